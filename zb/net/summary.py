"""What an iperf-mesh report means for a run: slowest link, most asymmetric pair, RTT per pair.

Pure functions over the report of zb/net/iperf.py (run through `zb iperf-mesh`); the CLI prints them.
"""

from __future__ import annotations

import statistics


def measured(report: dict) -> list[dict]:
    return [link for link in report["links"] if link["mbps"] is not None]


def slowest_link(report: dict) -> dict | None:
    links = measured(report)
    return min(links, key=lambda link: link["mbps"]) if links else None


def most_asymmetric_pair(report: dict) -> tuple[dict, dict, float] | None:
    """(faster direction, slower direction, ratio >= 1) of the pair whose directions differ most;
    consumer uplinks are often several times slower than their downlinks."""
    by_pair = {(link["src"], link["dst"]): link for link in measured(report)}
    best = None
    for (a, b), forward in by_pair.items():
        backward = by_pair.get((b, a))
        if a > b or backward is None or min(forward["mbps"], backward["mbps"]) <= 0:
            continue
        fast, slow = (forward, backward) if forward["mbps"] >= backward["mbps"] else (backward, forward)
        ratio = fast["mbps"] / slow["mbps"]
        if best is None or ratio > best[2]:
            best = (fast, slow, ratio)
    return best


def rtt_per_pair(report: dict) -> dict[tuple[int, int], float]:
    """(a, b) with a < b -> median of the RTTs measured in either direction, in ms."""
    samples: dict[tuple[int, int], list[float]] = {}
    for link in report["links"]:
        if link["rtt_ms"] is not None:
            samples.setdefault((min(link["src"], link["dst"]), max(link["src"], link["dst"])), []).append(link["rtt_ms"])
    return {pair: statistics.median(values) for pair, values in sorted(samples.items())}
