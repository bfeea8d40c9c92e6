"""Outer params and the outer optimizer, on CPU in fp32, for this rank's stripe only.

One flat buffer holds the outer copy of this rank's stripe of every parameter (a view per
parameter; zb.diloco.stripes: on a node with diloco.stripes local ranks, exactly its FSDP shard),
so the outer optimizer is a single vectorized SGD step and no extra GPU memory is used. Pseudo-gradient =
outer params - current params: the direction the inner steps moved, sign-flipped, so that an
SGD step with lr 1 and no momentum lands exactly on the average of the nodes' params.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from zb.config_schema import DilocoConfig
from zb.diloco.clip import squared_norm
from zb.diloco.stripes import StripeLayout, local_shard

__all__ = ["OuterState", "local_shard"]


class OuterState:
    """fp32 CPU outer params + pseudo-gradient buffer + outer optimizer for one rank's stripe."""

    def __init__(self, model: nn.Module, cfg: DilocoConfig, layout: StripeLayout | None = None):
        self.layout = layout or StripeLayout(1, 0, 1)
        self.params = [p for p in model.parameters()]
        self.names = [n for n, _ in model.named_parameters()]
        self.full_shapes = [tuple(p.shape) for p in self.params]
        self.shapes = [local_shard(p).shape if self.layout.identity else self.layout.stripe_shape(s)
                       for p, s in zip(self.params, self.full_shapes)]
        self.numels = [s.numel() for s in self.shapes]
        total = sum(self.numels)
        # Pageable, not pinned: torch's pinned allocator rounds each block up to a power of two (a
        # 5 GB shard of 10B takes 8 GB, twice: params and pseudo-gradient) and locks it; the copies
        # happen once per outer step, beside an all-reduce of minutes, so pinning gains nothing.
        self.flat = nn.Parameter(torch.zeros(total, dtype=torch.float32), requires_grad=False)
        self.flat.grad = torch.zeros(total, dtype=torch.float32)
        self.views = self._views(self.flat.data)
        self.grad_views = self._views(self.flat.grad)
        self.optimizer = self._build_optimizer(cfg)
        self.pull_from_model()

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        out, offset = [], 0
        for shape, n in zip(self.shapes, self.numels):
            out.append(flat[offset:offset + n].view(shape))
            offset += n
        return out

    def _build_optimizer(self, cfg: DilocoConfig) -> torch.optim.Optimizer:
        if cfg.outer_optimizer == "avg":
            return torch.optim.SGD([self.flat], lr=1.0)
        momentum = cfg.momentum()
        return torch.optim.SGD([self.flat], lr=cfg.lr(), momentum=momentum, nesterov=cfg.nesterov and momentum > 0)

    @property
    def numel(self) -> int:
        return self.flat.numel()

    def param_ranges(self) -> list[tuple[int, int]]:
        """(start, end) of each parameter in the flat buffers, in order."""
        ranges, offset = [], 0
        for n in self.numels:
            ranges.append((offset, offset + n))
            offset += n
        return ranges

    @torch.no_grad()
    def pull_from_model(self) -> None:
        """Outer params := the model's current shards (at start, and after state arrives). On a node
        whose FSDP shards are not its stripes, a collective over its local ranks."""
        if not self.layout.identity:
            self.layout.read(self.full_shapes, self.params, self.views)
            return
        for view, p in zip(self.views, self.params):
            view.copy_(local_shard(p), non_blocking=False)

    @torch.no_grad()
    def model_stripe(self, index: int) -> torch.Tensor:
        """This rank's stripe of parameter `index` as the model holds it now, fp32 on CPU (the shard itself
        when it is already that). On a node whose FSDP shards are not its stripes, a collective over its local
        ranks: every local rank asks for the same parameters in the same order (a passenger's stripe is empty)."""
        if self.layout.identity:
            return local_shard(self.params[index]).detach().to(device="cpu", dtype=torch.float32)
        out = torch.empty(self.shapes[index], dtype=torch.float32)
        self.layout.read([self.full_shapes[index]], [self.params[index]], [out])
        return out

    @torch.no_grad()
    def subtract_model(self, out: torch.Tensor) -> None:
        """out -= the model's current params, this rank's stripe of each (out laid out as the flat buffers,
        fp32 on CPU). One parameter at a time, so a node that moves rows holds one stripe more, not a model
        more; the same subtraction on every layout, so its bits do not depend on it. A collective when rows
        move inside the node (model_stripe)."""
        for i, view in enumerate(self._views(out)):
            view.sub_(self.model_stripe(i))

    @torch.no_grad()
    def fill_pseudo_gradients(self) -> None:
        """flat.grad := outer - current for every parameter at once: how a node whose FSDP shards are
        not its stripes makes them (a collective over its local ranks; see zb.diloco.stripes)."""
        self.layout.read(self.full_shapes, self.params, self.grad_views)
        grad = self.flat.grad
        assert grad is not None  # the pseudo-gradient buffer: set in __init__, never cleared
        torch.sub(self.flat.data, grad, out=grad)

    @torch.no_grad()
    def pseudo_gradient_sq(self) -> float:
        """Fill flat.grad with this rank's pseudo-gradient and return its sum of squares (diloco.clip); on a node
        whose FSDP shards are not its stripes, a collective over its local ranks."""
        if self.layout.identity:
            for index in range(len(self.params)):
                self.pseudo_gradient_of(index)
        else:
            self.fill_pseudo_gradients()
        grad = self.flat.grad
        assert grad is not None  # the pseudo-gradient buffer: set in __init__, never cleared
        return squared_norm(grad)

    @torch.no_grad()
    def pseudo_gradient_of(self, index: int) -> torch.Tensor:
        """Fill and return the pseudo-gradient view of parameter `index`: outer - current (already
        filled by fill_pseudo_gradients when the stripes are not this rank's FSDP shards)."""
        g = self.grad_views[index]
        if not self.layout.identity:
            return g
        g.copy_(local_shard(self.params[index]))
        torch.sub(self.views[index], g, out=g)
        return g

    @torch.no_grad()
    def step(self) -> None:
        """Apply the (averaged) pseudo-gradient in flat.grad with the outer optimizer."""
        self.optimizer.step()

    @torch.no_grad()
    def push_to_model(self, flat: torch.Tensor | None = None) -> None:
        """Model shards := outer params (or `flat`, laid out as they are), in the model's own dtype
        and device."""
        self.push_params(range(len(self.params)), self.views if flat is None else self._views(flat))

    @torch.no_grad()
    def push_params(self, indices: Sequence[int], stripes: Sequence[torch.Tensor]) -> None:
        """Model params `indices` := `stripes` (this rank's stripe of each, fp32 on CPU), in the model's own
        dtype and device. On a node whose FSDP shards are not its stripes, a collective over its local ranks:
        every local rank passes the same indices."""
        if not self.layout.identity:
            self.layout.write([self.full_shapes[i] for i in indices], stripes, [self.params[i] for i in indices])
            return
        for i, stripe in zip(indices, stripes):
            local_shard(self.params[i]).copy_(stripe, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        elif torch.backends.mps.is_available():   # a Mac's GPU: the same asynchronous copy
            torch.mps.synchronize()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The node-identical outer state as named tensors (for joiners and snapshots)."""
        out = {"outer/params": self.flat.data}
        buf = self.optimizer.state.get(self.flat, {}).get("momentum_buffer")
        if buf is not None:
            out["outer/momentum"] = buf
        return out

    @torch.no_grad()
    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.flat.data.copy_(tensors["outer/params"])
        if "outer/momentum" in tensors:
            state = self.optimizer.state[self.flat]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(self.flat.data)
            state["momentum_buffer"].copy_(tensors["outer/momentum"])
