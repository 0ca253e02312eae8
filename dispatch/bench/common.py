"""What every benchmark of ``dispatch-bench`` shares: shapes, the process world,
timing, progress and the result files.

Timing convention (``bench/results/README.md`` states it too): warm-up first,
then every timed run starts after a barrier, is measured with CUDA events on the
GPU (``perf_counter`` on CPU), and the figure of one run is the slowest rank's.
Reports give the median and the 10th-90th percentile spread.
"""

from __future__ import annotations

import datetime
import faulthandler
import functools
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

import dispatch
from dispatch.kernels.gather_sum import bits_of
from dispatch.timing import PhaseTimer


@dataclass(frozen=True)
class Shape:
    """T tokens per rank, hidden H, E experts, top-K, expert ffn hidden size."""

    name: str
    tokens: int
    hidden: int
    experts: int
    topk: int
    ffn: int


SHAPES = {
    s.name: s
    for s in [
        Shape("deepseek-v3", 4096, 7168, 256, 8, 2048),
        Shape("qwen3-235b", 4096, 4096, 128, 8, 1536),
        Shape("mixtral-8x7b", 8192, 4096, 8, 2, 14336),
        Shape("decode", 128, 7168, 256, 8, 2048),
        # small shapes for CPU worlds of gloo processes (the main job without a GPU)
        Shape("cpu-small", 512, 256, 16, 4, 128),
        Shape("cpu-decode", 32, 512, 16, 4, 128),
        Shape("cpu-tiny", 64, 32, 8, 2, 64),
    ]
}
GPU_SHAPES = ("deepseek-v3", "qwen3-235b", "mixtral-8x7b", "decode")
CPU_SHAPES = ("cpu-small", "cpu-decode")


def device() -> torch.device:
    """This rank's device: its GPU under NCCL, else the CPU."""
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# -- the world of processes -------------------------------------------------


def world_size_for(requested: int | None, cpu_default: int = 4) -> int:
    """Ranks a run starts: ``requested``, else every GPU, else ``cpu_default`` CPU processes."""
    if requested:
        return requested
    if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun, maybe several nodes
        return int(os.environ["WORLD_SIZE"])
    return torch.cuda.device_count() if torch.cuda.is_available() else cpu_default


def what_runs(runs: str = "") -> str:
    """One line, said before a run starts: the ranks, their devices and backend, then
    ``runs`` (what the job runs on them: its transports and baselines)."""
    world, backend = dist.get_world_size(), dist.get_backend()
    runs = f"; {runs}" if runs else ""
    if backend == "nccl":
        return f"dispatch-bench: {world} ranks, one per GPU ({torch.cuda.get_device_name()}), NCCL{runs}"
    from dispatch.kernels import plan_cpu

    why = plan_cpu.why_not()
    plan_in = "compiled (csrc/plan_cpu.cpp)" if why is None else f"in torch operations ({why})"
    return (f"dispatch-bench: a CPU world of {world} {backend} processes (no GPU here), with the small CPU shapes"
            f"{runs}; the routing plan {plan_in}")


def shapes_fit(names, world: int, prog: str = "dispatch-bench") -> bool:
    """True if every shape's experts split over ``world`` ranks; else says which on stderr."""
    bad = [n for n in names if SHAPES[n].experts % world]
    if bad:
        print(f"{prog}: experts of {', '.join(bad)} do not split over {world} ranks", file=sys.stderr)
    return not bad


def launch(job: Callable, args, world_size: int | None, cpu_default: int = 4, teardown: bool = True) -> int:
    """Run ``job(args)`` on every rank of a fresh world. Under torchrun
    (``LOCAL_RANK`` set) this process is one rank; otherwise one process per GPU
    (NCCL) or ``world_size`` CPU processes (gloo, default ``cpu_default``) are
    started here. Without ``teardown``, ranks whose job succeeded do not destroy the
    process group after the final barrier (the processes started here exit at once;
    under torchrun it is left to the process's exit): a job that captured NCCL
    collectives in CUDA graphs needs that, because NCCL's communicator destroy then
    never returns (pytorch/pytorch#115388).

    Returns a process exit code (0 on success, 2 for a world that cannot be made).
    """
    if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _rank_main(int(os.environ["LOCAL_RANK"]), job, args, None, teardown)
        return 0
    use_cuda = torch.cuda.is_available()
    world = world_size_for(world_size, cpu_default)
    if not use_cuda:  # the CPU plan built once here, not in every rank at its first dispatch
        from dispatch.kernels import plan_cpu

        if not plan_cpu.cached():
            print("dispatch-bench: compiling the CPU routing plan (csrc/plan_cpu.cpp), once per machine: under a "
                  "minute", flush=True)
        plan_cpu.module()
    if use_cuda and world > torch.cuda.device_count():
        print(f"dispatch-bench: --world-size {world} but only {torch.cuda.device_count()} GPUs", file=sys.stderr)
        return 2
    for attempt in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world)}
        try:
            torch.multiprocessing.spawn(_rank_main, args=(job, args, env, teardown), nprocs=world, join=True)
            return 0
        except torch.multiprocessing.ProcessRaisedException as exc:
            # the free port was taken before rank 0's store bound it: nothing ran yet
            if "EADDRINUSE" not in str(exc) or attempt == 2:
                raise
            print(f"dispatch-bench: port {port} was taken before the world started; another port", file=sys.stderr)
    return 0


TEARDOWN_S = 120  # seconds a rank may take to leave after its job


def _rank_main(local_rank: int, job: Callable, args, env: dict | None, teardown: bool = True) -> None:
    if env is not None:
        os.environ.update(env)
        os.environ["RANK"] = str(local_rank)
    use_cuda = torch.cuda.is_available()
    device_id = None
    if use_cuda:  # bound to its GPU: NCCL's barrier() then knows the device (no warning)
        device_id = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device_id)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=600),
                            device_id=device_id)
    if not use_cuda:  # the CPU's cores shared by the ranks: more threads each spin against the others' work
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    done = False
    try:
        job(args)
        dist.barrier()
        done = True
    except BaseException:
        # spawn reports only the first rank that died; say which one failed first-hand
        print(f"dispatch-bench: rank {dist.get_rank()} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    finally:
        if done and not teardown:
            if env is not None:  # a process of spawn's: its exit status is all it reports
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
            # under torchrun the caller goes on: the process group is left to the process's exit
        else:
            # a rank that cannot leave (a peer gone, a teardown stuck) prints every thread's
            # stack and exits, instead of holding the launcher forever
            faulthandler.dump_traceback_later(TEARDOWN_S, exit=True)
            dist.destroy_process_group()
            faulthandler.cancel_dump_traceback_later()


def new_group_with_sm_budget(
    ranks: list[int] | None, max_ctas: int | None, min_ctas: int | None = None, high_priority: bool = False
):
    """A new NCCL process group whose collectives use at most ``max_ctas``
    thread blocks (CTAs) per GPU and, with ``high_priority``, run on a
    high-priority CUDA stream. Fewer CTAs make the exchange slower: this is how
    the overlap benchmark (``--comm-max-ctas``) emulates a slow link on one
    machine. It is ``dist.new_group(ranks, backend="nccl", pg_options=opts)``
    with ``opts = dist.ProcessGroupNCCL.Options(is_high_priority_stream=high_priority)``
    and ``opts.config.max_ctas = max_ctas``; every rank of the world must call it.

    Args:
        ranks: global ranks of the group (None: the whole world).
        max_ctas: upper bound of CTAs per collective, >= 1; None: NCCL's choice.
        min_ctas: lower bound, in [1, max_ctas] (default 1); only with max_ctas.
        high_priority: run the group's collectives on a high-priority stream.
    """
    if max_ctas is not None and (isinstance(max_ctas, bool) or not isinstance(max_ctas, int) or max_ctas < 1):
        raise ValueError(f"max_ctas must be an int >= 1 or None, got {max_ctas!r}")
    if min_ctas is not None and (max_ctas is None or not isinstance(min_ctas, int) or not 1 <= min_ctas <= max_ctas):
        raise ValueError(f"min_ctas must be an int in [1, max_ctas={max_ctas}], got {min_ctas!r}")
    if not isinstance(high_priority, bool):
        raise TypeError(f"high_priority must be a bool, got {type(high_priority).__name__}")
    if not hasattr(dist, "ProcessGroupNCCL"):
        raise RuntimeError("new_group_with_sm_budget needs a torch build with NCCL")
    opts = dist.ProcessGroupNCCL.Options(is_high_priority_stream=high_priority)
    if max_ctas is not None:
        opts.config.max_ctas = max_ctas
        opts.config.min_ctas = min_ctas if min_ctas is not None else 1
    return dist.new_group(ranks, backend="nccl", pg_options=opts)


# -- timing ------------------------------------------------------------------


def time_phases(
    step: Callable[[PhaseTimer], None],
    iters: int,
    warmup: int,
    dev: torch.device,
    sections: dict[str, tuple[str, ...]] | None = None,
    whole: bool = False,
) -> list[dict[str, float]]:
    """Run ``step(timer)`` ``warmup`` times untimed, then ``iters`` times timed.

    ``step`` marks its phases on the timer (``timer.mark(name)``); ``"total"``,
    from the start to the end of the step, is added, and each of ``sections``
    (name -> the phases it sums, e.g. ``dispatch``) on each rank before ranks
    are compared. Each timed run starts after a barrier; each figure is the
    slowest rank's. Returns one {name: ms} dict per timed run. ``whole``: each
    timed run is followed, after a barrier, by a run of ``step(None)`` (no
    marks: a mark adds host work, and a dispatcher with a phase timer leaves
    its compiled usual calls aside), whose time is the run's ``"total"``; the
    marked run's is ``"marked"`` (the two in turns, so that both see the same
    drift; warmup likewise).
    """
    for _ in range(warmup):
        step(PhaseTimer(dev))
        if whole:
            step(None)
    runs = []
    for _ in range(iters):
        dist.barrier()
        timer = PhaseTimer(dev)
        timer.start()
        step(timer)
        timer.mark("_tail")
        phases = timer.phases()
        phases["total"] = sum(phases.values())
        del phases["_tail"]
        if whole:
            phases["marked"] = phases["total"]
            dist.barrier()
            timer = PhaseTimer(dev)
            timer.start()
            step(None)
            timer.mark("total")
            phases["total"] = timer.phases()["total"]
        for name, members in (sections or {}).items():
            phases[name] = sum(phases.get(m, 0.0) for m in members)
        runs.append(phases)
    names = sorted({name for phases in runs for name in phases})
    table = torch.tensor([[phases.get(n, 0.0) for n in names] for phases in runs], dtype=torch.float64)
    table = table.to(dev)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    return [dict(zip(names, row)) for row in table.cpu().tolist()]


GRAPH_SLACK = 1.1  # max_rows of a captured round trip: this rank's N of a host-read dispatch, plus 10%


def eager_calls(d, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, bound: int | None):
    """(a dispatch made now, {"dispatch", "combine", "total"}: a call of no arguments):
    dispatcher ``d``'s dispatch (``max_rows=bound``), the combine of that dispatch, and
    the round trip."""
    held = d.dispatch(x, topk_idx, topk_weights, max_rows=bound)

    def dispatch_only():
        return d.dispatch(x, topk_idx, topk_weights, max_rows=bound)

    def combine_only():
        return d.combine(held.tokens, held.handle, weights=held.weights)

    def round_trip():
        out = d.dispatch(x, topk_idx, topk_weights, max_rows=bound)
        return d.combine(out.tokens, out.handle, weights=out.weights)

    return held, {"dispatch": dispatch_only, "combine": combine_only, "total": round_trip}


def captured_round_trip(d, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, bound: int):
    """The NVLink engine without the host: a dispatch with ``max_rows=bound``, a
    combine, and the round trip, each run once eagerly and captured in a CUDA
    graph of its own. Returns ``({"dispatch", "combine", "total"}: replay,
    the round trip's output)``, the output rewritten by each replay."""
    held, calls = eager_calls(d, x, topk_idx, topk_weights, bound)
    replays, result = {}, None
    for name, step in calls.items():
        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            result = step()
        # the combine's graph reads the eager dispatch's outputs and plan (held): a
        # replay after they were freed would read whatever the allocator put there since
        replays[name] = functools.partial(_replay, graph, held, x, topk_idx, topk_weights)
    return replays, result


def expert_factor(expert: torch.Tensor, num_experts: int) -> torch.Tensor:
    """fp32 1 + e / E of each global expert id ``e``: what the checked experts
    multiply their rows by (:func:`by_expert`), a factor of its own per expert,
    so that a row the exchange gives the wrong expert, or a weight it puts on
    the wrong slot, changes the result (identity experts would not see either)."""
    return 1 + expert.to(torch.float32) / num_experts


def by_expert(rows: torch.Tensor, per_expert: torch.Tensor, first: int, num_experts: int,
              weights: torch.Tensor | None = None) -> torch.Tensor:
    """Checked experts on expert-major ``rows`` ([N, H], ``per_expert`` [E_local]
    rows each, local expert 0 first; rows past them, padding, as expert
    E_local): each row times :func:`expert_factor` of the expert its place gives
    (global id ``first`` + its local one), and times ``weights`` [N] where given
    (experts that weigh their rows), in fp32, rounded once to ``rows``' dtype.
    No host read: it runs inside a CUDA graph too."""
    ends = torch.cumsum(per_expert.to(device=rows.device, dtype=torch.int64), 0)
    local = torch.searchsorted(ends, torch.arange(rows.shape[0], device=rows.device), right=True)
    scale = expert_factor(local + first, num_experts)
    if weights is not None:
        scale = scale * weights.to(torch.float32)
    return (rows * scale.unsqueeze(1)).to(rows.dtype)  # (fp32 math: the product's dtype)


def wrong_rows(out: torch.Tensor, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
               num_experts: int, lossy: bool = False) -> int:
    """Rows of a round trip of ``x`` through the checked experts (each scales
    its rows by a factor of its own, :func:`by_expert`) that are not
    ``x * sum_k w_k (1 + e_k / E)`` within rounding, summed over the world: a row
    given to the wrong expert or a weight on the wrong slot counts. ``lossy``:
    the dispatch wire is a block format, allowed 1/16 of the row's largest magnitude."""
    factor = torch.where(topk_idx >= 0, expert_factor(topk_idx.clamp(min=0), num_experts), 0.0)
    expected = x.double() * (topk_weights.double() * factor.double()).sum(1, keepdim=True)
    tol = 1e-2 if x.dtype == torch.bfloat16 else 1e-5
    allowed = tol * (1 + expected.abs())
    if lossy:
        allowed = allowed + 0.0625 * expected.abs().amax(1, keepdim=True)
    bad = ((out.double() - expected).abs() > allowed).any(1)
    count = bad.sum().to(torch.int64).reshape(1)
    dist.all_reduce(count)
    return int(count)


def captured_checked(d, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, bound: int,
                     first: int) -> torch.Tensor:
    """The round trip of :func:`captured_round_trip` with the checked experts
    between (:func:`by_expert`, this rank's first expert ``first``), captured
    in a CUDA graph of its own and replayed once: its output (NaN before the
    replay), for the check; the timed graphs keep identity experts."""
    def round_trip():
        out = d.dispatch(x, topk_idx, topk_weights, max_rows=bound)
        y = by_expert(out.tokens, out.tokens_per_expert, first, d.config.num_experts)
        return d.combine(y, out.handle, weights=out.weights)

    round_trip()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = round_trip()
    result.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return result.clone()


def _replay(graph: torch.cuda.CUDAGraph, *inputs) -> None:
    """``graph.replay()``; ``inputs``: what its kernels read, held alive with the replay."""
    graph.replay()


def time_each(steps: dict[str, Callable[[], None]], iters: int, warmup: int, dev: torch.device) -> list[dict]:
    """``iters`` runs of every step (after ``warmup`` untimed ones), taken in
    turns (the order reversed every other run, so that none always follows
    another), each after a barrier and timed alone (:class:`PhaseTimer`: CUDA
    events, or the host clock on CPU); one {name: ms} dict per run, the slowest
    rank's figures (as :func:`time_phases`). Side by side like this, a slow
    spell of the machine falls on every step alike."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    names = list(steps)
    runs = []
    for i in range(iters):
        run = {}
        for name in names if i % 2 == 0 else names[::-1]:
            dist.barrier()
            timer = PhaseTimer(dev)
            timer.start()
            steps[name]()
            timer.mark("run")
            run[name] = timer.phases()["run"]
        runs.append(run)
    table = torch.tensor([[r[n] for n in names] for r in runs], dtype=torch.float64).to(dev)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    return [dict(zip(names, row)) for row in table.cpu().tolist()]


def time_back_to_back(step: Callable[[], None], iters: int, warmup: int, dev: torch.device) -> list[float]:
    """Milliseconds of each of ``iters`` runs of ``step()`` issued back to back
    after one barrier, the slowest rank's, as nccl-tests times a collective: on
    CUDA each run sits between two events on the stream and the host runs ahead,
    so the figure is the device's time, not the host's launch latency."""
    for _ in range(warmup):
        step()
    dist.barrier()
    if dev.type == "cuda":
        torch.cuda.synchronize()  # host sync: start the timed runs on an idle GPU
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            start.record()
            step()
            end.record()
        torch.cuda.synchronize()  # host sync: read the timings
        times = [start.elapsed_time(end) for start, end in events]
    else:
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    worst = torch.tensor(times, dtype=torch.float64, device=dev)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.cpu().tolist()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same dtype, shape and bits: what "bitwise" means in the checks
    (``torch.equal`` takes -0.0 for +0.0, and NaN for unequal to itself)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    return torch.equal(bits_of(a.contiguous()), bits_of(b.contiguous()))


def spread(values: list[float]) -> dict[str, float]:
    """Median and 10th / 90th percentiles (nearest rank) of ``values``."""
    ordered = sorted(values)
    n = len(ordered)
    return {
        "median": statistics.median(ordered),
        "p10": ordered[max(0, math.ceil(0.1 * n) - 1)],
        "p90": ordered[max(0, math.ceil(0.9 * n) - 1)],
    }


# -- progress and results ----------------------------------------------------


class Progress:
    """``[i/n] what ... result`` lines on stderr from rank 0, so a long run shows it is alive."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.done = total, label, 0
        self.started = time.perf_counter()
        self.enabled = dist.get_rank() == 0

    def step(self, what: str, result: str = "") -> None:
        self.done += 1
        if self.enabled:
            elapsed = time.perf_counter() - self.started
            print(f"[{self.label} {self.done}/{self.total} {elapsed:6.1f}s] {what} {result}", file=sys.stderr, flush=True)


def profile_text(profiler, calls: int, top: int = 45, ours: str = "/dispatch/") -> str:
    """A cProfile's statistics in microseconds per call of the profiled step
    (pstats prints seconds to three places, which rounds every function of one
    step to zero): the functions by own time, then those whose file path holds
    ``ours`` by cumulative time."""
    import pstats

    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (primitive calls, calls, own s, cumulative s, callers)

    def line(key, value) -> str:
        file, number, function = key
        where = function if file == "~" else f"{'/'.join(file.split('/')[-3:])}:{number}({function})"
        return f"{value[1] / calls:8.1f} {value[2] * 1e6 / calls:9.1f} {value[3] * 1e6 / calls:9.1f}  {where}"

    head = "   calls   own us    cum us  function (per step)"
    own = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    mine = sorted(((k, v) for k, v in stats.items() if ours in k[0]), key=lambda kv: -kv[1][3])[:top]
    total = sum(v[2] for v in stats.values()) * 1e6 / calls
    return "\n".join([f"{total:.0f} us of host time per step under the profiler", "by own time:", head,
                      *(line(k, v) for k, v in own), f"functions of {ours} by cumulative time:", head,
                      *(line(k, v) for k, v in mine)])


def environment() -> dict:
    """Machine, versions and commit, for every result file."""
    info = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "dispatch": dispatch.__version__,
        "host": socket.gethostname(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    if dist.is_initialized():
        info["backend"] = dist.get_backend()
        info["world_size"] = dist.get_world_size()
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        info["cuda"] = torch.version.cuda
        info["driver"] = _driver_version()
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    info["commit"] = os.environ.get("DISPATCH_COMMIT") or _git_commit()
    sent = _sent_commit()
    if sent is not None and not info["commit"].startswith(sent):  # a copy's git head may be another tree's
        info["sent_tree"] = sent
    return info


def _sent_commit() -> str | None:
    """What ``.dispatch-commit`` at the checkout's root names (``git describe``
    of a tree sent to another machine, whose copy's git history is not the
    tree's), or None."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        ".dispatch-commit")
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _driver_version() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        ).stdout.split()
        return out[0] if out else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _git_commit() -> str:
    """The checkout's HEAD, with ``-dirty`` where tracked files differ from it."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=20)
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                 capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    head = out.stdout.strip()
    return "unknown" if not head else head + ("-dirty" if changed.returncode == 0 and changed.stdout.strip() else "")


def write_results(out_dir: str, stem: str, title: str, table: str, payload: dict, notes: list[str] = ()) -> str:
    """``<stem>.json`` (payload + environment) and ``<stem>.md`` (title, table,
    notes, environment) under ``out_dir``; returns the markdown text."""
    os.makedirs(out_dir, exist_ok=True)
    env = environment()
    with open(os.path.join(out_dir, stem + ".json"), "w") as f:
        json.dump({"title": title, "environment": env, **payload}, f, indent=2)
    env_line = "environment: " + ", ".join(f"{k} {v}" for k, v in env.items())
    text = "\n".join([f"# {title}", "", table, "", *notes, "" if notes else "", env_line, ""])
    with open(os.path.join(out_dir, stem + ".md"), "w") as f:
        f.write(text)
    return text


def fixed_width(columns: list[tuple[str, str, int]], rows: list[list[str]]) -> str:
    """An nccl-tests style table: (name, unit, width) columns, a units row, right-aligned cells."""
    head = " ".join(f"{name:>{w}}" for name, _, w in columns)
    units = " ".join(f"{unit:>{w}}" for _, unit, w in columns)
    body = [" ".join(f"{cell:>{w}}" for cell, (_, _, w) in zip(row, columns)) for row in rows]
    return "\n".join([head, units, *body])
