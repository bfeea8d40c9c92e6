"""Benchmark: `zb train` tokens/s against a minimal plain-PyTorch loop of the same model, same run.

    python scripts/bench_train_throughput.py [--model tiny] [--steps 30] [--repeats 3] [--json]

Both train one process on random tokens (zb: data.fake) with AdamW, grad clipping and the same
micro batch. Repeats are interleaved (plain, zb, zb, plain, ...) because the machine is shared and
noisy; the result is the ratio of median tokens/s. Target: zb within 10% of the plain loop.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch


def plain_loop(model_name: str, steps: int, micro_bs: int, seq: int, warmup: int) -> float:
    """tokens/s of the bare loop: forward, CE, backward, clip, AdamW; nothing else."""
    from zb.config import load_config
    from zb.models import Transformer, model_args
    from zb.models.loss import cross_entropy

    cfg = load_config([], {"model.name": model_name}, environ={})
    model = Transformer(model_args(cfg.model, vocab_size=259, max_seq_len=seq))
    model.init_weights(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), foreach=True)
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        tokens = torch.randint(0, 259, (micro_bs, seq + 1), generator=gen)
        loss, _ = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return micro_bs * seq / statistics.median(times[warmup:])


def zb_loop(model_name: str, steps: int, micro_bs: int, seq: int, warmup: int) -> float:
    """tokens/s reported by zb train's own step events (median after warm-up)."""
    from zb.config import load_config
    from zb.metrics import read_metrics
    from zb.train.run import run

    with tempfile.TemporaryDirectory() as logdir:
        cfg = load_config([], {"model.name": model_name, "data.fake": "true", "optim.total_steps": str(steps),
                               "optim.warmup_steps": "1", "optim.batch_size": str(micro_bs),
                               "train.micro_bs": str(micro_bs), "data.seq_length": str(seq),
                               "eval.interval": "-1", "log.dir": logdir, "log.progress": "plain", "train.log_interval": "1",
                               "train.device": "cpu"}, environ={})
        run(cfg)
        rates = [r["tokens_per_s"] for r in read_metrics(f"{logdir}/metrics.jsonl", "step")]
    return statistics.median(rates[warmup:])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--micro-bs", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="only the JSON line on stdout")
    args = parser.parse_args(argv)
    from zb.log import setup_logging

    setup_logging(-1)  # warnings only: the benchmark prints its own table
    plain, zb = [], []
    for i in range(args.repeats):
        # Alternate which goes first, so neither always inherits a warm (or fragmented) allocator.
        runs = [(plain, plain_loop), (zb, zb_loop)]
        for out, fn in (runs if i % 2 == 0 else runs[::-1]):
            out.append(fn(args.model, args.steps, args.micro_bs, args.seq, args.warmup))
    result = {"bench": "train_throughput", "model": args.model, "micro_bs": args.micro_bs, "seq": args.seq,
              "threads": torch.get_num_threads(), "plain_tokens_per_s": plain, "zb_tokens_per_s": zb,
              "ratio_median": statistics.median(zb) / statistics.median(plain)}
    if not args.json:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"zb train vs plain PyTorch loop ({args.model}, bs {args.micro_bs} x seq {args.seq})")
        for col in ("repeat", "plain tok/s", "zb tok/s", "zb / plain"):
            table.add_column(col, justify="right")
        for i, (p, z) in enumerate(zip(plain, zb)):
            table.add_row(str(i + 1), f"{p:,.0f}", f"{z:,.0f}", f"{z / p:.3f}")
        table.add_row("median", f"{statistics.median(plain):,.0f}", f"{statistics.median(zb):,.0f}",
                      f"{result['ratio_median']:.3f}")
        Console(stderr=True).print(table)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
