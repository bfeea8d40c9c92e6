"""Model FLOPs utilization: the model's FLOPs per token (zb.models.flops) times tokens per second,
over what the node's devices could do at their peak.

    mfu (%) = 100 * flops_per_token * tokens_per_s / (peak_flops_per_device * local ranks)

As Prime logged it (`mfu`, in percent). The peak is train.peak_tflops when set; else, for CUDA
devices, the table below (dense bf16 tensor-core peaks from the vendors' datasheets, without
sparsity; fp32 runs are measured against the same bf16 peak, as Prime did). A CPU has no entry: its
peak depends on the cores, the clock and the vector units, so a CPU run reports mfu only when
train.peak_tflops says what one rank's share of the machine can do.
"""

from __future__ import annotations

import logging
import re

import torch

log = logging.getLogger("zb.train")

# (pattern matched against torch.cuda.get_device_name(), dense bf16 TFLOPS). First match wins, so a
# more specific name comes before the one it contains (H100 NVL before H100).
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"B200", 2250.0),
    (r"H200|GH200", 989.0),
    (r"H100.*NVL", 835.0),
    (r"H100.*PCIe", 756.0),
    (r"H100", 989.0),            # SXM and others
    (r"A100", 312.0),
    (r"L40S", 362.0),
    (r"\bL4\b", 121.0),
    (r"\bA10\b", 125.0),
    (r"RTX 4090", 165.0),        # with fp32 accumulation, as training uses
    (r"RTX 3090", 71.0),
    (r"MI300X", 1307.0),
)


def table_peak_tflops(device_name: str) -> float | None:
    for pattern, tflops in PEAK_BF16_TFLOPS:
        if re.search(pattern, device_name):
            return tflops
    return None


def peak_flops(device: torch.device, configured_tflops: float | None) -> tuple[float | None, str]:
    """(peak FLOPS of one device or None, where that number comes from or why there is none)."""
    if configured_tflops is not None:
        return configured_tflops * 1e12, f"train.peak_tflops = {configured_tflops:g}"
    if device.type != "cuda":
        return None, f"no peak is known for a {device.type} device: set train.peak_tflops to report mfu"
    name = torch.cuda.get_device_name(device)
    tflops = table_peak_tflops(name)
    if tflops is None:
        return None, f"no peak is known for {name}: set train.peak_tflops (dense bf16 TFLOPS) to report mfu"
    return tflops * 1e12, f"{name}, dense bf16"


def mfu_percent(flops_per_token: float, tokens_per_s: float, peak: float | None, devices: int) -> float | None:
    """Model FLOPs utilization in percent of the devices' peak; None without a peak."""
    if peak is None or tokens_per_s <= 0:
        return None
    return 100.0 * flops_per_token * tokens_per_s / (peak * devices)
