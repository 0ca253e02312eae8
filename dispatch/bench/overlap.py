"""``dispatch-bench overlap``: how much of the exchange MoEExchange hides behind the experts.

For each model shape, forward and forward+backward of the MoE layer
(exchange + GroupedExperts), on every local GPU with NCCL (or a tiny CPU world on
gloo, as a smoke test):

    T_comm      the exchange alone (MoEExchange, G = 1, identity experts)
    T_compute   the experts alone, on the rows one dispatch delivers
    T_seq       MoEExchange(G = 1) with GroupedExperts
    T_pipe      MoEExchange(G) with GroupedExperts, the best G of ``--groups``
                (G groups of local experts; a G above E_local is taken as
                E_local). Each expert's weights are read once per GEMM for
                every G: a group's grouped GEMM computes its experts only
    hidden      (T_seq - T_pipe) / min(T_comm, T_compute)   (1 = fully hidden)
    ceiling     hidden at T_pipe = max(T_comm, T_compute), the most a pipeline
                can reach here: 1 where T_seq = T_comm + T_compute, less (more)
                where the layer at G = 1 costs less (more) than that sum
    weights     the experts' weights handed to matrix products in one step, in units
                of all their weights ("seq" and each G): every product whose
                operand is a view of an expert parameter, with a non-empty result,
                adds the bytes of that view (counted at the dispatcher's aten level,
                so the backward's products count too). 1 forward and 2 forward+
                backward where each expert's weights are read once per GEMM, for
                every G
    peak        on CUDA, forward+backward: the most memory one step allocates above
                what was allocated before it (MiB, the largest rank's), for the
                sequential layer ("seq", G = 1) and each G
    host        the host's time to return from the step (on CUDA: to queue its
                work), the slowest rank's, for "seq" and each G: where it nears
                T_pipe, the host sets the pipeline's pace
    T_graph     with ``--graph`` (the NVLink engine, NVSHMEM): MoEExchange in one piece with
                ``max_rows`` (the largest N + 10%), the pass captured in a CUDA graph
                and replayed: no host in the loop (the time of one replay of
                ``GRAPH_REPLAYS`` queued back to back); by each G of ``--groups``;
                beside it the experts alone captured and replayed the same way
                (T_compute_graph, on the N rows; the layer's experts get the M
                rows, whose elementwise work covers the 10% past N), and
                T_graph / T_compute_graph
    T_mb        with ``--micro-batches [M]``: M (default 2) micro-batches of the shape
                through MoEMicroBatches (each one's dispatch and combine, and their
                backward, in flight beside another's experts, on its explicit schedule),
                against T_mb_serial, the same call with every kernel on the caller's
                stream in the order issued (the same work with nothing beside anything
                and no carveout: the difference is what the overlap gains less what the
                carveout costs); hidden_mb = (T_mb_serial - T_mb) /
                (M min(T_comm, T_compute)), at most (M - 1) / M; and T_mb_layer,
                MoEExchange (G = 1) on each in a row, the experts' gradients summed
                over them as a training step accumulates them (what a user runs
                without MoEMicroBatches); on CUDA forward+backward, the peak memory
                of T_mb_layer's step and of T_mb's. With ``--sm-carveout N`` the
                overlapped micro-batches' GEMMs leave N SMs to the exchange beside them;
                with ``--sm-partition N``, MoEMicroBatches(sm_partition=N): their exchange
                on an SM partition of N SMs, their GEMMs on the rest; with ``--graph``,
                T_mb_serial and T_mb also of the step captured whole (each dispatch with
                T_graph's ``max_rows``), replayed as T_graph is, and their hidden_mb

Each time is the slowest rank's, median over ``--iters`` runs after a barrier, CUDA events, after
``--warmup`` runs. ``--comm-max-ctas N`` builds the EP group with an NCCL budget of N CTAs,
``--nvshmem-blocks N`` launches the NVSHMEM kernels with N blocks (a slower exchange, as a slow link).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import dispatch
from dispatch import plan
from dispatch.bench.common import (
    SHAPES, Shape, environment, launch, new_group_with_sm_budget, shapes_fit, time_phases, world_size_for,
)
from dispatch.bench.overlap_mb import micro_batch_cell, micro_batches
from dispatch.bench.roundtrip import make_routing
from dispatch.experts import GroupedExperts

OVERLAP_SHAPES = ("deepseek-v3", "mixtral-8x7b", "cpu-tiny")
PASSES = ("fwd", "fwd+bwd")


def _shapes(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in OVERLAP_SHAPES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown) or 'nothing given'} not among {', '.join(OVERLAP_SHAPES)}")
    return names


def _groups(text: str) -> list[int]:
    """A ``--groups`` value: comma-separated G values, ints >= 1."""
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ints >= 1 (e.g. 1,2,4)")
    return list(dict.fromkeys(int(p) for p in parts))


def build_parser(prog: str = "dispatch-bench overlap", description: str | None = None) -> argparse.ArgumentParser:
    """The overlap command's flags (scripts that wrap it add their own)."""
    parser = argparse.ArgumentParser(prog=prog, description=description or __doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=_shapes,
                        help=f"comma-separated from {', '.join(OVERLAP_SHAPES)} "
                             "(default: deepseek-v3,mixtral-8x7b on GPUs, cpu-tiny on CPU)")
    parser.add_argument("--world-size", type=int, help="ranks (default: all GPUs, or 2 CPU processes)")
    parser.add_argument("--groups", type=_groups, default=[2, 4, 8],
                        help="comma-separated G values tried for T_pipe (default 2,4,8)")
    parser.add_argument("--iters", type=int, default=20, help="timed runs (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs first (default 5)")
    parser.add_argument("--dispatch-wire", default="native", help="DispatchConfig.dispatch_wire (e.g. bf16, fp8)")
    parser.add_argument("--transport", default="nccl", choices=("nccl", "auto", "nvlink", "nvshmem"),
                        help="DispatchConfig.transport (default nccl; over NCCL the alltoall variant moves each "
                             "group of experts as its own all-to-all, the NVLink engine and NVSHMEM get each "
                             "group's rows and put the pre-sums each group completes)")
    parser.add_argument("--max-rows", action="store_true",
                        help="every layer and the micro-batches dispatch with max_rows (the largest N + 10%%; by "
                             "groups, each group's): on the NVLink engine and over NVSHMEM nothing is read on the "
                             "host before the rows move")
    parser.add_argument("--nvshmem-blocks", type=int,
                        help="blocks of the NVSHMEM transport's data kernels (a slower exchange, as over a slow "
                             "link; --transport nvshmem)")
    parser.add_argument("--sm-budget", type=int,
                        help="DispatchConfig.sm_budget: blocks the NVLink engine's data kernels take (default: "
                             "four per SM)")
    parser.add_argument("--comm-max-ctas", type=int, help="NCCL max_ctas of the EP group (a slower exchange)")
    parser.add_argument("--comm-high-priority", action="store_true",
                        help="EP group's NCCL collectives on a high-priority stream (ahead of waiting GEMM blocks)")
    parser.add_argument("--sm-carveout", type=int,
                        help="MoEExchange(sm_carveout=N): SMs the experts' GEMMs leave to the exchange (G > 1); "
                             "with --micro-batches, also the overlapped micro-batches' GEMMs")
    parser.add_argument("--sm-partition", type=int, metavar="N",
                        help="with --micro-batches on CUDA: MoEMicroBatches(sm_partition=N), the overlapped "
                             "micro-batches' exchange on an SM partition of N SMs (rounded up as the device "
                             "requires), their GEMMs on the rest")
    parser.add_argument("--comm-priority", type=int, default=-1,
                        help="MoEExchange(comm_priority=P): CUDA priority of its communication stream (default -1)")
    parser.add_argument("--graph", action="store_true",
                        help="also T_graph: the layer with max_rows (the largest N + 10%%), in one piece and by each "
                             "G of --groups, its pass captured in a CUDA graph and replayed (the NVLink engine or "
                             "NVSHMEM: --transport auto, nvlink or nvshmem); with --micro-batches, the "
                             "micro-batches' step captured too")
    parser.add_argument("--micro-batches", type=int, nargs="?", const=2, metavar="M",
                        help="also T_mb: M (default 2) micro-batches through MoEMicroBatches, against one by one")
    parser.add_argument("--out", default="dispatch-results", help="folder for JSON and markdown results")
    return parser


def parse_args(argv: list[str] | None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Parse and check ``argv``; fills the hardware-dependent default of ``--shapes``."""
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")
    if args.world_size is not None and args.world_size < 1:
        parser.error(f"--world-size must be >= 1, got {args.world_size}")
    if args.sm_carveout is not None and args.sm_carveout < 0:
        parser.error(f"--sm-carveout must be >= 0, got {args.sm_carveout}")
    if args.sm_partition is not None and (args.sm_partition < 1 or not args.micro_batches
                                          or not torch.cuda.is_available()):
        parser.error(f"--sm-partition needs --micro-batches, a GPU and a value >= 1, got {args.sm_partition}")
    if args.sm_partition is not None and args.graph:
        parser.error("--sm-partition: an SM partition's streams are not captured in a CUDA graph (--graph)")
    if args.sm_budget is not None and (args.sm_budget < 1 or args.transport == "nccl"):
        parser.error(f"--sm-budget needs the NVLink engine (--transport auto or nvlink) and a value >= 1, got "
                     f"{args.sm_budget}")
    if args.comm_max_ctas is not None and (args.comm_max_ctas < 1 or not torch.cuda.is_available()):
        parser.error("--comm-max-ctas needs NCCL (a GPU) and a value >= 1")
    if args.comm_high_priority and not torch.cuda.is_available():
        parser.error("--comm-high-priority needs NCCL (a GPU)")
    if args.nvshmem_blocks is not None and (args.nvshmem_blocks < 1 or args.transport != "nvshmem"):
        parser.error(f"--nvshmem-blocks needs --transport nvshmem and a value >= 1, got {args.nvshmem_blocks}")
    if args.max_rows and args.transport == "nccl" and max(args.groups) > 1:
        parser.error("--max-rows with a G > 1 in --groups needs the NVLink engine or NVSHMEM (--transport auto, "
                     "nvlink or nvshmem): over NCCL a dispatch by groups takes no max_rows")
    if args.micro_batches is not None and args.micro_batches < 2:
        parser.error(f"--micro-batches needs M >= 2, got {args.micro_batches}")
    if args.graph and (args.transport == "nccl" or not torch.cuda.is_available()):
        parser.error("--graph needs the NVLink engine or NVSHMEM (--transport auto, nvlink or nvshmem, on GPUs): "
                     "over NCCL a dispatch reads its counts on the host, which a CUDA graph cannot hold")
    try:
        dispatch.DispatchConfig.from_options(num_experts=8, dispatch_wire=args.dispatch_wire, transport=args.transport)
    except ValueError as exc:
        parser.error(f"--dispatch-wire: {exc}")
    args.shapes = args.shapes or (["deepseek-v3", "mixtral-8x7b"] if torch.cuda.is_available() else ["cpu-tiny"])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not shapes_fit(args.shapes, world_size_for(args.world_size, cpu_default=2), "dispatch-bench overlap"):
        return 2
    return launch(_job, args, args.world_size, cpu_default=2)


def ep_group(args):
    """The EP group: the world's (None), or an NCCL group with ``--comm-max-ctas`` /
    ``--comm-high-priority``. Every rank must call it."""
    if args.comm_max_ctas is None and not args.comm_high_priority:
        return None
    return new_group_with_sm_budget(None, args.comm_max_ctas, high_priority=args.comm_high_priority)


def _job(args: argparse.Namespace) -> None:
    group = ep_group(args)
    for name in args.shapes:
        rows = run_shape(SHAPES[name], args, group)
        if dist.get_rank() == 0:
            report(SHAPES[name], rows, args)


@dataclass
class Case:
    """One shape's layer inputs on this rank: its dispatcher, experts, tokens
    [T, H] with an output gradient, the uniform routing, and the rows [N, H]
    one dispatch delivers (with their [E_local] counts) for the experts alone."""

    dispatcher: dispatch.TokenDispatcher
    experts: GroupedExperts
    x: torch.Tensor
    grad: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    tokens: torch.Tensor
    tokens_per_expert: torch.Tensor
    more: list  # the tokens of the micro-batches past the first (same routing)

    def layer(self, groups: int, comm_priority: int = -1, experts=None, sm_carveout=None,
              max_rows: int | None = None) -> dispatch.MoEExchange:
        """MoEExchange(groups) over these experts (or ``experts``)."""
        return dispatch.MoEExchange(self.dispatcher, self.experts if experts is None else experts,
                                    groups=groups, comm_priority=comm_priority, sm_carveout=sm_carveout,
                                    max_rows=max_rows)

    def bound(self, group, groups: int = 1) -> int:
        """max_rows of a dispatch by ``groups`` groups: the most rows a rank of
        ``group`` receives, plus 10%; by groups, G times the most rows of one group
        of a rank, plus 10% (collective)."""
        bounds = plan.expert_groups(self.dispatcher.num_local_experts, groups)
        per_group = [int(self.tokens_per_expert[lo:hi].sum()) for lo, hi in zip(bounds[:-1], bounds[1:])]
        most = torch.tensor([max(per_group)], device=self.x.device)  # host sync: the fullest group, once
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
        return groups * (int(most.item() * 1.1) + 1)  # host sync: the bound, once

    def layer_bounded(self, comm_priority: int, group, groups: int = 1) -> dispatch.MoEExchange:
        """MoEExchange by ``groups`` groups with max_rows (:meth:`bound`), for a CUDA graph."""
        if not self.dispatcher.host_free:
            raise ValueError(f"--graph: {type(self.dispatcher).__name__} reads its counts on the host")
        return self.layer(groups, comm_priority, max_rows=self.bound(group, groups))

    def layer_step(self, layer, backward: bool):
        """One forward (and backward) of ``layer`` on the case's tokens."""
        def run():
            xs = self.x.detach().requires_grad_(backward)
            ws = self.topk_weights.detach().requires_grad_(backward)
            out = layer(xs, self.topk_idx, ws)
            if backward:
                out.backward(self.grad)
                self.experts.zero_grad(set_to_none=True)
            return out

        return run

    def compute_step(self, backward: bool, counts: torch.Tensor | None = None):
        """One forward (and backward) of the experts alone on the dispatched rows
        (``counts``: the rows per expert to give them, by default the dispatch's)."""
        counts = self.tokens_per_expert if counts is None else counts

        def run():
            leaf = self.tokens.detach().requires_grad_(backward)
            y = self.experts(leaf, counts)
            if backward:
                y.backward(torch.ones_like(y))
                self.experts.zero_grad(set_to_none=True)

        return run


def make_case(shape: Shape, args, group) -> Case:
    """The layer inputs of ``shape`` on this rank (bf16 on CUDA, fp32 on CPU)."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if args.nvshmem_blocks is not None:  # every launch of NVSHMEM's data kernels
        from dispatch.kernels import nvshmem_puts

        nvshmem_puts.blocks = args.nvshmem_blocks
    config = dispatch.DispatchConfig.from_options(num_experts=shape.experts, dispatch_wire=args.dispatch_wire,
                                     transport=args.transport, sm_budget=args.sm_budget)
    d = dispatch.create(config, group)
    torch.manual_seed(1234 + rank)
    experts = GroupedExperts(d.num_local_experts, shape.hidden, shape.ffn, dtype=dtype, device=device)
    x = torch.randn(shape.tokens, shape.hidden, device=device, dtype=dtype)
    grad = torch.randn_like(x)
    topk_idx, topk_weights = make_routing("uniform", shape, world, rank, device)
    planned = d.dispatch(x, topk_idx, topk_weights)
    more = [torch.randn_like(x) for _ in range((args.micro_batches or 1) - 1)]
    return Case(d, experts, x, grad, topk_idx, topk_weights, planned.tokens.detach(), planned.tokens_per_expert, more)


def capture(step) -> torch.cuda.CUDAGraph:
    """``step()`` (a pass of ``case.layer_step`` or ``case.compute_step``) captured in
    a CUDA graph after two eager runs (buffers sized, kernels compiled), those
    and the capture on one side stream: a step whose side work follows the
    caller's stream (``micro_batch_step``'s serial one) takes the same streams
    in both, so the capture waits for no stream outside it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.synchronize()  # host sync: nothing of the eager runs in flight at the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    return graph


GRAPH_REPLAYS = 4  # replays queued back to back in one timed run of a captured pass


def _graph_ms(step, timed) -> float:
    """Time of one replay of ``step()`` captured in a CUDA graph
    (:func:`capture`): ``GRAPH_REPLAYS`` replays queued back to back, as a
    training loop queues its steps, so that the host's launch of a replay is
    behind the previous one on the GPU (a lone replay's time starts with the
    GPU waiting for it). The graph is freed after its timing, so that graphs of
    several G never hold their memory pools at once."""
    graph = capture(step)

    def replays():
        for _ in range(GRAPH_REPLAYS):
            graph.replay()

    try:
        return timed(replays)[0] / GRAPH_REPLAYS
    finally:
        torch.cuda.synchronize()  # host sync: the last replay done before its pool goes
        graph.reset()
        torch.cuda.empty_cache()


def group_values(args, num_local_experts: int) -> list[int]:
    """The G values of ``--groups``, each at most E_local, without repeats."""
    return list(dict.fromkeys(min(g, num_local_experts) for g in args.groups))


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


_MATMULS = frozenset({"mm", "bmm", "addmm", "baddbmm", "_grouped_mm"})


class _WeightReads(TorchDispatchMode):
    """While active: ``bytes``, the bytes of ``params``' views handed to matrix
    products whose result is not empty."""

    def __init__(self, params):
        super().__init__()
        self.storages = {p.untyped_storage().data_ptr() for p in params}
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in _MATMULS and out.numel():
            self.bytes += sum(t.numel() * t.element_size() for t in args
                              if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.storages)
        return out


def _weight_reads(fn, experts: nn.Module, device, group) -> float:
    """The experts' weights that one run of ``fn`` hands to matrix products, in
    units of all their weights (:class:`_WeightReads`), the largest over the
    ranks (collective)."""
    params = list(experts.parameters())
    with _WeightReads(params) as reads:
        fn()
    total = sum(p.numel() * p.element_size() for p in params)
    ratio = torch.tensor([reads.bytes / total], device=device)
    dist.all_reduce(ratio, op=dist.ReduceOp.MAX, group=group)
    return float(ratio)


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


def run_shape(shape: Shape, args, group) -> list[dict]:
    """Collective: one row per pass (forward, forward+backward) of ``shape``."""
    case = make_case(shape, args, group)
    device, world = case.x.device, dist.get_world_size(group)
    prio, carve = args.comm_priority, args.sm_carveout

    def timed(fn):
        return _time(fn, args.iters, args.warmup, device)

    candidates = group_values(args, case.dispatcher.num_local_experts)
    bound = case.bound(group) if args.max_rows else None
    if bound and max(candidates) > 1 and not case.dispatcher.transport.bounded_groups:  # (auto's choice: alike)
        raise ValueError(f"--max-rows: {case.dispatcher.transport.key} moves no dispatch by groups with max_rows; "
                         "use --groups 1")
    rows = []
    for name in PASSES:
        backward = name == "fwd+bwd"
        t_comm = timed(case.layer_step(case.layer(1, prio, experts=lambda t, n: t, max_rows=bound), backward))[0]
        t_compute = timed(case.compute_step(backward))[0]
        seq = case.layer(1, prio, max_rows=bound)
        t_seq, seq_host = timed(case.layer_step(seq, backward))
        layers = {g: case.layer(g, prio, sm_carveout=carve, max_rows=case.bound(group, g) if bound else None)
                  for g in candidates}
        pipe_times = {g: timed(case.layer_step(layers[g], backward)) for g in candidates}
        by_groups = {g: gpu for g, (gpu, _) in pipe_times.items()}
        best = min(by_groups, key=by_groups.get)
        with torch.no_grad():
            want = seq(case.x, case.topk_idx, case.topk_weights)
            got = layers[best](case.x, case.topk_idx, case.topk_weights)
        diff = torch.tensor([(got.float() - want.float()).abs().max().item() if got.numel() else 0.0], device=device)
        dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=group)
        peak = None
        if backward and device.type == "cuda":  # the sequential layer (G = 1) first, then each G
            peak = {"seq": _peak_mib(case.layer_step(seq, True), device, group)}
            peak.update({str(g): _peak_mib(case.layer_step(layers[g], True), device, group) for g in candidates})
        weights = {"seq": _weight_reads(case.layer_step(seq, backward), case.experts, device, group)}
        weights.update({str(g): _weight_reads(case.layer_step(layers[g], backward), case.experts, device, group)
                        for g in candidates})
        t_graph, graph_by_groups, t_compute_graph = None, None, None
        if args.graph:  # the layer in one piece, and by each G, captured
            graph_by_groups = {g: _graph_ms(case.layer_step(case.layer_bounded(prio, group, g), backward), timed)
                               for g in sorted({1, *candidates})}
            t_graph = graph_by_groups[1]
            # the experts alone captured and replayed the same way (their counts on the device)
            t_compute_graph = _graph_ms(case.compute_step(backward, case.tokens_per_expert.to(device)), timed)
        short, long = sorted((t_comm, t_compute))
        mb = {}
        if args.micro_batches:
            mb = micro_batches(case, seq, backward, timed, lambda fn: _peak_mib(fn, device, group), group, carve, bound,
                               args.sm_partition, graph_ms=(lambda fn: _graph_ms(fn, timed)) if args.graph else None,
                               graph_rows=bound or (case.bound(group) if args.graph else None))
        if mb:
            mb["hidden_mb"] = (mb["t_mb_serial_ms"] - mb["t_mb_ms"]) / (args.micro_batches * short)
        if "t_mb_graph_ms" in mb:
            mb["hidden_mb_graph"] = (mb["t_mb_serial_graph_ms"] - mb["t_mb_graph_ms"]) / (args.micro_batches * short)
        rows.append(dict(
            shape=shape.name, passes=name, world_size=world, dispatch_wire=args.dispatch_wire,
            transport=type(case.dispatcher.transport).__name__,
            comm_max_ctas=args.comm_max_ctas, comm_high_priority=args.comm_high_priority, sm_carveout=carve,
            sm_budget=args.sm_budget, max_rows=bound, nvshmem_blocks=args.nvshmem_blocks, sm_partition=args.sm_partition,
            t_comm_ms=t_comm, t_compute_ms=t_compute, t_seq_ms=t_seq, t_pipe_ms=by_groups[best], best_groups=best,
            t_pipe_by_groups_ms={str(g): t for g, t in by_groups.items()},
            hidden_fraction=(t_seq - by_groups[best]) / short, hidden_ceiling=(t_seq - long) / short,
            max_abs_diff_vs_seq=float(diff), weight_reads=weights, peak_mib=peak, t_graph_ms=t_graph,
            t_compute_graph_ms=t_compute_graph,
            t_graph_by_groups_ms=None if graph_by_groups is None else {str(g): t for g, t in graph_by_groups.items()},
            **mb,
            host_ms={"seq": seq_host, **{str(g): host for g, (_, host) in pipe_times.items()}},
        ))
    return rows


def suffix(args) -> str:
    """What sets a run apart, for its file names: "-auto", "-fp8", "-ctas2", "-hiprio"."""
    wire = "" if args.transport == "nccl" else f"-{args.transport}"
    wire += "" if args.dispatch_wire == "native" else f"-{args.dispatch_wire}"
    ctas = "" if args.comm_max_ctas is None else f"-ctas{args.comm_max_ctas}"
    carve = "" if args.sm_carveout is None else f"-carve{args.sm_carveout}"
    carve += "" if args.sm_budget is None else f"-budget{args.sm_budget}"
    carve += "" if args.nvshmem_blocks is None else f"-blocks{args.nvshmem_blocks}"
    carve += "" if args.sm_partition is None else f"-split{args.sm_partition}"
    return (wire + ctas + ("-hiprio" if args.comm_high_priority else "") + carve + ("-graph" if args.graph else "")
            + ("-bounded" if args.max_rows else "") + ("-mb" if args.micro_batches else "")
            + (str(args.micro_batches) if (args.micro_batches or 2) > 2 else ""))


def _graph_cell(row: dict) -> str:
    """T_graph of a row, with the experts alone captured beside it and its times by
    G where more than one G was captured."""
    if row.get("t_graph_ms") is None:
        return "-"
    by_g = row.get("t_graph_by_groups_ms") or {}
    more = ", ".join(f"{g}: {t:.2f}" for g, t in by_g.items() if g != "1")
    experts = row.get("t_compute_graph_ms")
    alone = "" if experts is None else f" / experts {experts:.3f} ({row['t_graph_ms'] / experts:.3f}x)"
    return f"{row['t_graph_ms']:.3f}" + alone + (f" (by G: {more})" if more else "")


def _budget(row: dict) -> str:
    """The engine's SM budget (or NVSHMEM's blocks) of a row and its max_rows, for the dispatcher cell."""
    blocks = row.get("sm_budget") or row.get("nvshmem_blocks")
    return (("" if blocks is None else f" ({blocks} blocks)")
            + ("" if row.get("max_rows") is None else f", max_rows {row['max_rows']}"))


def markdown_table(rows: list[dict]) -> str:
    head = ["shape", "pass", "W", "dispatcher", "wire", "carveout", "max_ctas", "NCCL stream", "T_comm ms",
            "T_compute ms", "T_seq ms", "T_pipe ms", "best G", "hidden", "ceiling", "T_pipe by G", "T_graph ms",
            "T_mb_layer / T_mb_serial / T_mb ms (hidden_mb)", "max abs diff", "weights read by G", "peak MiB by G",
            "host ms by G"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        by_g = ", ".join(f"{g}: {t:.2f}" for g, t in r["t_pipe_by_groups_ms"].items())
        lines.append(
            f"| {r['shape']} | {r['passes']} | {r['world_size']} | {r.get('transport', '-')}{_budget(r)} | "
            f"{r['dispatch_wire']} | "
            f"{r.get('sm_carveout') if r.get('sm_carveout') is not None else '-'}"
            f"{'' if r.get('sm_partition') is None else ', T_mb split ' + str(r['sm_partition'])} | "
            f"{r['comm_max_ctas'] or '-'} | {'high priority' if r['comm_high_priority'] else 'default'} | "
            f"{r['t_comm_ms']:.3f} | {r['t_compute_ms']:.3f} | {r['t_seq_ms']:.3f} | {r['t_pipe_ms']:.3f} | "
            f"{r['best_groups']} | {r['hidden_fraction']:.2f} | {r['hidden_ceiling']:.2f} | {by_g} | "
            f"{_graph_cell(r)} | "
            f"{micro_batch_cell(r)} | "
            f"{r['max_abs_diff_vs_seq']:.3g} | {_by_c(r.get('weight_reads'), '.2f')} | {_by_c(r['peak_mib'])} | "
            f"{_by_c(r['host_ms'], '.2f')} |"
        )
    return "\n".join(lines)


def _by_c(values: dict | None, fmt: str = ".0f") -> str:
    """"seq: 5120, 2: 4990, ..." (the sequential layer first), or "-" where not measured."""
    return "-" if not values else ", ".join(f"{g}: {value:{fmt}}" for g, value in values.items())


def report(shape: Shape, rows: list[dict], args) -> None:
    """Print the table; write ``overlap-<shape>-w<W><suffix>.json`` and ``.md`` under ``--out``."""
    env = environment()
    title = (f"overlap of exchange and experts, {shape.name} (T={shape.tokens}, H={shape.hidden}, "
             f"E={shape.experts}, K={shape.topk}, ffn={shape.ffn}), W={rows[0]['world_size']}")
    table = markdown_table(rows)
    env_line = "environment: " + ", ".join(f"{k} {v}" for k, v in env.items())
    print("\n".join([title, "", table, "", env_line]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"overlap-{shape.name}-w{rows[0]['world_size']}{suffix(args)}")
    with open(stem + ".json", "w") as f:
        json.dump({"title": title, "shape": asdict(shape), "environment": env, "rows": rows,
                   "iters": args.iters, "warmup": args.warmup}, f, indent=2)
    with open(stem + ".md", "w") as f:
        f.write(f"# {title}\n\n{table}\n\n{env_line}\n")


if __name__ == "__main__":
    sys.exit(main())
