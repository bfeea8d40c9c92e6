"""`zb ckpt ls` and `zb ckpt verify` over a real run's checkpoints and hand-made ones (several local
ranks, several nodes, incomplete, damaged, a remote copy): what they list and report, exit codes,
one-line errors, and that neither imports torch."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from zb.ckpt.durable.layout import part_name
from zb.ckpt.format.manifest import snapshot_name
from zb.ckpt.format.snapshot import write_snapshot
from zb.position import RunPosition
from zb.testing.procs import PYTHON, REPO, subprocess_env, zb_process, zb_train


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A real run's ckpt.path: steps 4 and 8 of 8, one local rank."""
    tmp = tmp_path_factory.mktemp("run")
    proc = zb_train(tmp, "--optim.total_steps", "8", "--ckpt.path", str(tmp / "ckpt"), "--ckpt.interval", "4",
                    "--log.dir", str(tmp / "log"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp / "ckpt"


def make_step(root: Path, step: int, ranks: int = 2, *, only: list[int] | None = None, final: bool = False) -> Path:
    """A hand-made checkpoint as zb train writes it (the meta a listing reads); `only` writes some parts."""
    meta = {"counters": RunPosition(step, step // 10, tokens=step * 64, run_tokens=step * 128).to_json(),
            "local_world_size": ranks, "final": final, "config": {"optim": {"total_steps": 1000}}}
    for rank in only if only is not None else range(ranks):
        write_snapshot(root / snapshot_name(step), {"model.safetensors": {"w": torch.full((64,), float(rank))}},
                       {**meta, "local_rank": rank}, step, outer_step=step // 10, name=part_name(rank))
    return root / snapshot_name(step)


def ls(run_zb, *args: str) -> dict:
    result = run_zb("ckpt", "ls", *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def one_line_error(proc: subprocess.CompletedProcess, code: int, text: str) -> None:
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and text in lines[0], proc.stderr


def test_ls_lists_a_real_runs_checkpoints(run, run_zb):
    doc = ls(run_zb, str(run))
    (node,) = doc["nodes"]
    assert node["node"] is None and node["latest"] == 8 and doc["common"] is None
    assert [s["step"] for s in node["steps"]] == [4, 8]
    last = node["steps"][1]
    assert last["complete"] and last["why"] is None and (last["parts"], last["ranks"]) == (1, 1)
    # 4 rows of 32 tokens a step; the run ended at step 8, which the interval had saved: final all the same
    assert last["position"] == {"step": 8, "outer_step": 0, "tokens": 1024, "run_tokens": 1024}
    assert [s["final"] for s in node["steps"]] == [False, True]
    assert last["bytes"] == sum(f.stat().st_size for f in (run / "step-000000008").rglob("*") if f.is_file())
    lines = run_zb("ckpt", "ls", str(run)).stdout.splitlines()  # not a terminal: plain lines
    assert lines[0] == f"{run}:" and "step 8  outer step 0  tokens 1,024" in lines[2] and lines[2].endswith("final")
    assert lines[3].strip().startswith("latest: step 8")


def test_verify_a_real_checkpoint(run, run_zb):
    result = run_zb("ckpt", "verify", str(run / "step-000000008"))
    assert result.exit_code == 0 and result.stdout.startswith("rank-0  OK")
    assert "checkpoint step 8" in result.stderr and "1 part(s) OK" in result.stderr
    doc = json.loads(run_zb("ckpt", "verify", str(run), "--step", "4", "--json").stdout)
    assert doc["ok"] and doc["step"] == 4 and doc["ranks"] == 1 and doc["parts"][0]["bytes"] > 0
    one = json.loads(run_zb("ckpt", "verify", str(run / "step-000000004" / "rank-0"), "--json").stdout)
    assert one["ok"] and [p["rank"] for p in one["parts"]] == [0]


def test_ls_says_why_a_step_is_incomplete_and_which_one_a_resume_takes(tmp_path, run_zb):
    root = tmp_path / "ckpt"
    make_step(root, 100)
    make_step(root, 200, only=[0])
    (root / snapshot_name(200) / ".tmp-rank-1").mkdir()  # a copy cut short
    damaged = make_step(root, 300) / "rank-1" / "model.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-8])
    steps = {s["step"]: s for s in ls(run_zb, str(root))["nodes"][0]["steps"]}
    assert steps[100]["complete"] and steps[100]["position"]["outer_step"] == 10
    assert not steps[200]["complete"] and (steps[200]["parts"], steps[200]["ranks"]) == (1, 2)
    # It named a missing rank-1 where a copy is being written (issue 37): the .tmp- copy is named now.
    assert steps[200]["why"] == "rank-1 is still being written or was cut short (only .tmp-rank-1 exists)"
    assert not steps[300]["complete"] and "the manifest says" in steps[300]["why"]
    assert ls(run_zb, str(root))["nodes"][0]["latest"] == 100
    out = run_zb("ckpt", "ls", str(root)).stdout
    assert "step 200  outer step 20  tokens 12,800" in out and "1/2 part(s)  incomplete: " in out


def test_ls_of_node_directories_names_the_common_step(tmp_path, run_zb):
    ram = tmp_path / "ram"
    for step in (4, 8):
        make_step(ram / "node-a", step, ranks=1)
    make_step(ram / "node-b", 4, ranks=1)
    make_step(ram / "node-b", 12, ranks=1, final=True)
    (ram / "live" / "node-a").mkdir(parents=True)  # live-recovery snapshots: not a node of checkpoints
    doc = ls(run_zb, str(ram))
    assert [(n["node"], n["latest"]) for n in doc["nodes"]] == [("node-a", 8), ("node-b", 12)]
    assert doc["common"] == 4 and doc["nodes"][1]["steps"][1]["final"]
    assert ls(run_zb, str(ram / "node-b"))["nodes"][0]["latest"] == 12  # one node's directory
    assert "common: step 4" in run_zb("ckpt", "ls", str(ram)).stdout


def test_ls_with_a_remote_copy(tmp_path, run_zb):
    make_step(tmp_path / "disk", 4)
    remote = tmp_path / "bucket" / "run" / "node-a"
    make_step(remote, 4)
    make_step(remote, 8)
    shutil.rmtree(make_step(remote, 12) / "rank-1")
    doc = ls(run_zb, str(tmp_path / "disk"), "--remote", f"file://{remote}")
    (node,) = doc["nodes"]
    assert node["latest"] == 8 and [(s["step"], s["where"]) for s in node["steps"]] == [
        (4, "local"), (4, "remote"), (8, "remote"), (12, "remote")]
    assert node["steps"][2]["position"]["step"] == 8 and node["steps"][2]["parts"] == 2
    assert not node["steps"][3]["complete"] and "rank-1" in node["steps"][3]["why"]
    whole = ls(run_zb, "--remote", f"file://{remote.parent}")  # ckpt.remote.path: a directory per node
    assert [(n["node"], n["latest"]) for n in whole["nodes"]] == [("node-a", 8)]


def test_verify_reports_each_damaged_part_and_exits_1(tmp_path):
    step_dir = make_step(tmp_path, 100, ranks=3)
    model = step_dir / "rank-1" / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[-1] ^= 1
    model.write_bytes(bytes(data))
    shutil.move(step_dir / "rank-2", step_dir / ".tmp-rank-2")
    proc = zb_process("ckpt", "verify", str(step_dir), timeout=60)
    assert proc.returncode == 1, proc.stderr
    out = proc.stdout.splitlines()
    assert out[0].startswith("rank-0  OK") and out[1].startswith("rank-1  DAMAGED") and "sha256" in out[1]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 3 and err[0].startswith("DAMAGED rank-1: ") and "sha256 does not match" in err[0]
    assert err[1].startswith("DAMAGED rank-2: ") and ".tmp-rank-2 is a copy being written or cut short" in err[1]
    assert err[2] == f"error: checkpoint step 100 ({step_dir}): 2 of 3 part(s) damaged or missing"
    proc = zb_process("ckpt", "verify", str(step_dir / "rank-0"), "--json", timeout=60)
    assert proc.returncode == 0 and json.loads(proc.stdout)["ok"]


@pytest.mark.parametrize("args, text", [
    (["verify", "{tmp}/missing"], "checkpoint {tmp}/missing does not exist"),
    (["verify", "{tmp}/empty"], "is not a zb checkpoint"),
    (["verify", "{tmp}/ckpt"], "is a checkpoint root: name one of its steps with --step N (its steps: 100)"),
    (["verify", "{tmp}/ckpt", "--step", "5"], "no checkpoint step 5 under"),
    (["verify", "{tmp}/ckpt/step-000000100", "--step", "100"], "is a checkpoint already"),
    (["ls", "{tmp}/missing"], "directory {tmp}/missing does not exist"),
    (["ls", "{tmp}/empty"], "holds no zb checkpoints"),
    (["ls", "{tmp}/ckpt/step-000000100"], "is a checkpoint, not a directory of checkpoints"),
    (["ls"], "name a directory to list"),
    (["ls", "--remote", "{tmp}/missing"], "--remote {tmp}/missing does not exist"),
])
def test_bad_paths_exit_2_with_one_line(tmp_path, args, text):
    make_step(tmp_path / "ckpt", 100, ranks=1)
    (tmp_path / "empty").mkdir()
    proc = zb_process("ckpt", *(a.format(tmp=tmp_path) for a in args), timeout=60)
    one_line_error(proc, 2, text.format(tmp=tmp_path))


def test_neither_command_imports_torch(run):
    """Listing and checking are file work: quick on a login node, without torch's seconds of import."""
    code = ("import sys; from zb.cli import main\n"
            f"for args in (['ckpt', 'ls', {str(run)!r}], ['ckpt', 'verify', {str(run / 'step-000000004')!r}]):\n"
            "    try: main(args)\n"
            "    except SystemExit as e: assert not e.code, e.code\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    proc = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, env=subprocess_env(), cwd=REPO,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
