"""Training FLOPs per token of the LLaMA model, for model FLOPs utilization (MFU).

    flops_per_token = 6 * N + 12 * L * H * Q * T

N: parameters without the embedding table (a lookup, not a matmul; the output projection counts),
L layers, H heads, Q head dim, T tokens per sequence. 6 N: each weight takes one multiply-add in
forward and two in backward (2 FLOPs each). 12 L H Q T: per layer the scores QK^T and the weighted
sum over values, each 2 H Q T FLOPs per token forward, times 3 for forward and backward. The
convention of the PaLM paper, torchtitan and Prime: the causal (and document) mask is not
discounted and recomputation (activation checkpointing) is not counted, so the number is the
model's work, not the hardware's.
"""

from __future__ import annotations

from zb.models.args import ModelArgs


def non_embedding_params(args: ModelArgs) -> int:
    """N of the formula: every parameter except the token embedding table."""
    q, kv = args.n_heads * args.head_dim, args.kv_heads * args.head_dim
    attention = args.dim * q + 2 * args.dim * kv + q * args.dim
    feed_forward = 3 * args.dim * args.ffn_hidden
    norms = 2 * args.dim
    return args.n_layers * (attention + feed_forward + norms) + args.dim + args.vocab_size * args.dim


def flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token at sequence length `seq_len`."""
    return 6 * non_embedding_params(args) + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
