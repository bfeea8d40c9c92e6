"""Eager and streaming against blocking DiLoCo across the regime, best against best, over seeds and model sizes.

Issue 24 asks whether the overlapped rules' loss gaps on the convergence benchmark are defects or
the regime. The rules themselves are held elsewhere (tests/test_node_inprocess.py: the closed forms,
M = 1, a single-process reference; real runs equal the simulation to 1e-5). Here every cell is the
single-process simulation of a rule (tests/drivers/diloco_reference.py, the same model, data and
inner optimizer as `zb train`; no pseudo-gradient compression), so a sweep of many settings fits on
a 2-core machine: the loss is the mean train loss of the last 30 steps over the nodes.

Every rule (blocking, eager, delayed: the naive one-round delay, and each streaming
fragments:tau:alpha) runs with every outer lr:momentum setting, on every model, H and seed. A cell is the mean over the seeds (each seed's
value kept: the spread); best against best takes, per (model, H, rule), the setting of lowest mean
loss and compares it with blocking's lowest, as a ratio of the means and per seed. With both eager and
delayed, `recovered` is the share of the delay's cost that eager wins back, best against best:
(delayed - eager) / (delayed - blocking), the eager paper's question (arXiv 2502.12996: almost all of it).

    PYTHONPATH=$PWD python scripts/bench_overlap_regime.py --models debug,debugmodel --seeds 1,2 --hs 10 \\
        --rules eager,streaming --streaming 2:1:0.5,5:1:0.5 --settings 1.0:0,0.7:0,0.5:0,0.7:0.9

Prints a table and one JSON line (--json: only the JSON line).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from statistics import mean

from zb.model_sizes import model_names
from zb.testing.cluster import REFERENCE
from zb.testing.procs import REPO, checkout_file, subprocess_env

TAIL = 30   # steps at the end whose train loss is averaged
RULES = ("eager", "streaming", "delayed")   # compared with blocking DiLoCo (rule none), which always runs


def _numbers(p: argparse.ArgumentParser, flag: str, text: str, kinds: tuple, sep: str = ":") -> list[tuple]:
    """'a:b,c:d' -> [(a, b), (c, d)] with each field converted by kinds; p.error on anything else."""
    out = []
    for item in (s.strip() for s in text.split(",")):
        fields = item.split(sep)
        try:
            if len(fields) != len(kinds):
                raise ValueError
            out.append(tuple(kind(f) for kind, f in zip(kinds, fields)))
        except ValueError:
            p.error(f"{flag}: {item!r} is not {sep.join(k.__name__ for k in kinds)}")
    return out


def _rule_settings(p: argparse.ArgumentParser, text: str) -> dict[str, list[tuple]]:
    """'blocking=1.0:0,eager=0.7:0;0.5:0' -> {rule: [(lr, momentum), ...]}; p.error on anything else."""
    out: dict[str, list[tuple]] = {}
    for item in (s.strip() for s in text.split(",") if s.strip()):
        rule, _, settings = item.partition("=")
        if rule.strip() not in ("blocking", *RULES) or not settings:
            p.error(f"--rule-settings: {item!r} is not RULE=lr:momentum (rules: blocking, {', '.join(RULES)})")
        out[rule.strip()] = _numbers(p, "--rule-settings", settings.replace(";", ","), (float, float))
    return out


def settings_of(args: argparse.Namespace, rule: str) -> list[tuple]:
    return args.rule_settings.get(rule, args.settings)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=4, help="M: simulated DiLoCo nodes.")
    p.add_argument("--steps", type=int, default=300, help="Inner steps (a multiple of every H).")
    p.add_argument("--hs", default="10", help="Comma-separated H values (diloco.inner_steps).")
    p.add_argument("--settings", default="1.0:0,0.7:0,0.5:0,0.7:0.9",
                   help="Comma-separated outer lr:momentum pairs (Nesterov when momentum > 0).")
    p.add_argument("--rule-settings", default="",
                   help="Per-rule outer settings instead of --settings, e.g. 'blocking=1.0:0,eager=0.7:0' "
                        "(several for one rule: 'eager=0.7:0;0.5:0'): for long runs, each rule at its best.")
    p.add_argument("--rules", default="eager",
                   help=f"Comma-separated rules compared with blocking DiLoCo: {', '.join(RULES)}.")
    p.add_argument("--streaming", default="2:1:0.5",
                   help="Comma-separated streaming settings fragments:tau:alpha (diloco.fragments, "
                        "diloco.fragment_delay, diloco.fragment_alpha), each crossed with --settings.")
    p.add_argument("--models", default="debug", help="Comma-separated model.name values.")
    p.add_argument("--batch", type=int, default=8, help="Per-node batch in sequences.")
    p.add_argument("--seq", type=int, default=128, help="data.seq_length.")
    p.add_argument("--seeds", default="1", help="Comma-separated train.seed values; cells are their means.")
    p.add_argument("--jobs", type=int, default=2, help="Simulations run at once (one thread each).")
    p.add_argument("--json", action="store_true", help="Only the JSON line on stdout.")
    args = p.parse_args(argv)
    args.hs = [h for (h,) in _numbers(p, "--hs", args.hs, (int,))]
    args.seeds = [s for (s,) in _numbers(p, "--seeds", args.seeds, (int,))]
    args.settings = _numbers(p, "--settings", args.settings, (float, float))
    args.rule_settings = _rule_settings(p, args.rule_settings)
    args.rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.streaming = _numbers(p, "--streaming", args.streaming, (int, int, float)) \
        if "streaming" in args.rules else []
    if any(h <= 0 for h in args.hs) or args.nodes < 1 or args.jobs < 1 or args.steps < 1:
        p.error("--hs, --nodes, --jobs and --steps must be positive")
    if any(args.steps % h for h in args.hs):
        p.error(f"--steps {args.steps} must be a multiple of every H ({','.join(map(str, args.hs))})")
    if args.steps < TAIL:
        p.error(f"--steps must be at least {TAIL} (the loss is the mean of the last {TAIL} steps)")
    if bad := [r for r in args.rules if r not in RULES]:
        p.error(f"--rules: unknown {', '.join(bad)} (choose from {', '.join(RULES)})")
    if bad := [m for m in args.models if m not in model_names("llama2")]:
        p.error(f"--models: no such size {', '.join(bad)} (valid: {', '.join(model_names('llama2'))})")
    if any(lr <= 0 or not 0 <= mom < 1 for lr, mom in [*args.settings, *sum(args.rule_settings.values(), [])]):
        p.error("--settings: the outer lr must be positive and the momentum in [0, 1)")
    for f, tau, alpha in args.streaming:
        if f < 1 or tau < 0 or not 0 <= alpha <= 1:
            p.error(f"--streaming {f}:{tau}:{alpha}: fragments >= 1, tau >= 0, alpha in [0, 1]")
        for h in args.hs:
            if h % f:
                p.error(f"--streaming {f}:{tau}:{alpha}: {f} fragments do not divide H = {h}")
            if tau >= h // f:
                p.error(f"--streaming {f}:{tau}:{alpha}: tau must be below H / fragments = {h // f} (H = {h})")
    return args


def variants(args: argparse.Namespace) -> list[tuple]:
    """(rule, fragments, tau, alpha) of every rule run: blocking first."""
    out = [("blocking", None, None, None)]
    if "eager" in args.rules:
        out.append(("eager", None, None, None))
    if "delayed" in args.rules:
        out.append(("delayed", None, None, None))
    out += [("streaming", f, tau, alpha) for f, tau, alpha in args.streaming]
    return out


def label(variant: tuple) -> str:
    rule, f, tau, alpha = variant
    return rule if f is None else f"{rule} {f}:{tau}:{alpha}"


def simulate(args: argparse.Namespace, model: str, h: int, variant: tuple, lr: float, momentum: float,
             seed: int) -> float:
    rule, f, tau, alpha = variant
    flags = ["--model.name", model, "--optim.total_steps", str(args.steps), "--diloco.inner_steps", str(h),
             "--optim.batch_size", str(args.batch), "--train.micro_bs", str(args.batch), "--data.seq_length",
             str(args.seq), "--diloco.outer_lr", str(lr), "--diloco.outer_momentum", str(momentum),
             "--train.seed", str(seed), "--train.device", "cpu"]
    if rule != "blocking":
        flags += ["--diloco.overlap", rule]
    if rule == "streaming":
        flags += ["--diloco.fragments", str(f), "--diloco.fragment_delay", str(tau), "--diloco.fragment_alpha",
                  str(alpha)]
    out = subprocess.run([sys.executable, checkout_file(REFERENCE), str(args.nodes),
                          "none" if rule == "blocking" else rule, *flags], capture_output=True, text=True,
                         timeout=7200, env=subprocess_env(OMP_NUM_THREADS="1"), cwd=REPO)
    if out.returncode != 0:
        raise SystemExit(f"the simulation of {model} {label(variant)} H={h} lr={lr} momentum={momentum} seed={seed} "
                         f"failed:\n{out.stderr[-2000:]}")
    losses = json.loads(out.stdout.strip().splitlines()[-1])["losses"]
    return mean(mean(node[-TAIL:]) for node in losses)


def pct(a: float, b: float) -> float:
    return round(100 * (a / b - 1), 2)


def summarize(args: argparse.Namespace, found: dict) -> tuple[list[dict], list[dict]]:
    rows, best = [], []
    for model in args.models:
        for h in args.hs:
            mine = []
            blocking_variant = variants(args)[0]
            best_blocking = min(settings_of(args, "blocking"), key=lambda st: mean(
                found[(model, h, blocking_variant, *st, s)] for s in args.seeds))
            for variant in variants(args):
                rule, f, tau, alpha = variant
                for lr, mom in settings_of(args, rule):
                    losses = [found[(model, h, variant, lr, mom, s)] for s in args.seeds]
                    # against blocking at the same setting where it ran, else against blocking's best
                    st = (lr, mom) if (lr, mom) in settings_of(args, "blocking") else best_blocking
                    blocking = [found[(model, h, blocking_variant, *st, s)] for s in args.seeds]
                    mine.append({"model": model, "h": h, "rule": rule, "fragments": f, "fragment_delay": tau,
                                 "fragment_alpha": alpha, "outer_lr": lr, "outer_momentum": mom,
                                 "loss": round(mean(losses), 4), "losses": [round(x, 4) for x in losses],
                                 "vs_blocking_pct": pct(mean(losses), mean(blocking))})
            rows += mine
            b = min((r for r in mine if r["rule"] == "blocking"), key=lambda r: r["loss"])
            for rule in dict.fromkeys(r["rule"] for r in mine if r["rule"] != "blocking"):
                o = min((r for r in mine if r["rule"] == rule), key=lambda r: r["loss"])
                best.append({"model": model, "h": h, "rule": rule, "loss": o["loss"], "losses": o["losses"],
                             "setting": {k: o[k] for k in ("outer_lr", "outer_momentum", "fragments",
                                                           "fragment_delay", "fragment_alpha")},
                             "blocking": b["loss"], "blocking_losses": b["losses"],
                             "blocking_setting": {"outer_lr": b["outer_lr"], "outer_momentum": b["outer_momentum"]},
                             "vs_blocking_pct": pct(o["loss"], b["loss"]),
                             "per_seed_vs_blocking_pct": [pct(x, y) for x, y in zip(o["losses"], b["losses"])]})
    return rows, best


def recovered(best: list[dict]) -> list[dict]:
    """Per (model, H) with both eager and delayed: the share (%) of the delay's cost, best against best, that
    eager wins back; None where the delay cost nothing."""
    out = []
    for key in dict.fromkeys((b["model"], b["h"]) for b in best):
        by_rule = {b["rule"]: b for b in best if (b["model"], b["h"]) == key}
        if "eager" in by_rule and "delayed" in by_rule:
            blocking, delayed, eager = by_rule["eager"]["blocking"], by_rule["delayed"]["loss"], by_rule["eager"]["loss"]
            cost = delayed - blocking
            share = round(100 * (delayed - eager) / cost, 1) if cost > 0 else None
            out.append({"model": key[0], "h": key[1], "blocking": blocking, "delayed": delayed, "eager": eager,
                        "recovered_pct": share})
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cells = [(model, h, v, lr, mom, s) for model in args.models for h in args.hs for v in variants(args)
             for lr, mom in settings_of(args, v[0]) for s in args.seeds]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        found = dict(zip(cells, pool.map(lambda c: simulate(args, *c), cells)))
    rows, best = summarize(args, found)
    doc = {"bench": "overlap_regime", "nodes": args.nodes, "steps": args.steps, "models": args.models,
           "batch": args.batch, "seq": args.seq, "seeds": args.seeds, "tail": TAIL, "rows": rows, "best": best,
           "recovered": recovered(best)}
    if not args.json:
        seeds = ", ".join(f"seed {s}" for s in args.seeds)
        print(f"{'model':>10} {'H':>4} {'rule':>18} {'outer lr':>8} {'momentum':>8} {'loss':>7}  ({seeds})  vs blocking")
        for r in rows:
            rule = label((r["rule"], r["fragments"], r["fragment_delay"], r["fragment_alpha"]))
            print(f"{r['model']:>10} {r['h']:>4} {rule:>18} {r['outer_lr']:>8} {r['outer_momentum']:>8} "
                  f"{r['loss']:>7.4f}  ({', '.join(f'{x:.4f}' for x in r['losses'])})  {r['vs_blocking_pct']:+.2f}%")
        for b in best:
            s = b["setting"]
            extra = "" if s["fragments"] is None else f", {s['fragments']}:{s['fragment_delay']}:{s['fragment_alpha']}"
            print(f"{b['model']} H={b['h']}: best {b['rule']} {b['loss']:.4f} (lr {s['outer_lr']}, momentum "
                  f"{s['outer_momentum']}{extra}) vs best blocking {b['blocking']:.4f} (lr "
                  f"{b['blocking_setting']['outer_lr']}, momentum {b['blocking_setting']['outer_momentum']}): "
                  f"{b['vs_blocking_pct']:+.2f}% (per seed {', '.join(f'{x:+.2f}%' for x in b['per_seed_vs_blocking_pct'])})")
        for r in doc["recovered"]:
            share = "n/a (the delay cost nothing)" if r["recovered_pct"] is None else f"{r['recovered_pct']:.1f}%"
            print(f"{r['model']} H={r['h']}: eager wins back {share} of the delay's cost (blocking {r['blocking']:.4f}, "
                  f"delayed {r['delayed']:.4f}, eager {r['eager']:.4f}; best against best)")
    print(json.dumps(doc))
    return doc


if __name__ == "__main__":
    main()
