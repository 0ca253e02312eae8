"""Why a GEMM beside a few-block exchange kernel can take twice its time, and
whether disjoint SM partitions (CUDA green contexts) keep it whole. One GPU.

The overlap timelines (MoEMicroBatches over NVSHMEM, 8 blocks a kernel, the
GEMMs leaving 8 SMs) show GEMMs that take up to 2x their time beside a get or a
put, while alone at the same carveout none takes over 1.22x. The reading tested:
an exchange kernel's blocks land on SMs the GEMM's blocks need, wherever SMs are
free at its launch (measured: a stand-in landing anywhere slows no GEMM; the
real exchange on SMs split off with ``dispatch.partition`` does not slow it either).

A stand-in exchange (``--blocks`` blocks of 256 threads copying HBM, long enough to
outlast the GEMM; each block records the SM it ran on) runs beside one GEMM of the
DeepSeek-V3 experts at EP2 (bench/carveout_probe.py's shapes), the GEMM leaving
``--carveout`` SMs, in each arrangement:

    alone            the GEMM alone
    shared, X first  both in the device's context, the exchange launched first
    shared, G first  the same, the GEMM first
    shared, X amid   the GEMM's stream runs a many-block kernel first, the exchange
                     launched amid it (its blocks land where SMs free up)
    split, ...       the exchange on the SMs split off for it (an SMPartition),
                     the GEMM on the rest (disjoint partitions), in each order
    X split only     the exchange on its SMs, the GEMM in the device's context

Printed: the partition's sizes and the SMs the exchange's blocks ran on in each
arrangement; the GEMM's median ms over ``--iters`` (CUDA events around it alone).

    python3 bench/partition_probe.py --out bench/results/<machine>/
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's dispatch

import torch  # noqa: E402

from carveout_probe import experts_gemms, time_median  # noqa: E402  (beside this script)
from dispatch.partition import SMPartition  # noqa: E402
from dispatch.pipeline import carved_out  # noqa: E402

_SPIN = r"""
extern "C" __global__ void __launch_bounds__(256) spin_copy(const int4* src, int4* dst, long long n, int reps,
                                                            unsigned* smids) {
  if (threadIdx.x == 0) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    smids[blockIdx.x] = sm;
  }
  for (int r = 0; r < reps; ++r)
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
      dst[i] = src[i];
}
"""

_PTR = ctypes.c_void_p
_SIGNATURES = {  # the driver calls this probe makes itself (dispatch.partition makes the partition's)
    "cuModuleLoadData": (ctypes.POINTER(_PTR), ctypes.c_char_p),
    "cuModuleGetFunction": (ctypes.POINTER(_PTR), _PTR, ctypes.c_char_p),
    "cuLaunchKernel": (_PTR, *[ctypes.c_uint] * 7, _PTR, ctypes.POINTER(_PTR), ctypes.POINTER(_PTR)),
    "cuStreamSynchronize": (_PTR,),
}


def driver(name: str, *args) -> None:
    """The driver's ``name`` (typed as ``_SIGNATURES`` says); a failure raises, naming it."""
    function = getattr(ctypes.CDLL("libcuda.so.1"), name)
    function.argtypes, function.restype = _SIGNATURES[name], ctypes.c_int
    status = function(*args)
    if status != 0:
        raise RuntimeError(f"{name} failed: CUDA error {status}")


def spinner():
    """spin_copy, loaded in the device's context (a green context's stream runs it too)."""
    import cupy

    image = cupy.cuda.compiler.compile_using_nvrtc(_SPIN, options=("-std=c++17",))
    image = image[0] if isinstance(image, (tuple, list)) else image  # (its image, the names' mapping)
    image = image.encode() + b"\0" if isinstance(image, str) else bytes(image)
    module, function = ctypes.c_void_p(), ctypes.c_void_p()
    driver("cuModuleLoadData", ctypes.byref(module), image)
    driver("cuModuleGetFunction", ctypes.byref(function), module, b"spin_copy")
    return function


def launch_spin(function, stream: int, blocks: int, src, dst, reps: int, smids) -> None:
    values = [ctypes.c_void_p(src.data_ptr()), ctypes.c_void_p(dst.data_ptr()), ctypes.c_longlong(src.numel() // 4),
              ctypes.c_int(reps), ctypes.c_void_p(smids.data_ptr())]
    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    driver("cuLaunchKernel", function, blocks, 1, 1, 256, 1, 1, 0, ctypes.c_void_p(stream), params, None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=8, help="the stand-in exchange's blocks")
    parser.add_argument("--carveout", type=int, default=8, help="SMs each GEMM leaves free")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default="dispatch-results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("partition_probe: needs a GPU", file=sys.stderr)
        return 2
    torch.cuda.init()
    every = experts_gemms()  # (bench/carveout_probe.py's shapes)
    gemms = {name: every[name] for name in ("fc1", "fc2 dgrad")}
    lines = [f"# a GEMM beside a {args.blocks}-block stand-in exchange, one {torch.cuda.get_device_name()}, "
             f"GEMMs leaving {args.carveout} SMs", ""]
    partition = None
    try:
        partition = SMPartition.of(torch.device("cuda"), args.blocks)
        lines.append(f"SMs: the exchange's {partition.exchange_sms}, the GEMMs' {partition.compute_sms}")
    except (RuntimeError, ValueError) as exc:
        lines.append(f"no SM partition: {exc}")
    src = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    smids = torch.zeros(args.blocks, dtype=torch.int32, device="cuda")
    spin = spinner()
    main_stream = torch.cuda.Stream()
    side_stream = torch.cuda.Stream()

    # the stand-in's reps: about 3x the longer GEMM, so it outlasts the GEMM in every arrangement
    with carved_out(args.carveout):
        longest = max(_median(lambda: fn(), main_stream, args.iters) for fn in gemms.values())
    one = _median(lambda: launch_spin(spin, side_stream.cuda_stream, args.blocks, src, dst, 1, smids),
                  side_stream, 3)
    reps = max(1, int(3 * longest / one))
    lines.append(f"the stand-in exchange: {one * reps:.2f} ms ({reps} passes over 256 MiB)")
    lines += ["", "| GEMM | arrangement | GEMM ms | x alone | slowest x alone | exchange's SMs |",
              "| --- | --- | --- | --- | --- | --- |"]
    busy_buf = torch.empty(512 << 20, dtype=torch.bfloat16, device="cuda")
    busy = lambda: busy_buf.mul_(1.0)  # noqa: E731  (a many-block kernel, about 0.4 ms)
    places = [("shared", side_stream, main_stream)]
    if partition is not None:
        x_apart = partition.stand_in(side_stream)
        places += [("split", x_apart, partition.compute_stream()), ("X split only", x_apart, main_stream)]
    arrangements = [(f"{place}, {order}", x_on, g_on, order)
                    for place, x_on, g_on in places for order in ("X first", "G first", "X amid")]
    for name, fn in gemms.items():
        with carved_out(args.carveout):
            alone = _median(fn, main_stream, args.iters)
            lines.append(f"| {name} | alone | {alone:.3f} | 1.00 | - | - |")
            for label, x_on, g_on, order in arrangements:
                times, seen = [], set()
                try:
                    for _ in range(args.iters):
                        times.append(_beside(fn, g_on, lambda: launch_spin(
                            spin, x_on.cuda_stream, args.blocks, src, dst, reps, smids), x_on, order, busy))
                        seen.update(smids.tolist())
                except RuntimeError as exc:
                    lines.append(f"| {name} | {label} | failed: {exc} | - | - | - |")
                    continue
                t = statistics.median(times)
                lines.append(f"| {name} | {label} | {t:.3f} | {t / alone:.2f} | {max(times) / alone:.2f} | {sorted(seen)} |")
    text = "\n".join(lines) + f"\n\ncommit {os.environ.get('DISPATCH_COMMIT', '?')}\n"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "partition-probe.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


def _median(fn, stream, iters: int) -> float:
    """``carveout_probe.time_median`` of ``fn()`` on ``stream``."""
    with torch.cuda.stream(stream):
        return time_median(fn, iters)


def _beside(gemm, g_on, spin, x_on, order: str, busy) -> float:
    """The GEMM's ms with the stand-in exchange running beside it. "X first" and
    "G first": the second is queued behind a 50 us sleep on its stream, so the first
    is resident; "X amid": the GEMM's stream runs ``busy`` (a kernel of many blocks)
    before the GEMM, and the exchange is launched 0.1 ms into it, as SMs free up."""
    def settle():
        for stream in (g_on, x_on):
            driver("cuStreamSynchronize", ctypes.c_void_p(stream.cuda_stream))
    settle()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if order == "X first":
        spin()
    with torch.cuda.stream(g_on):
        if order == "X first":
            torch.cuda._sleep(100_000)
        elif order == "X amid":
            busy()
        start.record()
        gemm()
        end.record()
    if order != "X first":
        with torch.cuda.stream(x_on):
            torch.cuda._sleep(100_000 if order == "G first" else 200_000)
        spin()
    settle()
    return start.elapsed_time(end)


if __name__ == "__main__":
    sys.exit(main())
