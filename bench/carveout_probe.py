"""What an SM carveout costs each of the experts' GEMMs, GEMM by GEMM, on one GPU.

GroupedExperts' four grouped GEMMs of one forward+backward, and its two weight
gradients, each timed alone (CUDA events, median of ``--iters`` after a
warm-up) with torch's SM carveout at each value of ``--carveouts``, on the
rows one rank's experts get in ``dispatch-bench overlap``'s DeepSeek-V3 case at
EP2 (E_local = 128, H = 7168, ffn = 2048, swiglu, 256 rows an expert, bf16):

    fc1        rows [N, H] x w_in [E, H, 2 ffn]
    fc2        act [N, ffn] x w_out [E, ffn, H]
    fc2 dgrad  grad_y [N, H] x w_out^T (the activations' gradient)
    fc1 dgrad  grad_h [N, 2 ffn] x w_in^T (the rows' gradient)
    w_in wgrad, w_out wgrad  the weight gradients (one GEMM over all rows)

Each row also gives the time over the time at carveout 0. The layers carve the
SMs out of every GEMM that runs beside an exchange, so a carveout that one GEMM
takes badly (its kernel's work split over fewer SMs) costs the overlap that much.

    python3 bench/carveout_probe.py --out bench/results/<machine>/
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's dispatch

import torch  # noqa: E402

from dispatch.experts import GroupedExperts, _ends  # noqa: E402
from dispatch.pipeline import carved_out  # noqa: E402
from dispatch.timing import PhaseTimer  # noqa: E402


def time_median(fn, iters: int) -> float:
    """Median ms of ``fn()`` over ``iters`` runs, each timed alone (``PhaseTimer``), after three."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        timer = PhaseTimer("cuda")
        timer.start()
        fn()
        timer.mark("run")
        times.append(timer.phases()["run"])
    return statistics.median(times)


def experts_gemms(e: int = 128, rows_per_expert: int = 256) -> dict:
    """The experts' GEMMs of the module doc (name -> a call of it), on ``e``
    experts of ``rows_per_expert`` rows each, bf16 on the current GPU."""
    hidden, ffn, n = 7168, 2048, e * rows_per_expert
    torch.manual_seed(0)
    experts = GroupedExperts(e, hidden, ffn, dtype=torch.bfloat16, device="cuda")
    offs = _ends(torch.full((e,), rows_per_expert, device="cuda"))
    x = torch.randn(n, hidden, dtype=torch.bfloat16, device="cuda")
    h = torch.randn(n, 2 * ffn, dtype=torch.bfloat16, device="cuda")
    act = torch.randn(n, ffn, dtype=torch.bfloat16, device="cuda")
    w_in, w_out = experts.w_in.detach(), experts.w_out.detach()
    return {
        "fc1": lambda: torch._grouped_mm(x, w_in, offs=offs),
        "fc2": lambda: torch._grouped_mm(act, w_out, offs=offs),
        "fc2 dgrad": lambda: torch._grouped_mm(x, w_out.transpose(1, 2), offs=offs),
        "fc1 dgrad": lambda: torch._grouped_mm(h, w_in.transpose(1, 2), offs=offs),
        "w_in wgrad": lambda: torch._grouped_mm(x.t(), h, offs=offs),
        "w_out wgrad": lambda: torch._grouped_mm(act.t(), x, offs=offs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--carveouts", default="0,4,8,12,16,20,24,32", help="SM carveouts to time (comma-separated)")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--rows-per-expert", type=int, default=256)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default="dispatch-results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("carveout_probe: needs a GPU", file=sys.stderr)
        return 2
    carveouts = [int(c) for c in args.carveouts.split(",")]
    gemms = experts_gemms(args.experts, args.rows_per_expert)
    table = {}
    for name, fn in gemms.items():
        for c in carveouts:
            with carved_out(c):
                table[name, c] = time_median(fn, args.iters)
    lines = [f"# the experts' GEMMs under an SM carveout, one {torch.cuda.get_device_name()} "
             f"({torch.cuda.get_device_properties(0).multi_processor_count} SMs), E_local={args.experts}, H=7168, "
             f"ffn=2048 (swiglu), {args.rows_per_expert} rows an expert, bf16; ms (x carveout 0)",
             "", "| GEMM | " + " | ".join(f"carveout {c}" for c in carveouts) + " |",
             "| --- |" + " --- |" * len(carveouts)]
    for name in gemms:
        base = table[name, carveouts[0]]
        lines.append(f"| {name} | " + " | ".join(f"{table[name, c]:.3f} ({table[name, c] / base:.2f})"
                                                for c in carveouts) + " |")
    text = "\n".join(lines) + f"\n\ntorch {torch.__version__}, commit {os.environ.get('DISPATCH_COMMIT', '?')}\n"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "carveout-probe.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
