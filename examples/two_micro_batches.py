"""Two micro-batches in flight on one dispatcher, with the async verbs, on gloo ranks.

    python3 examples/two_micro_batches.py [--ranks 2]

Micro-batch 1's dispatch starts before 0's experts run, and 0's combine before
1's experts run: on GPUs the exchanges run on the dispatcher's communication
stream beside the experts (on CPU, as collectives left in flight). The results
must equal the same round trips made one at a time, bitwise, gradients included;
and so must ``dispatch.MoEMicroBatches``, the same schedule as a layer (its
backward on a schedule of its own).
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import dispatch

E, K, T, H = 8, 2, 16, 32  # experts, experts per token, tokens per rank, hidden size


class Experts(nn.Module):
    """Local expert e multiplies its rows by scale[e]."""

    def __init__(self, count: int, gen: torch.Generator) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(count, generator=gen))

    def forward(self, tokens, tokens_per_expert):
        return tokens * self.scale.repeat_interleave(tokens_per_expert).unsqueeze(1)


def run(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    d = dispatch.create(dispatch.DispatchConfig(num_experts=E))
    gen = torch.Generator().manual_seed(rank)
    experts = Experts(E // world, gen)
    batches = [(torch.randn(T, H, generator=gen, requires_grad=True),
                torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]),
                torch.rand(T, K, generator=gen)) for _ in range(2)]  # (x, topk_idx, topk_weights) each
    w0 = d.dispatch(*batches[0], async_op=True)  # both micro-batches on the wire
    w1 = d.dispatch(*batches[1], async_op=True)
    o0 = w0.wait()  # [N, H] rows of micro-batch 0 for this rank's experts
    c0 = d.combine(experts(o0.tokens, o0.tokens_per_expert), o0.handle, weights=o0.weights,
                   async_op=True)  # 0 goes home ...
    o1 = w1.wait()
    c1 = d.combine(experts(o1.tokens, o1.tokens_per_expert), o1.handle, weights=o1.weights,
                   async_op=True)  # ... while 1 computes
    overlapped = [c0.wait(), c1.wait()]  # the caller's stream waits for each
    results = {"two micro-batches in flight": _with_grads(overlapped, batches, experts)}

    one_by_one = []  # the same, one call at a time
    for x, idx, w in batches:
        out = d.dispatch(x, idx, w)
        one_by_one.append(d.combine(experts(out.tokens, out.tokens_per_expert), out.handle, weights=out.weights))
    results["one at a time"] = _with_grads(one_by_one, batches, experts)

    layer = dispatch.MoEMicroBatches(d, experts)  # the schedule as a layer
    results["MoEMicroBatches"] = _with_grads(layer(*(list(b) for b in zip(*batches))), batches, experts)
    want = results["one at a time"]
    for name, got in results.items():
        if not all(torch.equal(a, b) for a, b in zip(got, want)):
            raise SystemExit(f"rank {rank}: {name} differ from one at a time")
    dist.barrier()
    if rank == 0:
        print(f"{world} ranks: two micro-batches in flight equal one at a time, gradients included; "
              "so does MoEMicroBatches", flush=True)
    dist.destroy_process_group()


def _with_grads(outs, batches, experts) -> list:
    """The outputs, then the gradients of every x and of the experts' scales
    (backward from the outputs' sum), each taken afresh."""
    for t in (*(b[0] for b in batches), experts.scale):
        t.grad = None
    sum(h.sum() for h in outs).backward()
    return [h.detach() for h in outs] + [b[0].grad for b in batches] + [experts.scale.grad]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="gloo processes to start (they must divide E = 8)")
    args = parser.parse_args()
    if args.ranks < 1 or E % args.ranks:
        parser.error(f"--ranks must divide the {E} experts, got {args.ranks}")
    with socket.socket() as s:  # a free port for the ranks to meet on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(args.ranks, port), nprocs=args.ranks)


if __name__ == "__main__":
    main()
