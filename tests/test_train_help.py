"""`zb train --help [SECTION]`: a short default, one config section or every option in full, and a
one-line error for a section that does not exist (issue 30: the flat help was ~600 lines)."""

from __future__ import annotations

import pytest

from zb.config import KEYS
from zb.testing.procs import zb_process


def _sections() -> dict[str, list]:
    from zb.cli.help_sections import section_keys
    from zb.config import KEYS

    return {name: [KEYS[k] for k in keys] for name, keys in section_keys().items()}


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_the_default_help_is_short_and_lists_every_section(run_zb, flag):
    result = run_zb("train", flag)
    out = result.output
    assert result.exit_code == 0
    assert len(out.splitlines()) < 60, out
    for own in ("--print-config", "--nproc-per-node", "-v, --verbose", "-q, --quiet", "-h, --help [SECTION]"):
        assert own in out
    lines = out.splitlines()
    for name, specs in _sections().items():
        assert any(line.split()[:2] == [name, f"{len(specs)}:"] for line in lines), (name, out)
    assert "ZB_OPTIM_LR" not in out and "--diloco.inner" not in out   # keys only in the long views
    assert "--help SECTION" in out and "--help all" in out         # the epilog says how to see them


@pytest.mark.parametrize("section", ["diloco", "optim", "ckpt", "eval"])
def test_a_section_lists_all_its_keys_in_schema_order_with_env_twins(run_zb, section):
    result = run_zb("train", "--help", section)
    assert result.exit_code == 0
    out = result.output
    specs = _sections()[section]
    places = [out.index(f"--{spec.key}") for spec in specs]
    assert places == sorted(places), "options out of schema order"
    for spec in specs:
        assert spec.env in out.replace("\n", " ").replace("  ", "")
    others = [s.key for name, group in _sections().items() if name != section for s in group]
    assert not any(f"--{key} " in out or f"--{key}," in out for key in others)
    assert out.splitlines()[2].startswith(f"{section} ({len(specs)} options): ")


def test_all_lists_every_key_under_its_section_heading(run_zb):
    from zb.config import KEYS

    out = run_zb("train", "--help", "all").output
    flat = out.replace("\n", " ")
    assert all(f"--{key}" in out for key in KEYS)
    assert all(spec.env.replace("_", "") in flat.replace("_", "").replace(" ", "") for spec in KEYS.values())
    headings = [out.index(f"\n{name} ({len(specs)} options): ") for name, specs in _sections().items()]
    assert headings == sorted(headings)
    assert "--print-config" in out and "Config sources" in out


@pytest.mark.parametrize("args", [
    ["--help", "diloco", "@configs/debug/normal.toml"],
    ["@configs/debug/normal.toml", "--optim.lr", "3e-4", "--help", "diloco"],
    ["--nproc-per-node", "2", "-v", "-h", "diloco"],
    ["--help=diloco", "--train.log_model_hash"],
    ["--print-config", "--help", "DILOCO"],
])
def test_help_works_beside_other_arguments(run_zb, args):
    result = run_zb("train", *args)
    diloco = len([k for k in KEYS if k.startswith("diloco.")])   # every [diloco] key is an option
    assert result.exit_code == 0 and f"diloco ({diloco} options)" in result.output


@pytest.mark.parametrize("args", [["--help", "--optim.lr", "3"], ["--help", "@configs/debug/normal.toml"]])
def test_help_before_a_flag_or_a_file_is_the_short_help(run_zb, args):
    result = run_zb("train", *args)
    assert result.exit_code == 0 and "Config sections" in result.output


def test_an_unknown_section_is_one_line_and_exit_2():
    proc = zb_process("train", "--optim.lr", "1", "--help", "dilocoo")
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown help section 'dilocoo' (did you mean diloco?)" in lines[0], proc.stderr
    assert all(name in lines[0] for name in [*_sections(), "all"])


def test_piped_and_narrow_help_is_plain_text():
    proc = zb_process("train", "--help", COLUMNS="50")
    assert proc.returncode == 0 and "\x1b" not in proc.stdout and "[bold" not in proc.stdout
    assert max(len(line) for line in proc.stdout.splitlines()) <= 50, proc.stdout
    assert all(name in proc.stdout for name in _sections())


def test_the_man_page_has_a_heading_per_section_and_every_option():
    from zb.cli.manpages import all_pages
    from zb.config import KEYS

    page = all_pages()["zb-train.1"].replace("\\-", "-")
    assert all(f"\n.SS {name} (" in page for name in _sections())
    assert all(f"\\fB--{key}" in page for key in KEYS)
