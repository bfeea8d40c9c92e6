"""The wheel carries what the code finds beside itself at runtime: built from the working tree,
installed into a fresh venv and run from a directory outside the checkout, the C++ kernels build
from the installed source and load (no fallback to the PyTorch twins), `zb train --help` and
`zb man` work, and `man zb-train` finds the page the wheel put in <venv>/share/man/man1. The
checkout's top-level csrc/ and man/ travel inside the wheel as zb/csrc and zb/man. Dependencies come
from this environment through a .pth file, so nothing is downloaded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from zb.testing.procs import REPO, pyproject

pytestmark = pytest.mark.timeout(600)

KERNELS = """
import json, torch, zb
from zb.collectives import kernels, twins
from zb.collectives.build import SOURCE, use_cpp
assert use_cpp(), "the C++ kernels did not load"
x = torch.randn(1000) * 3
codes, scales = torch.empty(1000, dtype=torch.uint8), torch.empty(kernels.num_blocks(1000))
twin_codes, twin_scales = torch.empty_like(codes), torch.empty_like(scales)
int8 = kernels.SCHEMES["int8"]
torch.ops.zb.quantize(x, codes, scales, int8.block, int8.bits, None, 1)
twins.quantize(x, twin_codes, twin_scales, int8)
print(json.dumps({"zb": zb.__file__, "source": str(SOURCE), "same": bool(torch.equal(codes, twin_codes)
                  and torch.equal(scales, twin_scales))}))
"""


def _run(*args: str, cwd: Path, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)
    assert proc.returncode == 0, f"{args}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def _build_wheel(tmp: Path, env: dict) -> Path:
    """From a copy of the tracked and new files: building in place would leave build/ in the checkout."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                           capture_output=True).stdout.decode().split("\0")
    src = tmp / "src"
    for name in filter(None, files):
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    _run(sys.executable, "-m", "pip", "wheel", "--no-index", "--no-deps", "--no-build-isolation", "-q",
         "--wheel-dir", str(tmp / "dist"), str(src), cwd=tmp, env=env)
    (wheel,) = (tmp / "dist").glob("zb-*.whl")
    return wheel


def _venv(tmp: Path, wheel: Path, env: dict) -> Path:
    """A fresh venv with the wheel installed and this environment's packages (torch...) visible."""
    venv = tmp / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", str(venv), cwd=tmp, env=env)
    site = Path(_run(str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                     cwd=tmp, env=env).stdout.strip())
    # Appended after the venv's own site-packages, so the installed zb wins over this checkout's.
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run(sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-index", "--no-deps",
         "-q", str(wheel), cwd=tmp, env=env)
    return venv


def test_wheel_ships_kernel_source_man_pages_and_license(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("ZB_")}
    wheel = _build_wheel(tmp_path, env)
    names = zipfile.ZipFile(wheel).namelist()
    # The checkout's csrc/ and man/, inside the package: zb.resources finds them there.
    assert "zb/csrc/zb_quant.cpp" in names and "zb/man/zb-train.1" in names
    assert not any(n.startswith(("csrc/", "man/")) for n in names), "csrc/ and man/ belong inside zb/"
    assert any(n.endswith(".data/data/share/man/man1/zb-train.1") for n in names), \
        "the man pages go to <prefix>/share/man/man1 too (data-files)"
    tracked = _tracked_modules()
    assert tracked <= set(names), f"modules missing from the wheel: {sorted(tracked - set(names))}"
    assert "zb/status/page.html" in names, "the dashboard's page (zb status --serve, --from) is package data"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)

    venv, outside = _venv(tmp_path, wheel, env), tmp_path / "elsewhere"
    outside.mkdir()
    env.update(ZB_USE_CPP="1", TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))  # a real build, an error if it fails
    installed = venv / "lib"
    result = json.loads(_run(str(venv / "bin" / "python"), "-c", KERNELS, cwd=outside, env=env).stdout)
    assert Path(result["zb"]).is_relative_to(installed) and Path(result["source"]).is_relative_to(installed)
    assert result["same"]

    assert "optim.lr" in _run(str(venv / "bin" / "zb"), "train", "--help", cwd=outside, env=env).stdout
    page = Path(_run(str(venv / "bin" / "zb"), "man", "train", "--path", cwd=outside, env=env).stdout.strip())
    assert page.is_relative_to(installed) and page.read_text().startswith(".TH ZB-TRAIN 1")
    if shutil.which("man"):
        shown = _run(str(venv / "bin" / "zb"), "man", "train", cwd=outside, env=dict(env, MANPAGER="cat"))
        assert "optim.lr" in shown.stdout.replace("\u2010", "-")

    installed_page = venv / "share" / "man" / "man1" / "zb-train.1"
    assert installed_page.read_text() == page.read_text(), "the wheel puts the man pages in <venv>/share/man/man1"
    if shutil.which("man") is None:
        pytest.skip("no `man` program: cannot check that `man zb-train` finds the installed page")
    # man-db maps a PATH entry's bin/ to ../share/man: the venv's bin on PATH is enough, no MANPATH.
    man_env = {k: v for k, v in env.items() if k != "MANPATH"}
    man_env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', os.defpath)}"
    found = _run("man", "-w", "zb-train", cwd=outside, env=man_env).stdout.strip()
    assert Path(found).resolve() == installed_page.resolve()


def _tracked_modules() -> set[str]:
    """Every tracked (or new) .py file under zb/, as a wheel names it."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "zb"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split()
    return {f for f in files if f.endswith(".py") and (REPO / f).is_file()}


def test_pyproject_lists_every_package():
    """pyproject.toml lists the packages (discovery cannot map csrc/ and man/ into zb): a new one must be there."""
    setuptools = pyproject()["tool"]["setuptools"]
    found = {str(Path(f).parent).replace("/", ".") for f in _tracked_modules() if f.endswith("/__init__.py")}
    assert set(setuptools["packages"]) == found | {"zb.csrc", "zb.man"}
    assert setuptools["package-dir"] == {"zb.csrc": "csrc", "zb.man": "man"}
