"""What scripts/simulate_multi_node_diloco.sh prints about its nodes, read from their metrics files.

    python scripts/_sim_report.py line LOGDIR N      one progress line (latest step and loss per node)
    python scripts/_sim_report.py summary LOGDIR N   the final table, and whether the nodes agree

Nodes agree when every node that logged a params hash at the last outer step they share logged the
same one (the simulator turns train.log_model_hash on for this). Exit code 0 either way: the
simulator's own status comes from the nodes' exit codes.
"""

from __future__ import annotations

import sys
from pathlib import Path

from zb.metrics import read_metrics


def _events(logdir: Path, node: int, kind: str) -> list[dict]:
    path = logdir / f"node{node}" / "metrics.jsonl"
    return read_metrics(path, kind) if path.is_file() else []


def line(logdir: Path, n: int) -> str:
    parts = []
    for i in range(n):
        steps = _events(logdir, i, "step")
        outer = _events(logdir, i, "outer_step")
        if not steps:
            parts.append(f"node{i} starting")
            continue
        last = steps[-1]
        parts.append(f"node{i} step {last['step']} loss {last['loss']:.3f} outer {len(outer)}")
    return " | ".join(parts)


def _number(value) -> str:
    """A loss for the table: 4 decimals, "-" when none was logged, as written when not finite ("inf")."""
    if value is None:
        return "-"
    return f"{value:.4f}" if isinstance(value, (int, float)) else str(value)


def summary(logdir: Path, n: int) -> str:
    rows = ["node   steps  outer steps  last loss  held-out loss  tokens/s"]
    hashes: dict[int, dict[int, str]] = {}
    for i in range(n):
        steps, outer, evals = (_events(logdir, i, k) for k in ("step", "outer_step", "eval"))
        hashes[i] = {e["outer_step"]: e["params_hash"] for e in outer if "params_hash" in e}
        last = steps[-1] if steps else {}
        held_out = _number(evals[-1]["loss"]) if evals else "not run"   # a run without evals has no held-out loss
        rows.append(f"node{i:<3} {last.get('step', 0):>5}  {len(outer):>11}  {_number(last.get('loss')):>9}  "
                    f"{held_out:>13}  {last.get('tokens_per_s', 0):>8,.0f}")
    shared = set.intersection(*(set(h) for h in hashes.values())) if hashes else set()
    if not shared:
        rows.append("agreement: no outer step logged a params hash on every node")
    else:
        at = max(shared)
        agree = len({hashes[i][at] for i in hashes}) == 1
        rows.append(f"agreement at outer step {at}: " + ("all nodes hold the same params" if agree else
                                                          "NODES DIFFER: " + ", ".join(f"node{i} {hashes[i][at][:12]}"
                                                                                       for i in hashes)))
    return "\n".join(rows)


def main() -> None:
    mode, logdir, n = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    print(line(logdir, n) if mode == "line" else summary(logdir, n), flush=True)


if __name__ == "__main__":
    main()
