"""``dispatch-bench``: what a user runs first on a new cluster.

    dispatch-bench                  the main job: the dispatcher comparison on the
                                    model shapes, then the all-to-all sweep; on all
                                    local GPUs with NCCL, or on 4 CPU processes with
                                    gloo and small shapes when there is no GPU
    dispatch-bench dispatch ...     dispatchers compared on model shapes (roundtrip.py)
    dispatch-bench a2a ...          all-to-all bandwidth sweep, nccl-tests style (a2a.py)
    dispatch-bench overlap ...      exchange hidden behind expert compute (overlap.py)

Every run starts its own processes (one per GPU), or runs as one rank under
torchrun; shows progress on stderr; prints a summary; writes JSON, PNG and
markdown under ``--out`` (default ``dispatch-results/``). Studies (wire formats,
convergence, a Megatron-Core layer, profiler timelines) are scripts under the
repository's ``bench/`` folder, not part of the package.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch
import torch.distributed as dist

from dispatch.bench import a2a, common, roundtrip

# Commands with their own command line: ``dispatch-bench NAME ARGS`` runs
# ``MODULE.main(ARGS)``.
OWN_PARSER = {
    "overlap": "dispatch.bench.overlap",  # MoEExchange pipelined against the experts
}

COMMANDS = {"dispatch": roundtrip, "a2a": a2a}


def _common_arguments(parser: argparse.ArgumentParser, defaults: bool) -> None:
    def default(value):
        return value if defaults else argparse.SUPPRESS

    parser.add_argument("--world-size", type=int, default=default(None),
                        help="ranks to start (default: every GPU, or 4 CPU processes)")
    parser.add_argument("--iters", type=int, default=default(20), help="timed runs per measurement (default 20)")
    parser.add_argument("--warmup", type=int, default=default(5), help="untimed runs first (default 5)")
    parser.add_argument("--out", default=default("dispatch-results"), help="results folder (default dispatch-results)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dispatch-bench", description=__doc__.split("\n\n")[0],
        epilog="overlap takes its own flags: dispatch-bench overlap --help",
    )
    _common_arguments(parser, defaults=True)
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join([*COMMANDS, *OWN_PARSER]) + "}")
    for name, module in COMMANDS.items():
        p = sub.add_parser(name, help=module.__doc__.split("\n")[0], description=module.__doc__)
        _common_arguments(p, defaults=False)
        module.add_arguments(p)
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("iters", "world_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    use_cuda = torch.cuda.is_available()
    if args.command is None:  # the main job: both benchmarks with their defaults
        for module in COMMANDS.values():
            defaults = argparse.ArgumentParser(add_help=False)
            module.add_arguments(defaults)
            for key, value in vars(defaults.parse_args([])).items():
                setattr(args, key, value)
    for name, module in COMMANDS.items():
        if args.command in (None, name):
            module.resolve(args, use_cuda, parser)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    own = next((i for i, word in enumerate(argv) if word in OWN_PARSER), None)
    if own is not None and _only_global_flags(argv[:own]):
        # it parses its own flags, the global ones before its name included
        return importlib.import_module(OWN_PARSER[argv[own]]).main(argv[:own] + argv[own + 1 :])
    args = parse_args(argv)
    world = common.world_size_for(args.world_size)
    if args.command in (None, "dispatch"):
        if world % args.nodes:
            print(f"dispatch-bench: --nodes {args.nodes} does not divide the {world} ranks", file=sys.stderr)
            return 2
        bad = [s for s in args.shapes if common.SHAPES[s].experts % world]
        if bad:
            print(f"dispatch-bench: --shapes {','.join(bad)}: experts do not split over {world} ranks", file=sys.stderr)
            return 2
    return common.launch(_job, args, args.world_size)


def _only_global_flags(words: list[str]) -> bool:
    """True if ``words`` are global flags with their values (``--iters 2 --out d``)."""
    flags = {"--world-size", "--iters", "--warmup", "--out"}
    return all(w in flags for w in words[0::2]) and len(words) % 2 == 0


def _job(args: argparse.Namespace) -> None:
    """One rank's part of the run; rank 0 reports."""
    if dist.get_rank() == 0:
        print(common.what_runs(roundtrip.what_runs(args) if args.command in (None, "dispatch") else ""), flush=True)
    results = {}
    if args.command in (None, "dispatch"):
        results["dispatch"] = roundtrip.run(args)
    if args.command in (None, "a2a"):
        results["a2a"] = a2a.run(args)
    if dist.get_rank() != 0:
        return
    texts = []
    if "dispatch" in results:
        texts.append(roundtrip.report(results["dispatch"], args))
        print("\n" + roundtrip.summary(results["dispatch"]["rows"]), flush=True)
    if "a2a" in results:
        texts.append(a2a.report(results["a2a"], args))
        rows = results["a2a"]["rows"]
        for transport in dict.fromkeys(r["transport"] for r in rows):
            print(f"\n# all-to-all, {a2a.label(transport)}\n" + a2a.table(rows, transport), flush=True)
        for line in a2a.comparison(rows):
            print(line, flush=True)
    if args.command is None:
        with open(os.path.join(args.out, "report.md"), "w") as f:
            f.write("\n\n".join(texts))
    print(f"\nresults: {os.path.abspath(args.out)}", flush=True)
