"""Block-scaled fp8 rows: send-side gather + quantize, receive-side dequantize + expand.

Notation: H hidden size, G = ceil(H / 128) channel blocks per row, n rows packed,
m rows unpacked, B = ``row_bytes(H)``.

A packed row is ``B`` bytes::

    [ H fp8 codes | 0-3 padding bytes | G fp32 scales ]

The codes start at byte 0; the scales start at ``codes_bytes(H)``, the first
multiple of 4 at or after H, so that they can be read as aligned fp32 (for H a
multiple of 128, the usual case, there is no padding and the row is exactly
``[H fp8 | H/128 fp32]``). Block g covers channels ``[128 g, min(128 (g + 1), H))``:
when H is not a multiple of 128 the last block is short and gets its own scale
from its own channels.

Encoding of one block, computed in fp32 (fp16/bf16/fp64 rows are converted to
fp32 first; fp64 values beyond fp32's range become infinities):

* ``amax`` = largest |value| among the block's finite values;
* ``scale = max(amax / FMT_MAX, 2^-126)`` (FMT_MAX = 448 for e4m3, 57344 for
  e5m2), rounded up to a power of two when asked (``pow2``); ``scale = 1`` for a
  block with ``amax == 0``, so zeros stay exactly zero and no 0/0 is formed. The
  floor 2^-126 keeps the reciprocal finite: blocks below ``FMT_MAX * 2^-126``
  lose relative precision, never absolute (error below ``2^-126 * 2^-10``);
* ``code = fp8(clamp(value * (1 / scale), -FMT_MAX, FMT_MAX))``, rounding to the
  nearest (ties to even); ``1 / scale`` is one correctly rounded fp32 division
  per block, so the kernels and the references agree bit for bit;
* decoding is ``fp32(code) * scale``, clamped to the finite range of the
  requested dtype (rounding up near that dtype's largest value, e.g. 65504 in
  fp16, must not make an infinity), then one cast to the requested dtype.

Non-finite values are carried through, never invented: a NaN or +-inf input
value decodes to NaN (e4m3 has no infinity) or to itself (e5m2 keeps +-inf);
the other values of its block are scaled by the block's finite amax and are
unaffected.

The Triton kernels use the hardware fp8 conversions on the GPU: on sm89+ Triton
3.6 lowers fp32 -> fp8 to ``cvt.rn.satfinite.{e4m3,e5m2}x2.f32`` (round to nearest
even straight from fp32, no detour through fp16: checked equal to torch on an
H200 for every fp32 of magnitude <= FMT_MAX). ``satfinite`` turns +-inf into
+-FMT_MAX, so the e5m2 kernel puts the infinities back itself. Triton's CPU
interpreter converts fp32 -> fp8 by truncation and decodes the fp8 NaN/inf
codes as finite numbers, so under the interpreter (``TRITON_INTERPRET=1``) the
kernels encode with an exact integer round-to-nearest-even (``_encode_soft``)
and patch the special codes on decode; tests hold both against the references.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:  # Triton is optional: CPU-only installs run the references.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

BLOCK = 128
MIN_SCALE = 2.0**-126
# Launch shape of the kernels: one program moves ``*_groups`` channel blocks
# (128 channels each) of one row with ``*_warps`` warps, so a deepseek-v3 row
# (H 7168 = 56 blocks) is 7 programs of 1024 channels, 16 (pack) or 32 (unpack)
# channels a thread: several 16-byte loads in flight per thread after the one
# index load. Measured on one H200 (torch 2.11, triton 3.6), H 7168, bf16,
# 11.8k rows packed from 4096, 32k unpacked; groups 4 / 8 / 16 x warps 1 / 2 / 4 / 8:
# groups 8 with 1-2 warps was best for both (pack +11%, unpack +15% over 8 x 4
# warps); whole-row programs (64 groups, 8-16 warps) were slower.
TUNING = {"pack_groups": 8, "pack_warps": 2, "unpack_groups": 8, "unpack_warps": 1}


@dataclass(frozen=True)
class Fp8Format:
    """One fp8 format: its torch dtype and the constants of its encoding."""

    name: str
    dtype: torch.dtype
    max: float  # largest finite value
    mantissa_bits: int
    min_exponent: int  # exponent of the smallest normal value
    has_inf: bool


E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, 448.0, 3, -6, False)
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, 57344.0, 2, -14, True)


def num_blocks(hidden: int) -> int:
    """G: 128-channel blocks of a row of ``hidden`` channels (the last may be short)."""
    return -(-hidden // BLOCK)


def codes_bytes(hidden: int) -> int:
    """Byte offset of the scales in a packed row: H rounded up to a multiple of 4."""
    return -(-hidden // 4) * 4


def row_bytes(hidden: int) -> int:
    """B: bytes of one packed row."""
    return codes_bytes(hidden) + 4 * num_blocks(hidden)


def _pow2_ceil(scale: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= each (positive, finite fp32) scale, by its bits."""
    bits = scale.view(torch.int32)
    exponent = bits & 0x7F800000
    exponent = exponent + torch.where((bits & 0x007FFFFF) != 0, 0x00800000, 0).to(torch.int32)
    return exponent.view(torch.float32)


def _blocks(rows: torch.Tensor, hidden: int) -> torch.Tensor:
    """[n, H] -> [n, G, 128] fp32, zero-padded to whole blocks."""
    padded = torch.zeros(rows.shape[0], num_blocks(hidden) * BLOCK, dtype=torch.float32, device=rows.device)
    padded[:, :hidden] = rows
    return padded.view(rows.shape[0], num_blocks(hidden), BLOCK)


def pack_reference(
    rows: torch.Tensor, index: torch.Tensor | None, fmt: Fp8Format, pow2: bool
) -> torch.Tensor:
    """PyTorch reference of :func:`pack_triton`: gather ``rows[index]`` and encode.

    Args:
        rows: [T, H] float16/bfloat16/float32/float64.
        index: [n] int64 rows to pack, or None for all (n = T).
        fmt: ``E4M3`` or ``E5M2``.
        pow2: round each scale up to a power of two.
    Returns:
        [n, B] uint8 packed rows.
    """
    hidden = rows.shape[1]
    picked = rows if index is None else rows.index_select(0, index)
    n = picked.shape[0]
    out = torch.zeros(n, row_bytes(hidden), dtype=torch.uint8, device=rows.device)
    if n == 0 or hidden == 0:
        return out
    x = _blocks(picked.to(torch.float32), hidden)  # [n, G, 128]
    finite = torch.isfinite(x)
    amax = torch.where(finite, x.abs(), 0.0).amax(2)  # [n, G]
    # A tensor divisor, not a Python number: CUDA torch computes ``a / number`` as
    # ``a * (1 / number)``, which is not the correctly rounded quotient.
    scale = torch.clamp(amax / torch.full_like(amax, fmt.max), min=MIN_SCALE)
    if pow2:
        scale = _pow2_ceil(scale)
    scale = torch.where(amax == 0, 1.0, scale)
    v = x * scale.reciprocal().unsqueeze(2)  # reciprocal: correctly rounded on CPU and CUDA
    q = torch.where(finite, v.clamp(-fmt.max, fmt.max), v if fmt.has_inf else torch.nan)
    codes = q.to(fmt.dtype).view(torch.uint8).view(n, -1)[:, :hidden]
    out[:, :hidden] = codes
    start = codes_bytes(hidden)
    out[:, start:] = scale.contiguous().view(torch.uint8).view(n, -1)
    return out


def split_packed(wire_rows: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, B] uint8 packed rows -> ([n, H] uint8 codes, [n, G] fp32 scales) views."""
    start = codes_bytes(hidden)
    scales = wire_rows.view(torch.float32)[:, start // 4 :]
    return wire_rows[:, :hidden], scales


def unpack_reference(
    wire_rows: torch.Tensor, index: torch.Tensor | None, fmt: Fp8Format, dtype: torch.dtype, hidden: int
) -> torch.Tensor:
    """PyTorch reference of :func:`unpack_triton`: decode ``wire_rows[index]``.

    Args:
        wire_rows: [n, B] uint8 packed rows.
        index: [m] int64 wire rows to decode, in output order, or None (m = n).
        fmt: the format they were packed in.
        dtype: dtype of the result.
        hidden: H.
    Returns:
        [m, H] rows of ``dtype``.
    """
    picked = wire_rows if index is None else wire_rows.index_select(0, index)
    m = picked.shape[0]
    if m == 0 or hidden == 0:
        return torch.zeros(m, hidden, dtype=dtype, device=wire_rows.device)
    codes, scales = split_packed(picked.contiguous(), hidden)
    values = codes.contiguous().view(fmt.dtype).to(torch.float32)
    per_channel = scales.repeat_interleave(BLOCK, dim=1)[:, :hidden]
    top = _out_max(dtype)
    decoded = values * per_channel
    return torch.where(torch.isfinite(values), decoded.clamp(-top, top), decoded).to(dtype)


def _out_max(dtype: torch.dtype) -> float:
    """Largest finite value a decoded row may take in ``dtype`` (decoding is in fp32)."""
    return min(torch.finfo(dtype).max, torch.finfo(torch.float32).max)


if triton is not None:

    @triton.jit
    def _encode_soft(q, MANT: tl.constexpr, MIN_EXP: tl.constexpr, HAS_INF: tl.constexpr):
        """fp32 (finite and clamped to the format's range, or NaN/inf) -> fp8 code
        bits as int32, rounding to the nearest, ties to even. Exact, integer-based."""
        bits = q.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        a = tl.abs(q)
        exponent = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        exponent = tl.maximum(exponent, MIN_EXP)
        inv_step = ((MANT - exponent + 127) << 23).to(tl.float32, bitcast=True)
        r = (a * inv_step + 8388608.0) - 8388608.0  # round half to even, as an integer value
        r = tl.where(a < float("inf"), r, 0.0)  # NaN / inf lanes: their code is set below
        code = ((exponent - MIN_EXP) << MANT) + r.to(tl.int32)
        if HAS_INF:
            special = tl.where(a == float("inf"), 0x7C, 0x7F)
        else:
            special = 0x7F
        code = tl.where(a == a, tl.where(a < float("inf"), code, special), 0x7F)
        return code | sign

    @triton.jit
    def _pack_kernel(
        src_ptr,
        index_ptr,
        out_ptr,
        scales_ptr,
        hidden,
        blocks,
        src_stride,
        out_stride,
        scales_stride,
        scales_start,
        HAS_INDEX: tl.constexpr,
        E4M3_FMT: tl.constexpr,
        FMT_MAX: tl.constexpr,
        POW2: tl.constexpr,
        SOFT: tl.constexpr,
        GROUPS: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        if HAS_INDEX:
            src_row = tl.load(index_ptr + row).to(tl.int64)
        else:
            src_row = row
        groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
        cols = groups[:, None] * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
        mask = cols < hidden
        x = tl.load(src_ptr + src_row * src_stride + cols, mask=mask, other=0.0).to(tl.float32)
        finite = tl.abs(x) < float("inf")
        amax = tl.max(tl.where(finite, tl.abs(x), 0.0), axis=1)
        scale = tl.maximum(tl.div_rn(amax, FMT_MAX), 1.1754943508222875e-38)  # MIN_SCALE
        if POW2:
            bits = scale.to(tl.int32, bitcast=True)
            exponent = (bits & 0x7F800000) + tl.where((bits & 0x007FFFFF) != 0, 0x00800000, 0)
            scale = exponent.to(tl.float32, bitcast=True)
        scale = tl.where(amax == 0.0, 1.0, scale)
        inv = tl.div_rn(tl.full([GROUPS], 1.0, tl.float32), scale)
        v = x * inv[:, None]
        if E4M3_FMT:
            q = tl.where(finite, tl.minimum(tl.maximum(v, -FMT_MAX), FMT_MAX), float("nan"))
        else:
            q = tl.where(finite, tl.minimum(tl.maximum(v, -FMT_MAX), FMT_MAX), v)
        if SOFT:
            if E4M3_FMT:
                code = _encode_soft(q, 3, -6, False).to(tl.uint8)
            else:
                code = _encode_soft(q, 2, -14, True).to(tl.uint8)
        else:
            if E4M3_FMT:
                code = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            else:
                code = q.to(tl.float8e5).to(tl.uint8, bitcast=True)
                # cvt.rn.satfinite saturates +-inf to +-57344: give the infinities back.
                code = tl.where(tl.abs(q) == float("inf"), tl.where(q > 0, 0x7C, 0xFC).to(tl.uint8), code)
        tl.store(out_ptr + row * out_stride + cols, code, mask=mask)
        tl.store(scales_ptr + row * scales_stride + scales_start + groups, scale, mask=groups < blocks)

    @triton.jit
    def _unpack_kernel(
        codes_ptr,
        scales_ptr,
        index_ptr,
        out_ptr,
        hidden,
        blocks,
        codes_stride,
        scales_stride,
        scales_start,
        out_stride,
        HAS_INDEX: tl.constexpr,
        E4M3_FMT: tl.constexpr,
        OUT_MAX: tl.constexpr,
        SOFT: tl.constexpr,
        GROUPS: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        if HAS_INDEX:
            wire_row = tl.load(index_ptr + row).to(tl.int64)
        else:
            wire_row = row
        groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
        cols = groups[:, None] * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
        mask = cols < hidden
        code = tl.load(codes_ptr + wire_row * codes_stride + cols, mask=mask, other=0)
        if E4M3_FMT:
            values = code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            if SOFT:  # the interpreter decodes the NaN codes as +-480
                values = tl.where((code & 0x7F) == 0x7F, float("nan"), values)
        else:
            values = code.to(tl.float8e5, bitcast=True).to(tl.float32)
            if SOFT:  # the interpreter decodes the inf / NaN codes as finite numbers
                exp_ones = (code & 0x7C) == 0x7C
                inf = tl.where((code & 0x80) != 0, -float("inf"), float("inf"))
                special = tl.where((code & 0x03) == 0, inf, float("nan"))
                values = tl.where(exp_ones, special, values)
        scale = tl.load(scales_ptr + wire_row * scales_stride + scales_start + groups, mask=groups < blocks, other=1.0)
        out = values * scale[:, None]
        out = tl.where(tl.abs(values) < float("inf"), tl.minimum(tl.maximum(out, -OUT_MAX), OUT_MAX), out)
        tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _launch(hidden: int, kernel: str) -> tuple[int, int]:
    """(channel blocks per program, warps per program) of ``kernel`` ("pack" or
    "unpack") for rows of ``hidden`` channels: the tuned values, shrunk for short rows."""
    groups = min(TUNING[f"{kernel}_groups"], triton.next_power_of_2(max(num_blocks(hidden), 1)))
    warps = max(1, min(TUNING[f"{kernel}_warps"], groups * BLOCK // 512))
    return groups, triton.next_power_of_2(warps)


def pack_triton(
    rows: torch.Tensor, index: torch.Tensor | None, fmt: Fp8Format, pow2: bool, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Gather ``rows[index]`` and encode, in one pass: each picked row is read once
    and its packed row written straight into the returned (send) buffer.
    Arguments and result as :func:`pack_reference`."""
    if triton is None:
        raise RuntimeError("pack_triton needs triton; use pack_reference")
    rows = rows.contiguous()
    hidden = rows.shape[1]
    n = rows.shape[0] if index is None else index.shape[0]
    padded = codes_bytes(hidden) != hidden  # zero the padding bytes, so that the wire is deterministic
    if out is None:
        out = (torch.zeros if padded else torch.empty)(n, row_bytes(hidden), dtype=torch.uint8, device=rows.device)
    else:
        if out.shape != (n, row_bytes(hidden)) or out.dtype != torch.uint8 or out.stride(1) != 1 or out.stride(0) % 4:
            raise ValueError(f"out must be [{n}, {row_bytes(hidden)}] uint8 rows with 4-aligned row strides, "
                             f"got {list(out.shape)} {out.dtype} strides {out.stride()}")
        if padded:
            out[:, hidden : codes_bytes(hidden)].zero_()
    if n == 0 or hidden == 0:
        return out
    groups, warps = _launch(hidden, "pack")
    grid = (n, triton.cdiv(num_blocks(hidden), groups))
    _pack_kernel[grid](
        rows,
        rows if index is None else index.contiguous(),
        out,
        out.view(torch.float32),
        hidden,
        num_blocks(hidden),
        rows.stride(0),
        out.stride(0),
        out.stride(0) // 4,
        codes_bytes(hidden) // 4,
        HAS_INDEX=index is not None,
        E4M3_FMT=fmt is E4M3,
        FMT_MAX=fmt.max,
        POW2=pow2,
        SOFT=_interpreted(),
        GROUPS=groups,
        BLOCK_C=BLOCK,
        num_warps=warps,
    )
    return out


def unpack_triton(
    wire_rows: torch.Tensor, index: torch.Tensor | None, fmt: Fp8Format, dtype: torch.dtype, hidden: int
) -> torch.Tensor:
    """Decode ``wire_rows[index]`` and expand, in one pass (one program per output
    row and ``TUNING["unpack_groups"]`` blocks). Arguments and result as :func:`unpack_reference`."""
    if triton is None:
        raise RuntimeError("unpack_triton needs triton; use unpack_reference")
    wire_rows = wire_rows.contiguous()
    m = wire_rows.shape[0] if index is None else index.shape[0]
    out = torch.empty(m, hidden, dtype=dtype, device=wire_rows.device)
    if m == 0 or hidden == 0:
        return out
    groups, warps = _launch(hidden, "unpack")
    grid = (m, triton.cdiv(num_blocks(hidden), groups))
    _unpack_kernel[grid](
        wire_rows,
        wire_rows.view(torch.float32),
        wire_rows if index is None else index.contiguous(),
        out,
        hidden,
        num_blocks(hidden),
        wire_rows.stride(0),
        wire_rows.stride(0) // 4,
        codes_bytes(hidden) // 4,
        out.stride(0),
        HAS_INDEX=index is not None,
        E4M3_FMT=fmt is E4M3,
        OUT_MAX=_out_max(dtype),
        SOFT=_interpreted(),
        GROUPS=groups,
        BLOCK_C=BLOCK,
        num_warps=warps,
    )
    return out


def pack(
    rows: torch.Tensor, index: torch.Tensor | None, fmt: Fp8Format, pow2: bool, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Gather + encode: the Triton kernel on CUDA, the reference elsewhere.
    ``out``: [n, B] uint8 to write into (rows may be strided, e.g. a staging
    buffer), or None for a new tensor; returned."""
    if rows.is_cuda and triton is not None:
        return pack_triton(rows, index, fmt, pow2, out)
    packed = pack_reference(rows, index, fmt, pow2)
    return packed if out is None else out.copy_(packed)


def unpack(
    wire_rows: torch.Tensor, index: torch.Tensor | None, fmt: Fp8Format, dtype: torch.dtype, hidden: int
) -> torch.Tensor:
    """Decode + expand: the Triton kernel on CUDA, the reference elsewhere."""
    if wire_rows.is_cuda and triton is not None:
        return unpack_triton(wire_rows, index, fmt, dtype, hidden)
    return unpack_reference(wire_rows, index, fmt, dtype, hidden)
