"""Study: the NVLink engine's launch shape, blocks per SM and steps in flight per
lane, on the model shapes, with the round trip captured in CUDA graphs (so that
only the device's time shows).

    python3 bench/engine_tuning.py [--shapes deepseek-v3,mixtral-8x7b,decode]
        [--blocks-per-sm 1,2,4 | --sm-budget 24,48] [--unroll 4,8] [--out DIR]

One process per local GPU (NCCL). For each shape and setting: median dispatch,
combine and round-trip times of graph replays (max_rows: this rank's N plus
10%), the mean time of each kernel in a profiled replay (rank 0), and whether
the results equal the first setting's bit for bit. The settings are compiled in
(``-DENGINE_UNROLL``) and set on the engine (``dispatch.nvlink.BLOCKS_PER_SM``, or
the dispatcher's ``sm_budget``: blocks in all) here only; the library keeps the
chosen defaults.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dispatch
from dispatch import cuda, nvlink
from dispatch.bench import common

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from engine_probe import SHAPES, init_rank, inputs, timed, write_json  # noqa: E402


def _compile_with(option: str) -> None:
    """Compile the engine's kernels from now on with one more NVRTC option (this
    study's knob; the library keeps its defaults)."""
    cuda._OPTIONS = ("-std=c++17", option)
    cuda.kernel.cache_clear()
    cuda._module.cache_clear()


def _kernels_us(fn, calls=5):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = {}
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.count:
            name = event.key.split("(")[0].split("<")[0].replace("void ", "")
            out[name] = out.get(name, 0.0) + event.self_device_time_total / calls
    return {k: round(v, 1) for k, v in sorted(out.items(), key=lambda kv: -kv[1]) if v >= 0.5}


def _worker(rank, world, args, port):
    device = init_rank(rank, world, port)
    rows = []
    with torch.no_grad():
        for name in args.shapes:
            shape = SHAPES[name]
            x, idx, w = inputs(shape, rank, device)
            first = None
            for unroll in args.unroll:
                for per_sm, budget in args.launches:
                    _compile_with(f"-DENGINE_UNROLL={unroll}")
                    nvlink.BLOCKS_PER_SM = per_sm
                    nvlink._ENGINES.clear()  # a fresh engine: its blocks and kernels
                    d = dispatch.create(dispatch.DispatchConfig.from_options(num_experts=shape[2], transport="nvlink",
                                                                sm_budget=budget, check_inputs=False))
                    n = d.dispatch(x, idx, w).tokens.shape[0]
                    bound = int(n * common.GRAPH_SLACK)
                    replays, result = common.captured_round_trip(d, x, idx, w, bound)
                    t_d, t_c, t_r = (replays[k] for k in ("dispatch", "combine", "total"))
                    times = [timed(fn, args.iters, args.warmup)[0] for fn in (t_d, t_c, t_r)]
                    kernels = _kernels_us(t_r)
                    d.check()
                    same = first is None or torch.equal(first, result)
                    first = result.clone() if first is None else first
                    rows.append(dict(shape=name, unroll=unroll, blocks_per_sm=per_sm,
                                     sm_budget=budget, dispatch_us=times[0], combine_us=times[1],
                                     round_trip_us=times[2], kernels_us=kernels, equal_to_first=bool(same)))
                    if rank == 0:
                        launch = f"budget {budget}" if budget else f"blocks/SM {per_sm}"
                        print(f"{name:14s} unroll {unroll} {launch}: "
                              f"dispatch {times[0]:7.1f} us  combine {times[1]:7.1f} us  "
                              f"round trip {times[2]:7.1f} us  equal {same}  kernels {kernels}", flush=True)
                    del d
                    torch.cuda.synchronize()
                    dist.barrier()
    if rank == 0 and args.out:
        write_json(args.out, "engine-budget.json" if args.sm_budget else "engine-tuning.json", rows)
    dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="deepseek-v3,mixtral-8x7b,decode")
    parser.add_argument("--blocks-per-sm", default="1,2,4")
    parser.add_argument("--sm-budget", default="",
                        help="blocks in all (DispatchConfig.sm_budget), instead of --blocks-per-sm")
    parser.add_argument("--unroll", default="4,8")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    args.shapes = args.shapes.split(",")
    if args.sm_budget:
        args.launches = [(nvlink.BLOCKS_PER_SM, int(v)) for v in args.sm_budget.split(",")]
    else:
        args.launches = [(int(v), None) for v in args.blocks_per_sm.split(",")]
    args.unroll = [int(v) for v in args.unroll.split(",")]
    world = torch.cuda.device_count()
    mp.spawn(_worker, args=(world, args, 29700 + os.getpid() % 1000), nprocs=world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
