"""Study: can a kernel of our own use NVSHMEM's device API inside the NVSHMEM
instance that torch's symmetric memory started? (The step before fused
NVSHMEM kernels: see issue notes in bench/results/README.md, NVSHMEM.)

    torchrun --nproc-per-node 2 bench/nvshmem_device_probe.py

Each rank builds (once, into $TMPDIR) a kernel that puts one int into the next
rank's symmetric buffer with ``nvshmem_int_p``: compiled relocatable
(``nvcc -rdc``), linked with NVSHMEM's device library (``nvlink``) into a
cubin, loaded through the driver, its NVSHMEM state set by
``nvshmemx_cumodule_init`` of the host library torch loaded. Prints, per rank,
what arrived from its left neighbour and how long a put of 64 MiB
(``nvshmemx_putmem_block`` from 128 blocks) took; then DeepSeek-V3's rows to
the experts put straight from x to their places at the receivers, against the
transport's way (packed into a send buffer, torch's ``all_to_all_vdev``).
"""

import ctypes
import hashlib
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

SOURCE = r"""
#include <nvshmem.h>
#include <nvshmemx.h>

extern "C" __global__ void put_next(int* box, int value) {
  const int me = nvshmem_my_pe(), n = nvshmem_n_pes();
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    nvshmem_int_p(box, value + me, (me + 1) % n);
    nvshmem_quiet();
  }
}

// each warp puts whole rows: row i of x (token send_token[i]) to rank dest[i]'s recv at row at[i]
extern "C" __global__ void pick_and_put(char* recv, const char* x, const long long* send_token, const long long* dest,
                                        const long long* at, unsigned long long rows, unsigned long long row_bytes) {
  const unsigned long long warps = (unsigned long long)gridDim.x * (blockDim.x / 32);
  for (unsigned long long i = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; i < rows; i += warps)
    nvshmemx_putmem_nbi_warp(recv + at[i] * row_bytes, x + send_token[i] * row_bytes, row_bytes, (int)dest[i]);
  nvshmem_quiet();
}

extern "C" __global__ void put_rows(char* dst, const char* src, unsigned long long bytes) {
  const int me = nvshmem_my_pe(), n = nvshmem_n_pes();
  const unsigned long long per = bytes / gridDim.x;
  nvshmemx_putmem_block(dst + blockIdx.x * per, src + blockIdx.x * per, per, (me + 1) % n);
  nvshmem_quiet();
}
"""


def build(folder: str) -> str:
    """The linked cubin (built once per folder)."""
    from importlib.util import find_spec

    root = list(find_spec("nvidia.nvshmem").submodule_search_locations)[0]
    cubin = os.path.join(folder, f"probe-{hashlib.sha256(SOURCE.encode()).hexdigest()[:12]}.cubin")
    if os.path.exists(cubin):
        return cubin
    cu = os.path.join(folder, "probe.cu")
    with open(cu, "w") as f:
        f.write(SOURCE)
    arch = "sm_%d%d" % torch.cuda.get_device_capability()
    obj = os.path.join(folder, "probe.o")
    subprocess.run(["nvcc", f"-arch={arch}", "-rdc=true", "--cubin", "-I", os.path.join(root, "include"), cu,
                    "-o", obj], check=True)
    subprocess.run(["nvlink", f"-arch={arch}", obj, os.path.join(root, "lib", "libnvshmem_device.a"),
                    "-o", cubin], check=True)
    return cubin


def main():
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    from torch.distributed import _symmetric_memory as symm_mem

    symm_mem.set_backend("NVSHMEM")
    dev = torch.device("cuda", rank)  # an indexed device: torch's NVSHMEM teams are kept per device
    box = symm_mem.empty(4, dtype=torch.int32, device=dev).zero_()
    symm_mem.rendezvous(box, dist.group.WORLD.group_name)  # NVSHMEM started by torch
    folder = os.path.join(tempfile.gettempdir(), f"nvshmem-device-probe-{rank}")
    os.makedirs(folder, exist_ok=True)
    try:
        cubin = build(folder)
    except (subprocess.CalledProcessError, FileNotFoundError) as error:
        print(f"rank {rank}: build failed: {error}", flush=True)
        return 1
    cuda = ctypes.CDLL("libcuda.so.1")
    module = ctypes.c_void_p()
    assert cuda.cuModuleLoad(ctypes.byref(module), cubin.encode()) == 0
    host = ctypes.CDLL("libnvshmem_host.so.3")  # the instance torch loaded
    status = host.nvshmemx_cumodule_init(module)
    print(f"rank {rank}: nvshmemx_cumodule_init -> {status}", flush=True)
    torch.cuda.synchronize()
    dist.barrier()

    def launch(name, grid, *args):
        fn = ctypes.c_void_p()
        assert cuda.cuModuleGetFunction(ctypes.byref(fn), module, name) == 0
        holders = [ctypes.c_uint64(a) if isinstance(a, int) else a for a in args]
        params = (ctypes.c_void_p * len(holders))(*[ctypes.cast(ctypes.byref(h), ctypes.c_void_p) for h in holders])
        stream = torch.cuda.current_stream().cuda_stream
        assert cuda.cuLaunchKernel(fn, grid, 1, 1, 256, 1, 1, 0, ctypes.c_void_p(stream), params, None) == 0

    launch(b"put_next", 1, box.data_ptr(), ctypes.c_int(100))
    torch.cuda.synchronize()
    dist.barrier()
    left = (rank - 1) % dist.get_world_size()
    print(f"rank {rank}: box[0] = {int(box[0])} (want {100 + left})", flush=True)

    size = 64 << 20
    dst = symm_mem.empty(size, dtype=torch.uint8, device=dev)
    symm_mem.rendezvous(dst, dist.group.WORLD.group_name)
    src = torch.full((size,), rank + 1, dtype=torch.uint8, device=dev)
    times = []
    for _ in range(5):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        launch(b"put_rows", 128, dst.data_ptr(), src.data_ptr(), size)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    dist.barrier()
    ok = bool((dst == left + 1).all())
    best = min(times)
    print(f"rank {rank}: 64 MiB put to the next rank from 128 blocks: {best * 1e6:.0f} us "
          f"({size / best / 1e9:.0f} GB/s), rows right: {ok}", flush=True)
    dist.barrier()
    deepseek_rows(launch, host, rank)
    return 0


def deepseek_rows(launch, host, rank):
    """DeepSeek-V3's rows to the experts (T = 4096, H = 7168 bf16, E = 256, K = 8,
    uniform), one per (token, rank), both ways: picked from x and put straight
    into their places at the receivers (``pick_and_put``, then NVSHMEM's barrier),
    against picking them into a symmetric send buffer and torch's
    ``all_to_all_vdev`` (a barrier exchange first, as the transport does).
    Checks that both land the same bytes; prints the median of 20 (CUDA events)."""
    from torch.distributed import _symmetric_memory as symm_mem

    world, name = dist.get_world_size(), dist.group.WORLD.group_name
    dev = torch.device("cuda", torch.cuda.current_device())
    tokens, hidden, experts, topk = 4096, 7168, 256, 8
    gen = torch.Generator(device=dev).manual_seed(rank)
    x = torch.randn(tokens, hidden, generator=gen, device=dev).to(torch.bfloat16)
    idx = torch.rand(tokens, experts, generator=gen, device=dev).topk(topk, dim=1).indices
    hit = torch.zeros(tokens, world, dtype=torch.bool, device=dev)
    hit.scatter_(1, idx // (experts // world), True)
    dest_of, token_of = hit.t().nonzero(as_tuple=True)  # destination-major, then token
    sends = hit.sum(0)  # [W]
    counts = torch.empty(world, world, dtype=torch.int64, device=dev)
    dist.all_gather_into_tensor(counts, sends)  # counts[s, d]: rows s sends d
    base = torch.cumsum(counts, 0) - counts  # base[s, d]: where s's rows start at d
    first = torch.cumsum(sends, 0) - sends
    at = base[rank][dest_of] + torch.arange(len(dest_of), device=dev) - first[dest_of]
    recv_rows = int(counts.sum(0).max())
    row_bytes = hidden * 2
    most = int(counts.sum(1).max())
    recv = symm_mem.empty(recv_rows * row_bytes, dtype=torch.uint8, device=dev)
    symm_mem.rendezvous(recv, name)
    send = symm_mem.empty(max(most * row_bytes, 8 << 20), dtype=torch.uint8, device=dev)
    symm_mem.rendezvous(send, name)
    recv2 = symm_mem.empty((recv_rows + 1) * row_bytes, dtype=torch.uint8, device=dev)
    symm_mem.rendezvous(recv2, name)
    splits = symm_mem.empty(world, dtype=torch.int64, device=dev)
    out_splits = symm_mem.empty(2, world, dtype=torch.int64, device=dev)
    sync = [symm_mem.empty(1, 16, dtype=torch.uint8, device=dev), symm_mem.empty(1, 16, dtype=torch.uint8,
            device=dev), symm_mem.empty(world, dtype=torch.int64, device=dev).zero_(),
            symm_mem.empty(2, world, dtype=torch.int64, device=dev)]
    for t in (splits, out_splits, *sync):
        symm_mem.rendezvous(t, name)
    token_of, dest_of, at = token_of.contiguous(), dest_of.contiguous(), at.contiguous()
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)

    def fused():
        launch(b"pick_and_put", 264, recv.data_ptr(), x.data_ptr(), token_of.data_ptr(), dest_of.data_ptr(),
               at.data_ptr(), len(token_of), row_bytes)
        host.nvshmemx_barrier_all_on_stream(stream)

    rows_view = send[: most * row_bytes].view(most, row_bytes)

    def torch_path():
        torch.ops.symm_mem.all_to_all_vdev(*sync, name)
        torch.index_select(x.view(torch.uint8).view(tokens, row_bytes), 0, token_of, out=rows_view[: len(token_of)])
        splits.copy_(sends)
        whole = send[: send.numel() // row_bytes * row_bytes].view(-1, row_bytes)
        torch.ops.symm_mem.all_to_all_vdev(whole, recv2.view(-1, row_bytes), splits, out_splits, name)

    report = []
    for label, run in (("pick_and_put + barrier", fused), ("index_select + torch all_to_all_vdev", torch_path)):
        times = []
        for i in range(25):
            dist.barrier()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            if i >= 5:
                times.append(start.elapsed_time(end) * 1e3)
        report.append(f"{label}: {sorted(times)[len(times) // 2]:.0f} us")
    dist.barrier()
    same = torch.equal(recv.view(-1, row_bytes)[:recv_rows].view(-1)[: int(counts[:, rank].sum()) * row_bytes],
                       recv2.view(-1)[: int(counts[:, rank].sum()) * row_bytes])
    print(f"rank {rank}: DeepSeek-V3 rows, {int(sends.sum())} sent ({int(sends[rank])} to itself), "
          f"{'; '.join(report)}; same bytes: {same}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
