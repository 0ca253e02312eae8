"""The NVSHMEM transport's plan of a dispatch with ``max_rows`` (nothing read on
the host), in one kernel on each side of its slot lists' exchange where its
torch operations are some sixty small kernels:

1. :func:`settle`, from the plan's summary (``plan_graph.plan_summary``, every
   rank's counts and header, the same on every rank): whether the dispatch
   fails (``checks.peers_fail``), recorded in place (the first failed
   dispatch's summary kept, the flag raised); the rows this rank sends to and
   receives from each rank, where its rows start at each rank to the experts
   and back home, the rows per local expert (zeros where it fails); the
   receive table of one group (``plan.one_group_table``).
2. :func:`pad`, from the receive plan: the expanded rows past the N real ones
   as padding (the zero row ``recv_rows``, weight 0, sources -1), and the send
   rows past the S sent as token 0.

Each is held bitwise against its torch reference (:func:`settle_reference`,
:func:`pad_reference`), which runs off CUDA.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dispatch import checks, plan
from dispatch.plan_graph import Summary

try:  # Triton is optional: CPU-only installs run the references.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

_BLOCK, _PAD_BLOCK = 1024, 512  # the summary's entries a step of the record; rows a program of pad


class Settled(NamedTuple):
    """What :func:`settle` makes: ``failed`` a 0-dim bool; the rest int64, the
    counts and starts zeros where it fails (and the table's from them)."""

    failed: torch.Tensor
    sends: torch.Tensor  # [W]
    receives: torch.Tensor  # [W]
    put_at: torch.Tensor  # [W] this rank's first row at each rank, to the experts
    back_at: torch.Tensor  # [W] each rank's first row here, back home
    per_expert: torch.Tensor  # [E_local]
    table: torch.Tensor  # [len(plan.RECV_TABLE), W] of ``receives``


def settle(summary: torch.Tensor, world: int, local: int, rank: int, seen: torch.Tensor,
           failure: torch.Tensor) -> Settled:
    """The settled plan of a dispatch from its ``summary`` (on the device);
    where it fails and ``seen`` (0-dim bool) is not raised yet, ``failure``
    takes ``summary``, then ``seen`` is raised (both in place)."""
    if not (summary.is_cuda and triton is not None):
        return settle_reference(summary, world, local, rank, seen, failure)
    return settle_triton(summary, world, local, rank, seen, failure)


def settle_reference(summary, world, local, rank, seen, failure) -> Settled:
    """:func:`settle` in torch operations."""
    parts = Summary.read(summary, world, local)
    failed = checks.peers_fail(parts.headers, parts.received, parts.groups, parts.fullest)
    failure.copy_(torch.where(failed & ~seen, summary, failure))
    seen.logical_or_(failed)
    put_at, back_at = starts(parts.matrix, rank)
    sends, receives, put_at, back_at, per_expert = (torch.where(failed, 0, t) for t in (
        parts.send, parts.recv, put_at, back_at, parts.per_expert))
    return Settled(failed, sends, receives, put_at, back_at, per_expert, plan.one_group_table(receives))


def starts(matrix: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(put_at, back_at) of ``rank`` from a dispatch's [source, destination]
    rows ``matrix`` (on its device): where its rows start at each rank (after
    the rows of the sources before it), and where each rank's rows start here
    on their way home (after that rank's rows to the ranks before this one)."""
    return (torch.cumsum(matrix, 0) - matrix)[rank], (torch.cumsum(matrix, 1) - matrix)[:, rank].contiguous()


def settle_triton(summary, world, local, rank, seen, failure) -> Settled:
    """:func:`settle` in one Triton kernel (one program; W and E_local wide
    vectors, no [W, W] tile, so that any group compiles)."""
    if triton is None:
        raise RuntimeError("settle_triton needs triton; install the 'test' extra or use the reference")
    device = summary.device
    sizes = Summary.sizes(world, local)
    starts_at = [sum(sizes[:i]) for i in range(len(sizes))]
    # one allocation: the table [3, W] first, then sends, receives, put_at, back_at and per_expert, each
    # starting 16-byte aligned, as separate allocations would (Triton specialises on it)
    first, step = _even(3 * world), _even(world)
    out = torch.empty(first + 4 * step + local, dtype=torch.int64, device=device)
    failed = torch.empty((), dtype=torch.bool, device=device)
    _settle_kernel[(1,)](
        summary, seen.view(torch.uint8), failure, failed.view(torch.uint8), out, world, local, rank,
        summary.numel(), starts_at[3], starts_at[4], starts_at[5], starts_at[7], starts_at[8], first, step,
        HEADER=len(plan.HEADER), AGREED=checks.AGREED, FAILED=plan.HEADER.index("failed"),
        MAX_ROWS=plan.HEADER.index("max_rows"), MEMORY_ROWS=plan.HEADER.index("memory_rows"),
        BLOCK_W=triton.next_power_of_2(world), BLOCK_H=triton.next_power_of_2(len(plan.HEADER)),
        BLOCK_L=triton.next_power_of_2(local), BLOCK=_BLOCK,
    )
    sends, receives, put_at, back_at = (out[first + i * step : first + i * step + world] for i in range(4))
    per_expert = out[first + 4 * step :]
    return Settled(failed, sends, receives, put_at, back_at, per_expert, out[: 3 * world].view(3, world))


def _even(n: int) -> int:
    return n + (n & 1)


class Padded(NamedTuple):
    """What :func:`pad` makes, by the name the plan gives it."""

    expand_src: torch.Tensor
    weights: torch.Tensor
    src_rank: torch.Tensor
    src_token: torch.Tensor
    send_token: torch.Tensor


def pad(expand_src: torch.Tensor, weights: torch.Tensor, src_rank: torch.Tensor, src_token: torch.Tensor,
        per_expert: torch.Tensor, send_token: torch.Tensor, sends: torch.Tensor, recv_rows: int) -> Padded:
    """The bounded plan's rows with their padding: of the N expanded rows
    (``expand_src`` [N], ``weights`` [N]; ``src_rank``, ``src_token`` [R] of the
    received rows), those past ``per_expert.sum()`` take the zero row
    ``recv_rows``, weight 0 and sources -1, the others their received row's
    sources; of the send rows (``send_token``), those past ``sends.sum()`` token 0
    (they are read, not sent). New tensors."""
    if not (expand_src.is_cuda and triton is not None):
        return pad_reference(expand_src, weights, src_rank, src_token, per_expert, send_token, sends, recv_rows)
    return pad_triton(expand_src, weights, src_rank, src_token, per_expert, send_token, sends, recv_rows)


def pad_reference(expand_src, weights, src_rank, src_token, per_expert, send_token, sends, recv_rows) -> Padded:
    """:func:`pad` in torch operations."""
    num_rows, device = expand_src.shape[0], expand_src.device
    real = torch.arange(num_rows, device=device) < per_expert.sum()
    index = torch.where(real, expand_src, src_rank.shape[0])
    src_rank, src_token = (torch.cat([src, src.new_full((1,), -1)])[index] for src in (src_rank, src_token))
    sent = torch.arange(send_token.shape[0], device=device) < sends.sum()
    return Padded(torch.where(real, expand_src, recv_rows), torch.where(real, weights, 0), src_rank, src_token,
                  torch.where(sent, send_token, 0))


def pad_triton(expand_src, weights, src_rank, src_token, per_expert, send_token, sends, recv_rows) -> Padded:
    """:func:`pad` in one Triton kernel."""
    if triton is None:
        raise RuntimeError("pad_triton needs triton; install the 'test' extra or use the reference")
    num_rows, sent_rows, device = expand_src.shape[0], send_token.shape[0], expand_src.device
    step = _even(num_rows)  # one allocation, each part 16-byte aligned
    out = torch.empty(3 * step + sent_rows, dtype=torch.int64, device=device)
    padded_src, padded_rank, padded_token = (out[i * step : i * step + num_rows] for i in range(3))
    padded_send = out[3 * step :]
    padded_weights = torch.empty_like(weights)
    rows = max(num_rows, sent_rows)
    if rows:
        _pad_kernel[(triton.cdiv(rows, _PAD_BLOCK),)](
            expand_src, weights, src_rank, src_token, per_expert, send_token, sends, padded_src, padded_weights,
            padded_rank, padded_token, padded_send, num_rows, sent_rows, per_expert.numel(), sends.numel(),
            recv_rows, BLOCK=_PAD_BLOCK, BLOCK_L=triton.next_power_of_2(max(per_expert.numel(), 1)),
            BLOCK_W=triton.next_power_of_2(sends.numel()),
        )
    return Padded(padded_src, padded_weights, padded_rank, padded_token, padded_send)


def place_by_groups(padded: Padded, presum_index: torch.Tensor, per_expert: torch.Tensor, groups: int,
                    bound: int, recv_rows: int) -> tuple[Padded, torch.Tensor]:
    """A padded plan (:func:`pad`, N real rows of G B, in the canonical order)
    placed by G ``groups`` of local experts (``plan.expert_groups``), as a
    dispatch by groups with ``max_rows`` hands them out: group g's rows at
    [g B, g B + its rows), padding after (the
    zero row ``recv_rows``, weight 0, sources -1); ``presum_index`` [R, J] the
    same places. Every group within B (else the plan failed: N = 0). Torch
    operations on the device, nothing read on the host (a CUDA graph may hold it)."""
    num_rows, device, local = padded.expand_src.shape[0], padded.expand_src.device, per_expert.shape[0]
    # [G] each group's rows in the canonical order, by the groups' rule on the device (no host index)
    group_of = ((torch.arange(local, device=device) + 1) * groups - 1) // local
    sizes = torch.zeros(groups, dtype=per_expert.dtype, device=device).index_add_(0, group_of, per_expert)
    group_end = torch.cumsum(sizes, 0)
    group_start = group_end - sizes
    position = torch.arange(num_rows, device=device)
    group = torch.searchsorted(group_end, position, right=True)
    real = group < groups
    group = group.clamp(max=groups - 1)
    to = torch.where(real, position - group_start[group] + group * bound, num_rows)  # past the rows: dropped

    def placed(values: torch.Tensor, fill) -> torch.Tensor:
        out = torch.full((num_rows + 1,), fill, dtype=values.dtype, device=device)
        return out.scatter_(0, to, values)[:num_rows]

    moved = Padded(placed(padded.expand_src, recv_rows), placed(padded.weights, 0), placed(padded.src_rank, -1),
                   placed(padded.src_token, -1), padded.send_token)
    to = torch.cat([to, to.new_full((1,), -1)])  # (a place -1 stays -1, whatever the rows: none at max_rows 0)
    return moved, to[torch.where(presum_index >= 0, presum_index, num_rows)]


if triton is not None:

    @triton.jit
    def _settle_kernel(summary_ptr, seen_ptr, failure_ptr, failed_ptr, out_ptr, world, local, rank, width,
                       headers_at, matrix_at, received_at, groups_at, fullest_at, first, step, HEADER: tl.constexpr,
                       AGREED: tl.constexpr, FAILED: tl.constexpr, MAX_ROWS: tl.constexpr, MEMORY_ROWS: tl.constexpr,
                       BLOCK_W: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK: tl.constexpr):
        # out: the table [3, W] at 0; sends, receives, put_at, back_at [W] each from first, step apart;
        # per_expert [E_local] after them
        r = tl.arange(0, BLOCK_W)
        live = r < world
        # checks.peers_fail: the agreed columns differ from rank 0's, a rank failed, a rank over its
        # bound (by groups, its fullest group over B) or its memory, the ranks' G differ
        c = tl.arange(0, BLOCK_H)
        cell = live[:, None] & (c < AGREED)[None, :]
        headers = tl.load(summary_ptr + headers_at + r[:, None] * HEADER + c[None, :], mask=cell, other=0)
        rank0 = tl.load(summary_ptr + headers_at + c, mask=c < AGREED, other=0)
        bad = tl.sum(tl.sum(((headers != rank0[None, :]) & cell).to(tl.int32), axis=1), axis=0)
        row = summary_ptr + headers_at + r * HEADER
        flags = tl.load(row + FAILED, mask=live, other=0)
        bound = tl.load(row + MAX_ROWS, mask=live, other=-1)
        memory = tl.load(row + MEMORY_ROWS, mask=live, other=-1)
        rows_of = tl.load(summary_ptr + received_at + r, mask=live, other=0)
        groups = tl.load(summary_ptr + groups_at + r, mask=live, other=0)
        fullest = tl.load(summary_ptr + fullest_at + r, mask=live, other=0)
        split = tl.maximum(groups, 1)
        per_group = (bound + split - 1) // split
        by_groups = groups > 1
        over = (bound >= 0) & tl.where(by_groups, fullest > per_group, rows_of > bound)
        outputs = tl.where(by_groups & (bound >= 0), split * per_group, bound)
        short = (memory >= 0) & (memory < tl.maximum(rows_of, outputs))
        odd = live & ((flags != 0) | over | short | (groups != tl.load(summary_ptr + groups_at)))
        failed = (bad + tl.sum(odd.to(tl.int32), axis=0)) > 0
        # the record: the first failed dispatch's summary, then the flag
        seen = tl.load(seen_ptr) != 0
        take = failed & (~seen)
        for at in range(0, width, BLOCK):
            i = at + tl.arange(0, BLOCK)
            inside = i < width
            kept = tl.load(failure_ptr + i, mask=inside, other=0)
            tl.store(failure_ptr + i, tl.where(take, tl.load(summary_ptr + i, mask=inside, other=0), kept),
                     mask=inside)
        tl.store(seen_ptr, (seen | failed).to(tl.uint8))
        tl.store(failed_ptr, failed.to(tl.uint8))
        # the W-vectors: matrix [source, destination]; this rank's rows start at d after the rows
        # of the sources before it, and each source's rows here after its rows to the ranks before this
        sends = tl.where(failed, 0, tl.load(summary_ptr + r, mask=live, other=0))
        receives = tl.where(failed, 0, tl.load(summary_ptr + world + r, mask=live, other=0))
        put_at = tl.zeros([BLOCK_W], dtype=tl.int64)
        back_at = tl.zeros([BLOCK_W], dtype=tl.int64)
        for k in range(0, rank):
            put_at += tl.load(summary_ptr + matrix_at + k * world + r, mask=live, other=0)
            back_at += tl.load(summary_ptr + matrix_at + r * world + k, mask=live, other=0)
        start = tl.cumsum(receives, axis=0) - receives  # exclusive prefix
        tl.store(out_ptr + r, start, mask=live)
        tl.store(out_ptr + world + r, start, mask=live)
        tl.store(out_ptr + 2 * world + r, r.to(tl.int64), mask=live)
        tl.store(out_ptr + first + r, sends, mask=live)
        tl.store(out_ptr + first + step + r, receives, mask=live)
        tl.store(out_ptr + first + 2 * step + r, tl.where(failed, 0, put_at), mask=live)
        tl.store(out_ptr + first + 3 * step + r, tl.where(failed, 0, back_at), mask=live)
        e = tl.arange(0, BLOCK_L)
        per_expert = tl.load(summary_ptr + 2 * world + e, mask=e < local, other=0)
        tl.store(out_ptr + first + 4 * step + e, tl.where(failed, 0, per_expert), mask=e < local)

    @triton.jit
    def _pad_kernel(expand_ptr, weights_ptr, src_rank_ptr, src_token_ptr, per_expert_ptr, send_token_ptr, sends_ptr,
                    expand_out, weights_out, rank_out, token_out, send_token_out, num_rows, sent_rows, local, world,
                    recv_rows, BLOCK: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_W: tl.constexpr):
        e = tl.arange(0, BLOCK_L)
        real_rows = tl.sum(tl.load(per_expert_ptr + e, mask=e < local, other=0), axis=0)
        w = tl.arange(0, BLOCK_W)
        sent = tl.sum(tl.load(sends_ptr + w, mask=w < world, other=0), axis=0)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        rows = i < num_rows
        real = rows & (i < real_rows)
        held = tl.load(expand_ptr + i, mask=rows, other=0)
        tl.store(expand_out + i, tl.where(real, held, recv_rows), mask=rows)
        weight = tl.load(weights_ptr + i, mask=rows, other=0)
        tl.store(weights_out + i, tl.where(real, weight, tl.zeros_like(weight)), mask=rows)
        tl.store(rank_out + i, tl.load(src_rank_ptr + held, mask=real, other=-1), mask=rows)
        tl.store(token_out + i, tl.load(src_token_ptr + held, mask=real, other=-1), mask=rows)
        sends = i < sent_rows
        token = tl.load(send_token_ptr + i, mask=sends, other=0)
        tl.store(send_token_out + i, tl.where(i < sent, token, 0), mask=sends)
