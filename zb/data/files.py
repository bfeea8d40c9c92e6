"""Documents from files: .txt, .jsonl/.json (optionally .gz), .parquet; and finding local files.

A "part" is an ordered, restartable collection of documents: `iter_raw(start)` yields
(index, raw) from document `start` on, cheaply (raw JSON lines are not parsed, so documents of
other ranks cost little), and `text(raw)` turns one raw record into the document's text.
A .txt file holds documents separated by blank lines (a file without blank lines is one document).
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from zb.data.hashing import text_id
from zb.errors import InvalidInput

EXTENSIONS = (".parquet", ".jsonl", ".json", ".jsonl.gz", ".json.gz", ".txt")
_PARAGRAPH = re.compile(r"\n\s*\n")


class FilePart:
    """One local file; `name` (stable across nodes) seeds the held-out split of its documents."""

    def __init__(self, path: Path, name: str, text_column: str, ensure: Callable[[], Path] | None = None):
        self.path, self.name, self.column = path, name, text_column
        self.key = text_id(name)
        self._ensure = ensure  # downloads the file on first use (hub sources)

    def _local(self) -> Path:
        return self._ensure() if self._ensure else self.path

    def iter_raw(self, start: int) -> Iterator[tuple[int, Any]]:
        path = self._local()
        if path.name.endswith(".parquet"):
            yield from self._parquet(path, start)
        elif path.name.endswith(".txt"):
            docs = [d.strip() for d in _PARAGRAPH.split(path.read_text(encoding="utf-8", errors="replace"))]
            yield from ((i, d) for i, d in enumerate(x for x in docs if x) if i >= start)
        else:
            yield from self._jsonl(path, start)

    def _jsonl(self, path: Path, start: int) -> Iterator[tuple[int, Any]]:
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rb") as handle:
            index = 0
            for line in handle:
                if not line.strip():
                    continue
                if index >= start:
                    yield index, line
                index += 1

    def _parquet(self, path: Path, start: int) -> Iterator[tuple[int, Any]]:
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        if self.column not in pf.schema_arrow.names:
            raise InvalidInput(f"data.text_column = {self.column!r}: no such column in {path} "
                               f"(columns: {', '.join(pf.schema_arrow.names)})")
        first = 0
        for group in range(pf.num_row_groups):
            rows = pf.metadata.row_group(group).num_rows
            if first + rows > start:  # row groups wholly before `start` are skipped unread
                values = pf.read_row_group(group, columns=[self.column]).column(0).to_pylist()
                for offset in range(max(0, start - first), rows):
                    yield first + offset, values[offset]
            first += rows

    def text(self, raw: Any) -> str:
        if isinstance(raw, bytes):
            try:
                record = json.loads(raw)
                raw = record[self.column]
            except (ValueError, TypeError) as e:
                raise InvalidInput(f"{self.path}: a line is not valid JSON ({e}); .json and .jsonl files must hold "
                                   "one JSON object per line") from None
            except KeyError:
                raise InvalidInput(f"data.text_column = {self.column!r}: missing from a record of {self.path} "
                                   f"(keys: {', '.join(list(record)[:10])})") from None
        return raw if isinstance(raw, str) else "" if raw is None else str(raw)


def find_local_files(spec: str) -> list[Path]:
    """Comma separated files, directories (searched recursively) or globs; sorted, deduplicated."""
    found: set[Path] = set()
    for entry in (e.strip() for e in spec.split(",") if e.strip()):
        entry = os.path.expanduser(entry)
        if os.path.isdir(entry):
            matches = [p for p in Path(entry).rglob("*") if p.name.endswith(EXTENSIONS)]
        elif glob.has_magic(entry):
            matches = [Path(p) for p in glob.glob(entry, recursive=True) if p.endswith(EXTENSIONS)]
        elif os.path.isfile(entry):
            if not entry.endswith(EXTENSIONS):
                raise InvalidInput(f"data.dataset_name_or_paths: {entry} is not a supported file "
                                   f"({', '.join(EXTENSIONS)})")
            matches = [Path(entry)]
        else:
            raise InvalidInput(f"data.dataset_name_or_paths: {entry} does not exist")
        if not matches:
            raise InvalidInput(f"data.dataset_name_or_paths: {entry} matches no {', '.join(EXTENSIONS)} file")
        found.update(p for p in matches if p.is_file())
    return sorted(found)


def looks_local(spec: str) -> bool:
    """True when the source names files rather than a hub dataset (owner/name also contains a slash)."""
    for entry in (e.strip() for e in spec.split(",") if e.strip()):
        if (os.path.exists(os.path.expanduser(entry)) or glob.has_magic(entry) or entry.endswith(EXTENSIONS)
                or entry.startswith(("/", "./", "../", "~"))):
            return True
    return "," in spec
