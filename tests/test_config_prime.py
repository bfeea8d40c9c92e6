"""Prime's config spelling: its files, ZERO_BAND_* twins and flags load in zb with Prime's meaning.

The key list below is written from Prime's config classes (Config, DataConfig, OptimConfig with
AdamConfig/SoapConfig, TrainConfig, MemoryProfilerConfig, DilocoConfig, MonitorConfig, CkptConfig,
RemoteConfig at ZeroBand commit d57965b), independently of zb.config_prime, so a key zb forgets fails.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from zb import config_prime as prime
from zb.config import KEYS, ConfigError, load_config, source_of, to_dict

# Prime key -> (a TOML value a user might set, the zb key it must set, the value that key must get);
# zb key None: accepted with a warning naming the key.
PRIME = {
    "name_model": ("271M", "model.name", "271M"),
    "type_model": ("llama2", "model.type", "llama2"),
    "project": ("myproj", "log.wandb_project", "myproj"),
    "run_id": ("abc", "log.wandb_id", "abc"),
    "run_name": ("first", "log.wandb_name", "first"),
    "metric_logger_type": ("wandb", "log.backends", "jsonl,wandb"),
    "wandb_resume": (True, "log.wandb_resume", True),
    "log_level": ("DEBUG", "log.level", "DEBUG"),
    "log_all_rank": (True, "log.all_ranks", True),
    "diloco.outer_lr": (0.5, "diloco.outer_lr", 0.5),
    "diloco.inner_steps": (25, "diloco.inner_steps", 25),
    "diloco.compression": ("uint8", "diloco.compression", "int8"),
    "diloco.retry_all_reduce": (5, "diloco.retry_all_reduce", 5),
    "data.dataset_name_or_paths": ("/data/a", "data.dataset_name_or_paths", "/data/a"),
    "data.val_dataset_name_or_paths": ("/data/val", None, None),
    "data.seq_length": (2048, "data.seq_length", 2048),
    "data.fake": (False, "data.fake", False),
    "data.num_workers": (4, None, None),
    "data.data_rank": (1, "data.data_rank", 1),
    "data.data_world_size": (4, "data.data_world_size", 4),
    "data.sequence_packing": (False, "data.document_mask", False),
    "data.max_train_samples": (1000, None, None),
    "data.max_eval_samples": (100, None, None),
    "data.dataset_ratio": ("100", "data.dataset_ratio", "100"),
    "data.reverse_data_files": (True, "data.reverse_data_files", True),
    "data.split_by_data_rank": (False, "data.split_by_data_rank", False),
    "optim.optim.type": ("soap", None, None),
    "optim.optim.lr": (7.5e-5, "optim.lr", 7.5e-5),
    "optim.optim.weight_decay": (0.05, "optim.weight_decay", 0.05),
    "optim.optim.betas1": (0.8, "optim.adam_betas1", 0.8),
    "optim.optim.betas2": (0.99, "optim.adam_betas2", 0.99),
    "optim.optim.max_preconditioner_dim": (4096, None, None),
    "optim.optim.precondition_frequency": (10, None, None),
    "optim.sched_type": ("wsd-sqrt", "optim.sched_type", "wsd-sqrt"),
    "optim.warmup_steps": (100, "optim.warmup_steps", 100),
    "optim.stable_steps": (700, "optim.stable_steps", 700),
    "optim.total_steps": (1000, "optim.total_steps", 1000),
    "optim.batch_size": (64, "optim.batch_size", 64),
    "optim.z_loss": (True, "optim.z_loss", True),
    "optim.z_loss_weight": (1e-4, "optim.z_loss_weight", 1e-4),
    "optim.num_chunks": (4, "optim.num_chunks", 4),
    "train.micro_bs": (8, "train.micro_bs", 8),
    "train.ac_ckpt": (2, "train.ac_ckpt", 2),
    "train.reshard_after_forward": (False, "train.reshard_after_forward", False),
    "train.reduce_fp32": (True, "train.reduce_dtype", "fp32"),
    "train.log_model_hash": (True, "train.log_model_hash", True),
    "train.memory_profiler.freq": (5, None, None),
    "train.memory_profiler.snapshot_dir": ("/tmp/snap", None, None),
    "train.torch_profiler": (True, None, None),
    "train.torch_compile": (True, "train.torch_compile", True),
    "train.fused_linear_ce": (True, "train.fused_linear_ce", True),
    "train.fsdp_cpu_offload": (True, "train.fsdp_cpu_offload", True),
    "train.attn_fn": ("math", "model.attn_impl", "sdpa"),
    "monitor.log_flush_interval": (5, None, None),
    "monitor.base_url": ("http://x", None, None),
    "monitor.auth_token": ("secret", None, None),
    "ckpt.path": ("/ckpt", "ckpt.path", "/ckpt"),
    "ckpt.interval": (100, "ckpt.interval", 100),
    "ckpt.topk": (3, "ckpt.topk", 3),
    "ckpt.remote.path": ("/remote", "ckpt.remote.path", "/remote"),
    "ckpt.remote.interval": (200, "ckpt.remote.interval", 200),
    "ckpt.remote_data_path": ("/remote-data", None, None),
    "ckpt.remote_data_load": (True, None, None),
    "ckpt.resume": ("latest", "ckpt.resume", "latest"),
    "ckpt.skip_dataloader": (True, "ckpt.skip_dataloader", True),
    "ckpt.live_recovery_rank_src": (0, None, None),
    "ckpt.data_path": ("/data-state", None, None),
    "ckpt.token_count": (1000, None, None),
}


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else repr(value)


def prime_file(tmp_path, entries: dict, name: str = "prime.toml") -> str:
    """A TOML file in Prime's shape: top-level keys first, then one table per section."""
    tables: dict[str, list[str]] = {}
    for key, value in entries.items():
        section, _, leaf = key.rpartition(".")
        tables.setdefault(section, []).append(f"{leaf} = {_toml_value(value)}")
    lines = tables.pop("", [])
    for section, body in tables.items():
        lines += ["", f"[{section}]", *body]
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_every_prime_key_is_known_to_zb():
    assert set(prime.all_keys()) == set(PRIME), "zb.config_prime must list exactly Prime's keys"
    for key in prime.SHARED_KEYS:
        assert key in KEYS, f"{key} is listed as spelled alike, but zb has no such key"
    for key, entry in prime.PRIME_KEYS.items():
        if isinstance(entry, prime.Alias):
            assert entry.zb_key in KEYS, f"{key} is an alias of {entry.zb_key}, which zb does not have"


def test_a_file_with_every_prime_key_loads_with_prime_s_meaning(tmp_path, caplog):
    path = prime_file(tmp_path, {key: value for key, (value, _, _) in PRIME.items()})
    with caplog.at_level(logging.WARNING, logger="zb.config"):
        cfg = load_config([path], {}, environ={})
    flat = {f"{s}.{k}" if s else k: v for s, k, v in _leaves(to_dict(cfg))}
    for key, (_, zb_key, expected) in PRIME.items():
        if zb_key is not None:
            assert flat[zb_key] == expected, key
            assert "file" in source_of(cfg, zb_key), key
        else:
            assert f"{key} (file {path}) has no effect in zb" in caplog.text, key
    assert cfg.diloco is not None


def _leaves(tree, prefix=""):
    for name, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}.{name}" if prefix else name)
        else:
            yield prefix, name, value


def test_prime_defaults_fill_a_prime_file_but_not_a_zb_file(tmp_path):
    cfg = load_config([prime_file(tmp_path, {"name_model": "debugmodel", "train.micro_bs": 4})], {}, environ={})
    assert (cfg.model.name, cfg.model.type) == ("debugmodel", "llama3")  # Prime's default family
    assert cfg.optim.lr == 4e-4 and cfg.optim.total_steps == 88_000 and cfg.optim.min_lr_ratio == 0.0
    assert cfg.data.seq_length == 1024 and cfg.data.dataset_name_or_paths == "datasets/fineweb-edu"
    assert cfg.data.tokenizer == "meta-llama/Meta-Llama-3-8B"  # Prime's tokenizer for llama3
    assert cfg.train.reduce_dtype == "param" and cfg.eval.interval == -1
    assert source_of(cfg, "optim.lr") == "Prime's default"
    zb_file = tmp_path / "zb.toml"
    zb_file.write_text("[train]\nmicro_bs = 4\n")
    plain = load_config([str(zb_file)], {}, environ={})
    assert plain.model.name == "debug" and plain.optim.lr == 3e-3 and plain.data.tokenizer == "bytes"


def test_a_size_only_llama2_has_takes_llama2_when_the_file_names_no_family(tmp_path):
    """Prime's 13B config names no type_model: Prime's default llama3 has no 13B (Prime failed on it)."""
    cfg = load_config([prime_file(tmp_path, {"name_model": "13B"})], {}, environ={})
    assert (cfg.model.name, cfg.model.type) == ("13B", "llama2")
    assert "llama3 has no 13B" in source_of(cfg, "model.type")
    with pytest.raises(ConfigError, match="no such llama3 size"):
        load_config([prime_file(tmp_path, {"name_model": "13B", "type_model": "llama3"})], {}, environ={})


def test_prime_fake_data_replaces_the_default_dataset(tmp_path):
    cfg = load_config([prime_file(tmp_path, {"name_model": "debugmodel", "data.fake": True})], {}, environ={})
    assert cfg.data.fake and cfg.data.dataset_name_or_paths == "builtin" and cfg.data.tokenizer == "bytes"


def test_zero_band_twins_of_every_kind_of_key(tmp_path, caplog):
    env = {"ZERO_BAND_NAME_MODEL": "70M", "ZERO_BAND_TYPE_MODEL": "llama2", "ZERO_BAND_TRAIN_MICRO_BS": "2",
           "ZERO_BAND_OPTIM_OPTIM_LR": "0.01", "ZERO_BAND_DILOCO_INNER_STEPS": "7",
           "ZERO_BAND_CKPT_REMOTE_INTERVAL": "30", "ZERO_BAND_TRAIN_AC_CKPT": "true",
           "ZERO_BAND_MONITOR_BASE_URL": "http://m"}
    with caplog.at_level(logging.WARNING, logger="zb.config"):
        cfg = load_config([], {}, environ=env)
    assert (cfg.model.name, cfg.train.micro_bs, cfg.optim.lr, cfg.diloco.inner_steps) == ("70M", 2, 0.01, 7)
    assert cfg.ckpt.remote.interval == 30 and cfg.train.ac_ckpt == 1
    assert source_of(cfg, "optim.lr") == "env ZERO_BAND_OPTIM_OPTIM_LR, Prime's optim.optim.lr"
    assert "monitor.base_url (env ZERO_BAND_MONITOR_BASE_URL) has no effect in zb" in caplog.text
    assert "unknown environment variable" not in caplog.text
    # zb's own twin of the same key wins over Prime's.
    both = load_config([], {}, environ={"ZERO_BAND_TRAIN_MICRO_BS": "2", "ZB_TRAIN_MICRO_BS": "4"})
    assert both.train.micro_bs == 4


@pytest.mark.parametrize("entries, message", [
    ({"train.attn_fn": "fast"}, "train.attn_fn = 'fast' (from file"),
    ({"train.reduce_fp32": "maybe"}, "train.reduce_fp32 = 'maybe' (from file"),
    ({"name_model": "3B"}, "model.name = '3B' (from file"),
    ({"optim.optim.lr": -1.0}, "optim.lr = -1.0 (from file"),
    ({"optim.optim.lrr": 1.0}, "unknown key optim.optim.lrr"),
])
def test_bad_prime_values_name_the_key_and_file(tmp_path, entries, message):
    with pytest.raises(ConfigError) as e:
        load_config([prime_file(tmp_path, {"name_model": "debugmodel", **entries})], {}, environ={})
    assert message in str(e.value) and e.value.exit_code == 2


def test_prime_flags_and_print_config_round_trip(tmp_path):
    """Prime's launch line works (flags in Prime's spelling), and --print-config shows zb's canonical
    form, notes the aliases, and loads back to the same config."""
    path = prime_file(tmp_path, {"name_model": "debugmodel", "type_model": "llama2", "data.num_workers": 2,
                                 "optim.optim.lr": 1e-3, "train.ac_ckpt": True, "data.fake": True,
                                 "diloco.inner_steps": 5})
    out = subprocess.run([sys.executable, "-m", "zb", "train", f"@{path}", "--optim.optim.betas1", "0.85",
                          "--train.reduce_fp32", "--print-config"], capture_output=True, text=True, check=True)
    assert "optim.optim.betas1 -> optim.adam_betas1 (flag --optim.optim.betas1)" in out.stdout
    assert "data.num_workers (file" in out.stdout and "has no effect in zb" in out.stdout
    printed = tmp_path / "printed.toml"
    printed.write_text(out.stdout)
    again = load_config([str(printed)], {}, environ={})
    first = load_config([path], {"optim.optim.betas1": "0.85", "train.reduce_fp32": "true"}, environ={})
    assert to_dict(again) == to_dict(first)
    assert again.optim.adam_betas1 == 0.85 and again.train.reduce_dtype == "fp32" and again.train.ac_ckpt == 1


def test_ac_ckpt_every_nth_block():
    import torch

    from zb.config_schema import ModelConfig
    from zb.models import Transformer, model_args
    from zb.train.fsdp import apply_activation_checkpointing

    model = Transformer(model_args(ModelConfig(name="tiny"), vocab_size=259, max_seq_len=16))
    assert apply_activation_checkpointing(model, every=3) == 3
    wrapped = [i for i, block in enumerate(model.layers) if type(block).__name__ == "CheckpointWrapper"]
    assert wrapped == [0, 3, 6]
    tokens = torch.randint(0, 259, (2, 16))
    model(tokens).sum().backward()  # still trains
