"""Transports: how the rows of one variable-split all-to-all move.

Notation: W ranks; ``matrix[s][d]`` rows go from rank s to rank d in one
exchange; a rank's send rows are in destination order, its received rows in
source order (what ``torch.distributed.all_to_all_single`` does).

* :class:`Collective`: ``all_to_all_single`` of the process group (NCCL on
  GPUs, gloo on CPU). NCCL moves the bytes with SM kernels, and over NVLink
  those kernels and the experts' GEMMs slow each other down when they overlap
  (``bench/results/README.md``: an all-to-all of 0.43 ms alone took 2.06 ms
  beside a GEMM, and the GEMM 2.59 ms instead of 1.50).
* :class:`PeerCopy`: every rank stages its send rows in a buffer its peers can
  read, and pulls its own blocks out of its peers' buffers with plain copies.
  On CUDA the buffer is ``torch.distributed._symmetric_memory`` and a copy is a
  ``cudaMemcpyAsync`` from peer memory, which the copy engines carry without
  taking an SM; on CPU it is a shared-memory file per rank (so gloo worlds run
  the same code; ``dispatch.peer_memory`` holds both). Every rank of the group
  must be on one host.

One peer-copy exchange, on the transport's own stream, in call order on every
rank (like a collective):

1. copy the rows for the peers into half ``k % 2`` of this rank's buffer;
2. barrier: every rank has staged;
3. for each source s (this rank's own block comes from ``rows`` directly):
   copy ``matrix[s][me]`` rows at row ``sum(matrix[s][:me])`` of s's half
   into row ``sum(matrix[:s][me])`` of the output.

A rank writes half ``k % 2`` again at exchange ``k + 2``, after barrier
``k + 1``, which its peers pass only after their pulls of exchange ``k``: two
halves need one barrier per exchange. The buffer grows (a collective) when an
exchange needs more than it holds; every rank knows the whole matrix, so every
rank grows at the same exchange.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dispatch import comm
from dispatch.peer_memory import buffers_of


@dataclass(frozen=True)
class Block:
    """One received block: ``rows`` rows of rank ``source``, at row ``src_row``
    of its send rows, land at row ``dst_row`` of the output."""

    source: int
    src_row: int
    dst_row: int
    rows: int


def pull_blocks(matrix: tuple[tuple[int, ...], ...], rank: int) -> tuple[Block, ...]:
    """The blocks ``rank`` receives, the nearest following source first (every
    rank starts with a different source, so no buffer serves everyone at once);
    empty blocks left out."""
    world = len(matrix)
    blocks = []
    for step in range(1, world + 1):
        source = (rank + step) % world
        rows = matrix[source][rank]
        if rows:
            src_row = sum(matrix[source][:rank])
            dst_row = sum(matrix[q][rank] for q in range(source))
            blocks.append(Block(source, src_row, dst_row, rows))
    return tuple(blocks)


def transposed(matrix: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """The matrix of the way back (rows return where they came from)."""
    return tuple(zip(*matrix))


class Collective:
    """All-to-all by the process group's own collective."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, world_size: int) -> None:
        self.group = group

    def start(self, rows, send_splits, recv_splits, matrix):
        """``comm.all_to_all_rows_start``; ``matrix`` is not needed."""
        return comm.all_to_all_rows_start(rows, send_splits, recv_splits, self.group)


class PeerCopy:
    """All-to-all by copies out of peers' memory (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, world_size: int) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size

    def start(self, rows, send_splits, recv_splits, matrix):
        """Start one exchange.

        Args:
            rows: [S, ...] send rows in destination order, any dtype.
            send_splits, recv_splits: this rank's row of ``matrix`` and its column.
            matrix: [W][W] host row counts of every rank to every rank.
        Returns:
            (out, work): [sum(recv_splits), ...] rows in source order, and an
            object whose ``wait()`` makes the current stream wait for them (None
            on CPU, where they are there on return). A group of one returns
            ``(rows, None)``.
        """
        if self.world_size == 1:
            return rows, None
        if len(matrix) != self.world_size or tuple(matrix[self.rank]) != tuple(send_splits) or tuple(
            row[self.rank] for row in matrix
        ) != tuple(recv_splits) or rows.shape[0] != sum(send_splits):
            # the plan makes all three from the same counts: this is a bug, not an input error
            raise RuntimeError("peer copy: the split matrix does not match the rows and splits of this rank")
        tail = rows.shape[1:]
        row_bytes = math.prod(tail) * rows.element_size()
        as_bytes = rows.contiguous().view(rows.shape[0], math.prod(tail)).view(torch.uint8)
        need = max(sum(row) for row in matrix) * row_bytes
        peers = buffers_of(self.group, rows.device)
        out = torch.empty(sum(recv_splits), row_bytes, dtype=torch.uint8, device=rows.device)
        with peers.ordered(as_bytes, out) as done:
            halves = peers.halves(need)  # [W] of [2, capacity] uint8
            half = peers.next_half()
            own = halves[self.rank][half]
            first = sum(send_splits[: self.rank])
            last = first + send_splits[self.rank]
            for a, b in ((0, first), (last, rows.shape[0])):  # the rows for the peers
                if b > a:
                    own[a * row_bytes : b * row_bytes].view(b - a, row_bytes).copy_(as_bytes[a:b])
            peers.barrier()
            for block in pull_blocks(matrix, self.rank):
                if block.source == self.rank:
                    src = as_bytes[block.src_row : block.src_row + block.rows]
                else:
                    start = block.src_row * row_bytes
                    src = halves[block.source][half][start : start + block.rows * row_bytes].view(-1, row_bytes)
                out[block.dst_row : block.dst_row + block.rows].copy_(src)
        return out.view(rows.dtype).view(out.shape[0], *tail), done.work


TRANSPORTS = {"collective": Collective, "peer_copy": PeerCopy}
