// The NVSHMEM transport's exchanges (dispatch/kernels/nvshmem_puts.py). `put_rows`
// puts rows by the sender straight to their places at the receivers: rows picked
// by index (row send_token[i] of x: the counts row to every rank) or taken in
// order (send_token null: row i of x, rows made in send order: the slot lists,
// fp8 rows, per-slot values). Built with NVSHMEM's device library (nvcc -rdc,
// nvlink with the wheel's libnvshmem_device.a) into a cubin, initialised in the
// NVSHMEM instance torch's symmetric memory started.
//
// Rows go out destination-major (sends[d] rows to rank d, in the send order of
// send_token); rank d keeps them source-major, this rank's at row at[d] of its
// receive buffer. The caller brackets the launch with NVSHMEM's barrier: before,
// so that no receiver still reads its buffer; after, so that every row landed.
//
// The exchange and the experts' layout in one pass, each (token, rank) row over
// the link once (the NVLink engine's shape on NVSHMEM): `get_expand` fetches
// each row a rank receives from its source's staged send rows and writes it to
// its expert-major places; `presum_put` sums the expert outputs of each received
// row (its places, in order, weighted: as dispatch/kernels/gather_sum.py does,
// bitwise) and puts the sum to its home. A peer's memory is read or written
// straight where NVSHMEM maps it (nvshmem_ptr: inside a host), else by NVSHMEM's
// get and put through this rank's receive / send buffer (across hosts).

#include <nvshmem.h>
#include <nvshmemx.h>

#include "engine.cuh"

constexpr int kMaxWorld = 64;

extern "C" __global__ void put_rows(char* recv, unsigned long long recv_stride, const char* x,
                                    unsigned long long x_stride, const long long* send_token, const long long* sends,
                                    const long long* at, int world, unsigned long long row_bytes,
                                    unsigned long long most) {
  __shared__ long long first[kMaxWorld + 1];  // where each destination's rows start in the send order
  if (threadIdx.x == 0) {
    long long start = 0;
    for (int d = 0; d < world; ++d) {
      first[d] = start;
      start += sends[d];
    }
    first[world] = start;
  }
  __syncthreads();
  const unsigned long long rows = static_cast<unsigned long long>(first[world]) < most
                                      ? static_cast<unsigned long long>(first[world]) : most;
  const unsigned long long lanes = blockDim.x / 32;
  const unsigned long long warps = static_cast<unsigned long long>(gridDim.x) * lanes;
  for (unsigned long long i = blockIdx.x * lanes + threadIdx.x / 32; i < rows; i += warps) {
    int d = 0;
    while (d + 1 < world && static_cast<long long>(i) >= first[d + 1]) ++d;
    const unsigned long long place = static_cast<unsigned long long>(at[d] + static_cast<long long>(i) - first[d]);
    const unsigned long long row = send_token != nullptr ? static_cast<unsigned long long>(send_token[i]) : i;
    nvshmemx_putmem_nbi_warp(recv + place * recv_stride, x + row * x_stride, row_bytes, d);
  }
  nvshmem_quiet();
}

namespace {

// Where the rows received from each rank start (source-major): first[s], first[world] the sum.
__device__ __forceinline__ void starts(const long long* receives, int world, long long* first) {
  long long start = 0;
  for (int s = 0; s < world; ++s) {
    first[s] = start;
    start += receives[s];
  }
  first[world] = start;
}

constexpr int kThreads = 256;            // threads of a block (dispatch/kernels/nvshmem_puts.py launches so)
constexpr int kWarps = kThreads / 32;
constexpr int kCopyUnits = 4;            // 16-byte words in flight per lane, a row copied
constexpr int kSumRows = 4, kSumUnits = 2;  // rows and 8-element units in flight per lane, a row summed

// A warp copies row_bytes from src to each of count places (16-byte words where all are aligned;
// kCopyUnits of them in flight per lane).
__device__ __forceinline__ void copy_to_places(const char* src, char* const* dst, int count,
                                               unsigned long long row_bytes, int lane) {
  bool words = (row_bytes % 16) == 0 && (reinterpret_cast<unsigned long long>(src) % 16) == 0;
  for (int j = 0; j < count; ++j) words = words && (reinterpret_cast<unsigned long long>(dst[j]) % 16) == 0;
  if (words) {
    const uint4* from = reinterpret_cast<const uint4*>(src);
    const unsigned long long units = row_bytes / 16;
    for (unsigned long long base = lane; base < units; base += 32 * kCopyUnits) {
      uint4 v[kCopyUnits];
#pragma unroll
      for (int u = 0; u < kCopyUnits; ++u)
        if (base + 32 * u < units) v[u] = __ldcg(from + base + 32 * u);
      for (int j = 0; j < count; ++j) {
#pragma unroll
        for (int u = 0; u < kCopyUnits; ++u)
          if (base + 32 * u < units) reinterpret_cast<uint4*>(dst[j])[base + 32 * u] = v[u];
      }
    }
  } else {
    for (unsigned long long i = lane; i < row_bytes; i += 32) {
      const char v = src[i];
      for (int j = 0; j < count; ++j) dst[j][i] = v;
    }
  }
}

// One received row's sum over its count rows (rows[j], in order) of y, each times scale[j] where
// WEIGHTED (one fused multiply-add a term), in fp32 from zero, narrowed once into out (hidden
// elements): the engine's pre-sum (engine::presum_rows) where the rows are 16-byte words, else
// element by element.
template <bool WEIGHTED, typename Y, typename O>
__device__ __noinline__ void presum_row(const Y* const* rows, const float* scale, int count, int hidden, O* out, bool vec,
                           int lane) {
  if (vec) {
    engine::presum_rows<kSumRows, kSumUnits, WEIGHTED, float>(rows, scale, count, lane, hidden / 8, out);
  } else {
    for (int col = lane; col < hidden; col += 32) {
      float acc = 0.f;
      for (int j = 0; j < count; ++j) {
        const float value = engine::widen<float>(rows[j][col]);
        acc = WEIGHTED ? fmaf(value, scale[j], acc) : __fadd_rn(acc, value);
      }
      out[col] = engine::narrow<O>(acc);
    }
  }
}

template <typename Y>
__device__ void presum_row_to(int out_code, const Y* const* rows, const float* scale, bool weighted, int count,
                              int hidden, char* out, bool vec, int lane) {
#define DISPATCH_PRESUM(O)                                                                   \
  (weighted ? presum_row<true>(rows, scale, count, hidden, reinterpret_cast<O*>(out), vec, lane) \
            : presum_row<false>(rows, scale, count, hidden, reinterpret_cast<O*>(out), vec, lane))
  if (out_code == 0) DISPATCH_PRESUM(__nv_bfloat16);
  else if (out_code == 1) DISPATCH_PRESUM(__half);
  else DISPATCH_PRESUM(float);
#undef DISPATCH_PRESUM
}

}  // namespace

// Dispatch: for each row r this rank receives (source-major, receives[s] from rank s; at most
// most), written (row_bytes, the tokens' own dtype) to its expert-major places (places[r, :width],
// -1 padded) of out (rows out_stride bytes apart). Every rank staged the rows it sends in its send
// order (destination-major) in its symmetric stage (rows stage_stride bytes apart): row r, the
// (r - first[s])-th from rank s, is row back_at[s] + r - first[s] of rank s's stage (back_at[s]: the
// rows s sends the ranks before this one), read where NVSHMEM maps it, else got into row r of this
// rank's symmetric recv first (always, where mapped is 0: the way across hosts). Rows i of out whose
// expand_src[i] is zero_at (padding) are zeroed. By groups of local experts, one launch a group:
// only the rows whose first place is in [lo, hi) (written to all their places: each row crosses
// once, with the first group that needs it; a row of no place with the span that starts at 0) and
// the padding rows in [lo, hi). The caller brackets it with NVSHMEM's barrier (every stage written
// before; the peers read it until after).
extern "C" __global__ void __launch_bounds__(kThreads) get_expand(
    char* out, unsigned long long out_stride, const char* stage, unsigned long long stage_stride, char* recv,
    unsigned long long recv_stride, const long long* places, int width, const long long* receives,
    const long long* back_at, int world, unsigned long long row_bytes, unsigned long long most,
    const long long* expand_src, unsigned long long num_rows, long long zero_at, int mapped, long long lo,
    long long hi) {
  __shared__ long long first[kMaxWorld + 1];
  __shared__ char* dst[kWarps][32];
  if (threadIdx.x == 0) starts(receives, world, first);
  __syncthreads();
  const unsigned long long rows = static_cast<unsigned long long>(first[world]) < most
                                      ? static_cast<unsigned long long>(first[world]) : most;
  const int lane = threadIdx.x & 31, in_block = threadIdx.x >> 5;
  const unsigned long long warp = blockIdx.x * kWarps + in_block;
  const unsigned long long warps = static_cast<unsigned long long>(gridDim.x) * kWarps;
  for (unsigned long long r = warp; r < rows; r += warps) {
    int s = 0;
    while (s + 1 < world && static_cast<long long>(r) >= first[s + 1]) ++s;
    // the row's places (packed left, -1 after), one a lane
    const long long at = lane < width ? places[r * width + lane] : -1;
    const int count = __popc(__ballot_sync(0xffffffffu, at >= 0));
    const int earliest = __reduce_min_sync(0xffffffffu, at >= 0 ? static_cast<int>(at) : 0x7fffffff);
    if (count == 0 ? lo != 0 : (earliest < lo || earliest >= hi)) continue;  // another group's row (warp-uniform)
    if (at >= 0) dst[in_block][lane] = out + at * out_stride;
    __syncwarp();
    const char* staged =
        stage + static_cast<unsigned long long>(back_at[s] + static_cast<long long>(r) - first[s]) * stage_stride;
    const char* src = mapped ? static_cast<const char*>(nvshmem_ptr(staged, s)) : nullptr;
    if (src == nullptr) {  // not mapped here (another host): got into this rank's receive row r first
      char* landed = recv + r * recv_stride;
      nvshmemx_getmem_warp(landed, staged, row_bytes, s);
      src = landed;
    }
    copy_to_places(src, dst[in_block], count, row_bytes, lane);
    __syncwarp();  // dst is rewritten by the next row
  }
  const unsigned long long pad_end = hi < static_cast<long long>(num_rows) ? static_cast<unsigned long long>(hi) : num_rows;
  for (unsigned long long i = static_cast<unsigned long long>(lo) + warp; i < pad_end; i += warps) {  // padding: zeros
    if (expand_src[i] != zero_at) continue;
    char* row = out + i * out_stride;
    for (unsigned long long b = lane; b < row_bytes; b += 32) row[b] = 0;
  }
}

// Combine: for each row r this rank received in the dispatch (as in get_expand), the sum of its
// places' rows of y (y_code 0 bf16, 1 fp16, 2 fp32; rows y_stride elements apart; weights fp32 or
// null), narrowed once to the wire (out_code, coded as y_code), put to its home rank s at row
// back_at[s] + r - first[s] of its symmetric recv (rows recv_stride bytes apart): stored where
// NVSHMEM maps it (and mapped is 1), else made in row r of this rank's symmetric send and put.
// By groups of local experts, one launch a group: the rows are in a tensor a group (table, not
// null: [G] their addresses, [G] their weights' addresses, then [G + 1] the places each group starts
// at, then whether the rows are weighted; y and weights unused; an empty group's addresses may be 0,
// no place reads them), and only the rows whose last place is in [lo, hi) are
// summed and put (each once every group it needs is in; a row of no place with the span that
// starts at 0). The caller brackets it with NVSHMEM's barrier.
extern "C" __global__ void __launch_bounds__(kThreads) presum_put(
    char* recv, unsigned long long recv_stride, char* send, unsigned long long send_stride, const char* y,
    unsigned long long y_stride, int y_code, const float* weights, const long long* places, int width,
    const long long* receives, const long long* back_at, int world, int hidden, int out_code,
    unsigned long long most, int mapped, const long long* table, int groups, long long lo, long long hi) {
  __shared__ long long first[kMaxWorld + 1];
  __shared__ const char* rows[kWarps][32];
  __shared__ float scale[kWarps][32];
  if (threadIdx.x == 0) starts(receives, world, first);
  __syncthreads();
  const unsigned long long count_rows = static_cast<unsigned long long>(first[world]) < most
                                            ? static_cast<unsigned long long>(first[world]) : most;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned long long warps = static_cast<unsigned long long>(gridDim.x) * kWarps;
  const int y_size = y_code == 2 ? 4 : 2;
  const bool weighted = table != nullptr ? table[3 * groups + 1] != 0 : weights != nullptr;
  const unsigned long long out_bytes = static_cast<unsigned long long>(hidden) * (out_code == 2 ? 4 : 2);
  for (unsigned long long r = blockIdx.x * kWarps + warp; r < count_rows; r += warps) {
    int s = 0;
    while (s + 1 < world && static_cast<long long>(r) >= first[s + 1]) ++s;
    char* home = recv + static_cast<unsigned long long>(back_at[s] + static_cast<long long>(r) - first[s]) * recv_stride;
    char* direct = mapped ? static_cast<char*>(nvshmem_ptr(home, s)) : nullptr;
    char* out = direct != nullptr ? direct : send + r * send_stride;
    // the row's places (packed left, -1 after), one a lane
    const long long at = lane < width ? places[r * width + lane] : -1;
    const int count = __popc(__ballot_sync(0xffffffffu, at >= 0));
    const int latest = __reduce_max_sync(0xffffffffu, at >= 0 ? static_cast<int>(at) : -1);
    if (count == 0 ? lo != 0 : (latest < lo || latest >= hi)) continue;  // another group's row (warp-uniform)
    const char* row = nullptr;
    if (at >= 0) {
      const char* base = y;
      const float* weigh = weights;
      long long off = at;
      if (table != nullptr) {  // the group of the place, its rows and weights
        int g = 0;
        while (g + 1 < groups && at >= table[2 * groups + g + 1]) ++g;
        base = reinterpret_cast<const char*>(table[g]);
        weigh = reinterpret_cast<const float*>(table[groups + g]);
        off = at - table[2 * groups + g];
      }
      row = base + static_cast<unsigned long long>(off) * y_stride * y_size;
      rows[warp][lane] = row;
      scale[warp][lane] = weigh != nullptr ? weigh[off] : 1.f;
    }
    __syncwarp();
    const bool vec = (hidden % 8) == 0 && (y_stride % 8) == 0 &&
                     __all_sync(0xffffffffu, (reinterpret_cast<unsigned long long>(row) % 16) == 0) &&
                     (reinterpret_cast<unsigned long long>(out) % 16) == 0;
    if (y_code == 0) {
      presum_row_to(out_code, reinterpret_cast<const __nv_bfloat16* const*>(rows[warp]), scale[warp], weighted,
                    count, hidden, out, vec, lane);
    } else if (y_code == 1) {
      presum_row_to(out_code, reinterpret_cast<const __half* const*>(rows[warp]), scale[warp], weighted, count,
                    hidden, out, vec, lane);
    } else {
      presum_row_to(out_code, reinterpret_cast<const float* const*>(rows[warp]), scale[warp], weighted, count,
                    hidden, out, vec, lane);
    }
    if (direct == nullptr) {
      __threadfence();  // the row made, visible to whatever NVSHMEM reads it with
      __syncwarp();
      nvshmemx_putmem_nbi_warp(home, out, out_bytes, s);
    }
    __syncwarp();  // rows[warp] is rewritten by the next row
  }
  nvshmem_quiet();
}
