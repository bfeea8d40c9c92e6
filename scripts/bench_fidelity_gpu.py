"""Fidelity at scale on one GPU: blocking DiLoCo against the naive delay, eager, streaming and int4/int2 with
error feedback, at equal tokens, on real English text.

The single-process simulation of M nodes (tests/drivers/diloco_reference.py: `run_rule`, the rules
written from their definitions, the same code the CPU sweep and the real-run tests use) on one device.
Every node is zb's model (bf16 autocast on CUDA, fp32 params), zb's inner AdamW, LR schedule and step
(zb.train.step.Trainer), and reads its own contiguous shard of the corpus that scripts/build_corpus.py
built; every variant trains on the same tokens in the same order from the same initial weights. A
compressed variant sends each outer step's pseudo-gradients through a model of zb's quantized ring
(zb.collectives.ring): chunk c is quantized by node c, re-quantized with each next node's values at every
hop, and fixed once by its owner, each node keeping its error-feedback residual across outer steps
(zb.collectives.twins, the definition the C++ kernels are tested against, run on the device).

After every outer step the outer params (the shared ones; under eager the mean of the nodes' private
ones; under streaming the fragments as they stand) are evaluated on held-out documents; at the end on
a larger held-out set. Writes fidelity.json (and fidelity.png where matplotlib is installed) under
--out after every variant, so a run cut short keeps what it finished; prints a table and one JSON line.

    python scripts/build_corpus.py --out data/english
    python scripts/bench_fidelity_gpu.py --corpus data/english --model 70M --budget-s 400 --out results
    python scripts/bench_fidelity_gpu.py --corpus data/english --model debug --steps 60 --h 10 \\
        --batch 4 --seq 64 --device cpu --out /tmp/fid     # the same code path on a CPU, in a minute

--budget-s sizes the run: the script times a few steps of one node, then gives every variant the same
number of inner steps (a multiple of H) so that all of them fit. --smoke runs every variant for one
round first and stops at the first error, before the budget is spent.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from zb.collectives import twins  # noqa: E402
from zb.collectives.kernels import SCHEMES, num_blocks  # noqa: E402
from zb.collectives.pieces import split_blocks  # noqa: E402
from zb.config import load_config  # noqa: E402
from zb.local_world import LocalWorld  # noqa: E402
from zb.train.device import pick_placement  # noqa: E402
from zb.train.lr_schedule import build_optimizer, build_scheduler  # noqa: E402
from zb.train.setup import build_model  # noqa: E402
from zb.train.step import Trainer  # noqa: E402


def _reference():
    spec = importlib.util.spec_from_file_location("diloco_reference", REPO / "tests" / "drivers" / "diloco_reference.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REF = _reference()


@dataclass(frozen=True)
class Variant:
    """One arm of the study: a rule, its outer setting and how the outer step's mean travels."""

    name: str
    rule: str                  # none (blocking) | delayed | eager | streaming, as in the reference
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    compression: str = "none"  # none | int8 | int4 | int2 (error feedback on)
    streaming: tuple[int, int, float] = (3, 1, 0.5)   # fragments, fragment_delay, fragment_alpha


VARIANTS = {v.name: v for v in [
    Variant("blocking", "none"),
    Variant("delayed", "delayed"),
    Variant("eager", "eager"),
    Variant("int4", "none", compression="int4"),
    Variant("int2", "none", compression="int2"),
    Variant("streaming", "streaming"),
    # the CPU sweep's best setting for eager (BENCHMARKS.md, "Eager across the regime"), and the same
    # setting for blocking and the delay, so the comparison is best against best
    Variant("eager-m0", "eager", outer_momentum=0.0),
    Variant("delayed-m0", "delayed", outer_momentum=0.0),
    Variant("blocking-m0", "none", outer_momentum=0.0),
]}


class Tokens:
    """Node m's contiguous shard of the train tokens, read in order in windows of seq + 1 (wrapping)."""

    def __init__(self, ids: torch.Tensor, nodes: int, batch: int, seq: int):
        self.batch, self.seq = batch, seq
        per = ids.numel() // nodes
        self.shards = [ids[m * per:(m + 1) * per] for m in range(nodes)]
        self.windows = per // (seq + 1)
        if self.windows < batch:
            raise SystemExit(f"the corpus is too small: {per} tokens a node hold {self.windows} windows of "
                             f"{seq + 1}, fewer than --batch {batch}")
        self.cursor = [0] * nodes

    def reset(self) -> None:
        self.cursor = [0] * len(self.shards)

    def next(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [(self.cursor[m] + i) % self.windows for i in range(self.batch)]
        self.cursor[m] += self.batch
        start = torch.tensor(rows, device=self.shards[m].device) * (self.seq + 1)
        idx = start[:, None] + torch.arange(self.seq + 1, device=start.device)[None, :]
        w = self.shards[m][idx].long()
        return w[:, :-1], w[:, 1:]


@dataclass
class Node:
    """One simulated node: zb's model, inner AdamW, schedule and step on its own data shard."""

    model: torch.nn.Module
    m: int
    data: Tokens
    placement: object
    cfg: object
    losses: list[float] = field(default_factory=list)
    trainer: Trainer | None = None

    def fresh(self, start: torch.Tensor) -> None:
        self.load(start)
        opt = build_optimizer(self.model, self.cfg.optim)
        self.trainer = Trainer(self.model, opt, build_scheduler(opt, self.cfg.optim), self.placement,
                               self.cfg.optim.grad_clip, 0.0)
        self.losses = []

    def flat(self) -> torch.Tensor:
        return REF.flat_params(self.model)

    def load(self, flat: torch.Tensor) -> None:
        REF.load_params(self.model, flat)

    def train(self, steps: int) -> None:
        assert self.trainer is not None
        for _ in range(steps):
            self.losses.append(self.trainer.train_step([self.data.next(self.m)]).loss)


class Ring:
    """A model of zb's quantized ring all-reduce (AVG) over the nodes' pseudo-gradients, with each
    node's error-feedback residual kept across calls (zb.collectives.ring's numbered steps)."""

    def __init__(self, scheme_name: str, nodes: int, numel: int, device: torch.device):
        self.scheme = SCHEMES[scheme_name]
        self.residuals = [torch.zeros(numel, device=device) for _ in range(nodes)]
        bounds = split_blocks(num_blocks(numel, self.scheme.block), nodes)
        self.chunks = [(min(a * self.scheme.block, numel), min(b * self.scheme.block, numel))
                       for a, b in zip(bounds, bounds[1:])]

    def _buffers(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.empty(twins.code_bytes(n, self.scheme), dtype=torch.uint8, device=device),
                torch.empty(num_blocks(n, self.scheme.block), dtype=torch.float32, device=device))

    def __call__(self, deltas: list[torch.Tensor]) -> torch.Tensor:
        world, out = len(deltas), torch.empty_like(deltas[0])
        for c, (a, b) in enumerate(self.chunks):
            if a == b:
                continue
            codes, scales = self._buffers(b - a, out.device)
            twins.quantize(deltas[c][a:b].contiguous(), codes, scales, self.scheme, self.residuals[c][a:b])
            for hop in range(1, world):
                r, owner = (c + hop) % world, hop == world - 1
                out_codes, out_scales = self._buffers(b - a, out.device)
                twins.reduce_quantize(codes, scales, deltas[r][a:b].clone(), out_codes, out_scales, self.scheme,
                                      float(world) if owner else 1.0, owner, self.residuals[r][a:b])
                codes, scales = out_codes, out_scales
            twins.dequantize(codes, scales, out[a:b], self.scheme)
        return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", type=Path, required=True, help="Folder scripts/build_corpus.py wrote (tokens.npz).")
    p.add_argument("--out", type=Path, required=True, help="Folder for fidelity.json and fidelity.png.")
    p.add_argument("--model", default="70M", help="model.name (llama2 sizes).")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"Comma-separated, in order: {', '.join(VARIANTS)}.")
    p.add_argument("--nodes", type=int, default=4, help="M: simulated DiLoCo nodes.")
    p.add_argument("--h", type=int, default=30, help="H: inner steps per outer step.")
    p.add_argument("--batch", type=int, default=16, help="Sequences per node step.")
    p.add_argument("--seq", type=int, default=512, help="Tokens per sequence.")
    p.add_argument("--lr", type=float, default=1e-3, help="Peak inner AdamW learning rate.")
    p.add_argument("--warmup", type=int, default=100, help="Inner warmup steps.")
    p.add_argument("--steps", type=int, default=0, help="Inner steps per node (0: as many as --budget-s allows).")
    p.add_argument("--budget-s", type=float, default=400.0, help="Seconds all variants may take together.")
    p.add_argument("--eval-windows", type=int, default=32, help="Held-out sequences evaluated after every outer step.")
    p.add_argument("--final-eval-windows", type=int, default=256, help="Held-out sequences of the final evaluation.")
    p.add_argument("--device", default="auto", help="train.device: auto, cuda or cpu.")
    p.add_argument("--seed", type=int, default=1, help="train.seed (initial weights).")
    p.add_argument("--smoke", action="store_true", help="First run every variant for one round; stop at an error.")
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if bad := [v for v in args.variants if v not in VARIANTS]:
        p.error(f"--variants: unknown {', '.join(bad)} (choose from {', '.join(VARIANTS)})")
    if min(args.nodes, args.h, args.batch, args.seq, args.eval_windows, args.final_eval_windows) < 1:
        p.error("--nodes, --h, --batch, --seq and the eval windows must be positive")
    if args.steps and args.steps % args.h:
        p.error(f"--steps {args.steps} must be a multiple of --h {args.h}")
    for name in args.variants:
        f, tau, _ = VARIANTS[name].streaming
        if VARIANTS[name].rule == "streaming" and (args.h % f or tau >= args.h // f):
            p.error(f"--h {args.h}: variant {name} needs H divisible by {f} fragments and above {f * (tau + 1) - 1}")
    if not (args.corpus / "tokens.npz").is_file():
        p.error(f"--corpus {args.corpus}: no tokens.npz there; build it with scripts/build_corpus.py --out {args.corpus}")
    return args


def config(args: argparse.Namespace, variant: Variant, steps: int):
    f, tau, alpha = variant.streaming
    flags = {"model.name": args.model, "optim.total_steps": str(max(steps, 1)), "optim.lr": str(args.lr),
             "optim.warmup_steps": str(min(args.warmup, max(steps // 10, 1))), "optim.batch_size": str(args.batch),
             "train.micro_bs": str(args.batch), "data.seq_length": str(args.seq), "train.device": args.device,
             "train.seed": str(args.seed), "diloco.inner_steps": str(args.h), "diloco.outer_lr": str(variant.outer_lr),
             "diloco.outer_momentum": str(variant.outer_momentum)}
    if variant.rule != "none":
        flags["diloco.overlap"] = variant.rule
    if variant.rule == "streaming":
        flags.update({"diloco.fragments": str(f), "diloco.fragment_delay": str(tau), "diloco.fragment_alpha": str(alpha)})
    return load_config([], flags, environ={})


class Evaluator:
    """Held-out loss of a flat param vector, on a model of its own."""

    def __init__(self, model: torch.nn.Module, placement, held_out: torch.Tensor, seq: int, batch: int):
        self.model, self.trainer = model, Trainer(model, None, None, placement, 0.0, 0.0)   # type: ignore[arg-type]
        windows = held_out.numel() // (seq + 1)
        self.windows = held_out[:windows * (seq + 1)].view(windows, seq + 1).long()
        self.batch = batch

    @torch.no_grad()
    def __call__(self, flat: torch.Tensor, windows: int) -> float:
        REF.load_params(self.model, flat)
        rows = self.windows[:windows]
        batches = [(rows[i:i + self.batch, :-1], rows[i:i + self.batch, 1:]) for i in range(0, rows.shape[0], self.batch)]
        return self.trainer.evaluate(batches, len(batches))


def run_variant(args: argparse.Namespace, variant: Variant, steps: int, nodes: list[Node], start: torch.Tensor,
                data: Tokens, evaluate: Evaluator) -> dict:
    cfg = config(args, variant, steps)
    data.reset()
    for n in nodes:
        n.cfg = cfg
        n.fresh(start)
    average = Ring(variant.compression, len(nodes), start.numel(), start.device) \
        if variant.compression != "none" else REF.mean_of
    curve: list[list[float]] = []

    def on_round(r: int, params: torch.Tensor) -> None:
        curve.append([(r + 1) * args.h, round(evaluate(params, args.eval_windows), 4)])

    sync(start.device)
    t0 = time.perf_counter()
    final = REF.run_rule(nodes, variant.rule, cfg.diloco, steps, average=average, on_round=on_round)
    sync(start.device)
    seconds = time.perf_counter() - t0
    train = [sum(n.losses[i] for n in nodes) / len(nodes) for i in range(steps)]
    return {"variant": variant.name, "rule": variant.rule, "outer_lr": variant.outer_lr,
            "outer_momentum": variant.outer_momentum, "compression": variant.compression,
            "streaming": list(variant.streaming) if variant.rule == "streaming" else None,
            "steps": steps, "tokens": steps * len(nodes) * args.batch * args.seq, "seconds": round(seconds, 1),
            "epochs": round(steps * args.batch / data.windows, 3),
            "final_eval": round(evaluate(final, args.final_eval_windows), 4),
            "train_tail": round(sum(train[-args.h:]) / min(args.h, len(train)), 4),
            "eval_curve": curve, "train_loss": [round(x, 4) for x in train]}


def calibrate(args: argparse.Namespace, nodes: list[Node], start: torch.Tensor, data: Tokens,
              evaluate: Evaluator) -> dict:
    """Seconds per node step, per evaluation and per compressed outer step, measured on this device."""
    cfg = config(args, VARIANTS["blocking"], 1000)
    node = nodes[0]
    node.cfg = cfg
    node.fresh(start)
    node.train(3)                      # warm-up: allocator, kernels' first launch
    sync(start.device)
    t0 = time.perf_counter()
    node.train(10)
    sync(start.device)
    step_s = (time.perf_counter() - t0) / 10
    t0 = time.perf_counter()
    evaluate(start, args.eval_windows)
    sync(start.device)
    eval_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    Ring("int2", len(nodes), start.numel(), start.device)([start.clone() for _ in nodes])
    sync(start.device)
    ring_s = time.perf_counter() - t0
    data.reset()
    return {"step_s": step_s, "eval_s": eval_s, "ring_s": ring_s}


def steps_for(args: argparse.Namespace, times: dict, variants: list[Variant]) -> int:
    """The most inner steps (a multiple of H) every variant can take within --budget-s."""
    per_round = [args.h * args.nodes * times["step_s"] * 1.05 + times["eval_s"] + args.nodes * 0.01
                 + (times["ring_s"] if v.compression != "none" else 0.0) for v in variants]
    rounds = int(args.budget_s / sum(per_round))
    return max(rounds, 1) * args.h


def write(args: argparse.Namespace, doc: dict) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fidelity.json").write_text(json.dumps(doc))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for r in doc["results"]:
        xs, ys = zip(*r["eval_curve"]) if r["eval_curve"] else ((), ())
        ax1.plot([x * doc["tokens_per_step"] / 1e6 for x in xs], ys, label=r["variant"])
        train = r["train_loss"]
        k = max(1, len(train) // 200)
        smooth = [sum(train[i:i + k]) / len(train[i:i + k]) for i in range(0, len(train), k)]
        ax2.plot([i * doc["tokens_per_step"] / 1e6 for i in range(0, len(train), k)], smooth, label=r["variant"])
    for ax, what in ((ax1, "held-out loss of the outer params"), (ax2, "train loss, mean of the nodes")):
        ax.set_xlabel("tokens (millions, all nodes)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    lows = [min(y for _, y in r["eval_curve"]) for r in doc["results"] if r["eval_curve"]]
    if lows:
        ax1.set_ylim(min(lows) - 0.05, min(lows) + 1.5)
    fig.suptitle(f"{doc['model']} ({doc['params'] / 1e6:.1f}M params), {doc['nodes']} nodes, H = {doc['h']}, "
                 f"{doc['device_name']}")
    fig.tight_layout()
    fig.savefig(args.out / "fidelity.png", dpi=110)
    plt.close(fig)


def table(doc: dict) -> None:
    base = {r["variant"]: r["final_eval"] for r in doc["results"]}
    print(f"{'variant':>12} {'rule':>9} {'lr':>4} {'mom':>4} {'bits':>5} {'steps':>6} {'Mtokens':>8} "
          f"{'held-out':>9} {'vs blocking':>11} {'train tail':>10} {'s':>6}")
    for r in doc["results"]:
        ref = base.get("blocking-m0" if r["outer_momentum"] == 0 and "blocking-m0" in base else "blocking")
        vs = f"{100 * (r['final_eval'] / ref - 1):+.2f}%" if ref else "n/a"
        print(f"{r['variant']:>12} {r['rule']:>9} {r['outer_lr']:>4} {r['outer_momentum']:>4} {r['compression']:>5} "
              f"{r['steps']:>6} {r['tokens'] / 1e6:>8.1f} {r['final_eval']:>9.4f} {vs:>11} {r['train_tail']:>10.4f} "
              f"{r['seconds']:>6.0f}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    tokens = np.load(args.corpus / "tokens.npz")
    train_ids, held_out = tokens["train"], tokens["eval"]
    vocab = int(tokens["vocab"][0])
    torch.manual_seed(args.seed)
    base_cfg = config(args, VARIANTS["blocking"], 1000)
    placement = pick_placement(base_cfg.train, LocalWorld(0, 1))
    device = placement.device
    data = Tokens(torch.from_numpy(train_ids.astype(np.int32)).to(device), args.nodes, args.batch, args.seq)
    models = [build_model(base_cfg, vocab, placement) for _ in range(args.nodes + 1)]
    nodes = [Node(models[m], m, data, placement, base_cfg) for m in range(args.nodes)]
    evaluate = Evaluator(models[-1], placement, torch.from_numpy(held_out.astype(np.int32)).to(device), args.seq,
                         args.batch)
    if evaluate.windows.shape[0] < args.final_eval_windows:
        raise SystemExit(f"the held-out split holds {evaluate.windows.shape[0]} windows of {args.seq + 1} tokens, "
                         f"fewer than --final-eval-windows {args.final_eval_windows}")
    start = nodes[0].flat()
    params = start.numel()
    variants = [VARIANTS[v] for v in args.variants]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}: {args.model}, {params / 1e6:.1f}M params, vocab {vocab}, {data.windows * (args.seq + 1) / 1e6:.1f}M "
          f"train tokens a node, {evaluate.windows.shape[0]} held-out windows", flush=True)
    if args.smoke:
        for v in variants:
            run_variant(args, v, args.h, nodes, start, data, evaluate)
            print(f"smoke: {v.name} ran one round", flush=True)
    times = calibrate(args, nodes, start, data, evaluate)
    steps = args.steps or steps_for(args, times, variants)
    print(f"{times['step_s'] * 1000:.1f} ms a node step, {times['eval_s']:.2f} s an evaluation, {times['ring_s']:.2f} s "
          f"a compressed outer step: {steps} inner steps a node for each of {len(variants)} variants", flush=True)
    doc: dict = {"bench": "fidelity_gpu", "device_name": name, "model": args.model, "params": params, "vocab": vocab,
                 "nodes": args.nodes, "h": args.h, "batch": args.batch, "seq": args.seq, "lr": args.lr,
                 "warmup": args.warmup, "seed": args.seed, "steps": steps,
                 "tokens_per_step": args.nodes * args.batch * args.seq, "timing": times,
                 "eval_windows": args.eval_windows, "final_eval_windows": args.final_eval_windows,
                 "corpus": json.loads((args.corpus / "corpus.json").read_text()) if (args.corpus / "corpus.json").is_file() else None,
                 "argv": sys.argv[1:], "results": []}
    for v in variants:
        doc["results"].append(run_variant(args, v, steps, nodes, start, data, evaluate))
        r = doc["results"][-1]
        print(f"{v.name}: held-out {r['final_eval']:.4f} after {r['tokens'] / 1e6:.1f}M tokens in {r['seconds']:.0f} s",
              flush=True)
        write(args, doc)
    table(doc)
    print(json.dumps({k: v for k, v in doc.items() if k != "results"} |
                     {"results": [{k: v for k, v in r.items() if k not in ("train_loss", "eval_curve")}
                                  for r in doc["results"]]}))
    return doc


if __name__ == "__main__":
    main()
