"""A process held to a fraction of one core by a cgroup v1 CPU quota (root): the honest way to give a
benchmark's node a machine of its own speed on a shared box (the kernel throttles it; zb does nothing
different). PLATFORM.md: the cpu controller is mounted at /sys/fs/cgroup/cpu and writable as root."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

CPU_CGROUP = Path("/sys/fs/cgroup/cpu")


def quota_unavailable() -> str | None:
    """None when quotas can be set here, else the reason."""
    if os.geteuid() != 0 or not (CPU_CGROUP / "cgroup.procs").exists():
        return "needs root and the cgroup v1 cpu controller at /sys/fs/cgroup/cpu"
    return None


@contextmanager
def cpu_quota(fraction: float, name: str = "slow", period_us: int = 100_000) -> Iterator[Callable[[int], None]]:
    """A cpu group limited to `fraction` of one core; yields a function that moves a pid (all its threads,
    and those it starts later) in. Leaving moves what is still there back to the root group. The kernel
    enforces the quota per period: a throttled process stops for the rest of each period, so a short period
    (10 ms) spreads its pauses finely, as a slower core would."""
    group = CPU_CGROUP / f"zb-bench-{name}-{os.getpid()}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text(str(period_us))
        (group / "cpu.cfs_quota_us").write_text(str(int(fraction * period_us)))
        yield lambda pid: (group / "cgroup.procs").write_text(str(pid))
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            try:
                (CPU_CGROUP / "cgroup.procs").write_text(pid)
            except OSError:
                pass   # the process is gone
        group.rmdir()
