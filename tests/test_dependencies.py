"""Declared dependencies match the code: every third-party import of zb/ is declared (core for
anything a plain install runs, an extra only behind a lazy import), every core dependency is used,
tests/ needs nothing beyond core and [dev], and a missing extra is one line with exit code 1."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from zb.testing.procs import PYTHON, REPO, TINY, pyproject, subprocess_env

# Declared, never imported by zb: what needs them.
USED_WITHOUT_IMPORT = {
    "ninja": "torch.utils.cpp_extension runs it to build csrc/",
    "numpy": "Tensor.numpy() (zb.diloco.drift, zb.ckpt.format.tensorfile) needs it; torch does not require it",
    "pytest-timeout": "the timeout option in [tool.pytest.ini_options]",
    "pytest-xdist": "the -n 2 workers of the README's test command (docs/architecture.md, Test tiers)",
    "ruff": "the lint .ci/run runs before the tests (configured in pyproject.toml)",
    "mypy": "the type check .ci/run runs before the tests (configured in pyproject.toml)",
}
# Import name -> distribution, for distributions that may not be installed here to ask.
NOT_INSTALLED = {"flash_attn": "flash-attn"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> dict[str, set[str]]:
    """{"core" or extra name: normalized distribution names}; an extra that names zb's own extras
    (dev = [..., "zb[monitor]"]) holds theirs."""
    project = pyproject()["project"]
    groups = {"core": project["dependencies"], **project["optional-dependencies"]}

    def names(group: str) -> set[str]:
        out = set()
        for req in map(Requirement, groups[group]):
            if _norm(req.name) == _norm(project["name"]):
                out |= set().union(*(names(extra) for extra in req.extras))
            else:
                out.add(_norm(req.name))
        return out

    return {group: names(group) for group in groups}


def _own_extras(group: str) -> set[str]:
    """zb's extras that `group` pulls in (dev = [..., "zb[monitor]"])."""
    project = pyproject()["project"]
    reqs = map(Requirement, project["optional-dependencies"].get(group, []))
    return {extra for req in reqs if _norm(req.name) == _norm(project["name"]) for extra in req.extras}


def _imports(root: Path, local: set[str] = frozenset()) -> dict[str, bool]:
    """{top-level third-party module: imported at module level somewhere (else only lazily)};
    `local`: module names that resolve inside `root` (tests import their helpers by bare name)."""
    local = set(local) | {"zb"}
    found: dict[str, bool] = {}
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node, in_function in _walk(tree, False):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {n.split(".")[0] for n in names} - local - set(sys.stdlib_module_names):
                found[top] = found.get(top, False) or not in_function
    return found


def _walk(node: ast.AST, in_function: bool):
    """(node, whether it sits inside a function); `if TYPE_CHECKING:` blocks never run, so skipped."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            continue
        inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield child, inner
        yield from _walk(child, inner)


def _dist(module: str) -> str:
    installed = importlib.metadata.packages_distributions().get(module)
    return _norm(installed[0] if installed else NOT_INSTALLED.get(module, module))


def test_every_import_of_zb_is_declared_where_it_is_needed():
    declared = _declared()
    extras = set().union(*(names for group, names in declared.items() if group not in ("core", "dev")))
    for module, top_level in sorted(_imports(REPO / "zb").items()):
        dist = _dist(module)
        if top_level:
            assert dist in declared["core"], f"zb imports {module} at module level: declare {dist} in core"
        else:
            assert dist in declared["core"] | extras, f"zb imports {module} ({dist}): declare it in core or an extra"
        tested_extras = set().union(*(declared[e] for e in _own_extras("dev")))
        assert dist not in declared["dev"] - tested_extras, f"{dist} is in [dev] but zb itself imports {module}"


def test_every_core_dependency_is_used_and_the_remote_extra_is_what_fsspec_loads():
    from zb.ckpt.durable.remote import REMOTE_EXTRA

    declared = _declared()
    imported = {_dist(m) for m in _imports(REPO / "zb")}
    unused = declared["core"] - imported - set(USED_WITHOUT_IMPORT)
    assert not unused, f"declared in core but never imported by zb: {sorted(unused)}"
    assert not (imported & set(USED_WITHOUT_IMPORT)), "USED_WITHOUT_IMPORT lists a package zb imports"
    assert declared["remote"] == set(REMOTE_EXTRA.values())
    assert declared["gpu"] == {"flash-attn"}
    from zb.monitor import EXTRA, PACKAGES

    assert declared[EXTRA] == set(PACKAGES.values()) and EXTRA in _own_extras("dev")


def test_tests_need_only_core_and_dev():
    declared, tests = _declared(), REPO / "tests"
    # Helpers by bare name: tests/ and its folders, and scripts/ (benchmarks the tests run).
    helpers = {p.stem for root in (tests, REPO / "scripts") for p in root.rglob("*.py")}
    helpers |= {p.name for p in tests.iterdir() if p.is_dir()}
    imported = _imports(tests, helpers)
    for module in sorted(imported):
        dist = _dist(module)
        assert dist in declared["core"] | declared["dev"], f"tests import {module}: declare {dist} in [dev]"
    assert declared["dev"] - {_dist(m) for m in imported} <= set(USED_WITHOUT_IMPORT)


def test_flash_without_flash_attn_names_the_gpu_extra(monkeypatch):
    import importlib.util

    from zb.config import ConfigError
    from zb.config_schema import ModelConfig
    from zb.errors import EnvironmentFailure
    from zb.models import model_args

    real = importlib.util.find_spec
    def find_spec(found):
        return lambda name, *a: found if name == "flash_attn" else real(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec(None))
    with pytest.raises(EnvironmentFailure) as e:
        model_args(ModelConfig(attn_impl="flash"), 259, 32)
    assert str(e.value) == "model.attn_impl = 'flash' needs flash-attn, which is not installed: pip install 'zb[gpu]'"
    assert e.value.exit_code == 1
    monkeypatch.setattr(importlib.util, "find_spec", find_spec(object()))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ConfigError, match="flash-attn runs on CUDA only"):  # installed, but the wrong machine: 2
        model_args(ModelConfig(attn_impl="flash"), 259, 32)


def test_s3_checkpoints_without_s3fs_exit_1_naming_the_remote_extra(tmp_path):
    # s3fs blocked in the child even where it is installed: the line must name the extra.
    code = "import sys; sys.modules['s3fs'] = None; from zb.cli import main; main(sys.argv[1:])"
    proc = subprocess.run([PYTHON, "-c", code, "train", *TINY, "--optim.total_steps", "2", "--log.dir", str(tmp_path),
                           "--ckpt.path", str(tmp_path / "ckpt"), "--ckpt.ram_dir", str(tmp_path / "ram"),
                           "--ckpt.remote.path", "s3://bucket/run"],
                          capture_output=True, text=True, timeout=150, env=subprocess_env(), cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: ckpt.remote.path 's3://bucket/run' needs s3fs, which is not installed: pip install 'zb[remote]'")
    assert "Traceback" not in proc.stderr
