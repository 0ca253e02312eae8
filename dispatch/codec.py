"""Wire formats: how one row is encoded while it crosses between ranks.

The formats so far are plain casts: ``native`` keeps the data's own dtype
(lossless), ``bf16`` and ``fp32`` cast on the way out and back on arrival.
"""

from __future__ import annotations

import torch

_WIRE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def wire_dtype(wire: str, data_dtype: torch.dtype) -> torch.dtype:
    """The dtype a row of ``data_dtype`` travels in under the wire format ``wire``."""
    if wire == "native":
        return data_dtype
    try:
        return _WIRE_DTYPES[wire]
    except KeyError:
        raise ValueError(f"unknown wire format {wire!r}; expected 'native', 'bf16' or 'fp32'") from None
