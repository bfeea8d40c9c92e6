"""Which exchange shape for diloco.compression = sparse: the paper's all-gather, or a ring that re-selects?

Issue 41 asks how the sparse exchange's traffic grows with the node count, and whether a shape whose
per-node traffic does not grow serves better. The shapes, each modelled with the kernels' twins
(zb.collectives.sparse_twins) inside the single-process DiLoCo simulation (tests/drivers/diloco_reference.py:
zb's model, data and inner optimizer, one process):

  gather  SparseLoCo as published (arXiv 2508.15706): every node sends its own top-k payload to every node; the
          average is the mean of the W payloads (up to W x k entries a chunk). A node sends (W - 1) payloads.
  ring    the quantized ring's shape with the sparse codec: each region of the vector travels the ring, and every
          hop adds its own accumulator to the partial sum it received and sends the top-k of that sum on, keeping
          what it dropped in its residual (so across rounds nothing is lost); the last hop's payload is the
          region's sum. A node sends 2 (W - 1) / W payloads, flat in W.

  union   indices every node agrees on (Union below): each node nominates the top k / W of its accumulator in
          each chunk, and every node sends its values at the union of the nominations, averaged over all W
          nodes; int8 values (`union-exact`: fp32). A node sends about k x (12 / W x (W - 1) + 2 x 8) bits a
          chunk, flat in W.

  shared  random indices every node agrees on (Shared below): at each sync `--shared-k` positions of every chunk
          drawn from a generator every node seeds alike (no index travels), every node's values there at int2
          (the quantized ring's codes), averaged over all W nodes. A node sends
          2 (W - 1) / W of chunks x shared-k values at 2 bits: flat in W.

`senders` is the gather averaged per entry over the nodes that sent it, not over all W (Senders below).
`exact` is the gather with the picked values sent as fp32 (no 2-bit codes): what the quantizer costs.
All against fp32 DiLoCo (the exact mean) at the same outer settings. The loss is the mean train loss of the
last 30 steps over the nodes; bytes are what one node sends per outer step (fp32: gloo's ring, 2 (W-1)/W x 4n).

    PYTHONPATH=$PWD python scripts/bench_sparse_shapes.py --seeds 1,2 --nodes 4

Prints a table and one JSON line (--json: only the JSON line).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from statistics import mean

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "drivers"))

from zb.collectives import sparse_twins as twin  # noqa: E402
from zb.collectives import twins  # noqa: E402
from zb.collectives.kernels import SCHEMES  # noqa: E402
from zb.collectives.sparse_twins import SparseScheme  # noqa: E402
from zb.config_schema import DilocoConfig  # noqa: E402

TAIL = 30
INT2 = SCHEMES["int2"]


class Gather:
    """The paper's average: each node's payload from its own accumulator, the mean of the W decoded payloads."""

    def __init__(self, scheme: SparseScheme, beta: float) -> None:
        self.scheme, self.beta = scheme, beta
        self.residuals: list[torch.Tensor] = []

    def _start(self, deltas: list[torch.Tensor]) -> int:
        """Every node's accumulator starts at zero; returns the values per node."""
        n = deltas[0].numel()
        if not self.residuals:
            self.residuals = [torch.zeros(n) for _ in deltas]
        return n

    def _decoded(self, deltas: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each node's payload from its accumulator (updated as the node does), decoded."""
        n = self._start(deltas)
        out = []
        for d, e in zip(deltas, self.residuals):
            p = torch.empty(self.scheme.payload_bytes(n), dtype=torch.uint8)
            twin.compress(d.float(), p, self.scheme, e, self.beta)
            mine = torch.zeros(n)
            assert twin.decode_add(p, mine, self.scheme)
            out.append(mine)
        return out

    def __call__(self, deltas: list[torch.Tensor]) -> torch.Tensor:
        payloads = self._decoded(deltas)
        return sum(payloads, torch.zeros_like(payloads[0])) / len(deltas)   # in node order, as decode_add sums

    def bytes_per_node(self, n: int, w: int) -> int:
        return (w - 1) * self.scheme.payload_bytes(n)


class Senders(Gather):
    """The gather averaged per entry over the nodes that sent it (at least one), not over all W: an entry only one
    node picked moves by that node's value, not by a W-th of it (what the outer lr makes up for in the gather)."""

    def __call__(self, deltas: list[torch.Tensor]) -> torch.Tensor:
        payloads = self._decoded(deltas)
        senders = sum(((p != 0).float() for p in payloads), torch.zeros_like(payloads[0]))
        return sum(payloads, torch.zeros_like(payloads[0])) / senders.clamp(min=1)


class Exact(Gather):
    """The gather with the picked entries sent exactly (fp32 values, no 2-bit codes): what the quantizer costs."""

    def __call__(self, deltas: list[torch.Tensor]) -> torch.Tensor:
        n = self._start(deltas)
        total = torch.zeros(n)
        for d, e in zip(deltas, self.residuals):
            acc = self.beta * e + d.float()
            p = torch.empty(self.scheme.payload_bytes(n), dtype=torch.uint8)
            twin.compress(acc, p, self.scheme)
            picked = torch.zeros(n)
            assert twin.decode_add(p, picked, self.scheme)
            mask = picked != 0
            total[mask] += acc[mask]
            e.copy_(torch.where(mask, torch.zeros_like(acc), acc))
        return total / len(deltas)

    def bytes_per_node(self, n: int, w: int) -> int:
        return (w - 1) * self.scheme.chunks(n) * (self.scheme.index_bytes() + 4 * self.scheme.k)


class Ring(Gather):
    """Region c of W starts at node c; each hop compresses (its accumulator + the partial sum it received)."""

    def __call__(self, deltas: list[torch.Tensor]) -> torch.Tensor:
        n, w, chunk = self._start(deltas), len(deltas), self.scheme.chunk
        chunks = -(-n // chunk)
        bounds = [min(n, chunk * (chunks * i // w)) for i in range(w + 1)]
        out = torch.zeros(n)
        for c in range(w):
            a, b = bounds[c], bounds[c + 1]
            if b <= a:
                continue
            partial = torch.zeros(b - a)
            for hop in range(w):
                r = (c + hop) % w
                p = torch.empty(self.scheme.payload_bytes(b - a), dtype=torch.uint8)
                twin.compress(deltas[r][a:b].float() + partial, p, self.scheme, self.residuals[r][a:b], self.beta)
                partial = torch.zeros(b - a)
                assert twin.decode_add(p, partial, self.scheme)
            out[a:b] = partial
        return out / w

    def bytes_per_node(self, n: int, w: int) -> int:
        return 2 * (w - 1) * self.scheme.payload_bytes(n) // w


class Union(Gather):
    """Indices every node agrees on: each node nominates the top k / W of its own accumulator in each chunk, the
    union of the W nominations (at most k a chunk) is what every node sends, and those values are averaged over
    all W nodes (a ring all-reduce of at most k values a chunk), each node keeping in its accumulator what it did
    not send. A node sends W - 1 nominations of k / W indices (an all-gather) and 2 (W - 1) / W of k values:
    flat in W. `bits`: the values' width on the wire (8: int8 with a per-chunk absmax scale, each node quantizing
    its own values; 32: exact). Modelled per node: the product's quantized ring re-quantizes partial sums at every
    hop, which this leaves out."""

    def __init__(self, scheme: SparseScheme, beta: float, bits: int) -> None:
        super().__init__(scheme, beta)
        self.bits = bits

    def _nominees(self, w: int) -> int:
        return max(1, self.scheme.k // w)

    def __call__(self, deltas: list[torch.Tensor]) -> torch.Tensor:
        n, w, chunk = self._start(deltas), len(deltas), self.scheme.chunk
        chunks = -(-n // chunk)
        accs = []
        mask = torch.zeros(chunks, chunk, dtype=torch.bool)
        for d, e in zip(deltas, self.residuals):
            acc = torch.zeros(chunks * chunk)
            acc[:n] = self.beta * e + d.float()
            acc = acc.view(chunks, chunk)
            mask.scatter_(1, acc.abs().topk(self._nominees(w), dim=1).indices, True)
            accs.append(acc)
        total = torch.zeros(chunks, chunk)
        for acc, e in zip(accs, self.residuals):
            sent = torch.where(mask, acc, torch.zeros_like(acc))
            if self.bits < 32:
                top = 2 ** (self.bits - 1) - 1
                scale = sent.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / top
                sent = torch.round(sent / scale).clamp(-top, top) * scale
            total += sent
            e.copy_((acc - sent).view(-1)[:n])
        return total.view(-1)[:n] / w

    def bytes_per_node(self, n: int, w: int) -> int:
        chunks = self.scheme.chunks(n)
        nominations = (w - 1) * chunks * -(-self._nominees(w) * self.scheme.index_bits // 8)
        values = 2 * (w - 1) * chunks * (self.scheme.k * self.bits // 8 + 4) // w
        return nominations + values


class Shared(Gather):
    """Random indices every node agrees on: at sync t, `per_chunk` positions of each chunk drawn from a generator
    seeded by t (so no index travels), every node sends its accumulator's values there through the quantized
    ring's int2 codes, and those are averaged over all W nodes, each node keeping in its accumulator what it did
    not send (including what its codes dropped). A node sends 2 (W - 1) / W of the masked values at 2 bits plus a
    scale a block: flat in W. Modelled per node: the product's ring re-quantizes
    partial sums at every hop, which this leaves out."""

    def __init__(self, scheme: SparseScheme, beta: float, per_chunk: int) -> None:
        super().__init__(scheme, beta)
        self.per_chunk, self.sync = per_chunk, 0

    def __call__(self, deltas: list[torch.Tensor]) -> torch.Tensor:
        n, w, chunk = self._start(deltas), len(deltas), self.scheme.chunk
        chunks = -(-n // chunk)
        gen = torch.Generator().manual_seed(1_000_003 * self.sync + 17)
        self.sync += 1
        picks = torch.rand(chunks, chunk, generator=gen).topk(self.per_chunk, dim=1).indices
        flat = (picks + torch.arange(chunks)[:, None] * chunk).view(-1)
        flat = flat[flat < n].sort().values
        total = torch.zeros(n)
        for d, e in zip(deltas, self.residuals):
            acc = self.beta * e + d.float()
            vals = acc[flat]
            codes = torch.empty(twins.code_bytes(vals.numel(), INT2), dtype=torch.uint8)
            scales = torch.empty(-(-vals.numel() // INT2.block))
            twins.quantize(vals, codes, scales, INT2)
            sent = torch.empty_like(vals)
            twins.dequantize(codes, scales, sent, INT2)
            total[flat] += sent
            acc[flat] -= sent
            e.copy_(acc)
        return total / w

    def bytes_per_node(self, n: int, w: int) -> int:
        m = min(n, self.scheme.chunks(n) * self.per_chunk)
        wire = m * INT2.bits // 8 + 4 * -(-m // INT2.block)
        return 2 * (w - 1) * wire // w


def run(args: argparse.Namespace, shape: str, seed: int) -> dict:
    from diloco_reference import SimNode, mean_of, run_rule

    from zb.config import load_config
    from zb.data import build_tokenizer
    from zb.local_world import LocalWorld
    from zb.train.device import pick_placement

    lr, momentum = (args.outer_lr, args.outer_momentum) if shape == "fp32" else (args.sparse_lr, args.sparse_momentum)
    flags = {"model.name": args.model, "optim.total_steps": str(args.steps), "diloco.inner_steps": str(args.h),
             "optim.batch_size": str(args.batch), "train.micro_bs": str(args.batch), "data.seq_length": str(args.seq),
             "diloco.outer_lr": str(lr), "diloco.outer_momentum": str(momentum), "train.seed": str(seed),
             "train.device": "cpu"}
    cfg = load_config([], flags, environ={})
    tokenizer = build_tokenizer(cfg.data.tokenizer, retries=0)
    placement = pick_placement(cfg.train, LocalWorld(0, 1))
    sims = [SimNode(cfg, tokenizer, placement, m, args.nodes) for m in range(args.nodes)]
    scheme = SparseScheme(args.chunk, args.k)
    average = {"fp32": mean_of, "gather": Gather(scheme, args.beta), "senders": Senders(scheme, args.beta),
               "ring": Ring(scheme, args.beta),
               "exact": Exact(scheme, args.beta), "union": Union(scheme, args.beta, 8),
               "union-exact": Union(scheme, args.beta, 32), "shared": Shared(scheme, args.beta, args.shared_k)}[shape]
    t0 = time.monotonic()
    run_rule(sims, "none", cfg.diloco, args.steps, average=average)
    n = sims[0].flat().numel()
    sent = 2 * (args.nodes - 1) * 4 * n // args.nodes if shape == "fp32" else average.bytes_per_node(n, args.nodes)
    return {"shape": shape, "seed": seed, "loss": mean(mean(s.losses[-TAIL:]) for s in sims), "bytes": sent,
            "params": n, "wall_s": round(time.monotonic() - t0, 1)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="fp32,gather,ring")
    p.add_argument("--seeds", default="1,2")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--h", type=int, default=10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--model", default="debug")
    p.add_argument("--outer-lr", type=float, default=1.0, help="fp32's outer lr (the convergence benchmark's best).")
    p.add_argument("--outer-momentum", type=float, default=0.0, help="fp32's outer momentum.")
    p.add_argument("--sparse-lr", type=float, default=1.0, help="The sparse shapes' outer lr (no momentum).")
    p.add_argument("--sparse-momentum", type=float, default=0.0,
                   help="The sparse shapes' outer momentum (Nesterov; 0: SparseLoCo's outer step).")
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--beta", type=float, default=DilocoConfig().sparse_beta,
                   help="The accumulator's decay (default: zb's diloco.sparse_beta; runs before 2026-12-02 used 0.95).")
    p.add_argument("--shared-k", type=int, default=512, help="The shared shapes' random positions per chunk.")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    runs = [run(args, shape, int(seed)) for seed in args.seeds.split(",") for shape in args.shapes.split(",")]
    shapes = list(dict.fromkeys(r["shape"] for r in runs))
    base = mean(r["loss"] for r in runs if r["shape"] == "fp32") if "fp32" in shapes else None
    rows = []
    for shape in shapes:
        mine = [r for r in runs if r["shape"] == shape]
        loss = mean(r["loss"] for r in mine)
        rows.append({"shape": shape, "loss": loss, "per_seed": [r["loss"] for r in mine], "bytes": mine[0]["bytes"],
                     "vs_fp32": None if base is None else (loss / base - 1) * 100})
    fp32_bytes = 2 * (args.nodes - 1) * 4 * runs[0]["params"] // args.nodes
    doc = {"bench": "sparse_shapes", "config": {k: v for k, v in vars(args).items() if k != "json"}, "rows": rows,
           "runs": runs}
    if not args.json:
        print(f"{'shape':>8} {'loss':>8} {'vs fp32':>8} {'bytes/node/step':>16} {'x fewer':>8}  per seed", file=sys.stderr)
        for r in rows:
            vs = "" if r["vs_fp32"] is None else f"{r['vs_fp32']:+.2f}%"
            print(f"{r['shape']:>8} {r['loss']:8.4f} {vs:>8} {r['bytes']:16,} {fp32_bytes / r['bytes']:8.1f}  "
                  + " ".join(f"{x:.4f}" for x in r["per_seed"]), file=sys.stderr)
    print(json.dumps(doc))
    return doc


if __name__ == "__main__":
    main()
