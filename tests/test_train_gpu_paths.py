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


def test_fsdp_bf16_blocks_keep_fp32_rope_and_gathered_params_are_resharded():
    """2 ranks, FSDP2 with bf16 params on CPU: what the CUDA path does, minus the device."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from zb.testing.procs import REPO, free_port, subprocess_env

    driver = str(Path(__file__).parent / "drivers" / "fsdp_probe.py")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                           "127.0.0.1", "--master-port", str(free_port()), driver], capture_output=True, text=True,
                          timeout=150, env=subprocess_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    assert out["init_differs"] == []  # meta-device build + sharded init == whole-model CPU init, bit for bit
    assert out["rope_dtypes"] == ["torch.float32"]  # as on one device, not cast to bf16 by FSDP2
    # The root keeps embeddings/norm/output gathered for backward (no extra all-gather per micro batch);
    # the last block too. Backward reshards both.
    kept = out["gathered_between_forward_and_backward"]
    assert "tok_embeddings.weight" in kept and any(n.startswith("layers.1.") for n in kept)
    assert not any(n.startswith("layers.0.") for n in kept)
    assert out["gathered_after_backward"] == []
    # A forward without backward (evaluation) leaves them gathered until reshard: the final-checkpoint bug.
    assert "layers.1.attention.wq.weight" in out["gathered_after_no_grad_forward"]
    assert out["gathered_after_reshard"] == []


def test_one_process_meta_device_init_equals_the_whole_model_cpu_init():
    import torch

    from zb.models import Transformer, model_args
    from zb.train.device import Placement
    from zb.train.setup import build_model

    cfg = _cfg(**{"train.device": "cpu", "train.ac_ckpt": "true", "data.seq_length": 32})
    placement = Placement(torch.device("cpu"), "gloo", torch.float32, torch.float32)
    model = build_model(cfg, 320, placement)
    reference = Transformer(model_args(cfg.model, vocab_size=320, max_seq_len=32))
    reference.init_weights(cfg.train.seed)
    from zb.models.init import canonical_name

    got = {canonical_name(n): t for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    want = dict(list(reference.named_parameters()) + list(reference.named_buffers()))
    assert set(got) == set(want)
    assert all(t.device.type == "cpu" for t in got.values())
    assert [n for n in want if not torch.equal(got[n], want[n])] == []


def test_cpu_run_hides_gpus_before_anything_opens_a_cuda_context(monkeypatch):
    from zb.local_world import LocalWorld
    from zb.train.device import pick_placement

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    placement = pick_placement(_cfg(**{"train.device": "cpu"}).train, LocalWorld(rank=0, world_size=1))
    import os

    assert placement.device.type == "cpu" and os.environ["CUDA_VISIBLE_DEVICES"] == ""


def test_more_local_ranks_than_gpus_is_one_line_not_an_nccl_error(monkeypatch):
    import torch

    from zb.errors import InvalidInput
    from zb.local_world import LocalWorld
    from zb.train.device import pick_placement

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: pytest.fail("set_device reached"))
    with pytest.raises(InvalidInput, match=r"2 local ranks but 1 CUDA device.*--nproc-per-node 1"):
        pick_placement(_cfg().train, LocalWorld(rank=1, world_size=2))


def test_flash_attention_with_fp32_params_is_refused():
    import torch

    from zb.config import ConfigError
    from zb.train.device import Placement
    from zb.train.setup import check_placement

    cfg = _cfg(**{"model.attn_impl": "flash"})
    with pytest.raises(ConfigError, match=r"model.attn_impl = 'flash'.*needs bf16.*--train.param_dtype bf16"):
        check_placement(cfg, Placement(torch.device("cuda", 0), "nccl", torch.float32, torch.float32))
    check_placement(cfg, Placement(torch.device("cuda", 0), "nccl", torch.bfloat16, torch.float32))  # fine


def test_flash_attention_on_cpu_exits_2_with_one_line(tmp_path):
    import subprocess
    import sys

    from zb.testing.procs import REPO, subprocess_env

    proc = subprocess.run([sys.executable, "-m", "zb", "train", "--data.fake", "--train.device", "cpu",
                           "--model.attn_impl", "flash", "--optim.total_steps", "2", "--optim.warmup_steps", "1", "--log.dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env=subprocess_env(), cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if "model.attn_impl" in ln]
    assert len(errors) == 1 and "CUDA only" in errors[0] and "use auto or sdpa" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_attention_neither_repeats_kv_heads_nor_looks_for_flash_per_call(monkeypatch):
    import torch

    from zb.models import Transformer, llama, model_args

    cfg = _cfg(**{"model.type": "llama2", "model.n_kv_heads": 2})
    model = Transformer(model_args(cfg.model, vocab_size=320, max_seq_len=16))
    model.init_weights(0)
    tokens = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(llama, "flash_available", lambda: pytest.fail("flash_available looked up per call"))
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", lambda *a, **k: pytest.fail("K/V heads repeated"))
    assert model(tokens).isfinite().all()


def test_checkpoint_state_refuses_a_sharded_model_with_gathered_params(monkeypatch):
    """The save-time guard: a checkpoint of gathered params under shard names is a bug, never written."""
    from types import SimpleNamespace

    from zb.train import fsdp
    from zb.train.run import TrainingRun

    run = SimpleNamespace(model=object())
    monkeypatch.setattr(fsdp, "unsharded_params", lambda model: ["layers.1.attention.wq.weight"])
    with pytest.raises(RuntimeError, match="refusing to checkpoint.*layers.1.attention.wq.weight"):
        TrainingRun.checkpoint_state(run)
