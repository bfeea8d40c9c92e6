"""man/ (at the checkout's top; zb/man in a wheel) is generated from the click definitions; this fails
when a command or option changed without regenerating (fix: python -m zb.cli.manpages)."""

from zb.cli.manpages import MAN_DIR as MAN
from zb.cli.manpages import all_pages
from zb.testing.procs import REPO


def test_man_pages_match_the_commands():
    assert MAN == REPO / "man", "in a checkout the pages live (and are generated) at its top: man/"
    pages = all_pages()
    on_disk = {p.name for p in MAN.glob("zb*.1")}
    assert on_disk == set(pages), "man/ lists other commands than `zb`: run python -m zb.cli.manpages"
    for name, text in pages.items():
        assert (MAN / name).read_text() == text, f"man/{name} is stale: run python -m zb.cli.manpages"


def test_every_command_has_a_page_with_its_options():
    pages = all_pages()
    assert "zb-train.1" in pages
    assert "optim.lr" in pages["zb-train.1"].replace("\\-", "-")
    assert "ZB_OPTIM_LR" in pages["zb-train.1"].replace("\\_", "_")


def test_zb_man_finds_the_pages_beside_the_code(run_zb):
    import pytest

    from zb.errors import InvalidInput

    assert run_zb("man", "train", "--path").stdout.strip() == str(MAN / "zb-train.1")
    assert run_zb("man", "--path").stdout.strip() == str(MAN / "zb.1")
    with pytest.raises(InvalidInput, match="no man page for 'trian'; commands: .*train"):
        run_zb("man", "trian")
