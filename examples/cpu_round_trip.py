"""A dispatch and combine on a CPU world of gloo ranks, checked against the dense answer.

    python3 examples/cpu_round_trip.py [--ranks 4]

Every rank holds E / W experts: global expert e lives on rank e // (E // W), as
its local expert e % (E // W). Each rank routes its tokens to K experts,
dispatches them, runs its local experts on the rows it received (expert e
multiplies its rows by e + 1) and combines the outputs home, weighted. Every
rank then checks its tokens against the dense answer, computed without any
communication: sum over a token's slots of weight * (e + 1) * x.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dispatch

E, K, T, H = 8, 2, 16, 32  # experts, experts per token, tokens per rank, hidden size


def run(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    d = dispatch.create(dispatch.DispatchConfig(num_experts=E))

    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=gen, dtype=torch.float64)
    topk_idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])  # [T, K] global ids
    topk_weights = torch.softmax(torch.randn(T, K, generator=gen, dtype=torch.float64), dim=1)

    out = d.dispatch(x, topk_idx, topk_weights)
    # out.tokens [N, H]: the rows for this rank's experts, grouped by local expert;
    # out.tokens_per_expert [E // W]: how many rows each local expert got
    local = E // world
    first = rank * local  # global id of local expert 0
    expert = first + torch.repeat_interleave(torch.arange(local), out.tokens_per_expert)  # [N] global ids
    y = out.tokens * (expert + 1).unsqueeze(1)  # the experts
    home = d.combine(y, out.handle, weights=out.weights)  # [T, H], weighted sum of each token's slots

    dense = (topk_weights * (topk_idx + 1)).sum(1, keepdim=True) * x
    if not torch.allclose(home, dense, rtol=1e-12, atol=1e-12):
        raise SystemExit(f"rank {rank}: the round trip differs from the dense answer by "
                         f"{(home - dense).abs().max().item():.3g}")
    dist.barrier()
    if rank == 0:
        print(f"{world} ranks: every token's round trip equals the dense answer", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4, help="gloo processes to start (E = 8 must split over them)")
    args = parser.parse_args()
    if args.ranks < 1 or E % args.ranks:
        parser.error(f"--ranks must divide the {E} experts, got {args.ranks}")
    with socket.socket() as s:  # a free port for the ranks to meet on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(args.ranks, port), nprocs=args.ranks)


if __name__ == "__main__":
    main()
