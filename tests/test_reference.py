"""docs/reference.md is generated from the code (zb.cli.reference); this fails when it is stale (fix: python -m
zb.cli.reference), and when the code reads a ZB_* variable that is neither a config twin nor listed in
zb.config_schema.ENVIRONMENT (the list the reference's variables come from)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from zb import config
from zb.cli.reference import MAN_LINK, REFERENCE, prime_twins, render
from zb.config_schema import ENVIRONMENT
from zb.testing.procs import REPO

ZB_NAME = re.compile(r"\bZB_[A-Z0-9][A-Z0-9_]*")
# ZB_* words in zb's source that are no environment variables.
NOT_VARIABLES = {"ZB_DATA"}   # zb/status/page.py: the HTML slot <!--ZB_DATA--> the dashboard's data goes into


def _skipped(node: ast.AST) -> bool:
    """zb.config's KNOWN_ENV: the names its unknown-variable warning spares, not a reader of any."""
    return isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "KNOWN_ENV" for t in node.targets)


def zb_names(source: str) -> set[str]:
    """Every ZB_* name in the string literals of one module (docstrings, messages, os.environ keys)."""
    found: set[str] = set()
    todo: list[ast.AST] = [ast.parse(source)]
    while todo:
        node = todo.pop()
        if _skipped(node):
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.update(name.rstrip("_") for name in ZB_NAME.findall(node.value))
        todo.extend(ast.iter_child_nodes(node))
    return found


def _documented() -> set[str]:
    twins = {spec.env for spec in config.KEYS.values()}
    return twins | {name for name, _ in ENVIRONMENT}


def test_the_reference_is_the_generated_one():
    assert REFERENCE.read_text() == render(), "docs/reference.md is stale: run python -m zb.cli.reference"


def test_every_zb_variable_in_the_code_is_a_twin_or_listed():
    known = _documented() | NOT_VARIABLES
    unknown = {}
    for path in sorted((REPO / "zb").rglob("*.py")):
        for name in zb_names(path.read_text()) - known:
            unknown.setdefault(name, str(path.relative_to(REPO)))
    assert unknown == {}, ("zb reads ZB_* variables that are neither config twins nor in zb.config_schema.ENVIRONMENT "
                           f"(add each with its meaning there, then run python -m zb.cli.reference): {unknown}")


def test_the_check_finds_an_unlisted_variable():
    source = 'import os\nKNOWN_ENV = {"ZB_SPARED"}\nx = os.environ.get("ZB_NEW_KNOB")\n"""Set ZB_OPTIM_LR."""\n'
    assert zb_names(source) == {"ZB_NEW_KNOB", "ZB_OPTIM_LR"}
    assert zb_names(source) - _documented() == {"ZB_NEW_KNOB"}


def test_the_listed_variables_are_no_twins_and_raise_no_warning():
    names = [name for name, _ in ENVIRONMENT]
    assert len(names) == len(set(names))
    zb_own = {name for name in names if name.startswith("ZB_")}
    assert zb_own <= config.KNOWN_ENV, "zb.config warns about a variable of ENVIRONMENT as unknown"
    assert not zb_own & {spec.env for spec in config.KEYS.values()}
    assert all(key in config.KEYS for key in prime_twins())


def test_the_reference_links_to_man_pages_that_exist():
    text = REFERENCE.read_text()
    pages = re.findall(re.escape(MAN_LINK) + r"([\w.-]+)\)", text)
    assert "zb-train.1" in pages
    for page in pages:
        assert (REFERENCE.parent / MAN_LINK / page).is_file(), page
    for key in config.KEYS:
        assert f"| `{key}` |" in text, key


def test_page_starts_with_how_to_regenerate():
    assert "python -m zb.cli.reference" in REFERENCE.read_text().splitlines()[0]


def test_the_generator_writes_the_page(tmp_path: Path):
    from zb.cli.reference import main

    main([str(tmp_path / "reference.md")])
    assert (tmp_path / "reference.md").read_text() == render()
