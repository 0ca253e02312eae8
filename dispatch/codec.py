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

The formats so far are plain casts: ``native`` keeps the data's own dtype
(lossless), ``bf16`` and ``fp32`` cast on the way out and back on arrival.
"""

from __future__ import annotations

import abc

import torch

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
    def pack(self, rows: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
        """Encode ``rows[index]`` (all rows if index is None) for the wire.

        Args:
            rows: [T, H] data rows.
            index: [n] int64 rows of ``rows`` to send, or None.
        Returns:
            [n, ...] wire rows; any dtype and trailing shape ``comm`` can move
            (it moves bytes), ``row_bytes(H)`` bytes per row.
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

    def pack(self, rows, index=None):
        picked = rows if index is None else rows.index_select(0, index)
        return picked.to(self.wire)

    def unpack(self, wire_rows, dtype, hidden, index=None):
        rows = wire_rows.to(dtype)
        return rows if index is None else rows.index_select(0, index)

    def __repr__(self) -> str:
        return f"CastCodec({self.name!r}, wire={self.wire})"


def to_experts_codec(wire: str, data_dtype: torch.dtype) -> Codec:
    """The codec for rows of ``data_dtype`` travelling to the experts under ``wire``."""
    if wire == "native":
        return CastCodec(wire, data_dtype, None)
    if wire in _CAST_WIRES:
        return CastCodec(wire, data_dtype, _CAST_WIRES[wire])
    raise ValueError(f"unknown wire format {wire!r} for rows going to the experts")


def sum_wire_dtype(wire: str, data_dtype: torch.dtype) -> torch.dtype:
    """The dtype a partial sum of ``data_dtype`` travels home in under ``wire``."""
    if wire == "native":
        return data_dtype
    try:
        return _CAST_WIRES[wire]
    except KeyError:
        raise ValueError(f"unknown wire format {wire!r} for partial sums going home") from None
