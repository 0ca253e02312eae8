"""Study: what NVLink carries between two GPUs when both move data at once, as a
W = 2 all-to-all does, against one way only; and the all-to-all's own shape
(each GPU pulling the peer's half while it copies its own half and stages the
half the peer pulls), to bound what an all-to-all of the engine can reach
against NCCL's.

    python3 bench/duplex_probe.py [--mib 512] [--iters 10]

One process, GPUs 0 and 1 (peer access through CuPy), a warp a 16 KiB row, 16-byte
vector loads, 8 in flight per lane. Each setting prints the slower GPU's time
(kernels launched on both GPUs back to back, timed by events on each) and the
bytes crossing NVLink per direction per second; every copy is checked.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tma_probe import two_gpus  # noqa: E402  (a study beside this one)

SOURCE = r"""
// Blocks [0, split) copy a_rows rows of `words` 16-byte words from a to b; blocks
// [split, grid) copy c_rows rows from c to d. A warp a row, 8 words in flight a lane.
extern "C" __global__ void __launch_bounds__(512) two_copies(const uint4* a, uint4* b, long long a_rows, const uint4* c,
                                                  uint4* d, long long c_rows, long long words, int split) {
  const bool first = (int)blockIdx.x < split;
  const uint4* src = first ? a : c;
  uint4* dst = first ? b : d;
  const long long rows = first ? a_rows : c_rows;
  const long long blocks = first ? split : (long long)gridDim.x - split;
  const long long block = first ? blockIdx.x : blockIdx.x - split;
  const int lane = threadIdx.x & 31;
  const long long warps = blocks * (blockDim.x / 32);
  constexpr int U = 8;
  for (long long r = block * (blockDim.x / 32) + (threadIdx.x >> 5); r < rows; r += warps) {
    for (long long base = lane; base < words; base += 32 * U) {
      uint4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (base + 32 * u < words) v[u] = __ldcg(src + r * words + base + 32 * u);
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (base + 32 * u < words) __stcg(dst + r * words + base + 32 * u, v[u]);
    }
  }
}
"""

ROW = 16 << 10  # bytes of a row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512, help="MiB crossing NVLink each way (default 512)")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)
    cupy = two_gpus("duplex_probe")
    runtime = cupy.cuda.runtime
    rows = (args.mib << 20) // ROW
    words = ROW // 16
    gpus, fns, bufs, sms = (0, 1), {}, {}, 0
    for g in gpus:
        with cupy.cuda.Device(g):
            runtime.deviceEnablePeerAccess(1 - g)
            fns[g] = cupy.RawModule(code=SOURCE, options=("-std=c++17",)).get_function("two_copies")
            sms = runtime.getDeviceProperties(g)["multiProcessorCount"]
            # stage: the half the peer pulls; inbox: what arrives; own: the half that
            # stays followed by the next half to stage (both copied locally)
            bufs[g] = {"stage": cupy.arange(rows * words * 4, dtype=cupy.int32).reshape(rows, -1) * (3 + g),
                       "own": cupy.arange(2 * rows * words * 4, dtype=cupy.int32).reshape(2 * rows, -1) * (5 + g),
                       "inbox": cupy.zeros((rows, words * 4), dtype=cupy.int32),
                       "own_out": cupy.zeros((2 * rows, words * 4), dtype=cupy.int32)}

    def copy(g, a, b, c=None, d=None, c_rows=0, split=None):
        """Copy a to b (its rows) on blocks [0, split), c to d (c_rows) on the rest."""
        grid = sms
        split = grid if split is None else split
        return lambda: fns[g]((grid,), (512,), (a, b, cupy.int64(a.shape[0]), c if c is not None else a,
                                                d if d is not None else b, cupy.int64(c_rows), cupy.int64(words),
                                                cupy.int32(split)))

    def timed(launches: dict, checks) -> float:
        """The slower GPU's time per run (us) of launches {gpu: fn} run together."""
        events = {}
        for g in launches:  # an event belongs to its GPU
            with cupy.cuda.Device(g):
                events[g] = (cupy.cuda.Event(), cupy.cuda.Event())
        for g, fn in launches.items():
            with cupy.cuda.Device(g):
                fn()
        for g in launches:
            cupy.cuda.Device(g).synchronize()
        ok = all(check() for check in checks)
        for g, fn in launches.items():  # issue both GPUs' runs before waiting on either
            with cupy.cuda.Device(g):
                events[g][0].record()
                for _ in range(args.iters):
                    fn()
                events[g][1].record()
        worst = 0.0
        for g in launches:
            events[g][1].synchronize()
            worst = max(worst, cupy.cuda.get_elapsed_time(*events[g]) * 1e3 / args.iters)
        if not ok:
            raise SystemExit("duplex_probe: a copy arrived wrong")
        return worst

    def same(g, dst, src_gpu, src):
        def check():
            with cupy.cuda.Device(src_gpu):
                want = cupy.asnumpy(bufs[src_gpu][src])
            with cupy.cuda.Device(g):
                return bool((cupy.asnumpy(bufs[g][dst]) == want).all())
        return check

    nbytes = rows * ROW
    print(f"{args.mib} MiB each way, rows of {ROW} B, {sms} SMs a GPU")

    def report(name, us, moved, unit="a direction"):
        print(f"{name:58s} {us:9.1f} us  {moved / us / 1e3:6.1f} GB/s {unit}", flush=True)

    # one way: GPU 0 pulls GPU 1's stage; GPU 0 pushes into GPU 1's inbox
    report("one way, pull (GPU 0 reads GPU 1)", timed({0: copy(0, bufs[1]["stage"], bufs[0]["inbox"])},
                                                      [same(0, "inbox", 1, "stage")]), nbytes)
    report("one way, push (GPU 0 writes GPU 1)", timed({0: copy(0, bufs[0]["stage"], bufs[1]["inbox"])},
                                                       [same(1, "inbox", 0, "stage")]), nbytes)
    # both ways at once
    report("both ways, pull", timed({g: copy(g, bufs[1 - g]["stage"], bufs[g]["inbox"]) for g in gpus},
                                    [same(g, "inbox", 1 - g, "stage") for g in gpus]), nbytes)
    report("both ways, push", timed({g: copy(g, bufs[g]["stage"], bufs[1 - g]["inbox"]) for g in gpus},
                                    [same(1 - g, "inbox", g, "stage") for g in gpus]), nbytes)
    # the all-to-all's shape: pull the peer's staged half while copying locally the
    # own half (1x the crossing bytes) or the own half and the half to stage (2x)
    for local in (1, 2):
        for share in (0.25, 0.4, 0.5, 0.6):
            split = max(1, min(sms - 1, round(sms * share)))
            launches = {g: copy(g, bufs[1 - g]["stage"], bufs[g]["inbox"], bufs[g]["own"], bufs[g]["own_out"],
                                local * rows, split) for g in gpus}
            checks = [same(g, "inbox", 1 - g, "stage") for g in gpus]
            if local == 2:
                checks += [same(g, "own_out", g, "own") for g in gpus]
            report(f"both ways, pull on {split} blocks + {local}x copied locally beside",
                   timed(launches, checks), nbytes)
    # the local copies alone, for the HBM side of the same
    report("local copy alone (2x the crossing bytes)", timed({0: copy(0, bufs[0]["own"], bufs[0]["own_out"])},
                                                              [same(0, "own_out", 0, "own")]),
           4 * nbytes, "of HBM (read + write)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
