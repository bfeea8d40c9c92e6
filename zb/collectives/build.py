"""Just-in-time build of csrc/zb_quant.cpp (zb/csrc/ in a wheel: package data), cached,
with a logged fallback to the PyTorch twins.

The first process to need the kernels compiles them (~8 s) into torch's extension cache
(TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions); concurrent ranks wait on torch's file
lock and load the same build; later processes load it in ~1 s. ZB_USE_CPP selects the path:
unset or "auto" = C++ if it builds, else the twins (one logged line says why); "0" = twins;
"1" = C++ or an error.

Threads: every kernel call says how many threads to split its blocks over (zb.collectives.kernels
threads()). With OpenMP that is an `omp parallel for`, which needs -fopenmp. macOS's clang has no
OpenMP (without Homebrew's libomp), so a probe compiles a tiny OpenMP program first; when it fails,
the kernels are built without -fopenmp and split their blocks over std::threads instead (one
logged line; results are bit for bit the same).
ZB_OPENMP=0 forces that build, ZB_OPENMP=1 makes a compiler without OpenMP an error.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from zb.errors import EnvironmentFailure, InvalidInput
from zb.resources import resource_dir

log = logging.getLogger("zb.collectives")

SOURCE = resource_dir("csrc", "zb_quant.cpp") / "zb_quant.cpp"  # the checkout's csrc/, or the wheel's zb/csrc/
# No -ffast-math, and no FMA contraction: every rounding is the one the twin performs.
BASE_CFLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-march=native"]
OPENMP_FLAGS = ["-fopenmp"]
OPENMP_PROBE = "#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n"

_lock = threading.Lock()
_state: dict[str, object] = {}


def _flags(openmp: bool) -> tuple[list[str], list[str]]:
    """(extra_cflags, extra_ldflags)."""
    return (BASE_CFLAGS + OPENMP_FLAGS, OPENMP_FLAGS) if openmp else (list(BASE_CFLAGS), [])


def _openmp_mode() -> str:
    return _tristate("ZB_OPENMP", "1 (require OpenMP), 0 (build without it) or auto")


def _tristate(name: str, choices: str) -> str:
    """An auto/0/1 switch from the environment ("auto" when unset); InvalidInput names the choices."""
    value = os.environ.get(name, "auto").strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value in ("0", "false", "no", "off"):
        return "0"
    if value in ("1", "true", "yes", "on"):
        return "1"
    raise InvalidInput(f"{name}={value!r}: use {choices}")


def compiler_has_openmp(compiler: str) -> tuple[bool, str]:
    """(True, "") when `compiler` compiles and links an OpenMP program, else (False, why)."""
    with tempfile.TemporaryDirectory(prefix="zb-omp-") as tmp:
        src = Path(tmp) / "probe.cpp"
        src.write_text(OPENMP_PROBE)
        try:
            done = subprocess.run([compiler, *OPENMP_FLAGS, str(src), "-o", str(Path(tmp) / "probe")],
                                  capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            return False, str(e)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return False, lines[0][:160] if lines else f"exit code {done.returncode}"
    return True, ""


def _use_openmp(compiler: str) -> bool:
    mode = _openmp_mode()
    if mode == "0":
        log.info("quantization kernels: building without OpenMP (ZB_OPENMP=0); blocks split over std::threads")
        return False
    ok, why = compiler_has_openmp(compiler)
    if not ok and mode == "1":
        raise EnvironmentFailure(f"ZB_OPENMP=1 but {compiler} cannot build OpenMP code ({why}); on macOS: "
                                 "brew install libomp, or unset ZB_OPENMP")
    if not ok:
        log.info("quantization kernels: %s has no OpenMP (%s); building without it, blocks split over std::threads",
                 compiler, why)
    return ok


def _build_tag(cflags: list[str], ldflags: list[str]) -> str:
    """A cache name per (CPU flags, source path and content, flags).

    -march=native code must not be shared across CPU models, and two checkouts (or versions) of
    zb on one machine must not share a build directory: torch would rebuild at every switch.
    """
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    digest = hashlib.sha1(flags.encode())
    digest.update(str(SOURCE).encode())
    digest.update(SOURCE.read_bytes() if SOURCE.is_file() else b"")
    digest.update(" ".join(cflags + ldflags).encode())
    return digest.hexdigest()[:10]


def _mode() -> str:
    return _tristate("ZB_USE_CPP", "1 (C++ kernels), 0 (PyTorch twins) or auto")


def _build() -> None:
    """Compile (or load from the cache) and register torch.ops.zb.*; raises on any failure."""
    if not SOURCE.is_file():
        raise FileNotFoundError(f"kernel source {SOURCE} not found (zb installed without its package data?)")
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise FileNotFoundError(f"no C++ compiler ({compiler}) on PATH")
    from torch.utils import cpp_extension

    cflags, ldflags = _flags(_use_openmp(compiler))
    name = f"zb_quant_{_build_tag(cflags, ldflags)}"
    with _build_lock(Path(cpp_extension._get_build_directory(name, verbose=False))):
        cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=cflags, extra_ldflags=ldflags,
                           is_python_module=False, verbose=False)


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """Serialize builds with a kernel-held lock, released even if the builder is SIGKILLed.

    torch's own lock is a plain file: a process killed mid-build leaves it behind and every later
    process waits for it forever. Whoever holds this flock is the only possible builder, so a torch
    lock file found while holding it is stale and is removed.
    """
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "zb-build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            log.warning("removing a stale build lock left by a killed process: %s", stale)
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def use_cpp() -> bool:
    """True when torch.ops.zb.* is loaded; decided (and logged) once per process."""
    with _lock:
        if "cpp" in _state:
            return bool(_state["cpp"])
        mode = _mode()
        if mode == "0":
            _state["cpp"] = False
            log.info("quantization kernels: PyTorch twins (ZB_USE_CPP=0)")
            return False
        try:
            _build()
        except Exception as e:  # noqa: BLE001 - any build failure means: use the twins
            if mode == "1":
                raise EnvironmentFailure(f"ZB_USE_CPP=1 but the C++ kernels did not build: {e}") from e
            _state["cpp"] = False
            log.warning("quantization kernels: PyTorch twins (C++ build failed: %s)", str(e).strip().splitlines()[-1:])
            return False
        _state["cpp"] = True
        log.info("quantization kernels: %s", cpp_kernels_line(_threads(), torch_ops_openmp()))
        return True


def torch_ops_openmp() -> bool:
    """Whether the loaded kernels were built with OpenMP."""
    import torch

    return bool(torch.ops.zb.openmp())


def cpp_kernels_line(threads: int, openmp: bool) -> str:
    return f"C++ (torch.ops.zb, {threads} thread{'s' * (threads != 1)}, {'OpenMP' if openmp else 'std::threads'})"


def _threads() -> int:
    """Threads per kernel call, as zb.collectives.kernels.threads() counts them.

    Read through sys.modules: kernels.py imports this module, so importing it here would be a cycle.
    Without it loaded (a caller of use_cpp() alone): the same count for a rank alone on its host,
    torch's intra-op thread count capped by the cores this process may use.
    """
    threads = getattr(sys.modules.get("zb.collectives.kernels"), "threads", None)
    if callable(threads):
        return int(threads())
    import torch

    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS has no affinity mask
        cores = os.cpu_count() or 1
    return max(1, min(torch.get_num_threads(), cores))
