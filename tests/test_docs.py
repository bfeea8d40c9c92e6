"""The docs cannot drift: every shell block in README.md and docs/ is run here or says what it needs, and every
link between the pages resolves.

A block is marked by an HTML comment on the line above its fence:
- `<!-- docs: run -->`: run here, in a fresh directory (bash -euo pipefail; the checkout's .venv/bin first on
  PATH; configs/, scripts/ and .venv reachable from it), within RUN_TIMEOUT_S;
- `<!-- docs: needs WHAT -->`: needs what this machine or a short test lacks; WHAT is one of NEEDS;
- `<!-- ci:install -->` / `<!-- ci:test -->`: run by CI itself (.ci/run reads them).
A shell block with no mark fails `test_every_shell_block_is_run_or_says_what_it_needs`.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from zb.testing.procs import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL = ("bash", "sh", "shell", "console")
NEEDS = {
    "gpu": "a CUDA or Apple GPU",
    "hosts": "several machines (or their addresses)",
    "internet": "the internet (the Hugging Face hub, a package index, W&B)",
    "root": "root and network namespaces",
    "minutes": "minutes of training or a benchmark",
    "a-run": "a run in progress to point at (its store, its checkpoints)",
    "files": "the user's own files (a dataset, a checkpoint, a config)",
    "placeholder": "values the user fills in (HOST, PORT, paths)",
}
RUN_TIMEOUT_S = 240
_MARK = re.compile(r"<!--\s*(?:docs:\s*(run|needs\s+([\w-]+))|ci:(install|test))\s*-->")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int          # 1-based line of the opening fence
    lang: str
    mark: str | None   # "run", "needs <what>", "ci", or None
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a page, with the mark on the line above each."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = re.match(r"^(\s*)(```+)(\w*)", lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence.group(2))), len(lines))
        above = lines[i - 1].strip() if i > 0 else ""
        match = _MARK.fullmatch(above)
        mark = None if match is None else "ci" if match.group(3) else match.group(1)
        found.append(Block(page, i + 1, fence.group(3).lower(), mark, "\n".join(lines[i + 1:end])))
        i = end + 1
    return found


def shell_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page) if b.lang in SHELL]


def test_every_shell_block_is_run_or_says_what_it_needs():
    unmarked = [b.where for b in shell_blocks() if b.mark is None]
    assert not unmarked, ("shell blocks with no `<!-- docs: run -->` or `<!-- docs: needs WHAT -->` above them "
                          f"(WHAT one of {', '.join(NEEDS)}): {', '.join(unmarked)}")
    unknown = [f"{b.where} ({b.mark})" for b in shell_blocks()
               if b.mark and b.mark.startswith("needs") and b.mark.split()[1] not in NEEDS]
    assert not unknown, f"unknown needs: {', '.join(unknown)}; known: {', '.join(NEEDS)}"


def test_every_block_names_its_language():
    """An unnamed fence could hold commands no test sees: output and diagrams are `text`."""
    unnamed = [b.where for page in PAGES for b in blocks(page) if not b.lang]
    assert not unnamed, f"fenced blocks without a language (use text for output): {', '.join(unnamed)}"


def test_marks_sit_only_on_shell_blocks():
    """A mark above a Python or TOML block would read as if something checked it."""
    stray = [b.where for page in PAGES for b in blocks(page) if b.mark and b.lang not in SHELL]
    assert not stray, f"docs/ci marks above blocks that are not shell: {', '.join(stray)}"


RUN = [b for b in shell_blocks() if b.mark == "run"]


@pytest.mark.parametrize("block", RUN, ids=[b.where for b in RUN])
def test_a_runnable_block_runs(block: Block, tmp_path):
    for name in ("configs", "scripts", ".venv"):
        if (REPO / name).exists():
            (tmp_path / name).symlink_to(REPO / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZB_", "GLOBAL_", "ZERO_BAND_"))}
    env["PATH"] = f"{REPO / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(REPO)
    env["OMP_NUM_THREADS"] = "1"
    env["HOME"] = str(tmp_path)            # a block may write under ~ (a token file): never the user's
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block.text], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S, start_new_session=True)
    assert proc.returncode == 0, f"{block.where} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    inside = False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
        if inside or not line.startswith("#"):
            continue
        base = slug(line.lstrip("#"))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_links_between_pages_resolve():
    broken = []
    for page in [*PAGES, REPO / "BENCHMARKS.md"]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in _LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue                                   # http(s), mailto: not followed here
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_readme_leads_to_every_guide():
    readme = (REPO / "README.md").read_text()
    missing = [p.name for p in PAGES[1:] if f"docs/{p.name}" not in readme]
    assert not missing, f"guides the README does not link: {', '.join(missing)}"
