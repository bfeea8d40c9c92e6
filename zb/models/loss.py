"""Token cross-entropy with an optional max-z-loss that keeps logits from drifting upwards; whole, in
chunks of tokens, or fused with the output projection.

At a large vocabulary the loss, not the model, sets peak memory: the [tokens, vocab] logits, their
fp32 copy and the softmax each take tokens * vocab * 4 bytes (1.1 GB for 8k tokens of a 32k vocab).
Chunking computes the fp32 part one chunk of tokens at a time and recomputes it in backward, so only
one chunk's worth exists at once; fusing also never holds the whole logits (each chunk's are made
from the hidden states and the output weight, and made again in backward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
FUSED_DEFAULT_CHUNKS = 8


@dataclass(frozen=True)
class LossSpec:
    """How the loss is computed: the z-loss weight, and chunking (None: one piece; fused: the output
    projection goes into the chunks too)."""
    z_loss_weight: float = 0.0
    num_chunks: int | None = None
    fused: bool = False

    @property
    def chunks(self) -> int:
        return self.num_chunks or (FUSED_DEFAULT_CHUNKS if self.fused else 1)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, z_loss_weight: float = 0.0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(total_loss, z_loss_detached) for logits [B, T, V] and labels [B, T].

    Cross-entropy is the mean over tokens whose label is not -100. The max-z-loss (as in Prime /
    INTELLECT-1) is the mean over those same tokens of the squared MAXIMUM logit, max_v(z)^2 (not
    logsumexp^2): it is cheap and penalises the one logit that grows. total = ce + weight * z_loss;
    the returned z_loss is the unweighted term, detached, for logging. Computed in fp32.
    """
    flat = logits.flatten(0, -2).float()
    target = labels.flatten()
    ce = F.cross_entropy(flat, target, ignore_index=IGNORE_INDEX)
    valid = target != IGNORE_INDEX
    count = valid.sum().clamp(min=1)
    if z_loss_weight == 0.0:
        with torch.no_grad():
            z_loss = (flat.max(dim=-1).values.pow(2) * valid).sum() / count
        return ce, z_loss
    z_loss = (flat.max(dim=-1).values.pow(2) * valid).sum() / count
    return ce + z_loss_weight * z_loss, z_loss.detach()


def _chunk_sums(logits: torch.Tensor, target: torch.Tensor, z_loss_weight: float) -> torch.Tensor:
    """[summed cross-entropy + weight * summed max-logit^2, summed max-logit^2] of one chunk, in fp32."""
    logits = logits.float()
    ce = F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX, reduction="sum")
    z = (logits.max(dim=-1).values.pow(2) * (target != IGNORE_INDEX)).sum()
    return torch.stack([ce + z_loss_weight * z, z.detach()])


def _projected_chunk_sums(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                          z_loss_weight: float) -> torch.Tensor:
    return _chunk_sums(hidden @ weight.t(), target, z_loss_weight)


def chunked_cross_entropy(inputs: torch.Tensor, labels: torch.Tensor, spec: LossSpec,
                          weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same (total_loss, z_loss_detached) as `cross_entropy`, a chunk of tokens at a time.

    `inputs` are logits [B, T, V], or with `weight` [V, D] the final hidden states [B, T, D] whose
    logits are `inputs @ weight.T` (fused). Each chunk runs under activation checkpointing: backward
    recomputes its fp32 logits instead of keeping them.
    """
    flat = inputs.flatten(0, -2)
    target = labels.flatten()
    count = (target != IGNORE_INDEX).sum().clamp(min=1)
    sums = flat.new_zeros(2, dtype=torch.float32)
    for part, part_target in zip(flat.chunk(spec.chunks), target.chunk(spec.chunks)):
        if weight is None:
            sums = sums + checkpoint(_chunk_sums, part, part_target, spec.z_loss_weight, use_reentrant=False)
        else:
            sums = sums + checkpoint(_projected_chunk_sums, part, weight, part_target, spec.z_loss_weight,
                                     use_reentrant=False)
    return sums[0] / count, (sums[1] / count).detach()
