"""Study: where an eager round trip on the NVLink engine spends host time, layer by layer.

    python3 bench/host_layers.py [--shape decode|deepseek-v3] [--calls N] [--world W]

One GPU, a world of one rank (the engine built directly, as ``bench/engine_one_gpu.py``
does). Times a dispatch + combine with grad mode on, back to back after a sync, the
median of ``--calls`` round trips: wall and the thread's CPU time, less the wait at
the host read (the compiled counts exchange's ``last_wait_ns``); then again with a
clock around each layer of the path (front end, agreement, transport, engine,
compiled calls, autograd nodes), each layer's inclusive median (the wait taken
off is the one the compiled counts exchange last reported: every round trip here
takes it, the engine's usual path on a built host module). A clock costs
about the difference of the two totals divided by the clocks a round trip reads
(printed). No cProfile: it would add its own cost to every Python call.

With ``--world W`` (W > 1): W processes, one a GPU, each timing the same round
trips (after a barrier each): wall and thread CPU time less the wait at its
host read, and wall less its agreements' waits for the peers too (the compiled
board's ``board_wait_ns``); no layers. Rank 0 prints every rank's medians.
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
    parser.add_argument("--world", type=int, default=1, help="processes (GPUs); > 1: totals only, every rank")
    args = parser.parse_args()
    if args.world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29564"))
        mp.spawn(_ranks, args=(args,), nprocs=args.world)
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29563"))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    import dispatch
    from dispatch import agreement, board, checks, dispatcher, host, nvlink, work
    from dispatch.transports import base, nvlink as nvlink_transport

    T, H, E, K = SHAPES[args.shape]
    cfg = dispatch.DispatchConfig(num_experts=E, transport="nvlink")
    d = dispatcher.TokenDispatcher(cfg, None, nvlink_transport.NVLinkTransport(cfg, None))
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16).requires_grad_(True)
    w, idx = torch.rand(T, E, generator=gen, device="cuda").topk(K, dim=1)
    w = (w / w.sum(1, keepdim=True)).float().requires_grad_(True)
    compiled = host.built()
    if compiled is None:
        raise SystemExit(f"the compiled host path did not build: {host.why_not()}")

    def rt():
        out = d.dispatch(x, idx, w)
        return d.combine(out.tokens, out.handle, weights=out.weights)

    def measure(n: int):
        walls, cpus = [], []
        for _ in range(20):
            rt()
        torch.cuda.synchronize()
        for _ in range(n):
            t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            rt()
            t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
            waited = compiled.last_wait_ns()
            torch.cuda.synchronize()
            walls.append((t1 - t0 - waited) / 1e3)
            cpus.append((c1 - c0 - waited) / 1e3)
        return statistics.median(walls), statistics.median(cpus)

    plain = measure(args.calls)
    # (owner, attribute, label): methods of classes and functions of modules, as the path calls them
    layers = [
        (dispatcher.TokenDispatcher, "dispatch", "dispatch()"),
        (dispatcher.TokenDispatcher, "_plan_dispatch", "  _plan_dispatch"),
        (dispatcher.TokenDispatcher, "_check_dispatch", "    _check_dispatch"),
        (base.Transport, "dispatch_word", "    dispatch_word"),
        (agreement.Calls, "agree", "    Calls.agree (both verbs)"),
        (board.Board, "agree", "      Board.agree (both verbs)"),
        (checks, "device_free_bytes", "    device_free_bytes"),
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
    ]
    spent = {label: [] for _, _, label in layers}
    reads = [0]
    originals = []
    for owner, name, label in layers:
        original = getattr(owner, name)
        originals.append((owner, name, original))
        wait_less = name in ("dispatch", "_plan_dispatch", "plan", "exchange_counts", "counts_plan")

        def clocked(*a, _original=original, _label=label, _less=wait_less, **k):
            t0 = time.perf_counter_ns()
            try:
                return _original(*a, **k)
            finally:
                took = time.perf_counter_ns() - t0
                spent[_label][-1] += took - (compiled.last_wait_ns() if _less else 0)
                reads[0] += 1

        setattr(owner, name, clocked)
    try:
        for _ in range(20):
            for values in spent.values():
                values.append(0)
            rt()
        torch.cuda.synchronize()
        for values in spent.values():
            values.clear()
        walls = []
        reads[0] = 0
        for _ in range(args.calls):
            for values in spent.values():
                values.append(0)
            t0 = time.perf_counter_ns()
            rt()
            t1 = time.perf_counter_ns()
            waited = compiled.last_wait_ns()
            torch.cuda.synchronize()
            walls.append((t1 - t0 - waited) / 1e3)
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
    clocks = reads[0] / args.calls
    wrapped = statistics.median(walls)
    print(f"{torch.cuda.get_device_name(0)}, {os.cpu_count()} CPU cores, torch {torch.__version__}, tree "
          f"{os.environ.get('DISPATCH_COMMIT', '?')}; {args.shape} (T={T}, H={H}, E={E}, K={K}), W = 1, grad on; "
          f"median of {args.calls} round trips, each after a sync, less the wait at the host read")
    print(f"round trip, host wall {plain[0]:.1f} us, thread CPU {plain[1]:.1f} us; with {clocks:.0f} clocks a round "
          f"trip {wrapped:.1f} us (a clock about {(wrapped - plain[0]) / max(clocks, 1):.2f} us)")
    print("inclusive host us per round trip (the dispatch's layers less the host read's wait):")
    for _, _, label in layers:
        print(f"  {statistics.median(spent[label]) / 1e3:8.1f}  {label}")
    dist.destroy_process_group()


def _ranks(rank: int, args) -> None:
    """One rank of ``--world``: the round trip's host time, less its waits, every rank's to rank 0."""
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=args.world, device_id=torch.device("cuda", rank))
    import dispatch
    from dispatch import host

    T, H, E, K = SHAPES[args.shape]
    d = dispatch.create(dispatch.DispatchConfig(num_experts=E, transport="nvlink"))
    compiled = host.built()
    assert d.transport.key == ("alltoall", "nvlink") and compiled is not None, (d.transport.key, host.why_not())
    gen = torch.Generator(device="cuda").manual_seed(rank)
    x = torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16).requires_grad_(True)
    w, idx = torch.rand(T, E, generator=gen, device="cuda").topk(K, dim=1)
    w = (w / w.sum(1, keepdim=True)).float().requires_grad_(True)

    def rt():
        out = d.dispatch(x, idx, w)
        return d.combine(out.tokens, out.handle, weights=out.weights)

    for _ in range(20):
        rt()
    torch.cuda.synchronize()
    got = {"wall": [], "cpu": [], "wall less every wait": []}
    for _ in range(args.calls):
        dist.barrier()
        torch.cuda.synchronize()
        board = compiled.board_wait_ns()
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        rt()
        t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        read, board = compiled.last_wait_ns(), compiled.board_wait_ns() - board
        got["wall"].append((t1 - t0 - read) / 1e3)
        got["cpu"].append((c1 - c0 - read) / 1e3)
        got["wall less every wait"].append((t1 - t0 - read - board) / 1e3)
    medians = {name: statistics.median(v) for name, v in got.items()}
    every = [None] * args.world
    dist.all_gather_object(every, medians)
    if rank == 0:
        print(f"{torch.cuda.get_device_name(0)}, {os.cpu_count()} CPU cores, torch {torch.__version__}, tree "
              f"{os.environ.get('DISPATCH_COMMIT', '?')}; {args.shape} (T={T}, H={H}, E={E}, K={K}) per rank, "
              f"W = {args.world}, grad on; median of {args.calls} round trips, each after a barrier, host us less "
              "the wait at the host read (and, last, less the agreements' waits for the peers too)")
        for r, m in enumerate(every):
            print(f"  rank {r}: " + ", ".join(f"{name} {value:.1f}" for name, value in m.items()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
