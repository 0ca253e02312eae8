"""Study: the bytes an expert-group pipeline over NCCL adds, on the model shapes.

    python3 bench/group_dedup.py [--out DIR]

Pipelining the exchange by groups of local experts (issue: groups are groups of
local experts) over the collectives means one exchange per group: a token whose
experts on one rank fall in several groups crosses to that rank once per group,
where one exchange sends it once. Under uniform top-K routing (K distinct experts
of E per token), a token reaches a given set of m experts with probability
1 - C(E - m, K) / C(E, K); the rows a rank sends to its W - 1 peers are, per token,

    one exchange:   (W - 1) * P(m = E / W)
    G groups:       (W - 1) * G * P(m = E / (W G))

and the ratio of the two is the cost in dispatch bytes (the same for the
gradient's way back). Each line also counts it on a sampled uniform routing.
Writes ``group-dedup.md`` and ``.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

SHAPES = {  # T per rank, H, E, K
    "deepseek-v3": (4096, 7168, 256, 8),
    "qwen3-235b": (4096, 4096, 128, 8),
    "mixtral-8x7b": (8192, 4096, 8, 2),
}


def hit(experts: int, topk: int, m: int) -> float:
    """P(a token's K distinct experts of E include one of m given experts)."""
    return 1.0 - math.comb(experts - m, topk) / math.comb(experts, topk)


def sampled_rows(tokens: int, experts: int, topk: int, world: int, groups: int, seed: int = 0) -> int:
    """Rows rank 0 sends to its peers in one exchange per group, on a sampled routing."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices
    per_group = experts // world // groups
    bucket = idx // per_group  # (rank, group) of each slot
    hits = torch.zeros(tokens, world * groups, dtype=torch.bool).scatter_(1, bucket, True)
    return int(hits[:, groups:].sum())  # the peers' (rank, group) pairs, rank 0's own first


def rows(args) -> list[dict]:
    out = []
    for name, (tokens, hidden, experts, topk) in SHAPES.items():
        for world in args.worlds:
            local = experts // world
            if experts % world:
                continue
            one = tokens * (world - 1) * hit(experts, topk, local)
            base = sampled_rows(tokens, experts, topk, world, 1)
            for groups in args.groups:
                if local % groups:
                    continue
                many = tokens * (world - 1) * groups * hit(experts, topk, local // groups)
                sample = sampled_rows(tokens, experts, topk, world, groups)
                out.append(dict(shape=name, world=world, groups=groups, experts_per_group=local // groups,
                                rows_one_exchange=one, rows_per_group_exchanges=many, ratio=many / one,
                                sampled_ratio=sample / base,
                                extra_mib=(many - one) * hidden * 2 / 2**20))
    return out


def report(table: list[dict], out: str | None) -> str:
    lines = ["| shape | W | groups | experts per group | rows sent, one exchange | rows sent, one per group | "
             "bytes x | sampled | extra MiB per rank (bf16) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in table:
        lines.append(f"| {r['shape']} | {r['world']} | {r['groups']} | {r['experts_per_group']} | "
                     f"{r['rows_one_exchange']:.0f} | {r['rows_per_group_exchanges']:.0f} | {r['ratio']:.2f} | "
                     f"{r['sampled_ratio']:.2f} | {r['extra_mib']:.1f} |")
    text = "\n".join(lines)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "group-dedup.md"), "w") as f:
            f.write("Dispatch rows a rank sends to its peers, uniform top-K routing: one exchange against one per "
                    "group of local experts (bench/group_dedup.py)\n\n" + text + "\n")
        with open(os.path.join(out, "group-dedup.json"), "w") as f:
            json.dump(table, f, indent=1)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=lambda s: [int(w) for w in s.split(",")], default=[2, 4, 8])
    parser.add_argument("--groups", type=lambda s: [int(g) for g in s.split(",")], default=[1, 2, 4, 8])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    print(report(rows(args), args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
