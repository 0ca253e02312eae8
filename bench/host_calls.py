"""The host cost of the usual round trip on a one-rank gloo world: Python calls
(cProfile) and wall time, per variant, of this tree and (``--against BASE``) of a
base tree, each in its own process, the trees taken in turns round by round.

    python3 bench/host_calls.py [--against BASE] [--rounds 3] [--trips 300] [--out FILE]

What CI sees of the host cost (``tests/test_host_calls.py`` holds the calls); the
time is the median of ``--trips`` round trips (dispatch, then combine with the
dispatch's weights, grad mode on) after 20 to warm up, the best round's.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

SHAPES = {"small": (64, 32, 2, 8), "cpu-small": (512, 256, 4, 16)}  # T, H, K, E
VARIANTS = ("alltoall", "auto", "allgather", "hierarchical")


def _measure(tree: str, variant: str, shape: str, trips: int) -> dict:
    """The calls and round-trip time of the ``dispatch`` of source tree ``tree``."""
    import cProfile
    import pstats
    import time

    import torch
    import torch.distributed as dist

    # the tree's package, not an installed one (an editable install's finder comes before sys.path)
    sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__module__.startswith("__editable__")]
    sys.path.insert(0, tree)
    import dispatch

    if not os.path.abspath(dispatch.__file__).startswith(tree + os.sep):
        raise RuntimeError(f"{dispatch.__file__} is not of {tree}")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)

    tokens, hidden, topk, experts = SHAPES[shape]
    d = dispatch.create(dispatch.DispatchConfig(num_experts=experts, variant=variant), None)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)])
    w = torch.rand(tokens, topk, generator=gen)

    def trip():
        out = d.dispatch(x, idx, w)
        return d.combine(out.tokens, out.handle, weights=out.weights)

    for _ in range(20):
        trip()
    profile = cProfile.Profile()
    profile.enable()
    trip()
    profile.disable()
    times = []
    for _ in range(trips):
        start = time.perf_counter()
        trip()
        times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    try:
        from dispatch.kernels import plan_cpu
    except ImportError:  # a tree from before the compiled CPU plan
        plan_cpu = None
    return {"calls": pstats.Stats(profile).total_calls, "us": statistics.median(times) * 1e6,
            "compiled": plan_cpu is not None and plan_cpu.module() is not None}


def measure(tree: str, variant: str, shape: str = "small", trips: int = 300) -> dict:
    """{calls, us, compiled} of a one-rank gloo round trip of source tree ``tree``'s
    ``dispatch``, in a process of its own (``tests/test_host_calls.py`` holds the calls)."""
    tree = os.path.abspath(tree)
    here = os.path.abspath(os.path.dirname(__file__))
    code = (f"import sys; sys.path.insert(0, {here!r}); import host_calls, json; "
            f"print(json.dumps(host_calls._measure({tree!r}, {variant!r}, {shape!r}, {trips})))")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": tree}, capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    args = sys.argv[1:]

    def option(name, default):
        return args[args.index(name) + 1] if name in args else default

    base, rounds, trips = option("--against", None), int(option("--rounds", 3)), int(option("--trips", 300))
    trees = {"this": "."} | ({"base": base} if base else {})
    best: dict = {}
    for _ in range(rounds):
        for shape in SHAPES:
            for variant in VARIANTS:
                for name, tree in trees.items():
                    got = measure(tree, variant, shape, trips)
                    key = (shape, variant, name)
                    if key not in best or got["us"] < best[key]["us"]:
                        best[key] = got
    lines = [f"one-rank gloo round trip (dispatch + combine, bf16, grad mode on), best of {rounds} rounds of the "
             f"median of {trips}; trees: " + ", ".join(f"{n} = {t}" for n, t in trees.items()),
             "| shape (T, H, K, E) | variant | calls | us | " + ("base calls | base us | us ratio |" if base else "")]
    lines.append("| --- " * (7 if base else 4) + "|")
    for shape, dims in SHAPES.items():
        for variant in VARIANTS:
            this = best[shape, variant, "this"]
            row = f"| {shape} {dims} | {variant} | {this['calls']} | {this['us']:.0f} |"
            if base:
                other = best[shape, variant, "base"]
                row += f" {other['calls']} | {other['us']:.0f} | {this['us'] / other['us']:.3f} |"
            lines.append(row)
    text = "\n".join(lines)
    print(text)
    out = option("--out", None)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
