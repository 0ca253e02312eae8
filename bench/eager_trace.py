"""Study: where an eager round trip on the NVLink engine spends its time, rank by
rank, on one clock: the host's calls into the package (marked), its CUDA API
calls, and the GPU's kernels, for one round trip after a barrier.

    python3 bench/eager_trace.py [--shape decode] [--max-rows] [--world 2] [--out DIR]

Two processes (GPUs 0 and 1; ``--world 1``: one, the engine built directly, as
``bench/engine_one_gpu.py`` does), torch.profiler around three round trips each
after a barrier; prints the middle one's events per rank (start and duration in
us from the round trip's start), and writes each rank's chrome trace to --out.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import engine_probe  # noqa: E402  (the shapes, inputs and process setup of the probe)

import dispatch  # noqa: E402
from dispatch import agreement, checks, free_memory, nvlink  # noqa: E402
from dispatch import dispatcher as base  # noqa: E402
from dispatch.transports.nvlink import NVLinkTransport  # noqa: E402

MARKED = [  # (owner, method): host ranges named in the trace
    (base.TokenDispatcher, "dispatch"),
    (base.TokenDispatcher, "combine"),
    (NVLinkTransport, "plan"),
    (NVLinkTransport, "_plan_bounded"),
    (free_memory, "row_budgets"),
    (nvlink.Engine, "exchange_counts"),
    (nvlink.Engine, "to_experts"),
    (nvlink.Engine, "to_home"),
    (nvlink.Engine, "seen_failed"),
    (agreement.Calls, "agree"),
    (base, "dispatched"),  # the result (work.dispatched, as the dispatcher names it)
    (checks, "check_dispatch_inputs"),
    (free_memory, "free_bytes"),
]
API = ("cuLaunchKernelEx", "cudaMemcpyAsync", "cudaStreamSynchronize", "cudaEventSynchronize",
       "cudaDeviceSynchronize", "cudaMemGetInfo", "cudaStreamWaitEvent", "cudaLaunchKernel", "cudaMemsetAsync")


def _mark(owner, name):
    method = getattr(owner, name)

    @functools.wraps(method)
    def marked(*args, **kwargs):
        with torch.profiler.record_function(f"## {owner.__name__}.{name}"):
            return method(*args, **kwargs)

    setattr(owner, name, marked)


def _worker(rank, world, args, port):
    device = engine_probe.init_rank(rank, world, port)
    for owner, name in MARKED:
        _mark(owner, name)
    shape = engine_probe.SHAPES[args.shape]
    x, idx, w = engine_probe.inputs(shape, rank, device)
    config = dispatch.DispatchConfig.from_options(num_experts=shape[2], transport="nvlink", check_inputs=False)
    if world == 1:  # the registry refuses a group of one rank: built directly
        d = base.TokenDispatcher(config, None, NVLinkTransport(config, None))
    else:
        d = dispatch.create(config)
    bound = None
    if args.max_rows:
        bound = int(d.dispatch(x, idx, w).tokens.shape[0] * 1.1)

    def round_trip():
        with torch.profiler.record_function("## round trip"):
            o = d.dispatch(x, idx, w, max_rows=bound)
            return d.combine(o.tokens, o.handle, weights=o.weights)

    for _ in range(10):
        round_trip()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(3):
            dist.barrier()
            torch.cuda.synchronize()
            round_trip()
        torch.cuda.synchronize()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"eager-trace-rank{rank}.json")
    prof.export_chrome_trace(path)
    dist.barrier()
    if rank == 0:
        for r in range(world):
            print(_summary(os.path.join(args.out, f"eager-trace-rank{r}.json"), r), flush=True)
    dist.destroy_process_group()


def _summary(path: str, rank: int) -> str:
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    trips = sorted((e for e in events if e["name"] == "## round trip"), key=lambda e: e["ts"])
    trip = trips[len(trips) // 2]
    start = trip["ts"]
    end = start + trip["dur"]
    picked = []
    for e in events:
        cat, name = e.get("cat", ""), e["name"]
        on_gpu = cat in ("kernel", "gpu_memcpy", "gpu_memset")
        marked = name.startswith("## ") and cat != "gpu_user_annotation"  # the host's range, not its GPU shadow
        keep = marked or on_gpu or (cat in ("cuda_runtime", "cuda_driver") and name in API)
        if keep and start - 50 <= e["ts"] <= end + 300:  # the round trip and its GPU tail
            picked.append(e)
    lines = [f"rank {rank}: round trip on the host {trip['dur']:.1f} us"]
    gpu_end = max((e["ts"] + e["dur"] for e in picked if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                  default=start)
    lines.append(f"  last GPU work ends at {gpu_end - start:.1f} us")
    for e in sorted(picked, key=lambda e: e["ts"]):
        where = "GPU " if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") else "host"
        lines.append(f"  {where} {e['ts'] - start:9.1f} +{e['dur']:8.1f}  {e['name'][:90]}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="decode", choices=sorted(engine_probe.SHAPES))
    parser.add_argument("--max-rows", action="store_true", help="dispatch with max_rows (no host read)")
    parser.add_argument("--world", type=int, default=2, choices=(1, 2), help="processes (GPUs)")
    parser.add_argument("--out", default="eager-trace")
    args = parser.parse_args(argv)
    world = args.world
    mp.spawn(_worker, args=(world, args, 29700 + os.getpid() % 1000), nprocs=world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
