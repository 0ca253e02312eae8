"""Study: does a second busy process slow this one's host code, and by what.

    python3 bench/contention_probe.py [--iters N]

At W = 2 every layer of the engine's eager round trip took 2.5-3.5x its W = 1 host time,
pure-Python autograd nodes included, on 2 x H200 and on one H200 shared by two ranks, with
the thread's CPU time equal to its wall (it ran, slower). This times two fixed workloads in
process A (pinned to one CPU): host Python (a torch.autograd.Function over small CPU
tensors, the kind of work a round trip's result does) and CUDA launches (small kernels,
host time per launch, no sync) while process B does, in turn: nothing; a Python busy loop
on another core, on A's SMT sibling, unpinned; a loop of CUDA host syncs on a spinning
kernel (a peer waiting at its host read); and the same with B's CUDA spin on A's sibling.
Prints the machine's topology and CPU quota first.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time


def _siblings(cpu: int) -> list[int]:
    path = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
    try:
        text = open(path).read().strip()
    except OSError:
        return [cpu]
    out = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def _busy(kind: str, cpu: int | None, stop) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    if kind == "python":
        x = 0
        while not stop.is_set():
            for _ in range(10000):
                x += 1
    elif kind == "cuda-sync":
        import torch

        torch.cuda.init()
        while not stop.is_set():
            torch.cuda._sleep(200000)  # about 0.1 ms of spinning on the GPU
            torch.cuda.synchronize()  # the host spins until it ends
    elif kind == "cuda-launch":
        import torch

        a = torch.zeros(16, device="cuda")
        while not stop.is_set():
            for _ in range(100):
                a.add_(1)
            torch.cuda.synchronize()


def _workloads(iters: int) -> dict:
    import torch

    class Node(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(w)
            return x.view_as(x), w.view_as(w)

        @staticmethod
        def backward(ctx, gx, gw):
            return gx, gw

    x = torch.zeros(8, 4, requires_grad=True)
    w = torch.zeros(8, 2, requires_grad=True)
    out = {}
    times = []
    for _ in range(iters):
        t = time.perf_counter_ns()
        for _ in range(20):
            a, b = Node.apply(x, w)
            d = {"a": a, "b": b, "n": a.shape[0]}
            _ = [d[k] for k in ("a", "b")]
        times.append((time.perf_counter_ns() - t) / 20e3)
    out["autograd node, us"] = statistics.median(times)
    if torch.cuda.is_available():
        c = torch.zeros(16, device="cuda")
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            t = time.perf_counter_ns()
            for _ in range(20):
                c.add_(1)
            times.append((time.perf_counter_ns() - t) / 20e3)
            if len(times) % 50 == 0:
                torch.cuda.synchronize()
        out["CUDA launch, us"] = statistics.median(times)
    return out


def _a(cpu: int, iters: int, queue) -> None:
    os.sched_setaffinity(0, {cpu})
    _workloads(50)  # warm
    queue.put(_workloads(iters))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=2000)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    cpus = sorted(os.sched_getaffinity(0))
    a_cpu = cpus[2] if len(cpus) > 2 else cpus[0]
    sib = [c for c in _siblings(a_cpu) if c != a_cpu]
    other = next(c for c in reversed(cpus) if c != a_cpu and c not in sib)
    print(f"CPUs {len(cpus)} ({cpus[0]}-{cpus[-1]}); A on {a_cpu}, its SMT siblings {sib or 'none'}; "
          f"another core {other}")
    for path in ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"):
        if os.path.exists(path):
            print(f"{path}: {open(path).read().strip()}")
    try:
        model = next(line for line in open("/proc/cpuinfo") if line.startswith("model name"))
        print(model.strip())
    except (OSError, StopIteration):
        pass
    print(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    cases = [("alone", None, None), ("B: Python loop, another core", "python", other)]
    if sib:
        cases.append(("B: Python loop, A's sibling", "python", sib[0]))
    cases += [("B: Python loop, unpinned", "python", None), ("B: CUDA host syncs, another core", "cuda-sync", other)]
    if sib:
        cases.append(("B: CUDA host syncs, A's sibling", "cuda-sync", sib[0]))
    cases += [("B: CUDA launches, another core", "cuda-launch", other), ("alone again", None, None)]
    for label, kind, cpu in cases:
        stop = ctx.Event()
        b = ctx.Process(target=_busy, args=(kind, cpu, stop)) if kind else None
        if b:
            b.start()
            time.sleep(3.0)  # B's imports and CUDA context
        q = ctx.Queue()
        a = ctx.Process(target=_a, args=(a_cpu, args.iters, q))
        a.start()
        got = q.get()
        a.join()
        if b:
            stop.set()
            b.join()
        print(f"{label:40s} " + "  ".join(f"{k} {v:7.2f}" for k, v in got.items()))


if __name__ == "__main__":
    main()
