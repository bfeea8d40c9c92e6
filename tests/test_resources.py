"""zb.resources: the package's own csrc/ and man/ (a wheel) win only when they hold the files."""

from __future__ import annotations

from zb import resources


def test_a_stale_package_folder_without_the_file_does_not_hide_the_checkouts(tmp_path, monkeypatch):
    """A checkout pulled across the move of csrc/ out of zb/ keeps zb/csrc/ if ignored build outputs were in it
    (seen on a GPU machine: 'kernel source zb/csrc/zb_quant.cpp not found')."""
    package = tmp_path / "zb"
    (package / "csrc" / "__pycache__").mkdir(parents=True)
    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "zb_quant.cpp").write_text("// source")
    monkeypatch.setattr(resources, "PACKAGE", package)
    assert resources.resource_dir("csrc", "zb_quant.cpp") == tmp_path / "csrc"
    (package / "csrc" / "zb_quant.cpp").write_text("// the wheel's copy")
    assert resources.resource_dir("csrc", "zb_quant.cpp") == package / "csrc"


def test_this_checkout_finds_its_kernel_source_and_man_pages():
    assert (resources.resource_dir("csrc", "zb_quant.cpp") / "zb_quant.cpp").is_file()
    assert (resources.resource_dir("man", "zb.1") / "zb.1").is_file()
