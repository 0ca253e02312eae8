"""Rank functions of test_peer_copy.py: exchanges run on every rank of a world."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dispatch.peer_copy import PeerCopy, transposed
from world import current_device


def draw_matrices(world_size: int, sizes: list[int], seed: int) -> list[tuple[tuple[int, ...], ...]]:
    """One [W][W] split matrix per exchange, entries in [0, size] (zeros
    included), the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    matrices = []
    for size in sizes:
        m = torch.randint(0, size + 1, (world_size, world_size), generator=gen)
        m[torch.rand(world_size, world_size, generator=gen) < 0.25] = 0
        matrices.append(tuple(tuple(row) for row in m.tolist()))
    return matrices


def rows_for(matrix, rank: int, width: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    """This rank's send rows, each carrying (salt, rank, destination, index) in
    its first channels, the rest noise."""
    count = sum(matrix[rank])
    rows = torch.randn(count, width, generator=torch.Generator().manual_seed(salt * 97 + rank)).to(dtype)
    dst = torch.repeat_interleave(torch.arange(len(matrix)), torch.tensor(matrix[rank]))
    if width >= 4 and count:
        rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3] = salt % 64, rank, dst.to(dtype), torch.arange(count) % 64
    return rows


def expected(matrix, rank: int, width: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    """What ``rank`` receives, by the definition of an all-to-all: the block of
    every source's send rows meant for it, in source order."""
    blocks = []
    for source, row in enumerate(matrix):
        first = sum(row[:rank])
        blocks.append(rows_for(matrix, source, width, dtype, salt)[first : first + row[rank]])
    return torch.cat(blocks)


def exchanges(matrices, width: int, dtype: torch.dtype, in_flight: int, salt: int, group_size: int = 0) -> list[bool]:
    """Run every matrix's exchange through PeerCopy, ``in_flight`` started
    before the oldest is waited for, and every other one the way back; each
    result against :func:`expected` (no other collective in between). With
    ``group_size``, in new groups of that many consecutive ranks, on fresh
    buffers. Returns one bool per exchange."""
    device = current_device()
    group, rank, world = None, dist.get_rank(), dist.get_world_size()
    if group_size:
        first = rank - rank % group_size
        members = list(range(first, min(first + group_size, world)))
        group = dist.new_group(members, use_local_synchronization=True)  # made by its members only
        rank, world = members.index(rank), len(members)
    ours = PeerCopy(group, rank, world)
    started, same = [], []
    for k, matrix in enumerate(matrices):
        matrix = tuple(tuple(row[:world]) for row in matrix[:world])
        if k % 2:
            matrix = transposed(matrix)
        rows = rows_for(matrix, rank, width, dtype, salt + k).to(device)
        send, recv = matrix[rank], tuple(row[rank] for row in matrix)
        started.append((ours.start(rows, send, recv, matrix), expected(matrix, rank, width, dtype, salt + k)))
        del rows  # the transport keeps what it reads
        while len(started) > (in_flight if k + 1 < len(matrices) else 0):
            (out, work), want = started.pop(0)
            if work is not None:
                work.wait()
            same.append(out.dtype == want.dtype and torch.equal(out.cpu(), want))
    return same
