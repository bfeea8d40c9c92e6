"""Prime's (ZeroBand's) config spelling, read as zb's: every key of Prime's config classes, what it
becomes in zb, and Prime's defaults.

Prime's files load unchanged and mean what they meant in Prime. A key Prime and zb spell alike needs
nothing here; a key spelled otherwise is an alias of the zb key (with its values translated where
they differ); a key zb has no counterpart for is accepted with one warning that names it and says
what to use instead. A file that uses any Prime-only spelling is read as Prime's: the keys it leaves
unset then take Prime's defaults (its 150M model on datasets/fineweb-edu, lr 4e-4, schedules that
decay to 0...), not zb's (the built-in CPU demo run).

Pure data and translation: zb.config applies it to files, ZERO_BAND_* variables and flags.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zb.errors import InvalidInput

ENV_PREFIX = "ZERO_BAND_"


class PrimeValueError(InvalidInput):
    """A Prime key has a value Prime itself would not have accepted."""


def _choice(mapping: dict[Any, Any], allowed: str) -> Callable[[Any], Any]:
    """Translate a value through `mapping` (strings case-insensitively, as Prime's enums)."""

    def convert(value: Any) -> Any:
        key = value.strip().lower() if isinstance(value, str) else value
        if key not in mapping:
            raise PrimeValueError(f"must be one of {allowed}")
        return mapping[key]

    return convert


_BOOL = {True: True, False: False, "true": True, "false": False, "1": True, "0": False}


@dataclass(frozen=True)
class Alias:
    """A Prime key that zb spells otherwise: its zb key and, where values differ, their translation
    (a function that raises PrimeValueError for values Prime would have refused); `boolean` when
    Prime's key was a bool though zb's is not (a bare --flag then means true)."""
    zb_key: str
    value: Callable[[Any], Any] | None = None
    boolean: bool = False


@dataclass(frozen=True)
class NoEffect:
    """A Prime key with no counterpart in zb: accepted, warned about once, with what to do instead.
    `unless` is a value for which there is nothing to warn about (Prime's default or the
    behaviour zb has anyway)."""
    why: str
    unless: Any = object()


# Prime keys (as dotted paths) that zb spells otherwise or does without. Keys Prime and zb share
# (train.micro_bs, optim.batch_size, diloco.inner_steps, data.seq_length, ckpt.path, ...) are absent:
# they are zb keys already, with the same meaning.
PRIME_KEYS: dict[str, Alias | NoEffect] = {
    # Top level.
    "name_model": Alias("model.name"),
    "type_model": Alias("model.type"),
    "log_level": Alias("log.level"),
    "log_all_rank": Alias("log.all_ranks"),
    # Prime's metric logger: wandb or nothing (its "dummy" kept metrics in memory and pickled them to a
    # file named after the project; zb's metrics.jsonl is always there unless log.backends drops it).
    "project": Alias("log.wandb_project"),
    "run_id": Alias("log.wandb_id"),
    "run_name": Alias("log.wandb_name"),
    "metric_logger_type": Alias("log.backends", _choice({"wandb": "jsonl,wandb", "dummy": "jsonl"}, "wandb or dummy")),
    "wandb_resume": Alias("log.wandb_resume"),
    # [optim.optim]: the inner optimizer.
    "optim.optim.type": NoEffect("zb's inner optimizer is AdamW; SOAP is not implemented", unless="adam"),
    "optim.optim.lr": Alias("optim.lr"),
    "optim.optim.weight_decay": Alias("optim.weight_decay"),
    "optim.optim.betas1": Alias("optim.adam_betas1"),
    "optim.optim.betas2": Alias("optim.adam_betas2"),
    "optim.optim.max_preconditioner_dim": NoEffect("a SOAP setting; zb's inner optimizer is AdamW"),
    "optim.optim.precondition_frequency": NoEffect("a SOAP setting; zb's inner optimizer is AdamW"),
    # [train]
    "train.reduce_fp32": Alias("train.reduce_dtype", _choice({True: "fp32", False: "param", "true": "fp32",
                                                              "false": "param"}, "true or false"), boolean=True),
    # flex only differed from SDPA in carrying the document mask, which zb applies on every kernel.
    "train.attn_fn": Alias("model.attn_impl", _choice({"flex": "auto", "math": "sdpa"}, "flex or math")),
    "train.torch_profiler": NoEffect("no profiler hook in zb; run under `python -m torch.profiler` or py-spy",
                                     unless=False),
    "train.memory_profiler.freq": NoEffect("no memory profiler hook in zb"),
    "train.memory_profiler.snapshot_dir": NoEffect("no memory profiler hook in zb"),
    # [data]
    "data.val_dataset_name_or_paths": NoEffect("Prime's training loop never read it; zb evaluates on a held-out "
                                               "fraction of the training source (data.eval_fraction)"),
    "data.num_workers": NoEffect("zb tokenizes in the training process; data.prefetch makes batches ahead in a "
                                 "background thread"),
    # Prime's packing always ran; the key only chose whether its flex-attention mask kept documents apart.
    "data.sequence_packing": Alias("data.document_mask"),
    "data.max_train_samples": NoEffect("Prime declared it but never read it; to train on less data, set "
                                       "optim.total_steps or train.max_steps"),
    "data.max_eval_samples": NoEffect("Prime declared it but never read it; eval.batches sets the size of an "
                                      "evaluation"),
    # [ckpt]: zb keeps the data position inside each checkpoint and finds live-recovery sources itself.
    "ckpt.remote_data_path": NoEffect("zb stores the data position inside each checkpoint (and its remote copy)"),
    "ckpt.remote_data_load": NoEffect("zb restores the data position from the checkpoint it resumes", unless=False),
    "ckpt.data_path": NoEffect("zb restores the data position from the checkpoint it resumes"),
    "ckpt.live_recovery_rank_src": NoEffect("zb's joiners fetch state from any live node (set ckpt.live_recovery "
                                            "= true on the nodes that serve it)"),
    "ckpt.token_count": NoEffect("zb counts tokens from the checkpoint's own position"),
    # [monitor]: Prime's HTTP progress reporter.
    "monitor.log_flush_interval": NoEffect("zb has no HTTP monitor; metrics go to <log.dir>/metrics.jsonl"),
    "monitor.base_url": NoEffect("zb has no HTTP monitor; metrics go to <log.dir>/metrics.jsonl"),
    "monitor.auth_token": NoEffect("zb has no HTTP monitor; metrics go to <log.dir>/metrics.jsonl"),
}

# Every key of Prime's config classes that zb spells the same way (for the ZERO_BAND_* twins and the
# test that covers every Prime key).
SHARED_KEYS = (
    "diloco.outer_lr", "diloco.inner_steps", "diloco.compression", "diloco.retry_all_reduce",
    "data.dataset_name_or_paths", "data.seq_length", "data.fake", "data.data_rank", "data.data_world_size",
    "data.dataset_ratio", "data.split_by_data_rank", "data.reverse_data_files",
    "optim.sched_type", "optim.warmup_steps", "optim.stable_steps", "optim.total_steps", "optim.batch_size",
    "optim.z_loss", "optim.z_loss_weight", "optim.num_chunks",
    "train.micro_bs", "train.ac_ckpt", "train.reshard_after_forward", "train.log_model_hash", "train.torch_compile",
    "train.fused_linear_ce", "train.fsdp_cpu_offload",
    "ckpt.path", "ckpt.interval", "ckpt.topk", "ckpt.remote.path", "ckpt.remote.interval", "ckpt.resume",
    "ckpt.skip_dataloader",
)

# Tables that exist only in Prime's spelling.
PRIME_SECTIONS = {"optim.optim", "train.memory_profiler", "monitor"}

# What Prime's config classes default to, where zb's built-in default differs (zb's defaults are a
# two-minute CPU demo). Applied to the keys a Prime file leaves unset.
PRIME_DEFAULTS: dict[str, Any] = {
    "model.name": "150M",
    "model.type": "llama3",
    "optim.lr": 4e-4,
    "optim.warmup_steps": 1000,
    "optim.stable_steps": 80_000,
    "optim.total_steps": 88_000,
    "optim.batch_size": 512,
    "optim.min_lr_ratio": 0.0,  # Prime's cosine, linear and wsd-sqrt schedules all end at 0
    "train.micro_bs": 1,
    "train.reduce_dtype": "param",  # Prime's reduce_fp32 = false: FSDP reduces in the params' dtype
    "data.seq_length": 1024,
    "data.dataset_name_or_paths": "datasets/fineweb-edu",
    "data.eval_fraction": 0.0,  # Prime trained on every document and evaluated nothing during training
    "eval.interval": -1,
    "log.wandb_project": "zeroband",
}


def is_prime_only(key: str) -> bool:
    """A key (or table) only Prime spells this way: its presence makes a file Prime's."""
    return key in PRIME_KEYS or key in PRIME_SECTIONS


def env_name(prime_key: str) -> str:
    """Prime's environment twin of a config key: ZERO_BAND_ + the dotted path in capitals, dots as _."""
    return ENV_PREFIX + prime_key.replace(".", "_").upper()


def all_keys() -> list[str]:
    """Every key of Prime's config classes."""
    return sorted(set(PRIME_KEYS) | set(SHARED_KEYS))


ENV_TWINS: dict[str, str] = {env_name(k): k for k in all_keys()}


@dataclass(frozen=True)
class Translated:
    """What a Prime key and value become: a zb key and value, or a reason it has no effect."""
    zb_key: str | None
    value: Any = None
    no_effect: str | None = None


def translate(prime_key: str, value: Any) -> Translated:
    """The zb meaning of a Prime key (one in PRIME_KEYS) with its value; raises PrimeValueError."""
    entry = PRIME_KEYS[prime_key]
    if isinstance(entry, NoEffect):
        unless = entry.unless
        same = value == unless or (isinstance(value, str) and isinstance(unless, (str, bool))
                                   and _normal(value) == _normal(unless))
        return Translated(None, no_effect=None if same else entry.why)
    return Translated(entry.zb_key, value if entry.value is None else entry.value(value))


def _normal(value: Any) -> Any:
    if isinstance(value, bool):
        return value
    text = value.strip().lower()
    return _BOOL.get(text, text)
