"""Study: the most that any overlap schedule can hide on this machine. The experts'
GEMMs and an exchange are launched together on two streams, with no host in
between, and timed against each alone.

    python3 bench/concurrency_probe.py [--shapes deepseek-v3,mixtral-8x7b] [--out DIR]

One process per local GPU (NCCL). For each model shape (``dispatch.bench.common``'s
shapes) and pass (forward; forward+backward):

    A       the experts alone (GroupedExperts on the rows one dispatch delivers,
            forward or forward+backward), captured in a CUDA graph; optionally
            with SMs carved out of its GEMMs (``--carveouts``)
    B       an exchange alone: the NVLink engine's round trip (dispatch and
            combine with ``max_rows``, captured in a CUDA graph) at its default
            launch and at each ``--sm-budgets``; or an NCCL all-to-all of the
            same rows there and back (eager, one collective each way), with
            NCCL's own CTA count or 2 CTAs (a slow link's stand-in, as
            ``dispatch-bench overlap --comm-max-ctas 2``). Forward+backward
            takes two of them (the backward moves the gradients both ways too).
    A + B   both queued at once, A on one stream and B on a high-priority one
    ceiling (T_A + T_B - T_{A+B}) / min(T_A, T_B): the share of the shorter
            one that running them side by side saved. A pipeline by groups of
            experts can hide no more than this, and usually less, since it also
            waits for its first piece and its last.

Times are the median of ``--iters`` runs, each the slowest rank's, each after a
barrier (``dispatch.bench.common.time_each``), after ``--warmup`` runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dispatch
from dispatch.bench import common
from dispatch.experts import GroupedExperts

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_probe import init_rank, inputs, write_json  # noqa: E402


def _graph(step):
    """``step()`` run twice eagerly, then captured in a CUDA graph; returns its replay."""
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def _experts_pass(experts, rows, counts, backward: bool):
    """The experts' forward (and backward) on ``rows``."""
    grad = torch.ones(rows.shape[0], experts.hidden, device=rows.device, dtype=rows.dtype)

    def run():
        leaf = rows.detach().requires_grad_(backward)
        y = experts(leaf, counts)
        if backward:
            y.backward(grad)
            experts.zero_grad(set_to_none=True)  # each pass makes its gradients, none accumulated

    return run


def _a2a(rows_to, group, hidden, device):
    """An NCCL all-to-all there and back of ``rows_to[r]`` rows [H] bf16 to each rank r
    over ``group`` (what a dispatch and its combine move, rows once per rank)."""
    send = torch.tensor(rows_to, device=device)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    rows_from = recv.tolist()  # host sync: the split sizes, once at setup
    out = torch.randn(sum(rows_to), hidden, device=device).to(torch.bfloat16)
    back = torch.empty(sum(rows_from), hidden, device=device, dtype=torch.bfloat16)

    def run():
        dist.all_to_all_single(back, out, rows_from, rows_to, group=group)
        dist.all_to_all_single(out, back, rows_to, rows_from, group=group)

    return run


def _repeat(step, times: int):
    def run():
        for _ in range(times):
            step()

    return run


def _together(a, b, side: torch.cuda.Stream, high: torch.cuda.Stream):
    """``a`` on ``side`` and ``b`` on ``high`` at once, both ordered after the
    caller's stream's work so far and before its later work."""
    def run():
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        high.wait_stream(main)
        with torch.cuda.stream(side):
            a()
        with torch.cuda.stream(high):
            b()
        main.wait_stream(side)
        main.wait_stream(high)

    return run


def _median_ms(step, args, device) -> float:
    """Median milliseconds of ``step()`` over ``args.iters`` runs, each the slowest rank's."""
    return statistics.median(run["step"] for run in common.time_each({"step": step}, args.iters, args.warmup, device))


def _worker(rank, world, args, port):
    device = init_rank(rank, world, port)
    side = torch.cuda.Stream()
    high = torch.cuda.Stream(priority=-1)
    slow_group = common.new_group_with_sm_budget(None, 2, high_priority=True)
    rows_out = []
    for name in args.shapes:
        shape = common.SHAPES[name]
        if args.experts is not None:
            shape = replace(shape, name=f"{name}-e{args.experts}", experts=args.experts)
        x, idx, w = inputs((shape.tokens, shape.hidden, shape.experts, shape.topk), rank, device)
        exchanges = {}  # label: (one exchange, what its replay reads kept alive)
        for budget in [None] + args.sm_budgets:
            config = dispatch.DispatchConfig.from_options(num_experts=shape.experts, transport="nvlink", sm_budget=budget,
                                             check_inputs=False)
            d = dispatch.create(config)
            out = d.dispatch(x, idx, w)
            bound = int(out.tokens.shape[0] * common.GRAPH_SLACK)
            replays, _ = common.captured_round_trip(d, x, idx, w, bound)
            exchanges["nvlink" if budget is None else f"nvlink-{budget}sm"] = (replays["total"], d)
        local = shape.experts // world
        rows_to = [int(((idx // local) == r).any(1).sum()) for r in range(world)]
        exchanges["nccl"] = (_a2a(rows_to, dist.group.WORLD, shape.hidden, device), None)
        exchanges["nccl-2cta"] = (_a2a(rows_to, slow_group, shape.hidden, device), None)
        nccl = dispatch.create(dispatch.DispatchConfig.from_options(num_experts=shape.experts, transport="nccl",
                                                       check_inputs=False))
        planned = nccl.dispatch(x, idx, w)
        experts = GroupedExperts(local, shape.hidden, shape.ffn, dtype=torch.bfloat16, device=device)
        for backward in (False, True):
            passes = 2 if backward else 1
            for carve in [None] + args.carveouts:
                before = torch._C._get_sm_carveout_experimental()
                if carve is not None:
                    torch._C._set_sm_carveout_experimental(carve)
                try:
                    compute = _graph(_experts_pass(experts, planned.tokens, planned.tokens_per_expert, backward))
                finally:
                    torch._C._set_sm_carveout_experimental(before)
                t_a = _median_ms(compute, args, device)
                for label, (exchange, _) in exchanges.items():
                    if carve is not None and label not in args.carveout_with:
                        continue
                    b = _repeat(exchange, passes)
                    t_b = _median_ms(b, args, device)
                    t_ab = _median_ms(_together(compute, b, side, high), args, device)
                    ceiling = (t_a + t_b - t_ab) / min(t_a, t_b)
                    row = dict(shape=shape.name, passes="fwd+bwd" if backward else "fwd", exchange=label,
                               gemm_carveout=carve, experts_ms=t_a, exchange_ms=t_b, together_ms=t_ab,
                               sequential_ms=t_a + t_b, ceiling=ceiling)
                    rows_out.append(row)
                    if rank == 0:
                        print(f"{shape.name:16s} {row['passes']:7s} carveout {str(carve):4s} {label:12s} "
                              f"experts {t_a:7.3f} ms  exchange {t_b:7.3f} ms  "
                              f"together {t_ab:7.3f} ms (one after the other {t_a + t_b:7.3f})  "
                              f"ceiling {ceiling:5.2f}", flush=True)
        del exchanges, experts, planned
        torch.cuda.empty_cache()
    if rank == 0 and args.out:
        write_json(args.out, "concurrency-probe" + ("" if args.experts is None else f"-e{args.experts}") + ".json",
                   rows_out)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="deepseek-v3,mixtral-8x7b")
    parser.add_argument("--sm-budgets", default="24,48", help="the engine's sm_budget values beside its default")
    parser.add_argument("--carveouts", default="24", help="SMs carved out of the experts' GEMMs, beside none")
    parser.add_argument("--carveout-with", default="nvlink-24sm,nccl-2cta",
                        help="the exchanges measured beside the carved-out GEMMs")
    parser.add_argument("--experts", type=int,
                        help="E for every shape (e.g. 16: the Megatron timing layer's, 4,096 rows an expert)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    args.shapes = args.shapes.split(",")
    args.sm_budgets = [int(v) for v in args.sm_budgets.split(",") if v]
    args.carveouts = [int(v) for v in args.carveouts.split(",") if v]
    args.carveout_with = [v for v in args.carveout_with.split(",") if v]
    world = torch.cuda.device_count()
    if world < 2:
        print("concurrency_probe: needs 2 or more GPUs", file=sys.stderr)
        return 2
    if args.experts is not None and (args.experts < world or args.experts % world):
        parser.error(f"--experts must be a multiple of the {world} GPUs, got {args.experts}")
    mp.spawn(_worker, args=(world, args, 29700 + os.getpid() % 1000), nprocs=world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
