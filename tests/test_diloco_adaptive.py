"""Speed-adaptive rounds (diloco.round_seconds): the token-weighted average over a real gloo group
against the one-process rule, the round clock's decisions (on a fake clock), the refusals, and real
nodes whose step times differ honestly (other batch sizes; under `soak`, a CPU quota set by the OS)."""

from __future__ import annotations

import os
import signal
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fake_world import FakeClock
from torch import nn

from zb.config import load_config
from zb.config_schema import DilocoConfig
from zb.diloco.background import BackgroundAllReduce
from zb.diloco.checkin import run_step
from zb.diloco.outer import OuterState
from zb.diloco.rounds import RoundClock, token_weight, weighted_average
from zb.diloco.sync import sync_pseudo_gradient
from zb.errors import InvalidInput
from zb.testing.cluster import TrainCluster
from zb.testing.procs import free_port


# -- the weighting ------------------------------------------------------------------------------------
def _weighted_sync_over_gloo(deltas: list[torch.Tensor], tokens: list[int], compression: str,
                             sparse_average: str = "nodes", background: bool = False) -> list[torch.Tensor]:
    """Each of len(deltas) ranks (threads on one gloo group) moved its copy of a shared model by -delta
    and syncs with its token weight, as DilocoNode does (`background`: as streaming does, the buffer all-reduced
    behind the inner steps, weighted by its tokens); returns every rank's summed buffer."""
    n, port, out = len(deltas), free_port(), {}
    master = dist.TCPStore("127.0.0.1", port, n, True, timeout=timedelta(seconds=20), use_libuv=True,
                           wait_for_workers=False)
    dcfg = DilocoConfig(compression=compression, bucket_mb=0.0004, sparse_chunk=16, sparse_k=8,  # several buckets
                        sparse_average=sparse_average)

    def rank(r: int) -> None:
        store = master if r == 0 else dist.TCPStore("127.0.0.1", port, n, False, timeout=timedelta(seconds=20))
        pg = dist.ProcessGroupGloo(dist.PrefixStore("w", store), r, n, timedelta(seconds=20))
        if background:
            arrival = BackgroundAllReduce(deltas[r].clone(), lambda: [pg], dcfg, scale=n, tokens=tokens[r]).wait()
            assert arrival.error is None and arrival.buffer is not None
            out[r] = arrival.buffer
            return
        torch.manual_seed(0)
        model = nn.Linear(16, 20)   # the same start on every rank
        outer = OuterState(model, dcfg)
        with torch.no_grad():
            model.weight.sub_(deltas[r][:320].view(20, 16))
            model.bias.sub_(deltas[r][320:])
        contributors = list(range(n))
        weight = token_weight(tokens, contributors, r)
        sync_pseudo_gradient(outer, pg, dcfg, zeros=False, scale=n, weight=weight)
        out[r] = outer.flat.grad.clone()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(out) == n, "a rank of the gloo group did not finish"
    return [out[r] for r in range(n)]


@pytest.mark.parametrize("tokens", [[4096, 1024, 2048], [3000, 0, 1000]], ids=["unequal", "one-node-idle"])
def test_token_weighted_all_reduce_equals_the_one_process_rule(tokens):
    gen = torch.Generator().manual_seed(1)
    deltas = [torch.randn(340, generator=gen) for _ in tokens]
    deltas[tokens.index(min(tokens))] *= 0 if min(tokens) == 0 else 1   # a node with no step did not move
    reference = weighted_average(deltas, tokens)
    got = _weighted_sync_over_gloo(deltas, tokens, "none")
    for g in got:
        torch.testing.assert_close(g, reference, rtol=1e-5, atol=1e-6)
    # Not the uniform average: the weighting is what the all-reduce computed.
    assert not torch.allclose(reference, sum(deltas) / len(deltas), atol=1e-3)


def test_token_weighted_all_reduce_with_int8_stays_near_the_rule():
    tokens = [4096, 1024, 2048]
    gen = torch.Generator().manual_seed(2)
    deltas = [torch.randn(340, generator=gen) for _ in tokens]
    reference = weighted_average(deltas, tokens)
    got = _weighted_sync_over_gloo(deltas, tokens, "int8")
    assert all(torch.equal(g, got[0]) for g in got)   # every node applies the same bits
    assert (got[0] - reference).norm() / reference.norm() < 0.05


def test_weights_and_run_step():
    assert token_weight([300, 100, 0], [0, 1, 2], 0) == 0.75
    assert token_weight([300, 100, 0], [0, 1, 2], 2) == 0.0
    assert token_weight([300, 100, 50], [0, 1], 2) == 0.0          # not a contributor: sends zeros
    assert token_weight([0, 0], [0, 1], 0) == 0.0                  # nobody trained: no update
    assert weighted_average([torch.ones(2)], [0]) is None
    # Every contributor started the round at step 80: the furthest one's steps move the run.
    assert run_step([120, 107, 95], [40, 27, 15], [1, 2], None) == (107, [])
    # Issue 40: a node that claims 180 more steps than it trained is not believed (named as ahead)...
    assert run_step([300, 107, 95], [40, 27, 15], [0, 1, 2], None) == (107, [0])
    # ... nor, with diloco.clip = 2, a round claimed over 2 x the median round (its start is right).
    assert run_step([260, 107, 95], [180, 27, 15], [0, 1, 2], 2.0) == (80 + 54, [])


# -- the round clock ----------------------------------------------------------------------------------
def _steps_until_over(rc: RoundClock, clock: FakeClock, step_s: float, step: int = 0) -> int:
    rc.start()
    while True:
        clock.now += step_s
        step += 1
        if rc.over(step):
            return rc.steps


def test_round_ends_at_the_last_step_that_fits_the_budget():
    clock = FakeClock()
    rc = RoundClock(1.0, 10_000, 256, clock=clock)
    assert _steps_until_over(rc, clock, 0.3) == 3      # 0.9 s; a fourth step would end at 1.2 s
    assert _steps_until_over(rc, clock, 0.12) == 8     # the estimate follows a node that got faster (0.96 s)
    assert rc.work().tokens == rc.work().steps * 256
    slow = RoundClock(1.0, 10_000, 256, clock=clock)
    assert _steps_until_over(slow, clock, 0.6) == 1    # a second step would overshoot: the slow node idles instead


def test_a_fragment_launches_when_its_part_of_the_budget_ends_within_tau_steps():
    """Streaming: a budget of 6 s over two fragment boundaries is 3 s a part; with tau = 2 and steps of 0.5 s
    the launch comes after step 4 (2 s, and 3 more steps would end at 3.5 s), the boundary 2 steps later."""
    clock = FakeClock()
    rc = RoundClock(6.0, 10_000, 1, clock=clock, parts=2)
    rc.start()
    decided = []
    for step in range(1, 5):
        clock.now += 0.5
        decided.append(rc.over(step, lead=2))
    assert decided == [False, False, False, True]
    rc.tick()
    rc.tick()
    assert rc.work().steps == 6


def test_fragment_parts_take_turns_and_end_at_the_runs_last_step():
    """The part's fragment is the run's outer step mod P; a part resumed with its fragment in flight (a
    checkpoint kept the average) applies tau steps on without launching again; the run's last step is a
    boundary whatever the budget."""
    from zb.diloco.fragment_rounds import FragmentRounds

    clock = FakeClock()
    rc = RoundClock(100.0, 20, 1, clock=clock, parts=2)
    parts = FragmentRounds(rc, fragments=2, delay=2)
    rc.start()
    parts.begin(outer_step=5, launched=True)
    seen = []
    for step in (11, 12):
        clock.now += 0.1
        seen.append(parts.sync_points(step))
    assert seen == [(None, None), (None, 1)]
    rc.start()
    parts.begin(outer_step=6, launched=False)
    seen, tokens = [], []
    for step in range(13, 21):
        clock.now += 0.1
        seen.append(parts.sync_points(step))
        if seen[-1][0] is not None:
            tokens.append(parts.take_tokens(seen[-1][0]))   # what the launch takes (StreamingAlgorithm)
    assert seen[:5] == [(None, None)] * 5 and seen[5:] == [(0, None), (None, None), (None, 0)]  # 18 + tau = 20
    assert tokens == [8] and parts.take_tokens(0) == 2 and parts.take_tokens(1) == 10   # steps since each launch


def test_a_part_too_short_for_tau_steps_is_refused_early(caplog):
    clock = FakeClock()
    rc = RoundClock(2.0, 10_000, 1, clock=clock, parts=2)   # 1 s a boundary, steps of 0.6 s, tau = 1
    rc.start()
    clock.now += 0.6
    assert rc.over(1, lead=1)          # launched after its first step: the part ends at 1.2 s
    with pytest.raises(InvalidInput, match=r"diloco.round_seconds = 2 gives each of its 2 fragment boundaries 1 s, "
                                           r"shorter than diloco.fragment_delay \+ 1 = 2 inner steps"):
        rc.start()
        clock.now += 0.6
        rc.over(1, lead=1)


def test_round_ends_at_the_last_step_of_the_run():
    clock = FakeClock()
    rc = RoundClock(100.0, 12, 1, clock=clock)
    assert _steps_until_over(rc, clock, 0.1, step=10) == 2


def test_a_budget_shorter_than_one_step_is_refused_early_and_tolerated_later(caplog):
    clock = FakeClock()
    rc = RoundClock(0.5, 10_000, 1, clock=clock)
    assert _steps_until_over(rc, clock, 2.0) == 1       # every round has at least one step
    with pytest.raises(InvalidInput, match=r"diloco.round_seconds = 0.5 is shorter than one inner step on this node"):
        _steps_until_over(rc, clock, 2.0)
    later = RoundClock(0.5, 10_000, 1, clock=clock)
    for _ in range(5):
        _steps_until_over(later, clock, 0.1)
    for _ in range(3):
        assert _steps_until_over(later, clock, 2.0) == 1   # the node slowed down mid-run: one step per round
    assert "now takes longer than diloco.round_seconds" in caplog.text


# -- refusals -----------------------------------------------------------------------------------------
def test_streaming_with_a_round_budget_drops_the_fixed_rounds_checks():
    """The clock cuts the round into the fragments' parts: inner_steps / fragments need not divide or hold tau."""
    cfg = load_config([], {"diloco.round_seconds": "5", "diloco.overlap": "streaming", "diloco.fragments": "3",
                           "diloco.fragment_delay": "40"}, environ={})
    assert (cfg.diloco.fragments, cfg.diloco.fragment_delay) == (3, 40)
    with pytest.raises(InvalidInput, match="diloco.fragments .*must divide diloco.inner_steps"):
        load_config([], {"diloco.overlap": "streaming", "diloco.fragments": "3"}, environ={})


def test_round_seconds_config_checks():
    with pytest.raises(InvalidInput, match="diloco.round_seconds .*must be positive"):
        load_config([], {"diloco.round_seconds": "0"}, environ={})
    cfg = load_config([], {"diloco.round_seconds": "2", "ckpt.interval": "7", "ckpt.path": "/tmp/x"}, environ={})
    assert cfg.diloco.round_seconds == 2.0   # ckpt.interval need not be a multiple of H: rounds have no H


# -- real nodes ---------------------------------------------------------------------------------------
def _check_agreement(run: TrainCluster, uids: list[str], batch: dict[str, int], seq: int,
                     streaming: bool = False) -> list[list[dict]]:
    """Every node's outer steps agree (params, steps, tokens, weights). Under eager the first outer step has
    no average yet, and the run's close (the last average) is its own event. Under streaming the weights are
    of the tokens since each node's last launch of the fragment (held against a reference in-process):
    here they sum to 1, and the fragments take turns."""
    events = [[e for e in run.metrics(u, "outer_step") if not e.get("closing")] for u in uids]
    assert len(events[0]) >= 2 and all(len(e) == len(events[0]) for e in events), [len(e) for e in events]
    previous = 0
    for i, per_node in enumerate(zip(*events)):
        first = per_node[0]
        assert all(e["applied"] for e in per_node) or (i == 0 and not any(e["applied"] for e in per_node))
        assert len({e["params_hash"] for e in per_node}) == 1, per_node          # the same params everywhere
        assert all(e["step"] == first["step"] and e["round_steps"] == first["round_steps"] for e in per_node)
        steps = first["round_steps"]
        assert first["round_tokens"] == sum(steps[u] * batch[u] * seq for u in uids)
        assert first["step"] == previous + max(steps.values())                  # the furthest node's step
        previous = first["step"]
        weights = {e["node"]: e["round_weight"] for e in per_node}
        if streaming:
            assert sum(weights.values()) == pytest.approx(1.0, abs=1e-5) and first["fragment"] == i % 2
            continue
        for u in uids:
            assert weights[u] == pytest.approx(steps[u] * batch[u] * seq / first["round_tokens"], abs=1e-5)
    return events


STREAMING = ("--diloco.overlap", "streaming", "--diloco.fragments", "2", "--diloco.fragment_delay", "1")


SENDERS = ("--diloco.compression", "sparse", "--diloco.sparse_average", "senders")


@pytest.mark.parametrize("overlap", ["none", pytest.param("eager", marks=pytest.mark.soak), "streaming",
                                     pytest.param("none-senders", marks=pytest.mark.soak),
                                     pytest.param("streaming-senders", marks=pytest.mark.soak)])
def test_nodes_of_unlike_speed_train_the_steps_that_fit_and_agree(tmp_path, overlap):
    """Two nodes whose steps take honestly different times (4x the batch), one budget: the light node
    trains more steps per round, both agree on the params at every outer step (under eager and streaming:
    the shared params, each share weighted by its tokens; the math is held in-process against a
    reference). Streaming shares each round's budget between its two fragments' boundaries. `-senders`: sparse
    averaged over each entry's senders (the weighted rule held in-process in
    test_token_weighted_sparse_all_reduce_equals_the_one_process_rule)."""
    run = TrainCluster(tmp_path, 2)
    batch = {"n0": 8, "n1": 2}
    overlap, _, senders = overlap.partition("-")
    flags = (STREAMING if overlap == "streaming" else ("--diloco.overlap", overlap)) + (SENDERS if senders else ())
    # Streaming splits the budget between 2 fragment boundaries, each of which must fit fragment_delay + 1 steps
    # of the heavy node: 2 s leaves room for steps 4x slower than on a quiet machine (a busy CI runner).
    budget = "2" if overlap == "streaming" else "0.5"
    try:
        for i, uid in enumerate(batch):
            run.start_train(uid, "--optim.total_steps", "400", "--diloco.round_seconds", budget,
                            "--optim.batch_size", str(batch[uid]), *flags, rank=i)
        for uid in batch:
            assert run.finish(uid) == 0, run.log(uid)
        events = _check_agreement(run, list(batch), batch, seq=32, streaming=overlap == "streaming")
        steps = [e["round_steps"] for e in events[0]]
        assert sum(s["n1"] for s in steps) > sum(s["n0"] for s in steps)
        assert events[0][-1]["step"] == 400
        # The run's tokens are what the nodes reported, not an estimate.
        assert events[0][-1]["run_tokens"] == sum(e["round_tokens"] for e in events[0])
    finally:
        run.close()


CPU_CGROUP = Path("/sys/fs/cgroup/cpu")


@pytest.mark.soak
@pytest.mark.skipif(os.geteuid() != 0 or not CPU_CGROUP.is_dir(), reason="needs root and the cgroup v1 cpu controller")
def test_a_node_slowed_by_a_cpu_quota_trains_fewer_steps_and_agrees(tmp_path):
    """Three nodes, the same batch; the OS gives one a fifth of a core (cgroup CPU quota)."""
    group = CPU_CGROUP / f"zb-test-slow-{os.getpid()}"
    group.mkdir()
    run = TrainCluster(tmp_path, 3)
    try:
        (group / "cpu.cfs_quota_us").write_text("20000")
        for i, uid in enumerate(["a", "b", "slow"]):
            proc = run.start_train(uid, "--optim.total_steps", "300", "--diloco.round_seconds", "1.0", rank=i)
            if uid == "slow":
                (group / "cgroup.procs").write_text(str(proc.pid))
        for uid in ["a", "b", "slow"]:
            assert run.finish(uid, timeout=400) == 0, run.log(uid)
        events = _check_agreement(run, ["a", "b", "slow"], {"a": 4, "b": 4, "slow": 4}, seq=32)
        steps = [e["round_steps"] for e in events[0]]
        assert sum(s["slow"] for s in steps) < min(sum(s["a"] for s in steps), sum(s["b"] for s in steps))
    finally:
        run.close()
        for pid in (group / "cgroup.procs").read_text().split():
            (CPU_CGROUP / "cgroup.procs").write_text(pid)
        group.rmdir()


@pytest.mark.parametrize("overlap", ["none", pytest.param("streaming", marks=pytest.mark.soak)])
def test_a_joiner_takes_the_runs_step_and_agrees(tmp_path, overlap):
    """Two nodes train with a time budget; a third joins after outer step 2 (blocking join) and trains
    rounds with them: it receives the run's step and holds the run's params at every shared outer step."""
    run = TrainCluster(tmp_path, 2)
    args = ("--optim.total_steps", "100000", "--diloco.round_seconds", "0.4",
            *(STREAMING if overlap == "streaming" else ()))
    try:
        for i in range(2):
            run.start_train(f"n{i}", *args, rank=i)
        run.wait_outer("n0", 2)
        run.start_train("late", *args, rank=2)
        run.wait_outer("late", 3)
        for uid in ("n0", "n1", "late"):
            run.procs[uid].send_signal(signal.SIGTERM)
        for uid in ("n0", "n1", "late"):
            assert run.finish(uid) == 128 + signal.SIGTERM, run.log(uid)
        by_step = [{e["step"]: e for e in run.metrics(u, "outer_step")} for u in ("n0", "n1", "late")]
        shared = sorted(set(by_step[0]) & set(by_step[1]) & set(by_step[2]))
        assert len(shared) >= 2, [sorted(b) for b in by_step]
        for step in shared:
            assert len({b[step]["params_hash"] for b in by_step}) == 1, step
        late = run.metrics("late", "outer_step")
        assert "late" not in late[0]["round_steps"]      # its first outer step: zeros, weight 0, state received
        assert late[0]["round_weight"] == 0.0
        assert any("late" in e["round_steps"] and e["round_steps"]["late"] > 0 for e in late[1:])
    finally:
        run.close()


def test_checkpoints_at_outer_steps_and_resume(tmp_path):
    """Checkpoints land at the outer steps that pass each multiple of ckpt.interval, at the same step on
    both nodes; a restart of the whole run resumes the agreed one and the nodes agree to the end."""
    def start(run: TrainCluster, *extra: str) -> None:
        for i, uid in enumerate(("n0", "n1")):
            run.start_train(uid, "--optim.total_steps", "120", "--diloco.round_seconds", "0.3",
                            "--optim.batch_size", ["8", "4"][i], "--ckpt.path", str(tmp_path / "ckpt" / uid),
                            "--ckpt.interval", "25", "--ckpt.ram_dir", str(tmp_path / "shm"), *extra, rank=i)
        for uid in ("n0", "n1"):
            assert run.finish(uid) == 0, run.log(uid)

    first = TrainCluster(tmp_path, 2)
    try:
        start(first, "--train.max_steps", "60")
        saved = [[e["step"] for e in first.metrics(u, "checkpoint") if not e.get("final")] for u in ("n0", "n1")]
        outer_steps = {e["step"] for e in first.metrics("n0", "outer_step")}
        assert saved[0] == saved[1] and saved[0] and set(saved[0]) <= outer_steps, (saved, outer_steps)
        assert all(s // 25 > p // 25 for p, s in zip([0, *saved[0]], saved[0]))
    finally:
        first.close()
    again = TrainCluster(tmp_path, 2)
    try:
        start(again, "--ckpt.resume", "latest")
        for uid in ("n0", "n1"):
            assert "resumed from" in (tmp_path / f"{uid}.log").read_text()
        _check_agreement_from(again, ("n0", "n1"), after=60)
    finally:
        again.close()


def _check_agreement_from(run: TrainCluster, uids, after: int) -> None:
    events = [[e for e in run.metrics(u, "outer_step") if e["step"] > after] for u in uids]
    assert events[0] and all(len(e) == len(events[0]) for e in events)
    for per_node in zip(*events):
        assert len({e["params_hash"] for e in per_node}) == 1 and len({e["step"] for e in per_node}) == 1
    assert events[0][-1]["step"] == 120


def test_nodes_of_two_local_ranks_end_their_rounds_together(tmp_path):
    """Each node's two FSDP ranks agree on when the round ends (else FSDP's collectives would hang)."""
    run = TrainCluster(tmp_path, 2)
    batch = {"n0": 8, "n1": 4}
    try:
        for i, uid in enumerate(batch):
            run.start_train(uid, "--optim.total_steps", "60", "--diloco.round_seconds", "0.5",
                            "--optim.batch_size", str(batch[uid]), local_ranks=2, rank=i)
        for uid in batch:
            assert run.finish(uid) == 0, run.log(uid)
        _check_agreement(run, list(batch), batch, seq=32)
    finally:
        run.close()


def test_the_last_round_shrinks_so_no_node_waits_for_the_end():
    clock = FakeClock()
    rc = RoundClock(1.0, 100, 1, clock=clock)
    rc.start(run_step=90, last_max_steps=20)          # the furthest node did 20 steps last round; 10 remain
    assert rc.round_budget_s == 0.5
    rc.start(run_step=60, last_max_steps=20)
    assert rc.round_budget_s == 1.0


def test_a_budget_shorter_than_one_step_exits_2_in_one_line(tmp_path):
    run = TrainCluster(tmp_path, 1)
    try:
        run.start_train("n0", "--optim.total_steps", "50", "--diloco.round_seconds", "0.001", rank=0)
        assert run.finish("n0") == 2, run.log("n0")
        log = (tmp_path / "n0.log").read_text()
        assert "Traceback" not in log
        assert "error: diloco.round_seconds = 0.001 is shorter than one inner step on this node" in log
    finally:
        run.close()


@pytest.mark.parametrize("background", [False, True], ids=["blocking", "streaming"])
@pytest.mark.parametrize("average", ["nodes", "senders"])
def test_token_weighted_sparse_all_reduce_equals_the_one_process_rule(average, background):
    """Sparse with a round budget: each node compresses its token-weighted pseudo-gradient bucket by bucket; the
    sum of the decoded payloads (not divided) is the same bits on every node as in one process. Under
    diloco.sparse_average = senders each node sends weight x nodes of its pseudo-gradient, and each entry is the
    mean of what its senders sent (sparse_twins.marks counts them)."""
    from zb.collectives import sparse_twins
    from zb.collectives.sparse_twins import SparseScheme
    from zb.diloco.sync import bucket_ranges

    tokens = [4096, 1024, 2048]
    gen = torch.Generator().manual_seed(3)
    deltas = [torch.randn(340, generator=gen) for _ in tokens]
    got = _weighted_sync_over_gloo(deltas, tokens, "sparse", average, background)
    assert all(torch.equal(g, got[0]) for g in got)
    scheme, want, count = SparseScheme(16, 8), torch.zeros(340), torch.zeros(340)
    factor = len(tokens) if average == "senders" else 1
    for a, b in bucket_ranges(340, 100):
        for r, d in enumerate(deltas):
            payload = torch.empty(scheme.payload_bytes(b - a), dtype=torch.uint8)
            sparse_twins.compress(d[a:b] * (token_weight(tokens, [0, 1, 2], r) * factor), payload, scheme)
            assert sparse_twins.decode_add(payload, want[a:b], scheme)
            sparse_twins.decode_add(sparse_twins.marks(payload, b - a, scheme), count[a:b], scheme)
    if average == "senders":
        assert 0 < int((count == sparse_twins.MARK).sum()) < int((count > 0).sum())   # entries of 1 and of more
        want /= (count / sparse_twins.MARK).clamp(min=1)
    torch.testing.assert_close(got[0], want, rtol=0, atol=1e-6)
