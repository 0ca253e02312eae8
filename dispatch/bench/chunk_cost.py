"""Chunk cost: what splitting the tokens into C chunks costs the experts, on one GPU.

``MoEExchange(chunks=C)`` runs the experts once per chunk: every chunk's GEMMs
read all the rank's expert weights again, with 1/C of the rows per expert. A
pipeline can hide the exchange only up to what this costs, so the study
measures it alone, without any exchange, on one device:

    rows        what one dispatch delivers to a rank of an EP group of ``--ep``
                ranks under uniform routing (T x K rows on average), the counts
                drawn from a routing of every rank's tokens, split into C chunks
                of home token ranges as MoEExchange splits them
    fwd         the experts' forward over the C chunks, one after another
                (``ChunkedExperts.forward``), ms
    fwd+bwd     forward, each chunk's backward, then the weight gradients once
                (what MoEExchange runs), ms
    x C=1       the same backend's time at C = 1 over this one: the compute a
                C-chunk pipeline adds, which the exchange it hides must pay for
    floor       forward: max(C x the weights' bytes / HBM bandwidth, FLOPs /
                GEMM peak), both measured in the same run (a device-to-device
                copy, an 8192^3 matmul)
    probe       whether each kind of GEMM heeds the carveout: one GEMM with
                every SM and with all but 8 carved out (CUDA)

for each backend of ``GroupedExperts`` (``--backends``) and SM carveout
(``--sm-carveout``: SMs the GEMMs leave free, as MoEExchange's ``sm_carveout``
sets them). Times are medians of ``--iters`` runs after ``--warmup``, CUDA
events (host timer on CPU, tiny shapes: a smoke test).

    dispatch-bench chunk-cost --ep 4 --out bench/results/
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch

from dispatch.bench.common import SHAPES, Shape, fixed_width, write_results
from dispatch.bench.plots import chunk_cost_plot
from dispatch.experts import BACKENDS, ChunkedExperts, GroupedExperts
from dispatch.pipeline import sm_carveout

CHUNK_COST_SHAPES = ("deepseek-v3", "qwen3-235b", "mixtral-8x7b", "cpu-tiny")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dispatch-bench chunk-cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=lambda t: [n.strip() for n in t.split(",") if n.strip()],
                        help=f"comma-separated from {', '.join(CHUNK_COST_SHAPES)} "
                             "(default: deepseek-v3,mixtral-8x7b on a GPU, cpu-tiny on CPU)")
    parser.add_argument("--ep", type=int, default=4, help="EP group size whose rank 0 is measured (default 4)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8], help="C values (1 is always added)")
    parser.add_argument("--backends", nargs="+", default=None,
                        help="GroupedExperts backends (default: grouped_mm where it runs, padded, loop)")
    parser.add_argument("--sm-carveout", type=int, nargs="+", default=[0],
                        help="SMs the GEMMs leave free, one run each (default 0; needs a GPU for > 0)")
    parser.add_argument("--iters", type=int, default=10, help="timed runs (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs first (default 3)")
    parser.add_argument("--out", default="dispatch-results", help="folder for JSON, markdown and PNG results")
    args = parser.parse_args(argv)
    use_cuda = torch.cuda.is_available()
    args.shapes = args.shapes or (["deepseek-v3", "mixtral-8x7b"] if use_cuda else ["cpu-tiny"])
    unknown = [n for n in args.shapes if n not in CHUNK_COST_SHAPES]
    if unknown:
        parser.error(f"--shapes: {', '.join(unknown)} not among {', '.join(CHUNK_COST_SHAPES)}")
    if args.ep < 1:
        parser.error(f"--ep must be >= 1, got {args.ep}")
    bad = [n for n in args.shapes if SHAPES[n].experts % args.ep]
    if bad:
        parser.error(f"--shapes: {', '.join(bad)}: experts do not split over --ep {args.ep} ranks")
    if min(args.chunks) < 1:
        parser.error(f"--chunks must be >= 1, got {args.chunks}")
    args.chunks = sorted({1, *args.chunks})
    if args.backends is None:
        args.backends = (["grouped_mm"] if hasattr(torch, "_grouped_mm") else []) + ["padded", "loop"]
    wrong = [b for b in args.backends if b not in BACKENDS]
    if wrong:
        parser.error(f"--backends: {', '.join(wrong)} not among {', '.join(BACKENDS)}")
    if min(args.sm_carveout) < 0 or (max(args.sm_carveout) > 0 and not use_cuda):
        parser.error(f"--sm-carveout must be >= 0, and > 0 only on a GPU; got {args.sm_carveout}")
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rates = _machine_rates(device, dtype)
    rates["carveout_probe_ms"] = carveout_probe(device, dtype)
    for name in args.shapes:
        rows = run_shape(SHAPES[name], args, device, dtype, rates)
        report(SHAPES[name], rows, args, rates)
    return 0


def chunk_counts(shape: Shape, ep: int, chunks: int, device, seed: int = 0) -> list[torch.Tensor]:
    """Per chunk, [E_local] int64 rows rank 0's experts get from the home token
    range c of every rank, under uniform top-K routing of every rank's tokens."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(ep, shape.tokens, shape.experts, generator=gen)
    topk = scores.topk(shape.topk, dim=-1).indices  # [ep, T, K] distinct experts, uniform
    local = shape.experts // ep
    bounds = [shape.tokens * c // chunks for c in range(chunks + 1)]
    counts = []
    for c in range(chunks):
        ids = topk[:, bounds[c]:bounds[c + 1]].flatten()
        counts.append(torch.bincount(ids[ids < local], minlength=local).to(device))
    return counts


def _carveout(sms: int):
    """GEMMs launched inside leave ``sms`` SMs free (0: as they are)."""
    return contextlib.nullcontext() if sms == 0 else sm_carveout(sms)


def _median_ms(fn, iters: int, warmup: int, device) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()  # host sync: each run starts on an idle GPU
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()  # host sync: read the timing
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _machine_rates(device, dtype) -> dict:
    """HBM bandwidth (bytes read + written per second, a 2 GiB copy) and GEMM
    peak (an 8192^3 matmul), measured now; small stand-ins on CPU."""
    n = 2**30 if device.type == "cuda" else 2**24
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = _median_ms(lambda: dst.copy_(src), 10, 3, device)
    m = 8192 if device.type == "cuda" else 256
    a = torch.randn(m, m, dtype=dtype, device=device)
    b = torch.randn(m, m, dtype=dtype, device=device)
    mm_ms = _median_ms(lambda: a @ b, 10, 3, device)
    return {"hbm_gbps": 2 * n / copy_ms / 1e6, "gemm_tflops": 2 * m**3 / mm_ms / 1e9, "gemm_size": m}


def carveout_probe(device, dtype) -> dict:
    """Whether each kind of GEMM the experts use heeds torch's SM carveout: its
    time with every SM, and with all but 8 carved out (a kernel that heeds it
    then runs on 8 SMs and is many times slower; one whose time stays put takes
    every SM whatever the carveout asks). {kind: (ms, ms carved)}; empty off CUDA."""
    if device.type != "cuda":
        return {}
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    a = torch.randn(8192, 4096, dtype=dtype, device=device)
    w = torch.randn(2, 4096, 8192, dtype=dtype, device=device)
    offs = torch.tensor([4096, 8192], dtype=torch.int32, device=device)
    kinds = {"mm (cuBLAS)": lambda: a @ w[0], "bmm (cuBLAS)": lambda: torch.bmm(a.view(2, 4096, 4096), w)}
    if hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(device) == (9, 0):
        kinds["grouped_mm"] = lambda: torch._grouped_mm(a, w, offs=offs)
    probe = {}
    for kind, fn in kinds.items():
        whole = _median_ms(fn, 10, 3, device)
        with _carveout(sms - 8):
            carved = _median_ms(fn, 10, 3, device)
        probe[kind] = (whole, carved)
    return probe


def run_shape(shape: Shape, args, device, dtype, rates) -> list[dict]:
    local = shape.experts // args.ep
    torch.manual_seed(0)
    experts = GroupedExperts(local, shape.hidden, shape.ffn, dtype=dtype, device=device)
    weight_bytes = sum(p.numel() * p.element_size() for p in experts.parameters())
    by_c = {c: chunk_counts(shape, args.ep, c, device) for c in args.chunks}
    rows_total = int(sum(by_c[1]).sum())
    width_in = experts.w_in.shape[2]
    flops = 2 * rows_total * shape.hidden * width_in + 2 * rows_total * shape.ffn * shape.hidden
    tokens = torch.randn(rows_total, shape.hidden, dtype=dtype, device=device)
    grad = torch.randn_like(tokens)
    results = []
    for backend in args.backends:
        experts.backend = backend
        for sms in args.sm_carveout:
            for c, counts in by_c.items():
                host = [n.cpu() for n in counts]
                bounds = torch.tensor([0] + [int(n.sum()) for n in host]).cumsum(0).tolist()
                parts = [tokens[bounds[i]:bounds[i + 1]] for i in range(c)]
                grads = [grad[bounds[i]:bounds[i + 1]] for i in range(c)]

                def forward(counts=counts, host=host, parts=parts):
                    chunked = ChunkedExperts(experts, counts, host, grad_on=False)
                    for i, part in enumerate(parts):
                        chunked.forward(i, part)

                def forward_backward(counts=counts, host=host, parts=parts, grads=grads):
                    chunked = ChunkedExperts(experts, counts, host, grad_on=True)
                    for i, part in enumerate(parts):
                        chunked.forward(i, part)
                    for i, g in enumerate(grads):
                        chunked.backward(i, g, rows_grad=True)
                    chunked.weight_grads()

                with _carveout(sms), torch.no_grad():
                    fwd = _median_ms(forward, args.iters, args.warmup, device)
                with _carveout(sms):
                    both = _median_ms(forward_backward, args.iters, args.warmup, device)
                floor = max(c * weight_bytes / (rates["hbm_gbps"] * 1e6), flops / (rates["gemm_tflops"] * 1e9))
                results.append(dict(
                    shape=shape.name, ep=args.ep, local_experts=local, rows=rows_total, backend=backend,
                    sm_carveout=sms, chunks=c, fwd_ms=fwd, fwd_bwd_ms=both, fwd_floor_ms=floor,
                    rows_per_expert_max=max(int(n.max()) for n in host),
                    rows_per_expert_mean=rows_total / local / c,
                ))
                print(f"[chunk-cost] {shape.name} {backend} carveout {sms} C={c}: fwd {fwd:.2f} ms, "
                      f"fwd+bwd {both:.2f} ms", file=sys.stderr, flush=True)
    for r in results:
        base = next(b for b in results if b["backend"] == r["backend"] and b["sm_carveout"] == r["sm_carveout"]
                    and b["chunks"] == 1)
        r["fwd_vs_c1"], r["fwd_bwd_vs_c1"] = r["fwd_ms"] / base["fwd_ms"], r["fwd_bwd_ms"] / base["fwd_bwd_ms"]
    return results


def table(rows: list[dict]) -> str:
    columns = [("backend", "", 10), ("carveout", "SMs", 8), ("C", "", 3), ("rows/exp", "mean", 8),
               ("max", "rows", 6), ("fwd", "ms", 8), ("x C=1", "", 6), ("floor", "ms", 7),
               ("fwd+bwd", "ms", 8), ("x C=1", "", 6)]
    body = [[r["backend"], str(r["sm_carveout"]), str(r["chunks"]), f"{r['rows_per_expert_mean']:.0f}",
             str(r["rows_per_expert_max"]), f"{r['fwd_ms']:.3f}", f"{r['fwd_vs_c1']:.2f}",
             f"{r['fwd_floor_ms']:.3f}", f"{r['fwd_bwd_ms']:.3f}", f"{r['fwd_bwd_vs_c1']:.2f}"] for r in rows]
    return fixed_width(columns, body)


def report(shape: Shape, rows: list[dict], args, rates) -> None:
    stem = f"chunk-cost-{shape.name}-ep{args.ep}"
    title = (f"Chunk cost of the experts: {shape.name} (H={shape.hidden}, ffn={shape.ffn}, "
             f"{rows[0]['local_experts']} experts per rank at EP{args.ep}, {rows[0]['rows']} rows)")
    text = table(rows)
    notes = [f"Measured in the same run: HBM {rates['hbm_gbps']:.0f} GB/s (copy, read + write), "
             f"GEMM {rates['gemm_tflops']:.3g} TFLOP/s ({rates['gemm_size']}^3 matmul)."]
    if rates["carveout_probe_ms"]:
        notes.append("SM carveout heeded? One GEMM with every SM / with all but 8 carved out: " + "; ".join(
            f"{kind} {whole:.3f} / {carved:.3f} ms" for kind, (whole, carved) in rates["carveout_probe_ms"].items()
        ) + " (a kernel that heeds the carveout is many times slower carved).")
    write_results(args.out, stem, title, "```\n" + text + "\n```", {"rows": rows, "rates": rates}, notes)
    chunk_cost_plot(rows, f"{args.out}/{stem}.png", title)
    print(f"\n# {title}\n{text}\n" + "\n".join(notes), flush=True)
