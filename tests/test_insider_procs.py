"""Issue 40, finding 4, with real processes: three `zb train` nodes around a `zb store`, one of them the hostile
driver (scripts/_hostile_node.py) lying in one of the issue's ways, every node with diloco.clip 2 and
diloco.evict_clipped. The two honest nodes must agree at every outer step, apply every outer step (the run
moves), end with a finite loss and exit 0; the liar must be evicted (exit 2) at its 3rd discredited outer
step. The same rules run in-process in the default suite (tests/test_insider_inprocess.py); these take
about 30 s each."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

HOSTILE = Path(__file__).resolve().parents[1] / "scripts" / "_hostile_node.py"
FLAGS = ("--optim.total_steps", "50", "--diloco.clip", "2", "--diloco.evict_clipped", "true")

pytestmark = pytest.mark.soak


@pytest.mark.parametrize("mode, says", [("ahead", "claims a position past the one most contributors hold"),
                                        ("quiet:30", "failed its check"),
                                        ("nan", "failed its check")])
def test_a_lying_node_is_outweighed_then_evicted_and_the_honest_nodes_agree(make_run, mode, says):
    run = make_run(3)
    run.start_train("a", *FLAGS, rank=0)
    run.start_train("c", *FLAGS, rank=2)
    run.start_train("liar", *FLAGS, rank=1, entry=(str(HOSTILE), mode))
    assert run.finish("liar") == 2, run.log("liar")
    assert "evicted by diloco.evict_clipped after 3 discredited outer steps" in run.log("liar")
    for uid in ("a", "c"):
        assert run.finish(uid) == 0, run.log(uid)
        whole = (run.tmp / f"{uid}.log").read_text()
        assert says in whole and "node liar is evicted from the run" in whole, whole
    outer = {uid: run.metrics(uid, "outer_step") for uid in ("a", "c")}
    assert len(outer["a"]) == 10 and all(e["applied"] for e in outer["a"]), outer["a"]
    assert [e["params_hash"] for e in outer["a"]] == [e["params_hash"] for e in outer["c"]]
    assert all(math.isfinite(e["loss"]) for e in run.metrics("a", "step"))
    assert outer["a"][-1]["global_world_size"] == 2
