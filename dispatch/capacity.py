"""Token dropping by expert capacity, as Megatron-Core's router does it, on the
rank's own routing before anything moves (``DispatchConfig.capacity_factor``).

Each rank caps the slots it sends to each expert at

    C = ceil(T * K / E * capacity_factor)

(T this rank's tokens, K slots per token, E experts: Megatron's ``get_capacity``
of T * K tokens), and keeps, per expert, the C slots its ``drop_policy`` ranks
first:

* ``"probs"``: the largest routing weights (ties: the earlier token);
* ``"position"``: the earliest tokens.

A dropped slot becomes an empty one (-1): its token does not travel to that
expert and its weight gets no gradient. The rest of the contract is unchanged
(a kept slot is dispatched as if the routing had named only the kept slots).
No host synchronisation: sorts on the device, so that it also runs inside a
CUDA graph.
"""

from __future__ import annotations

import math

import torch

from dispatch import checks
from dispatch.transports.base import WORD_SPAN

DROP_POLICIES = ("probs", "position")


def capacity(num_tokens: int, topk: int, num_experts: int, capacity_factor: float) -> int:
    """C, the slots of one rank's dispatch an expert takes (at most its T K slots:
    a factor large enough to overflow takes them all)."""
    most = num_tokens * topk
    share = most / num_experts * capacity_factor
    return most if share >= most else math.ceil(share)


def drop_over_capacity(
    topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, capacity_factor: float, policy: str,
    checked: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_idx with the dropped slots set to -1, [T, K] bool mask of the dropped slots).

    Ids outside [0, E) are left as they are (the value checks refuse them) and
    never dropped; where the value checks run (``checked``), neither is any
    slot of a row they refuse (an id out of range, an id twice, a non-finite
    weight), nor does it take an expert's capacity: their error names the row
    as given (and dropping one of a repeated id would hide it from them);
    ``topk_weights`` only orders the slots (``"probs"``).
    """
    num_tokens, topk = topk_idx.shape
    cap = capacity(num_tokens, topk, num_experts, capacity_factor)
    if cap >= num_tokens or topk_idx.numel() == 0:  # every expert takes every token it is given
        return topk_idx, torch.zeros_like(topk_idx, dtype=torch.bool)
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    if checked:  # the rows the value checks refuse keep every slot
        valid &= ~checks.bad_rows(topk_idx, topk_weights.detach(), num_experts).any(0).unsqueeze(1)
    expert = torch.where(valid, topk_idx, num_experts).flatten().long()  # E: the bucket never dropped
    order = torch.arange(expert.numel(), device=expert.device)  # (token, slot) order: token order first
    if policy == "probs":
        weights = topk_weights.detach().flatten()[order]
        order = order[torch.sort(weights, descending=True, stable=True).indices]
    order = order[torch.sort(expert[order], stable=True).indices]  # by expert, keeping the policy's order
    sizes = torch.zeros(num_experts + 1, dtype=torch.int64, device=expert.device)
    sizes.scatter_add_(0, expert, torch.ones_like(expert))  # not bincount: its size would need a host read
    starts = torch.cumsum(sizes, 0) - sizes
    place = torch.empty_like(order)
    place[order] = torch.arange(order.numel(), device=order.device) - starts[expert[order]]
    dropped = (valid.flatten() & (place >= cap)).view(num_tokens, topk)
    return torch.where(dropped, -1, topk_idx), dropped


def agreed_blocks(calls, config, topk_idx: torch.Tensor, ticket, word: int | None) -> tuple:
    """(min(C_s, T_s) of every rank s, every rank's dispatch word or None) of a
    ``pad_to_capacity`` dispatch: every rank's T travels in the call's agreement
    (``calls``: its ``agreement.Calls``), with the ``word`` of a transport that
    agrees one (``Transport.dispatch_word``), as T * WORD_SPAN + word."""
    topk = topk_idx.shape[1]
    told = [row[-1] for row in calls.agree(ticket, tail=(topk_idx.shape[0] * WORD_SPAN + (word or 0),))]
    blocks = tuple(min(capacity(t // WORD_SPAN, topk, config.num_experts, config.capacity_factor), t // WORD_SPAN)
                   for t in told)
    return blocks, None if word is None else tuple(t % WORD_SPAN for t in told)
