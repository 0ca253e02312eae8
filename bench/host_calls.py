"""The host cost of the usual round trip on a one-rank gloo world: Python calls
(cProfile) and wall time, per variant, of this tree and (``--against BASE``) of a
base tree, each in its own process, the trees taken in turns round by round.

    python3 bench/host_calls.py [--against BASE] [--rounds 3] [--trips 300] [--cuda] [--top N] [--out FILE]

What CI sees of the host cost (``tests/test_host_calls.py`` holds the calls); the
time is the median of ``--trips`` round trips (dispatch, then combine with the
dispatch's weights, grad mode on) after 20 to warm up, the best round's.
``--cuda``: a one-rank NCCL world on GPU 0 instead (each round trip's time up to
its synchronize: on one GPU, where the GPU's work is small, its host cost).
``--top N``: the N functions of the profiled round trip with the most own time,
then the N of the tree's with the most time in all, per variant (this tree's,
the last round's).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

SHAPES = {"small": (64, 32, 2, 8), "cpu-small": (512, 256, 4, 16)}  # T, H, K, E
VARIANTS = ("alltoall", "auto", "allgather", "hierarchical")


def _measure(tree: str, variant: str, shape: str, trips: int, on_cuda: bool = False, top: int = 0) -> dict:
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
    device = torch.device("cuda", 0) if on_cuda else torch.device("cpu")
    if on_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_cuda else "gloo", rank=0, world_size=1)

    tokens, hidden, topk, experts = SHAPES[shape]
    d = dispatch.create(dispatch.DispatchConfig(num_experts=experts, variant=variant), None)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64).to(torch.bfloat16).to(device)
    idx = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)]).to(device)
    w = torch.rand(tokens, topk, generator=gen).to(device)

    def trip():
        out = d.dispatch(x, idx, w)
        y = d.combine(out.tokens, out.handle, weights=out.weights)
        if on_cuda:
            torch.cuda.synchronize()
        return y

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
    stats = pstats.Stats(profile)
    own = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:top]  # (file, line, name): (cc, nc, tt, ct, _)
    ours = sorted(((key, value) for key, value in stats.stats.items() if key[0].startswith(tree + os.sep)),
                  key=lambda item: -item[1][3])[:top]
    # every function's calls, counted by code object: pstats keys them by (file, line, name),
    # under which dataclasses' generated __init__ ("<string>", 2) coincide and overwrite each other
    calls = sum(entry.callcount for entry in profile.getstats())
    return {"calls": calls, "us": statistics.median(times) * 1e6,
            "compiled": None if on_cuda else plan_cpu is not None and plan_cpu.module() is not None,  # (no build)
            "top": _lines(own, tree) + ["the tree's functions with the most time in all"] + _lines(ours, tree)
            if top else []}


def _lines(entries, tree: str) -> list[str]:
    """cProfile's entries, a line each."""
    return [f"{tt * 1e6:8.0f} us own {ct * 1e6:8.0f} us in all {nc:5d} calls  "
            f"{os.path.relpath(where, tree) if where.startswith(tree) else where}:{line} {name}"
            for (where, line, name), (_, nc, tt, ct, _) in entries]


def measure(tree: str, variant: str, shape: str = "small", trips: int = 300, on_cuda: bool = False,
            top: int = 0) -> dict:
    """{calls, us, compiled, top} of a one-rank round trip (gloo, or ``on_cuda`` NCCL on
    GPU 0) of source tree ``tree``'s ``dispatch``, in a process of its own
    (``tests/test_host_calls.py`` holds the calls)."""
    tree = os.path.abspath(tree)
    here = os.path.abspath(os.path.dirname(__file__))
    code = (f"import sys; sys.path.insert(0, {here!r}); import host_calls, json; print(json.dumps("
            f"host_calls._measure({tree!r}, {variant!r}, {shape!r}, {trips}, {on_cuda!r}, {top})))")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": tree}, capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    args = sys.argv[1:]

    def option(name, default):
        return args[args.index(name) + 1] if name in args else default

    base, rounds, trips = option("--against", None), int(option("--rounds", 3)), int(option("--trips", 300))
    on_cuda, top = "--cuda" in args, int(option("--top", 0))
    trees = {"this": "."} | ({"base": base} if base else {})
    best: dict = {}
    tops: dict = {}
    for _ in range(rounds):
        for shape in SHAPES:
            for variant in VARIANTS:
                for name, tree in trees.items():
                    got = measure(tree, variant, shape, trips, on_cuda, top if name == "this" else 0)
                    key = (shape, variant, name)
                    tops[key] = got["top"]
                    if key not in best or got["us"] < best[key]["us"]:
                        best[key] = got
    world = "NCCL on GPU 0, each trip synchronized" if on_cuda else "gloo"
    lines = [f"one-rank {world} round trip (dispatch + combine, bf16, grad mode on), best of {rounds} rounds of the "
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
    for (shape, variant, name), entries in tops.items():
        if entries:
            lines += ["", f"{shape}, {variant}: the profiled round trip's functions with the most own time"] + entries
    text = "\n".join(lines)
    print(text)
    out = option("--out", None)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
