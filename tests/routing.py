"""Routings for whole worlds, drawn in one place, and the helpers that build inputs.

A routing is drawn for every rank at once (hypothesis draws the shape and the
adversarial mode, a seeded generator the tensors), so a world can be fed one
example per call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

MODES = ("random", "one_expert", "one_rank", "sparse", "all_experts")


@dataclass(frozen=True)
class Routing:
    """One exchange's routing over a world.

    Attributes:
        num_experts: E.
        topk_idx: per rank, [T_r, K] int64 (-1 = empty slot).
        topk_weights: per rank, [T_r, K] float64, dyadic (exact in fp32 sums).
    """

    num_experts: int
    topk_idx: list
    topk_weights: list

    @property
    def world_size(self) -> int:
        return len(self.topk_idx)

    @property
    def num_tokens(self) -> list[int]:
        return [t.shape[0] for t in self.topk_idx]


def make_routing(world_size: int, experts_per_rank: int, topk: int, tokens: list[int], mode: str, seed: int) -> Routing:
    """Build a routing from its description (deterministic in ``seed``)."""
    gen = torch.Generator().manual_seed(seed)
    num_experts = world_size * experts_per_rank
    if mode == "all_experts":
        topk = num_experts
    topk = min(topk, num_experts)
    target_expert = int(torch.randint(num_experts, (1,), generator=gen))
    target_rank = int(torch.randint(world_size, (1,), generator=gen))
    idx_all, w_all = [], []
    for count in tokens:
        idx = torch.full((count, topk), -1, dtype=torch.int64)
        for t in range(count):
            if mode == "one_expert":
                idx[t, int(torch.randint(topk, (1,), generator=gen))] = target_expert
                continue
            if mode == "one_rank":
                pool = torch.arange(target_rank * experts_per_rank, (target_rank + 1) * experts_per_rank)
            else:
                pool = torch.arange(num_experts)
            chosen = pool[torch.randperm(len(pool), generator=gen)[: min(topk, len(pool))]]
            idx[t, : len(chosen)] = chosen
            idx[t] = idx[t, torch.randperm(topk, generator=gen)]  # empties anywhere
        if mode == "sparse" and count:
            drop = torch.rand(count, topk, generator=gen) < 0.4
            idx[drop] = -1
        weights = torch.randint(1, 9, (count, topk), generator=gen).double() / 8
        idx_all.append(idx)
        w_all.append(weights)
    return Routing(num_experts, idx_all, w_all)


@st.composite
def routings(draw, world_size: int, max_tokens: int = 10) -> Routing:
    """Hypothesis strategy: a routing for a world of ``world_size`` ranks."""
    experts_per_rank = draw(st.integers(1, 4))
    num_experts = world_size * experts_per_rank
    topk = draw(st.integers(1, min(num_experts, 6)))
    tokens = [draw(st.integers(0, max_tokens)) for _ in range(world_size)]
    mode = draw(st.sampled_from(MODES))
    seed = draw(st.integers(0, 2**31 - 1))
    return make_routing(world_size, experts_per_rank, topk, tokens, mode, seed)


def identity_tokens(rank: int, count: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """[count, hidden] rows that carry their origin: value = 64 * rank + token + h / 4.

    Exact in fp32/fp64 (and in bf16 while 64 * rank + token < 64), so a wrong
    route shows as a wrong value.
    """
    token = torch.arange(count, dtype=torch.float64).unsqueeze(1)
    channel = torch.arange(hidden, dtype=torch.float64).unsqueeze(0) / 4
    return (64 * rank + token + channel).to(dtype)


def random_tokens(rank: int, count: int, hidden: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    return torch.randn(count, hidden, generator=gen, dtype=torch.float64).to(dtype)
