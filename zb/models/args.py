"""ModelArgs and `model_args` (config section `model` -> ModelArgs, shapes from zb.model_sizes).

Each family has its own table, as in Prime: llama2 (multi-head attention unless the size says
otherwise, RoPE theta 1e4) and llama3 (grouped-query attention, RoPE theta 5e5). A name can mean
different shapes in the two (llama2 10B is 5120 wide; llama3 10B is INTELLECT-1's 4096 x 42 layers).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace

from zb.config import ConfigError
from zb.config_schema import ModelConfig
from zb.errors import missing_extra
from zb.model_sizes import MODEL_SIZES, model_names

VOCAB_MULTIPLE = 64


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: as many as n_heads (plain multi-head attention)
    vocab_size: int = 320
    ffn_dim_multiplier: float | None = None
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
        raise ConfigError(f"model.name = {model_cfg.name!r}: no such {model_cfg.type} size; valid names: "
                          f"{', '.join(model_names(model_cfg.type))}")
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
    if args.attn_impl == "flash" and importlib.util.find_spec("flash_attn") is None:
        raise missing_extra("model.attn_impl = 'flash'", "flash-attn", "gpu")
    if args.attn_impl == "flash" and not flash_available():
        raise ConfigError("model.attn_impl = 'flash': flash-attn runs on CUDA only and no CUDA device is present; "
                          "use auto or sdpa")
