"""The DiLoCo outer step, computed by hand, and agreement between nodes (fp32 and int8)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zb.testing.procs import REPO, free_port, subprocess_env

DRIVER = str(Path(__file__).parent / "drivers" / "diloco_formula.py")


def _run_nodes(world: int, compression: str) -> list[dict]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, DRIVER, str(r), str(world), str(port), compression],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
                              cwd=REPO) for r in range(world)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def test_outer_step_is_nesterov_on_the_average_pseudo_gradient():
    outs = _run_nodes(2, "none")
    before = torch.tensor(outs[0]["before"], dtype=torch.float32)
    params = torch.tensor(outs[0]["everyone"], dtype=torch.float32)
    # DiLoCo: delta = mean_i(outer - theta_i); Nesterov SGD, first step: buf = delta,
    # update = delta + momentum * buf; outer -= lr * update.
    delta = (before - params[0] + before - params[1]) / 2
    expected = before - 0.7 * (delta + 0.9 * delta)
    for out in outs:
        got = torch.tensor(out["outer_after"], dtype=torch.float32)
        torch.testing.assert_close(got, expected, rtol=0, atol=2e-6)
        assert out["model_after"] == out["outer_after"], "the model must hold the outer params after the step"
    assert outs[0]["buckets"] > 1, "the test should exercise several buckets"


@pytest.mark.parametrize("compression", [pytest.param("none", marks=pytest.mark.soak), "int8"])   # suite time
def test_nodes_end_with_identical_outer_params(compression):
    outs = _run_nodes(3, compression)
    assert len({o["hash"] for o in outs}) == 1
    if compression == "int8":
        assert outs[0]["wire_bytes"] > 0
