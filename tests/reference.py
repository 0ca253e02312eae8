"""A dense, single-process reference of the whole exchange: what is right.

Slow and obviously correct: plain Python loops over ranks, tokens and slots.
Tests compare every distributed variant with it, and benchmarks use it for
their correctness column. It follows the contract in README.md literally:

* each local expert receives the tokens routed to it ordered by (source rank,
  source token);
* combine sums, per (token, rank), the weighted slots of the token on that rank
  in ascending expert order (accumulating in fp32, fp64 for fp64), casts that
  partial to the combine wire dtype, then sums the partials in ascending rank
  order and casts once to the output dtype.

Notation: W ranks, E experts, E_local = E // W, per rank r: x[r] [T_r, H],
topk_idx[r] [T_r, K], topk_weights[r] [T_r, K].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dispatch.kernels.gather_sum import accumulate_dtype


@dataclass(frozen=True)
class ReferenceDispatch:
    """What one rank should receive.

    Attributes:
        tokens: [N, H] rows in canonical order.
        tokens_per_expert: [E_local] int64.
        weights: [N] routing weight of each row.
        src_rank, src_token: [N] int64 origin of each row.
        expert: [N] int64 local expert of each row.
    """

    tokens: torch.Tensor
    tokens_per_expert: torch.Tensor
    weights: torch.Tensor
    src_rank: torch.Tensor
    src_token: torch.Tensor
    expert: torch.Tensor


def reference_dispatch(x, topk_idx, topk_weights, num_experts: int) -> list[ReferenceDispatch]:
    """Per-rank dispatch results for a whole world (lists indexed by rank)."""
    world = len(x)
    per_rank = num_experts // world
    out = []
    for rank in range(world):
        rows, weights, src_rank, src_token, experts = [], [], [], [], []
        counts = torch.zeros(per_rank, dtype=torch.int64)
        for local in range(per_rank):
            expert = rank * per_rank + local
            for src in range(world):
                for t in range(x[src].shape[0]):
                    for k in range(topk_idx[src].shape[1]):
                        if int(topk_idx[src][t, k]) == expert:
                            rows.append(x[src][t])
                            weights.append(topk_weights[src][t, k])
                            src_rank.append(src)
                            src_token.append(t)
                            experts.append(local)
                            counts[local] += 1
        hidden = x[0].shape[1]
        out.append(
            ReferenceDispatch(
                tokens=torch.stack(rows) if rows else x[rank].new_zeros(0, hidden),
                tokens_per_expert=counts,
                weights=torch.stack(weights) if weights else topk_weights[rank].new_zeros(0),
                src_rank=torch.tensor(src_rank, dtype=torch.int64),
                src_token=torch.tensor(src_token, dtype=torch.int64),
                expert=torch.tensor(experts, dtype=torch.int64),
            )
        )
    return out


def reference_combine(
    expert_out,
    dispatched: list[ReferenceDispatch],
    num_tokens: list[int],
    weights=None,
    wire_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """Per-rank combine results.

    Args:
        expert_out: per rank r, [N_r, H] outputs in the order of ``dispatched[r]``.
        dispatched: ``reference_dispatch`` of the same routing.
        num_tokens: T of each rank.
        weights: per rank r, [N_r] weights to apply, or None for unweighted.
        wire_dtype: dtype of the partial sums on the wire (default: expert_out's).
    Returns:
        per rank, [T, H] in expert_out's dtype.
    """
    world = len(expert_out)
    out_dtype = expert_out[0].dtype
    wire = wire_dtype or out_dtype
    hidden = expert_out[0].shape[1]
    acc_dtype = accumulate_dtype(out_dtype, wire, *([] if weights is None else [weights[0].dtype]))
    # contributions[home][t][rank] = list of (local expert, row value) in that rank's order
    results = []
    for home in range(world):
        result = torch.zeros(num_tokens[home], hidden, dtype=acc_dtype)
        for t in range(num_tokens[home]):
            total = torch.zeros(hidden, dtype=acc_dtype)
            for rank in range(world):
                d = dispatched[rank]
                mine = ((d.src_rank == home) & (d.src_token == t)).nonzero().flatten().tolist()
                if not mine:
                    continue
                mine.sort(key=lambda n: int(d.expert[n]))
                partial = torch.zeros(hidden, dtype=acc_dtype)
                for n in mine:
                    row = expert_out[rank][n].to(acc_dtype)
                    if weights is not None:
                        row = row * weights[rank][n].to(acc_dtype)
                    partial = partial + row
                total = total + partial.to(wire).to(acc_dtype)
            result[t] = total
        results.append(result.to(out_dtype))
    return results
