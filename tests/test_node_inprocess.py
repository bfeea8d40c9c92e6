"""The DiLoCo node's decision paths in one process (tests/fake_world.py): each test is milliseconds to
seconds, and each fails when its rule breaks. The outer-step math is checked against single-process
references written here from the papers' rules, not from zb's code."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from fake_world import FakeClock, TinyModel, start_world, together

from zb.collectives import sparse_twins
from zb.collectives.sparse_twins import SparseScheme
from zb.diloco.checkin import Role, make_plan
from zb.elastic import keys
from zb.elastic.store_state import evicted_ids
from zb.elastic.tcpstore import read_many
from zb.errors import InvalidInput


def deltas(n_nodes: int, rounds: int, numel: int, seed: int = 1) -> list[list[torch.Tensor]]:
    """What each node's inner steps move its params by, per round (params -= delta)."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(numel, generator=g) * 0.01 for _ in range(n_nodes)] for _ in range(rounds)]


def outer_sgd(params: torch.Tensor) -> torch.optim.SGD:
    """zb's default outer optimizer (diloco.outer_lr 0.7, momentum 0.9, Nesterov) on `params`."""
    return torch.optim.SGD([params], lr=0.7, momentum=0.9, nesterov=True)


def blocking_reference(start: torch.Tensor, moves: list[list[torch.Tensor]]) -> torch.Tensor:
    """DiLoCo (Douillard et al.): every round, every node trains from the outer params; the outer
    optimizer steps with the average of (outer params - node params)."""
    theta = torch.nn.Parameter(start.clone())
    opt = outer_sgd(theta)
    for round_moves in moves:
        theta.grad = torch.stack(round_moves).mean(0)   # outer - (outer - delta) = delta
        opt.step()
    return theta.detach()


def eager_reference(start: torch.Tensor, moves: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The eager rule (zb.diloco.eager, equation 1), each node with its own whole outer optimizer:
    node m applies D~_m(r) = Dbar(r-1) + D_m(r)/M - D_m(r-1)/M to its own outer params. Returns each
    node's params after the last round, before the run's closing average."""
    m = len(moves[0])
    thetas = [torch.nn.Parameter(start.clone()) for _ in range(m)]
    opts = [outer_sgd(t) for t in thetas]
    previous = [torch.zeros_like(start) for _ in range(m)]
    for round_moves in moves:
        average = torch.stack(previous).mean(0)
        for i in range(m):
            thetas[i].grad = average + round_moves[i] / m - previous[i] / m
            opts[i].step()
        previous = list(round_moves)
    return [t.detach() for t in thetas]


def run_rounds(nodes, moves) -> None:
    """Each round: every node trains its move (from where its params stand), then the outer step."""
    for round_moves in moves:
        for node, move in zip(nodes, round_moves):
            node.train(move)
        together(nodes, lambda n: n.outer_step())


def test_blocking_outer_steps_equal_the_single_process_math():
    world, nodes = start_world(["a", "b", "c"])
    start = TinyModel().flat()
    moves = deltas(3, 3, start.numel())
    run_rounds(nodes, moves)
    expected = blocking_reference(start, moves)
    for node in nodes:
        assert torch.allclose(node.model.flat(), expected, atol=1e-6)
        assert node.reports[-1].applied and node.reports[-1].num_peers == 3
    assert len({n.reports[-1].params_hash for n in nodes}) == 1


def test_eager_outer_steps_equal_the_single_process_eager_rule():
    """Each node's params after every round are its own outer params under the eager rule (the
    shared + own split is exact up to rounding)."""
    world, nodes = start_world(["a", "b", "c"], **{"diloco.overlap": "eager"})
    start = TinyModel().flat()
    moves = deltas(3, 3, start.numel())
    run_rounds(nodes, moves)
    expected = eager_reference(start, moves)
    for node, theta in zip(nodes, expected):
        assert torch.allclose(node.model.flat(), theta, atol=1e-5)
    # The shared part moved with the averages only: the same on every node.
    assert len({n.reports[-1].params_hash for n in nodes}) == 1


def test_eager_close_ends_every_node_on_the_consensus_model():
    world, nodes = start_world(["a", "b"], **{"diloco.overlap": "eager"})
    start = TinyModel().flat()
    moves = deltas(2, 2, start.numel())
    run_rounds(nodes, moves)
    together(nodes, lambda n: n.diloco.close_run(n.position))
    # The consensus model: the shared params stepped with every round's average, in order.
    expected = blocking_reference(start, moves)
    for node in nodes:
        assert torch.allclose(node.model.flat(), expected, atol=1e-5)


def delayed_reference(start: torch.Tensor, moves: list[list[torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive one-round delay (the eager paper's baseline, arXiv 2502.12996): every round starts from the
    shared params; at the end of round r they step with round r-1's average, so round r's average waits one
    round. Returns (the params every node trains round R+1 from, the params after the run's closing average)."""
    theta = torch.nn.Parameter(start.clone())
    opt = outer_sgd(theta)
    previous = None
    for round_moves in moves:
        if previous is not None:
            theta.grad = previous
            opt.step()
        previous = torch.stack(round_moves).mean(0)
    before_close = theta.detach().clone()
    theta.grad = previous
    opt.step()
    return before_close, theta.detach()


def test_delayed_outer_steps_equal_the_single_process_one_round_delay():
    """diloco.overlap = delayed: nothing local; every node trains each round from the shared params, stepped with
    the average of two rounds before; the close applies the last one."""
    world, nodes = start_world(["a", "b", "c"], **{"diloco.overlap": "delayed"})
    start = TinyModel().flat()
    moves = deltas(3, 3, start.numel())
    run_rounds(nodes, moves)
    before_close, after_close = delayed_reference(start, moves)
    for node in nodes:
        assert torch.allclose(node.model.flat(), before_close, atol=1e-6)
    assert [r.applied for r in nodes[0].reports] == [False, True, True]   # the first boundary has nothing in flight
    assert len({n.reports[-1].params_hash for n in nodes}) == 1
    together(nodes, lambda n: n.diloco.close_run(n.position))
    for node in nodes:
        assert torch.allclose(node.model.flat(), after_close, atol=1e-6)


def test_streaming_fragments_step_the_shared_params_with_their_averages():
    """Streaming with tau = 0 and alpha = 0: each fragment's sync replaces it with the shared params
    stepped by the fragment's average, so after a whole round every node holds the shared params."""
    flags = {"diloco.overlap": "streaming", "diloco.fragments": "2", "diloco.fragment_delay": "0",
             "diloco.fragment_alpha": "0"}
    world, nodes = start_world(["a", "b"], **flags)
    start = TinyModel().flat()
    moves = deltas(2, 1, start.numel())[0]
    for node, move in zip(nodes, moves):
        node.train(move)
    for step in (2, 4):   # H = 4, two fragments: fragment 0 syncs at step 2, fragment 1 at step 4
        def sync(n, step=step):
            launch, apply = n.diloco.sync_points(step)
            assert launch == apply is not None   # tau = 0: launched and applied at the same step
            n.diloco.launch_fragment(launch)
            return n.outer_step()
        reports = together(nodes, sync)
        assert all(r.applied for r in reports) and {r.fragment for r in reports} == {step // 2 - 1}
    # Every fragment took one outer step with the average of its part of the moves: the blocking math.
    expected = blocking_reference(start, [moves])
    for node in nodes:
        assert torch.allclose(node.model.flat(), expected, atol=1e-6)


def test_a_non_finite_pseudo_gradient_is_skipped_everywhere_and_its_node_reset():
    world, nodes = start_world(["a", "b", "c"])
    start = TinyModel().flat()
    moves = deltas(3, 1, start.numel())[0]
    moves[1] = moves[1].clone()
    moves[1][0] = math.nan
    for node, move in zip(nodes, moves):
        node.train(move)
    reports = together(nodes, lambda n: n.outer_step())
    assert not any(r.applied for r in reports)
    assert torch.equal(nodes[1].model.flat(), start)          # the offender restarts from the outer params
    assert torch.allclose(nodes[0].model.flat(), start - moves[0])   # the others keep their inner progress
    assert len({r.params_hash for r in reports}) == 1         # nobody's outer params moved


def test_a_lagging_node_receives_the_run_state_instead_of_contributing():
    """A node whose outer step is behind the run's (it was frozen) sends zeros and gets the state."""
    world, nodes = start_world(["a", "b", "c"])
    start = TinyModel().flat()
    moves = deltas(3, 1, start.numel())[0]
    for node, move in zip(nodes, moves):
        node.train(move)
    nodes[0].position = nodes[1].position = type(nodes[0].position)(step=8, outer_step=1)
    reports = together(nodes, lambda n: n.outer_step())
    assert reports[0].num_peers == 2 and not reports[2].applied
    expected = blocking_reference(start, [moves[:2]])
    assert torch.allclose(nodes[2].model.flat(), expected, atol=1e-6)
    assert nodes[2].position.outer_step == nodes[0].position.outer_step == 2   # it took the run's position
    assert nodes[2].diloco.roles.contributing


def test_a_node_readmitted_after_an_eviction_receives_the_state():
    world, nodes = start_world(["a", "b"])
    start = TinyModel().flat()
    moves = deltas(2, 1, start.numel())[0]
    for node, move in zip(nodes, moves):
        node.train(move)
    nodes[1].diloco.steps.fresh_view = nodes[0].diloco.steps.fresh_view = False
    world.set_world(["a", "b"], joined=("b",))   # b was dropped while frozen, and admitted again
    reports = together(nodes, lambda n: n.outer_step())
    assert reports[0].num_peers == 1 and reports[0].applied and not reports[1].applied
    expected = blocking_reference(start, [moves[:1]])
    assert torch.allclose(nodes[1].model.flat(), expected, atol=1e-6)
    assert nodes[1].diloco.roles.contributing


def test_a_blocking_joiner_takes_the_state_at_its_first_outer_step():
    world, nodes = start_world(["a", "b"])
    start = TinyModel().flat()
    moves = deltas(2, 1, start.numel())[0]
    for node, move in zip(nodes, moves):
        node.train(move)
    together(nodes, lambda n: n.outer_step())
    from fake_world import make_node, node_config
    world.set_world(["a", "b", "j"], joined=("j",))
    joiner = make_node(world, "j", node_config(), seed=7)        # different weights: it must not contribute them
    starts = together([*nodes, joiner], lambda n: n.diloco.start() if n is joiner else n.diloco.mesh.resolve())
    assert joiner.diloco.roles.role == Role.NEEDS_STATE and starts[0].mesh_version == 2
    for node in nodes:
        node.diloco.steps.fresh_view = True   # the resolution above is this outer step's
    moves2 = deltas(3, 1, start.numel(), seed=2)[0]
    for node, move in zip(nodes, moves2):
        node.train(move)
    together([*nodes, joiner], lambda n: n.outer_step())
    expected = blocking_reference(start, [moves, moves2[:2]])
    for node in (*nodes, joiner):
        assert torch.allclose(node.model.flat(), expected, atol=1e-6)
    assert joiner.position == nodes[0].position and joiner.diloco.roles.contributing


def test_a_failed_attempt_is_retried_without_the_dead_peer():
    world, nodes = start_world(["a", "b", "c"])
    start = TinyModel().flat()
    moves = deltas(3, 1, start.numel())[0]
    for node, move in zip(nodes, moves):
        node.train(move)
    world.kill_in(world.version, "c")
    reports = together(nodes[:2], lambda n: n.outer_step())
    assert [r.attempts for r in reports] == [2, 2] and all(r.applied and r.num_peers == 2 for r in reports)
    expected = blocking_reference(start, [moves[:2]])
    assert torch.allclose(nodes[0].model.flat(), expected, atol=1e-6)


def test_every_attempt_failing_skips_the_outer_step_and_keeps_the_inner_progress(caplog):
    world, nodes = start_world(["a", "b"], **{"diloco.retry_all_reduce": "0"})
    start = TinyModel().flat()
    moves = deltas(2, 1, start.numel())[0]
    for node, move in zip(nodes, moves):
        node.train(move)
    world.broken[world.version] = "nobody"    # every collective of this version fails, nobody is dropped
    reports = together(nodes, lambda n: n.outer_step())
    assert not any(r.applied for r in reports) and reports[0].attempts == 1
    assert torch.allclose(nodes[0].model.flat(), start - moves[0])
    assert "outer step skipped after 1 failed check-ins" in caplog.text


@pytest.mark.parametrize("overlap", ["none", "eager"])
def test_checkpoint_tensors_round_trip(overlap):
    world, nodes = start_world(["a"], **{"diloco.overlap": overlap})
    start = TinyModel().flat()
    run_rounds(nodes, deltas(1, 2, start.numel()))
    saved = {k: v.clone() for k, v in nodes[0].diloco.checkpoint_tensors().items()}
    assert any(k.startswith("own/") for k in saved) == (overlap == "eager")
    nodes[0].diloco.load_checkpoint_tensors(saved)
    assert all(torch.equal(saved[k], v) for k, v in nodes[0].diloco.checkpoint_tensors().items())


def test_progress_is_published_after_the_store_client_was_dropped():
    """Chaos seed 6: the store restarted, an outer step dropped the client (store = None), and the
    next outer step's progress publication crashed the node with an AttributeError. It reconnects."""
    from types import SimpleNamespace

    from zb.diloco.live import read_progress

    world, nodes = start_world(["a"])
    node = nodes[0]
    node.diloco.live = SimpleNamespace(publish=lambda outer, position: None)   # a sidecar that serves nothing
    node.diloco.store = None
    run_rounds(nodes, deltas(1, 1, TinyModel().flat().numel()))
    assert node.diloco.store is not None and read_progress(world.store) == {"outer_step": 1, "step": 4}


def test_claims_go_back_into_a_restarted_store_and_are_not_rewritten_otherwise():
    """The run's fingerprint and the node's data slot are written again only into a store reached through a
    new client (a restarted, empty one): not at every outer step, where they cost two round trips."""
    from zb.diloco.claims import FINGERPRINT_KEY

    world, nodes = start_world(["a"])
    moves = deltas(1, 3, TinyModel().flat().numel())
    run_rounds(nodes, moves[:1])
    assert world.store.check([FINGERPRINT_KEY])
    world.store.delete_key(FINGERPRINT_KEY)
    run_rounds(nodes, moves[1:2])
    assert not world.store.check([FINGERPRINT_KEY]), "claims rewritten at an outer step with the same store"
    world.restart_store()
    nodes[0].diloco.store = None      # the write that found the old store gone dropped its client
    run_rounds(nodes, moves[2:])
    assert world.store.check([FINGERPRINT_KEY]) and world.store.get(FINGERPRINT_KEY)


# -- the overlapped algorithms' decision paths ----------------------------------------------------------
EAGER = {"diloco.overlap": "eager"}
STREAMING = {"diloco.overlap": "streaming", "diloco.fragments": "2", "diloco.fragment_delay": "1",
             "diloco.fragment_alpha": "0.5"}


def train_and_sync(nodes, moves_of_round, steps=(4,)):
    """One round's moves, then each sync point: streaming launches at its step minus tau, applies at its
    step (H = 4: fragment 0 launched after step 1, applied after step 2; fragment 1 after 3 and 4)."""
    for node, move in zip(nodes, moves_of_round):
        node.train(move)
    reports = []
    for step in steps:
        def boundary(n, step=step):
            launch, apply = n.diloco.sync_points(step)
            if launch is not None:
                n.diloco.launch_fragment(launch)
            return n.outer_step() if apply is not None else None
        reports.append(together(nodes, boundary))
    return reports


STREAM_STEPS = (1, 2, 3, 4)


@pytest.mark.parametrize("flags, steps", [(EAGER, (4,)), (STREAMING, STREAM_STEPS)], ids=["eager", "streaming"])
def test_overlap_a_non_finite_pseudo_gradient_is_skipped_everywhere(flags, steps):
    world, nodes = start_world(["a", "b"], **flags)
    numel = TinyModel().flat().numel()
    moves = deltas(2, 3, numel)
    moves[0][1] = torch.full((numel,), math.nan)     # b's first round is poisoned
    reports = [r for rnd in moves for r in train_and_sync(nodes, rnd, steps) if r is not None and r[0] is not None]
    assert all(torch.isfinite(n.model.flat()).all() for n in nodes), "the offender restarts from the outer params"
    # The averages that carry b's NaN are skipped on every node alike; the shared params never diverge.
    skipped = [rs for rs in reports if not rs[0].applied]
    assert skipped and all(not r.applied for rs in skipped for r in rs)
    assert all(rs[0].params_hash == rs[1].params_hash for rs in reports)
    assert any(rs[0].applied for rs in reports[len(skipped):]), "later averages apply again"


@pytest.mark.parametrize("flags, steps", [(EAGER, (4,)), (STREAMING, STREAM_STEPS)], ids=["eager", "streaming"])
def test_overlap_an_average_that_failed_on_one_node_is_skipped_on_every_node(flags, steps):
    """A transfer can end on some nodes and fail on others (a peer died mid-ring): nobody applies it."""
    from zb.collectives import PeerFailure

    world, nodes = start_world(["a", "b", "c"], **flags)
    numel = TinyModel().flat().numel()
    moves = deltas(3, 2, numel)
    train_and_sync(nodes, moves[0], steps)
    state = nodes[2].diloco.algorithm.state
    real_wait = state.wait

    def failed_wait():
        arrival = real_wait()
        if arrival is not None:
            arrival.buffer, arrival.error = None, PeerFailure("the ring broke here (fake world)", rank=None)
        return arrival

    state.wait = failed_wait
    hashes_before = {n.reports[-1].params_hash for n in nodes}
    rounds = [r for r in train_and_sync(nodes, moves[1], steps) if r[0] is not None]
    assert all(not r.applied for rs in rounds for r in rs)
    assert len({n.reports[-1].params_hash for n in nodes}) == 1 and len(hashes_before) == 1


@pytest.mark.parametrize("flags, steps", [(EAGER, (4,)), (STREAMING, STREAM_STEPS)], ids=["eager", "streaming"])
def test_overlap_a_blocking_joiner_takes_the_shared_state(flags, steps):
    from fake_world import make_node, node_config

    world, nodes = start_world(["a", "b"], **flags)
    numel = TinyModel().flat().numel()
    moves = deltas(2, 2, numel)
    train_and_sync(nodes, moves[0], steps)
    world.set_world(["a", "b", "j"], joined=("j",))
    joiner = make_node(world, "j", node_config(**flags), seed=7)
    together([*nodes, joiner], lambda n: n.diloco.start() if n is joiner else n.diloco.mesh.resolve())
    for n in nodes:
        n.diloco.steps.fresh_view = True
    # The joiner takes part from its first outer step on (it sends zeros until it holds the state).
    rounds = train_and_sync([*nodes, joiner], [*moves[1], torch.zeros(numel)], steps)
    reports = [rs for rs in rounds if rs[0] is not None][-1]
    assert len({r.params_hash for r in reports}) == 1 and joiner.diloco.roles.contributing
    assert joiner.position.outer_step == nodes[0].position.outer_step
    # The joiner holds the shared params, with no eager term or merge residue of its own.
    assert torch.allclose(joiner.model.flat(), joiner.diloco.outer.flat.data, atol=1e-6)


def test_eager_a_recovered_joiner_takes_the_average_in_flight_from_the_donor(caplog):
    """A live-recovery joiner's snapshot predates the average launched at the last boundary: the donor
    sends it that average, and from then on it holds the run's shared params."""
    import logging

    from fake_world import make_node, node_config

    world, nodes = start_world(["a", "b"], **EAGER)
    numel = TinyModel().flat().numel()
    moves = deltas(2, 2, numel)
    train_and_sync(nodes, moves[0])                  # round 1: its average is now in flight
    world.set_world(["a", "b", "j"], joined=("j",))
    joiner = make_node(world, "j", node_config(**EAGER), seed=7)
    together([*nodes, joiner], lambda n: n.diloco.start() if n is joiner else n.diloco.mesh.resolve())
    # What live recovery does (zb.diloco.live): the snapshot of the shared outer state, at the run's position.
    joiner.diloco.outer.load_state_tensors(nodes[0].diloco.outer.state_tensors())
    joiner.diloco.outer.push_to_model()
    joiner.diloco.roles.joined(recovered=True)
    joiner.position = nodes[0].position
    for n in nodes:
        n.diloco.steps.fresh_view = True
    for node, move in zip(nodes, moves[1]):
        node.train(move)
    with caplog.at_level(logging.INFO, logger="zb.diloco"):
        reports = together([*nodes, joiner], lambda n: n.outer_step())
    assert all(r.applied for r in reports) and len({r.params_hash for r in reports}) == 1
    assert "took the average in flight from rank 0" in caplog.text
    assert joiner.diloco.roles.contributing and joiner.position == nodes[0].position


def test_streaming_a_recovered_joiner_takes_the_fragment_in_flight_from_the_donor(caplog):
    """Streaming: the joiner is admitted at a fragment's outer step while that fragment's average is in
    flight; the donor sends the average and names the fragment, and the joiner applies it with the run."""
    import logging

    from fake_world import make_node, node_config

    world, nodes = start_world(["a", "b"], **STREAMING)
    numel = TinyModel().flat().numel()
    moves = deltas(2, 2, numel)
    train_and_sync(nodes, moves[0], STREAM_STEPS)          # a whole round: nothing in flight at its end
    for node, move in zip(nodes, moves[1]):
        node.train(move)
    together(nodes, lambda n: n.diloco.launch_fragment(n.diloco.sync_points(1)[0]))   # fragment 0 in flight
    world.set_world(["a", "b", "j"], joined=("j",))
    joiner = make_node(world, "j", node_config(**STREAMING), seed=7)
    snapshot, position = nodes[0].diloco.outer.state_tensors(), nodes[0].position

    def recover_and_step(n):
        if n is not joiner:
            return n.outer_step()                 # step 2: fragment 0's outer step
        n.diloco.start()                          # admitted at this resolution
        # What live recovery does (zb.diloco.live): the snapshot of the shared outer state, the run's position.
        n.diloco.outer.load_state_tensors(snapshot)
        n.diloco.outer.push_to_model()
        n.diloco.roles.joined(recovered=True)
        n.position = position
        return n.outer_step()

    with caplog.at_level(logging.INFO, logger="zb.diloco"):
        reports = together([*nodes, joiner], recover_and_step)
    assert all(r.applied and r.fragment == 0 for r in reports) and len({r.params_hash for r in reports}) == 1
    assert "took the average in flight from rank 0" in caplog.text and joiner.diloco.roles.contributing


# -- the eager rule's closed forms (issue 24: eager, found out) ------------------------------------------
def test_eager_with_one_node_is_blocking_diloco():
    """M = 1: D~(r) = Dbar(r-1) + D(r) - D(r-1) = D(r), the blocking update, round after round."""
    start = TinyModel().flat()
    moves = deltas(1, 4, start.numel())
    finals = []
    for flags in ({}, EAGER):
        world, nodes = start_world(["a"], **flags)
        run_rounds(nodes, moves)
        finals.append(nodes[0].model.flat())
    assert torch.allclose(finals[0], finals[1], rtol=0, atol=1e-6), (finals[0] - finals[1]).abs().max()


def test_eager_with_outer_lr_1_and_no_momentum_has_the_closed_form():
    """Outer lr 1, momentum 0: after R rounds node m holds theta0 - sum_{r<R} Dbar(r) - D_m(R)/M, every
    round, and each round's inner steps start from there (the outer step's result, not the trained weights)."""
    flags = {**EAGER, "diloco.outer_lr": "1.0", "diloco.outer_momentum": "0"}
    world, nodes = start_world(["a", "b", "c"], **flags)
    start = TinyModel().flat()
    moves = deltas(3, 4, start.numel())
    averages = []
    for r, round_moves in enumerate(moves):
        run_rounds(nodes, [round_moves])
        for m, node in enumerate(nodes):
            expected = start - sum(averages, torch.zeros_like(start)) - round_moves[m] / 3
            assert torch.allclose(node.model.flat(), expected, atol=1e-6), (r, m)
        averages.append(torch.stack(round_moves).mean(0))


def eager_weighted_reference(start: torch.Tensor, moves: list[list[torch.Tensor]],
                             weights: list[float]) -> list[torch.Tensor]:
    """The eager rule with token-weighted shares (diloco.round_seconds): node m applies
    D~_m(r) = sum_k w_k D_k(r-1) + w_m D_m(r) - w_m D_m(r-1) with its own whole outer optimizer."""
    m = len(moves[0])
    thetas = [torch.nn.Parameter(start.clone()) for _ in range(m)]
    opts = [outer_sgd(t) for t in thetas]
    previous = [torch.zeros_like(start) for _ in range(m)]
    for round_moves in moves:
        average = sum((w * p for w, p in zip(weights, previous)), torch.zeros_like(start))
        for i in range(m):
            thetas[i].grad = average + weights[i] * round_moves[i] - weights[i] * previous[i]
            opts[i].step()
        previous = list(round_moves)
    return [t.detach() for t in thetas]


def test_eager_weighs_each_share_by_the_work_of_its_round():
    """Eager composes with rounds of unlike work (diloco.round_seconds, the swarm's micro-batches): each
    node's share is weighted by its tokens, in the eager term and in the average alike."""
    from zb.diloco.rounds import RoundWork

    work = {"a": RoundWork(2, 100), "b": RoundWork(6, 300)}
    world, nodes = start_world(["a", "b"], work=work, **EAGER)
    start = TinyModel().flat()
    moves = deltas(2, 3, start.numel())
    run_rounds(nodes, moves)
    expected = eager_weighted_reference(start, moves, [0.25, 0.75])
    for node, theta in zip(nodes, expected):
        assert torch.allclose(node.model.flat(), theta, atol=1e-5)
    assert len({n.reports[-1].params_hash for n in nodes}) == 1


# -- combinations that stay refused (docs/slow-links.md, "What overlap combines with") --------------------------------
@pytest.mark.parametrize("flag", [("--diloco.overlap", "eager"), ("--diloco.round_seconds", "5")])
def test_swarm_with_overlap_or_a_round_budget_is_refused(flag):
    from zb.config import load_config
    from zb.errors import InvalidInput

    with pytest.raises(InvalidInput, match="swarm.stages .*needs diloco.overlap = none and no diloco.round_seconds"):
        load_config([], {"swarm.stages": "2", "diloco.inner_steps": "5", flag[0][2:]: flag[1]}, environ={})


def _load_flat(model, flat: torch.Tensor) -> None:
    with torch.no_grad():
        offset = 0
        for p in model.parameters():
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def checkpoint(nodes) -> list:
    """Each node's (model params, position, checkpoint tensors), copied as the checkpoint's staging takes them."""
    return together(nodes, lambda n: (n.model.flat(), n.position,
                                      {k: v.clone() for k, v in n.diloco.checkpoint_tensors().items()}))


def restart(saved: list, flags: dict) -> list:
    """Fresh nodes (a, b, ...) of a new world that load `saved`, as a whole-run restart does."""
    _, restarted = start_world(["a", "b", "c"][:len(saved)], **flags)
    for node, (params, position, tensors) in zip(restarted, saved):
        _load_flat(node.model, params)
        node.position = position
        node.diloco.load_checkpoint_tensors(tensors)
    return restarted


def test_a_checkpoint_keeps_the_average_in_flight_and_a_restart_applies_it():
    """Eager: after round 1 the average is in flight. The checkpoint waits for it and keeps it; fresh
    nodes that load the checkpoint (model params, shared state, own term, that average) and train round
    2 end on exactly the uninterrupted nodes' params."""
    flags = {"diloco.overlap": "eager", "diloco.outer_momentum": "0"}
    world, nodes = start_world(["a", "b"], **flags)
    moves = deltas(2, 2, TinyModel().flat().numel())
    run_rounds(nodes, moves[:1])
    saved = checkpoint(nodes)
    for _, _, tensors in saved:
        assert int(tensors["inflight/part"][0]) == -1
        assert torch.allclose(tensors["inflight/average"], torch.stack(moves[0]).mean(0), atol=1e-7)
    run_rounds(nodes, moves[1:])
    restarted = restart(saved, flags)
    run_rounds(restarted, moves[1:])
    assert all(r.reports[-1].applied for r in restarted)
    for node, resumed in zip(nodes, restarted):
        assert torch.equal(node.model.flat(), resumed.model.flat())


def test_an_average_in_flight_that_does_not_fit_the_run_is_dropped_alike(caplog):
    """A streaming checkpoint's fragment average loaded by an eager run (another diloco.overlap): one line
    says it is dropped, and the next boundary has nothing to apply on any node."""
    _, nodes = start_world(["a", "b"], **{"diloco.overlap": "eager"})
    fragment = {"inflight/average": torch.zeros(3), "inflight/part": torch.tensor([1])}
    for node in nodes:
        node.diloco.load_checkpoint_tensors({**node.diloco.checkpoint_tensors(), **fragment})
    assert "does not fit this run's diloco settings" in caplog.text
    run_rounds(nodes, deltas(2, 1, TinyModel().flat().numel()))
    assert not any(n.reports[-1].applied for n in nodes)


def test_blocking_drops_what_an_overlapped_checkpoint_kept_with_one_line(caplog):
    _, (node,) = start_world(["a"])
    node.diloco.load_checkpoint_tensors({**node.diloco.checkpoint_tensors(), "own/offset": torch.zeros(1),
                                         "inflight/average": torch.zeros(1)})
    lines = [r.getMessage() for r in caplog.records if "it is dropped" in r.getMessage()]
    assert len(lines) == 2 and "eager term" in lines[0] and "average in flight" in lines[1]


# -- streaming with rounds that end by time (diloco.round_seconds) --------------------------------------------
def timed_streaming_reference(start: torch.Tensor, fragment_of: list[torch.Tensor], moves: dict[str, list],
                              schedule: dict[str, tuple[int, int]], parts: int, alpha: float) -> dict[str, torch.Tensor]:
    """Streaming DiLoCo (arXiv 2501.18512) with parts that end by time: part j syncs fragment j mod P. Node i
    trains schedule[i] = (steps before its launch, steps after) in every part; at its launch it takes the
    fragment's pseudo-gradient (outer - own) and the tokens (here: steps) since its last launch of that
    fragment; at the boundary the outer params and momentum of the fragment step with the token-weighted
    average, and each node merges: own = alpha * own + (1 - alpha) * outer."""
    outer = [torch.nn.Parameter(start[idx].clone()) for idx in fragment_of]
    opts = [outer_sgd(p) for p in outer]
    own = {u: start.clone() for u in schedule}
    counted = {u: [0] * len(fragment_of) for u in schedule}
    taken = {u: 0 for u in schedule}    # moves used so far
    for j in range(parts):
        p, idx = j % len(fragment_of), fragment_of[j % len(fragment_of)]
        sent = {}
        for u, (before, after) in schedule.items():
            for _ in range(before):
                own[u] -= moves[u][taken[u]]
                taken[u] += 1
            counted[u] = [c + before for c in counted[u]]
            sent[u] = (outer[p].detach() - own[u][idx], counted[u][p])
            counted[u][p] = 0
            for _ in range(after):
                own[u] -= moves[u][taken[u]]
                taken[u] += 1
            counted[u] = [c + after for c in counted[u]]
        total = sum(t for _, t in sent.values())
        outer[p].grad = sum(g * (t / total) for g, t in sent.values())
        opts[p].step()
        for u in own:
            own[u][idx] = alpha * own[u][idx] + (1 - alpha) * outer[p].detach()
    return own


def test_streaming_with_a_round_budget_weighs_each_fragment_by_the_tokens_behind_it():
    """Two nodes of unlike speed (steps of 1 s and 2.5 s on their own clocks), a budget of 12 s shared by two
    fragment boundaries, tau = 1: the fast node launches after 5 steps and applies after 6, the slow one
    after 1 and 2. Both end every part on the reference's params (each fragment's average weighted by the
    tokens since each node last launched it), agree on the shared params and move to the furthest step."""
    from zb.diloco.streaming import fragment_of_params

    flags = {**STREAMING, "diloco.round_seconds": "12", "optim.total_steps": "1000"}
    world, nodes = start_world(["fast", "slow"], **flags)
    step_s = {"fast": 1.0, "slow": 2.5}
    parts = 4
    start = TinyModel().flat()
    g = torch.Generator().manual_seed(3)
    moves = {u: [torch.randn(start.numel(), generator=g) * 0.01 for _ in range(6 * parts)] for u in step_s}

    def drive(n):
        clock = n.diloco.rounds.clock = FakeClock()
        n.diloco.begin_rounds(n.position)
        used = 0
        while len(n.reports) < parts:
            clock.now += step_s[n.uid]
            step = n.step(moves[n.uid][used])
            used += 1
            launch, apply = n.diloco.sync_points(step)
            if launch is not None:
                n.diloco.launch_fragment(launch)
            if apply is not None:
                n.outer_step()

    together(nodes, drive)
    names = [name for name, _ in nodes[0].model.named_parameters()]
    sizes = [p.numel() for p in nodes[0].model.parameters()]
    owner = fragment_of_params(names, sizes, 2)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    fragment_of = [torch.cat([torch.arange(offsets[i], offsets[i] + sizes[i]) for i in range(len(sizes))
                              if owner[i] == f]) for f in range(2)]
    expected = timed_streaming_reference(start, fragment_of, moves, {"fast": (5, 1), "slow": (1, 1)}, parts,
                                         alpha=0.5)
    for n in nodes:
        assert torch.allclose(n.model.flat(), expected[n.uid], atol=1e-6), n.uid
        assert [r.fragment for r in n.reports] == [0, 1, 0, 1]
        assert all(r.applied and r.round_steps == {"fast": 6, "slow": 2} for r in n.reports)
        assert n.position.step == 6 * parts                    # the furthest node's steps, every part
    for a, b in zip(*(n.reports for n in nodes)):
        assert a.params_hash == b.params_hash
        assert a.round_weight + b.round_weight == pytest.approx(1.0)
    # Tokens since each node's last launch of the fragment: 5 against 1, then 11 against 3, 12 against 4.
    assert [r.round_weight for r in nodes[0].reports] == pytest.approx([5 / 6, 11 / 14, 12 / 16, 12 / 16])


# -- error feedback (diloco.error_feedback) with int4 and int2, and sparse's accumulator ------------------------
PLAIN_OUTER = {"diloco.outer_lr": "1.0", "diloco.outer_momentum": "0", "diloco.nesterov": "false"}
SPARSE_BETA = 0.9   # not the default: the setting reaches the accumulator
SPARSE = {"diloco.compression": "sparse", "diloco.sparse_chunk": "16", "diloco.sparse_k": "8",
          "diloco.sparse_beta": str(SPARSE_BETA)}


def sparse_reference(start: torch.Tensor, moves: list[list[torch.Tensor]], beta: float, lr: float,
                     scheme: SparseScheme, average: str = "nodes") -> torch.Tensor:
    """SparseLoCo (arXiv 2508.15706, Algorithm 1) with zb's sparse form: every node folds its pseudo-gradient
    into its accumulator (e <- beta e + delta), sends the top-k of each chunk at 2 bits and keeps the rest; the
    outer params step by the payloads' average times the outer lr, no momentum (the accumulator is it). The
    average is over all nodes (`average` nodes: the paper's, zb's default) or each entry's over the nodes that sent
    it (senders); the senders are counted here from the decoded values, not from the marks zb decodes."""
    theta = start.clone()
    residuals = [torch.zeros_like(start) for _ in moves[0]]
    for round_moves in moves:
        total, senders = torch.zeros_like(start), torch.zeros_like(start)
        for move, residual in zip(round_moves, residuals):
            payload = torch.empty(scheme.payload_bytes(start.numel()), dtype=torch.uint8)
            sparse_twins.compress(move, payload, scheme, residual, beta)
            mine = torch.zeros_like(start)
            assert sparse_twins.decode_add(payload, mine, scheme) and sparse_twins.decode_add(payload, total, scheme)
            senders += (mine != 0).float()
        theta -= lr * (total / (senders.clamp(min=1) if average == "senders" else len(round_moves)))
    return theta


@pytest.mark.parametrize("average", ["nodes", "senders"])
@pytest.mark.parametrize("overlap", ["none", "streaming"])
def test_sparse_outer_steps_equal_the_single_process_sparseloco_rule(overlap, average):
    """Three nodes on diloco.compression = sparse end every outer step on the same bits, at SparseLoCo's rule
    computed in one process (each entry averaged over its senders, or over every node); streaming with one
    fragment, no delay and alpha 0 is the same rule."""
    flags = dict(SPARSE, **{"diloco.overlap": overlap, "diloco.sparse_average": average})
    if overlap == "streaming":
        flags.update({"diloco.fragments": "1", "diloco.fragment_delay": "0", "diloco.fragment_alpha": "0"})
    _, nodes = start_world(["a", "b", "c"], **flags)
    start = TinyModel().flat()
    moves = deltas(3, 4, start.numel())
    for round_moves in moves:
        if overlap == "streaming":
            train_and_sync(nodes, round_moves, steps=(4,))
        else:
            run_rounds(nodes, [round_moves])
        assert len({n.reports[-1].params_hash for n in nodes}) == 1 and nodes[0].reports[-1].applied
    expected = sparse_reference(start, moves, SPARSE_BETA, 0.7, SparseScheme(16, 8), average)
    assert torch.allclose(nodes[0].diloco.outer.flat.detach(), expected, atol=1e-6)
    sent = nodes[0].reports[-1].wire_bytes
    assert sent == 2 * (SparseScheme(16, 8).payload_bytes(start.numel()) + 8)   # two payloads forwarded, headers


@pytest.mark.parametrize("overlap", ["none", "eager", "streaming"])
@pytest.mark.parametrize("compression", ["int4", "int2"])
def test_error_feedback_loses_nothing_across_outer_steps(compression, overlap):
    """Outer lr 1 and no momentum: the outer params move by exactly the averages, and with error feedback
    the averages summed plus every node's residual over the node count are the moves averaged (the closed
    form of the same math, to fp32 rounding), under each algorithm; every node holds the same shared
    params. Without error feedback the same run ends further from the exact mean."""
    flags = {**PLAIN_OUTER, "diloco.compression": compression, "diloco.overlap": overlap}
    if overlap == "streaming":
        flags.update({"diloco.fragments": "2", "diloco.fragment_delay": "0", "diloco.fragment_alpha": "0"})
    start = TinyModel().flat()
    moves = deltas(3, 4, start.numel())
    ends = {}
    for feedback in ("true", "false"):
        _, nodes = start_world(["a", "b", "c"], **flags, **{"diloco.error_feedback": feedback})
        for round_moves in moves:
            if overlap == "streaming":
                train_and_sync(nodes, round_moves, steps=(2, 4))
            else:
                run_rounds(nodes, [round_moves])
        if overlap == "eager":
            together(nodes, lambda n: n.diloco.close_run(n.position))
        assert len({n.reports[-1].params_hash for n in nodes}) == 1
        shared = nodes[0].diloco.outer.flat.detach().clone()
        kept = [n.diloco.algorithm.feedback for n in nodes]
        if feedback == "true":
            residuals = sum(k.residual for k in kept)
            assert residuals.abs().sum() > 0
            if overlap == "streaming":   # the residual is laid out fragment after fragment: back to param order
                residuals = _params_order(nodes[0], residuals)
            exact = start - sum(torch.stack(m).mean(0) for m in moves)
            assert torch.allclose(shared, exact + residuals / 3, atol=2e-6), (shared - exact - residuals / 3).abs().max()
        else:
            assert all(k is None for k in kept)
        ends[feedback] = shared
    exact = start - sum(torch.stack(m).mean(0) for m in moves)
    assert (ends["true"] - exact).norm() < (ends["false"] - exact).norm()


def _params_order(node, fragment_major: torch.Tensor) -> torch.Tensor:
    """A streaming residual (fragment after fragment) in the outer params' order."""
    state = node.diloco.algorithm.state
    out = torch.zeros_like(fragment_major)
    offset = 0
    for ranges in state.ranges:
        for a, b in ranges:
            out[a:b] = fragment_major[offset:offset + b - a]
            offset += b - a
    return out


@pytest.mark.parametrize("shape, uids, far", [("auto", "abcd", False), ("halving", "abc", False),
                                              ("auto", "abcde", True)])
def test_halving_doubling_nodes_lose_nothing_and_agree(shape, uids, far, monkeypatch):
    """diloco.reduce_shape: 4 nodes on auto take halving-doubling, 3 nodes on halving fold one into another, and 5
    on auto do when their world says its links are 50 ms long (the figures a measured ring plan writes in the
    world record: each node's view carries them to pick_shape); with int4 and error feedback, outer lr 1 and
    no momentum, the outer params are the moves averaged less every node's residual over the node count (the
    closed form, to fp32 rounding), the same bits on every node."""
    import zb.collectives.allreduce as allreduce

    calls = []
    real = allreduce.run_halving
    monkeypatch.setattr(allreduce, "run_halving", lambda *a, **k: calls.append(1) or real(*a, **k))
    flags = {**PLAIN_OUTER, "diloco.compression": "int4", "diloco.reduce_shape": shape}
    world, nodes = start_world(list(uids), **flags)
    if far:   # measured once the nodes were up: the next world carries the figures (the first outer step runs in
        world.ring_mbps, world.link_ms = 100.0, 50.0    # the world the nodes started in, by the ring)
        world.set_world(list(uids))
    start = TinyModel().flat()
    moves = deltas(len(uids), 3, start.numel())
    run_rounds(nodes, moves)
    assert len({n.reports[-1].params_hash for n in nodes}) == 1
    residuals = sum(n.diloco.algorithm.feedback.residual for n in nodes)
    exact = start - sum(torch.stack(m).mean(0) for m in moves)
    shared = nodes[0].diloco.outer.flat.detach()
    halving_rounds = 2 if far else 3
    assert residuals.abs().sum() > 0 and len(calls) == halving_rounds * len(uids), "every node's syncs went halving"
    assert torch.allclose(shared, exact + residuals / len(uids), atol=2e-6), (shared - exact).abs().max()


@pytest.mark.parametrize("flags", [{"diloco.compression": "int4"}, SPARSE])
def test_error_feedback_residual_resumes_exactly_from_a_checkpoint(flags):
    """int4 with error feedback, and sparse's accumulator: fresh nodes that load a checkpoint (params, shared
    state, residual) and train on end on exactly the uninterrupted nodes' params and residuals."""
    _, nodes = start_world(["a", "b"], **flags)
    moves = deltas(2, 3, TinyModel().flat().numel())
    run_rounds(nodes, moves[:1])
    saved = checkpoint(nodes)
    assert all(tensors["feedback/params"].abs().sum() > 0 for _, _, tensors in saved)
    run_rounds(nodes, moves[1:])
    restarted = restart(saved, flags)
    run_rounds(restarted, moves[1:])
    for node, resumed in zip(nodes, restarted):
        assert torch.equal(node.model.flat(), resumed.model.flat())
        assert torch.equal(node.diloco.algorithm.feedback.residual, resumed.diloco.algorithm.feedback.residual)


@pytest.mark.parametrize("flags", [{"diloco.compression": "int2"}, SPARSE])
def test_a_node_that_takes_the_runs_state_starts_its_residual_at_zero(flags):
    """A lagging node (its outer step behind the run's) receives the state: what it dropped before belongs to
    params it no longer has. The contributors keep theirs."""
    _, nodes = start_world(["a", "b", "c"], **flags)
    run_rounds(nodes, deltas(3, 1, TinyModel().flat().numel()))
    residuals = [n.diloco.algorithm.feedback.residual for n in nodes]
    assert all(r.abs().sum() > 0 for r in residuals)
    for node, move in zip(nodes, deltas(3, 1, TinyModel().flat().numel(), seed=2)[0]):
        node.train(move)
    nodes[2].position = type(nodes[2].position)(step=4, outer_step=0)   # it was frozen: one outer step behind
    reports = together(nodes, lambda n: n.outer_step())
    assert not reports[2].applied and nodes[2].diloco.roles.contributing
    assert torch.equal(residuals[2], torch.zeros_like(residuals[2]))
    assert residuals[0].abs().sum() > 0 and residuals[1].abs().sum() > 0


def test_a_checkpoint_residual_under_another_layout_is_dropped_with_one_line(caplog):
    _, nodes = start_world(["a"], **{"diloco.compression": "int4", "diloco.overlap": "streaming",
                                     "diloco.fragments": "2"})
    nodes[0].diloco.load_checkpoint_tensors({**nodes[0].diloco.checkpoint_tensors(),
                                             "feedback/params": torch.ones(3)})
    assert "does not fit this run's settings" not in caplog.text   # its own layout is there: taken
    _, (plain,) = start_world(["b"], **{"diloco.compression": "int4"})
    plain.diloco.load_checkpoint_tensors({**plain.diloco.checkpoint_tensors()} | {"feedback/params": torch.ones(3)})
    assert "error-feedback residual (params) does not fit" in caplog.text


def clipped_reference(start: torch.Tensor, moves: list[list[torch.Tensor]], k: float) -> torch.Tensor:
    """Robust aggregation (diloco.clip): each round, a node's pseudo-gradient whose norm exceeds k times the
    lower median of the round's norms is scaled down to that bound before the average."""
    theta = torch.nn.Parameter(start.clone())
    opt = outer_sgd(theta)
    for round_moves in moves:
        norms = [float(m.norm()) for m in round_moves]
        bound = k * sorted(norms)[(len(norms) - 1) // 2]
        theta.grad = torch.stack([m * min(1.0, bound / n) for m, n in zip(round_moves, norms)]).mean(0)
        opt.step()
    return theta.detach()


def test_clip_bounds_an_outsized_pseudo_gradient_as_the_single_process_math(caplog):
    """Node b sends its update x1000 every round: with diloco.clip = 2 every node holds the reference's params
    and names b as clipped (reported once clipped 3 outer steps in a row); without clipping the same poison
    moves the params hundreds of times further."""
    caplog.set_level("WARNING", logger="zb.diloco")
    start = TinyModel().flat()
    moves = deltas(3, 3, start.numel())
    for round_moves in moves:
        round_moves[1] = round_moves[1] * 1000
    world, nodes = start_world(["a", "b", "c"], **{"diloco.clip": "2"})
    run_rounds(nodes, moves)
    expected = clipped_reference(start, moves, 2.0)
    for node in nodes:
        assert torch.allclose(node.model.flat(), expected, atol=1e-5)
        assert node.reports[-1].clipped == ["b"] and node.reports[-1].applied
    clean = blocking_reference(start, [[m if i != 1 else m / 1000 for i, m in enumerate(r)] for r in moves])
    poisoned = blocking_reference(start, moves)
    assert float((poisoned - clean).norm()) > 100 * float((expected - clean).norm())
    assert "node b was discredited in 3 outer steps in a row" in caplog.text


def evicting_reference(start: torch.Tensor, moves: list[list[torch.Tensor]], k: float, evicted: int,
                       after: int) -> torch.Tensor:
    """diloco.evict_clipped: clipped rounds as clipped_reference; from round `after` on, node `evicted` is out of
    the run (its move is not averaged, nor does it count in the mean)."""
    theta = torch.nn.Parameter(start.clone())
    opt = outer_sgd(theta)
    for i, round_moves in enumerate(moves):
        if i >= after:
            round_moves = [m for j, m in enumerate(round_moves) if j != evicted]
        norms = [float(m.norm()) for m in round_moves]
        bound = k * sorted(norms)[(len(norms) - 1) // 2]
        theta.grad = torch.stack([m * min(1.0, bound / n) for m, n in zip(round_moves, norms)]).mean(0)
        opt.step()
    return theta.detach()


def outer_step_or_refusal(node):
    """The node's outer step; the InvalidInput it ends with when the run refuses it (its CLI would exit 2)."""
    try:
        return node.outer_step()
    except InvalidInput as e:
        return e


@pytest.mark.parametrize("evict", [True, False])
def test_evict_clipped_takes_a_node_clipped_3_outer_steps_in_a_row_out_of_the_run(caplog, evict):
    """Node b sends its update x1000 every round. With diloco.evict_clipped, at the 3rd clipped outer step every
    node evicts it: b ends with one line (exit 2), its id is in the store's list of evicted ids, the next
    resolution leaves it out of the world, and a and c train on together (same params_hash) as the reference
    without b. Without it, b stays in the world, clipped at every outer step."""
    caplog.set_level("WARNING", logger="zb.diloco")
    start = TinyModel().flat()
    moves = deltas(3, 5, start.numel())
    for round_moves in moves:
        round_moves[1] = round_moves[1] * 1000
    flags = {"diloco.clip": "2", "diloco.evict_clipped": "true" if evict else "false"}
    world, nodes = start_world(["a", "b", "c"], **flags)
    a, b, c = nodes
    refusals = []
    for i, round_moves in enumerate(moves):
        live = [n for n in nodes if n is not b or not evict or i < 3]
        for node in live:
            node.train(round_moves[nodes.index(node)])
        results = together(live, outer_step_or_refusal)
        refused = [(n.uid, r) for n, r in zip(live, results) if isinstance(r, InvalidInput)]
        assert [uid for uid, _ in refused] == (["b"] if evict and i == 2 else []), f"round {i + 1}"
        assert [n.reports[-1].evicted for n in (a, c)] == [["b"] if evict and i == 2 else None] * 2
        refusals += [e for _, e in refused]
    if evict:
        expected = evicting_reference(start, moves, 2.0, evicted=1, after=3)
        (error,) = refusals
        assert error.exit_code == 2 and "(b) was evicted by diloco.evict_clipped after 3 discredited outer steps" in str(error)
        assert evicted_ids(read_many(world.store, [keys.EVICTED])[0]) == {"b"}
        assert caplog.text.count("diloco.evict_clipped: node b is evicted from the run") == 3   # once on every node
        assert "node b was discredited in 3 outer steps in a row" not in caplog.text   # the eviction line says it
        with pytest.raises(InvalidInput, match="the run evicted node id 'b'"):
            b.diloco.mesh.resolve()    # b, had it ignored its eviction: the run refuses it
    else:
        expected = clipped_reference(start, moves, 2.0)
        assert b.reports[-1].global_world_size == 3 and b.reports[-1].clipped == ["b"] and b.reports[-1].applied
        assert read_many(world.store, [keys.EVICTED])[0] == b""
    for node in (a, c):
        report = node.reports[-1]
        assert report.global_world_size == (2 if evict else 3) and report.num_peers == (2 if evict else 3)
        assert report.applied and torch.allclose(node.model.flat(), expected, atol=1e-5)
    assert a.reports[-1].params_hash == c.reports[-1].params_hash


def test_evict_clipped_counts_an_outer_step_once_however_many_attempts_checked_in():
    """A retried check-in attempt of the same outer step sees the same clipped node: it counts once toward the
    outer steps in a row, so the node is evicted at the 3rd outer step, not at the 3rd attempt."""
    _, (node,) = start_world(["a"], **{"diloco.clip": "2", "diloco.evict_clipped": "true"})
    view = SimpleNamespace(nodes=["a", "b", "c"], uid="a")
    plan = make_plan([Role.CONTRIBUTOR] * 3, [0] * 3, norms=[1.0, 1000.0, 1.1], clip=2.0)
    for outer_step in (0, 0, 0, 1, 1):
        node.diloco.trust.note(view, plan, outer_step)
    assert node.diloco.trust.clipped_rounds == {"b": 2} and node.diloco.trust.evicted == set()
    node.diloco.trust.note(view, plan, 2)
    assert node.diloco.trust.evicted == {"b"} and node.diloco.trust.evicted_now == ["b"]
    node.diloco.trust.note(view, plan, 2)
    assert node.diloco.trust.evicted_now == ["b"]          # decided once


def test_sparse_with_clip_scales_what_enters_the_accumulator_and_passes_its_check(caplog):
    """diloco.clip with sparse: node b sends its update x1000; every node scales b's pseudo-gradient to the bound
    before it enters b's accumulator, the payloads' average passes the checked average (a payload is at most 11/8
    of its accumulator's norm), and every node holds SparseLoCo's params computed from the clipped moves."""
    start = TinyModel().flat()
    moves = deltas(3, 3, start.numel())
    for round_moves in moves:
        round_moves[1] = round_moves[1] * 1000
    _, nodes = start_world(["a", "b", "c"], **SPARSE, **{"diloco.clip": "2"})
    run_rounds(nodes, moves)
    clipped = []
    for round_moves in moves:
        norms = [float(m.norm()) for m in round_moves]
        bound = 2.0 * sorted(norms)[(len(norms) - 1) // 2]
        clipped.append([m * min(1.0, bound / n) for m, n in zip(round_moves, norms)])
    expected = sparse_reference(start, clipped, SPARSE_BETA, 0.7, SparseScheme(16, 8))
    for node in nodes:
        assert torch.allclose(node.model.flat(), expected, atol=1e-5)
        assert node.reports[-1].applied and node.reports[-1].clipped == ["b"]
    assert "the average failed its check" not in caplog.text
