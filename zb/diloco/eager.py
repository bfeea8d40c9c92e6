"""The eager outer update (Kale, Douillard, Donchev, arXiv 2502.12996), split into a part every node
shares and a part each node keeps to itself. Pure tensor functions: no process groups, no threads.

Where the rule comes from
-------------------------
The paper's own Algorithm 3 could not be read here (only its abstract, captions and tables): the
rule below is the one two independent summaries give, "a mixture of the current local outer
gradient with the delayed mixture of all other replicas' outer gradients", written out as

    D~_m(r) = (1/M) * (D_m(r) + sum over m' != m of D_m'(r-1))
            = Dbar(r-1) + D_m(r)/M - D_m(r-1)/M                                   (1)

where round r ends on node m with the pseudo-gradient D_m(r) = theta_m(r-1) - x_m(r) (start of the
round minus the params after its H inner steps), the all-reduce of D_m(r) is launched in the
background, and Dbar(r-1), the average launched at the previous boundary, has just arrived. Each
node then applies its own outer step, theta_m(r) = OuterOpt_m(theta_m(r-1), D~_m(r)), and trains
the next round from theta_m(r). The node's fresh share stands in for its stale share of the
average; the other nodes' shares are one round late. The naive delayed rule (the paper's
Algorithm 2) instead applies Dbar(r-1) alone, from params every node shares. With one node,
D~(r) = D(r): the eager rule is then blocking DiLoCo.

Another reading circulates in code, (1/M) D_m(r) + ((M-1)/M) Dbar(r-1): it keeps (M-1)/M^2 of the
node's stale share, so a share enters with weight (2M-1)/M^2 on its own node and (M-1)/M^2 on the
others, not once; the "other replicas'" wording of the summaries excludes the node's own stale share,
as (1) does.

Choices the summaries leave open, made here (check them against Algorithm 3 when it can be read):
  * first round: Dbar(0) = 0 and D_m(0) = 0, so node m applies D_m(1)/M alone;
  * the world size may change between rounds: each share is weighted by the size of the all-reduce
    that carries it, D~_m(r) = Dbar(r-1) + D_m(r)/M_r - D_m(r-1)/M_(r-1), so that the stale share
    withdrawn is exactly the one inside the average that arrived;
  * an average that never arrives (failed all-reduce): the shared step is skipped, as the blocking
    path skips it; the node still withdraws its stale share and applies its fresh one.

The split (derivation)
----------------------
The outer optimizer is SGD with momentum mu (Nesterov or heavy ball), dampening 0, no weight decay:
with lr eta, one step maps the params theta, the momentum b and the gradient g to

    b' = mu*b + g,   theta' = theta - eta*(g + mu*b')   (Nesterov; heavy ball: theta - eta*b')

which is linear in (theta, b, g) jointly. Write (1) as D~_m(r) = Dbar(r-1) + d_m(r), with the
node's own input d_m(r) = D_m(r)/M_r - D_m(r-1)/M_(r-1). Start from theta_m(0) = S(0) + 0,
b_m(0) = B(0) + 0 with S(0) the initial params and B(0) = 0. If theta_m = S + phi_m and
b_m = B + beta_m before a step, linearity gives after it

    (S, B)           <- step(S, B, Dbar(r-1))     the shared part: same inputs on every node
    (phi_m, beta_m)  <- step(phi_m, beta_m, d_m(r))   the node's own part

and theta_m = S + phi_m, b_m = B + beta_m again. By induction this holds at every round, for any
mu, Nesterov or not, and any outer lr schedule (both parts take the same eta). It is an identity in
real arithmetic, not an approximation; in floating point S + phi_m is rounded differently from a
directly stepped theta_m, so the two agree to rounding, not bit for bit. (S, B) is stepped only
with the averages, the same bits on every node, so nodes can hash it and compare it exactly.

Plain SGD (mu = 0): beta is unused and phi_m(r) = -sum_s eta_s d_m(s). With a constant eta it
telescopes to phi_m(r) = -eta * D_m(r)/M_r, the node's latest share, and

    theta_m(r) = theta(0) - eta * (Dbar(1) + ... + Dbar(r-1) + D_m(r)/M_r):

every share enters once, first eagerly on its own node, then for everyone inside the average.

With momentum, phi_m is NOT a function of the latest share alone: the node's momentum differs from
the shared one by beta_m(r) = sum_s mu^(r-s) d_m(s) = e(r) - (1-mu) * sum_(s<r) mu^(r-1-s) e(s),
with e(s) = D_m(s)/M_s, a geometrically fading memory of the node's past shares. The split stays
exact because the node keeps beta_m (one more params-sized buffer). Under the paper's rule the
outer optimizer state is therefore per node too, not only the params: the node-own part is
(phi_m, beta_m). Dropping beta_m (phi_m = -eta*(1+mu)*e(r), the first-step value) is NOT the
paper's rule.

Memory per node, beside the shared (S, B): phi (params-sized), beta (params-sized, only when
mu > 0) and the last share D_m(r-1)/M (params-sized), plus the in-flight all-reduce buffers.

Ending a run: the last average Dbar(T) arrives after the last round. Apply it with `shared_step`;
S is then the consensus model (every node's eager term dropped). With mu = 0 and a constant lr a
final `own_step` with a zero fresh pseudo-gradient brings phi back to 0 as well (up to rounding);
with momentum beta keeps a residue, so evaluate and export S, not S + phi.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OuterSGD:
    """The outer optimizer's hyper-parameters: torch.optim.SGD semantics with dampening 0 and no
    weight decay (the linear optimizers the split is exact for)."""

    lr: float
    momentum: float = 0.0
    nesterov: bool = False

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> OuterSGD:
        """The hyper-parameters of a torch.optim.SGD with one param group (as zb's OuterState)."""
        if not isinstance(optimizer, torch.optim.SGD) or len(optimizer.param_groups) != 1:
            raise ValueError("the eager split needs a torch.optim.SGD with one param group")
        g = optimizer.param_groups[0]
        if g["dampening"] != 0 or g["weight_decay"] != 0 or g.get("maximize", False):
            raise ValueError("the eager split is exact only for SGD with dampening 0, weight decay 0, "
                             "not maximizing")
        return cls(lr=float(g["lr"]), momentum=float(g["momentum"]), nesterov=bool(g["nesterov"]))

    @torch.no_grad()
    def step(self, param: torch.Tensor, buf: torch.Tensor | None, grad: torch.Tensor) -> None:
        """One SGD step on `param` in place, with `buf` (the momentum; None when momentum is 0)
        updated in place. A zero `buf` behaves as torch's first step (buffer := grad)."""
        if self.momentum == 0:
            param.add_(grad, alpha=-self.lr)
            return
        if buf is None:
            raise ValueError("momentum > 0 needs a momentum buffer")
        buf.mul_(self.momentum).add_(grad)
        update = grad.add(buf, alpha=self.momentum) if self.nesterov else buf
        param.add_(update, alpha=-self.lr)


@dataclass
class OwnTerm:
    """The part of the outer state that belongs to one node: its params are shared + offset, its
    momentum is shared momentum + momentum. Never all-reduced, never hashed."""

    offset: torch.Tensor              # phi_m: the node's outer params minus the shared ones
    momentum: torch.Tensor | None  # beta_m: node momentum minus shared momentum (None if mu == 0)
    last_share: torch.Tensor          # D_m(r-1)/M_(r-1): this node's share of the average in flight

    @classmethod
    def zeros_like(cls, like: torch.Tensor, opt: OuterSGD) -> OwnTerm:
        """The own term of a node that has applied nothing eagerly (start of a run, a joiner)."""
        return cls(offset=torch.zeros_like(like),
                   momentum=torch.zeros_like(like) if opt.momentum != 0 else None,
                   last_share=torch.zeros_like(like))


def start_params(shared: torch.Tensor, own: OwnTerm) -> torch.Tensor:
    """The node's outer params, where its inner steps start: shared + own offset (a new tensor)."""
    return shared + own.offset


def pseudo_gradient(shared: torch.Tensor, own: OwnTerm, local: torch.Tensor) -> torch.Tensor:
    """D_m(r): the node's start-of-round params minus its params after the inner steps (new tensor)."""
    return start_params(shared, own).sub_(local)


@torch.no_grad()
def shared_step(shared: torch.Tensor, shared_momentum: torch.Tensor | None,
                arrived: torch.Tensor | None, opt: OuterSGD) -> bool:
    """Step the shared outer params and momentum (in place) with the average that just arrived,
    Dbar(r-1). `arrived` None (first round, or the all-reduce failed): nothing changes. Returns
    whether a step was taken. Identical inputs on every node give identical bits on every node;
    zb's OuterState can do this step with its own torch SGD instead (same result)."""
    if arrived is None:
        return False
    opt.step(shared, shared_momentum, arrived)
    return True


@torch.no_grad()
def own_step(own: OwnTerm, fresh: torch.Tensor, world_size: int, opt: OuterSGD, *,
             weight: float | None = None) -> None:
    """Step the node's own term (in place) with d_m(r) = D_m(r)/M_r - D_m(r-1)/M_(r-1): the fresh
    share applied eagerly, the stale share (now inside the shared params, or lost with its average)
    withdrawn. `world_size` is M_r, the size of the all-reduce that carries `fresh`. With `weight`
    (rounds of unlike work: the node's tokens over the contributors' total) the share is w_m(r) D_m(r)
    instead, as it is inside the weighted average. Afterwards own.last_share is the share."""
    share = fresh * weight if weight is not None else fresh / world_size
    d = share - own.last_share
    opt.step(own.offset, own.momentum, d)
    own.last_share = share


@torch.no_grad()
def eager_step(shared: torch.Tensor, shared_momentum: torch.Tensor | None, own: OwnTerm,
               fresh: torch.Tensor, world_size: int, arrived: torch.Tensor | None,
               opt: OuterSGD) -> torch.Tensor:
    """The whole round boundary on one node: `shared_step` with the arrived average, `own_step`
    with the fresh pseudo-gradient; returns the params the next round starts from (new tensor).

    Mutates: shared, shared_momentum (identical on every node), own (this node's only). The caller
    launches the all-reduce of `fresh` (weighted 1/world_size) before or after; it must not be
    modified until it is sent: `own_step` keeps a scaled copy, not `fresh` itself."""
    shared_step(shared, shared_momentum, arrived, opt)
    own_step(own, fresh, world_size, opt)
    return start_params(shared, own)
