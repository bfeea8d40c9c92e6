"""The CLI through its real command tree: help, config printing, and one-line errors with exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import subprocess_env, zb_process


def test_help_lists_registered_commands(run_zb):
    from zb.cli import COMMANDS

    result = run_zb("--help")
    assert result.exit_code == 0
    for name in COMMANDS:
        assert name in result.output
        sub = run_zb(name, "--help")
        assert sub.exit_code == 0 and "Usage:" in sub.output


def test_python_dash_m_zb_works():
    proc = subprocess.run([sys.executable, "-m", "zb", "--version"], capture_output=True, text=True,
                          env=subprocess_env(), timeout=60)
    assert proc.returncode == 0 and "zb" in proc.stdout


def test_print_config_shows_sources(run_zb, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[optim]\nlr = 0.01\n")
    result = run_zb("train", f"@{cfg}", "--optim.warmup-steps", "3", "--print-config")
    assert result.exit_code == 0
    assert "lr = 0.01" in result.output and f"file {cfg}" in result.output
    assert "warmup_steps = 3" in result.output and "flag --optim.warmup_steps" in result.output


def test_bare_bool_flag_before_a_config_file(run_zb, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[optim]\nlr = 0.02\n")
    result = run_zb("train", "--train.log_model_hash", f"@{cfg}", "--print-config")
    assert result.exit_code == 0
    assert "log_model_hash = true" in result.output and "lr = 0.02" in result.output



@pytest.mark.parametrize("args, message", [
    (["train", "--optim.lr", "-1"], "optim.lr = -1.0 (from flag --optim.lr): must be positive"),
    (["train", "--optim.lrr", "1"], "No such option"),
    (["train", "notafile.toml"], "config files are given as @path"),
    (["train", "@missing.toml"], "config file missing.toml not found"),
    (["train", "--model.name", "giant"], "model.name"),
    (["train", "--optim.batch_size", "12", "--train.micro_bs", "8"], "multiple of train.micro_bs"),
])
def test_bad_inputs_exit_2_with_one_line(args, message):
    proc = zb_process(*args)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
