"""Shared test fixtures and test-only helpers: the CLI in-process (run_zb), a checkpoint sidecar (peer),
the multi-node harness (make_run, cluster), the loader of benchmark scripts (load_script), same_batch
and the SWARM arguments. What tests share with scripts is in zb.testing, imported from there: the
process helpers (zb.testing.procs: REPO, free_port, wait_until, zb_process, TINY, ...) and the harness
(zb.testing.cluster: Cluster, TrainCluster, ...)."""

from __future__ import annotations

import os
import sys

from zb.torch_log import quiet_torch_log

quiet_torch_log()   # as `zb` does, before torch loads: each timed-out store wait would cost reverse DNS lookups

import pytest
from click.testing import CliRunner

from zb.testing.procs import REPO

# Tests of whole runs (several processes, tens of seconds each) go first: the workers of `-n 2 --dist
# worksteal` then end on the short tests instead of one waiting for the other's last long test.
WHOLE_RUN_FIXTURES = {"make_run", "cluster"}
WHOLE_RUN_FILES = {"test_swarm_checkpoints", "test_swarm_run", "test_train_resume", "test_train_ckpt_end",
                   "test_status_live", "test_simulator", "test_wheel", "test_diloco_mixed_ranks", "test_diloco_adaptive",
                   "test_diloco_outer", "test_read_only"}


def pytest_collection_modifyitems(items):
    def whole_run(item) -> bool:
        return bool(WHOLE_RUN_FIXTURES & set(getattr(item, "fixturenames", ()))) or \
            item.module.__name__.rsplit(".", 1)[-1] in WHOLE_RUN_FILES
    items.sort(key=lambda item: not whole_run(item))   # stable: each group keeps its order


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch):
    """Tests must not inherit a developer's ZB_*/GLOBAL_* settings."""
    for name in list(os.environ):
        if name.startswith(("ZB_", "GLOBAL_", "ZERO_BAND_")) and name not in ("ZB_USE_CPP",):
            monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def _one_thread_children(monkeypatch):
    """Processes a test starts run one intra-op thread each, as TrainCluster's nodes and torchrun's ranks
    already do: two workers' children with two threads each on 2 cores spend 2-3x the CPU in OpenMP's spin
    waits (a 50-step tiny `zb train`: 7-10 s of CPU instead of 3). This process keeps its own threads (torch
    read them at import), so the in-process kernel tests still split over several; a test or script that
    wants more in a child says so (torch.set_num_threads, --threads)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _no_stop_signal_yet(monkeypatch):
    """zb.stop_signals records a stop signal for the whole process; a test that sent one to this process
    (a `zb store` stopped in-process) must not leave it for the next test's waits."""
    from zb import stop_signals

    monkeypatch.setattr(stop_signals, "_received", None)


@pytest.fixture(autouse=True)
def _fresh_store_memory(monkeypatch):
    """zb.signed_store remembers, per process, the run marker used at each store address and which forged
    records it has logged: a node process serves one run. Tests in one worker reuse addresses ("test-store")
    with fresh stores, so each starts with none of it: otherwise a fresh store gets an earlier test's marker
    back, and its forged record was already logged (CI failed so once)."""
    from zb import signed_store

    monkeypatch.setattr(signed_store, "_used", {})
    monkeypatch.setattr(signed_store, "_warned", set())


@pytest.fixture
def cli_runner():
    return CliRunner()


@pytest.fixture
def run_zb(cli_runner):
    """Invoke `zb ...` in-process through the real command tree; returns click's Result."""
    from zb.cli import cli

    def invoke(*args: str, **kwargs):
        return cli_runner.invoke(cli, list(args), catch_exceptions=False, **kwargs)

    return invoke


def load_script(name: str):
    """scripts/<name>.py as a module: benchmarks are importable functions with a main(argv) (scripts/
    goes on sys.path too: some scripts import their siblings)."""
    import importlib.util

    if str(REPO / "scripts") not in sys.path:
        sys.path.insert(0, str(REPO / "scripts"))
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def peer(tmp_path):
    """A checkpoint sidecar in a thread over a snapshot root: peer(name) -> (root, handle); closed after
    the test (see ckpt_peers for the snapshot it serves)."""
    from ckpt_peers import TOKEN, write_sample

    from zb.ckpt.sidecar.server import serve_in_thread

    handles = []

    def start(name: str = "a", snapshot: bool = True, timeout: float = 30.0):
        root = tmp_path / name
        root.mkdir()
        if snapshot:
            write_sample(root, node=name)
        handle = serve_in_thread(root, TOKEN, "127.0.0.1", 0, client_timeout=timeout)
        handles.append(handle)
        return root, handle

    yield start
    for h in handles:
        h.close()


@pytest.fixture
def make_run(tmp_path):
    """make_run(world_size): whole `zb train` nodes around a real `zb store` (zb.testing.cluster)."""
    from zb.testing.cluster import TrainCluster

    runs = []

    def make(world_size: int):
        runs.append(TrainCluster(tmp_path, world_size))
        return runs[-1]

    yield make
    for r in runs:
        r.close()


@pytest.fixture
def cluster(tmp_path):
    """Membership driver nodes around a store hosted in this process (zb.testing.cluster)."""
    from zb.testing.cluster import Cluster

    c = Cluster(tmp_path)
    c.host_store()
    yield c
    c.close()


def same_batch(x, y) -> bool:
    """Equal inputs, labels and document boundaries (both None, or equal tensors)."""
    import torch

    return all(a is b is None or (a is not None and b is not None and torch.equal(a, b)) for a, b in zip(x, y))


# A 2-stage DiLoCo-SWARM run with short waits (tests/test_swarm_run.py, test_swarm_checkpoints.py).
SWARM = ["--swarm.stages", "2", "--swarm.hop_timeout", "5", "--swarm.stage_wait", "30"]
