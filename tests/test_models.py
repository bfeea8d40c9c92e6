"""The LLaMA family: shapes, GQA, deterministic init, the size table, the loss."""

from __future__ import annotations

import math

import pytest
import torch

from zb.config import ConfigError
from zb.config_schema import ModelConfig
from zb.errors import ZbError
from zb.models import Transformer, count_params, model_args, model_names
from zb.models.loss import cross_entropy


def _debug(family: str = "llama2", **overrides) -> Transformer:
    args = model_args(ModelConfig(name="debug", type=family, **overrides), vocab_size=259, max_seq_len=32)
    model = Transformer(args)
    model.init_weights(0)
    return model


@pytest.mark.parametrize("family", ["llama2", "llama3"])
def test_forward_backward_shapes(family):
    model = _debug(family)
    tokens = torch.randint(0, 259, (3, 32))
    logits = model(tokens)
    assert logits.shape == (3, 32, 320)  # vocab 259 rounded up to a multiple of 64
    loss, _ = cross_entropy(logits, tokens)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert isinstance(model.layers, torch.nn.ModuleList) and len(model.layers) == model.args.n_layers


def test_llama3_uses_gqa_and_larger_theta():
    a2, a3 = _debug("llama2").args, _debug("llama3").args
    assert a2.kv_heads == a2.n_heads and a3.kv_heads < a3.n_heads
    assert a3.rope_theta > a2.rope_theta
    assert _debug("llama3").layers[0].attention.wk.weight.shape[0] == a3.kv_heads * a3.head_dim


def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa = _debug("llama2", n_kv_heads=2)
    mha = _debug("llama2")
    state = gqa.state_dict()
    rep = gqa.args.n_heads // gqa.args.kv_heads
    for i in range(gqa.args.n_layers):
        for w in ("wk", "wv"):
            key = f"layers.{i}.attention.{w}.weight"
            heads = state[key].view(gqa.args.kv_heads, gqa.args.head_dim, -1)
            state[key] = heads.repeat_interleave(rep, dim=0).reshape(-1, gqa.args.dim)
    mha.load_state_dict(state)
    tokens = torch.randint(0, 259, (2, 32))
    torch.testing.assert_close(gqa(tokens), mha(tokens), rtol=1e-5, atol=1e-5)


def test_causal():
    model = _debug()
    tokens = torch.randint(0, 259, (1, 32))
    changed = tokens.clone()
    changed[0, 20:] = (changed[0, 20:] + 1) % 259
    torch.testing.assert_close(model(tokens)[:, :20], model(changed)[:, :20])
    assert not torch.allclose(model(tokens)[:, 20:], model(changed)[:, 20:])


def test_init_is_deterministic_and_seed_dependent():
    a, b, c = _debug(), _debug(), Transformer(_debug().args)
    c.init_weights(1)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name


def test_init_after_meta_and_to_empty_matches_cpu_init():
    reference = _debug()
    with torch.device("meta"):
        model = Transformer(reference.args)
    model.to_empty(device="cpu")
    model.init_weights(0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
    torch.testing.assert_close(model.rope_cos, reference.rope_cos)
    tokens = torch.randint(0, 259, (1, 16))
    torch.testing.assert_close(model(tokens), reference(tokens))


def test_size_tables_are_prime_s_with_zb_s_cpu_sizes_and_param_counts_on_meta():
    """Each family has Prime's names and shapes (a Prime config's name_model means the same model),
    plus zb's debug and tiny, whose names Prime does not use."""
    assert model_names("llama2") == ["debug", "tiny", "debugmodel", "70M", "150M", "271M", "1B", "7B", "10B", "13B",
                                     "26B", "70B"]
    assert model_names("llama3") == ["debug", "tiny", "debugmodel", "1B", "8B", "10B", "70B", "405B"]
    shapes = {("llama2", "debugmodel"): (256, 2, 8, 8), ("llama3", "debugmodel"): (256, 8, 16, 16),
              ("llama2", "271M"): (1024, 16, 8, 8), ("llama2", "10B"): (5120, 32, 40, 40),
              ("llama3", "10B"): (4096, 42, 32, 8), ("llama3", "8B"): (4096, 32, 32, 8),
              ("llama2", "debug"): (64, 2, 4, 4)}
    for (family, name), shape in shapes.items():
        args = model_args(ModelConfig(name=name, type=family), vocab_size=32000, max_seq_len=128)
        assert (args.dim, args.n_layers, args.n_heads, args.kv_heads) == shape, (family, name)
        assert args.rope_theta == (500000.0 if family == "llama3" else 10000.0)
    expected = {("llama2", "debug"): (0.1e6, 1e6, 259), ("llama2", "tiny"): (5e6, 10e6, 259),
                ("llama2", "70M"): (50e6, 90e6, 32000), ("llama2", "1B"): (0.9e9, 1.2e9, 32000),
                ("llama2", "7B"): (6.5e9, 7e9, 32000), ("llama2", "13B"): (12.5e9, 13.5e9, 32000),
                ("llama3", "8B"): (7.5e9, 8.5e9, 128256), ("llama3", "10B"): (9.5e9, 10.5e9, 128256),
                ("llama3", "70B"): (68e9, 72e9, 128256)}
    for (family, name), (low, high, vocab) in expected.items():
        with torch.device("meta"):
            model = Transformer(model_args(ModelConfig(name=name, type=family), vocab_size=vocab, max_seq_len=128))
        assert low <= count_params(model) <= high, (family, name, count_params(model))
        assert model.output.weight.is_meta


def test_model_args_errors_name_the_keys():
    with pytest.raises(ConfigError, match=r"model.name = 'huge'.*debug, tiny"):
        model_args(ModelConfig(name="huge"), 259, 32)
    with pytest.raises(ConfigError, match=r"model.dim = 66 .*model.n_heads"):
        model_args(ModelConfig(dim=66), 259, 32)
    with pytest.raises(ConfigError, match=r"model.n_heads = 4 .*model.n_kv_heads = 3"):
        model_args(ModelConfig(n_kv_heads=3), 259, 32)
    with pytest.raises(ZbError, match="model.attn_impl = 'flash'"):  # not installed (exit 1) or no CUDA (exit 2)
        model_args(ModelConfig(attn_impl="flash"), 259, 32)
    assert model_args(ModelConfig(vocab_size=512), 259, 32).vocab_size == 512


def test_cross_entropy_ignores_masked_tokens_and_adds_z_loss():
    logits = torch.randn(2, 5, 11, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5))
    labels[0, :2] = -100
    loss, z = cross_entropy(logits, labels)
    valid = labels != -100
    manual = -torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0][valid].mean()
    torch.testing.assert_close(loss, manual)
    torch.testing.assert_close(z, logits.max(-1).values[valid].pow(2).mean())
    weighted, z2 = cross_entropy(logits, labels, z_loss_weight=0.5)
    torch.testing.assert_close(weighted, manual + 0.5 * z2)
    assert not z2.requires_grad
    weighted.backward()
    assert logits.grad is not None


def test_untrained_loss_is_near_uniform():
    model = _debug()
    tokens = torch.randint(0, 259, (4, 32))
    loss, _ = cross_entropy(model(tokens), tokens)
    assert abs(loss.item() - math.log(320)) < 1.5


def _sharded_init_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        with torch.device("meta"):
            model = Transformer(model_args(ModelConfig(name="debug"), 259, 32))
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        model.to_empty(device="cpu")
        model.init_weights(0)
        full = {name: p.full_tensor() for name, p in model.named_parameters()}
        if rank == 0:
            torch.save(full, out)
    finally:
        dist.destroy_process_group()
    from zb.process_exit import leave

    leave(0)  # finalizing after gloo can abort a passing rank (zb.process_exit)


def test_init_is_independent_of_fsdp_sharding(tmp_path):
    import torch.multiprocessing as mp

    from zb.testing.procs import free_port

    out = str(tmp_path / "full.pt")
    mp.start_processes(_sharded_init_worker, args=(free_port(), out), nprocs=2, start_method="spawn")
    sharded = torch.load(out, weights_only=True)
    for name, p in _debug().named_parameters():
        assert torch.equal(sharded[name], p), name
