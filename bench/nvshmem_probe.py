"""Study: the alltoall and hierarchical variants over NVSHMEM beside NCCL and the NVLink engine.

    torchrun --nproc-per-node W bench/nvshmem_probe.py OUT_DIR TRANSPORT [TRANSPORT ...] [--profile]

TRANSPORT is ``nccl``, ``nvshmem``, ``nvshmem-unmapped`` (NVSHMEM with every peer's rows got
and put through NVSHMEM as across hosts, not read and written where it maps them here:
``nvshmem_puts.mapped``) or ``nvlink``, made in the order given; ``hier-`` before
``nccl`` or ``nvshmem[-unmapped]``: the hierarchical variant over it, every rank a
node of its own (the inter-node tier is the whole exchange). Torch fixes
one symmetric-memory backend per process at its first allocation: after
``nvshmem``, the engine runs on NVSHMEM's buffers (each row names its
backend). The suite runs this twice in one call: ``nvshmem nccl nvlink``, then
``nvlink`` alone (the engine on CUDA's backend). For each
shape (decode, DeepSeek-V3, Mixtral-8x7B; bf16, uniform routing) and transport:
the eager round trip (dispatch + combine, timed back to back on the device, and
the issuing thread's wall time per call), and where the transport reads
nothing on the host with ``max_rows`` (nvshmem, nvlink), the same with
``max_rows`` eager and captured in a CUDA graph; first a check that its
combine equals its variant's over NCCL bitwise. Writes OUT_DIR/nvshmem-probe-<transports>.json and
prints one line per row (median milliseconds, the slowest rank's). ``--profile``:
then, on rank 0, a kernel table (torch.profiler, by device time) of 5 eager and
5 captured round trips of each transport at the DeepSeek-V3 and Mixtral shapes,
written to OUT_DIR/nvshmem-profile-<transport>-<shape>.txt. ``--host-profile``: on rank 0, where the
issuing thread spends 20 eager round trips with ``max_rows`` of each host-free
transport at each shape (cProfile, by own and by cumulative time), in
OUT_DIR/nvshmem-host-<transport>-<shape>.txt.
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dispatch  # noqa: E402
from dispatch.bench.common import SHAPES, captured_round_trip, spread, time_back_to_back, time_each  # noqa: E402
from dispatch.kernels import nvshmem_puts  # noqa: E402

ITERS, WARMUP = 30, 5


def inputs(shape, world, rank):
    gen = torch.Generator(device="cuda").manual_seed(rank)
    x = torch.randn(shape.tokens, shape.hidden, generator=gen, device="cuda").to(torch.bfloat16)
    scores = torch.rand(shape.tokens, shape.experts, generator=gen, device="cuda")
    w, idx = scores.topk(shape.topk, dim=1)
    return x, idx, (w / w.sum(1, keepdim=True)).float()


def kernel_table(run, rounds: int = 5) -> str:
    """The kernels (and host calls) of ``rounds`` calls of ``run``, by device time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            run()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    for key in ("device_time_total", "cuda_time_total"):  # the name differs between torch versions
        try:
            return averages.table(sort_by=key, row_limit=30)
        except (AttributeError, KeyError, ValueError):
            continue
    return averages.table(row_limit=30)


def host_table(run, rounds: int = 20) -> str:
    """Where the issuing thread spends ``rounds`` calls of ``run`` (cProfile)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(rounds):
        run()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(50)
    return text.getvalue()


def config_of(name: str, experts: int) -> dispatch.DispatchConfig:
    """The config of a TRANSPORT argument (see the module doc)."""
    hierarchical = name.startswith("hier-")
    options = dict(variant="hierarchical", local_world_size=1) if hierarchical else {}
    return dispatch.DispatchConfig.from_options(num_experts=experts, **options,
                                                transport=name.removeprefix("hier-").removesuffix("-unmapped"))


def main():
    profiling, host_profiling = "--profile" in sys.argv, "--host-profile" in sys.argv
    args = [a for a in sys.argv[1:] if a not in ("--profile", "--host-profile")]
    out_dir, transports = args[0], args[1:]
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    world = dist.get_world_size()
    dev = torch.device("cuda", rank)
    rows = []
    for name in ("decode", "deepseek-v3", "mixtral-8x7b"):
        shape = SHAPES[name]
        x, idx, w = inputs(shape, world, rank)
        made, references = {}, {}
        for t in transports:
            try:
                made[t] = dispatch.create(config_of(t, shape.experts))
            except ValueError as exc:  # the same on every rank: the transport cannot run here
                if rank == 0:
                    print(f"{name}: {exc}; not measured", flush=True)
        for t in made:  # each variant's rows over NCCL, to check against
            kind = "hier-nccl" if t.startswith("hier-") else "nccl"
            if kind not in references:
                references[kind] = made.get(kind) or dispatch.create(config_of(kind, shape.experts))
        for transport, d in made.items():
            nvshmem_puts.mapped = not transport.endswith("-unmapped")
            plain = d.dispatch(x, idx, w)
            limit = torch.tensor([plain.tokens.shape[0] + 256], device=dev)
            dist.all_reduce(limit, op=dist.ReduceOp.MAX)
            bound = int(limit)  # every rank's N and some room, the same bound on every rank
            check = references["hier-nccl" if transport.startswith("hier-") else "nccl"]
            want = check.combine(*(lambda o: (o.tokens, o.handle))(check.dispatch(x, idx, w)))
            got = d.combine(plain.tokens, plain.handle)
            row = dict(shape=name, world=world, transport=transport, bitwise=bool(torch.equal(got, want)))
            if not transport.endswith("nccl"):
                from torch.distributed import _symmetric_memory as symm_mem

                row["backend"] = symm_mem.get_backend(dev)

            def eager():
                out = d.dispatch(x, idx, w)
                d.combine(out.tokens, out.handle, weights=out.weights)

            times = time_back_to_back(eager, ITERS, WARMUP, dev)
            row["eager_ms"] = spread(times)["median"]
            if d.host_free:
                def bounded():
                    out = d.dispatch(x, idx, w, max_rows=bound)
                    d.combine(out.tokens, out.handle, weights=out.weights)

                row["eager_max_rows_ms"] = spread(time_back_to_back(bounded, ITERS, WARMUP, dev))["median"]
                host = []
                for _ in range(ITERS):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    bounded()
                    host.append((time.perf_counter() - t0) * 1e3)
                row["host_max_rows_ms"] = spread(host)["median"]
                replays, _ = captured_round_trip(d, x, idx, w, bound)
                runs = time_each({"total": replays["total"]}, ITERS, WARMUP, dev)
                row["captured_ms"] = spread([r["total"] for r in runs])["median"]
                d.check()
                if host_profiling:
                    table = host_table(bounded)
                    if rank == 0:
                        os.makedirs(out_dir, exist_ok=True)
                        with open(os.path.join(out_dir, f"nvshmem-host-{transport}-{name}.txt"), "w") as f:
                            f.write(f"{transport} {name} W={world}: 20 eager round trips with max_rows\n{table}")
                if profiling and name != "decode":
                    tables = [f"{transport} {name} W={world}: eager round trips", kernel_table(eager),
                              f"{transport} {name} W={world}: captured round trips (max_rows)",
                              kernel_table(replays["total"])]
                    if rank == 0:
                        os.makedirs(out_dir, exist_ok=True)
                        with open(os.path.join(out_dir, f"nvshmem-profile-{transport}-{name}.txt"), "w") as f:
                            f.write("\n\n".join(tables) + "\n")
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"nvshmem-probe-{'-'.join(transports)}.json"), "w") as f:
            json.dump(rows, f, indent=1)
    dist.barrier()


if __name__ == "__main__":
    main()
