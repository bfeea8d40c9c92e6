"""Folders zb ships beside its code: csrc/ (the C++ kernel source) and man/ (the man pages).

In a checkout they sit at the repository's top, beside zb/ (an editable install runs from there); a
wheel carries them inside the package, as zb/csrc and zb/man (pyproject.toml maps the two folders in
as data subpackages). resource_dir() gives the package's own folder when it holds the file asked for,
else the checkout's: a checkout updated across the move of csrc/ out of zb/ can keep a stale zb/csrc/
holding only ignored files (build outputs), which must not hide the real one.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def resource_dir(name: str, holding: str) -> Path:
    """zb/<name> in an installed wheel (when it holds the file `holding`), else <checkout>/<name> (which may
    not exist: the caller says so)."""
    own = PACKAGE / name
    return own if (own / holding).is_file() else PACKAGE.parent / name
