"""``dispatch-bench dispatch``: dispatchers compared on model shapes.

For each shape x routing, every variant x wire format of ours (the alltoall
variant over NCCL, over the NVLink engine, and over the engine with ``max_rows``
in CUDA graphs) and, on GPUs, Megatron-Core's ``alltoall`` and ``allgather``
dispatchers when megatron-core imports and DeepEP's intranode kernels when
``deep_ep`` imports (eager, and along a cached layout: ``dispatch.bench.deepep_baseline``;
each row beside its pair of ours, ``PAIRS``: not like for like, DeepEP at 24
SMs and charged the weighting its combine does not make, ours on every SM), in the
same processes and table:

* dispatch, combine and round-trip times (median and 10th-90th percentile over
  ``--iters`` timed runs after ``--warmup``, barrier first, CUDA events, the
  slowest rank's figure per run), and the six phases (plan, exchange out,
  expansion, expert-side pre-sum, exchange back, final sum). Megatron's six
  stages are shown in the phase columns of the same position
  (``dispatch_preprocess`` ... ``combine_postprocess``);
* bytes that leave a rank per direction and tier (intra-/inter-node; a rank's
  rows to itself cross no link and are not counted), mean over ranks;
* bandwidth the way DeepEP's tests count it: bytes of the rows a rank receives
  in dispatch (one per (token, rank), its own included) over the dispatch time,
  and the same bytes over the combine time;
* ``#wrong``: rows of a round trip whose experts each scale their rows by a
  factor of their own (``common.by_expert``; timed with identity experts, but
  Megatron's and DeepEP's, which weigh their rows in the same multiply) that
  are not ``x * sum_k w_k (1 + e_k / E)`` within the wire format's rounding: a
  row at the wrong expert or a weight on the wrong slot counts;
* for ``auto``: its round trip over the fastest other eager row of ours with
  its wire, all of them timed again in turns, run by run.

Routings: ``uniform`` (K distinct experts uniformly at random), ``zipf``
(expert popularity ~ 1 / rank^1.2, the same hot experts on every rank) and
``one-rank`` (every token's experts on rank 0).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict

import torch
import torch.distributed as dist

import dispatch
from dispatch import config as config_mod
from dispatch.bench import common, plots
from dispatch.codec import to_experts_codec

PHASES = ("plan", "exchange_out", "expand", "presum", "exchange_back", "final_sum")
SECTIONS = {"dispatch": PHASES[:3], "combine": PHASES[3:]}
ROUTINGS = ("uniform", "zipf", "one-rank")
# the alltoall variant's: NCCL, the NVLink engine, and the engine with max_rows in CUDA graphs
TRANSPORTS = ("nccl", "nvlink", "nvlink-graph")
TRANSPORT_WORDS = {"nvlink": "the NVLink engine", "nvlink-graph": "the engine in CUDA graphs"}
DEEPEP_EAGER, DEEPEP_CACHED = "deepep eager (layout, host read)", "deepep kernels (cached layout)"
# each DeepEP row's pair of ours: (the pair's label, our row's name)
PAIRS = {DEEPEP_EAGER: ("eager", "ours alltoall/nvlink"),
         DEEPEP_CACHED: ("captured", "ours alltoall/nvlink graph")}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", help=f"comma-separated shapes from {', '.join(common.SHAPES)} "
                        "(default: the four model shapes on GPUs, the cpu-* shapes on CPU)")
    parser.add_argument("--variants", default="all", help="comma-separated variants or 'all'")
    parser.add_argument("--wires", dest="dispatch_wires", default="all",
                        help="comma-separated dispatch wire formats (the combine wire stays native), or 'all'")
    parser.add_argument("--routings", default="all", help=f"comma-separated from {', '.join(ROUTINGS)}, or 'all'")
    parser.add_argument("--transports", default="all",
                        help="the alltoall variant's transports, comma-separated from nccl, nvlink, nvlink-graph "
                             "(the engine with max_rows = N + 10%%, dispatch, combine and round trip each "
                             "captured in a CUDA graph and replayed), or 'all' (nccl and nvlink on GPUs where "
                             "the NVLink engine runs, with nvlink-graph too where DeepEP's rows run: its cached "
                             "layout's pair; nccl elsewhere); the other variants over NCCL, auto over "
                             "the transport it chooses (transport=\"auto\")")
    parser.add_argument("--nodes", type=int, default=1,
                        help="treat the ranks as this many nodes of consecutive ranks (hierarchical tiers, "
                             "bytes per tier; default 1)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="token dtype (default bf16)")
    parser.add_argument("--no-check", action="store_true", help="DispatchConfig.from_options(check_inputs=False)")
    parser.add_argument("--no-grad", action="store_true",
                        help="every row under torch.no_grad(), as inference runs (no autograd nodes)")
    parser.add_argument("--baselines", choices=["auto", "none"], default="auto",
                        help="auto: Megatron-Core's dispatchers too, on GPUs, when megatron-core imports; "
                        "DeepEP's intranode kernels when deep_ep imports (bf16)")
    parser.add_argument("--profile", action="store_true",
                        help="also write a torch profiler table of 5 round trips of the first configuration")


def _pick(parser, flag: str, text: str, choices) -> list[str]:
    if text == "all":
        return list(choices)
    wanted = [w.strip() for w in text.split(",") if w.strip()]
    unknown = [w for w in wanted if w not in choices]
    if unknown or not wanted:
        parser.error(f"{flag}: {', '.join(unknown) or 'nothing given'} not among {', '.join(choices)}")
    return wanted


def resolve(args: argparse.Namespace, use_cuda: bool, parser: argparse.ArgumentParser) -> None:
    default_shapes = common.GPU_SHAPES if use_cuda else common.CPU_SHAPES
    args.shapes = _pick(parser, "--shapes", args.shapes or ",".join(default_shapes), list(common.SHAPES))
    args.variants = _pick(parser, "--variants", args.variants, config_mod.VARIANTS)
    if args.dispatch_wires == "all":
        # the lossless default and the compressing formats (bf16/fp32 casts of
        # bf16 tokens would repeat the native rows)
        from dispatch.bench.a2a import compressing_wires

        args.dispatch_wires = ["native", *compressing_wires()]
    else:
        args.dispatch_wires = _pick(parser, "--wires", args.dispatch_wires, config_mod.TO_EXPERTS_WIRES)
    args.routings = _pick(parser, "--routings", args.routings, ROUTINGS)
    if args.transports == "all":
        from dispatch import cuda

        # the NVLink engine takes peers: none on a machine of one GPU
        engine = use_cuda and cuda.available() and common.world_size_for(getattr(args, "world_size", None)) > 1
        # DeepEP's kernels on a cached layout need their pair: our round trip captured
        deepep = engine and args.baselines == "auto" and args.dtype == "bf16" and _deepep_importable()
        args.transports = ["nccl", "nvlink", *(["nvlink-graph"] if deepep else [])] if engine else ["nccl"]
    else:
        args.transports = _pick(parser, "--transports", args.transports, TRANSPORTS)
    if args.nodes < 1:
        parser.error(f"--nodes must be >= 1, got {args.nodes}")


def make_routing(kind: str, shape: common.Shape, world: int, rank: int, dev, seed: int = 0):
    """[T, K] int64 distinct expert ids and [T, K] float32 softmax weights for this rank,
    or None when ``kind`` cannot route this shape (one-rank with K > E_local)."""
    gen = torch.Generator(device=dev).manual_seed(seed * 7919 + rank)
    num_tokens, experts, topk = shape.tokens, shape.experts, shape.topk
    if kind == "uniform":
        scores = torch.rand(num_tokens, experts, generator=gen, device=dev)
    elif kind == "zipf":
        shared = torch.Generator(device=dev).manual_seed(seed)  # the same hot experts everywhere
        popularity = torch.randperm(experts, generator=shared, device=dev).double() + 1
        probs = popularity.pow(-1.2)
        # Gumbel top-k: K distinct experts drawn with probability ~ probs, without replacement
        gumbel = -torch.log(-torch.log(torch.rand(num_tokens, experts, generator=gen, device=dev, dtype=torch.float64)))
        scores = probs.log() + gumbel
    elif kind == "one-rank":
        per_rank = experts // world
        if topk > per_rank:
            return None
        scores = torch.full((num_tokens, experts), -1.0, device=dev)
        scores[:, :per_rank] = torch.rand(num_tokens, per_rank, generator=gen, device=dev)
    else:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {kind!r}")
    topk_idx = scores.topk(topk, dim=1).indices
    topk_weights = torch.softmax(torch.rand(num_tokens, topk, generator=gen, device=dev), dim=1)
    return topk_idx, topk_weights


def run(args: argparse.Namespace) -> dict | None:
    """Collective: every configuration on this world; rank 0 returns {"rows": [...]}."""
    with torch.set_grad_enabled(not args.no_grad):
        return _run(args)


def _run(args: argparse.Namespace) -> dict | None:
    dev = common.device()
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = DTYPES[args.dtype]
    megatron, deepep = _baselines(args, dev)
    baselines = (2 if megatron else 0) + (2 if deepep else 0)
    shapes = [common.SHAPES[s] for s in args.shapes]
    bad = [s.name for s in shapes if s.experts % world]
    if bad:
        raise ValueError(f"--shapes: {', '.join(bad)} cannot split its experts over {world} ranks")
    # auto as a user gets it (its transport "auto": the NVLink engine where it runs); the others over each transport
    ours = [(v, w, t) for v in args.variants for w in args.dispatch_wires
            for t in (args.transports if v == "alltoall" else ["auto"] if v == "auto" else ["nccl"])]
    total = len(shapes) * len(args.routings) * (len(ours) + baselines)
    progress = common.Progress(total, "dispatch")
    _warm_up(shapes[0], dtype, dev, args)
    dispatchers: dict = {}
    rows = []
    for shape in shapes:
        x = torch.randn(shape.tokens, shape.hidden, device=dev).to(dtype)
        for routing in args.routings:
            made = make_routing(routing, shape, world, rank, dev)
            if made is None:
                for _ in range(len(ours) + baselines):
                    progress.step(f"{shape.name} {routing}", "skipped: K > experts per rank")
                continue
            topk_idx, topk_weights = made
            start = len(rows)  # this shape and routing's first row
            eager = []  # this shape and routing's eager rows of ours, with their dispatchers
            for variant, wire, transport in ours:
                graphs = transport == "nvlink-graph"
                transport = "nvlink" if graphs else transport
                key = (shape.experts, variant, wire, transport)
                if key not in dispatchers:
                    cfg = dispatch.DispatchConfig.from_options(
                        num_experts=shape.experts, variant=variant, dispatch_wire=wire, transport=transport,
                        check_inputs=not args.no_check, **_node_options(args),
                    )
                    dispatchers[key] = dispatch.create(cfg)
                ours_row = _ours_graphs if graphs else _ours
                row = ours_row(dispatchers[key], shape, routing, x, topk_idx, topk_weights, args, dev)
                rows.append(row)
                if not graphs:
                    eager.append((row, dispatchers[key]))
                progress.step(f"{shape.name} {routing} {row['name']}", _brief(row))
                if args.profile and len(rows) == 1:
                    _profile(dispatchers[key], x, topk_idx, topk_weights, args, shape, dev)
            _auto_in_turns(eager, x, topk_idx, topk_weights, args, dev)
            if megatron:
                for kind in ("alltoall", "allgather"):
                    row = _megatron(kind, shape, routing, x, topk_idx, topk_weights, args, dev)
                    rows.append(row)
                    progress.step(f"{shape.name} {routing} {row['name']}", _brief(row))
            if deepep:
                if "deepep" not in dispatchers:
                    from dispatch.bench import deepep_baseline

                    dispatchers["deepep"] = deepep_baseline.build_buffer()
                for row in _deepep(dispatchers["deepep"], shape, routing, x, topk_idx, topk_weights, args, dev):
                    _beside_its_pair(rows, start, row)
                    progress.step(f"{shape.name} {routing} {row['name']}", _brief(row))
    result = {"rows": rows, "world_size": world, "dtype": args.dtype, "nodes": args.nodes,
              "grad": torch.is_grad_enabled()}
    return result if rank == 0 else None


def _baselines(args, dev) -> tuple[bool, bool]:
    """Whether Megatron-Core's rows and DeepEP's run beside ours (on GPUs, where each imports)."""
    wanted = args.baselines == "auto" and dev.type == "cuda"
    return wanted and _megatron_importable(), wanted and args.dtype == "bf16" and _deepep_importable()


def what_runs(args) -> str:
    """The transports and baselines of the comparison, for the job's first line."""
    dev = common.device()
    over = [f"torch.distributed's collectives over {dist.get_backend()}" if t == "nccl" else TRANSPORT_WORDS[t]
            for t in args.transports]
    if args.baselines == "none" or dev.type != "cuda":
        why = "--baselines none" if args.baselines == "none" else "Megatron-Core's and DeepEP's run on GPUs"
        return f"transports: {', '.join(over)}; baselines: none ({why})"
    megatron, deepep = _baselines(args, dev)
    beside = [
        "Megatron-Core's alltoall and allgather" if megatron else "no Megatron-Core (megatron-core does not import)",
        "DeepEP eager and on a cached layout, each beside its pair of ours" if deepep
        else "no DeepEP (deep_ep does not import)" if args.dtype == "bf16" else "no DeepEP (bf16 tokens only)",
    ]
    return f"transports: {', '.join(over)}; baselines: {', '.join(beside)}"


def _beside_its_pair(rows: list[dict], start: int, row: dict) -> None:
    """A DeepEP row into ``rows`` right after its pair of ours (``PAIRS``)
    among this shape and routing's, from ``start``, both labelled with the pair;
    last where that row of ours did not run."""
    pair, partner = PAIRS[row["name"]]
    at = next((i for i in range(start, len(rows)) if rows[i]["name"] == partner), None)
    if at is None:
        rows.append(row)
        return
    rows[at]["pair"] = row["pair"] = pair
    rows.insert(at + 1, row)


def _warm_up(shape, dtype, dev, args) -> None:
    """Untimed round trips before the first measurement: NCCL connects its peers
    and the GPUs reach their clocks on the first collectives, which would
    otherwise be charged to whichever configuration comes first."""
    made = make_routing("uniform", shape, dist.get_world_size(), dist.get_rank(), dev, seed=1)
    x = torch.randn(shape.tokens, shape.hidden, device=dev).to(dtype)
    d = dispatch.create(dispatch.DispatchConfig.from_options(num_experts=shape.experts, transport="nccl"))
    for _ in range(4 * args.warmup + 2):
        out = d.dispatch(x, *made)
        d.combine(out.tokens, out.handle, weights=out.weights)
    dist.barrier()


def _node_options(args) -> dict:
    world = dist.get_world_size()
    return {"local_world_size": world // args.nodes}


def _megatron_importable() -> bool:
    from dispatch.bench import megatron_baseline

    return megatron_baseline.megatron_available()


def _deepep_importable() -> bool:
    from dispatch.bench import deepep_baseline

    return deepep_baseline.deepep_available()


def _brief(row: dict) -> str:
    return f"{row['round_trip_ms']['median']:.3f} ms #wrong {row['wrong']}"


def _ours(d, shape, routing, x, topk_idx, topk_weights, args, dev) -> dict:
    cfg = d.config
    lossy = cfg.dispatch_wire not in ("native", "bf16", "fp32")
    out = d.dispatch(x, topk_idx, topk_weights)
    y = common.by_expert(out.tokens, out.tokens_per_expert, dist.get_rank() * d.num_local_experts, cfg.num_experts)
    combined = d.combine(y, out.handle, weights=out.weights)
    wrong = common.wrong_rows(combined, x, topk_idx, topk_weights, cfg.num_experts, lossy=lossy)
    codec = to_experts_codec(cfg.dispatch_wire, x.dtype)
    traffic = _traffic(out, topk_idx, codec.row_bytes(shape.hidden), dev)
    if cfg.variant == "auto":
        variant, transport = out.handle.transport.key
        traffic["auto_choice"] = variant + ("/nvlink" if transport == "nvlink" else "")
    del out, combined

    def step(timer):
        d.phase_timer = timer
        got = d.dispatch(x, topk_idx, topk_weights)
        d.combine(got.tokens, got.handle, weights=got.weights)
        d.phase_timer = None

    runs = common.time_phases(step, args.iters, args.warmup, dev, SECTIONS, whole=True)
    wire = cfg.dispatch_wire if cfg.combine_wire == "native" else f"{cfg.dispatch_wire}/{cfg.combine_wire}"
    name = f"ours {cfg.variant}" + ("/nvlink" if cfg.transport == "nvlink" else "")
    return _row(name, cfg.variant, wire, shape, routing, runs, wrong, traffic, PHASES)


def _auto_in_turns(eager: list, x, topk_idx, topk_weights, args, dev) -> None:
    """Each ``auto`` row against the other eager rows of ours with its wire, all
    timed again in turns (``common.time_each``), so that the comparison
    does not hang on when each row was measured: ``row["in_turns"]`` holds
    auto's median over the fastest one's and that one's name."""
    for row, d in eager:
        rivals = [(r, other) for r, other in eager if r["variant"] != "auto" and r["wire"] == row["wire"]]
        if row["variant"] != "auto" or not rivals:
            continue

        def step(d):
            def run():
                out = d.dispatch(x, topk_idx, topk_weights)
                d.combine(out.tokens, out.handle, weights=out.weights)
            return run

        steps = {r["name"]: step(other) for r, other in [(row, d), *rivals]}
        runs = common.time_each(steps, args.iters, args.warmup, dev)
        medians = {name: common.spread([run[name] for run in runs])["median"] for name in steps}
        fastest = min((r["name"] for r, _ in rivals), key=medians.__getitem__)
        row["in_turns"] = {"ratio": medians[row["name"]] / medians[fastest], "fastest": fastest, "median_ms": medians}


def _in_turns(row: dict) -> str:
    turns = row.get("in_turns")
    return "-" if turns is None else f"{turns['ratio']:.2f}x {turns['fastest'].removeprefix('ours ')}"


def _ours_graphs(d, shape, routing, x, topk_idx, topk_weights, args, dev) -> dict:
    """The engine without the host (``common.captured_round_trip``): no phases, the
    dispatch, the combine and the round trip each timed as a graph replay."""
    cfg = d.config
    out = d.dispatch(x, topk_idx, topk_weights)
    traffic = _traffic(out, topk_idx, to_experts_codec(cfg.dispatch_wire, x.dtype).row_bytes(shape.hidden), dev)
    bound = int(out.tokens.shape[0] * common.GRAPH_SLACK)
    del out
    replays, _ = common.captured_round_trip(d, x, topk_idx, topk_weights, bound)
    checked = common.captured_checked(d, x, topk_idx, topk_weights, bound, dist.get_rank() * d.num_local_experts)
    wrong = common.wrong_rows(checked, x, topk_idx, topk_weights, cfg.num_experts,
                       lossy=cfg.dispatch_wire not in ("native", "bf16", "fp32"))
    runs = common.time_each(replays, args.iters, args.warmup, dev)
    d.check()
    return _row("ours alltoall/nvlink graph", cfg.variant, cfg.dispatch_wire, shape, routing, runs, wrong, traffic,
                ())


def _traffic(out, topk_idx: torch.Tensor, dispatch_row_bytes: int, dev) -> dict:
    """Mean over ranks of the bytes a rank sends per direction and tier
    (``Dispatched.stats``: remote peers only), and of the bytes of the rows a rank
    receives in dispatch, one per (token, rank) with its own included (DeepEP's
    count; the same for every variant, from the routing)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    hits = torch.zeros(topk_idx.shape[0], world + 1, dtype=torch.bool, device=topk_idx.device)
    dest = torch.where(topk_idx >= 0, topk_idx // (out.handle.owner.config.num_experts // world), world)
    hits.scatter_(1, dest, True)
    per_rank = hits[:, :world].sum(0).double()
    dist.all_reduce(per_rank)
    stats = out.stats.as_dict()
    keys = [k for k in stats if k.endswith("_bytes") or k.endswith("_rows")]
    t = torch.tensor([float(stats[k]) for k in keys] + [per_rank[rank].item() * dispatch_row_bytes],
                     dtype=torch.float64, device=dev)
    dist.all_reduce(t)
    t /= world
    traffic = dict(zip(keys, t[:-1].tolist()))
    traffic["dispatch_bytes_out"] = traffic["dispatch_intra_bytes"] + traffic["dispatch_inter_bytes"]
    traffic["combine_bytes_out"] = traffic["combine_intra_bytes"] + traffic["combine_inter_bytes"]
    traffic["dispatch_bytes_received"] = t[-1].item()
    return traffic


def _megatron(kind, shape, routing, x, topk_idx, topk_weights, args, dev) -> dict:
    from dispatch.bench import megatron_baseline as mb

    routing_map, probs = mb.routing_to_megatron(topk_idx, topk_weights, shape.experts)
    md = mb.build_megatron_dispatcher(kind, shape.experts, shape.topk, shape.hidden)
    first = dist.get_rank() * (shape.experts // dist.get_world_size())
    result = mb.megatron_round_trip(md, x, routing_map, probs, weight_by_probs=True, first_expert=first)
    wrong = common.wrong_rows(result, x, topk_idx, topk_weights, shape.experts)
    traffic = {}
    if kind == "alltoall":  # one row per (token, expert) pair; no deduplication
        world, rank = dist.get_world_size(), dist.get_rank()
        home = topk_idx // (shape.experts // world)
        t = torch.stack([(home != rank).sum(), torch.tensor(0, device=dev)]).double()
        received = torch.bincount(home.flatten(), minlength=world).double()
        dist.all_reduce(received)
        t[1] = received[rank]
        dist.all_reduce(t)
        t /= world
        row_bytes = shape.hidden * x.element_size()
        traffic = {"dispatch_bytes_out": t[0].item() * row_bytes, "combine_bytes_out": t[0].item() * row_bytes,
                   "dispatch_bytes_received": t[1].item() * row_bytes}

    def step(timer):  # the round trip checked: its experts weigh their rows (as DeepEP's are charged to)
        mb.megatron_round_trip(md, x, routing_map, probs, weight_by_probs=True, first_expert=first, timer=timer)

    runs = common.time_phases(step, args.iters, args.warmup, dev, SECTIONS, whole=True)
    return _row(f"megatron {kind}", kind, "native", shape, routing, runs, wrong, traffic, PHASES)


def _deepep(buffer, shape, routing, x, topk_idx, topk_weights, args, dev) -> list[dict]:
    """DeepEP's intranode round trip eager, then its kernels along a cached
    layout (``dispatch.bench.deepep_baseline`` says what each includes)."""
    from dispatch.bench import deepep_baseline as db

    result, layout = db.deepep_round_trip(buffer, x, topk_idx, topk_weights, shape.experts)
    wrong = common.wrong_rows(result, x, topk_idx, topk_weights, shape.experts)

    def step(timer):
        db.deepep_round_trip(buffer, x, topk_idx, topk_weights, shape.experts, timer=timer)

    runs = common.time_phases(step, args.iters, args.warmup, dev, SECTIONS, whole=True)
    eager = _row(DEEPEP_EAGER, "deepep", "native", shape, routing, runs, wrong, {}, PHASES)
    cached = common.wrong_rows(db.deepep_cached_round_trip(buffer, x, layout), x, topk_idx, topk_weights, shape.experts)

    def cached_step(timer):
        db.deepep_cached_round_trip(buffer, x, layout, timer=timer)

    runs = common.time_phases(cached_step, args.iters, args.warmup, dev, SECTIONS, whole=True)
    kernels = _row(DEEPEP_CACHED, "deepep", "native", shape, routing, runs, cached, {}, PHASES)
    return [eager, kernels]


def _row(name, variant, wire, shape, routing, runs, wrong, traffic, phases) -> dict:
    dispatch_ms = [r["dispatch"] for r in runs]
    combine_ms = [r["combine"] for r in runs]
    row = {
        "name": (name if wire == "native" else f"{name} {wire}")
        + (f" (chose {traffic['auto_choice']})" if traffic.get("auto_choice") else ""),
        "variant": variant,
        "wire": wire,
        "shape": asdict(shape),
        "routing": routing,
        "world_size": dist.get_world_size(),
        "round_trip_ms": common.spread([r["total"] for r in runs]),
        **({"round_trip_marked_ms": common.spread([r["marked"] for r in runs])} if "marked" in runs[0] else {}),
        "dispatch_ms": common.spread(dispatch_ms),
        "combine_ms": common.spread(combine_ms),
        "phases_ms": {p: common.spread([r[p] for r in runs])["median"] for p in phases if p in runs[0]},
        "wrong": wrong,
        **traffic,
    }
    received = traffic.get("dispatch_bytes_received")
    if received:
        row["deepep_dispatch_gbps"] = received / (row["dispatch_ms"]["median"] * 1e6)
        row["deepep_combine_gbps"] = received / (row["combine_ms"]["median"] * 1e6)
    return row


def _profile(d, x, topk_idx, topk_weights, args, shape, dev) -> None:
    """Profile 5 round trips; rank 0 writes the op table (what the time goes to)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    dist.barrier()
    with profile(activities=activities) as prof:
        for _ in range(5):
            out = d.dispatch(x, topk_idx, topk_weights)
            d.combine(out.tokens, out.handle, weights=out.weights)
        if dev.type == "cuda":
            torch.cuda.synchronize()
    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"profile-{shape.name}-w{dist.get_world_size()}.txt")
        averages = prof.key_averages()
        with open(path, "w") as f:
            for key in ("self_cpu_time_total", "self_device_time_total" if dev.type == "cuda" else "count"):
                f.write(f"sorted by {key}\n{averages.table(sort_by=key, row_limit=40)}\n")


# -- report ---------------------------------------------------------------


def _mb(value) -> str:
    return "-" if value is None else f"{value / 1e6:.1f}"


def _ms(stats: dict) -> str:
    return f"{stats['median']:.3f}"


def _paired(rows: list[dict]) -> bool:
    return any("pair" in r for r in rows)


def markdown_table(rows: list[dict]) -> str:
    paired = _paired(rows)
    head = ["shape", "routing", "dispatcher", *(["pair"] if paired else []), "round trip ms", "p10-p90",
            "vs megatron a2a", "dispatch ms", "combine ms", *PHASES, "MB out/rank (dispatch, combine)",
            "of which inter-node", "DeepEP-style GB/s (dispatch, combine)", "auto in turns: / the fastest", "#wrong"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        base = _baseline(rows, r)
        speedup = f"{base / r['round_trip_ms']['median']:.2f}x" if base else "-"
        rt = r["round_trip_ms"]
        phases = [f"{r['phases_ms'][p]:.3f}" if p in r["phases_ms"] else "-" for p in PHASES]
        moved = f"{_mb(r.get('dispatch_bytes_out'))}, {_mb(r.get('combine_bytes_out'))}"
        inter = f"{_mb(r.get('dispatch_inter_bytes'))}, {_mb(r.get('combine_inter_bytes'))}"
        bw = (", ".join(f"{r[k]:.0f}" if r[k] >= 10 else f"{r[k]:.2g}" for k in ("deepep_dispatch_gbps",
                                                                                "deepep_combine_gbps"))
              if "deepep_dispatch_gbps" in r else "-")
        lines.append("| " + " | ".join([
            r["shape"]["name"], r["routing"], r["name"], *([r.get("pair", "-")] if paired else []), _ms(rt),
            f"{rt['p10']:.3f}-{rt['p90']:.3f}", speedup,
            _ms(r["dispatch_ms"]), _ms(r["combine_ms"]), *phases, moved, inter, bw, _in_turns(r), str(r["wrong"]),
        ]) + " |")
    return "\n".join(lines)


def _baseline(rows: list[dict], row: dict) -> float | None:
    for r in rows:
        if (r["name"] == "megatron alltoall" and r["shape"]["name"] == row["shape"]["name"]
                and r["routing"] == row["routing"]):
            return r["round_trip_ms"]["median"]
    return None


def summary(rows: list[dict]) -> str:
    """The fixed-width table printed at the end of a run, with the notes on its columns."""
    paired = _paired(rows)
    cols = [("shape", "", 13), ("routing", "", 9), ("dispatcher", "", 40), *([("pair", "", 9)] if paired else []),
            ("round trip", "(ms)", 10), ("dispatch", "(ms)", 9), ("combine", "(ms)", 9), ("vs megatron a2a", "", 15),
            ("auto in turns", "/ the fastest", 26), ("#wrong", "", 7)]
    body = []
    for r in rows:
        base = _baseline(rows, r)
        body.append([r["shape"]["name"], r["routing"], r["name"], *([r.get("pair", "-")] if paired else []),
                     _ms(r["round_trip_ms"]), _ms(r["dispatch_ms"]), _ms(r["combine_ms"]),
                     f"{base / r['round_trip_ms']['median']:.2f}x" if base else "-", _in_turns(r), str(r["wrong"])])
    return "\n".join([common.fixed_width(cols, body), *(f"({note})" for note in _notes_on_columns(rows))])


def _notes_on_columns(rows: list[dict]) -> list[str]:
    """What the summary and the written report say of a column left empty, and of the pairs."""
    notes = ["round trip: each run timed whole, without the phase marks (which add host work, and set the "
             "engine's compiled usual calls aside); dispatch and combine: from runs with the marks, taken in turns "
             "with those"]
    if not any(r["name"] == "megatron alltoall" for r in rows):
        notes.append("vs megatron a2a: - because Megatron-Core's alltoall dispatcher did not run here: it runs on GPUs "
                     "where megatron-core imports, unless --baselines none")
    if _paired(rows):
        notes.append("pair: eager, our eager round trip on the NVLink engine beside DeepEP's (each with its "
                     "layout and one host read); captured, ours with max_rows in a CUDA graph beside DeepEP's kernels "
                     "on a cached layout (no host read); a DeepEP row is compared with its pair only. Not like for "
                     "like: DeepEP at 24 SMs, ours on every SM; DeepEP's rows include one elementwise kernel weighing "
                     "its experts' rows (its combine sums unweighted), which ours does inside its combine")
    return notes


def report(result: dict, args: argparse.Namespace) -> str:
    rows, world = result["rows"], result["world_size"]
    where = common.environment().get("gpu", "CPU gloo")
    nodes = result.get("nodes", 1)
    tier = ""
    if nodes > 1:
        tier = f", as {nodes} nodes x {world // nodes}"
    title = (f"dispatch + combine, W={world}{tier}, {result['dtype']} tokens, {where}"
             + ("" if result.get("grad", True) else ", under torch.no_grad"))
    stem = f"dispatch-w{world}" + (f"-{nodes}nodes" if nodes > 1 else "")
    notes = [
        "Times: median over the timed runs, the slowest rank's per run. Megatron-Core's six stages "
        "(dispatch_preprocess, token_dispatch, dispatch_postprocess, combine_preprocess, token_combine, "
        "combine_postprocess) fill the six phase columns in that order. MB out/rank: bytes sent to other "
        "ranks per direction. DeepEP-style GB/s: bytes of the rows a rank receives in dispatch (its own "
        "included: one row per (token, rank) for ours, one per (token, expert) for Megatron's alltoall, "
        "what each actually moves) over the dispatch time, and over the combine time. Auto in turns: "
        "the auto row and the other eager rows of ours with its wire timed again, run by run in turns; auto's "
        "median over the fastest one's, and which one that was. #wrong: rows of a round trip through experts that "
        "each scale their rows by 1 + e / E that differ from x * sum_k w_k (1 + e_k / E).",
        *_notes_on_columns(rows),
    ]
    png = plots.round_trip_plot(rows, os.path.join(args.out, stem + ".png"), title, PHASES)
    if png:
        notes.append(f"plot: {os.path.basename(png)}")
    return common.write_results(args.out, stem, title, markdown_table(rows), result, notes)
