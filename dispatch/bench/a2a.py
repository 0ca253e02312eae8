"""``dispatch-bench a2a``: an nccl-tests style all-to-all bandwidth sweep.

For each buffer size (bytes per rank, doubling from ``--min-bytes`` to
``--max-bytes``) and each transport:

* ``nccl``: torch's ``all_to_all_single`` on a bf16 buffer, equal splits: the
  hardware's bar;
* ``ours``: ``dispatch.comm.all_to_all_rows``, the dispatchers' transport (rows of
  bytes with per-peer split sizes), on the same buffer;
* ``nvlink`` (where the NVLink engine runs): the engine moving the buffer as rows
  of ``--hidden`` bf16 channels, row r of a rank to rank r // (rows per peer) (one
  expert per rank, so its expert-major output is the all-to-all's), a dispatch
  with ``max_rows`` captured in a CUDA graph and replayed: routing plan, counts
  exchange, staging and pull included;
* one line per compressing wire format (``fp8``, ...): rows of ``--hidden`` bf16
  channels packed by the wire's codec, exchanged, unpacked; its time covers all
  three, and ``effective`` is the uncompressed bytes per second.

Timing as nccl-tests does it: the runs are issued back to back after one
barrier, each between two CUDA events, so the time is the device's (median and
10th-90th percentile over the runs, the slowest rank's). Columns as nccl-tests prints them: ``size`` (bytes per rank), ``count``
(elements), ``type``, ``time`` (median, us), ``algbw`` = size / time and
``busbw`` = algbw * (W-1)/W (GB/s, nccl-tests' all-to-all convention; for a
compressed wire both count the bytes actually sent), ``#wrong`` (elements that
arrived wrong: exactly equal for lossless transports, within the codec's
error bound for lossy ones).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from dispatch import comm, config
from dispatch.bench import common, plots
from dispatch.codec import to_experts_codec

LOSSLESS = ("nccl", "ours")  # transports that move the bf16 buffer as it is
COLUMNS = [
    ("size", "(B)", 12), ("count", "(elements)", 12), ("type", "", 8), ("time", "(us)", 10),
    ("algbw", "(GB/s)", 8), ("busbw", "(GB/s)", 8), ("effective", "(GB/s)", 9), ("#wrong", "", 8),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--min-bytes", type=_size, default=None, help="smallest buffer per rank, e.g. 1K (default 1K)")
    parser.add_argument("--max-bytes", type=_size, default=None,
                        help="largest buffer per rank, e.g. 1G (default 1G on GPUs, 4M on CPU)")
    parser.add_argument("--hidden", type=int, default=1024, help="channels per row for the wire formats (default 1024)")
    parser.add_argument("--wires", dest="a2a_wires", default="auto",
                        help="comma-separated compressing wire formats to sweep, 'none', or 'auto' (all of them)")


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 4096, 64K, 8M, 1G)") from None


def compressing_wires() -> list[str]:
    """Wire formats that put fewer bytes on the wire than bf16 rows."""
    hidden = 1024
    return [
        w for w in config.TO_EXPERTS_WIRES
        if to_experts_codec(w, torch.bfloat16).row_bytes(hidden) < 2 * hidden
    ]


def resolve(args: argparse.Namespace, use_cuda: bool, parser: argparse.ArgumentParser) -> None:
    """Defaults that depend on the hardware, and the checks argparse cannot do."""
    args.min_bytes = args.min_bytes or 1 << 10
    args.max_bytes = args.max_bytes or (1 << 30 if use_cuda else 4 << 20)
    if args.min_bytes < 1 or args.max_bytes < args.min_bytes:
        parser.error(f"--min-bytes ({args.min_bytes}) must be >= 1 and <= --max-bytes ({args.max_bytes})")
    if args.hidden < 1:
        parser.error(f"--hidden must be >= 1, got {args.hidden}")
    available = compressing_wires()
    if args.a2a_wires == "auto":
        args.a2a_wires = available
    elif args.a2a_wires == "none":
        args.a2a_wires = []
    else:
        wanted = [w.strip() for w in args.a2a_wires.split(",") if w.strip()]
        unknown = [w for w in wanted if w not in available]
        if unknown:
            parser.error(f"--wires: {', '.join(unknown)} not among the compressing wire formats ({', '.join(available) or 'none'})")
        args.a2a_wires = wanted


def sizes(min_bytes: int, max_bytes: int) -> list[int]:
    out, size = [], min_bytes
    while size <= max_bytes:
        out.append(size)
        size *= 2
    return out


def pattern(src: int, dst: int, count: int, dev) -> torch.Tensor:
    """[count] bf16 values that name their (source, destination) pair, exact in bf16."""
    i = torch.arange(count, device=dev)
    return (((src * 37 + dst * 11 + i) % 201) - 100).to(torch.bfloat16)


def run(args: argparse.Namespace) -> dict | None:
    """Collective: the sweep on this world; rank 0 returns {"rows": [...]}."""
    dev = common.device()
    world, rank = dist.get_world_size(), dist.get_rank()
    all_sizes = sizes(args.min_bytes, args.max_bytes)
    engine = _engine(world, _rows(max(all_sizes), world, args.hidden), args.hidden, dev) if all_sizes else None
    transports = ["nccl", "ours", *(["nvlink"] if engine is not None else []), *args.a2a_wires]
    progress = common.Progress(len(all_sizes) * len(transports), "a2a")
    rows = []
    for size in all_sizes:
        per_peer = size // (2 * world)
        for transport in transports:
            if per_peer == 0 or (transport not in LOSSLESS and per_peer < args.hidden):
                progress.step(f"{size} B {name(transport)}", "skipped (smaller than one element/row per peer)")
                continue
            row = _measure(transport, per_peer, world, rank, dev, args, engine)
            rows.append(row)
            progress.step(f"{size} B {name(transport)}", f"{row['time_us']:.1f} us {row['busbw_gbps']:.1f} GB/s")
    return {"rows": rows, "world_size": world} if rank == 0 else None


def _rows(size: int, world: int, hidden: int) -> int:
    """Rows of ``hidden`` bf16 values one rank sends in a sweep step of ``size`` bytes."""
    per_peer = size // (2 * world)
    return (per_peer - per_peer % hidden) * world // hidden


def _engine(world: int, largest_rows: int, hidden: int, dev):
    """A dispatcher on the NVLink engine with one expert per rank, its buffers
    sized once for the sweep's largest step (every dispatch after takes
    ``max_rows``: no host read, and no buffer grows under a captured graph), or
    None where the engine cannot run (the same answer on every rank)."""
    from dispatch import cuda

    if world < 2 or not cuda.available():
        return None
    import dispatch
    from dispatch.transports import unusable

    if unusable(None, world) is not None:  # a collective: every rank gets the same answer
        return None
    cfg = config.DispatchConfig.from_options(num_experts=world, transport="nvlink", check_inputs=False)
    engine = dispatch.create(cfg)
    if largest_rows:
        x = torch.zeros(largest_rows, hidden, dtype=torch.bfloat16, device=dev)
        engine.dispatch(x, _to_ranks(largest_rows, world, dev), torch.ones(largest_rows, 1, device=dev),
                        max_rows=largest_rows)
        engine.check()
    return engine


def _to_ranks(rows: int, world: int, dev) -> torch.Tensor:
    """[rows, 1]: row i goes to expert (= rank) i // (rows / W)."""
    return (torch.arange(rows, device=dev) // max(rows // world, 1)).clamp(max=world - 1).view(rows, 1)


def _engine_step(engine, send: torch.Tensor, world: int, hidden: int):
    """(replay, result) of the engine's all-to-all of ``send`` as rows of ``hidden``."""
    x = send.view(-1, hidden)
    rows = x.shape[0]
    dest = _to_ranks(rows, world, x.device)  # expert d lives on rank d
    ones = torch.ones(rows, 1, device=x.device)
    engine.dispatch(x, dest, ones, max_rows=rows)  # eager once before the capture
    torch.cuda.synchronize()
    # the graph reads its inputs where they were at the capture: they live as long as it replays
    graph, box = torch.cuda.CUDAGraph(), {"inputs": (x, dest, ones)}
    with torch.cuda.graph(graph):
        box["out"] = engine.dispatch(x, dest, ones, max_rows=rows)
    return graph.replay, lambda: box["out"].tokens.reshape(-1)


def _measure(transport: str, per_peer: int, world: int, rank: int, dev, args, engine=None) -> dict:
    if transport not in LOSSLESS:
        per_peer -= per_peer % args.hidden  # whole rows
    count = per_peer * world
    send = torch.cat([pattern(rank, dst, per_peer, dev) for dst in range(world)])
    expected = torch.cat([pattern(src, rank, per_peer, dev) for src in range(world)])
    recv = torch.empty_like(send)
    splits = (per_peer,) * world
    wire_bytes = count * 2

    if transport == "nccl":
        def step():
            dist.all_to_all_single(recv, send)
        result = lambda: recv  # noqa: E731
    elif transport == "nvlink":
        step, result = _engine_step(engine, send, world, args.hidden)
    elif transport == "ours":
        box = {}

        def step():
            box["out"] = comm.all_to_all_rows(send.view(count, 1), splits, splits, None)
        result = lambda: box["out"].view(-1)  # noqa: E731
    else:
        codec = to_experts_codec(transport, torch.bfloat16)
        rows_per_peer = per_peer // args.hidden
        wire_bytes = rows_per_peer * world * codec.row_bytes(args.hidden)
        row_splits = (rows_per_peer,) * world
        box = {}

        def step():
            packed = codec.pack(send.view(-1, args.hidden))
            arrived = comm.all_to_all_rows(packed, row_splits, row_splits, None)
            box["out"] = codec.unpack(arrived, torch.bfloat16, args.hidden)
        result = lambda: box["out"].reshape(-1)  # noqa: E731

    step()
    wrong = _wrong(result(), expected, lossless=transport in (*LOSSLESS, "nvlink"), hidden=args.hidden)
    stats = common.spread(common.time_back_to_back(step, args.iters, args.warmup, dev))
    seconds = stats["median"] / 1e3
    algbw = wire_bytes / seconds / 1e9
    return {
        "transport": transport,
        "size": count * 2,
        "count": count,
        "type": "bf16" if transport in LOSSLESS or transport == "nvlink" else transport,
        "wire_bytes": wire_bytes,
        "time_us": stats["median"] * 1e3,
        "time_us_p10": stats["p10"] * 1e3,
        "time_us_p90": stats["p90"] * 1e3,
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * (world - 1) / world,
        "effective_gbps": count * 2 / seconds / 1e9,
        "wrong": wrong,
    }


def _wrong(got: torch.Tensor, expected: torch.Tensor, lossless: bool, hidden: int) -> int:
    """Elements that arrived wrong, summed over the world."""
    if lossless:
        bad = (got != expected).sum()
    else:
        # Block formats round each value to within a fraction of its block's
        # largest magnitude; a misrouted or corrupted row is off by far more.
        blocks = expected.float().view(-1, min(128, hidden))
        bound = 0.0625 * blocks.abs().amax(1, keepdim=True)
        bad = ((got.float().view_as(blocks) - blocks).abs() > bound).sum()
    total = bad.to(torch.int64).reshape(1)
    dist.all_reduce(total)
    return int(total)


def table(rows: list[dict], transport: str) -> str:
    picked = [r for r in rows if r["transport"] == transport]
    body = [
        [str(r["size"]), str(r["count"]), r["type"], f"{r['time_us']:.1f}", f"{r['algbw_gbps']:.2f}",
         f"{r['busbw_gbps']:.2f}", f"{r['effective_gbps']:.2f}", str(r["wrong"])]
        for r in picked
    ]
    text = common.fixed_width(COLUMNS, body)
    if picked:
        avg = sum(r["busbw_gbps"] for r in picked) / len(picked)
        text += f"\n# Out of bounds values : {sum(r['wrong'] for r in picked)}\n# Avg bus bandwidth    : {avg:.3f} GB/s"
    return text


def comparison(rows: list[dict], from_bytes: int = 8 << 20) -> list[str]:
    """Lines comparing ``ours`` and the engine with raw NCCL (the backend's all-to-all) at
    every size from ``from_bytes`` up (none below), and the engine at 1 MiB."""
    nccl = {r["size"]: r for r in rows if r["transport"] == "nccl"}
    lines = []
    for transport in ("ours", "nvlink"):
        ratios = [
            (r["size"], nccl[r["size"]]["time_us"] / r["time_us"])
            for r in rows if r["transport"] == transport and r["size"] >= from_bytes and r["size"] in nccl
        ]
        if ratios:
            worst = min(ratios, key=lambda p: p[1])
            lines.append(f"{transport} / {name('nccl')} bandwidth from {from_bytes >> 20} MiB up: worst "
                         f"{worst[1]:.3f} at {worst[0]} B, mean {sum(r for _, r in ratios) / len(ratios):.3f}")
        at_1m = [nccl[r["size"]]["time_us"] / r["time_us"] for r in rows
                 if r["transport"] == transport == "nvlink" and r["size"] == 1 << 20 and r["size"] in nccl]
        if at_1m:
            lines.append(f"nvlink / {name('nccl')} bandwidth at 1 MiB: {at_1m[0]:.3f}")
    return lines


def name(transport: str) -> str:
    """A transport's short name in progress lines and plots: ``nccl`` is the process group's backend (gloo on CPU)."""
    return dist.get_backend() if transport == "nccl" else transport


def label(transport: str) -> str:
    """A transport's table title, naming what ran (the process group's backend: gloo on CPU)."""
    backend = dist.get_backend()
    if transport == "nccl":
        return f"{backend}: torch.distributed.all_to_all_single"
    if transport == "ours":
        return f"ours: dispatch.comm.all_to_all_rows over {backend}"
    if transport == "nvlink":
        return "nvlink: the NVLink engine's all-to-all"
    return f"{transport}: ours with the {transport} wire over {backend}"


def report(result: dict, args: argparse.Namespace) -> str:
    rows, world = result["rows"], result["world_size"]
    title = f"all-to-all sweep, W={world}, {common.environment().get('gpu', 'CPU gloo')}"
    sections = []
    for transport in dict.fromkeys(r["transport"] for r in rows):
        sections.append(f"## {label(transport)}\n\n```\n{table(rows, transport)}\n```")
    notes = comparison(rows)
    stem = f"a2a-w{world}"
    png = plots.bandwidth_plot(rows, os.path.join(args.out, stem + ".png"), title, name)
    if png:
        notes.append(f"plot: {os.path.basename(png)}")
    return common.write_results(args.out, stem, title, "\n\n".join(sections), result, notes)
