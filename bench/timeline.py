"""Timelines of profiler traces: the streams of every rank on one clock.

``draw_timeline`` draws the GPU kernels of one or more chrome traces (one per
rank, written by ``torch.profiler`` on one host, so on one clock) as bars, one
lane per rank and CUDA stream; ``lanes_summary`` says, lane by lane, when the
long kernels ran, how long the lane sat idle and how much of that it waited
for the host to launch the next kernel. A pipeline whose combine on one rank
takes far longer than its dispatch is waiting for a peer; these two show
which one, and whether that peer's GPU waited for its host.
"""

from __future__ import annotations

import json

# NCCL's and torch's collectives and copies, and the NVLink engine's kernels that read or
# write a peer's memory (csrc/: the counts exchange, the pull, the pushes)
COMM_WORDS = ("nccl", "all_to_all", "alltoall", "allgather", "memcpy", "barrier",
              "exchange_counts", "pull_rows", "push_partials", "push_slots")


def is_comm(name: str) -> bool:
    """Whether a kernel or op of this name moves bytes between ranks (or copies)."""
    lowered = name.lower()
    return any(word in lowered for word in COMM_WORDS)


def load_lanes(trace_path: str) -> tuple[dict[str, list[dict]], dict[int, float]]:
    """The trace's lanes ({"stream S": kernels} sorted by start; CPU ops per
    thread, "thread N", when it holds no kernels) and the start time of each
    kernel launch by correlation id. The barrier the step starts after (an
    all-reduce before any other collective) and what precedes it are left out."""
    with open(trace_path) as f:
        events = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy")), key=lambda e: e["ts"])
    first_comm = next((e for e in kernels if is_comm(e["name"])), None)
    if first_comm is not None and "allreduce" in first_comm["name"].lower():  # the barrier: not drawn
        barrier_end = first_comm["ts"] + first_comm["dur"]
        kernels = [e for e in kernels if e["ts"] >= barrier_end]
    lanes: dict[str, list[dict]] = {}
    if kernels:
        for e in kernels:
            lanes.setdefault(f"stream {e.get('args', {}).get('stream', '?')}", []).append(e)
    else:
        for e in sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: e["ts"]):
            lanes.setdefault(f"thread {e.get('tid')}", []).append(e)
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    return lanes, launches


def _all_lanes(trace_paths: list[str]) -> tuple[dict[str, list[dict]], dict[str, dict[int, float]], float]:
    """Lanes of every trace ("rank R, stream S" where there are several), the
    launches of each lane's trace, and the earliest start over all lanes."""
    lanes, launches = {}, {}
    for rank, path in enumerate(trace_paths):
        own, own_launches = load_lanes(path)
        for name, lane in own.items():
            key = f"rank {rank}, {name}" if len(trace_paths) > 1 else name
            lanes[key], launches[key] = lane, own_launches
    if not lanes:
        raise ValueError(f"{', '.join(trace_paths)} hold no kernels or CPU ops to draw")
    return lanes, launches, min(e["ts"] for lane in lanes.values() for e in lane)


def draw_timeline(trace_paths: list[str], png_path: str, title: str) -> None:
    """Bars of the traces' GPU kernels (CPU ops where a trace has no kernels), one
    lane per rank and stream, on the traces' common clock; communication in orange."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes, _, start = _all_lanes(trace_paths)
    names = sorted(lanes, key=_lane_order)
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.45 * len(names)))
    for y, name in enumerate(names):
        comm = [e for e in lanes[name] if is_comm(e["name"])]
        rest = [e for e in lanes[name] if not is_comm(e["name"])]
        for group, color in ((rest, "tab:blue"), (comm, "tab:orange")):
            spans = [((e["ts"] - start) / 1e3, e["dur"] / 1e3) for e in group]
            ax.broken_barh(spans, (y - 0.35, 0.7), facecolors=color)
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title + "  (orange: communication, blue: compute and copies)")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def _lane_order(name: str) -> tuple:
    """Rank first, then the stream (or thread) number."""
    parts = [p.split()[-1] for p in name.split(", ")]
    return tuple(int(p) if p.isdigit() else 0 for p in parts)


def lanes_summary(trace_paths: list[str], longer_than_ms: float = 0.1) -> str:
    """Lane by lane (times in ms from the earliest start over all traces): the
    span from first start to last end, the idle time inside it, the part of that
    idle time the lane waited for the host to launch its next kernel (the launch
    came after the previous kernel ended), and every kernel longer than
    ``longer_than_ms`` as ``start+duration name``."""
    lanes, launches, start = _all_lanes(trace_paths)
    out = []
    for name in sorted(lanes, key=_lane_order):
        lane = lanes[name]
        idle = host = 0.0
        for prev, e in zip(lane, lane[1:]):
            end = prev["ts"] + prev["dur"]
            gap = max(0.0, e["ts"] - end)
            idle += gap
            launched = launches[name].get(e.get("args", {}).get("correlation"))
            if launched is not None:
                host += max(0.0, min(e["ts"], launched) - end)
        first, last = lane[0]["ts"] - start, max(e["ts"] + e["dur"] for e in lane) - start
        out.append(f"{name}: {first / 1e3:.2f}-{last / 1e3:.2f} ms, idle {idle / 1e3:.2f} ms, "
                   f"of it waiting for the host {host / 1e3:.2f} ms")
        out.extend(f"  {(e['ts'] - start) / 1e3:8.2f}+{e['dur'] / 1e3:.2f}  {_short(e['name'])}"
                   for e in lane if e["dur"] > longer_than_ms * 1e3)
    return "\n".join(out) + "\n"


def _short(name: str) -> str:
    """A kernel's name, short: "nccl SendRecv", "GEMM" for CUTLASS, else its first 60 characters."""
    if "nccl" in name.lower():
        return "nccl " + name.split("(")[0].removeprefix("ncclDevKernel_")
    if "cutlass" in name.lower() or "gemm" in name.lower():
        return "GEMM"
    return name[:60]
