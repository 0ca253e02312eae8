"""The fp8 pack / unpack Triton kernels held against their PyTorch references
(interpreter on CPU, real kernels on GPU). Sizes stay tiny: the interpreter is slow."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dispatch.kernels import quantize as qz

pytestmark = pytest.mark.skipif(qz.triton is None, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = {"e4m3": qz.E4M3, "e5m2": qz.E5M2}


def _source(seed, rows, hidden, dtype, specials):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen, dtype=torch.float64)
    x *= 10 ** (torch.randint(-6, 7, (rows, 1), generator=gen).double())
    x[torch.rand(rows, hidden, generator=gen) < 0.15] = 0.0
    if rows:
        x[0, : min(hidden, 3)] = 0.0
    if specials and rows * hidden > 4:
        flat = x.view(-1)
        flat[1] = float("nan")
        flat[-1] = float("inf")
        flat[-2] = float("-inf")
        flat[2] = 1e-42
    return x.to(dtype).to(DEVICE)


def _same_codes(a: torch.Tensor, b: torch.Tensor, fmt) -> bool:
    """Equal code bytes, where NaN codes may differ in their sign bit."""
    nan_a = a.view(fmt.dtype).float().isnan()
    nan_b = b.view(fmt.dtype).float().isnan()
    return torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b])


@settings(max_examples=40, deadline=None)
@given(
    fmt=st.sampled_from(sorted(FORMATS)),
    pow2=st.booleans(),
    rows=st.integers(0, 5),
    hidden=st.sampled_from([1, 6, 128, 131, 260]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
    indexed=st.booleans(),
    specials=st.booleans(),
    seed=st.integers(0, 10**6),
)
def test_pack_matches_reference(fmt, pow2, rows, hidden, dtype, indexed, specials, seed):
    fmt = FORMATS[fmt]
    x = _source(seed, rows, hidden, dtype, specials)
    index = None
    if indexed:
        gen = torch.Generator().manual_seed(seed + 1)
        index = torch.randint(0, max(rows, 1), (rows + 2,), generator=gen).to(DEVICE) if rows else torch.zeros(0, dtype=torch.int64, device=DEVICE)
    want = qz.pack_reference(x, index, fmt, pow2)
    got = qz.pack_triton(x, index, fmt, pow2)
    assert got.shape == want.shape and got.dtype == torch.uint8
    codes_want, scales_want = qz.split_packed(want, hidden)
    codes_got, scales_got = qz.split_packed(got, hidden)
    assert torch.equal(scales_got, scales_want), "scales differ"
    assert _same_codes(codes_got, codes_want, fmt), "codes differ"
    assert torch.equal(got[:, hidden : qz.codes_bytes(hidden)], want[:, hidden : qz.codes_bytes(hidden)])


@settings(max_examples=40, deadline=None)
@given(
    fmt=st.sampled_from(sorted(FORMATS)),
    rows=st.integers(0, 5),
    hidden=st.sampled_from([1, 6, 128, 131, 260]),
    out_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
    specials=st.booleans(),
    seed=st.integers(0, 10**6),
)
@example(fmt="e5m2", rows=5, hidden=1, out_dtype=torch.bfloat16, specials=True, seed=0)  # an fp32 subnormal
def test_unpack_matches_reference(fmt, rows, hidden, out_dtype, specials, seed):
    fmt = FORMATS[fmt]
    packed = qz.pack_reference(_source(seed, rows, hidden, torch.float32, specials), None, fmt, False)
    gen = torch.Generator().manual_seed(seed + 2)
    index = torch.randint(0, max(rows, 1), (2 * rows,), generator=gen).to(DEVICE) if rows else None
    want = qz.unpack_reference(packed, index, fmt, out_dtype, hidden)
    got = qz.unpack_triton(packed, index, fmt, out_dtype, hidden)
    assert got.dtype == out_dtype and got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan())
    finite = ~want.isnan()
    if out_dtype in (torch.float32, torch.float64):
        assert torch.equal(got[finite], want[finite])
    else:
        # Triton's interpreter truncates fp32 -> bf16/fp16 where torch rounds: one unit apart at
        # most; and it converts fp32 subnormals (an e5m2 code times a tiny scale) to the
        # smallest normal of the output where torch rounds them to zero: below that, either.
        diff = (got[finite].double() - want[finite].double()).abs()
        bound = torch.finfo(out_dtype).eps * want[finite].double().abs() + torch.finfo(out_dtype).tiny
        assert not (diff > bound).any()
        if DEVICE == "cuda":
            assert torch.equal(got[finite], want[finite])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_code_decodes_like_torch(fmt):
    """All 256 codes with scale 1 (one row of 256 channels = two blocks)."""
    fmt = FORMATS[fmt]
    row = torch.zeros(1, qz.row_bytes(256), dtype=torch.uint8)
    row[0, :256] = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    row.view(torch.float32)[0, 64:] = 1.0
    row = row.to(DEVICE)
    want = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt.dtype).float().unsqueeze(0)
    got = qz.unpack_triton(row, None, fmt, torch.float32, 256).cpu()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~got.isnan()], want[~want.isnan()])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_rounding_ties_go_to_even(fmt):
    """Values exactly between two codes (scale 1: the block's amax is the format's max)."""
    fmt = FORMATS[fmt]
    m = fmt.mantissa_bits
    step = 2.0**-m
    ties = [1 + step / 2, 1 + 3 * step / 2, 2 ** (fmt.min_exponent - m - 1), 3 * 2 ** (fmt.min_exponent - m - 1)]
    x = torch.tensor([[fmt.max, *ties, *[-t for t in ties]]], device=DEVICE)
    want = qz.pack_reference(x, None, fmt, False)
    got = qz.pack_triton(x, None, fmt, False)
    assert torch.equal(got, want)
    decoded = qz.unpack_reference(got, None, fmt, torch.float32, x.shape[1]).cpu()[0, 1:5]
    assert decoded.tolist() == [1.0, 1 + 2 * step, 0.0, 2 ** (fmt.min_exponent - m + 1)]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_non_finite_values_are_carried(fmt):
    """+-inf and NaN among finite values (the GPU's satfinite conversion turns +-inf into +-max)."""
    fmt = FORMATS[fmt]
    x = torch.tensor([[0.0, float("nan"), 6e-3, float("-inf"), float("inf"), -3.0, fmt.max * 4]], device=DEVICE)
    want = qz.pack_reference(x, None, fmt, False)
    got = qz.pack_triton(x, None, fmt, False)
    codes_want, scales_want = qz.split_packed(want, x.shape[1])
    codes_got, scales_got = qz.split_packed(got, x.shape[1])
    assert torch.equal(scales_got, scales_want)
    assert _same_codes(codes_got, codes_want, fmt)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_scales_are_correctly_rounded_quotients(fmt):
    """scale = fp32(amax / FMT_MAX), not amax * fp32(1 / FMT_MAX) (torch's CUDA ``a / number``)."""
    fmt = FORMATS[fmt]
    gen = torch.Generator().manual_seed(0)
    x = (torch.rand(32, 1, generator=gen) * 10).to(DEVICE)
    want = (x.cpu().double() / fmt.max).float()
    for packed in (qz.pack_reference(x, None, fmt, False), qz.pack_triton(x, None, fmt, False)):
        assert torch.equal(qz.split_packed(packed, 1)[1].cpu(), want)
