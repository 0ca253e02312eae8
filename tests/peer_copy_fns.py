"""Rank functions of test_peer_copy.py: exchanges run on every rank of a world."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dispatch import comm
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


def exchanges(matrices, width: int, dtype: torch.dtype, in_flight: int, salt: int) -> list[bool]:
    """Run every matrix's exchange through PeerCopy, ``in_flight`` started
    before the oldest is waited for, and every other one the way back; each
    result against the collective's. Returns one bool per exchange."""
    device = current_device()
    rank = dist.get_rank()
    ours = PeerCopy(None, rank, dist.get_world_size())
    started, same = [], []
    for k, matrix in enumerate(matrices):
        if k % 2:
            matrix = transposed(matrix)
        rows = rows_for(matrix, rank, width, dtype, salt + k).to(device)
        send, recv = matrix[rank], tuple(row[rank] for row in matrix)
        started.append((ours.start(rows, send, recv, matrix), comm.all_to_all_rows(rows, send, recv, None)))
        del rows  # the transport keeps what it reads
        while len(started) > (in_flight if k + 1 < len(matrices) else 0):
            (out, work), want = started.pop(0)
            if work is not None:
                work.wait()
            same.append(out.dtype == want.dtype and torch.equal(out.cpu(), want.cpu()))
    return same
