"""The LLaMA transformer: RMSNorm, RoPE, SwiGLU, grouped-query attention.

Layout follows torchtitan so that FSDP2 and activation checkpointing wrap `Transformer.layers[i]`:
`tok_embeddings`, `layers` (nn.ModuleList of TransformerBlock), `norm`, `output`. The model knows
nothing of distribution; `init_weights(seed)` gives the same weights on every node and device
(see zb.models.init).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zb.models.args import ModelArgs, flash_available
from zb.models.init import init_transformer


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device: torch.device | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, [max_seq_len, head_dim // 2], in fp32."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32, device=device), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x0, x1) of the head dim, as Meta's complex-number formulation does.

    x: [B, T, H, D]; cos, sin: [T, D/2].
    """
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32: bf16 sums of squares lose too much precision.
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        # Decided once here, not per call: looking for flash-attn inside `attend` (a module spec
        # lookup) breaks torch.compile's graph in every block.
        self.attn_impl = "sdpa" if args.attn_impl == "auto" and not flash_available() else args.attn_impl
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attend(q, k, v, self.attn_impl)
        return self.wo(out.reshape(b, t, -1))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, impl: str) -> torch.Tensor:
    """Causal attention over [B, T, H, D] tensors (K/V may have fewer heads); returns [B, T, H, D].

    impl: "flash", "sdpa", or "auto" (only when flash-attn is available: flash for bf16/fp16 CUDA
    tensors, SDPA otherwise).
    """
    if impl == "flash" or (impl == "auto" and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        from flash_attn import flash_attn_func  # CUDA only; handles GQA natively

        return flash_attn_func(q, k, v, causal=True)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    # Grouped-query attention without materialising repeated K/V heads (a copy of K and V per step).
    gqa = k.shape[1] != q.shape[1]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa).transpose(1, 2)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(i, args) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Non-persistent: not in state dicts, recomputed by init_weights (after meta init + to_empty).
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, vocab_size]."""
        t = tokens.shape[1]
        if t > self.args.max_seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds max_seq_len {self.args.max_seq_len}")
        h = self.tok_embeddings(tokens)
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))

    def reset_rope(self) -> None:
        """Recompute the RoPE tables in place on the buffers' current device."""
        cos, sin = rope_tables(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta,
                               device=self.rope_cos.device)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init from `seed`: identical on every node, device and sharding."""
        self.reset_rope()
        init_transformer(self, seed)


def count_params(model: nn.Module) -> int:
    """Parameters of the full (unsharded) model; works on the meta device without allocating."""
    # numel() of a DTensor is its global size, so a sharded model counts the same as an unsharded one.
    return sum(p.numel() for p in model.parameters())
