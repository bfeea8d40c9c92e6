"""Nodes of different local rank counts in one DiLoCo run (diloco.stripes, zb.diloco.stripes): a
1-rank node and a 2-rank FSDP node against the single-process simulation of the same math, a
2-rank joiner of a run of 1-rank nodes (blocking and live recovery), a node too small for the
run's stripes refused, a checkpoint resumed with another local rank count, and the row moves
themselves against whole tensors."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from zb.shard_rows import rows
from zb.testing.cluster import RUN_FLAGS, agree_with_joiner, reference_losses, worst_relative
from zb.testing.procs import REPO, TINY, free_port, subprocess_env, zb_process

MOVES = str(Path(__file__).parent / "drivers" / "stripe_moves.py")


def test_rows_split_as_torch_chunk_does():
    import torch

    for d0 in (0, 1, 2, 5, 7, 10, 64):
        for parts in (1, 2, 3, 4, 8):
            chunks = torch.arange(d0).chunk(parts) if d0 else ()
            for i in range(parts):
                a, b = rows(d0, parts, i)
                want = chunks[i].tolist() if i < len(chunks) else []
                assert list(range(a, b)) == want, (d0, parts, i)


@pytest.mark.parametrize("local_ranks, stripes", [(3, 1), pytest.param(3, 2, marks=pytest.mark.soak)])
def test_row_moves_match_whole_tensors_under_fsdp(local_ranks, stripes):
    """Real FSDP2 shards on `local_ranks` gloo ranks: reading gives each stripe owner exactly its rows
    of the whole params and AdamW moments, and writing puts every rank's FSDP rows back from them."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          f"--nproc-per-node={local_ranks}", MOVES, str(stripes)], capture_output=True, text=True,
                         timeout=300, env=subprocess_env(OMP_NUM_THREADS="1"), cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("ok") == local_ranks, out.stdout


def test_nodes_of_one_and_two_local_ranks_equal_the_single_process_simulation(make_run):
    flags = [*TINY[:-4], "--model.name", "debug", "--diloco.inner_steps", "5", *RUN_FLAGS, "--train.device", "cpu"]
    expected = reference_losses("1,2", "none", flags)     # node 1 reads as 2 local ranks do
    run = make_run(2)
    run.start_train("n0", *RUN_FLAGS, "--diloco.stripes", "1", rank=0)
    run.start_train("n1", *RUN_FLAGS, local_ranks=2, rank=1)       # takes the run's stripes: 1
    for uid in ("n0", "n1"):
        assert run.finish(uid) == 0, run.log(uid)
    for i in range(2):
        got = [e["loss"] for e in run.metrics(f"n{i}", "step")]
        assert len(got) == 22 and worst_relative(got, expected[i]) < 1e-5, (i, got, expected[i])
    hashes = [run.hashes(f"n{i}") for i in range(2)]
    assert hashes[0] == hashes[1] and len(hashes[0]) >= 4
    assert all(e["num_peers"] == 2 for e in run.metrics("n0", "outer_step"))
    assert "rows move inside the node" in (run.tmp / "n1.log").read_text()


# The default suite checks a mixed run against the simulation and a resume across counts; the joins
# (a 2-rank node's start through torch's launcher, 30 s each) run under soak.
@pytest.mark.parametrize("live", [pytest.param(False, marks=pytest.mark.soak), pytest.param(True, marks=pytest.mark.soak)])
def test_a_two_rank_node_joins_a_run_of_one_rank_nodes(make_run, live):
    run = make_run(2)
    args = ["--optim.total_steps", "100000"]
    if live:   # slower outer steps: the joiner lands in time
        run.env["ZB_CKPT_TOKEN"] = "test-token-0123456789abcdef"
        args += ["--ckpt.live_recovery", "--diloco.blocking_join", "false", "--ckpt.ram_dir", str(run.tmp / "shm"),
                 "--diloco.inner_steps", "60"]
    for i in range(2):
        run.start_train(f"n{i}", *args, "--diloco.stripes", "1", rank=i)
    run.wait_outer("n0", 2)
    run.start_train("late", *args, local_ranks=2, rank=2)
    run.wait_outer("late", 3)
    for uid in ("n0", "n1", "late"):
        run.procs[uid].send_signal(signal.SIGTERM)
    for uid in ("n0", "n1"):
        assert run.finish(uid) == 128 + signal.SIGTERM, run.log(uid)
    run.finish("late")      # torch's launcher exits 1 on SIGTERM whatever its ranks did: read the node's log
    late = (run.tmp / "late.log").read_text()
    assert "zb.train: done:" in late
    if live:
        assert run.metrics("late", "recovery")[0]["bytes"] > 0
    else:
        assert "received the run's state from rank" in late
    agree_with_joiner(run)


def test_a_node_with_fewer_local_ranks_than_stripes_is_refused(make_run):
    run = make_run(1)
    run.start_train("big", "--optim.total_steps", "100000", local_ranks=2, rank=0)   # stripes: 2
    run.wait_for("big", lambda: "global rank" in (run.tmp / "big.log").read_text(), "joining the run")
    run.start_train("small", "--optim.total_steps", "100000", rank=1)
    assert run.finish("small") == 2
    assert "stripes (diloco.stripes)" in run.log("small") and "Traceback" not in run.log("small")


def test_a_checkpoint_resumes_with_another_local_rank_count(tmp_path):
    """Written by a 2-rank node (FSDP shards, outer state in 1 stripe), resumed by a 1-rank node: its
    next checkpoint, at the same step, holds exactly the same inner and outer params."""
    import torch
    from safetensors.torch import load_file

    from zb.export import export_checkpoint

    def train(name: str, *args: str):
        return zb_process("train", *TINY, "--optim.total_steps", "8", "--diloco.inner_steps", "4", "--diloco.stripes",
                          "1", "--elastic.host_store", "--ckpt.path", str(tmp_path / name / "ckpt"), "--ckpt.ram_dir",
                          str(tmp_path / "ram"), "--log.dir", str(tmp_path / name / "log"), *args,
                          GLOBAL_ADDR="127.0.0.1", GLOBAL_PORT=str(free_port()), GLOBAL_UNIQUE_ID=name)

    two = train("two", "--nproc-per-node", "2", "--ckpt.interval", "4")
    assert two.returncode == 0, two.stderr[-3000:]
    one = train("one", "--ckpt.resume", str(tmp_path / "two" / "ckpt" / "step-000000008"))
    assert one.returncode == 0, one.stderr[-3000:]
    assert "written by 2 local ranks and this node has 1" in one.stderr and "resharded" in one.stderr
    for inner in (False, True):
        tensors = []
        for name in ("two", "one"):
            out = tmp_path / f"{name}-{inner}"
            export_checkpoint(tmp_path / name / "ckpt" / "step-000000008", out, inner=inner)
            tensors.append({k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()})
        assert tensors[0].keys() == tensors[1].keys() and len(tensors[0]) > 10
        assert all(torch.equal(tensors[0][k], tensors[1][k]) for k in tensors[0]), inner
