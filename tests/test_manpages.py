"""man/ is generated from the click definitions; this fails when a command or option changed
without regenerating (fix: python -m zb.cli.manpages man/)."""

from pathlib import Path

from zb.cli.manpages import all_pages

MAN = Path(__file__).resolve().parents[1] / "man"


def test_man_pages_match_the_commands():
    pages = all_pages()
    on_disk = {p.name for p in MAN.glob("zb*.1")}
    assert on_disk == set(pages), "man/ lists other commands than `zb`: run python -m zb.cli.manpages man/"
    for name, text in pages.items():
        assert (MAN / name).read_text() == text, f"man/{name} is stale: run python -m zb.cli.manpages man/"


def test_every_command_has_a_page_with_its_options():
    pages = all_pages()
    assert "zb-train.1" in pages
    assert "optim.lr" in pages["zb-train.1"].replace("\\-", "-")
    assert "ZB_OPTIM_LR" in pages["zb-train.1"].replace("\\_", "_")
