"""Study: the NVLink engine beside the NCCL transport on the model shapes, with a
per-kernel profile of the engine's round trip.

    python3 bench/engine_probe.py [--shapes deepseek-v3,mixtral-8x7b,decode] [--out DIR]

One process per local GPU (NCCL). For each shape, transport and wire: median
dispatch, combine and round-trip times (CUDA events, after warm-up and a
barrier), every result checked against the NCCL transport bit for bit; the
engine with one host read per dispatch, with max_rows (no host read; this
rank's N plus 10%, the rows past N zeroed), and with max_rows captured in CUDA
graphs (dispatch, combine, round trip: each one graph, replayed), and there the
round trip in steady state (STEADY replays queued back to back, timed together:
a single replay's time includes how much later the peers' graphs were launched,
which the counts exchange waits out) and the plan phase alone (the routing
layout and the counts exchange of a dispatch with max_rows, no rows staged) in a
graph of its own; then one profiled round trip of the engine, its kernels' times
on rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dispatch
from dispatch.bench import common

SHAPES = {  # T per rank, H, E, K
    "deepseek-v3": (4096, 7168, 256, 8),
    "qwen3-235b": (4096, 4096, 128, 8),
    "mixtral-8x7b": (8192, 4096, 8, 2),
    "decode": (128, 7168, 256, 8),
}
HOST_CALLS = 20  # round trips a host profile takes
STEADY = 10  # graph replays of the round trip queued back to back for the steady-state time
SETTINGS = [  # name, transport, dispatch wire, sm budget, mode
    # mode: "host" (one host read per dispatch), "bounded" (max_rows, no host read),
    # "graph" (max_rows, the round trip captured once in a CUDA graph and replayed)
    ("nccl", "nccl", "native", None, "host"),
    ("nvlink", "nvlink", "native", None, "host"),
    ("nvlink-bounded", "nvlink", "native", None, "bounded"),
    ("nvlink-graph", "nvlink", "native", None, "graph"),
    ("nvlink-24sm", "nvlink", "native", 24, "host"),
    ("nvlink-24sm-graph", "nvlink", "native", 24, "graph"),
    ("nccl-fp8", "nccl", "fp8", None, "host"),
    ("nvlink-fp8", "nvlink", "fp8", None, "host"),
    ("nvlink-fp8-graph", "nvlink", "fp8", None, "graph"),
]


def inputs(shape, rank, device):
    """(x [T, H] bf16, topk_idx, normalised weights) of rank ``rank`` for ``shape``, seeded by the rank."""
    tokens, hidden, experts, topk = shape
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    x = torch.randn(tokens, hidden, generator=gen, device=device).to(torch.bfloat16)
    scores = torch.rand(tokens, experts, generator=gen, device=device)
    weights, idx = scores.topk(topk, dim=1)
    return x, idx, (weights / weights.sum(1, keepdim=True)).float()


def timed(fn, iters, warmup):
    """(median, min, max) us of ``fn`` on the device, each run between two events, after a barrier."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times), min(times), max(times)


def _captured_plan(d, x, topk_idx, topk_weights, bound: int):
    """The plan phase of a dispatch with ``max_rows=bound`` alone: the routing layout
    and the counts exchange on the device (no rows staged beside the layout), run
    once eagerly and captured in a CUDA graph; returns its replay."""
    from dispatch import plan
    from dispatch.codec import to_experts_codec

    # what the dispatch hands the engine: the weights in their wire dtype, x's codec
    weights = topk_weights.to(plan.weight_wire_dtype(topk_weights.dtype)).contiguous()
    codec = to_experts_codec(d.config.dispatch_wire, x.dtype, d.config.tuning.fp8_pow2_scales)
    header = plan.header(x, topk_weights, topk_idx.shape[1], plan.Ticket(max_rows=bound))
    idx = topk_idx.contiguous()

    def plan_only():
        d.transport.engine.exchange_counts(idx, weights, header, None, codec, False, host_read=False)

    plan_only()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan_only()

    def replay(_reads=(idx, weights)):  # the graph reads them: held as long as the replay is
        graph.replay()

    return replay


def _host_sections(round_trip, calls=20):
    """Host microseconds per round trip spent inside the engine's main calls
    (wall clock on the host, the waits of its host reads included)."""
    import time

    from dispatch import cuda, nvlink
    from dispatch import dispatcher as base
    from dispatch.transports import nvlink as nvlink_transport

    targets = [(nvlink.Engine, "exchange_counts"), (nvlink.Engine, "to_experts"), (nvlink.Engine, "to_home"),
               (nvlink_transport.NVLinkTransport, "plan"), (base.TokenDispatcher, "dispatch"),
               (base.TokenDispatcher, "combine"), (cuda.Kernel, "__call__")]
    spent = {f"{cls.__name__}.{name}": 0.0 for cls, name in targets}
    originals = []
    for cls, name in targets:
        original = getattr(cls, name)
        originals.append((cls, name, original))

        def clocked(*a, _original=original, _key=f"{cls.__name__}.{name}", **k):
            start = time.perf_counter()
            try:
                return _original(*a, **k)
            finally:
                spent[_key] += time.perf_counter() - start

        setattr(cls, name, clocked)
    try:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            round_trip()
        torch.cuda.synchronize()
        total = time.perf_counter() - start
    finally:
        for cls, name, original in originals:
            setattr(cls, name, original)
    out = {key: value * 1e6 / calls for key, value in spent.items()}
    out["round trip (wall)"] = total * 1e6 / calls
    return out


def init_rank(rank: int, world: int, port: int) -> torch.device:
    """This process as rank ``rank`` of a local NCCL world, on GPU ``rank``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    return device


def _worker(rank, world, args, port):
    device = init_rank(rank, world, port)
    rows = []
    for name in args.shapes:
        shape = SHAPES[name]
        x, idx, w = inputs(shape, rank, device)
        reference = None
        for label, transport, wire, budget, mode in SETTINGS:
            config = dispatch.DispatchConfig.from_options(num_experts=shape[2], transport=transport, dispatch_wire=wire,
                                             sm_budget=budget, check_inputs=False)
            d = dispatch.create(config)
            out = d.dispatch(x, idx, w)
            bound = None if mode == "host" else int(out.tokens.shape[0] * common.GRAPH_SLACK)
            n = out.tokens.shape[0]
            if bound is not None:
                out = d.dispatch(x, idx, w, max_rows=bound)
            combined = d.combine(out.tokens, out.handle, weights=out.weights)
            key = (wire,)
            if transport == "nccl":
                reference = (key, out.tokens, combined)
                same = True
            else:
                same = reference[0] == key and common.same_bits(reference[1], out.tokens[:n]) and common.same_bits(
                    reference[2], combined)

            if mode == "graph":
                calls, replayed = common.captured_round_trip(d, x, idx, w, bound)
                replayed.fill_(float("nan"))
                calls["total"]()
                torch.cuda.synchronize()
                same = same and common.same_bits(reference[2], replayed)  # the replay's own output, by bits
            else:
                calls = common.eager_calls(d, x, idx, w, bound)[1]
            dispatch_only, combine_only, round_trip = (calls[k] for k in ("dispatch", "combine", "total"))
            t_d = timed(dispatch_only, args.iters, args.warmup)
            t_c = timed(combine_only, args.iters, args.warmup)
            t_r = timed(round_trip, args.iters, args.warmup)
            t_s = t_p = None
            if mode == "graph":
                t_s = [t / STEADY for t in timed(lambda: [round_trip() for _ in range(STEADY)], args.iters,
                                                 args.warmup)]
                t_p = timed(_captured_plan(d, x, idx, w, bound), args.iters, args.warmup)
            if bound is not None:
                d.check()
            rows.append(dict(shape=name, setting=label, max_rows=bound, dispatch_us=t_d[0], combine_us=t_c[0],
                             round_trip_us=t_r[0], round_trip_min_us=t_r[1], round_trip_max_us=t_r[2],
                             steady_round_trip_us=None if t_s is None else t_s[0],
                             plan_us=None if t_p is None else t_p[0], bitwise_equal_nccl=bool(same)))
            if rank == 0:
                graph_text = "" if t_p is None else (f"  steady {t_s[0]:8.1f} us  plan {t_p[0]:6.1f} us "
                                                    f"(min {t_p[1]:.1f})")
                print(f"{name:14s} {label:18s} dispatch {t_d[0]:8.1f} us  combine {t_c[0]:8.1f} us  "
                      f"round trip {t_r[0]:8.1f} us (min {t_r[1]:.1f})  equal to nccl: {same}{graph_text}", flush=True)
            profiled = label in ("nvlink", "nvlink-bounded")
            if profiled and args.host_profile and rank == 0:
                import cProfile

                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(HOST_CALLS):
                    round_trip()
                torch.cuda.synchronize()
                profiler.disable()
                print(f"{name} {label} host profile, per round trip:\n" + common.profile_text(profiler, HOST_CALLS),
                      flush=True)
            elif profiled and args.host_profile:
                for _ in range(HOST_CALLS):
                    round_trip()
                torch.cuda.synchronize()
            if profiled and args.host_sections:
                sections = _host_sections(round_trip)
                if rank == 0:
                    print(f"{name} {label} host us per round trip: " + ", ".join(f"{k} {v:.0f}" for k, v in sections.items()),
                          flush=True)
            if label in ("nvlink", "nvlink-graph") and args.profile:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        round_trip()
                    torch.cuda.synchronize()
                if rank == 0:
                    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14), flush=True)
            d = calls = None  # (the engine's buffers go with it before the next setting)
    if rank == 0 and args.out:
        write_json(args.out, "engine-probe.json", rows)
    dist.destroy_process_group()


def write_json(out: str, name: str, rows: list) -> None:
    """The rows, with the world, the GPU, versions and the commit measured."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, name), "w") as f:
        json.dump(dict(world=dist.get_world_size(), device=torch.cuda.get_device_name(),
                       environment=common.environment(), rows=rows), f, indent=1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="deepseek-v3,mixtral-8x7b,decode")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="kernel times of the engine's round trip")
    parser.add_argument("--host-profile", action="store_true", help="where rank 0's host time goes (cProfile)")
    parser.add_argument("--host-sections", action="store_true", help="host time inside the engine's main calls")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    args.shapes = args.shapes.split(",")
    world = torch.cuda.device_count()
    mp.spawn(_worker, args=(world, args, 29600 + os.getpid() % 1000), nprocs=world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
