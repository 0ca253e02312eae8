"""Wire formats: how one row is encoded while it crosses between ranks.

Two kinds of direction, two kinds of format:

* Rows that travel *to the experts* (the dispatch, and the gradients of the
  combined output in backward) go through a :class:`Codec`: ``pack`` gathers the
  rows to send and encodes them in one pass, ``unpack`` decodes what arrived and
  expands it to one row per (token, expert) in one pass. Variants only ever call
  these two, so a new format needs no change in any variant.
* Partial sums that travel *home* (the combine, and the gradients of x in
  backward) are reduced in fp32 on both sides; on the wire they are a plain dtype
  (``sum_wire_dtype``), never a lossy block format.

Formats of rows going to the experts:

* ``native`` keeps the data's own dtype (lossless); ``bf16`` and ``fp32`` cast on
  the way out and back on arrival (bf16: 7 stored mantissa bits, per-element
  relative error at most 2^-8, but for finite values past the wire's largest,
  which round to infinity: above 3.39e38 for bf16, 3.40e38 for fp32 from fp64).
* ``fp8`` (e4m3) and ``e5m2``: one fp32 scale per 128 channels of each row, packed
  as one byte row ``[H fp8 codes | pad to 4 | ceil(H/128) fp32 scales]``
  (``dispatch.kernels.quantize`` has the layout, the encoding, the short last
  block and the handling of zeros and non-finite values). Per element, the
  round-trip error (before the cast to the data's dtype) is at most
  ``max(2^-(m+1) |x|, scale * 2^(e_min - m - 1))``, m the mantissa width (3 for
  e4m3, 2 for e5m2) and e_min the exponent of the smallest normal (-6, -14):
  half a step, relative in the normal range, half the subnormal step below it.
  Since ``scale <= 2 amax / FMT_MAX``, that is at most ``2^-(m+1)`` of the
  block's amax. e4m3 is for activations (precision), e5m2 for gradients (range
  within the block). With ``pow2_scales`` each scale is a power of two, so
  scaling is exact and a scale costs one exponent.

Sums never travel in fp8: a block format rounds every partial to ``2^-4`` of its
block's amax, and the home rank adds W such partials, so where partials cancel
the error is large relative to the result. The lowest precision for sums is
bf16, whose error is relative to each element.
"""

from __future__ import annotations

import abc
import functools

import torch

from dispatch.kernels import quantize

_CAST_WIRES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class Codec(abc.ABC):
    """Encoding of the rows of one dtype, one direction. Stateless.

    Notation: H hidden size, n rows packed, m rows unpacked, B = ``row_bytes``.
    """

    name: str

    @abc.abstractmethod
    def row_bytes(self, hidden: int) -> int:
        """Bytes one packed row of ``hidden`` channels takes on the wire."""

    @abc.abstractmethod
    def wire_row(self, dtype: torch.dtype, hidden: int) -> tuple[torch.dtype, int]:
        """(dtype, width) of the wire row ``pack`` makes of a row of ``hidden`` channels of ``dtype``."""

    @abc.abstractmethod
    def pack(self, rows: torch.Tensor, index: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Encode ``rows[index]`` (all rows if index is None) for the wire.

        Args:
            rows: [T, H] data rows.
            index: [n] int64 rows of ``rows`` to send, or None.
            out: None, or where to write them: a contiguous tensor of the
                shape and dtype they take (e.g. an exchange's send buffer).
        Returns:
            [n, ...] wire rows (``out`` where given); any dtype and trailing
            shape ``comm`` can move (it moves bytes), ``row_bytes(H)`` bytes per row.
        """

    @abc.abstractmethod
    def unpack(
        self, wire_rows: torch.Tensor, dtype: torch.dtype, hidden: int, index: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Decode ``wire_rows[index]`` (all if index is None) back to data rows.

        Args:
            wire_rows: [n, ...] rows as ``pack`` produced them.
            dtype: dtype of the rows to return.
            hidden: H.
            index: [m] int64 wire rows to decode, in output order, or None.
        Returns:
            [m, H] rows of ``dtype``.
        """


class CastCodec(Codec):
    """A row travels as a plain dtype: ``wire=None`` keeps the data's own (lossless)."""

    def __init__(self, name: str, data_dtype: torch.dtype, wire: torch.dtype | None) -> None:
        self.name = name
        self.wire = data_dtype if wire is None else wire

    def row_bytes(self, hidden: int) -> int:
        return hidden * self.wire.itemsize

    def wire_row(self, dtype, hidden):
        return self.wire, hidden

    def pack(self, rows, index=None, out=None):
        if out is not None and index is not None and rows.dtype == self.wire:
            return torch.index_select(rows, 0, index, out=out)  # one pass, straight into out
        picked = rows if index is None else rows.index_select(0, index)
        return picked.to(self.wire) if out is None else out.copy_(picked)

    def unpack(self, wire_rows, dtype, hidden, index=None):
        picked = wire_rows if index is None else wire_rows.index_select(0, index)  # then convert only those
        return picked.to(dtype)

    def __repr__(self) -> str:
        return f"CastCodec({self.name!r}, wire={self.wire})"


class BlockFp8Codec(Codec):
    """A row travels as fp8 codes with one fp32 scale per 128 channels, packed
    into one uint8 row of ``row_bytes(H)`` bytes (see ``dispatch.kernels.quantize``).

    Args:
        name: the wire's name (``"fp8"`` or ``"e5m2"``).
        fmt: ``quantize.E4M3`` or ``quantize.E5M2``.
        pow2_scales: round each scale up to a power of two.
    """

    def __init__(self, name: str, fmt: quantize.Fp8Format, pow2_scales: bool = False) -> None:
        self.name = name
        self.fmt = fmt
        self.pow2_scales = pow2_scales

    def row_bytes(self, hidden: int) -> int:
        return quantize.row_bytes(hidden)

    def wire_row(self, dtype, hidden):
        return torch.uint8, self.row_bytes(hidden)

    def pack(self, rows, index=None, out=None):
        """Returns [n, row_bytes(H)] uint8; the Triton kernel on CUDA."""
        packed = quantize.pack(rows, index, self.fmt, self.pow2_scales)
        return packed if out is None else out.copy_(packed)

    def unpack(self, wire_rows, dtype, hidden, index=None):
        if wire_rows.dtype != torch.uint8 or wire_rows.dim() != 2 or wire_rows.shape[1] != self.row_bytes(hidden):
            raise ValueError(
                f"wire_rows must be [n, {self.row_bytes(hidden)}] uint8 packed rows for H={hidden}, "
                f"got {list(wire_rows.shape)} {wire_rows.dtype}"
            )
        return quantize.unpack(wire_rows, index, self.fmt, dtype, hidden)

    def __repr__(self) -> str:
        return f"BlockFp8Codec({self.name!r}, {self.fmt.name}, pow2_scales={self.pow2_scales})"


_BLOCK_WIRES = {"fp8": quantize.E4M3, "e5m2": quantize.E5M2}


def to_experts_codec(wire: str, data_dtype: torch.dtype, pow2_scales: bool = False) -> Codec:
    """The codec for rows of ``data_dtype`` travelling to the experts under ``wire``
    (one object per codec: a codec holds no state).

    Args:
        wire: ``"native"``, ``"bf16"``, ``"fp32"``, ``"fp8"`` (e4m3) or ``"e5m2"``.
        data_dtype: dtype of the rows (and of the rows the experts receive).
        pow2_scales: for the fp8 formats, power-of-two scales.
    """
    return _codec(wire, data_dtype, bool(pow2_scales))


@functools.lru_cache(maxsize=256)
def _codec(wire: str, data_dtype: torch.dtype, pow2_scales: bool) -> Codec:
    if wire == "native":
        return CastCodec(wire, data_dtype, None)
    if wire in _CAST_WIRES:
        return CastCodec(wire, data_dtype, _CAST_WIRES[wire])
    if wire in _BLOCK_WIRES:
        return BlockFp8Codec(wire, _BLOCK_WIRES[wire], pow2_scales)
    raise ValueError(f"unknown wire format {wire!r} for rows going to the experts")


def sum_wire_dtype(wire: str, data_dtype: torch.dtype) -> torch.dtype:
    """The dtype a partial sum of ``data_dtype`` travels home in under ``wire``."""
    if wire == "native":
        return data_dtype
    try:
        return _CAST_WIRES[wire]
    except KeyError:
        raise ValueError(f"unknown wire format {wire!r} for partial sums going home") from None
