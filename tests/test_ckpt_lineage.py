"""Checkpoint lineage (issue 37): resuming an older step starts a branch; pruning counts only the
running branch, keeps the step it resumed from until the branch has a newer one and the newest step
of every other branch; `latest` (resume, zb ckpt ls, zb export) is the newest step of the current branch."""

from __future__ import annotations

import logging
import shutil

from ckpt_states import manager, save_steps, small_state

from zb.ckpt.durable.inventory import list_checkpoints
from zb.ckpt.durable.layout import complete_steps, latest_step
from zb.ckpt.durable.lineage import LEGACY, Entry, Origin, continue_or_fork, current_lineage, origin_of, plan_prune
from zb.ckpt.format.manifest import snapshot_name
from zb.export.source import resolve_step_dir

A, B, C = "a" * 12, "b" * 12, "c" * 12


def tree(*rows: tuple[int, str, tuple[int, str] | None]) -> dict[int, Entry]:
    """Entries written in the order given."""
    return {s: Entry(s, Origin(b, base), float(i)) for i, (s, b, base) in enumerate(rows)}


# -- the rules, in-process --------------------------------------------------------------------------

def test_a_fork_keeps_its_base_until_a_newer_step_and_the_left_branch_keeps_its_tip():
    old = [(20, A, None), (40, A, None), (60, A, None)]
    running = Origin(B, (20, A))
    assert plan_prune(tree(*old), running, keep=1) == [(40, "on a branch this run left (its newest step, 60, is kept)")]
    after = tree(*old, (25, B, (20, A)))
    assert [s for s, _ in plan_prune(after, running, keep=1)] == [20, 40]
    assert [s for s, _ in plan_prune(after, running, keep=3)] == [40]
    assert current_lineage(after) == [20, 25]


def test_topk_counts_the_running_lineage_only():
    entries = tree((20, A, None), (40, A, None), (60, A, None), (25, B, (20, A)), (30, B, (20, A)),
                   (35, B, (20, A)), (38, B, (20, A)))
    doomed = dict(plan_prune(entries, Origin(B, (20, A)), keep=3))
    assert sorted(doomed) == [20, 25, 40]
    assert "newest 3 of this run" in doomed[20] and "left" in doomed[40]
    assert current_lineage(entries) == [20, 25, 30, 35, 38]
    assert plan_prune(entries, Origin(B, (20, A)), keep=0) == []  # topk 0 keeps every one


def test_lineage_walks_bases_and_stops_where_a_base_was_written_again():
    entries = tree((10, A, None), (20, A, None), (30, A, None), (25, B, (20, A)), (40, C, (25, B)))
    assert current_lineage(entries) == [10, 20, 25, 40]
    rewritten = tree((10, A, None), (20, A, None), (25, B, (20, A)), (40, C, (25, B)), (20, C, (25, B)))
    assert current_lineage(rewritten) == [20, 25, 40]  # B's base, step 20, is C's now: A's 10 is not an ancestor


def test_other_branches_may_go_whole_where_they_are_only_copies():
    entries = tree((20, A, None), (40, A, None), (25, B, (20, A)))
    assert [s for s, _ in plan_prune(entries, Origin(B, (20, A)), 1, keep_tips=False)] == [20, 40]


def test_incomplete_steps_go_only_when_older_than_every_step_kept():
    entries = tree((20, A, None), (40, A, None))
    assert plan_prune(entries, Origin(A, None), 1, incomplete=[10, 20, 30, 50]) == [
        (10, "incomplete, and older than every step kept"), (20, "older than the newest 1 of this run's branch"),
        (30, "incomplete, and older than every step kept")]


def test_resuming_the_newest_step_continues_its_branch_and_an_older_one_forks():
    entries = tree((20, A, None), (40, A, None))
    assert continue_or_fork(entries, entries[40], B) == Origin(A, None)
    assert continue_or_fork(entries, entries[20], B) == Origin(B, (20, A))
    assert continue_or_fork(entries, None, B) == Origin(B, None)


def test_a_manifest_without_or_with_a_malformed_lineage_is_legacy():
    assert origin_of({}) == Origin(LEGACY, None)
    for bad in ({"branch": 7}, {"branch": "../x"}, {"branch": "A" * 40}, "x", None):
        assert origin_of({"lineage": bad}) == Origin(LEGACY, None), bad
    assert origin_of({"lineage": {"branch": A, "base": {"step": -1, "branch": B}}}) == Origin(A, None)
    assert origin_of({"lineage": {"branch": A, "base": {"step": True, "branch": B}}}) == Origin(A, None)
    assert origin_of({"lineage": {"branch": A, "base": {"step": 4, "branch": ""}}}) == Origin(A, (4, LEGACY))


# -- real checkpoints ---------------------------------------------------------------------------------

def _steps(m, steps):
    save_steps(m, small_state(), steps)
    m.close()


def test_resume_from_an_older_step_prunes_and_resumes_the_new_branch(tmp_path, caplog):
    """Issue 37, case 1: 20, 40, 60; then resumed from 20 with checkpoints every 5 until 38. It pruned 20,
    25, 30, 35 as they came and `latest` named the abandoned step 60."""
    disk = tmp_path / "disk"
    _steps(manager(tmp_path), [20, 40, 60])
    m = manager(tmp_path, resume=str(disk / snapshot_name(20)))
    with caplog.at_level(logging.INFO, logger="zb.ckpt"):
        assert m.resume(small_state(seed=1)).position.step == 20
        _steps(m, [25, 30, 35, 38])
    assert complete_steps(disk) == [30, 35, 38, 60]
    said = [r.getMessage() for r in caplog.records]
    assert any("resuming step 20 while this node holds newer steps of its branch (40, 60)" in s for s in said)
    assert any(s.startswith("pruned checkpoint step 40 under") and "branch this run left" in s for s in said)
    assert any(s.startswith("pruned checkpoint step 20 under") and "newest 3 of this run" in s for s in said)
    assert latest_step(disk) == 38
    assert list_checkpoints(disk).nodes[0].latest == 38
    assert resolve_step_dir(disk).name == snapshot_name(38)  # zb export / zb generate of a ckpt.path
    assert manager(tmp_path, resume="latest").resume(small_state(seed=2)).position.step == 38


def test_ckpt_ls_shows_the_branches_and_the_step_latest_takes(tmp_path, run_zb):
    import json

    disk = tmp_path / "disk"
    _steps(manager(tmp_path), [20, 40, 60])
    m = manager(tmp_path, resume=str(disk / snapshot_name(20)))
    m.resume(small_state(seed=1))
    _steps(m, [25, 30])
    doc = json.loads(run_zb("ckpt", "ls", str(disk), "--json").stdout)["nodes"][0]
    current, left = sorted(doc["branches"], key=lambda b: not b["current"])
    assert (current["steps"], current["base"], current["current"]) == ([25, 30], 20, True)
    assert (left["steps"], left["base"], left["current"]) == ([20, 60], None, False)
    assert current["base_branch"] == left["id"] and doc["lineage"] == [20, 25, 30] and doc["latest"] == 30
    out = run_zb("ckpt", "ls", str(disk)).stdout
    assert f"branch {current['id'][:6]}: step(s) 25, 30 (from step 20 of branch {left['id'][:6]}); current" in out
    assert f"branch {left['id'][:6]}: step(s) 20, 60 (from scratch); left; its newest step is kept" in out
    assert "latest: step 30 " in out


def test_a_damaged_newest_step_then_topk_1_and_a_kill_loses_nothing(tmp_path):
    """Issue 37, case 1's variant: step 60 damaged (same size), resumed with topk 1: 40 was loaded, then
    every new checkpoint was pruned as it was written, and after a kill only the damaged 60 was left."""
    disk = tmp_path / "disk"
    _steps(manager(tmp_path), [20, 40, 60])
    optim = disk / snapshot_name(60) / "rank-0" / "optim.safetensors"
    data = bytearray(optim.read_bytes())
    data[len(data) // 2] ^= 0x01
    optim.write_bytes(bytes(data))
    m = manager(tmp_path, resume="latest", topk=1)
    assert m.resume(small_state(seed=1)).position.step == 40
    save_steps(m, small_state(), [45, 50])
    assert m.wait(30)
    # killed here: no close; the RAM copies are not needed, they were copied to disk
    assert complete_steps(disk) == [50, 60]
    assert manager(tmp_path, resume="latest", topk=1).resume(small_state(seed=2)).position.step == 50


def test_a_continued_branch_keeps_pruning_by_topk(tmp_path):
    _steps(manager(tmp_path, topk=2), [1, 2])
    m = manager(tmp_path, resume="latest", topk=2)
    assert m.resume(small_state(seed=1)).position.step == 2
    _steps(m, [3, 4])
    assert complete_steps(tmp_path / "disk") == [3, 4]
    assert manager(tmp_path).committed_steps() == [3, 4]


def test_checkpoints_written_before_lineage_form_one_branch(tmp_path):
    """A ckpt.path of an earlier zb: manifests without lineage are one branch, resumed and continued."""
    disk = tmp_path / "disk"
    _steps(manager(tmp_path), [1, 2])
    for step in (1, 2):
        _strip_lineage(disk / snapshot_name(step) / "rank-0")
    m = manager(tmp_path, resume="latest", topk=2)
    assert m.resume(small_state(seed=1)).position.step == 2
    assert m.origin == Origin(LEGACY, None)
    _steps(m, [3])
    assert complete_steps(disk) == [2, 3]


def test_the_remote_copy_follows_the_lineage_too(tmp_path):
    """A replaced machine (its disk gone) resumes the current branch from the remote copy, not step 60."""
    remote = tmp_path / "remote"
    _steps(manager(tmp_path, remote=str(remote)), [20, 40, 60])
    m = manager(tmp_path, remote=str(remote), resume=str(tmp_path / "disk" / snapshot_name(20)))
    m.resume(small_state(seed=1))
    _steps(m, [25, 30, 35, 38])
    assert sorted(p.name for p in (remote / "n0").iterdir()) == [snapshot_name(s) for s in (30, 35, 38, 60)]
    shutil.rmtree(tmp_path / "disk")
    shutil.rmtree(tmp_path / "ram", ignore_errors=True)
    assert manager(tmp_path, remote=str(remote), resume="latest").resume(small_state(seed=2)).position.step == 38


def _strip_lineage(part):
    """Rewrite a committed part's manifest without `lineage`, as zb before issue 37 wrote it."""
    import json

    from zb.ckpt.format.manifest import MANIFEST, MARKER, sha256_bytes

    doc = json.loads((part / MANIFEST).read_text())
    doc["meta"].pop("lineage")
    data = json.dumps(doc).encode()
    (part / MANIFEST).write_bytes(data)
    (part / MARKER).write_text(sha256_bytes(data))
