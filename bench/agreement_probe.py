"""Study: what a call's agreement costs on the host, against the collectives it could ride on.

Per call, on a group of every local GPU (one process each), back to back after a
warm-up: the dispatcher's agreement on the board (``agreement.Calls.agree``,
shared memory; compiled, ``csrc/host.cpp``'s ``board_agree``, and in Python), the same row all-gathered over a gloo group (the host channel
off one host), and over NCCL with the host reading it back (what an agreement
on the GPU's side costs when the GPU is idle: with the engine's kernels holding
the SMs it waits for them). Medians of rank 0's host time.

Usage: python3 bench/agreement_probe.py [--calls 300]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, calls: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    sys.path.insert(0, os.getcwd())
    import dispatch

    d = dispatch.create(dispatch.DispatchConfig(num_experts=16 * world, transport="nccl"))
    gloo = dist.new_group(list(range(world)), backend="gloo")
    row, out = torch.zeros(300, dtype=torch.int64), torch.empty(world * 300, dtype=torch.int64)
    row_gpu, out_gpu = row.cuda(), out.cuda()

    board = d._calls._board  # None where the ranks cannot share one (no shared memory): its steps are left out
    compiled = None if board is None else board._compiled  # the compiled agreement (a process with CUDA, built)

    def on_board(agreement):
        def step():
            board._compiled = agreement
            d._calls.agree(d._calls.ticket("combine"))
        return step

    def gloo_all_gather():
        dist.all_gather_into_tensor(out, row, group=gloo)

    def nccl_all_gather_read():
        dist.all_gather_into_tensor(out_gpu, row_gpu)
        out_gpu.tolist()

    steps = [("board, compiled", on_board(compiled)), ("board, in Python", on_board(None)),
             ("gloo all-gather", gloo_all_gather), ("nccl all-gather + host read", nccl_all_gather_read)]
    for name, step in steps[(0 if compiled is not None else 1) if board is not None else 2:]:
        for _ in range(50):
            step()
        dist.barrier()
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e6)
        if rank == 0:
            print(f"{name:28s} median {statistics.median(times):7.1f} us  min {min(times):7.1f}  "
                  f"p90 {sorted(times)[int(0.9 * calls)]:7.1f}", flush=True)
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args(argv)
    world = torch.cuda.device_count()
    if world < 2:
        print("agreement_probe: needs 2 GPUs or more", file=sys.stderr)
        return 2
    mp.spawn(_worker, args=(world, args.calls), nprocs=world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
