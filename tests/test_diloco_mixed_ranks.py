"""Nodes of different local rank counts in one DiLoCo run (diloco.stripes, zb.diloco.stripes): a
1-rank node and a 2-rank FSDP node against the single-process simulation of the same math (blocking,
eager and streaming), a 2-rank joiner of a run of 1-rank nodes (blocking and live recovery), a node
too small for the run's stripes refused, a checkpoint resumed with another local rank count, and the
row moves themselves against whole tensors."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from zb.metrics import read_metrics
from zb.shard_rows import rows
from zb.testing.cluster import RUN_FLAGS, STREAMING, agree_with_joiner, reference_losses, worst_relative
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


# Each rule's run is about a minute on two cores: the default suite runs blocking and streaming (its
# launch and merge move rows for one fragment at a time); eager runs under soak.
@pytest.mark.parametrize("rule", ["none", pytest.param("eager", marks=pytest.mark.soak), "streaming",
                                  pytest.param("sparse", marks=pytest.mark.soak)])
def test_nodes_of_one_and_two_local_ranks_equal_the_single_process_simulation(make_run, rule):
    """Under every diloco.overlap: the 2-rank node's second rank holds no stripe, sends nothing, and joins
    every row move of its node's outer steps (and, streaming, of each fragment's launch and merge). Sparse:
    blocking with diloco.compression = sparse, the simulation's average SparseLoCo's with the twins."""
    own = STREAMING if rule == "streaming" else ["--diloco.compression", "sparse"] if rule == "sparse" else []
    rule = "none" if rule == "sparse" else rule
    flags = [*TINY[:-4], "--model.name", "debug", "--diloco.inner_steps", "5", *RUN_FLAGS, "--train.device", "cpu"]
    expected = reference_losses("1,2", rule, flags + own)     # node 1 reads as 2 local ranks do
    run = make_run(2)
    args = [*RUN_FLAGS, "--diloco.overlap", rule, *own]
    run.start_train("n0", *args, "--diloco.stripes", "1", rank=0)
    run.start_train("n1", *args, local_ranks=2, rank=1)       # takes the run's stripes: 1
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
# (a 2-rank node's start through torch's launcher, 30 s each) run under soak. Under overlap: a blocking
# joiner of eager, and a live-recovery joiner of streaming, whose second rank learns from its first which
# fragment the average in flight that the donor sends is.
@pytest.mark.parametrize("live, overlap", [pytest.param(False, "none", marks=pytest.mark.soak),
                                           pytest.param(True, "none", marks=pytest.mark.soak),
                                           pytest.param(False, "eager", marks=pytest.mark.soak),
                                           pytest.param(True, "streaming", marks=pytest.mark.soak)])
def test_a_two_rank_node_joins_a_run_of_one_rank_nodes(make_run, live, overlap):
    run = make_run(2)
    args = ["--optim.total_steps", "100000", "--diloco.overlap", overlap]
    if overlap == "streaming":   # two fragments: the part the joiner's ranks merge is not always the same
        args += ["--diloco.fragments", "2"]
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
    if live and overlap != "none":   # or, when the run moved on before the admission, the blocking transfer
        assert ("took the average in flight from rank" in late) != ("received the run's state from rank" in late)
    agree_with_joiner(run)


def test_a_node_with_fewer_local_ranks_than_stripes_is_refused(make_run):
    run = make_run(1)
    run.start_train("big", "--optim.total_steps", "100000", local_ranks=2, rank=0)   # stripes: 2
    run.wait_for("big", lambda: "global rank" in (run.tmp / "big.log").read_text(), "joining the run")
    run.start_train("small", "--optim.total_steps", "100000", rank=1)
    assert run.finish("small") == 2
    assert "stripes (diloco.stripes)" in run.log("small") and "Traceback" not in run.log("small")


def _train_alone(tmp_path: Path, name: str, *args: str) -> subprocess.CompletedProcess:
    """A node alone in its run (stripes 1, H = 4), checkpointing under tmp_path/name/ckpt."""
    return zb_process("train", *TINY, "--diloco.inner_steps", "4", "--diloco.stripes", "1", "--elastic.host_store",
                      "--ckpt.path", str(tmp_path / name / "ckpt"), "--ckpt.ram_dir", str(tmp_path / "ram"),
                      "--log.dir", str(tmp_path / name / "log"), *args,
                      GLOBAL_ADDR="127.0.0.1", GLOBAL_PORT=str(free_port()), GLOBAL_UNIQUE_ID=name)


def test_a_checkpoint_resumes_with_another_local_rank_count(tmp_path):
    """Written by a 2-rank node (FSDP shards, outer state in 1 stripe), resumed by a 1-rank node: its
    next checkpoint, at the same step, holds exactly the same inner and outer params."""
    import torch
    from safetensors.torch import load_file

    from zb.export import export_checkpoint

    def train(name: str, *args: str):
        return _train_alone(tmp_path, name, "--optim.total_steps", "8", *args)

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


@pytest.mark.soak
def test_a_streaming_average_in_flight_resumes_on_a_node_with_more_local_ranks(tmp_path):
    """Streaming (2 fragments, H = 4, tau 1): a 1-rank node stops at step 5, right after launching fragment 0,
    and its checkpoint keeps that average. A 2-rank node resumes it: its second rank holds no stripe and its
    part of the resharded checkpoint is empty, so it takes the fragment from the first rank, and both merge
    fragment 0 at step 6 (a rank merging the other fragment would move other rows: the node would fail)."""
    flags = ["--optim.total_steps", "12", "--diloco.overlap", "streaming", "--diloco.fragments", "2",
             "--diloco.fragment_delay", "1"]
    one = _train_alone(tmp_path, "one", *flags, "--train.max_steps", "5")
    assert one.returncode == 0, one.stderr[-3000:]
    two = _train_alone(tmp_path, "two", *flags, "--nproc-per-node", "2", "--ckpt.resume",
                       str(tmp_path / "one" / "ckpt" / "step-000000005"))
    assert two.returncode == 0, two.stderr[-3000:]
    assert "resumed with the average that was in flight" in two.stderr
    first = read_metrics(tmp_path / "two" / "log" / "metrics.jsonl", "outer_step")[0]
    assert (first["step"], first["fragment"], first["applied"]) == (6, 0, True)
