"""Wire-format benchmark: bytes on the wire, dispatch phases and kernel bandwidth, bf16 vs fp8.

For each shape, with the ``alltoall`` variant and a bf16 model, in one run and
one table: bytes a rank sends, the dispatch split into its three phases (gather +
encode ``pack``, the all-to-all ``exchange``, decode + expand ``unpack``), their
sum, the whole ``dispatch`` (with its routing plan) and ``combine`` (bf16 partial
sums), and the achieved memory bandwidth of the pack and unpack kernels
((bytes read + written) / time). Times are the median over ``--iters`` of the
slowest rank, CUDA events after warm-up, a barrier before each. ``#wrong``
counts dispatched rows that differ from what the dispatcher itself delivers.

    python3 bench/wire.py --out bench/results/nvidia-h200-x4   # every GPU, three model shapes
    python3 bench/wire.py --shapes cpu-small --world-size 2      # CPU smoke run (gloo)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's dispatch

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import dispatch  # noqa: E402
from dispatch import comm  # noqa: E402
from dispatch.bench import common  # noqa: E402
from dispatch.bench.common import SHAPES, time_phases  # noqa: E402
from dispatch.bench.roundtrip import make_routing  # noqa: E402
from dispatch.codec import to_experts_codec  # noqa: E402

WIRES = ("bf16", "fp8")
GPU_SHAPES = ("deepseek-v3", "qwen3-235b", "mixtral-8x7b")
TIMES = ("pack", "exchange", "unpack", "three_phases", "dispatch", "combine")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/wire.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", help=f"comma list of {', '.join(SHAPES)} (default: {','.join(GPU_SHAPES)} on "
                        "GPUs, cpu-small on CPU)")
    parser.add_argument("--world-size", type=int, help="ranks (default: all GPUs, or 2 CPU processes)")
    parser.add_argument("--iters", type=int, default=20, help="timed repetitions (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed repetitions first (default 5)")
    parser.add_argument("--peak-gbps", type=float, default=4800.0, help="memory bandwidth of one GPU (H200: 4800)")
    parser.add_argument("--out", default="wire-results", help="folder for the JSON and markdown results")
    args = parser.parse_args(argv)
    default = GPU_SHAPES if torch.cuda.is_available() else ("cpu-small",)
    args.shapes = args.shapes.split(",") if args.shapes else list(default)
    for shape in args.shapes:
        if shape not in SHAPES:
            parser.error(f"--shapes: unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    if args.iters < 1 or args.warmup < 0 or (args.world_size is not None and args.world_size < 1):
        parser.error("--iters and --world-size must be >= 1, --warmup >= 0")
    return args


def measure(shape, wire: str, args, device) -> dict:
    """One (shape, wire) row: bytes, phase times (ms, median of the slowest rank), bandwidths."""
    rank, world = dist.get_rank(), dist.get_world_size()
    # the phases it times are the NCCL transport's (pack, all-to-all, unpack)
    d = dispatch.create(dispatch.DispatchConfig(num_experts=shape.experts, dispatch_wire=wire, combine_wire="bf16",
                                                transport="nccl"))
    gen = torch.Generator(device=device).manual_seed(rank)
    x = torch.randn(shape.tokens, shape.hidden, generator=gen, device=device).to(torch.bfloat16)
    topk_idx, topk_weights = make_routing("uniform", shape, world, rank, device)
    out = d.dispatch(x, topk_idx, topk_weights)
    handle = out.handle
    codec = to_experts_codec(wire, x.dtype)
    held = {}

    def pack():
        held["sent"] = codec.pack(x, handle.send_token)

    def exchange():
        held["received"] = comm.all_to_all_rows(held["sent"], handle.send_splits, handle.recv_splits, d.group)

    def unpack():
        held["rows"] = codec.unpack(held["received"], x.dtype, shape.hidden, handle.expand_src)

    def three_phases():
        pack()
        exchange()
        unpack()

    def whole_dispatch():
        held["out"] = d.dispatch(x, topk_idx, topk_weights)

    def combine():
        d.combine(out.tokens, handle, weights=out.weights)

    times = {}
    for name, fn in zip(TIMES, (pack, exchange, unpack, three_phases, whole_dispatch, combine)):
        runs = time_phases(lambda timer: fn(), args.iters, args.warmup, device)
        times[name] = statistics.median(r["total"] for r in runs)
    three_phases()
    wrong = torch.tensor([int((held["rows"] != out.tokens).any(1).sum())], device=device)
    dist.all_reduce(wrong)

    row_bytes = codec.row_bytes(shape.hidden)
    sent_rows, kept = sum(handle.send_splits), handle.send_splits[rank]
    num_send, num_rows = handle.send_token.numel(), out.tokens.shape[0]
    pack_bytes = num_send * (shape.hidden * x.element_size() + 8 + row_bytes)  # read row + index, write packed
    recv_rows = sum(handle.recv_splits)
    unpack_bytes = num_rows * (row_bytes + 8 + shape.hidden * x.element_size())
    stats = torch.tensor([sent_rows - kept, sent_rows, recv_rows, num_rows], dtype=torch.float64, device=device)
    dist.all_reduce(stats)
    return {
        "shape": shape.name, "wire": wire, "world_size": world, "row_bytes": row_bytes,
        "bytes_out_per_rank": float(stats[0]) / world * row_bytes,  # leaving the rank
        "bytes_sent_per_rank": float(stats[1]) / world * row_bytes,  # incl. the rank's own rows
        "times_ms": times, "wrong": int(wrong),
        "pack_gbps": pack_bytes / times["pack"] / 1e6, "unpack_gbps": unpack_bytes / times["unpack"] / 1e6,
        "pack_bytes": pack_bytes, "unpack_bytes": unpack_bytes,
    }


def summarise(rows: list[dict], peak_gbps: float) -> list[dict]:
    """The targets, per shape: fp8 bytes <= 0.52x bf16, exchange >= 1.40x and
    three-phase dispatch >= 1.25x as fast, pack kernel >= 70% of ``peak_gbps``."""
    out = []
    by = {(r["shape"], r["wire"]): r for r in rows}
    for shape in dict.fromkeys(r["shape"] for r in rows):
        bf16, fp8 = by.get((shape, "bf16")), by.get((shape, "fp8"))
        if bf16 is None or fp8 is None:
            continue
        t16, t8 = bf16["times_ms"], fp8["times_ms"]
        out.append({
            "shape": shape,
            "bytes_ratio": fp8["bytes_sent_per_rank"] / bf16["bytes_sent_per_rank"],
            "exchange_speedup": t16["exchange"] / t8["exchange"],
            "dispatch_speedup": t16["three_phases"] / t8["three_phases"],
            "whole_dispatch_speedup": t16["dispatch"] / t8["dispatch"],
            "pack_fraction_of_peak": fp8["pack_gbps"] / peak_gbps,
            "unpack_fraction_of_peak": fp8["unpack_gbps"] / peak_gbps,
        })
    return out


def report(rows: list[dict], summary: list[dict], args, device: str) -> None:
    head = ["shape", "wire", "W", "MB out", *[f"{t} ms" for t in TIMES], "pack GB/s", "unpack GB/s", "#wrong"]
    units = "" if device == "cuda" else "   (CPU smoke run: times are not GPU figures)"
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        cells = [r["shape"], r["wire"], str(r["world_size"]), f"{r['bytes_out_per_rank'] / 1e6:.1f}",
                 *[f"{r['times_ms'][t]:.3f}" for t in TIMES], f"{r['pack_gbps']:.0f}", f"{r['unpack_gbps']:.0f}",
                 str(r["wrong"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| shape | fp8/bf16 bytes | exchange speed-up | pack+exchange+unpack speed-up | "
              "dispatch speed-up | pack % of peak | unpack % of peak |", "|" + " --- |" * 7]
    for s in summary:
        lines.append(f"| {s['shape']} | {s['bytes_ratio']:.3f} | {s['exchange_speedup']:.2f}x | "
                     f"{s['dispatch_speedup']:.2f}x | {s['whole_dispatch_speedup']:.2f}x | "
                     f"{100 * s['pack_fraction_of_peak']:.0f}% | {100 * s['unpack_fraction_of_peak']:.0f}% |")
    text = "\n".join(lines)
    print(text + units)
    os.makedirs(args.out, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "peak_gbps": args.peak_gbps, "iters": args.iters, "warmup": args.warmup}
    name = f"wire-w{rows[0]['world_size']}" if rows else "wire"
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "summary": summary}, f, indent=1)
    with open(os.path.join(args.out, name + ".md"), "w") as f:
        f.write(f"{meta['device']}, torch {meta['torch']}, median of {args.iters}\n\n{text}\n")


def _job(args) -> None:
    device = common.device()
    rows = [measure(SHAPES[s], wire, args, device) for s in args.shapes for wire in WIRES]
    if dist.get_rank() == 0:
        report(rows, summarise(rows, args.peak_gbps), args, device.type)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not common.shapes_fit(args.shapes, common.world_size_for(args.world_size, cpu_default=2), "wire bench"):
        return 2
    return common.launch(_job, args, args.world_size, cpu_default=2)


if __name__ == "__main__":
    sys.exit(main())
