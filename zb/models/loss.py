"""Token cross-entropy with an optional max-z-loss that keeps logits from drifting upwards."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


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
