"""ModelArgs, the size table of the LLaMA family, and `model_args` (config section `model` -> ModelArgs).

Two families share one table of shapes: llama2 (multi-head attention unless the size says otherwise,
RoPE theta 1e4) and llama3 (grouped-query attention, RoPE theta 5e5). The 10B entry is INTELLECT-1's
shape (dim 4096, 42 layers, 32 heads, 8 KV heads, FFN multiplier 1.3, multiple_of 1024) in both.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace
from typing import Optional

from zb.config import ConfigError
from zb.config_schema import ModelConfig

VOCAB_MULTIPLE = 64


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: Optional[int] = None  # None: as many as n_heads (plain multi-head attention)
    vocab_size: int = 320
    ffn_dim_multiplier: Optional[float] = None
    multiple_of: int = 32  # the SwiGLU hidden size is rounded up to a multiple of this
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 256
    attn_impl: str = "auto"  # auto | sdpa | flash
    family: str = "llama2"

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        """LLaMA's SwiGLU width: 2/3 of 4*dim, times the multiplier, rounded up to multiple_of."""
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


# Shapes by size. Sizes from 150M up follow Prime/torchtitan; debug and tiny are for tests and CPU runs.
_SHAPES: dict[str, dict] = {
    "debug": dict(dim=64, n_layers=2, n_heads=4, multiple_of=32),
    "tiny": dict(dim=256, n_layers=8, n_heads=8, multiple_of=64),
    "150M": dict(dim=1024, n_layers=12, n_heads=16, multiple_of=256),
    "1B": dict(dim=2048, n_layers=18, n_heads=16, multiple_of=256),
    "7B": dict(dim=4096, n_layers=32, n_heads=32, multiple_of=256),
    "10B": dict(dim=4096, n_layers=42, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024),
    "13B": dict(dim=5120, n_layers=40, n_heads=40, multiple_of=256),
    "70B": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096),
}

# What llama3 changes per size: fewer KV heads (GQA) and a larger RoPE base.
_LLAMA3_KV = {"debug": 2, "tiny": 4, "150M": 4, "1B": 8, "7B": 8, "10B": 8, "13B": 8, "70B": 8}


def _family(family: str) -> dict[str, dict]:
    table = {}
    for size, shape in _SHAPES.items():
        entry = dict(shape, family=family, rope_theta=10000.0)
        if family == "llama3":
            entry.update(n_kv_heads=_LLAMA3_KV[size], rope_theta=500000.0)
        table[size] = entry
    return table


MODEL_SIZES: dict[str, dict[str, dict]] = {"llama2": _family("llama2"), "llama3": _family("llama3")}


def model_names() -> list[str]:
    """Size names valid for model.name (the same for every family)."""
    return list(_SHAPES)


def flash_available() -> bool:
    """flash-attn importable and a CUDA device present (its kernels are CUDA only)."""
    if importlib.util.find_spec("flash_attn") is None:
        return False
    import torch

    return torch.cuda.is_available()


def model_args(model_cfg: ModelConfig, vocab_size: int, max_seq_len: int) -> ModelArgs:
    """ModelArgs for the configured size and family, with the config's overrides applied and checked.

    `vocab_size` is the tokenizer's; unless model.vocab_size is set it is rounded up to a multiple of
    64 (faster matmuls, room for specials).
    """
    table = MODEL_SIZES[model_cfg.type]
    if model_cfg.name not in table:
        raise ConfigError(f"model.name = {model_cfg.name!r}: unknown model size; valid names: "
                          f"{', '.join(model_names())}")
    args = ModelArgs(**table[model_cfg.name], max_seq_len=max_seq_len, attn_impl=model_cfg.attn_impl,
                     vocab_size=-(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE)
    overrides = {k: getattr(model_cfg, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size",
                                                    "rope_theta") if getattr(model_cfg, k) is not None}
    if "n_heads" in overrides and "n_kv_heads" not in overrides and args.n_kv_heads is not None:
        # A size's KV count may not divide a new head count: keep MHA unless asked for GQA.
        overrides["n_kv_heads"] = None if args.family == "llama2" else _divisor_at_most(overrides["n_heads"],
                                                                                        args.n_kv_heads)
    args = replace(args, **overrides)
    _check(args, vocab_size, model_cfg.vocab_size is not None)
    return args


def _divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def _check(args: ModelArgs, tokenizer_vocab: int, vocab_overridden: bool) -> None:
    if args.dim % args.n_heads:
        raise ConfigError(f"model.dim = {args.dim} must be divisible by model.n_heads = {args.n_heads}")
    if args.head_dim % 2:
        raise ConfigError(f"model.dim / model.n_heads = {args.head_dim} must be even (RoPE rotates pairs)")
    if args.n_heads % args.kv_heads:
        raise ConfigError(f"model.n_heads = {args.n_heads} must be divisible by model.n_kv_heads = {args.kv_heads}")
    if vocab_overridden and args.vocab_size < tokenizer_vocab:
        raise ConfigError(f"model.vocab_size = {args.vocab_size} is smaller than the tokenizer's vocabulary "
                          f"({tokenizer_vocab}); raise it or unset it")
    if args.attn_impl == "flash" and not flash_available():
        raise ConfigError("model.attn_impl = 'flash': flash-attn is not installed or no CUDA device is present; "
                          "install zb[gpu] on a CUDA machine, or use auto or sdpa")
