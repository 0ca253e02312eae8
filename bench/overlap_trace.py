"""Where a pipelined MoE layer's time goes: profiler timelines of ``dispatch-bench overlap``'s layer.

For each shape and each G of ``--groups``, on the same layer, inputs and EP
group as ``dispatch-bench overlap`` (same flags): one forward+backward of
MoEExchange(G) with GroupedExperts is profiled on every rank (torch.profiler).
Each rank writes its chrome trace (rank 0 ``<stem>.json``, rank R
``<stem>-rank<R>.json``; one host, one folder); rank 0 writes the kernel table
(``<stem>.txt``), every rank's streams on one PNG timeline (``<stem>.png``) and
a lane-by-lane summary of idle time and host waits (``<stem>-lanes.txt``:
first the step's time as ``dispatch-bench`` takes it, CUDA events around it
from an idle GPU, whose lanes start only at the first kernel; then
``timeline.lanes_summary``), with ``<stem>`` =
``overlap-trace-<shape>-w<W><suffix>-g<G>``.

``--host-profile`` also profiles the host (cProfile of rank 0) over 5
forward+backward steps: ``overlap-host-<shape>-w<W><suffix>-g<G>.txt`` (with
``--micro-batches``, of MoEMicroBatches: ``overlap-host-<shape>-w<W><suffix>.txt``),
the functions by their own time and by their time with callees.

``--graph`` profiles the replay of the layer with ``max_rows`` captured in a
CUDA graph (the NVLink engine), as ``dispatch-bench overlap --graph`` times it.
``--micro-batches [M]`` profiles, in place of the layer by groups, one forward+backward
of M micro-batches through MoEMicroBatches, as ``dispatch-bench overlap
--micro-batches`` times them, then its baselines there: the same call with every
kernel on one stream (``<stem>-serial``) and MoEExchange on each in a row
(``<stem>-layer``). ``--max-rows`` bounds the layer by groups (each
group's rows) or the micro-batches, as ``dispatch-bench overlap`` does.

    python3 bench/overlap_trace.py --groups 1,4 --comm-max-ctas 2 --out bench/results/<machine>/
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's dispatch

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dispatch.bench import overlap, overlap_mb  # noqa: E402
from dispatch.bench.common import SHAPES, launch, shapes_fit, world_size_for  # noqa: E402
from dispatch.timing import PhaseTimer  # noqa: E402
from timeline import draw_timeline, lanes_summary  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = overlap.build_parser(prog="bench/overlap_trace.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host-profile", action="store_true",
                        help="also profile the host (cProfile, rank 0) over 5 forward+backward steps")
    args = overlap.parse_args(argv, parser)
    if args.max_rows and args.graph:
        parser.error("--max-rows: --graph bounds its layer itself")
    if args.micro_batches and args.graph:
        parser.error("--micro-batches traces the micro-batches alone (without --graph)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not shapes_fit(args.shapes, world_size_for(args.world_size, cpu_default=2), "overlap_trace"):
        return 2
    return launch(_job, args, args.world_size, cpu_default=2)


def _job(args: argparse.Namespace) -> None:
    group = overlap.ep_group(args)
    for name in args.shapes:
        case = overlap.make_case(SHAPES[name], args, group)
        if args.micro_batches:  # the micro-batches through MoEMicroBatches (--max-rows: bounded)
            bound = case.bound(group) if args.max_rows else None
            stem = os.path.join(args.out, f"overlap-trace-{name}-w{dist.get_world_size()}{overlap.suffix(args)}")
            what = f"{name}: {args.micro_batches} micro-batches"
            step = overlap_mb.micro_batch_step(case, True, sm_carveout=args.sm_carveout, max_rows=bound,
                                               sm_partition=args.sm_partition)
            trace(step, stem, case.x.device, f"{what} through MoEMicroBatches, one fwd+bwd step")
            if args.host_profile:
                host_profile(step, os.path.join(args.out, f"overlap-host-{name}-w{dist.get_world_size()}"
                                                f"{overlap.suffix(args)}.txt"), case.x.device,
                             f"host profile of 5 forward+backward steps, {what} through MoEMicroBatches, rank 0")
            # its baselines as dispatch-bench overlap times them: the same call with every kernel on
            # one stream (T_mb_serial), and MoEExchange (G = 1) on each in a row (T_mb_layer)
            trace(overlap_mb.micro_batch_step(case, True, serial=True, max_rows=bound), stem + "-serial",
                  case.x.device, f"{what} through MoEMicroBatches on one stream, one fwd+bwd step")
            trace(overlap_mb.layer_steps(case, case.layer(1, args.comm_priority, max_rows=bound), True),
                  stem + "-layer", case.x.device, f"{what}, MoEExchange on each in a row, one fwd+bwd step")
            continue
        for g in overlap.group_values(args, case.dispatcher.num_local_experts):
            graph = None
            if args.graph:  # the layer with max_rows, its step captured: the replay is profiled
                layer = case.layer_bounded(args.comm_priority, group, g)
                graph = overlap.capture(case.layer_step(layer, backward=True))
                step = graph.replay
            else:  # (--max-rows: bounded, each group's rows as dispatch-bench overlap bounds them)
                layer = case.layer(g, args.comm_priority, sm_carveout=args.sm_carveout,
                                   max_rows=case.bound(group, g) if args.max_rows else None)
                step = case.layer_step(layer, backward=True)
            tail = f"{name}-w{dist.get_world_size()}{overlap.suffix(args)}-g{g}"
            trace(step, os.path.join(args.out, f"overlap-trace-{tail}"), case.x.device,
                  f"{name}: one fwd+bwd step{' (graph replay)' if graph else ''}, G={g}")
            if args.host_profile:
                host_profile(step, os.path.join(args.out, f"overlap-host-{tail}.txt"), case.x.device,
                             f"host profile of 5 forward+backward steps, {name}, G={g}, rank 0")
            if graph is not None:
                _sync(case.x.device)
                graph.reset()  # its pool goes before the next G's

def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()  # host sync: the profile holds the steps only, and all of them


def trace(step, stem: str, device, title: str) -> None:
    """Profile one ``step()`` on every rank after two warm-up steps; write the
    traces, the kernel table, the timeline and the lanes summary (see the module doc)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    step()
    step()
    with profile(activities=activities) as prof:
        dist.barrier()  # inside the profile: every rank's profiler has started before the step
        _sync(device)
        timer = PhaseTimer(device)  # as dispatch-bench times a step: events around it, from an idle GPU
        timer.start()
        step()
        timer.mark("step")
        _sync(device)
    timed = torch.tensor([timer.phases()["step"]], dtype=torch.float64, device=device)
    dist.all_reduce(timed, op=dist.ReduceOp.MAX)
    rank, world = dist.get_rank(), dist.get_world_size()
    paths = [stem + ".json"] + [f"{stem}-rank{r}.json" for r in range(1, world)]
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    prof.export_chrome_trace(paths[rank])
    dist.barrier()  # every rank's trace is on disk before rank 0 reads them
    if rank != 0:
        return
    with open(stem + ".txt", "w") as f:  # where the time goes, kernel by kernel
        key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        f.write(prof.key_averages().table(sort_by=key, row_limit=40))
    with open(stem + "-lanes.txt", "w") as f:  # (the lanes start at the first kernel; the events before it)
        f.write(f"the step timed with CUDA events around it (slowest rank): {float(timed):.2f} ms\n")
        f.write(lanes_summary(paths))
    draw_timeline(paths, stem + ".png", title)
    print(f"timeline: {stem}.png", flush=True)


def host_profile(step, path: str, device, title: str) -> None:
    """Run ``step()`` 5 times on every rank (after two warm-up steps), rank 0
    under cProfile; rank 0 writes its functions by own time and by cumulative time."""
    import cProfile
    import io
    import pstats

    step()
    step()
    _sync(device)
    dist.barrier()
    profiler = cProfile.Profile()
    if dist.get_rank() == 0:
        profiler.enable()
    for _ in range(5):
        step()
    profiler.disable()
    _sync(device)
    dist.barrier()
    if dist.get_rank() != 0:
        return
    text = io.StringIO()
    text.write(title + "\n")
    for key in ("tottime", "cumulative"):
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(40)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(text.getvalue())
    print(f"host profile: {path}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
