"""Folders zb ships beside its code: csrc/ (the C++ kernel source) and man/ (the man pages).

In a checkout they sit at the repository's top, beside zb/ (an editable install runs from there); a
wheel carries them inside the package, as zb/csrc and zb/man (pyproject.toml maps the two folders in
as data subpackages). resource_dir() gives the package's own folder when it has one, else the checkout's.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def resource_dir(name: str) -> Path:
    """zb/<name> in an installed wheel, else <checkout>/<name> (which may not exist: the caller says so)."""
    own = PACKAGE / name
    return own if own.is_dir() else PACKAGE.parent / name
