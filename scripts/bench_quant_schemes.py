"""Compare int8 quantization schemes by error at equal wire bytes.

Schemes, each with the same metadata budget (4 bytes per 256 values, i.e. 1.0156 bytes/value,
and a second budget 4x smaller):
  prime   256-bin codebook over mean +- 3 std per chunk, tails clipped, each bin decoded as the
          mean of the values that fell in it (Prime's scheme); chunk = 65536 values (1 KB of
          codebook per chunk) or 262144
  absmax  blockwise symmetric: scale = max|x| / 127 per block of 256 (or 1024) values
  minmax  blockwise affine: 256 levels between min and max per block of 512 (or 2048) values
Data: Gaussian, Student-t (df=3), and real pseudo-gradients (theta_0 - theta_H of a small
byte-level transformer LM trained H steps with AdamW on this repository's source text).
Error: relative L2 ||q(x) - x|| / ||x|| after one quantization, and after a simulated 4-rank ring
(reduce-scatter re-quantizing partial sums, then the owner's final quantization).

Run: PYTHONPATH=. python scripts/bench_quant_schemes.py [--numel 2000000] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def prime(x: torch.Tensor, chunk: int) -> torch.Tensor:
    out = torch.empty_like(x)
    for c in range(0, x.numel(), chunk):
        t = x[c:c + chunk]
        centered = t - t.mean()
        std = centered.norm() / max(t.numel() - 1, 1) ** 0.5
        scale = 6 * std / 256 if std > 0 else torch.tensor(1.0)
        q = (centered / scale + 128).round().clamp(0, 255).long()
        sums = torch.zeros(256).index_add_(0, q, t)
        counts = torch.bincount(q, minlength=256).clamp(min=1)
        out[c:c + chunk] = (sums / counts)[q]
    return out


def _pad(x: torch.Tensor, block: int) -> torch.Tensor:
    pad = -x.numel() % block
    return torch.cat([x, x.new_zeros(pad)]).view(-1, block)


def absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    from zb.collectives import kernels

    scheme = kernels.Scheme("int8", 8, block)
    codes = torch.empty(x.numel(), dtype=torch.uint8)
    scales = torch.empty(kernels.num_blocks(x.numel(), block))
    out = torch.empty_like(x)
    kernels.quantize(x, codes, scales, scheme=scheme)
    kernels.dequantize(codes, scales, out, scheme=scheme)
    return out


def minmax(x: torch.Tensor, block: int) -> torch.Tensor:
    mat = _pad(x, block)
    lo, hi = mat.amin(1, keepdim=True), mat.amax(1, keepdim=True)
    scale = ((hi - lo) / 255).clamp(min=1e-30)
    q = ((mat - lo) / scale).round().clamp(0, 255)
    return (q * scale + lo).reshape(-1)[: x.numel()]


SCHEMES = {  # name -> (function, parameter at budget 1, at budget 1/4)
    "prime": (prime, 65536, 262144),
    "absmax": (absmax, 256, 1024),
    "minmax": (minmax, 512, 2048),
}


def ring_error(fn, param: int, parts: list[torch.Tensor]) -> float:
    """Relative error of a simulated ring: partial sums re-quantized at each hop, final quantized."""
    exact = torch.stack(parts).sum(0)
    acc = fn(parts[0], param)
    for p in parts[1:]:
        acc = fn(acc + p, param)
    return float((acc - exact).norm() / exact.norm())


def pseudo_gradient(numel: int, steps: int = 30) -> torch.Tensor:
    """theta_0 - theta_H of a small byte-level LM trained on this repository's source text."""
    torch.manual_seed(0)
    root = Path(__file__).resolve().parents[1]
    text = b"".join(p.read_bytes() for p in sorted(root.glob("zb/**/*.py")))
    data = torch.tensor(list(text), dtype=torch.long)
    d = 128
    layer = torch.nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(torch.nn.Embedding(256, d), torch.nn.TransformerEncoder(layer, 2),
                                torch.nn.Linear(d, 256))
    theta0 = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(64)
    for _ in range(steps):
        idx = torch.randint(0, data.numel() - 65, (16,))
        batch = torch.stack([data[i:i + 65] for i in idx])
        h = model[1](model[0](batch[:, :-1]), mask=mask, is_causal=True)
        loss = torch.nn.functional.cross_entropy(model[2](h).reshape(-1, 256), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    pg = theta0 - torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return pg[:numel].contiguous()


def datasets(numel: int) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    t3 = torch.distributions.StudentT(3.0)
    torch.manual_seed(2)
    pg = pseudo_gradient(numel)
    return {
        "gaussian": [torch.randn(numel, generator=g) for _ in range(4)],
        "student_t3": [t3.sample((numel,)) for _ in range(4)],
        # four "nodes": the same real pseudo-gradient with node-specific noise of its own scale
        "pseudo_grad": [pg + 0.5 * pg.std() * torch.randn(pg.numel(), generator=g) * (pg != 0) for _ in range(4)],
    }


def measure(numel: int) -> list[dict]:
    rows = []
    for data_name, parts in datasets(numel).items():
        x = parts[0]
        for name, (fn, p1, p4) in SCHEMES.items():
            for budget, param in (("1/64", p1), ("1/256", p4)):
                err = float((fn(x, param) - x).norm() / x.norm())
                rows.append({"data": data_name, "scheme": name, "param": param, "meta_bytes_per_value": budget,
                             "rel_error": err, "ring4_rel_error": ring_error(fn, param, parts)})
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=2_000_000)
    parser.add_argument("--json", action="store_true", help="only the JSON line on stdout")
    args = parser.parse_args(argv)
    rows = measure(args.numel)
    if not args.json:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="int8 schemes: relative L2 error at equal wire bytes")
        for col in ("data", "scheme", "block/chunk", "metadata B/value", "1 quantization", "4-rank ring"):
            table.add_column(col)
        for r in rows:
            table.add_row(r["data"], r["scheme"], str(r["param"]), r["meta_bytes_per_value"],
                          f"{r['rel_error']:.5f}", f"{r['ring4_rel_error']:.5f}")
        Console(stderr=True).print(table)
    doc = {"benchmark": "quant_schemes", "numel": args.numel, "rows": rows}
    sys.stdout.write(json.dumps(doc) + "\n")
    return doc


if __name__ == "__main__":
    main()
