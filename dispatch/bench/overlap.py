"""Overlap study: how much of the exchange MoEExchange hides behind the experts.

For each model shape, forward and forward+backward of the MoE layer
(exchange + GroupedExperts), on every local GPU with NCCL (or a tiny CPU world on
gloo, as a smoke test):

    T_comm      the exchange alone (MoEExchange, C = 1, identity experts)
    T_compute   the experts alone, on the rows one dispatch delivers
    T_seq       MoEExchange(C = 1) with GroupedExperts
    T_pipe      MoEExchange(C) with GroupedExperts, best C of ``--chunks`` (a
                value "1:3:3:1" is MoEExchange(chunks=(1, 3, 3, 1)), chunks of
                those relative sizes) (and,
                with ``--local-first``, of MoEExchange(local_first=True) with
                C = 1 and with each C of ``--chunks``: "local", "localC"; with
                ``--ahead A``, of each of these with ``ahead=A`` where C > A:
                "C/A", "localC/A")
    hidden      (T_seq - T_pipe) / min(T_comm, T_compute)   (1 = fully hidden)
    peak        on CUDA, forward+backward: the most memory one step allocates above
                what was allocated before it (MiB, the largest rank's), for the
                sequential layer ("seq", C = 1) and each candidate
    ceiling     hidden at T_pipe = max(T_comm, T_compute), the most a pipeline
                can reach here: 1 where T_seq = T_comm + T_compute, less (more)
                where the layer at C = 1 costs less (more) than that sum
    host        the host's time to return from the step (on CUDA: to queue its
                work, with the plan's host synchronisation), the slowest rank's,
                for "seq" and each candidate: where it nears T_pipe, the host
                sets the pipeline's pace

``--transport both`` measures T_comm, T_seq and every T_pipe candidate with each
transport (``DispatchConfig.transport``; peer-copy candidates are named
``peer:C``, ``peer:local`` and ``peer:localC``); then T_seq is the faster transport's and T_comm
that of the best candidate's transport.

Each time is the slowest rank's, median over ``--iters`` runs after a barrier,
CUDA events, after ``--warmup`` runs. ``--comm-max-ctas N`` builds the EP group
with an NCCL SM budget (a slower exchange, as on a slow inter-node tier);
``--trace`` profiles one pipelined forward+backward (of the best
forward+backward candidate, or ``--trace-candidate``) on every rank, writes each
rank's trace, and draws every rank's streams on one PNG timeline, with a
lane-by-lane summary beside it (``dispatch.bench.timeline``).

    python -m dispatch.bench.overlap --out bench/results/
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

import dispatch
from dispatch.bench.common import (
    SHAPES, Shape, launch, new_group_with_sm_budget, shapes_fit, time_phases, world_size_for,
)
from dispatch.bench.roundtrip import make_routing
from dispatch.bench.timeline import draw_timeline, lanes_summary
from dispatch.experts import BACKENDS, GroupedExperts


OVERLAP_SHAPES = ("deepseek-v3", "mixtral-8x7b", "cpu-tiny")
PASSES = ("fwd", "fwd+bwd")


def _shapes(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in OVERLAP_SHAPES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown) or 'nothing given'} not among {', '.join(OVERLAP_SHAPES)}")
    return names


def _chunks(text: str):
    """A ``--chunks`` value: C (an int >= 1) or relative sizes "s0:s1:..." (ints >= 1), kept as text."""
    parts = text.split(":")
    if not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is neither an int >= 1 nor sizes >= 1 joined by ':'")
    return int(text) if len(parts) == 1 else text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dispatch-overlap", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=_shapes,
                        help=f"comma-separated from {', '.join(OVERLAP_SHAPES)} "
                             "(default: deepseek-v3,mixtral-8x7b on GPUs, cpu-tiny on CPU)")
    parser.add_argument("--world-size", type=int, help="ranks (default: all GPUs, or 2 CPU processes)")
    parser.add_argument("--chunks", type=_chunks, nargs="+", default=[2, 4, 8],
                        help="C values tried for T_pipe, or relative chunk sizes joined by ':' (1:3:3:1)")
    parser.add_argument("--iters", type=int, default=20, help="timed runs (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs first (default 5)")
    parser.add_argument("--dispatch-wire", default="native", help="DispatchConfig.dispatch_wire (e.g. bf16, fp8)")
    parser.add_argument("--comm-max-ctas", type=int, help="NCCL max_ctas of the EP group (a slower exchange)")
    parser.add_argument("--comm-high-priority", action="store_true",
                        help="EP group's NCCL collectives on a high-priority stream (ahead of waiting GEMM blocks)")
    parser.add_argument("--comm-priority", type=int, default=-1, help="CUDA priority of the comm stream")
    parser.add_argument("--sm-carveout", type=int, default=None,
                        help="MoEExchange(sm_carveout=N): SMs the experts' GEMMs leave to the exchange")
    parser.add_argument("--local-first", action="store_true",
                        help="also try MoEExchange(local_first=True) with C = 1 and each --chunks C for T_pipe "
                             "(reported as C = local, localC)")
    parser.add_argument("--ahead", type=int, nargs="+",
                        help="also try MoEExchange(ahead=A) for each A and each C > A of the candidates "
                             "(named C/A, localC/A; without /A every chunk is dispatched ahead)")
    parser.add_argument("--experts-backend", choices=BACKENDS, default="auto",
                        help="GroupedExperts backend of every layer (default auto: torch._grouped_mm on Hopper)")
    parser.add_argument("--transport", choices=("collective", "peer_copy", "both"), default="collective",
                        help="DispatchConfig.transport of the layers, or both side by side")
    parser.add_argument("--trace", action="store_true", help="profile one pipelined step; PNG timeline of the streams")
    parser.add_argument("--trace-candidate", help="the T_pipe candidate --trace profiles (e.g. 4, local2, peer:local); "
                                                  "default: the best forward+backward")
    parser.add_argument("--host-profile", metavar="CANDIDATE",
                        help="profile the host (cProfile, rank 0) over 5 forward+backward steps of this candidate")
    parser.add_argument("--out", default="dispatch-results", help="folder for JSON, markdown and PNG results")
    args = parser.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")
    if args.world_size is not None and args.world_size < 1:
        parser.error(f"--world-size must be >= 1, got {args.world_size}")
    if args.comm_max_ctas is not None and (args.comm_max_ctas < 1 or not torch.cuda.is_available()):
        parser.error("--comm-max-ctas needs NCCL (a GPU) and a value >= 1")
    if args.comm_high_priority and not torch.cuda.is_available():
        parser.error("--comm-high-priority needs NCCL (a GPU)")
    if args.sm_carveout is not None and args.sm_carveout < 0:
        parser.error(f"--sm-carveout must be >= 0, got {args.sm_carveout}")
    if args.ahead is not None and min(args.ahead) < 1:
        parser.error(f"--ahead values must be >= 1, got {args.ahead}")
    if args.trace_candidate is not None and not args.trace:
        parser.error("--trace-candidate needs --trace")
    if args.host_profile is not None and _candidate(candidates_of(args), args.host_profile) is None:
        parser.error(f"--host-profile {args.host_profile!r} is not among the candidates "
                     f"{', '.join(map(str, candidates_of(args)))}")
    if args.trace_candidate is not None and _candidate(candidates_of(args), args.trace_candidate) is None:
        parser.error(f"--trace-candidate {args.trace_candidate!r} is not among the candidates "
                     f"{', '.join(map(str, candidates_of(args)))}")
    try:
        dispatch.DispatchConfig(num_experts=8, dispatch_wire=args.dispatch_wire)
    except ValueError as exc:
        parser.error(f"--dispatch-wire: {exc}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    use_cuda = torch.cuda.is_available()
    args.shapes = args.shapes or (["deepseek-v3", "mixtral-8x7b"] if use_cuda else ["cpu-tiny"])
    if not shapes_fit(args.shapes, world_size_for(args.world_size, cpu_default=2), "dispatch-bench overlap"):
        return 2
    return launch(_job, args, args.world_size, cpu_default=2)


def _job(args: argparse.Namespace) -> None:
    group = None
    if args.comm_max_ctas is not None or args.comm_high_priority:
        group = new_group_with_sm_budget(None, args.comm_max_ctas, high_priority=args.comm_high_priority)
    for name in args.shapes:
        rows, trace = run_shape(SHAPES[name], args, group)
        if dist.get_rank() == 0:
            report(SHAPES[name], rows, args, trace)


def _time(fn, iters: int, warmup: int, device) -> tuple[float, float]:
    """Medians over ``iters`` runs, barrier first, of the slowest rank's time (ms)
    of ``fn`` and of the slowest rank's host time (ms) to return from ``fn``
    (on CUDA: to queue its work; where it nears the first, the host sets the pace)."""
    host = []

    def step(timer):
        start = time.perf_counter()
        fn()
        host.append((time.perf_counter() - start) * 1e3)

    runs = time_phases(step, iters, warmup, device)
    issued = torch.tensor(host[warmup:], dtype=torch.float64, device=device)
    dist.all_reduce(issued, op=dist.ReduceOp.MAX)
    return statistics.median(r["total"] for r in runs), statistics.median(issued.tolist())


def _peak_mib(fn, device, group) -> float | None:
    """The most memory one run of ``fn`` allocates above what was allocated
    before it, in MiB, the largest over the ranks; None off CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()  # host sync: the baseline is taken with nothing in flight
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()  # host sync: the step is over when the peak is read
    peak = torch.tensor([(torch.cuda.max_memory_allocated() - before) / 2**20], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    return float(peak)


def run_shape(shape: Shape, args, group) -> tuple[list[dict], str | None]:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    transports = transports_of(args)
    by_transport = {t: dispatch.create(dispatch.DispatchConfig(
        num_experts=shape.experts, dispatch_wire=args.dispatch_wire, transport=t), group) for t in transports}
    d = by_transport[transports[0]]
    torch.manual_seed(1234 + rank)
    experts = GroupedExperts(d.num_local_experts, shape.hidden, shape.ffn, backend=args.experts_backend,
                             dtype=dtype, device=device)
    x = torch.randn(shape.tokens, shape.hidden, device=device, dtype=dtype)
    grad = torch.randn_like(x)
    topk_idx, topk_weights = make_routing("uniform", shape, world, rank, device)
    planned = d.dispatch(x, topk_idx, topk_weights)
    tokens, per_expert = planned.tokens.detach(), planned.tokens_per_expert
    del planned

    def identity(t, n):
        return t

    def layer_fn(layer, backward):
        def run():
            xs = x.detach().requires_grad_(backward)
            ws = topk_weights.detach().requires_grad_(backward)
            out = layer(xs, topk_idx, ws)
            if backward:
                out.backward(grad)
                experts.zero_grad(set_to_none=True)
            return out

        return run

    def compute_fn(backward):
        def run():
            leaf = tokens.detach().requires_grad_(backward)
            y = experts(leaf, per_expert)
            if backward:
                y.backward(torch.ones_like(y))
                experts.zero_grad(set_to_none=True)

        return run

    def timed(fn):
        return _time(fn, args.iters, args.warmup, device)[0]

    def timed_host(fn):
        return _time(fn, args.iters, args.warmup, device)

    prio = args.comm_priority
    options = dict(comm_priority=prio, sm_carveout=args.sm_carveout)

    candidates = candidates_of(args)

    def pipe(name):
        transport, c = candidates[name]
        return dispatch.MoEExchange(by_transport[transport], experts, **layer_options(c), **options)

    rows = []
    for name in PASSES:
        backward = name == "fwd+bwd"
        t_comm = {t: timed(layer_fn(dispatch.MoEExchange(by_transport[t], identity, chunks=1, comm_priority=prio),
                                    backward)) for t in transports}
        t_compute = timed(compute_fn(backward))
        seq_layers = {t: dispatch.MoEExchange(by_transport[t], experts, chunks=1, comm_priority=prio)
                      for t in transports}
        seq_times = {t: timed_host(layer_fn(layer, backward)) for t, layer in seq_layers.items()}
        t_seqs = {t: gpu for t, (gpu, _) in seq_times.items()}
        pipe_times = {c: timed_host(layer_fn(pipe(c), backward)) for c in candidates}
        by_chunks = {c: gpu for c, (gpu, _) in pipe_times.items()}
        best = min(by_chunks, key=by_chunks.get)
        t_seq, comm = min(t_seqs.values()), t_comm[candidates[best][0]]
        with torch.no_grad():
            want = seq_layers[transports[0]](x, topk_idx, topk_weights)
            got = pipe(best)(x, topk_idx, topk_weights)
        diff = torch.tensor([(got.float() - want.float()).abs().max().item() if got.numel() else 0.0], device=device)
        dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=group)
        peak = None
        if backward and device.type == "cuda":  # the sequential layer (C = 1) first, then each candidate
            peak = {"seq": _peak_mib(layer_fn(seq_layers[transports[0]], True), device, group)}
            peak.update({str(c): _peak_mib(layer_fn(pipe(c), True), device, group) for c in candidates})
        rows.append(dict(
            shape=shape.name, passes=name, world_size=world, dispatch_wire=args.dispatch_wire,
            comm_max_ctas=args.comm_max_ctas, comm_high_priority=args.comm_high_priority,
            sm_carveout=args.sm_carveout, transport=args.transport, experts_backend=args.experts_backend,
            t_comm_ms=comm, t_compute_ms=t_compute,
            t_seq_ms=t_seq, t_pipe_ms=by_chunks[best], best_chunks=best, t_pipe_by_chunks_ms=by_chunks,
            t_comm_by_transport_ms=t_comm, t_seq_by_transport_ms=t_seqs,
            hidden_fraction=(t_seq - by_chunks[best]) / min(comm, t_compute),
            hidden_ceiling=(t_seq - max(comm, t_compute)) / min(comm, t_compute),
            max_abs_diff_vs_seq=float(diff), peak_mib=peak,
            host_ms={"seq": min(seq_times.values())[1], **{c: host for c, (_, host) in pipe_times.items()}},
        ))
    trace = None
    if args.host_profile is not None:
        profiled = _candidate(candidates, args.host_profile)
        _host_profile(layer_fn(pipe(profiled), True), shape, args, device, profiled)
    if args.trace:
        traced = rows[-1]["best_chunks"] if args.trace_candidate is None else _candidate(candidates, args.trace_candidate)
        trace = _trace(layer_fn(pipe(traced), True), shape, args, device, traced)
    return rows, trace


def _host_profile(fn, shape, args, device, chunks) -> None:
    """Where the host's time goes over 5 forward+backward steps of one
    candidate (every rank runs them; rank 0 under cProfile): the functions by
    their own time and by their time with callees, in
    ``overlap-host-<shape>-w<W><suffix>.txt``."""
    import cProfile
    import io
    import pstats

    fn()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()  # host sync: the profile holds the steps only
    dist.barrier()
    profiler = cProfile.Profile()
    if dist.get_rank() == 0:
        profiler.enable()
    for _ in range(5):
        fn()
    profiler.disable()
    if device.type == "cuda":
        torch.cuda.synchronize()  # host sync: the steps are done before the next measurement
    dist.barrier()
    if dist.get_rank() != 0:
        return
    text = io.StringIO()
    text.write(f"host profile of 5 forward+backward steps, {_layer_words(str(chunks))}, rank 0\n")
    for key in ("tottime", "cumulative"):
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(40)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"overlap-host-{shape.name}-w{dist.get_world_size()}{_suffix(args)}.txt"),
              "w") as f:
        f.write(text.getvalue())


def _trace(fn, shape, args, device, chunks) -> str | None:
    """Profile one pipelined forward+backward on every rank. Each rank writes its
    trace (rank 0 ``<stem>.json``, rank R ``<stem>-rank<R>.json``; one host, one
    folder); rank 0 writes its kernel table, the PNG timeline of every rank's
    streams and ``<stem>-lanes.txt`` (``timeline.lanes_summary``)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    fn()
    fn()
    with profile(activities=activities) as prof:
        dist.barrier()  # inside the profile: every rank's profiler has started before the step
        if device.type == "cuda":
            torch.cuda.synchronize()  # host sync: the step starts on an idle GPU
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()  # host sync: the trace must hold the whole step
    rank, world = dist.get_rank(), dist.get_world_size()
    stem = os.path.join(args.out, f"overlap-trace-{shape.name}-w{world}{_suffix(args)}")
    paths = [stem + ".json"] + [f"{stem}-rank{r}.json" for r in range(1, world)]
    os.makedirs(args.out, exist_ok=True)
    prof.export_chrome_trace(paths[rank])
    dist.barrier()  # every rank's trace is on disk before rank 0 reads them
    if rank != 0:
        return None
    with open(stem + ".txt", "w") as f:  # where the time goes, kernel by kernel
        key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        f.write(prof.key_averages().table(sort_by=key, row_limit=40))
    with open(stem + "-lanes.txt", "w") as f:
        f.write(lanes_summary(paths))
    draw_timeline(paths, stem + ".png", f"{shape.name}: one pipelined fwd+bwd step, "
                  + _layer_words(str(chunks))
                  + (", peer copy" if str(chunks).startswith("peer:") else ""))
    return stem + ".png"


def transports_of(args) -> tuple[str, ...]:
    """The transports ``--transport`` names."""
    return ("collective", "peer_copy") if args.transport == "both" else (args.transport,)


def candidates_of(args) -> dict:
    """The T_pipe candidates: {name: (transport, C or "local" / "localC", "/A" after it for ``--ahead``)}."""
    transports = transports_of(args)
    local = ["local", *(f"local{c}" for c in args.chunks if c != 1)] if args.local_first else []
    layers = [*args.chunks, *local]
    layers += [f"{c}/{a}" for c in layers for a in args.ahead or () if _count(layer_options(c)["chunks"]) > a]
    return {candidate_name(t, c): (t, c) for t in transports for c in layers}


def layer_options(layer) -> dict:
    """MoEExchange's chunks, local_first and ahead of a candidate's layer: C or
    relative sizes "s0:s1:..." (chunks=(s0, s1, ...)), "local" (C = 1) or "local"
    and either, then "/A" for ``ahead=A`` (none: every chunk ahead)."""
    name, _, ahead = str(layer).partition("/")
    local = name.startswith("local")
    sizes = (name.removeprefix("local") or "1").split(":")
    chunks = int(sizes[0]) if len(sizes) == 1 else tuple(map(int, sizes))
    return dict(chunks=chunks, local_first=local, ahead=int(ahead) if ahead else None)


def _count(chunks) -> int:
    """C of a layer's ``chunks`` (a count or the chunks' relative sizes)."""
    return chunks if isinstance(chunks, int) else len(chunks)


def _candidate(candidates: dict, name: str):
    """The key of ``candidates`` named ``name`` (C values are ints there), or None."""
    return next((key for key in candidates if str(key) == name), None)


def _layer_words(name: str) -> str:
    """A candidate's name in words, for a title: "own rows first, C=2" for "local2",
    "C=4, 2 ahead" for "4/2"."""
    options = layer_options(name.removeprefix("peer:"))
    chunks = options["chunks"]
    words = ("own rows first, " if options["local_first"] else "") + (
        f"C={chunks}" if isinstance(chunks, int) else "chunk sizes " + ":".join(map(str, chunks)))
    return words + ("" if options["ahead"] is None else f", {options['ahead']} ahead")


def candidate_name(transport: str, chunks):
    """A T_pipe candidate's name: C, "local" or "localC", "peer:" first for the peer-copy transport."""
    return chunks if transport == "collective" else f"peer:{chunks}"


def _suffix(args) -> str:
    wire = "" if args.dispatch_wire == "native" else f"-{args.dispatch_wire}"
    ctas = "" if args.comm_max_ctas is None else f"-ctas{args.comm_max_ctas}"
    carve = "" if args.sm_carveout is None else f"-carve{args.sm_carveout}"
    transport = "" if args.transport == "collective" else f"-{args.transport.replace('_', '-')}"
    ahead = "" if not args.ahead else "-ahead" + "-".join(map(str, args.ahead))
    backend = "" if args.experts_backend == "auto" else f"-{args.experts_backend.replace('_', '-')}"
    return wire + ctas + ("-hiprio" if args.comm_high_priority else "") + carve + transport + (
        "-local-first" if args.local_first else "") + ahead + backend


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| shape | pass | W | wire | max_ctas | NCCL stream | SM carveout | T_comm ms | T_compute ms | T_seq ms | T_pipe ms | best C | hidden | ceiling | T_pipe by C | T_comm / T_seq by transport | max abs diff | peak MiB by C | host ms by C |",
        "|" + " --- |" * 19,
    ]
    for r in rows:
        by_c = ", ".join(f"{c}: {t:.2f}" for c, t in r["t_pipe_by_chunks_ms"].items())
        by_t = ", ".join(f"{t}: {r['t_comm_by_transport_ms'][t]:.2f} / {seq:.2f}"
                         for t, seq in r["t_seq_by_transport_ms"].items())
        lines.append(
            f"| {r['shape']} | {r['passes']} | {r['world_size']} | {r['dispatch_wire']} | "
            f"{r['comm_max_ctas'] or '-'} | "
            f"{'high priority' if r.get('comm_high_priority') else 'default'} | {r.get('sm_carveout') or '-'} | "
            f"{r['t_comm_ms']:.3f} | {r['t_compute_ms']:.3f} | {r['t_seq_ms']:.3f} | {r['t_pipe_ms']:.3f} | "
            f"{r['best_chunks']} | {r['hidden_fraction']:.2f} | {r['hidden_ceiling']:.2f} | {by_c} | {by_t} | "
            f"{r['max_abs_diff_vs_seq']:.3g} | {_peaks(r.get('peak_mib'))} | {_peaks(r.get('host_ms'), '.2f')} |"
        )
    return "\n".join(lines)


def _peaks(peak: dict | None, fmt: str = ".0f") -> str:
    """"seq: 5120, 2: 4990, ..." (the sequential layer first), or "-" where not measured."""
    return "-" if not peak else ", ".join(f"{c}: {value:{fmt}}" for c, value in peak.items())


def report(shape: Shape, rows: list[dict], args, trace: str | None) -> None:
    from dispatch.bench.common import environment

    env = environment()
    title = (f"overlap of exchange and experts, {shape.name} (T={shape.tokens}, H={shape.hidden}, "
             f"E={shape.experts}, K={shape.topk}, ffn={shape.ffn}), W={rows[0]['world_size']}")
    table = markdown_table(rows)
    text = "\n".join([title, "", table, "", "environment: " + ", ".join(f"{k} {v}" for k, v in env.items())])
    print(text, flush=True)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"overlap-{shape.name}-w{rows[0]['world_size']}{_suffix(args)}")
    with open(stem + ".json", "w") as f:
        json.dump({"title": title, "shape": asdict(shape), "environment": env, "rows": rows,
                   "iters": args.iters, "warmup": args.warmup, "trace_png": trace}, f, indent=2)
    with open(stem + ".md", "w") as f:
        f.write(f"# {title}\n\n{table}\n\n" + (f"timeline: {os.path.basename(trace)}\n\n" if trace else "")
                + "environment: " + ", ".join(f"{k} {v}" for k, v in env.items()) + "\n")


if __name__ == "__main__":
    sys.exit(main())
