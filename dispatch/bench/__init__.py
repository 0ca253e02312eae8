"""``dispatch-bench``: time a dispatch + combine round trip, phase by phase.

Runs on every local GPU with NCCL (starting one process per GPU, or under
torchrun), or on a CPU world of gloo processes with a small shape when there is
no GPU. Each round trip is checked (identity experts: the result must be
``x * sum(weights)``) and wrong rows are counted in ``#wrong``. Megatron-Core's
dispatchers run in the same processes and table when megatron-core imports.

    dispatch-bench                       # default shape for the hardware
    dispatch-bench --shape deepseek-v3 --iters 30 --out results/
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

import dispatch
from dispatch.timing import PhaseTimer


@dataclass(frozen=True)
class Shape:
    """T tokens per rank, hidden H, E experts, top-K."""

    name: str
    tokens: int
    hidden: int
    experts: int
    topk: int


SHAPES = {
    s.name: s
    for s in [
        Shape("deepseek-v3", 4096, 7168, 256, 8),
        Shape("qwen3-235b", 4096, 4096, 128, 8),
        Shape("mixtral-8x7b", 8192, 4096, 8, 2),
        Shape("decode", 128, 7168, 256, 8),
        Shape("cpu-small", 512, 256, 16, 4),
    ]
}
PHASES = ("plan", "exchange_out", "expand", "presum", "exchange_back", "final_sum")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dispatch-bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), help="model shape (default: deepseek-v3 on GPUs, cpu-small on CPU)")
    parser.add_argument("--world-size", type=int, help="ranks to start (default: all GPUs, or 4 CPU processes)")
    parser.add_argument("--iters", type=int, default=20, help="timed round trips (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed round trips first (default 5)")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="token dtype (default bf16)")
    parser.add_argument("--no-check", action="store_true", help="DispatchConfig(check_inputs=False)")
    parser.add_argument("--baselines", choices=["auto", "none"], default="auto",
                        help="auto: Megatron-Core's dispatchers too when megatron-core imports")
    parser.add_argument("--profile", action="store_true", help="also write a torch profiler table of 5 round trips")
    parser.add_argument("--out", default="dispatch-results", help="folder for JSON and markdown results")
    args = parser.parse_args(argv)
    for name in ("iters", "world_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    use_cuda = torch.cuda.is_available()
    if args.shape is None:
        args.shape = "deepseek-v3" if use_cuda else "cpu-small"
    if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        _run_rank(int(os.environ["LOCAL_RANK"]), args, None)
        return 0
    world = args.world_size or (torch.cuda.device_count() if use_cuda else 4)
    if use_cuda and world > torch.cuda.device_count():
        print(f"dispatch-bench: --world-size {world} but only {torch.cuda.device_count()} GPUs", file=sys.stderr)
        return 2
    shape = SHAPES[args.shape]
    if shape.experts % world:
        print(f"dispatch-bench: {shape.experts} experts do not split over {world} ranks", file=sys.stderr)
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world)}
    torch.multiprocessing.spawn(_run_rank, args=(args, env), nprocs=world, join=True)
    return 0


def _run_rank(rank: int, args: argparse.Namespace, env: dict | None) -> None:
    if env is not None:
        os.environ.update(env)
        os.environ["RANK"] = str(rank)
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=300))
    try:
        rows = run_benchmark(args)
        if dist.get_rank() == 0:
            report(rows, args)
    finally:
        dist.destroy_process_group()


def uniform_routing(shape: Shape, rank: int, device, seed: int = 0):
    """[T, K] distinct uniformly random experts and softmax weights, per rank."""
    gen = torch.Generator(device=device).manual_seed(seed * 7919 + rank)
    scores = torch.rand(shape.tokens, shape.experts, generator=gen, device=device)
    topk_idx = scores.topk(shape.topk, dim=1).indices
    topk_weights = torch.softmax(torch.rand(shape.tokens, shape.topk, generator=gen, device=device), dim=1)
    return topk_idx, topk_weights


def _time(fn, iters: int, warmup: int, device) -> list[float]:
    """Per-iteration wall time (ms) of ``fn``, the slowest rank's, after a barrier each time."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        timer = PhaseTimer(device)
        timer.start()
        fn()
        timer.mark("total")
        times.append(timer.phases()["total"])
    worst = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.tolist()


def _wrong_rows(out: torch.Tensor, x: torch.Tensor, topk_weights: torch.Tensor) -> int:
    """Rows of combine(dispatch(x)) (identity experts) that are not x * sum(w)."""
    expected = x.double() * topk_weights.double().sum(1, keepdim=True)
    tol = 1e-2 if x.dtype == torch.bfloat16 else 1e-5
    bad = ((out.double() - expected).abs() > tol * (1 + expected.abs())).any(1)
    count = torch.tensor([int(bad.sum())], device=x.device)
    dist.all_reduce(count)
    return int(count)


def run_benchmark(args: argparse.Namespace) -> list[dict]:
    shape = SHAPES[args.shape]
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    world, rank = dist.get_world_size(), dist.get_rank()
    x = torch.randn(shape.tokens, shape.hidden, device=device).to(dtype)
    topk_idx, topk_weights = uniform_routing(shape, rank, device)
    rows = []

    config = dispatch.DispatchConfig(num_experts=shape.experts, check_inputs=not args.no_check)
    d = dispatch.create(config)

    def ours():
        out = d.dispatch(x, topk_idx, topk_weights)
        return d.combine(out.tokens, out.handle, weights=out.weights), out

    combined, out = ours()
    wrong = _wrong_rows(combined, x, topk_weights)
    remote_rows = sum(n for r, n in enumerate(out.handle.send_splits) if r != rank)
    bytes_out = torch.tensor([remote_rows * shape.hidden * x.element_size()], dtype=torch.float64, device=device)
    dist.all_reduce(bytes_out)
    phase_runs = []

    def ours_timed():
        timer = PhaseTimer(device)
        d.phase_timer = timer
        timer.start()
        ours()
        d.phase_timer = None
        phase_runs.append(timer)

    totals = _time(ours_timed, args.iters, args.warmup, device)
    phases = {p: statistics.median(t.phases().get(p, 0.0) for t in phase_runs[args.warmup:]) for p in PHASES}
    rows.append(_row("ours alltoall", shape, world, totals, wrong, float(bytes_out) / world, phases))
    if args.profile:
        _profile(ours, args, shape, device)

    if args.baselines == "auto":
        rows += _megatron_rows(args, shape, x, topk_idx, topk_weights, device)
    return rows


def _profile(fn, args, shape, device) -> None:
    """Profile 5 round trips; rank 0 writes the op table (what the time goes to)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    dist.barrier()
    with profile(activities=activities) as prof:
        for _ in range(5):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"profile-{shape.name}-w{dist.get_world_size()}.txt")
        averages = prof.key_averages()
        with open(path, "w") as f:
            for key in ("self_cpu_time_total", "self_device_time_total" if device.type == "cuda" else "count"):
                f.write(f"sorted by {key}\n{averages.table(sort_by=key, row_limit=40)}\n")


def _megatron_rows(args, shape, x, topk_idx, topk_weights, device) -> list[dict]:
    try:
        from dispatch.bench import megatron_baseline as mb
    except ImportError:
        return []
    if not mb.megatron_available() or device.type != "cuda":
        return []
    rows = []
    routing_map, probs = mb.routing_to_megatron(topk_idx, topk_weights, shape.experts)
    world = dist.get_world_size()
    # Megatron's alltoall sends one row per (token, expert) to remote ranks.
    remote = (topk_idx // (shape.experts // world) != dist.get_rank()).sum()
    bytes_out = torch.tensor([float(remote) * shape.hidden * x.element_size()], dtype=torch.float64, device=device)
    dist.all_reduce(bytes_out)
    for kind in ("alltoall", "allgather"):
        md = mb.build_megatron_dispatcher(kind, shape.experts, shape.topk, shape.hidden)
        result = mb.megatron_round_trip(md, x, routing_map, probs, weight_by_probs=True)
        wrong = _wrong_rows(result, x, topk_weights)
        # timed as ../shared/BASELINES.md measured it: the six stages, no experts
        totals = _time(lambda: mb.megatron_round_trip(md, x, routing_map, probs), args.iters, args.warmup, device)
        moved = float(bytes_out) / world if kind == "alltoall" else float("nan")
        rows.append(_row(f"megatron {kind}", shape, world, totals, wrong, moved, {}))
    return rows


def _row(name, shape, world, totals, wrong, bytes_out, phases) -> dict:
    ordered = sorted(totals)
    return {
        "name": name,
        "shape": asdict(shape),
        "world_size": world,
        "median_ms": statistics.median(totals),
        "p10_ms": ordered[len(ordered) // 10],
        "p90_ms": ordered[(len(ordered) * 9) // 10],
        "wrong": wrong,
        "bytes_out_per_rank": bytes_out,
        "phases_ms": phases,
    }


def environment() -> dict:
    info = {"torch": torch.__version__, "python": sys.version.split()[0], "dispatch": dispatch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        info["cuda"] = torch.version.cuda
    info["commit"] = os.environ.get("DISPATCH_COMMIT") or _git_commit()
    return info


def _git_commit() -> str:
    try:
        import subprocess

        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def markdown_table(rows: list[dict]) -> str:
    head = "| dispatcher | W | median ms | p10-p90 ms | #wrong | MB out/rank | " + " | ".join(PHASES) + " |"
    lines = [head, "|" + " --- |" * (6 + len(PHASES))]
    for r in rows:
        phases = " | ".join(f"{r['phases_ms'][p]:.3f}" if p in r["phases_ms"] else "-" for p in PHASES)
        lines.append(
            f"| {r['name']} | {r['world_size']} | {r['median_ms']:.3f} | {r['p10_ms']:.3f}-{r['p90_ms']:.3f} | "
            f"{r['wrong']} | {_megabytes(r['bytes_out_per_rank'])} | {phases} |"
        )
    return "\n".join(lines)


def _megabytes(value: float) -> str:
    return "-" if value != value else f"{value / 1e6:.1f}"  # NaN: not counted for this dispatcher


def report(rows: list[dict], args: argparse.Namespace) -> None:
    shape = SHAPES[args.shape]
    env = environment()
    title = (
        f"dispatch + combine round trip, {shape.name} (T={shape.tokens}, H={shape.hidden}, "
        f"E={shape.experts}, K={shape.topk}), {args.dtype}, uniform routing"
    )
    table = markdown_table(rows)
    base = next((r for r in rows if r["name"] == "megatron alltoall"), None)
    lines = [title, "", table, ""]
    if base is not None:
        lines.append(f"speed-up over megatron alltoall: {base['median_ms'] / rows[0]['median_ms']:.2f}x")
    lines.append("environment: " + ", ".join(f"{k} {v}" for k, v in env.items()))
    text = "\n".join(lines)
    print(text, flush=True)
    os.makedirs(args.out, exist_ok=True)
    suffix = "-nocheck" if args.no_check else ""
    stem = os.path.join(args.out, f"roundtrip-{shape.name}-w{rows[0]['world_size']}{suffix}")
    with open(stem + ".json", "w") as f:
        json.dump({"title": title, "environment": env, "rows": rows, "iters": args.iters}, f, indent=2)
    with open(stem + ".md", "w") as f:
        f.write(f"# {title}\n\n{table}\n\n" + "\n".join(lines[4:]) + "\n")
