"""Laptops: the device choice with Apple GPUs (MPS) simulated by monkeypatching torch's probes, and
the quantization kernels built the way a Mac builds them, without OpenMP, held bit for bit to the twins.
MPS itself is never run here (no Mac): docs/one-node.md, "Laptops", says what that leaves untested."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from zb.config import load_config
from zb.errors import EnvironmentFailure, InvalidInput
from zb.local_world import LocalWorld
from zb.testing.procs import REPO, subprocess_env


def _train(**over: str):
    return load_config([], {k: str(v) for k, v in over.items()}, environ={}).train


@pytest.fixture
def mac(monkeypatch):
    """A Mac: no CUDA, MPS present, macOS 14 (bf16 works) unless a test says otherwise."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_macos_or_newer", lambda major, minor: (major, minor) <= (14, 0))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    return monkeypatch


ONE, TWO = LocalWorld(rank=0, world_size=1), LocalWorld(rank=0, world_size=2)


def test_auto_picks_mps_on_a_mac_with_fp32_and_gloo(mac, caplog):
    from zb.train.device import pick_placement

    with caplog.at_level(logging.INFO, logger="zb.train"):
        p = pick_placement(_train(), ONE)
    assert p.device.type == "mps" and p.backend == "gloo" and p.param_dtype == torch.float32
    assert "Apple GPU (MPS)" in caplog.text


def test_auto_prefers_cuda_over_mps(mac, monkeypatch):
    from zb.train.device import pick_placement

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "fake")
    p = pick_placement(_train(), ONE)
    assert p.device.type == "cuda" and p.backend == "nccl" and p.param_dtype == torch.bfloat16


def test_auto_with_several_local_ranks_on_a_mac_trains_on_the_cpu(mac, caplog):
    from zb.train.device import pick_placement

    with caplog.at_level(logging.INFO, logger="zb.train"):
        p = pick_placement(_train(), TWO)
    assert p.device.type == "cpu" and "MPS takes one local rank and this node has 2" in caplog.text


def test_auto_without_cuda_or_mps_is_the_cpu(monkeypatch):
    from zb.train.device import pick_placement

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert pick_placement(_train(), ONE).device.type == "cpu"


def test_explicit_mps_refusals(mac, monkeypatch):
    from zb.train.device import pick_placement

    with pytest.raises(InvalidInput, match="one local rank per Mac .* --nproc-per-node 1"):
        pick_placement(_train(**{"train.device": "mps"}), TWO)
    assert pick_placement(_train(**{"train.device": "mps", "train.param_dtype": "bf16"}), ONE).param_dtype == torch.bfloat16
    monkeypatch.setattr(torch.backends.mps, "is_macos_or_newer", lambda major, minor: False)   # macOS 13
    with pytest.raises(InvalidInput, match="bf16' on MPS needs macOS 14"):
        pick_placement(_train(**{"train.device": "mps", "train.param_dtype": "bf16"}), ONE)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(InvalidInput, match="train.device = 'mps' but MPS is not available"):
        pick_placement(_train(**{"train.device": "mps"}), ONE)


def test_cpu_keeps_cpu_even_on_a_mac(mac):
    from zb.train.device import pick_placement

    assert pick_placement(_train(**{"train.device": "cpu"}), ONE).device.type == "cpu"


def test_loss_accumulators_avoid_fp64_on_mps():
    from zb.train.device import stats_dtype

    assert stats_dtype(torch.device("mps")) == torch.float32
    assert stats_dtype(torch.device("cpu")) == torch.float64


def test_zb_train_on_mps_without_one_exits_2_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "zb", "train", "--train.device", "mps", "--data.fake"],
                          env=subprocess_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert "MPS is not available" in lines[-1] and "Traceback" not in proc.stderr


# -- the kernel build without OpenMP -------------------------------------------------------------------

FAKE_CLANG = """#!/bin/sh
# A compiler like macOS's clang: no OpenMP. Anything else goes to the real one.
for a in "$@"; do [ "$a" = "-fopenmp" ] && { echo "clang: error: unsupported option '-fopenmp'" >&2; exit 1; }; done
exec c++ "$@"
"""

CHECK = """
import logging, sys, torch
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
torch.set_num_threads(3)
from zb.collectives import kernels
from zb.collectives.build import torch_ops_openmp, use_cpp
assert use_cpp() and not torch_ops_openmp()
for n in (1, 255, 257, 100_003, 2_000_001):   # the largest splits over all 3 threads
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * 3
    x[:: max(1, n // 7)] = float("nan")
    blocks = kernels.num_blocks(n)
    out = {}
    for cpp in (True, False):
        codes, scales = torch.empty(n, dtype=torch.uint8), torch.empty(blocks)
        kernels.quantize(x, codes, scales, cpp=cpp)
        acc = torch.randn(n, generator=torch.Generator().manual_seed(1))
        kernels.dequantize_add(codes, scales, acc, cpp=cpp)
        oc, os_ = torch.empty(n, dtype=torch.uint8), torch.empty(blocks)
        acc2 = acc.clone()
        kernels.reduce_quantize(codes, scales, acc2, oc, os_, divisor=3.0, write_back=True, cpp=cpp)
        out[cpp] = (codes, scales, acc, oc, os_, acc2)
    for a, b in zip(out[True], out[False]):
        assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))), n
print("IDENTICAL")
"""


@pytest.fixture
def clang_without_openmp(tmp_path):
    if subprocess.run(["sh", "-c", "command -v c++"], capture_output=True).returncode != 0:
        pytest.skip("no C++ compiler")
    fake = tmp_path / "clang-no-omp"
    fake.write_text(FAKE_CLANG)
    fake.chmod(0o755)
    return str(fake)


def test_kernels_built_without_openmp_equal_the_twins(clang_without_openmp, tmp_path):
    """The compiler probe fails as on macOS; the build leaves -fopenmp out (the fake compiler would
    fail on it) and the std::threads split gives the twins' bits."""
    env = subprocess_env(CXX=clang_without_openmp, ZB_USE_CPP="1", TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    proc = subprocess.run([sys.executable, "-c", CHECK], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "IDENTICAL" in proc.stdout
    said = [ln for ln in proc.stdout.splitlines() if "has no OpenMP" in ln]
    assert len(said) == 1 and "unsupported option '-fopenmp'" in said[0]


def test_openmp_setting(clang_without_openmp, monkeypatch):
    from zb.collectives import build

    assert build.compiler_has_openmp(clang_without_openmp)[0] is False
    monkeypatch.setenv("ZB_OPENMP", "1")
    with pytest.raises(EnvironmentFailure, match="ZB_OPENMP=1 but .* cannot build OpenMP code"):
        build._use_openmp(clang_without_openmp)
    monkeypatch.setenv("ZB_OPENMP", "0")
    assert build._use_openmp("c++") is False
    assert build._flags(False) == (build.BASE_CFLAGS, []) and "-fopenmp" in build._flags(True)[0]
    monkeypatch.setenv("ZB_OPENMP", "maybe")
    with pytest.raises(InvalidInput, match="ZB_OPENMP='maybe'"):
        build._use_openmp("c++")
