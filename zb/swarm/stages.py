"""Pipeline stages of a zb Transformer: which blocks each stage holds, and the stage as a module.

A stage is a contiguous slice of the blocks; the first also holds the token embeddings, the last the
final norm and the output head (and computes the loss). Parameter names stay the whole model's
("layers.5.attention.wq.weight"), so a stage's weights are drawn from the same per-name seeds as the
whole model's (zb.models.init): stage s of a pipelined run starts bit-identical to the same slice of
a single-process model, and only the stage's parameters are ever allocated.
"""

from __future__ import annotations

import torch
from torch import nn

from zb.models.args import ModelArgs
from zb.models.docmask import spans
from zb.models.init import full_value, layer_id
from zb.models.llama import RMSNorm, TransformerBlock, attention_impl, rope_tables
from zb.models.loss import LossSpec, cross_entropy


def block_params(args: ModelArgs) -> int:
    """Parameters of one transformer block (all blocks are alike)."""
    with torch.device("meta"):
        return sum(p.numel() for p in TransformerBlock(0, args).parameters())


def split_blocks(args: ModelArgs, stages: int, explicit: str | None = None) -> list[tuple[int, int]]:
    """[start, end) block ranges per stage: as given ("3,1"), or balanced by parameter count with the
    embeddings counted in the first stage and norm + head in the last (greedy, contiguous)."""
    n = args.n_layers
    if stages > n:
        raise ValueError(f"{stages} stages but the model has only {n} blocks; use at most {n} stages")
    if explicit is not None:
        counts = [int(c) for c in explicit.split(",")]
        if sum(counts) != n:
            raise ValueError(f"swarm.split {explicit!r} holds {sum(counts)} blocks but the model has {n}")
    else:
        counts = _balanced(n, stages, block_params(args), args.vocab_size * args.dim,
                           args.vocab_size * args.dim + args.dim)
    bounds, start = [], 0
    for c in counts:
        bounds.append((start, start + c))
        start += c
    return bounds


def _balanced(n: int, stages: int, per_block: int, head: int, tail: int) -> list[int]:
    """Block counts minimizing the largest stage's parameters (n and stages are small: try them all)."""
    best: tuple[int, list[int]] | None = None

    def walk(prefix: list[int], left: int) -> None:
        nonlocal best
        if len(prefix) == stages - 1:
            if left < 1:
                return
            counts = prefix + [left]
            sizes = [c * per_block for c in counts]
            sizes[0] += head
            sizes[-1] += tail
            if best is None or max(sizes) < best[0]:
                best = (max(sizes), counts)
            return
        for c in range(1, left - (stages - 1 - len(prefix)) + 1):
            walk(prefix + [c], left - c)

    walk([], n)
    assert best is not None   # split_blocks checked stages <= blocks: some split exists
    return best[1]


class Stage(nn.Module):
    """Blocks [start, end) of the model, with the embeddings on stage 0 and norm + head on the last.

    forward(x): tokens [B, T] (first stage) or hidden states [B, T, D] -> hidden states, or with
    `labels` on the last stage (total loss, z-loss detached) as zb.models.loss computes them."""

    rope_cos: torch.Tensor   # buffers, registered in __init__
    rope_sin: torch.Tensor

    def __init__(self, args: ModelArgs, index: int, num_stages: int, start: int, end: int):
        super().__init__()
        self.args, self.index, self.num_stages, self.start, self.end = args, index, num_stages, start, end
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        if self.is_first:
            self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A dict keyed by the block's index in the whole model keeps the whole model's parameter names.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(start, end)})
        if self.is_last:
            self.norm = RMSNorm(args.dim, args.norm_eps)
            self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.attn_impl = attention_impl(args.attn_impl)   # what every block decided, as zb's Transformer keeps it

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """The same values as the whole model's init (per-name seeds), drawn for this stage only."""
        for name, param in self.named_parameters():
            param.copy_(full_value(name, param.shape, seed, layer_id(name), self.args.dim))

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                loss: LossSpec | None = None):
        h = self.tok_embeddings(x) if self.is_first else x
        b, t = h.shape[:2]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        docs = spans(cu_seqlens, b, t, dense=self.attn_impl == "sdpa")
        for layer in self.layers.values():
            h = layer(h, cos, sin, docs)
        if not self.is_last:
            return h
        logits = self.output(self.norm(h))
        if labels is None:
            return logits
        return cross_entropy(logits, labels, (loss or LossSpec()).z_loss_weight)


def build_stage(args: ModelArgs, index: int, bounds: list[tuple[int, int]], seed: int,
                device: torch.device | str = "cpu") -> Stage:
    start, end = bounds[index]
    with torch.device("meta"):
        stage = Stage(args, index, len(bounds), start, end)
    stage.to_empty(device=device)
    cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta, device=stage.rope_cos.device)
    stage.rope_cos.copy_(cos)
    stage.rope_sin.copy_(sin)
    stage.init_weights(seed)
    return stage


def stage_signature(stage: Stage) -> str:
    """Names and shapes of the stage's parameters: workers of one stage must hold the same model."""
    return ";".join(f"{n}:{'x'.join(map(str, p.shape))}" for n, p in stage.named_parameters())
