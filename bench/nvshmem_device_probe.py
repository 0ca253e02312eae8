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
(``nvshmemx_putmem_block`` from 128 blocks) took.
"""

import ctypes
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
    cubin = os.path.join(folder, "probe.cubin")
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
    box = symm_mem.empty(4, dtype=torch.int32, device="cuda").zero_()
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
    dst = symm_mem.empty(size, dtype=torch.uint8, device="cuda")
    symm_mem.rendezvous(dst, dist.group.WORLD.group_name)
    src = torch.full((size,), rank + 1, dtype=torch.uint8, device="cuda")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
