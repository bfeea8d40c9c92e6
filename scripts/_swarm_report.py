"""What scripts/simulate_swarm.sh prints at the end, read from its workers' metrics files.

    python scripts/_swarm_report.py LOGDIR

A table per worker (stage, steps, final loss for first-stage workers, micro-batches served, re-issued
ones, pipeline bytes) and, per stage, whether every worker that applied an outer step logged the same
params hash there. Exit code 0 either way: the simulator's status comes from the workers' exit codes.
"""

from __future__ import annotations

import sys
from pathlib import Path

from zb.metrics import read_metrics


def report(logdir: Path) -> str:
    rows, hashes = [], {}
    for path in sorted(logdir.glob("*/metrics.jsonl")):
        name = path.parent.name
        steps, swarm = read_metrics(path, "step"), read_metrics(path, "swarm")
        outer, evals = read_metrics(path, "outer_step"), read_metrics(path, "eval")
        last = swarm[-1] if swarm else {}
        stage = last.get("stage", outer[-1]["stage"] if outer else "?")
        loss = f"{steps[-1]['loss']:.4f}" if steps else "-"
        held = f"{evals[-1]['loss']:.4f}" if evals else "-"
        rows.append(f"{name:<10} stage {stage:<3} steps {last.get('step', 0):<6} loss {loss:<8} held-out {held:<8} "
                    f"backward {last.get('backward', 0):<6} re-issued {last.get('reissued', '-')!s:<4} "
                    f"pipeline out {last.get('pipeline_bytes_out', 0) / 1e6:.1f} MB")
        for e in outer:
            if e.get("applied") and "params_hash" in e:
                hashes.setdefault(stage, {}).setdefault(e["outer_step"], set()).add(e["params_hash"])
    for stage, by_step in sorted(hashes.items(), key=lambda kv: str(kv[0])):
        bad = [k for k, v in by_step.items() if len(v) > 1]
        rows.append(f"stage {stage}: workers agree at {len(by_step) - len(bad)} of {len(by_step)} outer steps"
                    + (f" (differ at {bad[:5]})" if bad else ""))
    return "\n".join(rows)


if __name__ == "__main__":
    print(report(Path(sys.argv[1])))
