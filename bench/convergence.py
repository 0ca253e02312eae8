"""Convergence check of the wire formats: a small MoE model trained with each wire.

A model of ``--layers`` residual MoE layers (a replicated top-2 router over
``--experts`` experts, each a two-layer GELU MLP, living ``E / W`` per rank) is
trained on a synthetic regression task with the engine on a CPU world of gloo
processes (or one GPU per rank with NCCL). Inputs come from 8 clusters and each
cluster has its own linear teacher, so experts have something to specialise in.
``--task classify`` (the default, like language modelling): 16 classes, each
label drawn from the softmax of the cluster's teacher logits, cross-entropy loss
(its floor is the labels' own entropy). ``--task regress``: the teacher's output
itself, mean squared error, which keeps falling towards zero, so late in
training it measures how precisely the inputs reach the experts. Every wire
setting trains from the same initial weights on the same batches; only the
bytes on the wire differ.

    python3 bench/convergence.py --steps 400 --out bench/results/cpu

writes ``convergence.json`` (losses per step, final losses, relative gap) and
``convergence.png`` (the curves); ``convergence-regress.*`` for ``--task regress``. The final loss of a run is the mean of its
last ``--tail`` steps; the check passes when every wire is within ``--tolerance``
(default 2 percent) of the first (the reference, default ``bf16``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's dispatch

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import dispatch  # noqa: E402

# The wire settings a run can name: all four directions of the engine.
WIRES = {
    "native": dict(),
    "bf16": dict(dispatch_wire="bf16", combine_wire="bf16", dispatch_grad_wire="bf16", combine_grad_wire="bf16"),
    "fp8": dict(dispatch_wire="fp8", combine_wire="bf16", dispatch_grad_wire="bf16", combine_grad_wire="e5m2"),
    "fp8-pow2": dict(dispatch_wire="fp8", combine_wire="bf16", dispatch_grad_wire="bf16", combine_grad_wire="e5m2",
                     fp8_pow2_scales=True),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/convergence.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--wires", default="bf16,fp8", help=f"comma list of {', '.join(WIRES)}; the first is the reference")
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--batch", type=int, default=128, help="tokens per rank per step (default 128)")
    parser.add_argument("--hidden", type=int, default=32, help="model width (default 32)")
    parser.add_argument("--ffn", type=int, default=64, help="expert MLP width (default 64)")
    parser.add_argument("--experts", type=int, default=8, help="experts in total (default 8)")
    parser.add_argument("--layers", type=int, default=2, help="MoE layers (default 2)")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (default 3e-3)")
    parser.add_argument("--tail", type=int, default=20, help="steps averaged for the final loss (default 20)")
    parser.add_argument("--tolerance", type=float, default=0.02, help="allowed relative gap of final losses")
    parser.add_argument("--task", choices=["classify", "regress"], default="classify", help="default classify")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="folder for convergence.json and convergence.png")
    args = parser.parse_args(argv)
    args.wires = args.wires.split(",")
    for wire in args.wires:
        if wire not in WIRES:
            parser.error(f"--wires: unknown wire {wire!r}; choose from {', '.join(WIRES)}")
    for name in ("world_size", "steps", "batch", "hidden", "ffn", "experts", "layers", "tail"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.experts % args.world_size:
        parser.error(f"--experts {args.experts} do not split over --world-size {args.world_size}")
    if args.tail > args.steps:
        parser.error("--tail must not exceed --steps")
    return args


class MoELayer(torch.nn.Module):
    """Router (replicated) + this rank's experts; ``forward`` runs the exchange."""

    def __init__(self, args, rank: int, world: int, layer: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(args.seed * 1000 + layer)
        self.router = torch.nn.Parameter(torch.randn(args.hidden, args.experts, generator=gen) / args.hidden**0.5)
        local = args.experts // world
        up, down = [], []
        for expert in range(rank * local, (rank + 1) * local):
            g = torch.Generator().manual_seed(args.seed * 1000 + 100 * layer + expert + 1)
            up.append(torch.randn(args.hidden, args.ffn, generator=g) / args.hidden**0.5)
            down.append(torch.randn(args.ffn, args.hidden, generator=g) / args.ffn**0.5 * 0.5)
        self.up = torch.nn.Parameter(torch.stack(up))  # [E_local, H, F]
        self.down = torch.nn.Parameter(torch.stack(down))  # [E_local, F, H]

    def forward(self, h: torch.Tensor, dispatcher) -> torch.Tensor:
        x = F.rms_norm(h, (h.shape[1],))
        probs = torch.softmax(x @ self.router, dim=1)
        topk_weights, topk_idx = probs.topk(2, dim=1)
        topk_weights = topk_weights / topk_weights.sum(1, keepdim=True)
        out = dispatcher.dispatch(x, topk_idx, topk_weights)
        pieces = out.tokens.split(out.tokens_per_expert_host.tolist())  # host: counts already on the CPU
        y = torch.cat([F.gelu(p @ self.up[e]) @ self.down[e] for e, p in enumerate(pieces)])
        return h + dispatcher.combine(y, out.handle, weights=out.weights)


CLASSES = 16


def _batch(args, rank: int, step: int, device):
    """[B, H] inputs and their targets: [B] int64 labels (classify) or [B, H]
    values (regress). The same on every run."""
    task = torch.Generator().manual_seed(12345)
    centres = torch.randn(8, args.hidden, generator=task) * 2
    width = CLASSES if args.task == "classify" else args.hidden
    maps = torch.randn(8, args.hidden, width, generator=task) / args.hidden**0.5
    gen = torch.Generator().manual_seed(args.seed * 7919 + step * 131 + rank)
    which = torch.randint(0, 8, (args.batch,), generator=gen)
    x = centres[which] + torch.randn(args.batch, args.hidden, generator=gen)
    y = torch.einsum("bh,bhk->bk", x, maps[which])
    if args.task == "classify":
        y = torch.multinomial(torch.softmax(y, dim=1), 1, generator=gen).squeeze(1)
    return x.to(device), y.to(device)


def train(args, wire: str, device) -> list[float]:
    """Train from scratch with one wire setting; the global mean loss of each step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    config = dispatch.DispatchConfig.from_options(num_experts=args.experts, **WIRES[wire])
    dispatcher = dispatch.create(config)
    layers = torch.nn.ModuleList(MoELayer(args, rank, world, i) for i in range(args.layers)).to(device)
    head = torch.nn.Linear(args.hidden, CLASSES if args.task == "classify" else args.hidden).to(device)
    loss_fn = F.cross_entropy if args.task == "classify" else F.mse_loss
    torch.manual_seed(args.seed)
    head.reset_parameters()
    replicated = [p for layer in layers for p in [layer.router]] + list(head.parameters())
    params = list(layers.parameters()) + list(head.parameters())
    opt = torch.optim.Adam(params, lr=args.lr)
    losses = []
    for step in range(args.steps):
        x, target = _batch(args, rank, step, device)
        h = x
        for layer in layers:
            h = layer(h, dispatcher)
        loss = loss_fn(head(h), target)
        opt.zero_grad()
        loss.backward()
        for p in replicated:  # data-parallel parameters: average over the ranks
            dist.all_reduce(p.grad)
        for p in params:  # the loss is the mean over ranks of each rank's loss
            p.grad /= world
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)  # host sync: the loss curve is the result
    return losses


def _rank_main(rank: int, args, store_file: str, conn) -> None:
    torch.set_num_threads(1)
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= args.world_size
    if use_cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method=f"file://{store_file}", rank=rank,
                            world_size=args.world_size, timeout=datetime.timedelta(seconds=120),
                            device_id=device if use_cuda else None)
    try:
        curves = {wire: train(args, wire, device) for wire in args.wires}
        if rank == 0:
            conn.send((curves, str(device.type)))
        dist.barrier()  # no rank tears its connections down while a peer still uses them
    finally:
        dist.destroy_process_group()


def run(args) -> dict:
    """Train every wire of ``args.wires`` on a fresh world; the result as a dict."""
    # rendezvous through a fresh file: no free TCP port that another process may take first
    handle, store_file = tempfile.mkstemp(prefix="dispatch-convergence-")
    os.close(handle)
    os.unlink(store_file)
    ctx = torch.multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=_rank_main, args=(r, args, store_file, send)) for r in range(args.world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs) or not receive.poll():
        raise RuntimeError(f"a training rank failed (exit codes {[p.exitcode for p in procs]})")
    curves, device = receive.recv()
    final = {wire: sum(c[-args.tail :]) / args.tail for wire, c in curves.items()}
    reference = args.wires[0]
    gaps = {wire: abs(f - final[reference]) / final[reference] for wire, f in final.items()}
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    return {"settings": settings, "device": device, "initial": {w: c[0] for w, c in curves.items()},
            "final": final, "relative_gap": gaps, "passed": all(g <= args.tolerance for g in gaps.values()),
            "losses": curves}


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    s = result["settings"]
    for wire, losses in result["losses"].items():
        ax.plot(losses, label=f"{wire} wire (final {result['final'][wire]:.4f})", linewidth=1)
    ylabel = "training loss (cross-entropy)" if s["task"] == "classify" else "training loss (MSE)"
    ax.set(yscale="log", xlabel="step", ylabel=ylabel,
           title=f"{s['layers']} MoE layers, top-2 of {s['experts']} experts, W={s['world_size']} ({result['device']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print(f"{'wire':>10} {'initial':>10} {'final':>10} {'gap':>8}")
    for wire in args.wires:
        print(f"{wire:>10} {result['initial'][wire]:>10.5f} {result['final'][wire]:>10.5f} "
              f"{100 * result['relative_gap'][wire]:>7.2f}%")
    print(f"final losses within {100 * args.tolerance:.0f}% of {args.wires[0]}: {'yes' if result['passed'] else 'NO'}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        stem = "convergence" if args.task == "classify" else f"convergence-{args.task}"
        with open(os.path.join(args.out, stem + ".json"), "w") as f:
            json.dump(result, f, indent=1)
        _plot(result, os.path.join(args.out, stem + ".png"))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
