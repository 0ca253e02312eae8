"""The NVLink engine's layout shared by its host modules: the columns of a
row of the counts matrix (``Row`` in ``csrc/engine.cuh``), the sizes of its
buffers (:class:`Capacity`) and what a counts exchange gives (:class:`Counts`).

Notation as in ``dispatch.nvlink``.
"""

from __future__ import annotations

import array
import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from dispatch import cuda, plan
from dispatch.kernels import quantize

_ALIGN = 256
# the columns of a row of the counts matrix (``Row`` in csrc/engine.cuh)
TOKENS_COL = len(plan.HEADER)
STAGED_COL = TOKENS_COL + 1
GROUPS_COL = TOKENS_COL + 2
SENDS_COL = TOKENS_COL + 3

# what the status words (csrc/engine.cuh's Status, and where it was recorded) say
_STATUS = (
    "ok",
    "rank {me} timed out waiting for rank {peer}",
    "rank {me} received more rows than the dispatch counted from rank {peer}",
    "rank {me} received a route no checked dispatch makes (an expert id twice in a row, check_inputs=False) "
    "from rank {peer}",
    "rank {peer} receives more rows than its max_rows",
    "rank {peer} was at another call of the dispatcher, or dispatched with another K, H, x or topk_weights "
    "dtype or number of groups of experts than rank {me}",
    "rank {peer} marked its input bad (topk_idx/topk_weights values, more tokens than the buffers hold, or a "
    "max_rows its free device memory does not hold)",
    "rank {peer} failed (its own error says why) and sent rank {me} nothing",
)
_WHERE = ("the counts exchange", "the rows exchange", "the combine", "the routing-weight gradients")


def failure_message(code: int, peer: int, where: int, me: int, timeout_ns: int) -> str:
    """What a failure the kernels recorded (status words ``code, peer, where``) says to the user."""
    what = _STATUS[code].format(me=me, peer=peer) if 0 < code < len(_STATUS) else f"status {code}"
    return (f"NVLink transport: {what} in {_WHERE[where] if 0 <= where < len(_WHERE) else where} "
            f"(timeout {timeout_ns / 1e9:g} s); the exchange's results are invalid and the engine stays failed "
            "(build the dispatchers again on every rank)")


def _up(n: int, to: int = _ALIGN) -> int:
    return -(-n // to) * to


def staged_row_bytes(codec, hidden: int) -> int:
    """Bytes of one staged row of ``hidden`` channels under ``codec`` (16-aligned)."""
    return _up(codec.row_bytes(hidden), 16)


def partial_row_bytes(wire: torch.dtype, hidden: int) -> int:
    """Bytes of one partial-sum row of ``hidden`` channels in ``wire`` (16-aligned)."""
    return _up(hidden * wire.itemsize, 16)


@dataclass(frozen=True)
class Capacity:
    """Sizes the data buffer holds (per parity copy)."""

    tokens: int = 0  # T_max
    topk: int = 0  # K
    stage_row: int = 0  # bytes of a staged row
    part_row: int = 0  # bytes of a partial row

    def covers(self, other: "Capacity") -> bool:
        return (self.tokens >= other.tokens and self.topk >= other.topk and self.stage_row >= other.stage_row
                and self.part_row >= other.part_row)

    def union(self, other: "Capacity") -> "Capacity":
        tokens = max(self.tokens, other.tokens)
        return Capacity(max(256, 1 << max(tokens - 1, 0).bit_length()) if tokens > self.tokens else tokens,
                        max(self.topk, other.topk), max(self.stage_row, other.stage_row),
                        max(self.part_row, other.part_row))

    def regions(self, world: int) -> dict[str, tuple[int, int]]:
        """name -> (offset of copy 0, bytes of one copy)."""
        sizes = {
            "route": self.tokens * self.topk * 16,
            "lists": world * self.tokens * 4,
            "slots": self.tokens * self.topk * 8,
            "stage": self.tokens * self.stage_row,
            "partials": world * self.tokens * self.part_row,
        }
        out, at = {}, 0
        for name, size in sizes.items():
            size = _up(size)
            out[name] = (at, size)
            at += 2 * size
        out["total"] = (at, 0)
        return out


class HostCounts(NamedTuple):
    """What the host reads of a counts exchange (every rank's row of the counts
    matrix), summed.

    Attributes:
        headers: every rank's ``plan.HEADER`` entries.
        sends: every rank's tokens to every rank, ``sends[s][d]``.
        rows: N of every rank: the rows it receives.
        per_expert: [E_local] int64 on the host, this rank's rows of each local expert.
    """

    headers: tuple
    sends: tuple[tuple[int, ...], ...]
    rows: tuple[int, ...]
    per_expert: torch.Tensor

    @classmethod
    def read(cls, matrix_host: list[list[int]], rank: int, local: int) -> "HostCounts":
        """Those of the counts matrix read on the host (W rows), for ``rank`` of E_local = ``local`` experts."""
        world = len(matrix_host)
        header_len, first = len(plan.HEADER), SENDS_COL + world
        rows = tuple([sum(sum(r[first + d * local : first + (d + 1) * local]) for r in matrix_host)
                      for d in range(world)])
        if world == 1:
            mine = matrix_host[0][first : first + local]
        else:
            mine = list(map(sum, zip(*(r[first + rank * local : first + (rank + 1) * local] for r in matrix_host))))
        return cls(tuple(r[:header_len] for r in matrix_host), tuple(tuple(r[SENDS_COL:first]) for r in matrix_host),
                   rows, torch.frombuffer(array.array("q", mine), dtype=torch.int64))


class Planned(NamedTuple):
    """What the compiled counts exchange makes in the usual case (``Counts.planned``):
    what the checks of every rank's header would give (whether some rank needs
    the gradient of x, of topk_weights) and the handle's tensors (presum,
    slot_k [W * bound, J] int32; the places' weights [N], src_rank, src_token [N]);
    ``tokens``: the dispatch's rows [N, H] where it pulled them with the counts
    (``Engine.exchange_counts(pull=True)``), else None."""

    x_grad: bool
    weights_grad: bool
    presum: torch.Tensor
    slot_k: torch.Tensor
    weights: torch.Tensor
    src_rank: torch.Tensor
    src_token: torch.Tensor
    tokens: torch.Tensor | None = None


class WordsAt(NamedTuple):
    """Where a dispatch's int32 words (``Counts.words``) hold what: T, K, W, L,
    E_local, and the offsets (in words) of its routes (at 0), lists, hits and
    the counts exchange's output (status, the counts matrix, src_start,
    num_rows, group_end). One per shape of dispatch (``Engine._counts_launches``)."""

    tokens: int
    topk: int
    world: int
    row_len: int
    local: int
    lists: int
    hit: int
    out: int

    @classmethod
    def of(cls, tokens: int, topk: int, world: int, row_len: int, local: int, sizes) -> "WordsAt":
        """From the words' part sizes (routes, lists, hits, output, scan sums)."""
        return cls(tokens, topk, world, row_len, local, sizes[0], sizes[0] + sizes[1],
                   sizes[0] + sizes[1] + sizes[2])


@dataclass(frozen=True)
class Counts:
    """What the counts exchange of one dispatch gave.

    Attributes:
        words: the dispatch's int32 words on the device (``at``: where each part is);
            ``route``, ``lists``, ``hit``, ``matrix``, ``src_start`` and ``num_rows``
            are views of it, made at their first use (a dispatch on the compiled
            path hands the kernels their addresses: ``address``).
        at: :class:`WordsAt`.
        host: what the host read of it (:class:`HostCounts`; None without a host read).
        received: the items (source rank, token) this rank receives (host; None
            without a host read).
        bound: rows of each source in presum: the largest T of the group, or
            without a host read the token capacity of the buffers.
        tokens_per_expert: [E_local] int64 on the device.
        tokens_at: [W * bound] int32 on the device, written by the dispatch's
            pull: the token of each item (source rank s, j) this rank received,
            at s * bound + j, in the order the later kernels walk them.
        staged: every rank staged its routes and rows with the counts (else
            they move in an exchange of their own).
        group_end: [G] int32 on the device, the end of each group's rows, for a
            dispatch by G > 1 groups with a row budget (group g's rows start at
            g B, B = ceil(max_rows / G)); None otherwise.
        planned: where the compiled counts exchange found the usual case (every
            header agreeing, none failed, every rank within its budgets: the
            checks would pass), :class:`Planned`; None otherwise (the checks run
            on the host).
        core: where the usual dispatch compiled made it (``dispatch.usual``),
            what a combine compiled along its handle reads of it (csrc/host.cpp's
            ``HandleCore``); None otherwise.

    The views: ``matrix`` [W, L] (the counts matrix); ``src_start`` [W * E_local],
    first row of (source, local expert); ``num_rows`` [1], N; ``route`` [T, K]
    ``Slot`` (int32 [T, K, 4]) of this rank's tokens; ``lists`` [W, T], the
    tokens of this rank each rank gets, ascending, at [d, 0 .. its count);
    ``hit`` [T], the mask of the ranks each token goes to.
    """

    words: torch.Tensor
    at: WordsAt
    host: HostCounts | None
    received: int | None
    bound: int
    tokens_per_expert: torch.Tensor
    tokens_at: torch.Tensor
    staged: bool
    group_end: torch.Tensor | None = None
    planned: Planned | None = None
    core: object = None

    @property
    def tokens(self) -> int:
        """T, this rank's tokens."""
        return self.at.tokens

    @property
    def topk(self) -> int:
        """K, slots a token."""
        return self.at.topk

    def address(self, part: str) -> int:
        """The device address of ``part`` ("matrix", "hit", "src_start", "num_rows") of
        the words, as its view's ``data_ptr()`` gives it (0 for an empty one: hit where T = 0)."""
        at = self.at
        if part == "hit" and at.tokens == 0:
            return 0
        return self.words.data_ptr() + 4 * {
            "matrix": at.out + 4,
            "hit": at.hit,
            "src_start": at.out + 4 + at.world * at.row_len,
            "num_rows": at.out + 4 + at.world * at.row_len + at.world * at.local,
        }[part]

    @functools.cached_property
    def route(self) -> torch.Tensor:
        at = self.at
        return self.words.as_strided((at.tokens, at.topk, 4), (at.topk * 4, 4, 1), 0)

    @functools.cached_property
    def lists(self) -> torch.Tensor:
        at = self.at
        return self.words.as_strided((at.world, at.tokens), (at.tokens, 1), at.lists)

    @functools.cached_property
    def hit(self) -> torch.Tensor:
        return self.words.as_strided((self.at.tokens,), (1,), self.at.hit)

    @functools.cached_property
    def matrix(self) -> torch.Tensor:
        at = self.at
        return self.words.as_strided((at.world, at.row_len), (at.row_len, 1), at.out + 4)

    @functools.cached_property
    def src_start(self) -> torch.Tensor:
        at = self.at
        return self.words.as_strided((at.world * at.local,), (1,), at.out + 4 + at.world * at.row_len)

    @functools.cached_property
    def num_rows(self) -> torch.Tensor:
        at = self.at
        return self.words.as_strided((1,), (1,), at.out + 4 + at.world * at.row_len + at.world * at.local)

    @property
    def items(self) -> int:
        """(source rank, token) pairs this rank receives, to size a kernel's grid by
        (the kernels loop over the pairs, whatever the grid): without a host read,
        W times this rank's T, as if every rank sent it every token."""
        if self.received is not None:
            return self.received
        return self.at.world * self.at.tokens


def _wire_of(codec, dtype: torch.dtype) -> tuple[torch.dtype, int]:
    """(wire dtype, fp8 kind: 0 none, 1 e4m3, 2 e5m2) of a codec for rows of ``dtype``."""
    fmt = getattr(codec, "fmt", None)
    if fmt is None:
        return codec.wire, 0
    return torch.uint8, 1 if fmt is quantize.E4M3 else 2


def aligned_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` contiguous at a 16-byte-aligned address (the kernels load 16 bytes at a time)."""
    rows = rows.contiguous()
    return rows if rows.data_ptr() % 16 == 0 else rows.clone()


def scan_warps(num_experts: int, world: int) -> int:
    """Warps of a block of the routing layout's scan (``route_layout``): as many as
    hold a row of E + W counts each in its shared memory; 0 where not one does."""
    return min(cuda.THREADS // 32, cuda.SCAN_SHARED // (4 * (num_experts + world)))


def counts_shared(num_experts: int, world: int) -> int:
    """Dynamic shared bytes of the counts exchange (``exchange_counts``): the
    places of the rank's E_local experts, then every rank's rows per group."""
    local = num_experts // world
    return 4 * (local + 1 + world * local)


def most_experts(world: int) -> int:
    """The most experts (a multiple of W) whose counts the layout kernels hold
    in one block's shared memory on ``world`` ranks (``scan_warps`` >= 1, and
    ``counts_shared`` within ``cuda.SCAN_SHARED``)."""
    ints = cuda.SCAN_SHARED // 4
    most = min(ints - world, (ints - 1) * world // (world + 1))
    return most - most % world
