"""The routing plan: everything derived from ``topk_idx`` for one exchange.

Notation (used throughout the package):

    W        ranks in the EP group          E        experts in total
    E_local  experts per rank (E // W)      K        expert slots per token
    T        tokens on this rank            H        hidden size
    S        rows this rank sends           (one per (token, destination rank))
    R        rows this rank receives        (one per (source token, this rank))
    N        expanded rows on this rank     (one per (source token, local expert))
    J        min(K, E_local): most slots one token can have on one rank

Orders (the contract in README.md):

* send order: destination rank ascending, then token index ascending. A token is
  sent to a rank once, however many of its experts live there.
* receive order: the concatenation of the send orders of the source ranks, so
  (source rank, source token) ascending.
* canonical (expanded) order: local expert ascending, then (source rank, source
  token) ascending. This is what the experts see.

How the plan is made, with one host synchronisation:

1. ``route``: destination ranks and per-destination counts, before any
   communication.
2. The counts of every rank are all-gathered (one small collective). From them
   every rank knows where each of its slots will land in the destination's
   canonical order, so ``build_send_plan`` writes, for each send row, the
   expanded positions of its slots: the receiver scatters, it never sorts.
   Buffers are sized by the upper bound ``T * min(K, W)`` so that nothing here
   waits for the host.
3. The caller copies the split sizes to the host once, slices the buffers and
   moves the slot lists with the rows' metadata (one all-to-all);
   ``build_recv_plan`` expands, placing each received block (source rank)
   from a table made on the host (``recv_table``).

The send order (destination-major, then item ascending) is made by ``send_positions`` /
``rows_by_item`` / ``items_by_row``: the alltoall variant's tokens to ranks here, the others'
tokens to ranks or nodes and held rows to ranks in ``dispatch.counts.send_order``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dispatch.kernels import plan_cpu, recv_plan

# Larger than any row position, used to push padding to the end of a sort.
_PAD = torch.iinfo(torch.int64).max


@dataclass(frozen=True)
class Route:
    """Send-side routing of one rank, computed before any communication.

    Attributes:
        dest: [T, K] int64, destination rank of each slot; ``W`` for an empty slot.
        hit: [T, W] bool, whether token t has at least one expert on rank r.
        counts: [W, 1 + E_local] int64; row r is ``[rows sent to r, slots for each
            of r's local experts]``. This is what the counts exchange moves.
    """

    dest: torch.Tensor
    hit: torch.Tensor
    counts: torch.Tensor


def route(topk_idx: torch.Tensor, num_experts: int, world_size: int) -> Route:
    """Destination ranks and per-destination counts of one rank's routing (on CPU
    compiled: ``dispatch.kernels.plan_cpu``; elsewhere :func:`route_reference`).

    Args:
        topk_idx: [T, K] int32/int64 global expert ids, ``-1`` = empty slot. Ids
            outside ``[0, E)`` and repeats within a row are treated as empty (the
            value checks reject them; with the checks off they are dropped).
        num_experts: E.
        world_size: W.
    """
    compiled = plan_cpu.on_cpu(topk_idx)
    if compiled is not None:
        return Route(*compiled.route(topk_idx, num_experts, world_size))
    return route_reference(topk_idx, num_experts, world_size)


def route_reference(topk_idx: torch.Tensor, num_experts: int, world_size: int) -> Route:
    """:func:`route` in torch operations (any device)."""
    (num_tokens, topk), experts_per_rank, idx = topk_idx.shape, num_experts // world_size, topk_idx.long()
    # Ids out of range and repeats of an earlier slot's expert are rejected by the value checks; here
    # they are empty slots, so the plan never reads memory it did not write, whatever the input.
    earlier = torch.ones(topk, topk, dtype=torch.bool, device=idx.device).tril(-1)
    repeat = ((idx.unsqueeze(2) == idx.unsqueeze(1)) & earlier).any(2)
    valid = (idx >= 0) & (idx < num_experts) & ~repeat
    dest = torch.where(valid, idx // experts_per_rank, world_size)
    hit = torch.zeros(num_tokens, world_size + 1, dtype=torch.bool, device=idx.device)
    hit.scatter_(1, dest, True)
    hit = hit[:, :world_size]
    expert_slots = torch.zeros(num_experts + 1, dtype=torch.int64, device=idx.device)
    flat = torch.where(valid, idx, num_experts).flatten()
    expert_slots.scatter_add_(0, flat, torch.ones_like(flat))
    per_expert = expert_slots[:num_experts].view(world_size, experts_per_rank)
    counts = torch.cat([hit.sum(0, dtype=torch.int64).unsqueeze(1), per_expert], dim=1)
    return Route(dest=dest, hit=hit, counts=counts)


# What each rank adds to the counts all-gather (and to every other verb's first
# message, ``agreement.agree``): the call itself (its verb, its number on the
# dispatcher, and the number of the dispatch whose handle it moves along: ranks
# whose calls differ all raise, so that no call completes by pairing with
# another), so that every rank can check that all ranks agree, learn
# which gradients some rank needs, learn that a rank failed or refused its input
# in work it did before the all-gather (its peers then stop too), and learn every
# rank's row budgets (its max_rows, and the rows its free device memory holds;
# -1: none), so that all refuse a rank over one alike.
HEADER = ("verb", "call", "along", "topk", "hidden", "x_dtype", "weights_dtype", "x_grad", "weights_grad", "failed",
          "max_rows", "memory_rows")
DTYPE_CODES = {dtype: code for code, dtype in enumerate((torch.float16, torch.bfloat16, torch.float32, torch.float64))}


@dataclass(frozen=True)
class Ticket:
    """What a call's header carries besides its inputs.

    Attributes:
        verb: index of the verb in ``agreement.VERBS``.
        call: the call's number among this dispatcher's calls of that verb (1, 2, ...).
        along: the number of the dispatch whose handle the call moves along (0
            for a dispatch).
        refused: this rank refused its own arguments: it takes part in the
            call's first message marked failed, then raises its own error.
        max_rows, memory_rows: the row budgets (``max_rows``, and the rows the
            free device memory holds), -1 for none.
    """

    verb: int = 0
    call: int = 0
    along: int = 0
    refused: bool = False
    max_rows: int = -1
    memory_rows: int = -1

    def with_budgets(self, budgets: tuple[int, int]) -> "Ticket":
        return Ticket(self.verb, self.call, self.along, self.refused, budgets[0], budgets[1])


def header(x: torch.Tensor, topk_weights: torch.Tensor, topk: int, ticket: Ticket = Ticket()) -> list[int]:
    """This rank's entries of ``HEADER``."""
    grad = torch.is_grad_enabled()
    return [
        ticket.verb,
        ticket.call,
        ticket.along,
        topk,
        x.shape[1],
        DTYPE_CODES[x.dtype],
        DTYPE_CODES[topk_weights.dtype],
        int(grad and x.requires_grad),
        int(grad and topk_weights.requires_grad),
        int(ticket.refused),  # or raised later on the device (``checks.fold_flags``)
        ticket.max_rows,
        ticket.memory_rows,
    ]


def call_header(ticket: Ticket, dtype_code: int = -1, hidden: int = 0, weights_code: int = -1) -> list[int]:
    """The entries of ``HEADER`` for a call without a dispatch's inputs (its
    agreement, ``agreement.agree`` and ``dispatch.board``): the call, its refusal,
    ``hidden`` (the width of its rows, 0: none), ``dtype_code`` in ``x_dtype``
    (the code of its rows' dtype, -1: none) and ``weights_code`` in
    ``weights_dtype`` (the code of its weights' dtype, -1: none)."""
    return [ticket.verb, ticket.call, ticket.along, 0, hidden, dtype_code, weights_code, 0, 0, int(ticket.refused),
            -1, -1]


@dataclass(frozen=True)
class CountsRow:
    """The row each rank all-gathers in a counts exchange over the collectives,
    defined here once: ``[counts W * (1 + E_local) | header | tail]``, the
    counts this rank's ``Route.counts``, the header its ``HEADER`` entries, the
    tail what the exchange adds (at least one entry). A call's agreement over
    the host channel never meets it (``agreement.agree``). (The NVLink engine's
    row is ``Row`` in ``csrc/engine.cuh``: ``dispatch.nvlink_layout``.)

    Attributes:
        world: W; local: E_local; tail: entries after the header.
        header_at: where the header starts; width: the row's entries.
    """

    world: int
    local: int
    tail: int = 1
    header_at: int = field(init=False)
    width: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "header_at", self.world * (1 + self.local))
        object.__setattr__(self, "width", self.header_at + len(HEADER) + self.tail)

    def row(self, counts: torch.Tensor, header_row: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
        """[width] int64: what this rank all-gathers (counts [W, 1 + E_local])."""
        return torch.cat([counts.flatten(), header_row, tail])

    def split(self, gathered: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[W, width] all-gathered rows -> (all_counts [W_src, W_dst, 1 + E_local],
        headers [W, len(HEADER)], tails [W, tail])."""
        at, end = self.header_at, self.header_at + len(HEADER)
        return gathered[:, :at].view(self.world, self.world, -1), gathered[:, at:end], gathered[:, end:]


def to_device(host: torch.Tensor, device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """A small host-built tensor on ``device`` (into ``out`` there, if given);
    on CUDA through a pinned buffer with ``non_blocking=True``, so that the
    copy does not wait for the work queued on the stream (every host-to-device
    copy of the package goes here)."""
    if device.type != "cuda" or host.device.type != "cpu":
        if out is None and host.device == device:  # (CPU: the tensor itself)
            return host
        return host.to(device) if out is None else out.copy_(host)
    if out is None:
        return host.pin_memory().to(device, non_blocking=True)
    return out.copy_(host.pin_memory(), non_blocking=True)


def send_positions(hit: torch.Tensor, sizes: "torch.Tensor | tuple[int, ...]") -> torch.Tensor:
    """Send row of each (item, destination) when items go out destination-major.

    Args:
        hit: [I, D] bool, item i goes to destination d.
        sizes: rows per destination (``hit.sum(0)``): [D] int64 on hit's
            device, or host ints (the split sizes).
    Returns:
        [I, D] int64: the row of (i, d) in the send order (destination
        ascending, then item ascending); meaningless where ``hit`` is False.
    """
    # Scan along the contiguous dimension: a scan down I columns of width D is
    # D-way parallel only, and slow.
    if not isinstance(sizes, torch.Tensor):
        sizes = to_device(torch.tensor(sizes, dtype=torch.int64), hit.device)
    before = torch.cumsum(hit.t().contiguous(), 1, dtype=torch.int64).t()  # [I, D] items up to i going to d
    return before - 1 + _exclusive(sizes, 0)


def rows_by_item(hit: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """[I, D] int64: row i lists the send rows of item i in ascending destination, -1 padded
    (``position`` ascending with the destination, as in the send order)."""
    return _pack_left(torch.where(hit, position, _PAD))


def rows_by_destination(hit: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """:func:`rows_by_item` for positions in any order: row i lists ``position``
    of item i's destinations, in ascending destination, -1 padded."""
    dests = hit.shape[1]
    order = torch.sort(torch.where(hit, torch.arange(dests, device=hit.device), dests), dim=1, stable=True).indices
    return torch.where(hit.gather(1, order), position.gather(1, order), -1)


def items_by_row(hit: torch.Tensor, position: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[num_rows] int64: the item behind each of the first ``num_rows`` send rows
    (``num_rows`` may be an upper bound of them: the rows past the real ones
    are left unset)."""
    items, dests = hit.shape
    out = torch.empty(num_rows + 1, dtype=torch.int64, device=hit.device)
    item = torch.arange(items, device=hit.device).repeat_interleave(dests)
    out.scatter_(0, torch.where(hit, position, num_rows).flatten(), item)
    return out[:num_rows]


def expert_groups(num_local: int, groups: int) -> tuple[int, ...]:
    """G + 1 bounds of the groups of local experts: group g is experts
    ``[g E_local // G, (g + 1) E_local // G)`` (contiguous, in ascending order,
    so that a group's rows are one range of the canonical order)."""
    return tuple(g * num_local // groups for g in range(groups + 1))


@dataclass(frozen=True)
class GroupRoute:
    """Send-side routing of one rank by groups of local experts (G groups).

    A (token, destination) row crosses with the first group of the destination
    that needs it (the later groups there copy it locally), and its partial sum
    goes home with the last (once every slot of the token there is summed).

    Attributes:
        groups: G.
        first: [T, W] int64, the group of token t's first local expert on rank r
            (G where t has none there).
        last: [T, W] int64, the group of its last one (G where none).
        counts: [W, 2, E_local] int64: rows to rank r whose first (``[:, 0]``) /
            last (``[:, 1]``) group is g, in column g < G (zero beyond): what the
            counts exchange moves, in a width that does not depend on G.
    """

    groups: int
    first: torch.Tensor
    last: torch.Tensor
    counts: torch.Tensor


def group_route(r: Route, topk_idx: torch.Tensor, groups: int) -> GroupRoute:
    """The :class:`GroupRoute` of ``route(topk_idx, ...)`` = ``r`` for G = ``groups``."""
    hit, dest = r.hit, r.dest
    num_tokens, world = hit.shape
    local = r.counts.shape[1] - 1
    device = hit.device
    # the group of local expert e under ``expert_groups``, made on the device (no
    # host copy: this runs inside the plan's CUDA graphs)
    group_of = ((torch.arange(local, device=device) + 1) * groups - 1) // local
    valid = dest < world
    group = group_of[torch.where(valid, topk_idx.long() % local, 0)]
    none = torch.full((num_tokens, world + 1), groups, dtype=torch.int64, device=device)
    first = none.scatter_reduce(1, dest, torch.where(valid, group, groups), "amin")[:, :world]
    last = none.fill_(-1).scatter_reduce(1, dest, torch.where(valid, group, -1), "amax")[:, :world]
    last = torch.where(hit, last, groups)
    counts = torch.zeros(world * 2 * local + 1, dtype=torch.int64, device=device)
    column = torch.arange(world, device=device) * (2 * local)
    for side, which in enumerate((first, last)):
        at = torch.where(hit, column + side * local + which, world * 2 * local)
        counts.scatter_add_(0, at.flatten(), torch.ones_like(at).flatten())
    return GroupRoute(groups, first, last, counts[:-1].view(world, 2, local))


def ordered_positions(hit: torch.Tensor, bucket: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """[I, D] int64: the place of each (item, destination) with ``hit`` when
    they are ordered by ``bucket`` ([I, D] int64 in [0, num_buckets)), then by
    item ascending; meaningless where ``hit`` is False."""
    items, dests = hit.shape
    item = torch.arange(items, device=hit.device).unsqueeze(1)
    key = torch.where(hit, bucket * items + item, num_buckets * items).flatten()
    order = torch.sort(key, stable=True).indices
    place = torch.empty_like(order)
    place[order] = torch.arange(order.numel(), device=hit.device)
    return place.view(items, dests)


def group_orders(hit: torch.Tensor, groups: GroupRoute) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three orders of a grouped exchange's rows ([T, W] places where ``hit``):

    * slot lists: destination, then first group, then token (one metadata
      all-to-all: each source's rows arrive group after group);
    * rows leaving: first group, then destination, then token (group g's
      all-to-all takes one contiguous range);
    * partial sums coming home: last group, then source rank, then token.
    """
    world, count = hit.shape[1], groups.groups
    dest = torch.arange(world, device=hit.device).unsqueeze(0)
    return (ordered_positions(hit, dest * count + groups.first.clamp(max=count - 1), world * count),
            ordered_positions(hit, groups.first.clamp(max=count - 1) * world + dest, world * count),
            ordered_positions(hit, groups.last.clamp(max=count - 1) * world + dest, world * count))


@dataclass(frozen=True)
class SendPlan:
    """Where each of this rank's tokens goes, and where its partial sums come back.

    Row buffers hold ``T * min(K, W)`` rows (an upper bound of S); the first S
    are real.

    Attributes:
        send_token: [T * min(K, W)] int64, in send order, the token of each send row.
        meta: [T * min(K, W) + 1, J + 1 + J * w] int32 per send row: the
            expanded positions of its slots on the destination, ascending, -1
            padded (J columns); the source token; the slot weights bit-cast to
            int32 (``w`` words each, 1 for fp32 weights, 2 for fp64), in the
            order of the positions. The last row collects the writes of empty slots.
        home_index: [T, W] int64; row t lists the send rows of token t in
            ascending destination rank, so that its partial sums come back in
            rank order, padded with -1.
        slot_row: [T, K] int64, the send row that carries slot k (-1 if empty).
        slot_col: [T, K] int64, the column of slot k in that row's slot list.
    """

    send_token: torch.Tensor
    meta: torch.Tensor
    home_index: torch.Tensor
    slot_row: torch.Tensor
    slot_col: torch.Tensor


def weight_wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """Routing weights travel as fp64 if they are fp64, else as fp32 (exact for bf16/fp16)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _exclusive(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Exclusive prefix sum along ``dim``."""
    return torch.cumsum(values, dim) - values


def build_send_plan(
    r: Route,
    all_counts: torch.Tensor,
    rank: int,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    groups: "GroupRoute | None" = None,
) -> SendPlan:
    """Send order and slot lists, from the all-gathered counts; no host synchronisation.

    Args:
        r: this rank's :class:`Route`.
        all_counts: [W_src, W_dst, 1 + E_local] int64, ``all_counts[s]`` =
            ``route(...).counts`` of rank s.
        rank: this rank's index in the group.
        topk_idx: [T, K] (valid) expert ids.
        topk_weights: [T, K] routing weights.
        groups: for an exchange by groups of local experts (:class:`GroupRoute`),
            the orders of :func:`group_orders`: the slot lists (``meta``,
            ``slot_row``) in the grouped send order, ``send_token`` in the
            order the rows leave (group after group), ``home_index`` in the
            order the partial sums come home. None: one order for all.
    """
    hit, dest, counts = r.hit, r.dest, r.counts
    num_tokens, world_size = hit.shape
    topk = dest.shape[1]
    experts_per_rank = counts.shape[1] - 1
    num_experts = world_size * experts_per_rank
    width = min(topk, experts_per_rank)
    device = hit.device
    idx = topk_idx.long()
    valid = dest < world_size
    capacity = num_tokens * min(topk, world_size)  # upper bound of S; row `capacity` collects misses

    if groups is None:
        row = send_positions(hit, counts[:, 0])  # [T, W]
        send_token = items_by_row(hit, row, capacity)
        home_index = rows_by_item(hit, row)
    else:
        row, leave, home = group_orders(hit, groups)
        send_token = items_by_row(hit, leave, capacity)
        home_index = rows_by_destination(hit, home)  # the partials are summed in ascending rank all the same
    safe_dest = dest.clamp(max=world_size - 1)
    slot_row = torch.where(valid, row.gather(1, safe_dest), -1)

    # Expanded position of each slot on its destination: start of (expert, this
    # rank) in the destination's canonical order + earlier tokens of this rank
    # with the same expert.
    per_source = all_counts[:, :, 1:]  # [W_src, W_dst, E_local]
    start = (_exclusive(per_source.sum(0), 1) + per_source[:rank].sum(0)).flatten()  # [E]
    # Earlier slots with the same expert: a stable sort keeps token order, so a
    # slot's rank inside its key's run is that count.
    keys = torch.where(valid, idx, num_experts).flatten()
    sorted_keys, order = torch.sort(keys, stable=True)
    mine = counts[:, 1:].flatten()  # [E] this rank's slots per expert
    run_start = torch.cat([_exclusive(mine, 0), mine.sum().view(1)])  # [E + 1]
    earlier = torch.empty_like(keys)
    earlier[order] = torch.arange(keys.numel(), device=device) - run_start[sorted_keys]
    slot_pos = start[torch.where(valid, idx, 0)] + earlier.view(num_tokens, topk)

    # Column of each slot in its row: slots of one token on one rank, by expert.
    same_rank = (dest.unsqueeze(2) == dest.unsqueeze(1)) & (idx.unsqueeze(1) < idx.unsqueeze(2))
    slot_col = torch.where(valid, same_rank.sum(2), -1)

    wire = weight_wire_dtype(topk_weights.dtype)
    words = torch.finfo(wire).bits // 32
    meta = torch.full((capacity + 1, width + 1 + width * words), -1, dtype=torch.int32, device=device)
    rows = torch.where(valid, slot_row, capacity)
    cols = slot_col.clamp(min=0)
    meta.index_put_((rows, cols), slot_pos.to(torch.int32))
    token = torch.arange(num_tokens, device=device, dtype=torch.int32).repeat_interleave(world_size)
    meta[:, width].scatter_(0, torch.where(hit, row, capacity).flatten(), token)
    weight_words = topk_weights.to(wire).flatten().contiguous().view(torch.int32).view(num_tokens, topk, words)
    word = torch.arange(words, device=device)
    weight_cols = width + 1 + cols.unsqueeze(2) * words + word
    meta.index_put_((rows.unsqueeze(2), weight_cols), weight_words)
    return SendPlan(send_token, meta, home_index, slot_row, slot_col)


@dataclass(frozen=True)
class RecvPlan:
    """How received rows expand to one row per (token, local expert).

    Received rows are held group after group (groups of local experts; one
    group: by source rank), each group's by (source rank, token); expanded
    positions are those of the whole exchange.

    Attributes:
        expand_src: [N] int64, the held row behind each expanded row.
        presum_index: [R, J] int64; row j lists the expanded rows of held row j
            in ascending local expert, padded with -1. Summing along it is the
            expert-side pre-sum of combine.
        weights: [N] routing weight of each expanded row (in the wire dtype of weights).
        src_token: [R] int64, source token of each held row.
        src_rank: [R] int64, source rank of each held row.
        expanded_token, expanded_rank: [N] int64, those of each expanded row
            (``src_token[expand_src]``, ``src_rank[expand_src]``; like
            ``expand_src``, unset past the rows the slots fill).
    """

    expand_src: torch.Tensor
    presum_index: torch.Tensor
    weights: torch.Tensor
    src_token: torch.Tensor
    src_rank: torch.Tensor
    expanded_token: torch.Tensor
    expanded_rank: torch.Tensor


RECV_TABLE = ("arrival_start", "held_start", "src_rank")


def recv_table(recv_rows: list[list[int]]) -> list[list[int]]:
    """Where the received metadata's blocks go, computed on the host.

    The metadata arrives in blocks b = (source rank s, group g), s-major (each
    source's rows group after group); it is held g-major. Returns one list per
    entry of ``RECV_TABLE``, each [W * G]: the block's first row as it arrives;
    its first row as held; s.

    Args:
        recv_rows: [G][W] rows of group g received from rank s.
    """
    groups, world = len(recv_rows), len(recv_rows[0])
    group_start = _prefix([sum(row) for row in recv_rows])
    table = [[], [], []]
    arrived = 0
    for s in range(world):
        for g in range(groups):
            for column, value in zip(table, (arrived, group_start[g] + sum(recv_rows[g][:s]), s)):
                column.append(value)
            arrived += recv_rows[g][s]
    return table


def one_group_table(recv: torch.Tensor) -> torch.Tensor:
    """:func:`recv_table` of one group on ``recv``'s device, from ``recv``: [W]
    int64 rows received from each rank (no host copy)."""
    start = torch.cumsum(recv, 0) - recv
    return torch.stack([start, start, torch.arange(recv.shape[0], device=recv.device)])


def _prefix(values: list[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        out.append(total)
        total += v
    return out


def build_recv_plan(meta: torch.Tensor, table: torch.Tensor, num_rows: int, weight_dtype: torch.dtype) -> RecvPlan:
    """Expansion of the received rows, from their slot lists; the Triton kernel
    on CUDA (``dispatch.kernels.recv_plan``), the compiled one on CPU
    (``dispatch.kernels.plan_cpu``), the reference elsewhere.

    Args:
        meta: [R, J + 1 + J * w] int32 received metadata (see :class:`SendPlan`),
            in source-rank order, each source's rows group after group.
        table: [len(RECV_TABLE), W * G] int64 :func:`recv_table`, on meta's device.
        num_rows: N, expanded rows, known on the host from the counts exchange.
        weight_dtype: dtype the weights travelled in (``weight_wire_dtype``).
    """
    if meta.is_cuda and recv_plan.triton is not None:
        return RecvPlan(*recv_plan.recv_plan_triton(meta, table, num_rows, weight_dtype))
    compiled = plan_cpu.on_cpu(meta)
    if compiled is not None:
        return RecvPlan(*compiled.recv_plan(meta, table, num_rows, torch.finfo(weight_dtype).bits // 32))
    return build_recv_plan_reference(meta, table, num_rows, weight_dtype)


def build_recv_plan_reference(
    meta: torch.Tensor, table: torch.Tensor, num_rows: int, weight_dtype: torch.dtype
) -> RecvPlan:
    """PyTorch reference of :func:`build_recv_plan` (same arguments and result)."""
    num_recv = meta.shape[0]
    words = torch.finfo(weight_dtype).bits // 32
    width = (meta.shape[1] - 1) // (1 + words)
    device = meta.device
    arrival_start, held_start, src = table
    row = torch.arange(num_recv, device=device)
    block = torch.searchsorted(arrival_start, row, right=True) - 1  # last block starting at or before the row
    held = held_start[block] + row - arrival_start[block]

    slots = meta[:, :width].long()
    at = torch.where(slots >= 0, slots, num_rows).flatten()
    expand_src = torch.empty(num_rows + 1, dtype=torch.int64, device=device)
    expand_src.scatter_(0, at, held.repeat_interleave(width))
    presum_index = torch.empty_like(slots)
    presum_index[held] = slots
    token, rank = meta[:, width].long(), src[block]  # of each row as it arrived
    src_token = torch.empty(num_recv, dtype=torch.int64, device=device)
    src_token[held] = token
    src_rank = torch.empty(num_recv, dtype=torch.int64, device=device)
    src_rank[held] = rank
    expanded_token, expanded_rank = (torch.empty(num_rows + 1, dtype=torch.int64, device=device).scatter_(
        0, at, values.repeat_interleave(width)) for values in (token, rank))
    weight_words = torch.empty(num_recv, width * words, dtype=torch.int32, device=device)
    weight_words.copy_(meta[:, width + 1 :])
    weights = torch.empty(num_rows + 1, dtype=weight_dtype, device=device)
    weights.scatter_(0, at, weight_words.view(weight_dtype).flatten())
    return RecvPlan(expand_src[:num_rows], presum_index, weights[:num_rows], src_token, src_rank,
                    expanded_token[:num_rows], expanded_rank[:num_rows])


def _pack_left(values: torch.Tensor) -> torch.Tensor:
    """Sort each row ascending and turn the ``_PAD`` entries (now last) into -1."""
    packed = torch.sort(values, dim=1).values
    return torch.where(packed == _PAD, -1, packed)
