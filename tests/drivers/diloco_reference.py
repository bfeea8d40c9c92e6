"""Driver for tests/test_diloco_overlap.py: M DiLoCo nodes simulated in one process, written from
the update rules' definitions (not from zb.diloco's code), with zb's own model, data and inner
optimizer, so a real multi-process run can be compared with it step loss by step loss.

    python diloco_reference.py NODES RULE ARGS...      (RULE: none | eager | streaming | delayed; ARGS: zb train flags)
    python diloco_reference.py --rules NODES JSON      (JSON: {RULE: [ARGS...], ...}: each rule's simulation in turn,
                                                        one process start for all of them)

NODES is a count, or each node's local rank count (`1,2`): a node of L local ranks reads the data
of local ranks 0..L-1 of its slot, as a `zb train` node through torchrun does, and one step
averages over all of them, as FSDP's gradient reduction does.

none:  the blocking rule. Every node steps one shared outer SGD with the mean pseudo-gradient
       theta - x_m, and every node restarts from the shared params.
eager: the paper's per-worker form (arXiv 2502.12996, as RESEARCH.md gives it): node m keeps a
       private outer SGD (params and momentum) and steps it with
         Dbar(r-1) + D_m(r)/M - D_m(r-1)/M,
       where D_m(r) = theta_m - x_m and Dbar(r-1) is the mean launched one boundary earlier.
delayed: the naive one-round delay (the eager paper's baseline): one shared outer SGD; every round
       starts from the shared params, and at its end they step with the mean launched one boundary
       earlier, D_m(r) = theta - x_m taking the shared params the round started from.
streaming: Streaming DiLoCo (torchft's fragment rule): fragment p of P syncs at step (p+1)*H/P of
       each round; tau steps earlier every node takes D_m = theta_p - x_m,p; at the sync step one
       outer SGD per fragment (its own momentum) steps theta_p with the mean, and every node merges
       x_m,p <- alpha * x_m,p + (1 - alpha) * theta_p. The fragments are zb's layout (a separately
       tested pure function); the rule is written here.

Node m trains on data slot m of M, as `zb train` nodes with GLOBAL_RANK m claim. Prints one JSON
line: {"losses": [[node 0's step losses], ...]} (with --rules: {"losses": {RULE: [[...], ...], ...}}).
"""

from __future__ import annotations

import json
import sys

import torch

from zb.config import load_config
from zb.local_world import LocalWorld
from zb.train.device import pick_placement
from zb.train.lr_schedule import build_optimizer, build_scheduler
from zb.train.setup import build_loaders, build_model, check_batch
from zb.train.step import Trainer, take


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    """The model's params as one new fp32 vector, in parameters() order."""
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


@torch.no_grad()
def load_params(model: torch.nn.Module, flat: torch.Tensor) -> None:
    """Copy a flat_params vector into the model (copies: the vector stays the caller's)."""
    offset = 0
    for p in model.parameters():
        p.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


class SimNode:
    def __init__(self, cfg, tokenizer, placement, slot: int, nodes: int, local_ranks: int = 1):
        self.model = build_model(cfg, tokenizer.vocab_size, placement)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim)
        self.trainer = Trainer(self.model, self.optimizer, self.scheduler, placement, cfg.optim.grad_clip,
                               cfg.optim.z_loss_weight if cfg.optim.z_loss else 0.0, False)
        self.loaders = [build_loaders(cfg, tokenizer, LocalWorld(r, local_ranks), slot, nodes)[0]
                        for r in range(local_ranks)]
        self.accum = check_batch(cfg, LocalWorld(0, local_ranks))
        self.losses: list[float] = []

    def flat(self) -> torch.Tensor:
        return flat_params(self.model)

    def load(self, flat: torch.Tensor) -> None:
        load_params(self.model, flat)

    def train(self, steps: int) -> None:
        for _ in range(steps):
            batches = [b for loader in self.loaders for b in take(loader, self.accum)]
            self.losses.append(self.trainer.train_step(batches).loss)


def outer_sgd(theta: torch.Tensor, dcfg) -> torch.optim.SGD:
    if dcfg.outer_optimizer == "avg":
        return torch.optim.SGD([theta], lr=1.0)
    return torch.optim.SGD([theta], lr=dcfg.lr(), momentum=dcfg.momentum(),
                           nesterov=dcfg.nesterov and dcfg.momentum() > 0)


def step(opt: torch.optim.SGD, grad: torch.Tensor) -> None:
    opt.param_groups[0]["params"][0].grad = grad
    opt.step()


def streaming(sims: list, dcfg, total: int, on_round=None) -> torch.Tensor:
    from zb.diloco.streaming import fragment_of_params

    names, numels = zip(*[(n, p.numel()) for n, p in sims[0].model.named_parameters()])
    owner = fragment_of_params(list(names), list(numels), dcfg.fragments)
    starts = [sum(numels[:i]) for i in range(len(numels))]
    theta = sims[0].flat()
    index = [torch.cat([torch.arange(starts[i], starts[i] + numels[i], device=theta.device)
                        for i in range(len(owner)) if owner[i] == p]) for p in range(dcfg.fragments)]
    frags = [torch.nn.Parameter(theta[ix].clone(), requires_grad=False) for ix in index]
    opts = [outer_sgd(f, dcfg) for f in frags]  # one outer SGD (and momentum) per fragment
    H, per, tau = dcfg.inner_steps, dcfg.inner_steps // dcfg.fragments, dcfg.fragment_delay
    pending: dict[int, list[torch.Tensor]] = {}
    for t in range(1, total + 1):
        for s in sims:
            s.train(1)
        for p in range(dcfg.fragments):
            if t % H == ((p + 1) * per - tau) % H:
                pending[p] = [frags[p].detach() - s.flat()[index[p]] for s in sims]
            if t % H == ((p + 1) * per) % H and p in pending:
                step(opts[p], torch.stack(pending.pop(p)).mean(0))
                for s in sims:
                    x = s.flat()
                    x[index[p]] = dcfg.fragment_alpha * x[index[p]] + (1 - dcfg.fragment_alpha) * frags[p].detach()
                    s.load(x)
        if on_round is not None and t % H == 0:
            on_round(t // H - 1, outer_params(theta, frags, index))
    return outer_params(theta, frags, index)


def outer_params(theta: torch.Tensor, frags: list[torch.Tensor], index: list[torch.Tensor]) -> torch.Tensor:
    """Streaming's outer params as one flat vector: each fragment's, where it sits."""
    out = torch.empty_like(theta)
    for frag, ix in zip(frags, index):
        out[ix] = frag.detach()
    return out


def global_params(rule: str, thetas: list[torch.Tensor]) -> torch.Tensor:
    """The run's outer params: the shared ones, or under eager the mean of the nodes' private ones."""
    return thetas[0].detach() if rule in ("none", "delayed") else torch.stack([t.detach() for t in thetas]).mean(0)


def mean_of(deltas: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(deltas).mean(0)


class SparseMean:
    """SparseLoCo's average (arXiv 2508.15706, diloco.compression = sparse): node m folds its pseudo-gradient into
    its accumulator, e_m <- beta e_m + D_m, sends the top-k of every chunk at 2 bits (the scheme as
    zb.collectives.sparse_twins defines it) and keeps the rest; the average is the mean of the M payloads, each
    entry's over the payloads that sent it under diloco.sparse_average = senders."""

    def __init__(self, dcfg) -> None:
        from zb.collectives.sparse_twins import SparseScheme

        self.scheme, self.beta = SparseScheme(dcfg.sparse_chunk, dcfg.sparse_k), dcfg.sparse_beta
        self.by_senders = dcfg.sparse_average == "senders"
        self.kept: list[torch.Tensor] = []

    def __call__(self, deltas: list[torch.Tensor]) -> torch.Tensor:
        from zb.collectives import sparse_twins

        n = deltas[0].numel()
        self.kept = self.kept or [torch.zeros(n) for _ in deltas]
        total, senders = torch.zeros(n), torch.zeros(n)
        for d, e in zip(deltas, self.kept):
            payload = torch.empty(self.scheme.payload_bytes(n), dtype=torch.uint8)
            sparse_twins.compress(d.float().cpu(), payload, self.scheme, e, self.beta)
            assert sparse_twins.decode_add(payload, total, self.scheme)
            assert sparse_twins.decode_add(sparse_twins.marks(payload, n, self.scheme), senders, self.scheme)
        divisor = (senders / sparse_twins.MARK).clamp(min=1) if self.by_senders else len(deltas)
        return (total / divisor).to(deltas[0].device)


def run_rule(sims: list, rule: str, dcfg, total: int, average=mean_of, on_round=None) -> torch.Tensor:
    """Train `sims` (objects with train(steps), flat(), load(flat)) for `total` inner steps under `rule`
    and return the outer params at the end.

    `average(deltas)` is the all-reduce (the exact mean, or a model of a compressed one; not used by
    streaming); `on_round(r, params)` sees the outer params after round r's outer step."""
    nodes, H = len(sims), dcfg.inner_steps
    if rule == "streaming":
        return streaming(sims, dcfg, total, on_round)
    thetas = [torch.nn.Parameter(s.flat(), requires_grad=False) for s in sims]
    opts = [outer_sgd(thetas[0], dcfg)] if rule in ("none", "delayed") else [outer_sgd(t, dcfg) for t in thetas]
    last = [torch.zeros_like(thetas[0]) for _ in sims]
    arrived: torch.Tensor | None = None
    for r in range(total // H):
        for s in sims:
            s.train(H)
        deltas = [thetas[m if rule == "eager" else 0].detach() - s.flat() for m, s in enumerate(sims)]
        mean = average(deltas)
        if rule in ("none", "delayed"):
            if rule == "none" or arrived is not None:
                step(opts[0], mean if rule == "none" else arrived)
            arrived = mean
            for s in sims:
                s.load(thetas[0].detach())
        else:
            for m, s in enumerate(sims):
                g = deltas[m] / nodes - last[m]
                if arrived is not None:
                    g = g + arrived
                step(opts[m], g)
                last[m] = deltas[m] / nodes
                s.load(thetas[m].detach())
            arrived = mean
        if on_round is not None:
            on_round(r, global_params(rule, thetas))
    for s in sims:
        s.train(total % H)
    return global_params(rule, thetas)


def simulate(nodes_arg: str, rule: str, flags: list[str]) -> list[list[float]]:
    """Each simulated node's step losses: NODES, RULE and ARGS as on the command line."""
    ranks = [int(n) for n in nodes_arg.split(",")] if "," in nodes_arg else [1] * int(nodes_arg)
    nodes = len(ranks)
    cfg = load_config([], dict(zip([f[2:] for f in flags[::2]], flags[1::2])), environ={})
    from zb.data import build_tokenizer

    tokenizer = build_tokenizer(cfg.data.tokenizer, retries=0)
    placement = pick_placement(cfg.train, LocalWorld(0, 1))
    sims = [SimNode(cfg, tokenizer, placement, m, nodes, ranks[m]) for m in range(nodes)]
    sparse = cfg.diloco.compression == "sparse"
    assert rule in ("none", "delayed") or not sparse, "the sparse average is modelled for blocking and delayed rules"
    run_rule(sims, rule, cfg.diloco, cfg.optim.total_steps, average=SparseMean(cfg.diloco) if sparse else mean_of)
    return [s.losses for s in sims]


def main() -> None:
    torch.set_num_threads(1)
    if sys.argv[1] == "--rules":
        runs = json.loads(sys.argv[3])
        print(json.dumps({"losses": {rule: simulate(sys.argv[2], rule, flags) for rule, flags in runs.items()}}))
    else:
        print(json.dumps({"losses": simulate(sys.argv[1], sys.argv[2], sys.argv[3:])}))


if __name__ == "__main__":
    main()
