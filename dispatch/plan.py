"""The routing plan: everything derived from ``topk_idx`` for one exchange.

Notation (used throughout the package):

    W        ranks in the EP group          E        experts in total
    E_local  experts per rank (E // W)      K        expert slots per token
    T        tokens on this rank            H        hidden size
    S        rows this rank sends           (one per (token, destination rank))
    R        rows this rank receives        (one per (source token, this rank))
    N        expanded rows on this rank     (one per (source token, local expert))
    J        min(K, E_local): most slots one token can have on one rank

Orders (the contract of DESIGN.md):

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
   moves the slot lists with the rows' metadata; ``build_recv_plan`` expands.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    """Destination ranks and per-destination counts of one rank's routing.

    Args:
        topk_idx: [T, K] int32/int64 global expert ids, ``-1`` = empty slot. Ids
            outside ``[0, E)`` and repeats within a row are treated as empty (the
            value checks reject them; with the checks off they are dropped).
        num_experts: E.
        world_size: W.
    """
    num_tokens = topk_idx.shape[0]
    experts_per_rank = num_experts // world_size
    idx = topk_idx.long()
    # Ids out of range and repeats of an earlier slot's expert are rejected by the
    # value checks; here they are empty slots, so the plan never reads memory it
    # did not write, whatever the input.
    topk = idx.shape[1]
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


# What each rank adds to the counts all-gather so that every rank can check that
# all ranks agree, and learn which gradients some rank needs.
HEADER = ("topk", "hidden", "x_dtype", "weights_dtype", "x_grad", "weights_grad")
DTYPE_CODES = {dtype: code for code, dtype in enumerate((torch.float16, torch.bfloat16, torch.float32, torch.float64))}


def header(x: torch.Tensor, topk_weights: torch.Tensor, topk: int) -> list[int]:
    """This rank's entries of ``HEADER``."""
    grad = torch.is_grad_enabled()
    return [
        topk,
        x.shape[1],
        DTYPE_CODES[x.dtype],
        DTYPE_CODES[topk_weights.dtype],
        int(grad and x.requires_grad),
        int(grad and topk_weights.requires_grad),
    ]


def exchange_row(r: Route, header_row: torch.Tensor) -> torch.Tensor:
    """[W * (1 + E_local) + len(HEADER)] int64: what this rank all-gathers."""
    return torch.cat([r.counts.flatten(), header_row])


def split_gathered(gathered: torch.Tensor, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[W, L] all-gathered rows -> (all_counts [W_src, W_dst, 1 + E_local], headers [W, len(HEADER)])."""
    counts = gathered[:, : gathered.shape[1] - len(HEADER)]
    return counts.view(world_size, world_size, -1), gathered[:, counts.shape[1] :]


def chunk_counts(r: Route, topk_idx: torch.Tensor, bounds: tuple[int, ...], num_experts: int) -> torch.Tensor:
    """Counts of C home token ranges, for one counts exchange that serves all chunks.

    Args:
        r: :class:`Route` of all T tokens.
        topk_idx: [T, K] expert ids.
        bounds: C + 1 ascending host ints from 0 to T; chunk c is tokens
            ``[bounds[c], bounds[c + 1])``.
        num_experts: E.
    Returns:
        [C, W, 1 + E_local] int64; ``[c]`` is ``route(topk_idx[chunk c]).counts``.
    """
    num_tokens, world_size = r.hit.shape
    chunks = len(bounds) - 1
    device = r.hit.device
    sizes = torch.tensor([b - a for a, b in zip(bounds[:-1], bounds[1:])], device=device)
    chunk_of = torch.repeat_interleave(torch.arange(chunks, device=device), sizes, output_size=num_tokens)
    rows = torch.zeros(chunks, world_size, dtype=torch.int64, device=device)
    rows.index_add_(0, chunk_of, r.hit.long())
    valid = r.dest < world_size
    slot = torch.where(valid, topk_idx.long(), num_experts) + (num_experts + 1) * chunk_of.unsqueeze(1)
    slots = torch.zeros(chunks * (num_experts + 1), dtype=torch.int64, device=device)
    slots.scatter_add_(0, slot.flatten(), torch.ones_like(slot.flatten()))
    per_expert = slots.view(chunks, num_experts + 1)[:, :num_experts].reshape(chunks, world_size, -1)
    return torch.cat([rows.unsqueeze(2), per_expert], dim=2)


def split_gathered_chunks(gathered: torch.Tensor, world_size: int, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[W, L] all-gathered rows of ``chunk_counts`` + header ->
    (all_counts [W_src, C, W_dst, 1 + E_local], headers [W, len(HEADER)])."""
    counts = gathered[:, : gathered.shape[1] - len(HEADER)]
    return counts.view(world_size, chunks, world_size, -1), gathered[:, counts.shape[1] :]


@dataclass(frozen=True)
class SendPlan:
    """Where each of this rank's tokens goes, and where its partial sums come back.

    Row buffers hold ``T * min(K, W)`` rows (an upper bound of S, plus one row
    that collects the writes of empty slots); the first S are real.

    Attributes:
        send_token: [T * min(K, W) + 1] int64, source token of each send row, in send order.
        meta: [T * min(K, W) + 1, J + 1 + J * w] int32 per send row: the expanded positions
            of its slots on the destination, ascending, -1 padded (J columns);
            the source token; the slot weights bit-cast to int32 (``w`` words each,
            1 for fp32 weights, 2 for fp64), in the order of the positions.
        home_index: [T, W] int64; row t lists the send rows of token t in
            ascending destination rank (so its partial sums come back in rank
            order), padded with -1.
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


def build_send_plan(
    r: Route,
    all_counts: torch.Tensor,
    rank: int,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
) -> SendPlan:
    """Send order and slot lists, from the all-gathered counts; no host synchronisation.

    Args:
        r: this rank's :class:`Route`.
        all_counts: [W, W, 1 + E_local] int64, ``all_counts[s]`` = ``route(...).counts``
            of rank s.
        rank: this rank's index in the group.
        topk_idx: [T, K] (valid) expert ids.
        topk_weights: [T, K] routing weights.
    """
    hit, dest = r.hit, r.dest
    num_tokens, world_size = hit.shape
    topk = dest.shape[1]
    experts_per_rank = all_counts.shape[2] - 1
    width = min(topk, experts_per_rank)
    device = hit.device
    idx = topk_idx.long()
    valid = dest < world_size
    capacity = num_tokens * min(topk, world_size)  # upper bound of S; row `capacity` collects misses

    # Send rows: position of (token, destination) in send order.
    send_splits = r.counts[:, 0]
    offsets = torch.cumsum(send_splits, 0) - send_splits
    # Scan along the contiguous dimension: a scan down T columns of width W is
    # W-way parallel only, and slow.
    before = torch.cumsum(hit.t().contiguous(), 1, dtype=torch.int64).t()
    position = before - 1 + offsets  # [T, W]
    row_at = torch.where(hit, position, capacity)
    send_token = torch.empty(capacity + 1, dtype=torch.int64, device=device)
    send_token.scatter_(0, row_at.flatten(), torch.arange(num_tokens, device=device).repeat_interleave(world_size))
    home_index = _pack_left(torch.where(hit, position, _PAD))
    slot_row = torch.where(valid, position.gather(1, dest.clamp(max=world_size - 1)), -1)

    # Expanded position of each slot on its destination: start of (expert, this
    # rank) in the destination's canonical order + earlier tokens of this rank
    # with the same expert.
    per_source = all_counts[:, :, 1:]  # [W_src, W_dst, E_local]
    expert_sizes = per_source.sum(0)  # [W_dst, E_local]
    expert_start = torch.cumsum(expert_sizes, 1) - expert_sizes
    start = (expert_start + per_source[:rank].sum(0)).flatten()  # [E]
    num_experts = start.numel()
    # Earlier slots of this rank with the same expert: a stable sort by expert
    # keeps token order, so a slot's rank inside its expert's run is that count.
    keys = torch.where(valid, idx, num_experts).flatten()
    sorted_keys, order = torch.sort(keys, stable=True)
    mine = r.counts[:, 1:].flatten()  # [E] this rank's slots per expert
    run_start = torch.cat([torch.cumsum(mine, 0) - mine, mine.sum().view(1)])  # [E + 1]
    earlier = torch.empty_like(keys)
    earlier[order] = torch.arange(keys.numel(), device=device) - run_start[sorted_keys]
    safe_idx = torch.where(valid, idx, 0)
    slot_pos = start[safe_idx] + earlier.view(num_tokens, topk)

    # Column of each slot in its row: slots of one token on one rank, by expert.
    same_rank = (dest.unsqueeze(2) == dest.unsqueeze(1)) & (idx.unsqueeze(1) < idx.unsqueeze(2))
    slot_col = torch.where(valid, same_rank.sum(2), -1)

    wire = weight_wire_dtype(topk_weights.dtype)
    words = torch.finfo(wire).bits // 32
    meta = torch.full((capacity + 1, width + 1 + width * words), -1, dtype=torch.int32, device=device)
    rows = torch.where(valid, slot_row, capacity)
    cols = slot_col.clamp(min=0)
    meta.index_put_((rows, cols), slot_pos.to(torch.int32))
    meta[:, width] = send_token.to(torch.int32)
    weight_words = topk_weights.to(wire).flatten().contiguous().view(torch.int32).view(num_tokens, topk, words)
    word = torch.arange(words, device=device)
    weight_cols = width + 1 + cols.unsqueeze(2) * words + word
    meta.index_put_((rows.unsqueeze(2), weight_cols), weight_words)
    return SendPlan(send_token, meta, home_index, slot_row, slot_col)


@dataclass(frozen=True)
class RecvPlan:
    """How received rows expand to one row per (token, local expert).

    Attributes:
        expand_src: [N] int64, received row behind each expanded row (canonical order).
        presum_index: [R, J] int64; row j lists the expanded rows of received row j
            in ascending local expert, padded with -1. Summing along it is the
            expert-side pre-sum of combine.
        weights: [N] routing weight of each expanded row (in the wire dtype of weights).
        src_token: [R] int64, source token of each received row.
    """

    expand_src: torch.Tensor
    presum_index: torch.Tensor
    weights: torch.Tensor
    src_token: torch.Tensor


def build_recv_plan(meta: torch.Tensor, num_rows: int, weight_dtype: torch.dtype) -> RecvPlan:
    """Expansion of the received rows, from their slot lists.

    Args:
        meta: [R, J + 1 + J * w] int32 received metadata (see :class:`SendPlan`).
        num_rows: N, known on the host from the counts exchange.
        weight_dtype: dtype the weights travelled in (``weight_wire_dtype``).
    """
    num_recv = meta.shape[0]
    words = torch.finfo(weight_dtype).bits // 32
    width = (meta.shape[1] - 1) // (1 + words)
    device = meta.device
    presum_index = meta[:, :width].long()
    valid = presum_index >= 0
    at = torch.where(valid, presum_index, num_rows).flatten()
    expand_src = torch.empty(num_rows + 1, dtype=torch.int64, device=device)
    expand_src.scatter_(0, at, torch.arange(num_recv, device=device).repeat_interleave(width))
    weight_words = torch.empty(num_recv, width * words, dtype=torch.int32, device=device)
    weight_words.copy_(meta[:, width + 1 :])
    slot_weights = weight_words.view(weight_dtype).flatten()
    weights = torch.empty(num_rows + 1, dtype=weight_dtype, device=device)
    weights.scatter_(0, at, slot_weights)
    return RecvPlan(expand_src[:num_rows], presum_index, weights[:num_rows], meta[:, width].long())


def _pack_left(values: torch.Tensor) -> torch.Tensor:
    """Sort each row ascending and turn the ``_PAD`` entries (now last) into -1."""
    packed = torch.sort(values, dim=1).values
    return torch.where(packed == _PAD, -1, packed)
