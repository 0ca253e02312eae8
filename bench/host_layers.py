"""Study: where an eager round trip on the NVLink engine spends host time, layer by layer.

    python3 bench/host_layers.py [--shape decode|deepseek-v3] [--calls N] [--world W] [--bind] [--shared-gpu]
                                 [--steady] [--pause-us US]

One GPU, a world of one rank (the engine built directly, as ``bench/engine_one_gpu.py``
does), or ``--world W`` processes, one a GPU (``--shared-gpu``: all on GPU 0, as the
tests' ``tests/shared_gpu.py`` runs them where one GPU is lent: the host path of W
ranks as on W GPUs, the GPU's times no measure of anything). Times a dispatch + combine with grad
mode on, each after a sync (and a barrier; ``--pause-us``: and a sleep, as a thread
that waited in the kernel), or back to back (``--steady``: as a training loop issues
them, the ranks kept in step by their waits), the median of ``--calls`` round trips:
wall and the thread's CPU time, less the wait at the host read (the compiled
counts exchange's ``last_wait_ns``), and wall less the agreements' waits for the
peers too (the compiled board's ``board_wait_ns``); then again with a clock around
each layer of the path (front end, agreement, transport, engine, compiled calls,
autograd nodes), each layer's inclusive median less the waits inside it (the host
read's is the one the compiled counts exchange last reported: every round trip
here takes it, the engine's usual path on a built host module). A clock costs
about the difference of the two totals divided by the clocks a round trip reads
(printed). No cProfile: it would add its own cost to every Python call. Rank 0
prints every rank's. ``--bind`` pins each rank to physical cores of its own near
its GPU (as a launcher's NUMA binding does), before its process group starts.
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPES = {"decode": (128, 7168, 256, 8), "deepseek-v3": (4096, 7168, 256, 8)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="decode", choices=sorted(SHAPES))
    parser.add_argument("--calls", type=int, default=600)
    parser.add_argument("--world", type=int, default=1, help="processes, one a GPU")
    parser.add_argument("--bind", action="store_true", help="pin each rank to cores of its own near its GPU")
    parser.add_argument("--shared-gpu", action="store_true", help="every rank on GPU 0 (tests/shared_gpu.py)")
    parser.add_argument("--steady", action="store_true",
                        help="round trips back to back (as a training loop issues them), not each after a sync")
    parser.add_argument("--pause-us", type=float, default=0.0,
                        help="the thread sleeps this long after each sync, before its round trip")
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29563"))
    if args.world > 1:
        mp.spawn(_run, args=(args,), nprocs=args.world)
    else:
        _run(0, args)


def _run(rank: int, args) -> None:
    world = args.world
    bound = _bind(rank, world) if args.bind else "not pinned"
    if args.shared_gpu:
        import sys

        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
        import shared_gpu

        shared_gpu.init_rank(rank, world, "env://")
    else:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    import dispatch
    from dispatch import agreement, board, dispatcher, free_memory, host, nvlink, usual, work
    from dispatch.transports import base, nvlink as nvlink_transport

    T, H, E, K = SHAPES[args.shape]
    cfg = dispatch.DispatchConfig(num_experts=E, transport="nvlink")
    if world == 1:  # the engine built directly (create takes two ranks or more)
        d = dispatcher.TokenDispatcher(cfg, None, nvlink_transport.NVLinkTransport(cfg, None))
    else:
        d = dispatch.create(cfg)
    gen = torch.Generator(device="cuda").manual_seed(rank)
    x = torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16).requires_grad_(True)
    w, idx = torch.rand(T, E, generator=gen, device="cuda").topk(K, dim=1)
    w = (w / w.sum(1, keepdim=True)).float().requires_grad_(True)
    compiled = host.built()
    if compiled is None:
        raise SystemExit(f"the compiled host path did not build: {host.why_not()}")
    board_waits = compiled.board_wait_ns

    def rt():
        out = d.dispatch(x, idx, w)
        return d.combine(out.tokens, out.handle, weights=out.weights)

    def settle():
        torch.cuda.synchronize()
        if world > 1:
            dist.barrier()
            torch.cuda.synchronize()
        if args.pause_us:
            time.sleep(args.pause_us / 1e6)

    def measure(n: int, walls, cpus=None, less_every=None):
        for _ in range(n):
            if not args.steady:
                settle()
            b0 = board_waits()
            t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            rt()
            t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
            read, agreed = compiled.last_wait_ns(), board_waits() - b0
            walls.append((t1 - t0 - read) / 1e3)
            if cpus is not None:
                cpus.append((c1 - c0 - read) / 1e3)
                less_every.append((t1 - t0 - read - agreed) / 1e3)

    fast = d._usual  # the usual dispatch compiled (dispatch.usual), beside the Python path in turns
    measure(20, [])
    totals, python = ([], [], []), ([], [], [])
    for _ in range(args.calls):
        for path, into in ((fast, totals), (None, python)):
            d._usual = path
            measure(1, *into)
    d._usual = fast
    plain = [statistics.median(v) for v in totals]
    plain_python = [statistics.median(v) for v in python]
    # (owner, attribute, label): methods of classes and functions of modules, as the path calls them
    layers = [
        (dispatcher.TokenDispatcher, "dispatch", "dispatch()"),
        (usual.UsualDispatches, "dispatch", "  UsualDispatches.dispatch (the usual call compiled)"),
        (compiled.UsualDispatch, "dispatch", "    UsualDispatch.dispatch (C++, less its waits)"),
        (usual.UsualDispatches, "_result", "    its result in Python"),
        (nvlink_transport.NVLinkTransport, "planned", "      NVLinkTransport.planned"),
        (dispatcher.TokenDispatcher, "_dispatched", "      TokenDispatcher._dispatched"),
        (usual, "dispatch_node", "      dispatch's autograd node"),
        (dispatcher.TokenDispatcher, "_plan_dispatch", "  _plan_dispatch"),
        (dispatcher.TokenDispatcher, "_check_dispatch", "    _check_dispatch"),
        (base.Transport, "dispatch_word", "    dispatch_word"),
        (agreement.Calls, "agree", "    Calls.agree (both verbs)"),
        (board.Board, "agree", "      Board.agree (both verbs)"),
        (free_memory, "device_free_bytes", "    device_free_bytes"),
        (nvlink_transport.NVLinkTransport, "plan", "    NVLinkTransport.plan"),
        (nvlink_transport.NVLinkTransport, "_wire_inputs", "      _wire_inputs"),
        (nvlink.Engine, "exchange_counts", "      Engine.exchange_counts"),
        (host, "exchange_counts", "        host.exchange_counts"),
        (compiled, "counts_plan", "          counts_plan (C++, less its wait)"),
        (nvlink_transport.NVLinkTransport, "_handle", "      _handle"),
        (dispatcher, "dispatched", "  work.dispatched (the result)"),
        (work, "dispatch_node", "    dispatch's autograd node"),
        (dispatcher.TokenDispatcher, "combine", "combine()"),
        (dispatcher.TokenDispatcher, "_along", "  _along (ticket, checks)"),
        (nvlink_transport.NVLinkTransport, "to_home", "  NVLinkTransport.to_home"),
        (nvlink.Engine, "to_home", "    Engine.to_home"),
        (compiled, "to_home", "      to_home (C++)"),
        (dispatcher, "combine_node", "  combine's autograd node"),
        (usual.UsualDispatches, "combine", "  UsualDispatches.combine (the usual call compiled)"),
        (compiled.UsualCombine, "combine", "    UsualCombine.combine (C++, less its waits)"),
        (usual, "combine_node", "    combine's autograd node"),
    ]
    spent = {label: [] for _, _, label in layers}
    reads = [0]
    originals = []
    for owner, name, label in layers:
        original = getattr(owner, name)
        originals.append((owner, name, original))
        read_less = name in ("dispatch", "_plan_dispatch", "plan", "exchange_counts", "counts_plan")  # (and the usual)

        def clocked(*a, _original=original, _label=label, _less=read_less, **k):
            b0, t0 = board_waits(), time.perf_counter_ns()
            try:
                return _original(*a, **k)
            finally:
                took = time.perf_counter_ns() - t0
                spent[_label][-1] += took - (compiled.last_wait_ns() if _less else 0) - (board_waits() - b0)
                reads[0] += 1

        setattr(owner, name, clocked)
    try:
        for calls, walls in ((20, []), (args.calls, [])):
            for values in spent.values():
                values.clear()
            reads[0] = 0
            for _ in range(calls):
                for values in spent.values():
                    values.append(0)
                measure(1, walls)
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
    clocks = reads[0] / args.calls
    wrapped = statistics.median(walls)
    mine = dict(bound=bound, plain=plain, python=plain_python, wrapped=wrapped, clocks=clocks,
                layers={label: statistics.median(v) / 1e3 for label, v in spent.items()})
    every = [mine]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, mine)
    how = "back to back" if args.steady else f"each after a sync{' and a barrier' if world > 1 else ''}"
    how += f" and a sleep of {args.pause_us:g} us" if args.pause_us and not args.steady else ""
    if rank == 0:
        print(f"{torch.cuda.get_device_name(0)}, {os.cpu_count()} CPU cores, torch {torch.__version__}, tree "
              f"{os.environ.get('DISPATCH_COMMIT', '?')}; {args.shape} (T={T}, H={H}, E={E}, K={K}), W = {world}"
              f"{' (every rank on GPU 0: tests/shared_gpu.py)' if args.shared_gpu else ''}, "
              f"grad on; median of {args.calls} round trips, {how}, "
              "less the wait at the host read")
        for r, got in enumerate(every):
            wall, cpu, less_every = got["plain"]
            clocks = got["clocks"]
            print(f"rank {r}: CPUs {got['bound']}")
            print(f"rank {r}: round trip, host wall {wall:.1f} us, thread CPU {cpu:.1f} us, wall less the "
                  f"agreements' waits for the peers too {less_every:.1f} us; with {clocks:.0f} clocks a round trip "
                  f"{got['wrapped']:.1f} us (a clock about {(got['wrapped'] - wall) / max(clocks, 1):.2f} us)")
            py_wall, _, py_less = got["python"]
            print(f"rank {r}: the same with the usual dispatch in Python (in turns): host wall {py_wall:.1f} us, less "
                  f"the agreements' waits {py_less:.1f} us; compiled / Python {wall / py_wall:.2f}x, "
                  f"{less_every / py_less:.2f}x")
        print("inclusive host us per round trip (the layers less the host read's and the agreements' waits), "
              + ", ".join(f"rank {r}" for r in range(world)) + ":")
        for _, _, label in layers:
            if any(got["layers"][label] for got in every):  # (the layers the compiled calls step around: none)
                print("  " + "".join(f"{got['layers'][label]:8.1f}" for got in every) + f"  {label}")
    dist.destroy_process_group()


def _bind(rank: int, world: int) -> str:
    """Pin this process to physical cores of its own near GPU ``rank``: the CPUs
    of that GPU's NUMA node (sysfs) that the process may use, whole cores
    (hyperthread siblings together), split among the ranks whose GPUs share the
    node. Returns what it took (or why it did not pin). (Threads started before,
    by CUDA's initialisation, keep their own.)"""
    def near(gpu: int) -> tuple[int, ...]:
        props = torch.cuda.get_device_properties(gpu)
        bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        with open(f"/sys/bus/pci/devices/{bus}/local_cpulist") as f:
            return _cpus(f.read())

    allowed = os.sched_getaffinity(0)
    try:
        lists = [tuple(c for c in near(g) if c in allowed) for g in range(world)]
    except (AttributeError, OSError) as error:
        return f"not pinned ({type(error).__name__}: {error})"
    mine = lists[rank]
    sharing = [g for g in range(world) if lists[g] == mine]
    cores = {}
    for cpu in mine:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            cores.setdefault(f.read().strip(), []).append(cpu)
    cores = sorted(cores.values())
    size = len(cores) // len(sharing)
    if size == 0:
        return f"not pinned (fewer cores near GPU {rank} than ranks beside it)"
    at = sharing.index(rank) * size
    cpus = sorted(c for core in cores[at : at + size] for c in core)
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as error:
        return f"not pinned ({error})"
    return f"{cpus[0]}-{cpus[-1]} ({len(cpus)} CPUs, {size} cores of the {len(cores)} near GPU {rank})" if \
        cpus == list(range(cpus[0], cpus[-1] + 1)) else f"{cpus} ({size} cores of the {len(cores)} near GPU {rank})"


def _cpus(text: str) -> tuple[int, ...]:
    """The CPUs of a sysfs CPU list ("0-15,32-47")."""
    out = []
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(out)


if __name__ == "__main__":
    main()
