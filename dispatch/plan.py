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

An exchange in C chunks of home tokens (``MoEExchange``) keeps these orders
inside each chunk: its send rows are chunk-major (chunk, destination, token),
and each chunk's received and expanded rows are contiguous, in the orders above.
One plan serves all chunks; C = 1 is the plain exchange.

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
   moves the slot lists with the rows' metadata (one all-to-all for all
   chunks); ``build_recv_plan`` expands, placing each received block (source
   rank, chunk) from a table made on the host (``recv_table``).
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
# all ranks agree, learn which gradients some rank needs, and learn that a rank
# failed in work it did before the all-gather (its peers then stop too).
HEADER = ("topk", "hidden", "x_dtype", "weights_dtype", "x_grad", "weights_grad", "failed")
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
        0,  # raised later in the row itself (``mark_failed``)
    ]


def mark_failed(row: torch.Tensor) -> None:
    """Raise the ``failed`` entry of a row about to be all-gathered ([... + len(HEADER)])."""
    row[row.shape[0] - len(HEADER) + HEADER.index("failed")] = 1


def exchange_row(r: Route, header_row: torch.Tensor) -> torch.Tensor:
    """[W * (1 + E_local) + len(HEADER)] int64: what this rank all-gathers."""
    return torch.cat([r.counts.flatten(), header_row])


def split_gathered(gathered: torch.Tensor, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[W, L] all-gathered rows -> (all_counts [W_src, W_dst, 1 + E_local], headers [W, len(HEADER)])."""
    counts = gathered[:, : gathered.shape[1] - len(HEADER)]
    return counts.view(world_size, world_size, -1), gathered[:, counts.shape[1] :]


def chunk_counts(r: Route, topk_idx: torch.Tensor, chunk_of: torch.Tensor, chunks: int, num_experts: int) -> torch.Tensor:
    """Counts of C home token ranges, for one counts exchange that serves all chunks.

    Args:
        r: :class:`Route` of all T tokens.
        topk_idx: [T, K] expert ids.
        chunk_of: [T] int64 chunk of each token (``token_chunks(bounds)[0]``).
        chunks: C.
        num_experts: E.
    Returns:
        [C, W, 1 + E_local] int64; ``[c]`` is ``route(topk_idx[chunk c]).counts``.
    """
    world_size = r.hit.shape[1]
    device = r.hit.device
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


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device``; on CUDA through pinned memory, so that
    the copy does not wait for the work queued on the stream."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def token_chunks(bounds: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """[2, T] int64: the chunk of each token and its index inside its chunk.

    Made on ``device`` without waiting for its stream (the bounds travel from
    pinned memory on CUDA).

    Args:
        bounds: C + 1 ascending host ints from 0 to T; chunk c is tokens
            ``[bounds[c], bounds[c + 1])``.
    """
    num_tokens = bounds[-1]
    token = torch.arange(num_tokens, device=device)
    if len(bounds) == 2:  # one chunk: every token in chunk 0, at its own index
        return torch.stack([torch.zeros_like(token), token])
    starts = to_device(torch.tensor(bounds[:-1], dtype=torch.int64), device)
    chunk_of = torch.searchsorted(starts, token, right=True) - 1  # last chunk starting at or before the token
    return torch.stack([chunk_of, token - starts[chunk_of]])


@dataclass(frozen=True)
class SendPlan:
    """Where each of this rank's tokens goes, and where its partial sums come back,
    for an exchange in C chunks of home tokens (C = 1: one exchange).

    Chunk c moves the tokens of its range with one token all-to-all of its own;
    its send rows are contiguous (send order *chunk-major*: chunk, then
    destination rank, then token), and so are its received rows and its
    expanded rows on every destination. The slot lists travel in one metadata
    all-to-all for all chunks, in plain send order (destination rank, token):
    for token ranges that is each destination's rows of chunk 0, then chunk 1, ...

    Row buffers hold ``T * min(K, W)`` rows (an upper bound of S, plus one row
    that collects the writes of empty slots); the first S are real.

    Attributes:
        send_token: [T * min(K, W) + 1] int64, in chunk-major send order, the
            token of each send row as an index inside its chunk.
        meta: [T * min(K, W) + 1, J + 1 + J * w] int32 per send row in plain send
            order: the expanded positions of its slots on the destination
            (inside the row's chunk), ascending, -1 padded (J columns); the
            source token (index inside its chunk); the slot weights bit-cast to int32
            (``w`` words each, 1 for fp32 weights, 2 for fp64), in the order of
            the positions.
        home_index: [T, W] int64; row t lists the send rows of token t (inside
            its chunk's send rows) in ascending destination rank, so that its
            partial sums come back in rank order, padded with -1.
        slot_row: [T, K] int64, the send row (inside its chunk) that carries slot k (-1 if empty).
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


def send_rows(hit: torch.Tensor, counts: torch.Tensor, chunks_of_tokens: torch.Tensor, topk: int):
    """The send rows of each (token, destination), from this rank's counts alone.

    Args:
        hit: [T, W] bool, ``Route.hit``.
        counts: [C, W, 1 + E_local] int64, this rank's counts of each chunk.
        chunks_of_tokens: [2, T] int64 from :func:`token_chunks`.
        topk: K.
    Returns:
        before: [T, W] int64, tokens up to t (included) with a row to each destination.
        local: [T, W] int64, the row of (t, destination) inside its chunk's send rows
            (meaningful where ``hit``).
        row: [T, W] int64, the same among all chunks' send rows (chunk-major).
        send_token: ``SendPlan.send_token``.
    """
    num_tokens, world_size = hit.shape
    capacity = num_tokens * min(topk, world_size)  # upper bound of S; row `capacity` collects misses
    chunk_of, chunk_token = chunks_of_tokens[0], chunks_of_tokens[1]
    # Rows of (token, destination): `before` earlier-or-equal tokens with the same
    # destination. Scan along the contiguous dimension: a scan down T columns of
    # width W is W-way parallel only, and slow.
    before = torch.cumsum(hit.t().contiguous(), 1, dtype=torch.int64).t()  # [T, W]
    rows_to = counts[:, :, 0]  # [C, W]
    earlier_chunks = _exclusive(rows_to, 0)[chunk_of]  # [T, W] rows of earlier chunks per destination
    local = before - 1 - earlier_chunks + _exclusive(rows_to, 1)[chunk_of]  # row inside the chunk
    row = local + _exclusive(rows_to.sum(1), 0)[chunk_of].unsqueeze(1)  # after the rows of earlier chunks
    in_chunk = chunk_token.repeat_interleave(world_size)  # [T * W] token of each (token, rank) pair
    send_token = torch.empty(capacity + 1, dtype=torch.int64, device=hit.device)
    send_token.scatter_(0, torch.where(hit, row, capacity).flatten(), in_chunk)
    return before, local, row, send_token


@dataclass(frozen=True)
class OwnKeys:
    """The rows this rank routes to its own experts ("own rows"), before the host
    knows how many there are: fixed shapes, made with the route (an exchange in
    C chunks of home tokens, C = 1 included).

    Attributes:
        send_token: ``SendPlan.send_token`` of the exchange (its first S are real).
        row_key: [T * K] int64 ascending: ``local expert * T + token`` of each own
            slot, then ``E_local * T`` for every other slot. Its first N_own
            entries are the own rows of all chunks in the canonical order of
            one exchange (local expert, then token).
        send_row: [T] int64, the send row (among all chunks' S, chunk-major) of
            each token to this rank (meaningful for tokens with an own slot).
    """

    send_token: torch.Tensor
    row_key: torch.Tensor
    send_row: torch.Tensor


def own_keys(r: Route, topk_idx: torch.Tensor, counts: torch.Tensor, chunks_of_tokens: torch.Tensor,
             rank: int) -> OwnKeys:
    """:class:`OwnKeys` of this rank's routing ``r``; ``counts`` [C, W, 1 + E_local]
    this rank's counts of each chunk (``r.counts[None]`` for one), and
    ``chunks_of_tokens`` from :func:`token_chunks`."""
    num_tokens, topk = topk_idx.shape
    experts_per_rank = counts.shape[2] - 1
    _, _, row, send_token = send_rows(r.hit, counts, chunks_of_tokens, topk)
    token = torch.arange(num_tokens, device=topk_idx.device).unsqueeze(1)
    last = experts_per_rank * num_tokens
    key = torch.where(r.dest == rank, topk_idx.long() % experts_per_rank * num_tokens + token, last)
    return OwnKeys(send_token, torch.sort(key.flatten()).values, row[:, rank])


def build_send_plan(
    r: Route,
    counts: torch.Tensor,
    all_counts: torch.Tensor,
    rank: int,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    chunks_of_tokens: torch.Tensor,
) -> SendPlan:
    """Send order and slot lists, from the all-gathered counts; no host synchronisation.

    Args:
        r: this rank's :class:`Route`.
        counts: [C, W, 1 + E_local] int64, this rank's counts of each chunk
            (``chunk_counts``; ``r.counts[None]`` for one chunk).
        all_counts: [W_src, C, W_dst, 1 + E_local] int64, ``all_counts[s]`` =
            ``counts`` of rank s.
        rank: this rank's index in the group.
        topk_idx: [T, K] (valid) expert ids.
        topk_weights: [T, K] routing weights.
        chunks_of_tokens: [2, T] int64 from :func:`token_chunks`.
    """
    hit, dest = r.hit, r.dest
    num_tokens, world_size = hit.shape
    topk = dest.shape[1]
    num_chunks, experts_per_rank = counts.shape[0], counts.shape[2] - 1
    num_experts = world_size * experts_per_rank
    width = min(topk, experts_per_rank)
    device = hit.device
    idx = topk_idx.long()
    valid = dest < world_size
    capacity = num_tokens * min(topk, world_size)  # upper bound of S; row `capacity` collects misses
    chunk_of, chunk_token = chunks_of_tokens[0], chunks_of_tokens[1]

    before, local, _, send_token = send_rows(hit, counts, chunks_of_tokens, topk)
    plain = before - 1 + _exclusive(counts[:, :, 0].sum(0), 0)  # plain send order (metadata)
    in_chunk = chunk_token.repeat_interleave(world_size)  # [T * W] token of each (token, rank) pair
    home_index = _pack_left(torch.where(hit, local, _PAD))
    safe_dest = dest.clamp(max=world_size - 1)
    slot_row = torch.where(valid, local.gather(1, safe_dest), -1)

    # Expanded position of each slot on its destination, inside its chunk: start
    # of (expert, this rank) in the destination's canonical order of the chunk +
    # earlier tokens of this rank and chunk with the same expert.
    per_source = all_counts[:, :, :, 1:]  # [W_src, C, W_dst, E_local]
    start = (_exclusive(per_source.sum(0), 2) + per_source[:rank].sum(0)).flatten()  # [C * E]
    # Earlier slots with the same (chunk, expert): a stable sort keeps token order,
    # so a slot's rank inside its key's run is that count.
    key = idx + num_experts * chunk_of.unsqueeze(1)
    keys = torch.where(valid, key, num_chunks * num_experts).flatten()
    sorted_keys, order = torch.sort(keys, stable=True)
    mine = counts[:, :, 1:].flatten()  # [C * E] this rank's slots per (chunk, expert)
    run_start = torch.cat([_exclusive(mine, 0), mine.sum().view(1)])  # [C * E + 1]
    earlier = torch.empty_like(keys)
    earlier[order] = torch.arange(keys.numel(), device=device) - run_start[sorted_keys]
    slot_pos = start[torch.where(valid, key, 0)] + earlier.view(num_tokens, topk)

    # Column of each slot in its row: slots of one token on one rank, by expert.
    same_rank = (dest.unsqueeze(2) == dest.unsqueeze(1)) & (idx.unsqueeze(1) < idx.unsqueeze(2))
    slot_col = torch.where(valid, same_rank.sum(2), -1)

    wire = weight_wire_dtype(topk_weights.dtype)
    words = torch.finfo(wire).bits // 32
    meta = torch.full((capacity + 1, width + 1 + width * words), -1, dtype=torch.int32, device=device)
    rows = torch.where(valid, plain.gather(1, safe_dest), capacity)
    cols = slot_col.clamp(min=0)
    meta.index_put_((rows, cols), slot_pos.to(torch.int32))
    meta[:, width].scatter_(0, torch.where(hit, plain, capacity).flatten(), in_chunk.to(torch.int32))
    weight_words = topk_weights.to(wire).flatten().contiguous().view(torch.int32).view(num_tokens, topk, words)
    word = torch.arange(words, device=device)
    weight_cols = width + 1 + cols.unsqueeze(2) * words + word
    meta.index_put_((rows.unsqueeze(2), weight_cols), weight_words)
    return SendPlan(send_token, meta, home_index, slot_row, slot_col)


@dataclass(frozen=True)
class RecvPlan:
    """How received rows expand to one row per (token, local expert), all chunks.

    Received rows and expanded rows are held chunk after chunk (chunk c's
    ``[R_c]`` and ``[N_c]`` are contiguous); indices point inside their chunk.

    Attributes:
        expand_src: [N] int64, received row (inside its chunk) behind each expanded
            row (canonical order inside each chunk).
        expand_all: [N] int64, the same row among all chunks' received rows.
        presum_index: [R, J] int64; row j lists the expanded rows (inside its chunk)
            of received row j in ascending local expert, padded with -1. Summing
            along it is the expert-side pre-sum of combine.
        weights: [N] routing weight of each expanded row (in the wire dtype of weights).
        src_token: [R] int64, source token of each received row.
        src_rank: [R] int64, source rank of each received row.
    """

    expand_src: torch.Tensor
    expand_all: torch.Tensor
    presum_index: torch.Tensor
    weights: torch.Tensor
    src_token: torch.Tensor
    src_rank: torch.Tensor


RECV_TABLE = ("arrival_start", "held_start", "local_start", "expanded_start", "src_rank")


def recv_table(recv_rows: list[list[int]], rows_per_chunk: list[int]) -> list[list[int]]:
    """Where the received metadata's blocks go, computed on the host.

    The metadata arrives in blocks b = (source rank s, chunk c), s-major. Returns
    one list per entry of ``RECV_TABLE``, each [W * C]: the block's first row as
    it arrives; its first row among all chunks' received rows (chunk after
    chunk); the same inside its chunk; the first expanded row of its chunk; s.

    Args:
        recv_rows: [C][W] rows of chunk c received from rank s.
        rows_per_chunk: [C] expanded rows of each chunk.
    """
    chunks, world = len(recv_rows), len(recv_rows[0])
    recv_start = _prefix([sum(row) for row in recv_rows])
    expanded_start = _prefix(rows_per_chunk)
    table = [[], [], [], [], []]
    arrived = 0
    for s in range(world):
        for c in range(chunks):
            local = sum(recv_rows[c][:s])
            for column, value in zip(table, (arrived, recv_start[c] + local, local, expanded_start[c], s)):
                column.append(value)
            arrived += recv_rows[c][s]
    return table


def _prefix(values: list[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        out.append(total)
        total += v
    return out


def build_recv_plan(meta: torch.Tensor, table: torch.Tensor, num_rows: int, weight_dtype: torch.dtype) -> RecvPlan:
    """Expansion of the received rows, from their slot lists; the Triton kernel
    on CUDA (``dispatch.kernels.recv_plan``), the reference elsewhere.

    Args:
        meta: [R, J + 1 + J * w] int32 received metadata (see :class:`SendPlan`),
            in source-rank order, each source's rows chunk after chunk.
        table: [len(RECV_TABLE), W * C] int64 :func:`recv_table`, on meta's device.
        num_rows: N, expanded rows of all chunks, known on the host from the counts exchange.
        weight_dtype: dtype the weights travelled in (``weight_wire_dtype``).
    """
    from dispatch.kernels import recv_plan

    if meta.is_cuda and recv_plan.triton is not None:
        return RecvPlan(*recv_plan.recv_plan_triton(meta, table, num_rows, weight_dtype))
    return build_recv_plan_reference(meta, table, num_rows, weight_dtype)


def build_recv_plan_reference(
    meta: torch.Tensor, table: torch.Tensor, num_rows: int, weight_dtype: torch.dtype
) -> RecvPlan:
    """PyTorch reference of :func:`build_recv_plan` (same arguments and result)."""
    num_recv = meta.shape[0]
    words = torch.finfo(weight_dtype).bits // 32
    width = (meta.shape[1] - 1) // (1 + words)
    device = meta.device
    arrival_start, held_start, local_start, expanded_start, src = table
    row = torch.arange(num_recv, device=device)
    block = torch.searchsorted(arrival_start, row, right=True) - 1  # last block starting at or before the row
    offset = row - arrival_start[block]
    held, local = held_start[block] + offset, local_start[block] + offset

    slots = meta[:, :width].long()
    at = torch.where(slots >= 0, slots + expanded_start[block].unsqueeze(1), num_rows).flatten()
    expand_src = torch.empty(num_rows + 1, dtype=torch.int64, device=device)
    expand_src.scatter_(0, at, local.repeat_interleave(width))
    expand_all = torch.empty(num_rows + 1, dtype=torch.int64, device=device)
    expand_all.scatter_(0, at, held.repeat_interleave(width))
    presum_index = torch.empty_like(slots)
    presum_index[held] = slots
    src_token = torch.empty(num_recv, dtype=torch.int64, device=device)
    src_token[held] = meta[:, width].long()
    src_rank = torch.empty(num_recv, dtype=torch.int64, device=device)
    src_rank[held] = src[block]
    weight_words = torch.empty(num_recv, width * words, dtype=torch.int32, device=device)
    weight_words.copy_(meta[:, width + 1 :])
    weights = torch.empty(num_rows + 1, dtype=weight_dtype, device=device)
    weights.scatter_(0, at, weight_words.view(weight_dtype).flatten())
    return RecvPlan(expand_src[:num_rows], expand_all[:num_rows], presum_index, weights[:num_rows], src_token, src_rank)


def _pack_left(values: torch.Tensor) -> torch.Tensor:
    """Sort each row ascending and turn the ``_PAD`` entries (now last) into -1."""
    packed = torch.sort(values, dim=1).values
    return torch.where(packed == _PAD, -1, packed)
