"""PNG pictures of benchmark results (matplotlib, from the ``bench`` extra).

Each function returns the path it wrote, or None (with a note on stderr) when
matplotlib is not installed: the JSON and markdown results never depend on it.
"""

from __future__ import annotations

import os
import sys


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("dispatch-bench: matplotlib not installed, no PNG (pip install 'moe-dispatch[bench]')", file=sys.stderr)
        return None
    return plt


def bandwidth_plot(rows: list[dict], path: str, title: str, name=str) -> str | None:
    """Bus bandwidth (effective bandwidth for compressed wires) against buffer size,
    one line per transport, named in the legend by ``name(transport)``."""
    plt = _pyplot()
    if plt is None or not rows:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for transport in dict.fromkeys(r["transport"] for r in rows):
        picked = [r for r in rows if r["transport"] == transport]
        lossless = picked[0]["type"] == "bf16"  # the buffer moved as it is (a2a rows name their wire)
        key = "busbw_gbps" if lossless else "effective_gbps"
        label = f"{name(transport)} busbw" if lossless else f"{name(transport)} effective (uncompressed B/s)"
        ax.plot([r["size"] for r in picked], [r[key] for r in picked], marker="o", ms=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("buffer size per rank (bytes)")
    ax.set_ylabel("GB/s")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def round_trip_plot(rows: list[dict], path: str, title: str, phases: tuple[str, ...]) -> str | None:
    """Two horizontal bars per dispatcher row (shape / routing / name): its round
    trip timed whole (the table's figure), and under it its phases where the row
    has them, from the runs timed with phase marks (which add host work and take
    the engine's Python path: their sum may exceed the whole)."""
    plt = _pyplot()
    if plt is None or not rows:
        return None
    labels = [f"{r['shape']['name']} {r['routing']} | {r['name']}" for r in rows]
    fig, ax = plt.subplots(figsize=(10, 0.36 * len(rows) + 1.5))
    colors = plt.get_cmap("tab10")
    y = [float(v) for v in range(len(rows))][::-1]
    ax.barh([v + 0.18 for v in y], [r["round_trip_ms"]["median"] for r in rows], color="0.3",
            label="round trip, timed whole", height=0.36)
    for i, phase in enumerate(phases):
        left = [sum(r["phases_ms"].get(p, 0.0) for p in phases[:i]) for r in rows]
        width = [r["phases_ms"].get(phase, 0.0) for r in rows]
        ax.barh([v - 0.18 for v in y], width, left=left, color=colors(i), label=f"{phase} (marked runs)", height=0.36)
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xlabel("ms (medians)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

