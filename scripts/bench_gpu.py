"""Benchmark on one CUDA GPU: `zb train` against a plain PyTorch loop, and two DiLoCo nodes sharing the GPU.

    python scripts/bench_gpu.py throughput [--model 150M --model 1B] [--compile off --compile on]
    python scripts/bench_gpu.py diloco [--model 150M] [--outer-steps 4]
    python scripts/bench_gpu.py features [--model 150M] [--seq 512] [--only eager]
    python scripts/bench_gpu.py throughput --cpu --model debug --steps 6 --warmup 2   # checks the script only

throughput: for each model and torch.compile setting, one subprocess runs the plain loop and zb train
in turn (plain, zb, zb, plain, ...: neither always inherits a warm allocator), on the model's shipped
config (configs/<model>/normal.toml: its micro batch, sequence length and activation checkpointing),
one micro batch per optimizer step, random tokens and a 32,000-token vocabulary (the shipped
configs' tokenizer, which needs the hub: random tokens need none). The plain loop is what a user
writes by hand around the same model: bf16 autocast over fp32 params, the same per-block
activation checkpointing and per-block torch.compile, cross-entropy, backward, clipping, fused
AdamW, one loss read per step. zb's tokens/s is measured from outside its own accounting: the
wall-clock stamps of its step events over the timed steps (its own tokens_per_s is printed beside
it). MFU: zb's formula (zb.models.flops, the peak from zb.train.mfu) for both.

diloco: `zb store` and two `zb train` nodes of one local rank each on the same GPU, int8 outer steps;
every outer step's params hash must be equal on both nodes, and the outer step's seconds are split
into device-to-host (pseudo-gradients filled), all-reduce (inside the collective) and host-to-device
(outer params back into the model), from the outer_step events.

features: the same two nodes once per combination in FEATURES (int4 and int2 with error feedback, eager
and streaming overlap, streaming under a round budget, a run secret with clipping and eviction), each
one's params hashes compared per applied outer step; one JSON line per combination, then a table.

Each prints a table on stderr and one JSON line on stdout; exit 1 when a run fails.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _two_nodes import REPO, repo_env, run_two_nodes

sys.path.insert(0, str(REPO))

VOCAB = 32000


def _config_file(model: str) -> str:
    path = REPO / "configs" / model / "normal.toml"
    return str(path) if path.exists() else ""


def _shape(model: str, device: str) -> tuple[int, int, bool]:
    """(micro batch, sequence length, activation checkpointing) of the model's shipped config."""
    from zb.config import load_config

    files = [_config_file(model)] if _config_file(model) else []
    cfg = load_config(files, {"model.name": model, "train.device": device}, environ={})
    return cfg.train.micro_bs, cfg.data.seq_length, bool(cfg.train.ac_ckpt)


# -- throughput: one (model, compile) pair, run inside its own process ---------------------------------
def plain_loop(model_name: str, micro_bs: int, seq: int, ac: bool, compile_: bool, steps: int, warmup: int,
               device: str) -> dict:
    """The hand-written loop: seconds per step over the timed steps, measured with a host clock after a
    loss read (a host sync) per step, as a user logging the loss does."""
    import torch
    import torch.nn.functional as F

    from zb.config import load_config
    from zb.models import Transformer, model_args
    from zb.train.fsdp import apply_activation_checkpointing

    cfg = load_config([], {"model.name": model_name, "model.vocab_size": str(VOCAB)}, environ={})
    args = model_args(cfg.model, vocab_size=VOCAB, max_seq_len=seq)
    dev = torch.device(device)
    with dev:
        model = Transformer(args)
    model.init_weights(0)
    if ac:
        apply_activation_checkpointing(model)
    if compile_:
        for block in model.layers:
            block.compile()
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=0.1, betas=(0.9, 0.95), fused=cuda,
                            foreach=None if cuda else True)
    gen = torch.Generator(device=dev).manual_seed(0)
    batches = [torch.randint(0, VOCAB, (micro_bs, seq + 1), device=dev, generator=gen) for _ in range(4)]
    marks = []
    for i in range(steps):
        tokens = batches[i % len(batches)]
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=cuda):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        marks.append(time.perf_counter())
    del model, opt, batches
    if cuda:
        torch.cuda.empty_cache()
    return {"step_s": _step_times(marks, warmup), "peak_mem_gb": _peak_mem(dev)}


def zb_loop(model_name: str, micro_bs: int, seq: int, ac: bool, compile_: bool, steps: int, warmup: int,
            device: str) -> dict:
    """zb train in this process on the model's shipped config; seconds per step from its step events'
    wall-clock stamps, and its own tokens_per_s and mfu."""
    import torch

    from zb.config import load_config
    from zb.metrics import read_metrics
    from zb.train.run import run

    with tempfile.TemporaryDirectory() as logdir:
        # The config file's shape comes in through the arguments; its data source (a hub dataset) stays out.
        cfg = load_config([], {
            "model.name": model_name, "model.vocab_size": str(VOCAB), "data.fake": "true", "data.tokenizer": "bytes",
            "optim.batch_size": str(micro_bs), "train.micro_bs": str(micro_bs), "data.seq_length": str(seq),
            "train.ac_ckpt": str(ac).lower(), "train.torch_compile": str(compile_).lower(),
            "optim.total_steps": str(steps), "optim.warmup_steps": "1", "eval.interval": "-1",
            "log.dir": logdir, "log.progress": "plain", "train.log_interval": "1", "train.device": device,
            **({} if device == "cuda" else {"train.param_dtype": "fp32"})}, environ={})
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        run(cfg)
        events = read_metrics(f"{logdir}/metrics.jsonl", "step")
    marks = [e["time"] for e in events]
    own = [e["tokens_per_s"] for e in events[warmup:]]
    mfu = [e["mfu"] for e in events[warmup:] if e.get("mfu") is not None]
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"step_s": _step_times(marks, warmup), "own_tokens_per_s": statistics.median(own),
            "own_mfu": statistics.median(mfu) if mfu else None, "peak_mem_gb": _peak_mem(torch.device(device))}


def _step_times(marks: list[float], warmup: int) -> float:
    """Mean seconds per step from the end of step `warmup` to the end of the last step."""
    timed = marks[warmup - 1:]
    return (timed[-1] - timed[0]) / (len(timed) - 1)


def _peak_mem(dev) -> float | None:
    import torch

    return round(torch.cuda.max_memory_allocated(dev) / 1e9, 2) if dev.type == "cuda" else None


def one_pair(model: str, compile_: bool, steps: int, warmup: int, repeats: int, device: str) -> dict:
    """Runs inside a subprocess: interleaved repeats of the plain loop and zb train."""
    import torch

    from zb.config import load_config
    from zb.log import setup_logging
    from zb.models import model_args
    from zb.models.flops import flops_per_token
    from zb.train.mfu import mfu_percent, peak_flops

    setup_logging(-1)
    micro_bs, seq, ac = _shape(model, device)
    plain, zb, own, own_mfu, mem = [], [], [], [], {}
    for i in range(repeats):
        order = ("plain", "zb") if i % 2 == 0 else ("zb", "plain")
        for which in order:
            fn = plain_loop if which == "plain" else zb_loop
            r = fn(model, micro_bs, seq, ac, compile_, steps, warmup, device)
            (plain if which == "plain" else zb).append(micro_bs * seq / r["step_s"])
            mem[which] = r["peak_mem_gb"]
            if which == "zb":
                own.append(r["own_tokens_per_s"])
                own_mfu.append(r["own_mfu"])
    cfg = load_config([], {"model.name": model}, environ={})
    fpt = flops_per_token(model_args(cfg.model, vocab_size=VOCAB, max_seq_len=seq), seq)
    dev = torch.device(device)
    peak, _ = peak_flops(dev, None)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    p, z = statistics.median(plain), statistics.median(zb)
    return {"model": model, "compile": compile_, "micro_bs": micro_bs, "seq": seq, "ac_ckpt": ac, "device": name,
            "attn": _attn(), "plain_tokens_per_s": plain, "zb_tokens_per_s": zb, "zb_own_tokens_per_s": own,
            "ratio": z / p, "plain_mfu": mfu_percent(fpt, p, peak, 1), "zb_mfu": mfu_percent(fpt, z, peak, 1),
            "zb_own_mfu": statistics.median([m for m in own_mfu if m is not None]) if any(own_mfu) else None,
            "peak_mem_gb": mem, "steps": steps, "warmup": warmup, "repeats": repeats}


def _attn() -> str:
    from zb.models.llama import attention_impl

    return attention_impl("auto")


def throughput(args) -> list[dict]:
    rows, failed = [], False
    # Every model uncompiled first: the compiled runs take longest, and a time limit then cuts those.
    for comp in args.compile or ["off", "on"]:
        for model in args.model or ["150M", "1B"]:
            cmd = [sys.executable, __file__, "_pair", "--model", model, "--compile", comp, "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--repeats", str(args.repeats)] + (["--cpu"] if args.cpu else [])
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, env=repo_env(), cwd=REPO, timeout=args.timeout)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode != 0 or not lines:
                failed = True
                tail = "\n".join(proc.stderr.splitlines()[-15:])
                print(f"bench_gpu: {model} compile {comp}: exit {proc.returncode}\n{tail}", file=sys.stderr)
                rows.append({"model": model, "compile": comp == "on", "error": tail[-2000:]})
                continue
            row = json.loads(lines[-1])
            row["wall_s"] = round(time.perf_counter() - t0, 1)
            rows.append(row)
            print(json.dumps({"bench": "gpu_throughput_row", **row}), flush=True)
            print(f"bench_gpu: {model} compile {comp}: zb/plain {row['ratio']:.3f} ({row['wall_s']} s)",
                  file=sys.stderr, flush=True)
    _throughput_table(rows)
    print(json.dumps({"bench": "gpu_throughput", "rows": rows}), flush=True)
    return rows if not failed else rows + [{"failed": True}]


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _throughput_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="zb train vs a plain PyTorch loop, one GPU (median tok/s; spread min-max)")
    for col in ("model", "compile", "bs x seq", "plain tok/s", "zb tok/s", "zb/plain", "plain MFU %", "zb MFU %",
                "zb own tok/s"):
        table.add_column(col, justify="right")
    for r in rows:
        if "error" in r:
            table.add_row(r["model"], str(r["compile"]), "FAILED", *[""] * 6)
            continue

        def spread(xs):
            return f"{statistics.median(xs):,.0f} ({min(xs):,.0f}-{max(xs):,.0f})"

        table.add_row(r["model"], "on" if r["compile"] else "off", f"{r['micro_bs']} x {r['seq']}",
                      spread(r["plain_tokens_per_s"]), spread(r["zb_tokens_per_s"]), f"{r['ratio']:.3f}",
                      _fmt(r["plain_mfu"], ".1f"), _fmt(r["zb_mfu"], ".1f"),
                      f"{statistics.median(r['zb_own_tokens_per_s']):,.0f}")
    Console(stderr=True, width=160).print(table)


# -- diloco: two nodes sharing one GPU --------------------------------------------------------------------
# what `features` runs: (label, extra zb train flags, whether the store and nodes hold a run secret, total steps
# instead of inner x outer steps: a round budget ends rounds by the clock)
FEATURES = [
    ("int8", ["--diloco.compression", "int8"], False, None),
    ("int4 + error feedback", ["--diloco.compression", "int4"], False, None),
    ("int2 + eager overlap", ["--diloco.compression", "int2", "--diloco.overlap", "eager"], False, None),
    ("streaming, 4 fragments", ["--diloco.compression", "int8", "--diloco.overlap", "streaming", "--diloco.fragments",
                                "4", "--diloco.fragment_delay", "1"], False, None),
    ("streaming + round budget + int4", ["--diloco.compression", "int4", "--diloco.overlap", "streaming",
                                         "--diloco.fragments", "2", "--diloco.fragment_delay", "1",
                                         "--diloco.round_seconds", "6"], False, 400),
    ("run secret + clip + evict_clipped", ["--diloco.compression", "int8", "--diloco.clip", "--diloco.evict_clipped"],
     True, None),
]


def two_nodes(args, work: Path, label: str, extra: list[str], secret: bool = False,
              total_steps: int | None = None) -> dict:
    """`zb store` and two `zb train` nodes on one device with `extra` flags; the outer steps' params hashes
    compared (applied outer steps, by outer step) and their seconds split as in the module's docstring."""
    from zb.metrics import read_metrics

    work.mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.cpu else "cuda"
    micro_bs, seq = args.micro_bs, args.seq
    shared_env = {}
    if secret:
        from zb.secret import write_new_secret

        write_new_secret(work / "run.secret")
        shared_env["ZB_ELASTIC_SECRET_FILE"] = str(work / "run.secret")

    def args_of(i: int) -> list[str]:
        # debug/diloco.toml: DiLoCo on the built-in data; the model, shape and data are set here.
        return ["@configs/debug/diloco.toml", "--model.name", args.model[0], "--model.vocab_size", str(VOCAB),
                "--data.fake", "--data.tokenizer", "bytes", "--train.device", device, "--train.micro_bs", str(micro_bs),
                "--optim.batch_size", str(micro_bs), "--data.seq_length", str(seq), "--optim.warmup_steps", "2",
                "--diloco.inner_steps", str(args.inner_steps),
                "--optim.total_steps", str(total_steps or args.inner_steps * args.outer_steps), "--eval.interval", "-1",
                "--train.log_model_hash", "--log.progress", "plain", "--log.dir", str(work / f"node{i}"), *extra] + \
            (["--train.param_dtype", "fp32"] if args.cpu else [])

    t0 = time.perf_counter()
    failed = run_two_nodes(work, "node", args_of, args.timeout, shared_env=shared_env)
    files = [work / f"node{i}" / "metrics.jsonl" for i in range(2)]
    events = [read_metrics(f, "outer_step") if f.exists() else [] for f in files]
    hashes = [{e["outer_step"]: e.get("params_hash") for e in ev if e.get("applied", True)} for ev in events]
    if failed is None and (not hashes[0] or None in hashes[0].values() or hashes[0] != hashes[1]):
        failed = f"params hashes differ between the nodes or are missing: {hashes}"
    timed = [e for ev in events for e in ev[1:]] or [e for ev in events for e in ev]  # the first pays warm-up

    def med(key):
        vals = [e[key] for e in timed if e.get(key) is not None]
        return round(statistics.median(vals), 4) if vals else None

    losses = [e["loss"] for e in read_metrics(files[0], "step") if e.get("loss") is not None] if files[0].exists() else []
    return {"bench": "gpu_diloco", "label": label, "model": args.model[0], "device": _device_name(device),
            "extra": " ".join(extra), "secret": secret, "micro_bs": micro_bs, "seq": seq,
            "inner_steps": args.inner_steps, "outer_steps": len(hashes[0]), "hashes_equal": failed is None,
            "allreduce_s": med("allreduce_s"), "d2h_s": med("d2h_s"), "reduce_s": med("reduce_s"), "h2d_s": med("h2d_s"),
            "wire_bytes": med("wire_bytes"), "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None, "wall_s": round(time.perf_counter() - t0, 1), "error": failed}


def _work(args) -> Path:
    return Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="zb-bench-gpu-"))


def diloco(args) -> dict:
    result = two_nodes(args, _work(args), args.compression, ["--diloco.compression", args.compression])
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Two DiLoCo nodes sharing one GPU: {args.model[0]}, {args.compression}, median over "
                        f"outer steps 2 on (both nodes, the first step left out)")
    for col in ("sync (allreduce_s)", "device-to-host", "all-reduce", "host-to-device", "wire bytes", "hashes"):
        table.add_column(col, justify="right")
    table.add_row(*[_fmt(result[k], ".3f") + " s" for k in ("allreduce_s", "d2h_s", "reduce_s", "h2d_s")],
                  _fmt(result["wire_bytes"], ",.0f"), "equal" if result["error"] is None else "FAIL")
    Console(stderr=True, width=160).print(table)
    if result["error"]:
        print(f"bench_gpu: diloco: {result['error']}", file=sys.stderr)
    print(json.dumps(result), flush=True)
    return result


def features(args) -> list[dict]:
    """Every FEATURES row as a two-node run on one device; one JSON line per row as it ends, then a table."""
    from rich.console import Console
    from rich.table import Table

    work, rows = _work(args), []
    for n, (label, extra, secret, total) in enumerate(FEATURES):
        if args.only and not any(o in label for o in args.only):
            continue
        rows.append(two_nodes(args, work / f"f{n}", label, extra, secret, total))
        print(json.dumps(rows[-1]), flush=True)
        if rows[-1]["error"]:
            print(f"bench_gpu: features: {label}: {rows[-1]['error']}", file=sys.stderr)
    table = Table(title=f"Feature combinations, two DiLoCo nodes sharing one {_device_name('cpu' if args.cpu else 'cuda')}"
                        f": {args.model[0]}, {args.micro_bs} x {args.seq}, {args.inner_steps} inner steps")
    for col in ("combination", "outer steps", "hashes", "sync s", "wire bytes", "loss first -> last", "wall s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["label"], str(r["outer_steps"]), "equal" if r["error"] is None else "FAIL",
                      _fmt(r["allreduce_s"], ".3f"), _fmt(r["wire_bytes"], ",.0f"),
                      f"{_fmt(r['first_loss'], '.3f')} -> {_fmt(r['last_loss'], '.3f')}", _fmt(r["wall_s"], ".0f"))
    Console(stderr=True, width=160).print(table)
    return rows


def _device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(0) if device == "cuda" else "cpu"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["throughput", "diloco", "features", "_pair"])
    parser.add_argument("--model", action="append", help="model.name (repeatable; throughput default: 150M and 1B, "
                                                         "diloco: 150M)")
    parser.add_argument("--compile", action="append", choices=["off", "on"], help="torch.compile (repeatable; "
                                                                                  "default: off and on)")
    parser.add_argument("--steps", type=int, default=10, help="steps per run (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the timing (default 3)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each loop, interleaved (default 2)")
    parser.add_argument("--outer-steps", type=int, default=4, help="diloco: outer steps (default 4)")
    parser.add_argument("--inner-steps", type=int, default=10, help="diloco: inner steps per outer step (default 10)")
    parser.add_argument("--micro-bs", type=int, default=8, help="diloco: micro batch = batch (default 8)")
    parser.add_argument("--seq", type=int, default=1024, help="diloco: sequence length (default 1024)")
    parser.add_argument("--compression", help="diloco: diloco.compression (default int8; features sets its own)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds allowed per subprocess (default 600)")
    parser.add_argument("--keep", metavar="DIR", help="diloco: keep logs and metrics here")
    parser.add_argument("--only", action="append", help="features: only the rows whose label holds this (repeatable)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU in fp32: checks this script only")
    args = parser.parse_args(argv)
    if args.compression and args.what == "features":
        parser.error("--compression has no effect on features: each combination sets its own (see --only)")
    args.compression = args.compression or "int8"
    if args.only and args.what != "features":
        parser.error("--only picks rows of `features`; it has no effect on " + args.what)
    labels = [f[0] for f in FEATURES]
    if args.only and not [label for label in labels if any(o in label for o in args.only)]:
        parser.error(f"--only {' '.join(args.only)} matches no combination; the combinations: {'; '.join(labels)}")
    if args.steps - args.warmup < 2 or args.warmup < 1:
        parser.error("--steps must exceed --warmup (at least 1) by 2 or more")
    device = "cpu" if args.cpu else "cuda"
    if not args.cpu:
        import torch

        if not torch.cuda.is_available():
            print("bench_gpu: no CUDA GPU is visible to torch; run on a GPU machine, or pass --cpu to check the "
                  "script", file=sys.stderr)
            return 2
    if args.what == "_pair":
        row = one_pair(args.model[0], args.compile[0] == "on", args.steps, args.warmup, args.repeats, device)
        print(json.dumps(row), flush=True)
        return 0
    if args.what in ("diloco", "features"):
        args.model = args.model or ["150M"]
        if args.what == "features":
            return 1 if any(r["error"] for r in features(args)) else 0
        return 1 if diloco(args)["error"] else 0
    rows = throughput(args)
    return 1 if any("failed" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
