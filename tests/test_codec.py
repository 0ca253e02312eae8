"""Wire codecs on their own: round-trip error bounds, zeros, non-finite values, layout."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dispatch
from dispatch.codec import BlockFp8Codec, CastCodec, sum_wire_dtype, to_experts_codec
from dispatch.kernels import quantize

DATA_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
FP8_WIRES = {"fp8": quantize.E4M3, "e5m2": quantize.E5M2}


def _rows(seed: int, count: int, hidden: int, log_spread: float) -> torch.Tensor:
    """[count, hidden] fp64 rows whose magnitudes span 10^+-log_spread, with exact zeros."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(count, hidden, generator=gen, dtype=torch.float64)
    rows *= 10 ** ((torch.rand(count, hidden, generator=gen, dtype=torch.float64) * 2 - 1) * log_spread)
    rows[torch.rand(count, hidden, generator=gen) < 0.1] = 0.0
    return rows


def fp8_error_bound(x: torch.Tensor, scales: torch.Tensor, fmt: quantize.Fp8Format, out_dtype) -> torch.Tensor:
    """Per-element bound of |decode(encode(x)) - x| for fp32 values x [n, H] and their
    block scales [n, G]: half a step of the format (relative, or the subnormal step
    times the scale), the fp32 scaling roundings, and one rounding to ``out_dtype``
    (relative, or half its subnormal step)."""
    m = fmt.mantissa_bits
    scale = scales.double().repeat_interleave(quantize.BLOCK, dim=1)[:, : x.shape[1]]
    half_step = torch.maximum(2.0 ** -(m + 1) * x.abs(), scale * 2.0 ** (fmt.min_exponent - m - 1))
    fp32_slack = 4 * 2.0**-24 * (x.abs() + scale * fmt.max * 2.0**-24)
    out_eps = torch.finfo(out_dtype).eps / 2 if out_dtype != torch.float64 else 0.0
    # a result in out_dtype's subnormal range rounds to its fixed step: half of it, absolute
    info = torch.finfo(out_dtype)
    out_tiny = info.smallest_normal * info.eps / 2 if out_dtype != torch.float64 else 0.0
    return half_step * (1 + 2.0**-20) + fp32_slack + out_eps * (x.abs() * (1 + 2.0 ** -m)) + out_tiny


@settings(max_examples=80, deadline=None)
@given(
    wire=st.sampled_from(sorted(FP8_WIRES)),
    pow2=st.booleans(),
    hidden=st.sampled_from([1, 5, 127, 128, 129, 300]),
    count=st.integers(0, 6),
    data_dtype=st.sampled_from(DATA_DTYPES),
    log_spread=st.sampled_from([0.0, 3.0, 30.0]),
    seed=st.integers(0, 10**6),
)
def test_fp8_round_trip_within_mantissa_bound(wire, pow2, hidden, count, data_dtype, log_spread, seed):
    fmt = FP8_WIRES[wire]
    top = min(torch.finfo(data_dtype).max, torch.finfo(torch.float32).max)  # finite in the codec's fp32
    x = _rows(seed, count, hidden, log_spread).clamp(-top, top).to(data_dtype)
    codec = to_experts_codec(wire, data_dtype, pow2_scales=pow2)
    packed = codec.pack(x)
    assert packed.dtype == torch.uint8 and packed.shape == (count, codec.row_bytes(hidden))
    back = codec.unpack(packed, data_dtype, hidden)
    assert back.dtype == data_dtype and back.shape == x.shape
    exact = x.to(torch.float32).double()  # the codec works in fp32
    _, scales = quantize.split_packed(packed, hidden)
    err = (back.double() - exact).abs()
    assert torch.isfinite(back).all(), "a finite input decoded to a non-finite value"
    assert not (err > fp8_error_bound(exact, scales, fmt, data_dtype)).any()
    # relative to the block's amax: at most half a step of the largest binade
    blocks = quantize._blocks(exact.float(), hidden).abs().amax(2).double()
    amax = blocks.repeat_interleave(quantize.BLOCK, dim=1)[:, :hidden]
    out_eps = torch.finfo(data_dtype).eps if data_dtype != torch.float64 else 0.0
    assert not (err > amax * (2.0 ** -(fmt.mantissa_bits + 1) + 2.0**-20 + out_eps)).any()
    assert torch.equal(back[x == 0], x[x == 0]), "a zero did not stay exactly zero"
    if pow2:
        mantissa = scales.view(torch.int32) & 0x007FFFFF
        assert (mantissa == 0).all(), "scales are not powers of two"


@pytest.mark.parametrize("wire", sorted(FP8_WIRES))
@pytest.mark.parametrize("pow2", [False, True])
def test_scales_follow_block_amax(wire, pow2):
    """scale = amax / FMT_MAX (or the power of two above it); short last block; zero blocks."""
    fmt = FP8_WIRES[wire]
    hidden = 300  # blocks of 128, 128, 44
    x = torch.zeros(2, hidden)
    x[0, 3] = -5.0
    x[0, 200] = 7.0
    x[0, 299] = 0.25  # only value of the short block
    packed = to_experts_codec(wire, torch.float32, pow2).pack(x)
    _, scales = quantize.split_packed(packed, hidden)
    want = torch.tensor([[5.0, 7.0, 0.25], [0.0, 0.0, 0.0]]) / fmt.max
    if pow2:
        want = 2.0 ** torch.ceil(torch.log2(want))
    want[1] = 1.0  # all-zero blocks
    assert torch.equal(scales, want)
    assert quantize.codes_bytes(hidden) == 300 and packed.shape[1] == 300 + 3 * 4


@pytest.mark.parametrize("wire", sorted(FP8_WIRES))
def test_huge_and_tiny_magnitudes_invent_nothing(wire):
    x = torch.zeros(4, 130)
    x[0] = 3.0e38  # near fp32's max
    x[1] = 1.0e-44  # fp32 subnormals: below the scale floor
    x[2, :128] = 1.0e-30
    x[2, 128:] = 1.0e30  # one block tiny, the next huge
    x[3, 5] = -1.0e-45
    codec = to_experts_codec(wire, torch.float32)
    back = codec.unpack(codec.pack(x), torch.float32, 130)
    assert torch.isfinite(back).all()
    assert torch.equal(back[x == 0], x[x == 0])
    fmt = FP8_WIRES[wire]
    for row in (0, 2):
        rel = ((back[row].double() - x[row].double()).abs() / x[row].double().abs())
        assert (rel <= 2.0 ** -(fmt.mantissa_bits + 1) + 1e-6).all()
    assert (back[1] - x[1]).abs().max() <= 2.0**-126  # absolute error below the scale floor
    assert back[3, 5] <= 0 and (back[3, 5] - x[3, 5]).abs() <= 2.0**-126


@pytest.mark.parametrize("wire", sorted(FP8_WIRES))
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_largest_values_of_the_data_dtype_stay_finite(wire, pow2, dtype):
    """Rounding up near the dtype's largest value must not decode to an infinity."""
    top = torch.finfo(dtype).max if dtype != torch.float32 else torch.finfo(torch.float32).max
    x = torch.tensor([[top, -top, top * 0.999, 1.0]]).to(dtype)
    codec = to_experts_codec(wire, dtype, pow2)
    back = codec.unpack(codec.pack(x), dtype, 4)
    assert torch.isfinite(back).all()
    assert (back[0, :2].abs() == top).all()


@pytest.mark.parametrize("wire", sorted(FP8_WIRES))
def test_non_finite_values_are_carried_through(wire):
    """A NaN/inf decodes to NaN (e4m3) or itself (e5m2); the rest of its block is untouched."""
    x = torch.linspace(-3, 3, 256).view(2, 128).clone()
    clean = to_experts_codec(wire, torch.float32)
    reference = clean.unpack(clean.pack(x), torch.float32, 128)
    x[0, 7] = float("nan")
    x[0, 9] = float("inf")
    x[1, 4] = float("-inf")
    back = clean.unpack(clean.pack(x), torch.float32, 128)
    assert back[0, 7].isnan()
    if wire == "e5m2":
        assert back[0, 9] == float("inf") and back[1, 4] == float("-inf")
    else:
        assert back[0, 9].isnan() and back[1, 4].isnan()
    keep = torch.isfinite(x)
    assert torch.equal(back[keep], reference[keep]), "a non-finite value changed its neighbours"


def test_packed_layout_is_documented_bytes():
    """Codes at byte 0, scales at codes_bytes(H) as native fp32: decodable by hand."""
    x = torch.tensor([[1.0, -2.0, 0.5, 448.0 * 3, 0.0]])
    codec = to_experts_codec("fp8", torch.float32)
    packed = codec.pack(x)
    assert packed.shape == (1, 8 + 4)
    scale = packed[0, 8:12].view(torch.float32)
    assert scale.item() == 3.0
    by_hand = packed[0, :5].view(torch.float8_e4m3fn).float() * scale
    assert torch.equal(by_hand, codec.unpack(packed, torch.float32, 5)[0])
    assert by_hand[3] == 1344.0 and by_hand[4] == 0.0 and by_hand[1] < 0
    assert torch.equal(packed[0, 5:8], torch.zeros(3, dtype=torch.uint8))  # padding is zero


@settings(max_examples=40, deadline=None)
@given(data_dtype=st.sampled_from(DATA_DTYPES), seed=st.integers(0, 10**6), hidden=st.sampled_from([1, 9, 130]))
def test_bf16_round_trip_within_mantissa_bound(data_dtype, seed, hidden):
    x = _rows(seed, 4, hidden, 3.0).to(data_dtype)
    codec = to_experts_codec("bf16", data_dtype)
    back = codec.unpack(codec.pack(x), data_dtype, hidden)
    err = (back.double() - x.double()).abs()
    out_eps = torch.finfo(data_dtype).eps / 2 if data_dtype != torch.float64 else 0.0
    assert not (err > x.double().abs() * (2.0**-8 + out_eps * 1.01)).any()
    assert torch.equal(back[x == 0], x[x == 0])


def test_codec_choice_and_row_bytes():
    assert isinstance(to_experts_codec("native", torch.bfloat16), CastCodec)
    fp8 = to_experts_codec("fp8", torch.bfloat16)
    assert isinstance(fp8, BlockFp8Codec) and fp8.fmt is quantize.E4M3
    assert to_experts_codec("e5m2", torch.float32).fmt is quantize.E5M2
    assert fp8.row_bytes(7168) == 7168 + 56 * 4
    bf16 = to_experts_codec("bf16", torch.float32)
    assert fp8.row_bytes(7168) / bf16.row_bytes(7168) <= 0.52
    with pytest.raises(ValueError, match="unknown wire format"):
        to_experts_codec("fp4", torch.float32)
    with pytest.raises(ValueError, match="partial sums"):
        sum_wire_dtype("fp8", torch.float32)
    with pytest.raises(ValueError, match="wire_rows"):
        fp8.unpack(torch.zeros(2, 5, dtype=torch.uint8), torch.float32, 7168)


@pytest.mark.parametrize("wire", ["native", "bf16", "fp32", "fp8", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_into_a_buffer_is_pack(wire, dtype):
    """``pack(rows, index, out)`` writes into ``out`` (an exchange's send buffer)
    the bits ``pack(rows, index)`` returns, in the dtype and width ``wire_row``
    states."""
    gen = torch.Generator().manual_seed(3)
    rows = (torch.randn(9, 130, generator=gen) * 100).to(dtype)
    index = torch.tensor([4, 0, 8, 8, 2], dtype=torch.int64)
    codec = to_experts_codec(wire, dtype)
    want = codec.pack(rows, index)
    wire_dtype, width = codec.wire_row(dtype, rows.shape[1])
    assert (want.dtype, want.shape[1], want.shape[1] * want.element_size()) == (wire_dtype, width,
                                                                                codec.row_bytes(130))
    out = torch.full((5, width), 7, dtype=wire_dtype)
    assert codec.pack(rows, index, out) is out
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize(
    "field, value",
    [("dispatch_wire", "e5m2"), ("combine_wire", "fp8"), ("dispatch_grad_wire", "fp8"), ("combine_grad_wire", "fp4")],
)
def test_config_refuses_wires_a_direction_cannot_take(field, value):
    with pytest.raises(ValueError, match=field):
        dispatch.DispatchConfig.from_options(num_experts=4, **{field: value})


def test_config_accepts_fp8_directions():
    cfg = dispatch.DispatchConfig.from_options(num_experts=4, dispatch_wire="fp8", combine_grad_wire="e5m2", fp8_pow2_scales=True)
    assert cfg.tuning.fp8_pow2_scales
    dispatch.DispatchConfig.from_options(num_experts=4, combine_grad_wire="fp8")
    with pytest.raises(TypeError, match="fp8_pow2_scales"):
        dispatch.DispatchConfig.from_options(num_experts=4, fp8_pow2_scales=1)
