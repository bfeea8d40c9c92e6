"""The CUDA paths that can be checked without a GPU: which group carries local control traffic, how
long it may wait, and the one-line refusals of settings that cannot work together."""

from __future__ import annotations

from datetime import timedelta

import pytest

from zb.config import load_config


def _cfg(**over: str):
    return load_config([], {k: str(v) for k, v in over.items()}, environ={})


def test_control_group_is_gloo_even_when_the_local_group_is_nccl(monkeypatch):
    import torch.distributed as dist

    from zb.train import device

    made = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "new_group", lambda **kw: made.update(kw) or "control-pg")
    device.init_control_group(1234.0)
    try:
        assert made["backend"] == "gloo"
        assert made["timeout"] == timedelta(seconds=1234.0)
        assert device.control_group() == "control-pg"
    finally:
        device._control = None


def test_control_group_must_exist_before_use(monkeypatch):
    import torch.distributed as dist

    from zb.train import device

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(RuntimeError, match="init_control_group"):
        device.control_group()


def test_control_timeout_covers_a_slow_int8_outer_all_reduce():
    from zb.train.device import LOCAL_TIMEOUT_S, control_timeout_s

    assert control_timeout_s(_cfg(), 10**10) == LOCAL_TIMEOUT_S  # no DiLoCo: no long control waits
    diloco = _cfg(**{"diloco.compression": "int8", "diloco.min_bandwidth_mbps": 10})
    # 10B params, int8, ring (2 bytes per param on the wire) at 10 Mbit/s: 16,000 s of transfer alone.
    assert control_timeout_s(diloco, 10**10) > 16_000
    assert control_timeout_s(diloco, 1000) >= LOCAL_TIMEOUT_S
