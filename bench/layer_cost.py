"""What the exchange costs inside a layer: MoEExchange against the plain verbs.

One forward+backward (and one forward) of the experts alone, of ``MoEExchange``
(G = 1) and of the same layer written with the plain verbs (``dispatch`` ->
experts -> ``combine(weights=...)``, autograd through both), each also with
identity experts (the exchange alone), taken in turns (``time_each``). Per row:
the GPU time of the step (CUDA events, slowest rank), the issuing thread's host
time, and the host reads it makes (torch's sync debug mode). The layer's and
the verbs' outputs and gradients are checked bitwise against each other.

    torchrun --nproc-per-node 2 bench/layer_cost.py [--shapes deepseek-v3] [--transport auto]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's dispatch

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import dispatch  # noqa: E402
from dispatch.bench import overlap  # noqa: E402
from dispatch.bench.common import SHAPES, launch, time_each  # noqa: E402


def _verbs(d, experts):
    def layer(x, topk_idx, topk_weights):
        out = d.dispatch(x, topk_idx, topk_weights)
        y = experts(out.tokens, out.tokens_per_expert)
        return d.combine(y, out.handle, weights=out.weights)

    return layer


def job(args) -> None:
    world = dist.get_world_size()
    for name in args.shapes.split(","):
        # the inputs of dispatch-bench overlap: its dispatcher, GroupedExperts, tokens, routing, rows for the experts
        case = overlap.make_case(SHAPES[name], argparse.Namespace(nvshmem_blocks=None, dispatch_wire="native",
                                                                  transport=args.transport, sm_budget=None,
                                                                  micro_batches=None), None)
        d, experts, device = case.dispatcher, case.experts, case.x.device
        identity = lambda t, n: t  # noqa: E731
        layers = {
            "layer": dispatch.MoEExchange(d, experts, groups=1),
            "verbs": _verbs(d, experts),
            "layer, identity experts": dispatch.MoEExchange(d, identity, groups=1),
            "verbs, identity experts": _verbs(d, identity),
        }
        # bitwise: the layer against the verbs, output and gradients
        same = []
        for pair in (("layer", "verbs"), ("layer, identity experts", "verbs, identity experts")):
            got = []
            for key in pair:
                xs, ws = case.x.detach().requires_grad_(), case.topk_weights.detach().requires_grad_()
                out = layers[key](xs, case.topk_idx, ws)
                out.backward(case.grad)
                got.append((out.detach(), xs.grad, ws.grad, *[p.grad for p in experts.parameters()]))
                experts.zero_grad(set_to_none=True)
            same.append(all(a is b is None or (a is not None and b is not None and torch.equal(a, b))
                            for a, b in zip(*got)))
        for backward in (False, True):
            steps = {"experts alone": case.compute_step(backward)}
            steps.update({key: case.layer_step(layer, backward) for key, layer in layers.items()})
            host = {key: [] for key in steps}
            syncs = {key: 0 for key in steps}

            def timed(key, fn):
                def run():
                    t0 = time.thread_time_ns()
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        if device.type == "cuda":
                            torch.cuda.set_sync_debug_mode("warn")
                        try:
                            fn()
                        finally:
                            if device.type == "cuda":
                                torch.cuda.set_sync_debug_mode("default")
                    host[key].append((time.thread_time_ns() - t0) / 1e6)
                    syncs[key] = sum("synchroniz" in str(w.message) for w in caught)
                return run

            runs = time_each({k: timed(k, f) for k, f in steps.items()}, args.iters, args.warmup, device)
            if dist.get_rank() == 0:
                what = "forward+backward" if backward else "forward"
                print(f"{name}, W = {world}, {d.transport.key}, {what} (median of {args.iters}; host: rank 0's "
                      "thread CPU time issuing the step; host reads in one step)")
                base = statistics.median(r["experts alone"] for r in runs)
                for key in steps:
                    gpu = statistics.median(r[key] for r in runs)
                    print(f"  {key:<26} {gpu:8.3f} ms  {gpu / base:5.2f}x experts  host {statistics.median(host[key]):7.3f}"
                          f" ms  host reads {syncs[key]}")
        if dist.get_rank() == 0:
            print(f"  bitwise, layer against verbs: {same[0]}; identity experts: {same[1]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bench/layer_cost.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="deepseek-v3")
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=None)
    args = parser.parse_args(argv)
    return launch(job, args, args.world_size, cpu_default=2)


if __name__ == "__main__":
    sys.exit(main())
