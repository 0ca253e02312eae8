"""Where the all-gather and hierarchical variants should expand their routing rows on
CUDA: in torch operations on the device or on the host in the compiled CPU plan
(``plan_cpu.on_host``: the rows copied down, the results copied up in one
pinned buffer); ``counts.HOST_PLAN_ITEMS`` is set from it. One process, one device, no collectives:
the routing rows of W ranks of T tokens each are made up as an all-gather leaves
them (``counts.ROUTING``), and this rank's expansion (``counts.expand``) is timed
both ways, the two held equal bit for bit.

    python3 bench/host_plan_probe.py [--device cuda] [--tokens 128,1024,4096] [--worlds 2,4,8]
        [--experts 256] [--topk 8] [--iters 50] [--out FILE]

Per row: the median host time of one expansion, each taken up to its results
usable on the device (synchronized), and their ratio (host / device); below 1
the host plan is faster there. On CPU both ways run on the host (a check of the
script, no measure).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from dispatch import counts, plan
from dispatch.kernels import plan_cpu


def routing_rows(world: int, tokens: int, experts: int, topk: int, seed: int = 0) -> torch.Tensor:
    """[W T, 2 + 2K] routing rows of W ranks of T tokens, uniform routing."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(world * tokens, experts, generator=gen).argsort(1)[:, :topk]
    weights = torch.rand(world * tokens, topk, generator=gen, dtype=torch.float64)
    source = torch.stack([torch.arange(world).repeat_interleave(tokens), torch.arange(tokens).repeat(world)], 1)
    return torch.cat([source, ids, weights.view(torch.int64)], 1)


def timed(fn, iters: int, device: torch.device) -> float:
    """Median seconds of ``fn()`` up to its results usable on ``device``."""
    times = []
    for _ in range(iters + 5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[5:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", default="128,1024,4096")
    parser.add_argument("--worlds", default="2,4,8")
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if plan_cpu.module() is None:
        print(f"the compiled CPU plan does not build here: {plan_cpu.why_not()}", file=sys.stderr)
        return 1
    device = torch.device(args.device)
    lines = [f"expansion of the routing rows that reach rank 0 (E = {args.experts}, K = {args.topk}), on {device}: "
             f"median of {args.iters}, each synchronized",
             "| W | T / rank | rows here | device (torch ops) us | host (compiled, copies) us | host / device | same bits |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for world in map(int, args.worlds.split(",")):
        for tokens in map(int, args.tokens.split(",")):
            routing = routing_rows(world, tokens, args.experts, args.topk).to(device)
            route = plan.route_reference(routing[:, 2 : 2 + args.topk].cpu(), args.experts, world)
            num_rows = int(route.counts[0, 1:].sum())
            items_here = int(route.hit[:, 0].sum())
            shape = (args.topk, tokens, args.experts, world, 0, num_rows, min(args.topk, args.experts // world),
                     items_here)
            want = counts.expand_reference(routing, *shape)
            got = counts.Expansion(*plan_cpu.on_host("expand", routing, *shape))
            same = all(torch.equal(a.view(torch.int64), b.view(torch.int64))
                       for a, b in zip(want.__dict__.values(), got.__dict__.values()))
            on_device = timed(lambda: counts.expand_reference(routing, *shape), args.iters, device)
            host = timed(lambda: counts.Expansion(*plan_cpu.on_host("expand", routing, *shape)), args.iters, device)
            lines.append(f"| {world} | {tokens} | {num_rows} | {on_device * 1e6:.0f} | {host * 1e6:.0f} | "
                         f"{host / on_device:.2f} | {'yes' if same else 'NO'} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
