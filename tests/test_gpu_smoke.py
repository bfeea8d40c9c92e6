"""scripts/gpu_smoke.py, as far as a machine without a GPU can check it: usage, and a clean refusal."""

import subprocess
import sys

from conftest import REPO, subprocess_env

SCRIPT = str(REPO / "scripts" / "gpu_smoke.py")


def test_help_lists_the_stages():
    proc = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, timeout=60,
                          env=subprocess_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    for stage in ("single", "ac-compile", "torchrun", "diloco"):
        assert stage in proc.stdout


def test_refuses_in_one_line_without_a_gpu(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, "--keep", str(tmp_path / "w")], capture_output=True, text=True,
                          timeout=60, env=subprocess_env(CUDA_VISIBLE_DEVICES=""), cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]  # one line
    assert "no CUDA GPU is visible" in proc.stderr and proc.stdout == ""
    assert not (tmp_path / "w").exists()  # nothing was run


def test_rejects_an_unknown_stage():
    proc = subprocess.run([sys.executable, SCRIPT, "--stage", "everything"], capture_output=True, text=True,
                          timeout=60, env=subprocess_env(), cwd=REPO)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
