"""What a dispatch hands out: its handle, its result, and its rows by group.

Notation: W ranks, E experts (E_local per rank), T tokens on this rank, K slots
per token, H hidden size, N expanded rows on this rank (one per (source token,
local expert)), in canonical order: local expert ascending, then (source rank,
source token) ascending.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

import torch

from dispatch.stats import DispatchStats


@dataclass(frozen=True, kw_only=True)
class CombineHandle:
    """What combine (and both backwards) need from one dispatch; frozen, so that
    several micro-batches can be in flight on one dispatcher.

    Attributes:
        owner: the dispatcher that made it (checked by the verbs along it).
        transport: the transport that planned it and moves along it
            (``dispatch.transports``; for ``variant="auto"``, the one it chose).
        device: the device of the dispatch's x, where its rows and the rows
            moved along it lie (``GroupSums.add`` holds the experts' rows to it).
        num_tokens: T of the dispatch.
        num_rows: N, rows handed to the experts.
        topk: K of the dispatch.
        x_grad_any, weights_grad_any: whether some rank of the group needs the
            gradient of x / topk_weights (learnt in the counts all-gather): the
            backward exchanges run on every rank alike, whatever this rank needs.
        link: [0] tensor output by the dispatch's autograd node and fed into the
            combine's, so that with grad mode on, both nodes exist on every rank
            (a rank whose experts return a fresh tensor still joins the backward
            exchanges of its peers). None until dispatch sets it.
        has_rows: per rank of the group, whether its experts get rows in this
            exchange (host, from the counts exchange; the same on every rank).
            Where some rank has rows and another none, the partial sums' dtype
            is agreed (``checks.home_rows``).
        max_rows: a dispatch with ``max_rows`` whose variant read N on the host,
            or with ``pad_to_capacity``: the rows the verbs hand out and take
            (the N received, padded); the variant moves N. None otherwise (a
            variant that bounds its outputs on the device counts them in
            ``num_rows``).
        pad_blocks: with ``pad_to_capacity``, the rows each source rank has in
            every local expert's block (min(C_s, T_s)); None otherwise.
        pad_index: with ``pad_to_capacity``, [N] int64 on the device: where each
            received row sits among the ``max_rows`` (set when the dispatch is
            waited for); None otherwise (the N rows come first).
        group_experts: for a dispatch by G groups of local experts
            (``dispatch(groups=G)``), the G + 1 bounds of the groups'
            local experts (``plan.expert_groups``); None for one group.
        group_rows: the G + 1 bounds of the groups' rows among the N
            (host); None for one group.
        call: the number of its dispatch among the dispatcher's (``plan.Ticket``;
            the transport's plan sets it): the verbs along it carry it, so that
            ranks moving along the handles of different dispatches raise.
    """

    owner: object
    transport: object
    device: torch.device
    num_tokens: int
    num_rows: int
    topk: int
    x_grad_any: bool
    weights_grad_any: bool
    has_rows: tuple[bool, ...]
    link: torch.Tensor | None = None
    max_rows: int | None = None
    pad_blocks: tuple[int, ...] | None = None
    pad_index: torch.Tensor | None = None
    group_experts: tuple[int, ...] | None = None
    group_rows: tuple[int, ...] | None = None
    call: int = 0

    @property
    def rows(self) -> int:
        """Rows of the dispatched tensors the verbs hand out and take."""
        return self.num_rows if self.max_rows is None else self.max_rows

    @property
    def groups(self) -> int:
        """G, the groups of local experts the exchange moves by (1: one piece)."""
        return 1 if self.group_rows is None else len(self.group_rows) - 1

    def row_range(self, g: int) -> tuple[int, int]:
        """Group g's rows among the N: [lo, hi)."""
        return (0, self.rows) if self.group_rows is None else self.group_rows[g : g + 2]


@dataclass(frozen=True)
class Dispatched:
    """The result of ``TokenDispatcher.dispatch``.

    Attributes:
        tokens: [N, H] rows for the local experts, canonical order, dtype of x
            (with ``max_rows`` or ``pad_to_capacity``, padded: see ``dispatch``
            and ``DispatchConfig``).
        tokens_per_expert: [E_local] int64 on the device of x.
        tokens_per_expert_host: [E_local] int64 on the CPU (the plan already had it:
            no extra synchronisation), for grouped GEMMs that size on the host;
            None for a dispatch with ``max_rows`` (nothing read on the host).
        weights: [N] routing weight of each row (dtype of topk_weights);
            differentiable w.r.t. topk_weights.
        src_rank: [N] int64, home rank of each row's token.
        src_token: [N] int64, index of each row's token on its home rank.
        handle: pass to ``combine``.
        stats: :class:`dispatch.stats.DispatchStats`, rows and bytes this rank
            sends per tier (intra-/inter-node) in this round trip, from the plan's
            host-side split sizes (None for a variant that does not account them,
            or a dispatch with ``max_rows`` on the NVLink engine); counted when
            first read.
        dropped: [T, K] bool, the slots of this rank dropped by expert capacity
            (``DispatchConfig.capacity_factor``; None without it).
    """

    tokens: torch.Tensor
    tokens_per_expert: torch.Tensor
    tokens_per_expert_host: torch.Tensor | None
    weights: torch.Tensor
    src_rank: torch.Tensor
    src_token: torch.Tensor
    handle: CombineHandle
    dropped: torch.Tensor | None = None
    # what counts ``stats`` (a function of no arguments), called at its first read
    _traffic: Callable[[], DispatchStats | None] | None = dataclasses.field(default=None, repr=False, compare=False)

    @functools.cached_property
    def stats(self) -> DispatchStats | None:
        return None if self._traffic is None else self._traffic()


@dataclass(frozen=True)
class DispatchedGroup:
    """One group's rows of a dispatch by groups (``DispatchWork.wait_group``);
    not differentiable (a pipeline makes its own backward along the handle).

    Attributes:
        tokens: [N_g, H] the group's rows (canonical order), dtype of x.
        tokens_per_expert: [E_local] int64 on the device: rows per local
            expert, zero outside the group (so ``experts(tokens, tokens_per_expert)``
            computes the group's experts only).
        tokens_per_expert_host: the same on the CPU.
        weights: [N_g] routing weight of each row (dtype of topk_weights).
        rows: (lo, hi), the group's rows among the dispatch's N.
        experts: (first, end), the group's local experts.
    """

    tokens: torch.Tensor
    tokens_per_expert: torch.Tensor
    tokens_per_expert_host: torch.Tensor
    weights: torch.Tensor
    rows: tuple[int, int]
    experts: tuple[int, int]


def made(cls: type, **fields):
    """An instance of the frozen dataclass ``cls`` with ``fields`` (every field
    without a default among them; the others their defaults), made without its
    ``__init__``: a frozen dataclass sets each field through
    ``object.__setattr__``, microseconds on every dispatch's host path."""
    try:
        defaults = _DEFAULTS[cls]
    except KeyError:
        defaults = _DEFAULTS[cls] = {f.name: f.default for f in dataclasses.fields(cls)
                                     if f.default is not dataclasses.MISSING}
    instance = object.__new__(cls)
    instance.__dict__.update(defaults, **fields)
    return instance


_DEFAULTS: dict[type, dict] = {}  # (made) the defaults of each class made so


def with_link(handle: CombineHandle, link: torch.Tensor) -> CombineHandle:
    """A copy of ``handle`` with its ``link`` set (shallow: the dispatch's autograd
    node keeps the handle without the link, so that no reference cycle (handle,
    link, node) keeps the graph alive past its outputs)."""
    linked = object.__new__(type(handle))
    linked.__dict__.update(handle.__dict__, link=link)
    return linked


def padded(rows: torch.Tensor, handle: CombineHandle, fill) -> torch.Tensor:
    """The N rows a variant moved, padded with ``fill`` to the ``max_rows`` of a
    handle that has one (a dispatch with ``max_rows`` over a host read: after
    them; with ``pad_to_capacity``: in their blocks, ``pad_index``)."""
    if handle.pad_index is not None:
        out = rows.new_full((handle.max_rows, *rows.shape[1:]), fill)
        return out.index_copy_(0, handle.pad_index, rows)
    if handle.max_rows is None or rows.shape[0] == handle.max_rows:
        return rows
    pad = rows.new_full((handle.max_rows - rows.shape[0], *rows.shape[1:]), fill)
    return torch.cat([rows, pad])


def received(rows: torch.Tensor, handle: CombineHandle) -> torch.Tensor:
    """The N of a handle's ``max_rows`` rows that the variant moves."""
    if handle.pad_index is not None:
        return rows.index_select(0, handle.pad_index)
    return rows if handle.max_rows is None else rows[: handle.num_rows]


def pad_to_blocks(handle: CombineHandle, plan_out: "PlanOutputs", local: int):
    """(handle with ``pad_index``, plan outputs counting the blocks) of a
    ``pad_to_capacity`` dispatch: received row i of local expert e from source
    s goes to e * sum(B) + B_0 + .. + B_{s-1} + (its place among (e, s)'s rows),
    from the rows' sources and counts on the device (no host read)."""
    blocks = torch.tensor(handle.pad_blocks, dtype=torch.int64)
    width, starts = int(blocks.sum()), torch.cumsum(blocks, 0) - blocks
    device = plan_out.src_rank.device
    rows, world = handle.num_rows, len(handle.pad_blocks)
    expert = torch.repeat_interleave(torch.arange(local, device=device), plan_out.tokens_per_expert,
                                     output_size=rows)
    key = expert * world + plan_out.src_rank  # canonical order: ascending key
    sizes = torch.zeros(local * world, dtype=torch.int64, device=device).scatter_add_(0, key, torch.ones_like(key))
    first = torch.cumsum(sizes, 0) - sizes
    place = torch.arange(rows, device=device) - first[key]
    index = expert * width + starts.to(device)[plan_out.src_rank] + place
    per_expert = torch.full((local,), width, dtype=torch.int64)
    plan_out = dataclasses.replace(plan_out, tokens_per_expert=per_expert.to(device), tokens_per_expert_host=per_expert)
    return dataclasses.replace(handle, pad_index=index), plan_out


def only(counts: torch.Tensor, first: int, end: int) -> torch.Tensor:
    """``counts`` with every entry outside [first, end) zeroed (a new tensor)."""
    out = torch.zeros_like(counts)
    out[first:end] = counts[first:end]
    return out


@dataclass(frozen=True)
class PlanOutputs:
    """Per-row facts the plan learned, handed to :class:`Dispatched` (weights in
    the dtype they travelled in; the dispatch converts them to topk_weights' dtype)."""

    weights: torch.Tensor
    tokens_per_expert: torch.Tensor
    tokens_per_expert_host: torch.Tensor
    src_rank: torch.Tensor
    src_token: torch.Tensor

