"""The eager outer update (zb/diloco/eager.py) against a single-process simulation of M workers.

Two formulations of the same rule are simulated with the same model, data and inner optimizer:
(a) the paper's per-worker form, written directly from the rule: every worker owns its outer params
    and its own torch.optim.SGD, and steps it with (1/M)(D_m(r) + sum of the other workers' D(r-1));
(b) zb's split form: shared outer params and momentum stepped only with the delayed averages (one
    copy per worker, to show that they stay bit-identical), plus each worker's own term (eager.py).
They must agree to rounding (the split is an identity, see eager.py). Blocking DiLoCo and the naive
one-round delay run on the same problem for comparison.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from zb.diloco import eager
from zb.diloco.eager import OuterSGD, OwnTerm


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matmuls: intra-op threads only add overhead (and the machine is shared)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- the toy problem ------------------------------------------------------------------------------

IN, HID, OUT = 8, 32, 4


def mlp(dtype: torch.dtype, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, HID), nn.Tanh(),
                         nn.Linear(HID, OUT)).to(dtype)


def teachers(M: int, dtype: torch.dtype, spread: float, seed: int) -> list[torch.Tensor]:
    """One linear teacher per worker around a common one: the workers' data differ (non-iid)."""
    g = torch.Generator().manual_seed(1234 + seed)
    common = torch.randn(IN, OUT, generator=g, dtype=torch.float64)
    return [(common + spread * torch.randn(IN, OUT, generator=g, dtype=torch.float64)).to(dtype)
            for _ in range(M)]


def mlp_batch(teacher: torch.Tensor, worker: int, step: int, bs: int = 16):
    """Worker `worker`'s batch at inner step `step`: a function of (worker, step) only."""
    g = torch.Generator().manual_seed(10_000 * worker + step)
    x = torch.randn(bs, IN, generator=g, dtype=torch.float64).to(teacher.dtype)
    return x, torch.tanh(x @ teacher)


@dataclass
class Problem:
    """Model factory, loss of a model on worker m's batch at a step, and a held-out evaluation."""
    make: Callable[[], nn.Module]
    loss: Callable[[nn.Module, int, int], torch.Tensor]
    evaluate: Callable[[nn.Module], float] | None


def mlp_problem(M: int, dtype=torch.float64, spread: float = 1.0, seed: int = 0) -> Problem:
    ts = teachers(M, dtype, spread, seed)

    def loss(model, m, step):
        x, y = mlp_batch(ts[m], m, step)
        return nn.functional.mse_loss(model(x), y)

    def evaluate(model):
        with torch.no_grad():
            return sum(nn.functional.mse_loss(model(x), y).item()
                       for m in range(M) for x, y in [mlp_batch(ts[m], m, 10**6 + m)]) / M

    return Problem(lambda: mlp(dtype), loss, evaluate)


# --- the simulation -------------------------------------------------------------------------------

@dataclass
class Run:
    losses: list[list[float]] = field(default_factory=list)      # [inner step][worker]
    starts: list[list[torch.Tensor]] = field(default_factory=list)  # [boundary][worker]: next start
    shared: list[list[tuple]] = field(default_factory=list)      # split form: [boundary][worker] (S, B)
    offsets: list[list[torch.Tensor]] = field(default_factory=list)  # split form: own offsets
    deltas: list[list[torch.Tensor]] = field(default_factory=list)   # [boundary][worker]: D_m(r)
    final: torch.Tensor | None = None                            # consensus params after the last flush


class Workers:
    """M replicas of one model with their own AdamW (kept across rounds, as DiLoCo does)."""

    def __init__(self, problem: Problem, M: int, inner_lr: float):
        self.problem = problem
        self.models = [problem.make() for _ in range(M)]
        self.inner = [torch.optim.AdamW(m.parameters(), lr=inner_lr, weight_decay=0.01) for m in self.models]
        self.step = 0

    def start(self) -> torch.Tensor:
        return parameters_to_vector(self.models[0].parameters()).detach().clone()

    def load(self, m: int, flat: torch.Tensor) -> None:
        with torch.no_grad():
            vector_to_parameters(flat.clone(), self.models[m].parameters())

    def inner_round(self, H: int, run: Run) -> list[torch.Tensor]:
        """H inner steps on every worker; returns each worker's params after them."""
        for _ in range(H):
            row = []
            for m, (model, opt) in enumerate(zip(self.models, self.inner)):
                opt.zero_grad()
                loss = self.problem.loss(model, m, self.step)
                loss.backward()
                opt.step()
                row.append(loss.item())
            run.losses.append(row)
            self.step += 1
        return [parameters_to_vector(m.parameters()).detach().clone() for m in self.models]


def average(deltas: list[torch.Tensor]) -> torch.Tensor:
    """The all-reduce: the mean of the workers' pseudo-gradients (the same bits for everyone)."""
    return torch.stack(deltas).mean(0)


def torch_outer(param: torch.Tensor, opt: OuterSGD) -> tuple[nn.Parameter, torch.optim.SGD]:
    p = nn.Parameter(param.clone(), requires_grad=False)
    return p, torch.optim.SGD([p], lr=opt.lr, momentum=opt.momentum, nesterov=opt.nesterov)


def torch_step(p: nn.Parameter, sgd: torch.optim.SGD, grad: torch.Tensor) -> None:
    p.grad = grad.clone()
    sgd.step()


def run_blocking(problem: Problem, M: int, H: int, T: int, opt: OuterSGD, inner_lr: float) -> Run:
    run, w = Run(), Workers(problem, M, inner_lr)
    theta, sgd = torch_outer(w.start(), opt)
    for _ in range(T):
        xs = w.inner_round(H, run)
        deltas = [theta.data - x for x in xs]
        torch_step(theta, sgd, average(deltas))
        for m in range(M):
            w.load(m, theta.data)
        run.starts.append([theta.data.clone() for _ in range(M)])
        run.deltas.append(deltas)
    run.final = theta.data.clone()
    return run


def run_naive_delayed(problem: Problem, M: int, H: int, T: int, opt: OuterSGD, inner_lr: float) -> Run:
    """The paper's Algorithm 2 as summarized: every worker restarts from the shared params, stepped
    with the average of the previous round (the current one is still in flight)."""
    run, w = Run(), Workers(problem, M, inner_lr)
    theta, sgd = torch_outer(w.start(), opt)
    in_flight = None
    for _ in range(T):
        xs = w.inner_round(H, run)
        deltas = [theta.data - x for x in xs]
        if in_flight is not None:
            torch_step(theta, sgd, in_flight)
        in_flight = average(deltas)
        for m in range(M):
            w.load(m, theta.data)
        run.starts.append([theta.data.clone() for _ in range(M)])
        run.deltas.append(deltas)
    torch_step(theta, sgd, in_flight)  # the last average lands after the last round
    run.final = theta.data.clone()
    return run


def run_paper_eager(problem: Problem, M: int, H: int, T: int, opt: OuterSGD, inner_lr: float) -> Run:
    """(a) Per-worker outer params and optimizer; the outer gradient of worker m is its fresh
    pseudo-gradient mixed with the other workers' pseudo-gradients of the previous round."""
    run, w = Run(), Workers(problem, M, inner_lr)
    outer = [torch_outer(w.start(), opt) for _ in range(M)]
    previous = [torch.zeros_like(w.start()) for _ in range(M)]  # no round before the first
    for _ in range(T):
        xs = w.inner_round(H, run)
        deltas = [outer[m][0].data - xs[m] for m in range(M)]
        for m in range(M):
            others = sum(previous[k] for k in range(M) if k != m)
            torch_step(*outer[m], (deltas[m] + others) / M)
            w.load(m, outer[m][0].data)
        previous = deltas
        run.starts.append([outer[m][0].data.clone() for m in range(M)])
        run.deltas.append(deltas)
    return run


def run_split_eager(problem: Problem, M: int, H: int, T: int, opt: OuterSGD, inner_lr: float) -> Run:
    """(b) zb's form: every worker holds a copy of the shared (S, B), stepped only with the arrived
    averages, and its own term; it trains from S + own offset."""
    run, w = Run(), Workers(problem, M, inner_lr)
    start = w.start()
    shared = [(start.clone(), torch.zeros_like(start) if opt.momentum else None) for _ in range(M)]
    own = [OwnTerm.zeros_like(start, opt) for _ in range(M)]
    in_flight = None
    for _ in range(T):
        xs = w.inner_round(H, run)
        deltas = [eager.pseudo_gradient(shared[m][0], own[m], xs[m]) for m in range(M)]
        for m in range(M):
            nxt = eager.eager_step(shared[m][0], shared[m][1], own[m], deltas[m], M, in_flight, opt)
            w.load(m, nxt)
        in_flight = average(deltas)
        run.starts.append([eager.start_params(s, o) for (s, _), o in zip(shared, own)])
        run.shared.append([(s.clone(), None if b is None else b.clone()) for s, b in shared])
        run.offsets.append([o.offset.clone() for o in own])
        run.deltas.append(deltas)
    eager.shared_step(shared[0][0], shared[0][1], in_flight, opt)  # flush; S is the consensus model
    run.final = shared[0][0].clone()
    return run


# --- tests ----------------------------------------------------------------------------------------

OPTS = {
    "sgd": OuterSGD(lr=0.7),
    "nesterov": OuterSGD(lr=0.7, momentum=0.9, nesterov=True),
    "heavy_ball": OuterSGD(lr=0.5, momentum=0.8),
}


@pytest.mark.parametrize("name", list(OPTS))
def test_outer_sgd_step_is_torch_sgd(name):
    """The functional step the own term uses is torch.optim.SGD's step, bit for bit."""
    opt = OPTS[name]
    g = torch.Generator().manual_seed(0)
    start = torch.randn(1000, generator=g)
    p, sgd = torch_outer(start, opt)
    mine, buf = start.clone(), torch.zeros_like(start) if opt.momentum else None
    for _ in range(5):
        grad = torch.randn(1000, generator=g)
        torch_step(p, sgd, grad)
        opt.step(mine, buf, grad)
        assert torch.equal(mine, p.data)
    if opt.momentum:
        assert torch.equal(buf, sgd.state[p]["momentum_buffer"])
    assert OuterSGD.of(sgd) == opt


def test_outer_sgd_of_zb_outer_state():
    """zb's OuterState optimizer (defaults: lr 0.7, Nesterov 0.9) is one the split is exact for."""
    from zb.config_schema import DilocoConfig
    from zb.diloco.outer import OuterState

    state = OuterState(mlp(torch.float32), DilocoConfig())
    assert OuterSGD.of(state.optimizer) == OuterSGD(lr=0.7, momentum=0.9, nesterov=True)
    avg = OuterState(mlp(torch.float32), DilocoConfig(outer_optimizer="avg"))
    assert OuterSGD.of(avg.optimizer) == OuterSGD(lr=1.0)


def test_outer_sgd_of_refuses_nonlinear_settings():
    p = nn.Parameter(torch.zeros(3))
    for kwargs in (dict(momentum=0.9, dampening=0.1), dict(weight_decay=0.1)):
        with pytest.raises(ValueError):
            OuterSGD.of(torch.optim.SGD([p], lr=0.1, **kwargs))
    with pytest.raises(ValueError):
        OuterSGD.of(torch.optim.Adam([p]))


@pytest.mark.parametrize("name", list(OPTS))
def test_split_equals_paper_per_worker_rule(name):
    """(b) == (a) at every boundary and every inner step, to float64 rounding (measured: 3e-16), for
    plain SGD, Nesterov and heavy ball; the shared part stays bit-identical across workers."""
    opt, M, H, T = OPTS[name], 3, 4, 6
    problem = mlp_problem(M)
    a = run_paper_eager(problem, M, H, T, opt, inner_lr=0.02)
    b = run_split_eager(problem, M, H, T, opt, inner_lr=0.02)
    for row_a, row_b in zip(a.losses, b.losses):
        for la, lb in zip(row_a, row_b):
            assert abs(la - lb) <= 1e-11 * abs(la)
    for r in range(T):
        for m in range(M):
            torch.testing.assert_close(b.starts[r][m], a.starts[r][m], rtol=0, atol=1e-11)
            s0, b0 = b.shared[r][0]
            sm, bm = b.shared[r][m]
            assert torch.equal(sm, s0) and (b0 is None or torch.equal(bm, b0))
    # The workers' params do differ (by their own terms): the rule is not plain DiLoCo.
    assert (a.starts[-1][0] - a.starts[-1][1]).abs().max() > 1e-3


def test_plain_sgd_own_term_is_the_latest_share():
    """mu = 0: the own offset is -lr * D_m(r)/M (each share enters once: eagerly, then averaged),
    and the shared params are theta(0) - lr * (sum of the averages that arrived)."""
    opt, M, H, T = OPTS["sgd"], 3, 3, 5
    problem = mlp_problem(M)
    b = run_split_eager(problem, M, H, T, opt, inner_lr=0.02)
    theta0 = parameters_to_vector(problem.make().parameters()).detach()
    arrived = torch.zeros_like(theta0)
    for r in range(T):
        for m in range(M):
            torch.testing.assert_close(b.offsets[r][m], -opt.lr * b.deltas[r][m] / M, rtol=0, atol=1e-12)
        torch.testing.assert_close(b.shared[r][0][0], theta0 - opt.lr * arrived, rtol=0, atol=1e-12)
        arrived = arrived + average(b.deltas[r])


def test_first_round_applies_only_the_own_share():
    """Round 1: nothing has arrived, the shared part stays theta(0) with zero momentum; the node
    applies its own share alone (Nesterov's first step: offset = -lr (1 + mu) D/M)."""
    opt, M = OPTS["nesterov"], 4
    g = torch.Generator().manual_seed(1)
    theta0, local = torch.randn(50, generator=g, dtype=torch.float64), torch.randn(50, generator=g, dtype=torch.float64)
    shared, mom, own = theta0.clone(), torch.zeros(50, dtype=torch.float64), OwnTerm.zeros_like(theta0, opt)
    fresh = eager.pseudo_gradient(shared, own, local)
    nxt = eager.eager_step(shared, mom, own, fresh, M, None, opt)
    assert torch.equal(shared, theta0) and torch.equal(mom, torch.zeros_like(mom))
    torch.testing.assert_close(nxt, theta0 - opt.lr * (1 + opt.momentum) * fresh / M, rtol=0, atol=1e-14)
    torch.testing.assert_close(own.last_share, fresh / M, rtol=0, atol=0)


def test_world_size_change_keeps_each_share_once():
    """mu = 0 with M changing between rounds: the stale share withdrawn is the one the arrived
    average carried (weight 1/M of its own all-reduce), so the node's params stay
    theta(0) - lr * (sum of arrived averages + its latest share)."""
    opt = OPTS["sgd"]
    g = torch.Generator().manual_seed(2)
    theta0 = torch.randn(20, dtype=torch.float64, generator=g)
    shared, own = theta0.clone(), OwnTerm.zeros_like(theta0, opt)
    arrived_sum, in_flight = torch.zeros_like(theta0), None
    for M in (2, 3, 5, 4):
        fresh = torch.randn(20, dtype=torch.float64, generator=g)
        others = [torch.randn(20, dtype=torch.float64, generator=g) for _ in range(M - 1)]
        nxt = eager.eager_step(shared, None, own, fresh, M, in_flight, opt)
        if in_flight is not None:
            arrived_sum += in_flight
        torch.testing.assert_close(nxt, theta0 - opt.lr * (arrived_sum + fresh / M), rtol=0, atol=1e-13)
        in_flight = average([fresh] + others)


def test_lost_average_skips_the_shared_step_alike():
    """An all-reduce that failed: the shared part does not move (on every node alike); the node still
    swaps its stale share for its fresh one, so with mu = 0 its offset is -lr * D_m(r)/M."""
    opt = OPTS["sgd"]
    g = torch.Generator().manual_seed(3)
    shared = torch.randn(20, dtype=torch.float64, generator=g)
    own = OwnTerm.zeros_like(shared, opt)
    before = shared.clone()
    for _ in range(3):
        fresh = torch.randn(20, dtype=torch.float64, generator=g)
        eager.eager_step(shared, None, own, fresh, 3, None, opt)
        assert torch.equal(shared, before)
        torch.testing.assert_close(own.offset, -opt.lr * fresh / 3, rtol=0, atol=1e-13)


def test_one_worker_eager_is_blocking_diloco():
    """M = 1: the fresh share is the whole average, D~(r) = D(r), so the eager rule is blocking
    DiLoCo (to rounding), with Nesterov."""
    opt = OPTS["nesterov"]
    problem = mlp_problem(1)
    a = run_blocking(problem, 1, 4, 5, opt, inner_lr=0.02)
    b = run_split_eager(problem, 1, 4, 5, opt, inner_lr=0.02)
    for r in range(5):
        torch.testing.assert_close(b.starts[r][0], a.starts[r][0], rtol=0, atol=1e-11)


def test_split_equals_paper_rule_fp32_transformer():
    """zb's debug Transformer in fp32 (the issue's check): every step loss of the split form is within
    1e-5 (relative) of the per-worker form, with Nesterov and AdamW."""
    from zb.config_schema import ModelConfig
    from zb.models import Transformer, model_args

    M, H, T, seq, bs = 2, 3, 4, 16, 4
    args = model_args(ModelConfig(name="debug"), vocab_size=259, max_seq_len=seq)

    def make():
        torch.manual_seed(0)
        model = Transformer(args)
        model.init_weights(0)
        return model

    def tokens(m, step):
        # Worker m's sequences count up with its own stride (learnable, and different per worker).
        g = torch.Generator().manual_seed(10_000 * m + step)
        first = torch.randint(0, 259, (bs, 1), generator=g)
        return (first + (m + 1) * torch.arange(seq + 1)) % 259

    def loss(model, m, step):
        t = tokens(m, step)
        logits = model(t[:, :-1])
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), t[:, 1:].flatten())

    problem = Problem(make, loss, None)
    opt = OuterSGD(lr=0.7, momentum=0.9, nesterov=True)
    a = run_paper_eager(problem, M, H, T, opt, inner_lr=3e-3)
    b = run_split_eager(problem, M, H, T, opt, inner_lr=3e-3)
    worst = max(abs(la - lb) / abs(la) for ra, rb in zip(a.losses, b.losses) for la, lb in zip(ra, rb))
    print("worst relative step-loss difference", worst)
    assert worst < 1e-5, worst
    assert a.losses[-1][0] < a.losses[0][0]  # it trained


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ordering_blocking_eager_naive(seed):
    """Same non-iid toy problem, Nesterov outer (lr 0.4, mu 0.9), M = 4, H = 10, 12 rounds: eager beats
    the naive one-round delay, and blocking beats both, on the held-out loss of the consensus model
    after the last average and on the mean training loss of the run. Deterministic; the margins held
    over 8 data seeds when chosen (mean training loss: naive >= 1.6x eager, eager >= 1.07x blocking).

    Not asserted, but seen on this toy: with zb's defaults (outer lr 0.7, mu 0.9) both delayed rules
    diverge while blocking trains. Here H inner steps nearly reach each worker's optimum, the regime
    where a one-round delay plus strong momentum is unstable (on a scalar model with the
    pseudo-gradient = kappa * distance to the optimum, the delayed Nesterov iteration has spectral
    radius 1.29 at kappa = 1 against 0.95 at kappa = 0.02; blocking is stable at both)."""
    M, H, T = 4, 10, 12
    opt = OuterSGD(lr=0.4, momentum=0.9, nesterov=True)
    problem = mlp_problem(M, seed=seed)
    held_out, train = {}, {}
    for name, simulate in (("blocking", run_blocking), ("eager", run_split_eager), ("naive", run_naive_delayed)):
        run = simulate(problem, M, H, T, opt, 0.01)
        held_out[name] = problem.evaluate(_load(problem, run.final))
        train[name] = sum(map(sum, run.losses)) / (len(run.losses) * M)
    assert held_out["blocking"] < held_out["eager"] < held_out["naive"], held_out
    assert train["blocking"] < train["eager"] and 1.3 * train["eager"] < train["naive"], train


def _load(problem: Problem, flat: torch.Tensor) -> nn.Module:
    model = problem.make()
    with torch.no_grad():
        vector_to_parameters(flat.clone(), model.parameters())
    return model
