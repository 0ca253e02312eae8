"""Does folding the expansion into the experts' GEMM pay? One GPU, the first GEMM of the experts.

The NVLink engine hands each rank's experts expert-major rows: every received
row written once per local expert of its token (the expansion). A grouped
GEMM that reads its rows through the place table (the received row of each
expert-major row) would never write that copy. Here, on the experts' first
GEMM (rows [N, H] times w_in [E_local, H, 2F]) of a model shape at EP W, with
uniform routing (each received row has its slots on this rank's experts):

* ``expand + torch._grouped_mm``: the expansion (``index_select`` of the
  received rows) then torch's grouped GEMM: what runs today, the expansion
  being the layout work;
* ``torch._grouped_mm`` on rows already expanded: today's GEMM alone;
* ``triton, expanded``: a grouped GEMM of ours in Triton on the expanded rows
  (how far a Triton grouped GEMM is from torch's, without any gather);
* ``triton, gathered``: the same kernel reading each row through the place
  table from the received rows (the fold).

Every output is held against torch's (the largest absolute difference: the
Triton kernel's tile sums do not follow cuBLAS's order). Times: CUDA events, median of
``--iters`` runs, each row in turn.

    python3 bench/gather_gemm_probe.py [--shape deepseek-v3] [--world 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's dispatch

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from dispatch.bench.common import SHAPES  # noqa: E402


@triton.jit
def _grouped_gemm(src, place, w, out, tile_expert, tile_row, tile_end, N, K, TILES,
                  stride_src, stride_we, stride_wk, stride_out, GATHER: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """out[r] = src[place[r] if GATHER else r] @ w[e] for the rows r of expert e;
    the m-tiles listed (expert, first row, the expert's end) times the n-tiles of N."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BN)
    m_tile, n_tile = pid // n_tiles, pid % n_tiles
    if m_tile >= TILES:
        return
    expert = tl.load(tile_expert + m_tile)
    row0 = tl.load(tile_row + m_tile)
    end = tl.load(tile_end + m_tile)
    rows = row0 + tl.arange(0, BM)
    live = rows < end
    if GATHER:
        src_rows = tl.load(place + rows, mask=live, other=0).to(tl.int64)
    else:
        src_rows = rows.to(tl.int64)
    cols = n_tile * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    a_ptr = src + src_rows[:, None] * stride_src + ks[None, :]
    b_ptr = w + expert.to(tl.int64) * stride_we + ks[:, None] * stride_wk + cols[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_ptr, mask=live[:, None], other=0.0)
        b = tl.load(b_ptr, mask=(cols[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptr += BK
        b_ptr += BK * stride_wk
    o_ptr = out + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(o_ptr, acc.to(out.dtype.element_ty), mask=live[:, None] & (cols[None, :] < N))


def _tiles(counts: list[int], bm: int, device) -> tuple[torch.Tensor, ...]:
    """(expert, first row, end row) of every m-tile of ``bm`` rows, expert by expert."""
    experts, rows, ends = [], [], []
    start = 0
    for e, n in enumerate(counts):
        for r in range(start, start + n, bm):
            experts.append(e)
            rows.append(r)
            ends.append(start + n)
        start += n
    return tuple(torch.tensor(v, dtype=torch.int32, device=device) for v in (experts, rows, ends))


def run_grouped(src, place, w, counts, bm, bn, bk, stages, warps, tiles):
    """[sum(counts), w's N]: each expert's rows (gathered through ``place`` from
    ``src`` where given, else ``src``'s own rows) times its weight, in tiles of
    (bm, bn, bk) (``tiles``: :func:`_tiles` of bm)."""
    total = sum(counts)
    out = torch.empty(total, w.shape[2], dtype=src.dtype, device=src.device)
    n_dim, k_dim = w.shape[2], w.shape[1]
    if k_dim % bk:  # (the kernel's loads along K are not masked)
        raise ValueError(f"bk={bk} must divide the contraction length {k_dim}")
    grid = (tiles[0].numel() * triton.cdiv(n_dim, bn),)
    _grouped_gemm[grid](src, place if place is not None else src, w, out, *tiles, n_dim, k_dim, tiles[0].numel(),
                              src.stride(0), w.stride(0), w.stride(1), out.stride(0), GATHER=place is not None,
                              BM=bm, BN=bn, BK=bk, num_stages=stages, num_warps=warps)
    return out



def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bench/gather_gemm_probe.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="deepseek-v3")
    parser.add_argument("--world", type=int, default=2, help="EP W whose rank's experts are timed")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    shape = SHAPES[args.shape]
    device = torch.device("cuda")
    torch.manual_seed(0)
    local = shape.experts // args.world
    # uniform routing from W ranks: each of W T tokens picks K of E experts; those on rank 0's experts come here
    tokens = args.world * shape.tokens
    idx = torch.rand(tokens, shape.experts, device=device).topk(shape.topk, dim=1).indices
    mine = idx < local
    received = mine.any(1).nonzero().squeeze(1)  # the rows this rank receives, one per token
    slot_row = torch.full((tokens,), -1, device=device, dtype=torch.int64)
    slot_row[received] = torch.arange(received.numel(), device=device)
    expert = torch.where(mine, idx, local)  # per slot: its local expert, or past them
    order = torch.argsort(expert.flatten() * tokens + torch.arange(tokens, device=device).repeat_interleave(
        shape.topk), stable=True)
    order = order[: int(mine.sum())]
    place = slot_row[order // shape.topk].to(torch.int32)  # each expert-major row's received row
    counts = torch.bincount(expert.flatten()[order], minlength=local).tolist()
    src = torch.randn(received.numel(), shape.hidden, device=device, dtype=torch.bfloat16)
    w_in = torch.randn(local, shape.hidden, 2 * shape.ffn, device=device, dtype=torch.bfloat16) / shape.hidden**0.5
    offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    expanded = src.index_select(0, place.long())
    want = torch._grouped_mm(expanded, w_in, offs=offs)
    print(f"{args.shape} at EP{args.world}: {src.shape[0]} received rows, {expanded.shape[0]} expert-major rows "
          f"over {local} experts (mean {expanded.shape[0] / local:.0f}), H={shape.hidden}, 2F={2 * shape.ffn}")
    configs = [(128, 128, 64, 4, 8), (128, 256, 64, 3, 8), (64, 256, 64, 4, 8), (128, 128, 128, 3, 8),
               (64, 128, 64, 5, 4), (128, 64, 64, 4, 4)]
    tiles_of = {bm: _tiles(counts, bm, device) for bm in {c[0] for c in configs}}

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(args.iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    rows = {
        "expand + torch._grouped_mm": lambda: torch._grouped_mm(src.index_select(0, place.long()), w_in, offs=offs),
        "expand (index_select) alone": lambda: src.index_select(0, place.long()),
        "torch._grouped_mm, expanded": lambda: torch._grouped_mm(expanded, w_in, offs=offs),
    }
    times = {name: timed(fn) for name, fn in rows.items()}
    best = {}
    for gather in (False, True):
        name = "triton, gathered" if gather else "triton, expanded"
        results = []
        for bm, bn, bk, stages, warps in configs:
            def fn(bm=bm, bn=bn, bk=bk, stages=stages, warps=warps, gather=gather):
                return run_grouped(src if gather else expanded, place if gather else None, w_in, counts, bm, bn, bk,
                                   stages, warps, tiles_of[bm])
            try:
                got = fn()
            except Exception as error:  # noqa: BLE001 - a configuration the GPU cannot take: reported, skipped
                print(f"  {name} {bm}x{bn}x{bk} s{stages} w{warps}: {type(error).__name__}: {str(error)[:80]}")
                continue
            diff = (got.float() - want.float()).abs().max().item()
            results.append((timed(fn), (bm, bn, bk, stages, warps), diff))
        print(f"  {name}: each configuration (BM, BN, BK, stages, warps), ms: "
              + ", ".join(f"{c}: {t:.3f}" for t, c, _ in sorted(results)))
        times[name], config, diff = min(results)
        best[name] = (config, diff)
    base = times["expand + torch._grouped_mm"]
    for name, ms in times.items():
        extra = f"  best {best[name][0]}, max abs diff to torch {best[name][1]:.3g}" if name in best else ""
        print(f"  {name:<30} {ms:8.3f} ms  {ms / base:5.2f}x today's{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
