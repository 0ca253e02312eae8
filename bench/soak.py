"""Soak: many round trips on one dispatcher per transport, the shapes, routings
and wires changing every call, every row checked by its identity.

    python3 bench/soak.py --calls 10000 --out bench/results/nvidia-h100-x2   # every GPU, both transports
    python3 bench/soak.py --calls 40 --world-size 2                            # CPU (gloo), NCCL transport

Each call draws, from a seed every rank shares: T per rank (0 to ``--max-tokens``,
a rank may have none), the routing (uniform, Zipf-skewed, every token to one
rank's experts) and the dispatch wire (native or fp8). Token rows carry their
identity (source rank, token index, and small integers exact in bf16), so a row
sent to the wrong place shows as a wrong value. Checked on every call: each
dispatched row against the row of its (source rank, source token), the row
counts per expert against the routing, and the combined output (experts that
scale a row by 1 + its local expert) against a float64 sum on the home rank.
Reported per transport: calls, rows checked, wrong rows, memory allocated after
the warm-up and at the end (CUDA), the slowest call.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's dispatch

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import dispatch  # noqa: E402
from dispatch import cuda  # noqa: E402
from dispatch.bench import common  # noqa: E402

ROUTINGS = ("uniform", "zipf", "one-rank")
TRANSPORTS = ("nccl", "nvlink", "nvlink-bounded")
WIRES = ("native", "fp8")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/soak.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000, help="round trips per transport (default 1000)")
    parser.add_argument("--max-tokens", type=int, help="largest T per rank (default 8192 on GPUs, 64 on CPU)")
    parser.add_argument("--hidden", type=int, help="H (default 1024 on GPUs, 128 on CPU)")
    parser.add_argument("--experts-per-rank", type=int, default=8, help="E_local (default 8)")
    parser.add_argument("--topk", type=int, default=4, help="K (default 4)")
    parser.add_argument("--transports", help="comma list of nccl, nvlink, nvlink-bounded (the engine with "
                        "max_rows: no host read) (default: all three where the engine runs)")
    parser.add_argument("--world-size", type=int, help="ranks (default: every GPU, or 2 CPU processes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="soak-results", help="folder for soak-w<W>.json and .md")
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available()
    args.max_tokens = args.max_tokens if args.max_tokens is not None else (8192 if gpu else 64)
    args.hidden = args.hidden if args.hidden is not None else (1024 if gpu else 128)
    if args.transports is None:
        args.transports = "nccl,nvlink,nvlink-bounded" if gpu and cuda.available() else "nccl"
    args.transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    bad = [t for t in args.transports if t not in TRANSPORTS]
    if bad or not args.transports:
        parser.error(f"--transports: {', '.join(bad) or 'nothing given'} not among {', '.join(TRANSPORTS)}")
    for name in ("calls", "max_tokens", "hidden", "experts_per_rank", "topk"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.topk > args.experts_per_rank:
        parser.error("--topk must be at most --experts-per-rank (every routing must fit one rank's experts)")
    if args.hidden % 8:
        parser.error("--hidden must be a multiple of 8")
    return args


def identity_rows(rank: int, tokens: int, hidden: int, call: int, device) -> torch.Tensor:
    """[T, H] bf16 rows naming themselves: (rank, t % 256, t // 256, call % 256, then
    small integers that depend on all of them), every value exact in bf16."""
    t = torch.arange(tokens, device=device).unsqueeze(1)
    j = torch.arange(hidden, device=device).unsqueeze(0)
    rows = (t * 7 + j * 3 + rank * 5 + call) % 17 - 8
    rows[:, 0:1] = rank
    if hidden > 1:
        rows[:, 1:2] = t % 256
    if hidden > 2:
        rows[:, 2:3] = t // 256
    if hidden > 3:
        rows[:, 3:4] = call % 256
    return rows.to(torch.bfloat16)


def draw(call: int, args, world: int) -> dict:
    """The call's shapes, routing and wire: the same on every rank (a shared seed)."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + call)
    tokens = torch.randint(0, args.max_tokens + 1, (world,), generator=gen).tolist()
    if int(torch.randint(0, 8, (1,), generator=gen)) == 0:
        tokens[int(torch.randint(0, world, (1,), generator=gen))] = 0  # a rank with nothing, now and then
    routing = ROUTINGS[int(torch.randint(0, len(ROUTINGS), (1,), generator=gen))]
    wire = WIRES[int(torch.randint(0, len(WIRES), (1,), generator=gen))]
    target = int(torch.randint(0, world, (1,), generator=gen))
    return {"tokens": tokens, "routing": routing, "wire": wire, "target": target}


def routing_of(plan: dict, rank: int, call: int, args, world: int, device):
    """[T, K] int64 distinct experts and [T, K] float32 weights of this rank."""
    gen = torch.Generator(device=device).manual_seed(args.seed * 7919 + call * 131 + rank)
    tokens, experts = plan["tokens"][rank], world * args.experts_per_rank
    if plan["routing"] == "uniform":
        scores = torch.rand(tokens, experts, generator=gen, device=device)
    elif plan["routing"] == "zipf":
        popularity = (torch.arange(experts, device=device, dtype=torch.float64) + 1).pow(-1.2)
        uniform = torch.rand(tokens, experts, generator=gen, device=device, dtype=torch.float64)
        scores = popularity.log() - torch.log(-torch.log(uniform))
    else:
        scores = torch.full((tokens, experts), -1.0, device=device)
        first = plan["target"] * args.experts_per_rank
        scores[:, first : first + args.experts_per_rank] = torch.rand(
            tokens, args.experts_per_rank, generator=gen, device=device)
    topk_idx = scores.topk(args.topk, dim=1).indices
    weights = torch.softmax(torch.rand(tokens, args.topk, generator=gen, device=device), dim=1)
    return topk_idx, weights


def check_call(d, plan: dict, call: int, args, world: int, rank: int, device,
               bounded: bool = False) -> tuple[int, int]:
    """One round trip, checked; (rows checked, wrong rows) on this rank. With
    ``bounded``, the dispatch takes max_rows (every row the call could send here)
    and the rows past the N received must be zero rows from source -1."""
    x = identity_rows(rank, plan["tokens"][rank], args.hidden, call, device)
    topk_idx, weights = routing_of(plan, rank, call, args, world, device)
    bound = sum(plan["tokens"]) * min(args.topk, args.experts_per_rank) if bounded else None
    out = d.dispatch(x, topk_idx, weights, max_rows=bound)
    local = torch.repeat_interleave(torch.arange(args.experts_per_rank, device=device),
                                    out.tokens_per_expert.to(device))
    n = local.shape[0]
    scale = torch.zeros(out.tokens.shape[0], dtype=out.tokens.dtype, device=device)
    scale[:n] = (1 + local).to(out.tokens.dtype)
    combined = d.combine(out.tokens * scale.unsqueeze(1), out.handle, weights=out.weights)

    wrong = 0
    if bounded:  # the rows past N: zero, weight 0, from nowhere
        wrong += int(((out.tokens[n:] != 0).any(1) | (out.weights[n:] != 0) | (out.src_rank[n:] != -1)
                      | (out.src_token[n:] != -1)).sum())
        out = dataclasses.replace(out, tokens=out.tokens[:n], src_rank=out.src_rank[:n],
                                  src_token=out.src_token[:n])
    # every dispatched row is the row of its (source rank, source token)
    want = torch.empty_like(out.tokens)
    for source in range(world):
        mine = out.src_rank == source
        if bool(mine.any()):
            rows = identity_rows(source, plan["tokens"][source], args.hidden, call, device)
            want[mine] = rows[out.src_token[mine]]
    if plan["wire"] == "native":
        bad = (out.tokens != want).any(1)
        bad |= out.tokens[:, 0].float() != out.src_rank.float()  # the rank it names
    else:  # e4m3: within 2^-4 of its 128-channel block's largest magnitude (here 255 at most)
        bad = ((out.tokens.float() - want.float()).abs() > 255 / 16 + 1e-3).any(1)
    wrong += int(bad.sum())
    # rows per local expert: what the routing sends here
    counts = torch.zeros(args.experts_per_rank, dtype=torch.int64, device=device)
    for source in range(world):
        idx, _ = routing_of(plan, source, call, args, world, device)
        here = idx[(idx // args.experts_per_rank) == rank] % args.experts_per_rank
        counts += torch.bincount(here, minlength=args.experts_per_rank)
    wrong += int((counts != out.tokens_per_expert.to(device)).sum())
    # the combined rows: sum over slots of w * (1 + local expert) * x, in float64
    scale = 1 + (topk_idx % args.experts_per_rank).double()
    expected = (x.double().unsqueeze(1) * (weights.double() * scale).unsqueeze(2)).sum(1)
    if plan["wire"] == "native":
        tolerance = 2e-2 * expected.abs() + 1e-2
    else:
        tolerance = 2e-2 * expected.abs() + (weights.double() * scale).sum(1, keepdim=True) * (255 / 16) + 1e-2
    wrong += int(((combined.double() - expected).abs() > tolerance).any(1).sum())
    return out.tokens.shape[0] + combined.shape[0], wrong


def soak(transport: str, args, device) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    bounded = transport == "nvlink-bounded"
    configs = {wire: dispatch.DispatchConfig.from_options(num_experts=world * args.experts_per_rank,
                                             transport="nvlink" if bounded else transport, dispatch_wire=wire,
                                             timeout=30.0 if bounded else 60.0) for wire in WIRES}
    dispatchers = {wire: dispatch.create(cfg) for wire, cfg in configs.items()}
    if bounded:  # the first dispatch with max_rows sizes the buffers: give it the largest T
        x = torch.zeros(args.max_tokens, args.hidden, dtype=torch.bfloat16, device=device)
        idx = torch.arange(args.topk, device=device).expand(args.max_tokens, -1).contiguous()
        for d in dispatchers.values():
            d.dispatch(x, idx, torch.ones(idx.shape, device=device), max_rows=world * args.max_tokens * args.topk)
    warmup = min(10, args.calls)
    checked = wrong = 0
    slowest = 0.0
    memory = {}
    for call in range(args.calls):
        if call == warmup and device.type == "cuda":
            torch.cuda.synchronize()
            memory["after_warmup_mib"] = torch.cuda.memory_allocated() / 2**20
        plan = draw(call, args, world)
        start = time.perf_counter()
        rows, bad = check_call(dispatchers[plan["wire"]], plan, call, args, world, rank, device, bounded)
        if device.type == "cuda":
            torch.cuda.synchronize()
        slowest = max(slowest, time.perf_counter() - start)
        checked, wrong = checked + rows, wrong + bad
    if device.type == "cuda":
        torch.cuda.synchronize()
        memory["end_mib"] = torch.cuda.memory_allocated() / 2**20
    for d in dispatchers.values():
        d.check()  # what a dispatch with no host read recorded
    totals = torch.tensor([checked, wrong], dtype=torch.int64, device=device)
    dist.all_reduce(totals)
    worst = torch.tensor([slowest], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    checked, wrong = totals.tolist()  # host sync: the totals, once, after the soak
    return {"transport": transport, "calls": args.calls, "rows_checked": checked, "wrong_rows": wrong,
            "slowest_call_ms": float(worst) * 1e3, **memory}


def report(rows: list[dict], args, world: int) -> str:
    columns = [("transport", "", 10), ("calls", "", 8), ("rows checked", "", 13), ("wrong rows", "", 11),
               ("memory after warm-up", "(MiB)", 21), ("memory at end", "(MiB)", 14), ("slowest call", "(ms)", 13)]

    def mib(value):
        return "-" if value is None else f"{value:.1f}"

    body = [[r["transport"], str(r["calls"]), str(r["rows_checked"]), str(r["wrong_rows"]),
             mib(r.get("after_warmup_mib")), mib(r.get("end_mib")), f"{r['slowest_call_ms']:.1f}"] for r in rows]
    table = common.fixed_width(columns, body)
    print(table, flush=True)
    os.makedirs(args.out, exist_ok=True)
    settings = {k: getattr(args, k) for k in ("calls", "max_tokens", "hidden", "experts_per_rank", "topk", "seed")}
    with open(os.path.join(args.out, f"soak-w{world}.json"), "w") as f:
        json.dump({"environment": common.environment(), "settings": settings, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, f"soak-w{world}.md"), "w") as f:
        f.write(f"# soak, W={world}\n\nsettings: {settings}\n\n```\n{table}\n```\n")
    return table


def _job(args) -> None:
    device = common.device()
    rows = [soak(transport, args, device) for transport in args.transports]
    if dist.get_rank() == 0:
        report(rows, args, dist.get_world_size())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return common.launch(_job, args, args.world_size, cpu_default=2)


if __name__ == "__main__":
    sys.exit(main())
