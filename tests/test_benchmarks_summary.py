"""BENCHMARKS.md's Summary table: every row links to a heading that exists, and the table is not a stub."""

import re
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "BENCHMARKS.md"

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"\]\(#([^)\s]*)\)")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading (before the -1, -2 suffixes of duplicates): the rendered text,
    lowercased, every character but letters, digits, '_', '-' and spaces dropped, each space a '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = text.lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def heading_anchors(markdown: str) -> set[str]:
    """Anchors of all headings outside fenced code blocks, with GitHub's suffixes for duplicates."""
    anchors: set[str] = set()
    counts: dict[str, int] = {}
    in_fence = False
    for line in markdown.splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        m = _HEADING.match(line)
        if not m:
            continue
        base = github_anchor(m.group(2))
        anchor = base
        while anchor in anchors:
            counts[base] = counts.get(base, 0) + 1
            anchor = f"{base}-{counts[base]}"
        anchors.add(anchor)
    return anchors


def summary_rows(markdown: str) -> list[str]:
    """The body rows of the first table under '## Summary' (header and separator left out)."""
    lines = markdown.splitlines()
    start = lines.index("## Summary")
    table: list[str] = []
    for line in lines[start + 1 :]:
        if line.startswith("## ") or line.startswith("# "):
            break
        if line.startswith("|"):
            table.append(line)
        elif table:
            break  # the table ended
    assert len(table) >= 2, "no table under ## Summary"
    assert re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", table[1]), f"second line is not a separator: {table[1]}"
    return table[2:]


def summary_problems(markdown: str) -> list[str]:
    anchors = heading_anchors(markdown)
    problems = []
    for row in summary_rows(markdown):
        links = _LINK.findall(row)
        if not links:
            problems.append(f"row without a section link: {row}")
        problems += [f"#{a} is no heading of BENCHMARKS.md (row: {row})" for a in links if a not in anchors]
    return problems


def test_anchor_rules_match_github():
    md = "# A\n## Fewer bits: int4 (issue 25)\n```\n# not a heading\n```\n## Kernels\n### Kernels\n## `x.y_z`\n"
    assert heading_anchors(md) == {"a", "fewer-bits-int4-issue-25", "kernels", "kernels-1", "xy_z"}


def test_summary_links_resolve_to_headings():
    problems = summary_problems(BENCHMARKS.read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)


def test_summary_table_has_at_least_20_rows():
    assert len(summary_rows(BENCHMARKS.read_text(encoding="utf-8"))) >= 20
