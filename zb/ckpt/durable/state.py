"""The training state of one local rank as named tensors + JSON, and loading it back in place.

A rank's checkpoint part holds these safetensors files (names are part of the format):

    model.safetensors   "<param name>": the rank's local shard (FSDP2) or the whole tensor
    optim.safetensors   "<param name>/<state key>": inner optimizer state (AdamW: step, exp_avg, exp_avg_sq)
    rng.safetensors     "rng/cpu" (+ "rng/cuda"): generator states as uint8 tensors
    outer.safetensors   "outer/params", "outer/momentum": the DiLoCo outer state (identical on every node);
                        with diloco.overlap also "own/..." (eager: this node's term) and "inflight/average",
                        "inflight/part" (the average in flight at the save, kept for the restart); with
                        diloco.error_feedback "feedback/params" or "feedback/fragments" (this node's residual)

Numbers (counters, scheduler, optimizer hyperparameters, data position, the data slot the node reads: what
`zb train --eval.only` evaluates on) go in the manifest as JSON.
`Staging` preallocates CPU buffers once and refills them at every save: the only blocking work.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import torch

from zb.position import JSON_KEY, RunPosition

MODEL, OPTIM, RNG, OUTER = "model.safetensors", "optim.safetensors", "rng.safetensors", "outer.safetensors"


@dataclass
class TrainState:
    """What the training loop hands over at a save, and what a resume fills in."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    position: RunPosition                          # where the run stands at this save
    _: KW_ONLY                                     # the rest by name
    data_state: dict                               # this local rank's loader.state_dict() (JSON-able)
    outer: dict[str, torch.Tensor] | None          # OuterState.state_tensors(), None without DiLoCo
    config: dict                                   # zb.config.to_dict(cfg)
    fingerprint: dict                              # zb.fingerprint.fingerprint(...)
    data_exact: bool = True                        # loader.exact_resume
    data_slot: tuple[int, int] | None = None       # (data rank, data world size) this node reads; None: unknown
    extra: dict = field(default_factory=dict)      # any other JSON the caller wants back


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank holds (a DTensor's local shard), detached."""
    t = t.detach()
    return t.to_local() if hasattr(t, "to_local") else t


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: local_tensor(p) for name, p in model.named_parameters()}


def optim_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"{name}/{key}"] = local_tensor(value)
    return out


def rng_tensors() -> dict[str, torch.Tensor]:
    out = {"rng/cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["rng/cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    if torch.backends.mps.is_available():
        out["rng/mps"] = torch.mps.get_rng_state()
    return out


def live_tensors(state: TrainState) -> dict[str, dict[str, torch.Tensor]]:
    """File -> name -> tensor that must be copied before training continues (they change every step)."""
    return {MODEL: model_tensors(state.model), OPTIM: optim_tensors(state.model, state.optimizer),
            RNG: rng_tensors()}


def json_meta(state: TrainState) -> dict[str, Any]:
    """Everything that is not a tensor: numbers and the data position, as plain JSON."""
    groups = [{k: v for k, v in g.items() if k != "params" and _is_number_like(v)}
              for g in state.optimizer.param_groups]
    slot = None if state.data_slot is None else {"rank": state.data_slot[0], "world_size": state.data_slot[1]}
    return {JSON_KEY: state.position.to_json(), "data_state": state.data_state, "data_exact": state.data_exact,
            "data_slot": slot, "scheduler": _scheduler_state(state.scheduler), "param_groups": groups,
            "config": state.config, "fingerprint": state.fingerprint, "threads": torch.get_num_threads(),
            "extra": state.extra}


def _is_number_like(v: Any) -> bool:
    if isinstance(v, (list, tuple)):
        return all(_is_number_like(x) for x in v)
    return v is None or isinstance(v, (bool, int, float, str))


def _scheduler_state(scheduler: Any) -> dict | None:
    if scheduler is None:
        return None
    sd = scheduler.state_dict()
    return {k: v for k, v in sd.items() if _is_number_like(v)}


class Staging:
    """Preallocated CPU copies of the live tensors, reused save after save (pinned with CUDA)."""

    def __init__(self) -> None:
        self.buffers: dict[str, dict[str, torch.Tensor]] = {}

    def fill(self, live: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
        for file_name, tensors in live.items():
            bufs = self.buffers.setdefault(file_name, {})
            for name, t in tensors.items():
                buf = bufs.get(name)
                if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                    buf = bufs[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
                buf.copy_(t, non_blocking=t.is_cuda)
            for stale in set(bufs) - set(tensors):
                del bufs[stale]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return {f: dict(ts) for f, ts in self.buffers.items() if f in live}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self.buffers.values() for t in ts.values())


# -- loading in place ---------------------------------------------------------------------------

# -- checking a checkpoint's content before anything is applied -----------------------------------

def check_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
                    groups: Any) -> None:
    """The optimizer file must hold state for every trainable parameter, named `<param>/<key>`, the
    same keys for each, moments shaped like the parameter's local shard, and as many param groups
    as the optimizer has; raise ValueError naming what is wrong (a file of other tensors would
    otherwise load as no state at all)."""
    if not isinstance(groups, list) or len(groups) != len(optimizer.param_groups):
        raise ValueError(f"the checkpoint has {len(groups) if isinstance(groups, list) else 'no'} optimizer param "
                         f"groups, the optimizer has {len(optimizer.param_groups)}")
    params = dict(model.named_parameters())
    keys: dict[str, set[str]] = {}
    for full, t in tensors.items():
        name, _, key = full.rpartition("/")
        if name not in params:
            raise ValueError(f"optimizer tensor {full!r} belongs to no parameter of the model")
        shape = tuple(local_tensor(params[name]).shape)
        if t.dim() and tuple(t.shape) != shape:
            raise ValueError(f"optimizer tensor {full!r} is {list(t.shape)}, its parameter {list(shape)}")
        keys.setdefault(name, set()).add(key)
    trainable = {n for n, p in params.items() if p.requires_grad}
    missing = sorted(trainable - set(keys))
    if missing:
        raise ValueError(f"no optimizer state for {missing[0]}" + (f" and {len(missing) - 1} more parameters"
                                                                   if len(missing) > 1 else ""))
    if len({frozenset(k) for k in keys.values()}) > 1:
        raise ValueError("optimizer state keys differ between parameters")
    live = {k for p in params.values() for k, v in optimizer.state.get(p, {}).items() if isinstance(v, torch.Tensor)}
    saved = set().union(*keys.values()) if keys else set()
    if live and saved != live:
        raise ValueError(f"optimizer state holds {sorted(saved)}, this optimizer keeps {sorted(live)}")


def check_rng(tensors: dict[str, torch.Tensor]) -> None:
    cpu, ref = tensors.get("rng/cpu"), torch.get_rng_state()
    if cpu is None:
        raise ValueError("no rng/cpu tensor")
    if cpu.dtype != ref.dtype or cpu.shape != ref.shape:
        raise ValueError(f"rng/cpu is {list(cpu.shape)} {cpu.dtype}, expected {list(ref.shape)} {ref.dtype}")


def check_meta(meta: dict, step: int) -> None:
    """The JSON half of a part: the run position (matching the manifest's step), data position, scheduler."""
    position = RunPosition.from_json(meta.get(JSON_KEY))
    if position.step != step:
        raise ValueError(f"the run position says step {position.step}, the manifest step {step}")
    if not isinstance(meta.get("data_state"), dict):
        raise ValueError("no data loader position (data_state) in the manifest")
    if meta.get("scheduler") is not None and not isinstance(meta["scheduler"], dict):
        raise ValueError("the scheduler state is not an object")


@torch.no_grad()
def load_model(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        local_tensor(p).copy_(tensors[name])


@torch.no_grad()
def load_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
                   groups: list[dict]) -> None:
    """Fill the optimizer state (created if the optimizer has not stepped yet) and its hyperparameters
    (checked beforehand by check_optimizer)."""
    for name, p in model.named_parameters():
        prefix = f"{name}/"
        saved = {k[len(prefix):]: t for k, t in tensors.items() if k.startswith(prefix)}
        state = optimizer.state[p]
        for key, t in saved.items():
            if key not in state:
                # AdamW's step is a plain scalar; moments are shaped (and sharded) like the param.
                state[key] = torch.zeros_like(p) if t.shape == local_tensor(p).shape and t.dim() else t.clone()
            local_tensor(state[key]).copy_(t)
    for group, saved in zip(optimizer.param_groups, groups):
        for k, v in saved.items():
            group[k] = tuple(v) if isinstance(v, list) else v


def load_scheduler(scheduler: Any, sd: dict | None) -> None:
    if scheduler is not None and sd is not None:
        scheduler.load_state_dict({**scheduler.state_dict(), **sd})


def load_rng(tensors: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(tensors["rng/cpu"])
    if "rng/cuda" in tensors and torch.cuda.is_available():
        states = list(tensors["rng/cuda"])
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
    if "rng/mps" in tensors and torch.backends.mps.is_available():
        torch.mps.set_rng_state(tensors["rng/mps"])
