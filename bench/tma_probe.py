"""Study: what one SM moves with the engine's copy loop (a warp a row, vector loads
of 16 bytes, U in flight per lane) against Hopper's bulk copies (cp.async.bulk:
one lane per pipe streams row chunks through shared memory, each chunk read
once and stored K times), from local HBM, from a peer over NVLink and to a peer, at an SM
budget (24 blocks) and on every SM.

    python3 bench/tma_probe.py [--rows 16384] [--row-bytes 14336]

One process, GPUs 0 and 1 (peer access through CuPy). Prints GB/s of bytes read
plus bytes written for each setting, every copy checked.
"""

from __future__ import annotations

import argparse
import sys

SOURCE = r"""
template <int U>
__global__ void __launch_bounds__(512) lsu_expand(const uint4* src, uint4* dst, long long rows, long long words,
                                                 int k) {
  const int lane = threadIdx.x & 31;
  const long long warps = (long long)gridDim.x * (blockDim.x / 32);
  for (long long r = (long long)blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5); r < rows; r += warps) {
    for (long long base = lane; base < words; base += 32 * U) {
      uint4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (base + 32 * u < words) v[u] = __ldcg(src + r * words + base + 32 * u);
      for (int j = 0; j < k; ++j)
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (base + 32 * u < words) dst[(r * k + j) * words + base + 32 * u] = v[u];
    }
  }
}

__device__ __forceinline__ unsigned smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void bulk_load(unsigned to, const void* from, unsigned bytes, unsigned bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(to), "l"(from), "r"(bytes), "r"(bar) : "memory");
}

__device__ __forceinline__ void bulk_wait(unsigned bar, unsigned phase) {
  unsigned done = 0;
  while (!done) {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(bar), "r"(phase) : "memory");
  }
}

__device__ __forceinline__ void bulk_store(void* to, unsigned from, unsigned bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(to), "r"(from), "r"(bytes)
               : "memory");
}

// Pipes of S stages of `chunk` bytes each (dynamic shared memory), one lane 0 of a
// warp per pipe; a unit is (row, chunk of the row).
template <int S>
__global__ void __launch_bounds__(512) tma_expand(const char* src, char* dst, long long rows, long long row_bytes,
                                                  int k, int chunk) {
  extern __shared__ __align__(128) char buf[];
  const int pipes = blockDim.x / 32, pipe = threadIdx.x >> 5;
  unsigned long long* bars = reinterpret_cast<unsigned long long*>(buf + (long long)pipes * S * chunk);
  if ((threadIdx.x & 31) == 0) {
    for (int s = 0; s < S; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem(bars + pipe * S + s)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if ((threadIdx.x & 31) != 0) return;
  const long long per_row = (row_bytes + chunk - 1) / chunk;
  const long long units = rows * per_row;
  const long long stride = (long long)gridDim.x * pipes;
  const long long first = (long long)blockIdx.x * pipes + pipe;
  char* ring = buf + (long long)pipe * S * chunk;
  auto bytes_of = [&](long long unit) {
    const long long c = unit % per_row;
    return (unsigned)min((long long)chunk, row_bytes - c * chunk);
  };
  auto issue = [&](long long i) {  // load this pipe's i-th unit into stage i % S
    const long long unit = first + i * stride;
    if (unit >= units) return;
    const long long r = unit / per_row, c = unit % per_row;
    bulk_load(smem(ring + (i % S) * chunk), src + r * row_bytes + c * chunk, bytes_of(unit),
              smem(bars + pipe * S + i % S));
  };
  for (int i = 0; i < S; ++i) issue(i);
  for (long long i = 0;; ++i) {
    const long long unit = first + i * stride;
    if (unit >= units) break;
    bulk_wait(smem(bars + pipe * S + i % S), (unsigned)((i / S) & 1));
    const long long r = unit / per_row, c = unit % per_row;
    for (int j = 0; j < k; ++j)
      bulk_store(dst + (r * k + j) * row_bytes + c * chunk, smem(ring + (i % S) * chunk), bytes_of(unit));
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (i >= 1) {  // unit i - 1's stores have read their stage: refill it
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      issue(i - 1 + S);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
"""


def two_gpus(script: str):
    """CuPy, where this machine has two GPUs for ``script``; else the script
    exits with status 2, saying why on stderr."""
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        print(f"{script} needs two GPUs", file=sys.stderr)
        raise SystemExit(2)
    return cupy


NAMES = ("lsu_expand<4>", "lsu_expand<8>", "lsu_expand<16>", "tma_expand<4>")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--row-bytes", type=int, default=14336)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)
    cupy = two_gpus("tma_probe")
    runtime = cupy.cuda.runtime
    cupy.cuda.Device(0).use()
    runtime.deviceEnablePeerAccess(1)
    module = cupy.RawModule(code=SOURCE, options=("-std=c++17", "-arch=sm_90"), name_expressions=NAMES)
    sms = runtime.getDeviceProperties(0)["multiProcessorCount"]
    words = args.row_bytes // 16
    with cupy.cuda.Device(1):
        peer = cupy.arange(args.rows * words * 4, dtype=cupy.int32).reshape(args.rows, words * 4)
    local = cupy.arange(args.rows * words * 4, dtype=cupy.int32).reshape(args.rows, words * 4) * 3
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()

    def on_device_0(a):  # a itself, or its copy on GPU 0 (the check compares there)
        if a.device.id == 0:
            return a
        out = cupy.empty(a.shape, a.dtype)
        out.data.copy_from_device(a.data, a.nbytes)
        return out

    print(f"rows {args.rows} x {args.row_bytes} B; {sms} SMs")
    with cupy.cuda.Device(1):
        peer_out = cupy.zeros((args.rows, words * 4), dtype=cupy.int32)
    for where, src in (("local", local), ("peer", peer), ("to peer", local)):
        for k in ((1,) if where == "to peer" else (1, 4)):
            dst = peer_out if where == "to peer" else cupy.zeros((args.rows * k, words * 4), dtype=cupy.int32)
            moved = args.rows * args.row_bytes * (1 + k)
            for blocks in (24, sms):
                for name in NAMES:
                    fn = module.get_function(name)
                    if name.startswith("tma"):
                        threads, chunk = 512, 3584
                        shared = 16 * 4 * chunk + 16 * 4 * 8
                        fn.max_dynamic_shared_size_bytes = shared
                        launch = lambda: fn((blocks,), (threads,), (src, dst, cupy.int64(args.rows),  # noqa: E731
                                                                    cupy.int64(args.row_bytes), cupy.int32(k),
                                                                    cupy.int32(chunk)), shared_mem=shared)
                    else:
                        launch = lambda: fn((blocks,), (512,), (src, dst, cupy.int64(args.rows),  # noqa: E731
                                                                cupy.int64(words), cupy.int32(k)))
                    dst.fill(0)
                    launch()
                    cupy.cuda.Device(0).synchronize()
                    ok = bool((on_device_0(dst).reshape(args.rows, k, -1) == on_device_0(src)[:, None, :]).all())
                    start.record()
                    for _ in range(args.iters):
                        launch()
                    stop.record()
                    stop.synchronize()
                    us = cupy.cuda.get_elapsed_time(start, stop) * 1e3 / args.iters
                    print(f"{where:7s} K={k} blocks {blocks:3d} {name:16s} {us:8.1f} us  "
                          f"{moved / us / 1e3:7.1f} GB/s  ok {ok}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
