"""The dashboard's one page: HTML, CSS and JS inline (no CDN: it works offline and behind firewalls).

Live, the page polls `api/status` next to it every 2 s; as a report, the document is embedded in the
page itself and drawn once. Curves are inline SVG.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TEMPLATE = Path(__file__).with_name("page.html")
_SLOT = "<!--ZB_DATA-->"


def render(doc: dict[str, Any] | None = None) -> str:
    """The page; with `doc`, a static report of it (the data embedded, no polling)."""
    html = TEMPLATE.read_text(encoding="utf-8")
    if doc is None:
        return html
    # "<" escaped, so no value can close the script element (node ids and paths come from files).
    data = json.dumps(doc, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c")
    html = html.replace("<title>zb run</title>", "<title>zb run report</title>")
    html = html.replace('<h1 id="title">zb run</h1>', '<h1 id="title">zb run report</h1>')
    return html.replace(_SLOT, f'<script id="zb-data" type="application/json">{data}</script>')
