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
from zb.models.docmask import DocSpans, dense_mask, spans
from zb.models.init import init_transformer
from zb.models.loss import LossSpec, chunked_cross_entropy, cross_entropy


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


def attention_impl(requested: str) -> str:
    """"auto" stays "auto" only where flash-attn is available; decided once per model, not per call:
    looking for flash-attn inside `attend` (a module spec lookup) breaks torch.compile's graph in
    every block."""
    return "sdpa" if requested == "auto" and not flash_available() else requested


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        self.attn_impl = attention_impl(args.attn_impl)
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs: DocSpans | None = None
                ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attend(q, k, v, self.attn_impl, docs)
        return self.wo(out.reshape(b, t, -1))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, impl: str, docs: DocSpans | None = None
           ) -> torch.Tensor:
    """Causal attention over [B, T, H, D] tensors (K/V may have fewer heads); returns [B, T, H, D].

    impl: "flash", "sdpa", or "auto" (only when flash-attn is available: flash for bf16/fp16 CUDA
    tensors, SDPA otherwise). docs: where the documents of each row start (zb.models.docmask);
    None attends over the whole row.
    """
    b, t, h, d = q.shape
    if impl == "flash" or (impl == "auto" and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        if docs is None:
            from flash_attn import flash_attn_func  # CUDA only; handles GQA natively

            return flash_attn_func(q, k, v, causal=True)
        from flash_attn import flash_attn_varlen_func

        # Every document is its own sequence of one flat batch. max_seqlen only sizes the kernel's
        # grid, so the row length bounds it: the exact value would cost a host sync per forward,
        # and a value that changes per batch would recompile a compiled block.
        out = flash_attn_varlen_func(q.reshape(b * t, h, d), k.flatten(0, 1), v.flatten(0, 1),
                                     docs.cu_seqlens, docs.cu_seqlens, t, t, causal=True)
        return out.view(b, t, h, d)
    mask = None
    if docs is not None:
        # Built by the model for SDPA; here only when an "auto" model fell back to SDPA (fp32 on CUDA).
        mask = docs.dense if docs.dense is not None else dense_mask(docs.cu_seqlens, b, t)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    # Grouped-query attention without materialising repeated K/V heads (a copy of K and V per step).
    gqa = k.shape[1] != q.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                          enable_gqa=gqa).transpose(1, 2)


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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs: DocSpans | None = None
                ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, docs)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    rope_cos: torch.Tensor   # buffers (register_buffer below)
    rope_sin: torch.Tensor

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.attn_impl = attention_impl(args.attn_impl)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(i, args) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Non-persistent: not in state dicts, recomputed by init_weights (after meta init + to_empty).
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                loss: LossSpec | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T] -> logits [B, T, vocab_size]; with `labels` [B, T], the loss instead:
        (total, z_loss detached), computed as `loss` says (zb.models.loss).

        cu_seqlens: where the documents packed into the rows start (zb.models.docmask): each token
        then attends only within its document. None: over its whole row. The loss is computed here,
        inside forward, so that FSDP2 has the output weight gathered for the fused loss.
        """
        b, t = tokens.shape
        if t > self.args.max_seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds max_seq_len {self.args.max_seq_len}")
        h = self.tok_embeddings(tokens)
        # RoPE positions run over the whole row, not from 0 per document, as in Prime (its
        # flex-attention document mask kept freqs_cis[0:T]): within a document only position
        # differences reach the attention scores, so restarting would change nothing but rounding.
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        docs = spans(cu_seqlens, b, t, dense=self.attn_impl == "sdpa")
        for layer in self.layers:
            h = layer(h, cos, sin, docs)
        h = self.norm(h)
        if labels is None:
            return self.output(h)
        loss = loss or LossSpec()
        if loss.fused:
            return chunked_cross_entropy(h, labels, loss, weight=self.output.weight)
        if loss.chunks > 1:
            return chunked_cross_entropy(self.output(h), labels, loss)
        return cross_entropy(self.output(h), labels, loss.z_loss_weight)

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
        init_transformer(self, seed, self.args.dim)


def count_params(model: nn.Module) -> int:
    """Parameters of the full (unsharded) model; works on the meta device without allocating."""
    # numel() of a DTensor is its global size, so a sharded model counts the same as an unsharded one.
    return sum(p.numel() for p in model.parameters())
