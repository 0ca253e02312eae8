// Dispatch inside one host, pull shaped: every rank staged its rows (wire
// format) and routes in its own symmetric buffer and raised its flag; each
// receiver reads every row it needs over NVLink once and writes it, decoded, to
// each of its expert-major places.
#include "engine.cuh"

using namespace engine;

// Decode 8 wire elements starting at element u8 * 8 of a staged row.
template <typename WireT, int FP8> struct Wire {
  // FP8: 0 = a plain dtype, 1 = e4m3, 2 = e5m2 (codes, then fp32 scales per 128 channels)
  template <typename A>
  static __device__ __forceinline__ void load(const char* row, long long unit, long long scales_at, float out_max,
                                              A* out) {
    const Vec8<WireT> v = load8_cg(reinterpret_cast<const WireT*>(row) + unit * 8);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = widen<A>(v.v[i]);
  }
  static __device__ __forceinline__ Vec8<WireT> load8_cg(const WireT* p) {
    Vec8<WireT> out;
    constexpr int kWords = sizeof(Vec8<WireT>) / 16;
#pragma unroll
    for (int i = 0; i < kWords; ++i) reinterpret_cast<uint4*>(&out)[i] = __ldcg(reinterpret_cast<const uint4*>(p) + i);
    return out;
  }
};

template <int FP8> __device__ __forceinline__ float fp8_value(unsigned char code) {
  const __nv_fp8_interpretation_t kind = FP8 == 1 ? __NV_E4M3 : __NV_E5M2;
  const __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)code, kind);
  return __half2float(__half(h));
}

template <int FP8> struct Fp8Wire {
  template <typename A>
  static __device__ __forceinline__ void load(const char* row, long long unit, long long scales_at, float out_max,
                                              A* out) {
    const uint2 codes = __ldcg(reinterpret_cast<const uint2*>(row) + unit);
    const float scale = __ldcg(reinterpret_cast<const float*>(row + scales_at) + (unit * 8) / 128);
    const unsigned char* c = reinterpret_cast<const unsigned char*>(&codes);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float v = fp8_value<FP8>(c[i]);
      float d = v * scale;
      if (fabsf(v) < __int_as_float(0x7f800000)) d = fminf(fmaxf(d, -out_max), out_max);
      out[i] = (A)d;
    }
  }
};

template <typename WireT, int FP8> struct Codec { using type = Wire<WireT, 0>; };
template <typename WireT> struct Codec<WireT, 1> { using type = Fp8Wire<1>; };
template <typename WireT> struct Codec<WireT, 2> { using type = Fp8Wire<2>; };

// One element of a staged row (the rows whose H is not a multiple of 8).
template <typename WireT, int FP8, typename A>
__device__ __forceinline__ A load_one(const char* row, long long col, long long scales_at, float out_max) {
  if constexpr (FP8 == 0) {
    return widen<A>(reinterpret_cast<const WireT*>(row)[col]);
  } else {
    const float v = fp8_value<FP8>(reinterpret_cast<const unsigned char*>(row)[col]);
    float d = v * reinterpret_cast<const float*>(row + scales_at)[col / 128];
    if (fabsf(v) < __int_as_float(0x7f800000)) d = fminf(fmaxf(d, -out_max), out_max);
    return (A)d;
  }
}

// Rows [lo, hi) of out [max_rows, H] zeroed (with their weight 0 and sources -1
// where the dispatch writes them), spread over the grid.
template <bool WITH_META, typename OutT, typename WOutT>
__device__ void zero_rows(OutT* out, int hidden, long long lo, long long hi, WOutT* weights, long long* src_rank,
                          long long* src_token) {
  if (lo >= hi) return;
  const long long first = lo * hidden, last = hi * hidden;
  const long long threads = (long long)gridDim.x * blockDim.x;
  const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  constexpr long long kPer = 16 / sizeof(OutT);  // elements of a 16-byte word
  if ((hidden % kPer) == 0 && (reinterpret_cast<unsigned long long>(out) % 16) == 0) {
    uint4* words = reinterpret_cast<uint4*>(out + first);
    for (long long i = tid; i < (last - first) / kPer; i += threads) __stwb(words + i, make_uint4(0, 0, 0, 0));
  } else {
    for (long long i = first + tid; i < last; i += threads) out[i] = OutT(0.0f);
  }
  if constexpr (WITH_META) {
    for (long long r = lo + tid; r < hi; r += threads) {
      weights[r] = WOutT(0.0f);
      src_rank[r] = -1;
      src_token[r] = -1;
    }
  }
}

// Stage rows for the peers: rows [T] of row_bytes each (at src, src_stride bytes
// apart) into this rank's copy of a region of the next epoch (seq + 1; copy 0 at
// dst, copy_bytes apart; dst_stride bytes apart). With `signal`, the flags of
// that epoch are raised (and seq stored) once every block's rows are visible,
// marked failed where this rank's status is (signal_when_done). A rank that has
// failed copies nothing (as its pushes write nothing): its peers take nothing
// from it, and a peer still reading an earlier epoch of the region is not
// overtaken by a failed rank that no longer waits.
__global__ void __launch_bounds__(Tuning::kThreads) stage_rows(
    const char* src, long long src_stride, long long row_bytes, long long rows, unsigned long long dst,
    long long copy_bytes, long long dst_stride, unsigned* seq, int signal,
    const unsigned long long* flag_ptrs, int world, int me, int* counter, const int* status) {
  follow_previous();
  const unsigned epoch = load_seq(seq) + 1;
  char* base = reinterpret_cast<char*>(by_parity((long long)dst, copy_bytes, epoch));
  if (!failed(status))
    copy_rows(src, src_stride, row_bytes, rows, base, dst_stride,
              (long long)blockIdx.x * Tuning::kWarps + (threadIdx.x >> 5), (long long)gridDim.x * Tuning::kWarps);
  if (signal) signal_when_done(flag_ptrs, world, me, epoch, counter, seq, status);
}

// Receiver side of a dispatch. Items are (source rank s, j) for j in [0, n_s),
// n_s the tokens s sends this rank (column sends_col + me of the counts
// matrix); item (s, j) is s's token t = its list for this rank at j; one warp
// an item (the receivers walk only their own tokens, each at its own pace,
// whatever the order of the sources' tokens).
//   FROM_ROUTE: the tokens come from the sources' lists (lists region: copy 0 at
//     lists_off, lists_copy bytes apart, this rank's at me * list_stride ints),
//     the places from their routes (a dispatch with a plan): writes
//     tokens_at [W * tstride] (t of each item), presum/slot_k [W * tstride, J]
//     (this rank's expanded rows of each item in ascending local expert, -1
//     padded, and the slot of each), and per expanded row its weight, source
//     rank and source token.
//   else: the tokens come from tokens_at, the places from presum (a move along
//     an existing plan).
// A = the type the conversion goes through (float, or double for fp64 data).
// The operation's epoch is seq (raised by the kernel before). Rows of out past
// the N rows counted (*num_rows) up to max_rows are zeroed (and, FROM_ROUTE,
// their weight 0 and sources -1), so that a bounded output (max_rows) holds no
// stale values.
// A piece of a dispatch by groups writes only the places in [row_lo, row_hi)
// (one group's rows; the pieces run in order into one out): an item whose first
// place lies in an earlier piece is copied from there, locally, instead of
// crossing again. The whole dispatch is one piece [0, max_rows). The rows zeroed
// are [*num_rows, tail_to): for a piece of a dispatch by groups with a row
// budget, from the group's end (group_end) to its bound. A block whose wait for
// the peers fails (a timeout, or a peer that signalled the operation failed)
// zeroes its share of the rows the piece would have written, [row_lo,
// min(row_hi, *num_rows)), too: best effort (blocks past the wait before the
// failure was recorded still write theirs), the status saying it failed.
template <typename WireT, int FP8, typename OutT, typename A, bool FROM_ROUTE, typename WOutT>
__global__ void __launch_bounds__(Tuning::kThreads) pull_rows(
    const unsigned long long* data_ptrs, long long route_off, long long route_copy, long long stage_off,
    long long stage_copy, long long stage_row, long long scales_at, long long lists_off, long long lists_copy,
    long long list_stride, const int* matrix, int row_len, int sends_col, int* tokens_at, const int* src_start,
    const int* num_rows, int me, int world, int experts_per_rank, int topk, int width, int hidden, long long tstride,
    OutT* out, long long max_rows, int* presum, int* slot_k, WOutT* out_weights, long long* out_src_rank,
    long long* out_src_token, float out_max, long long row_lo, long long row_hi, long long tail_to,
    const unsigned* flags, const unsigned* seq, unsigned long long timeout_ns, int* status) {
  follow_previous();
  __shared__ int tokens_of[Tuning::kMaxWorld];
  __shared__ long long dest[Tuning::kWarps][Tuning::kMaxTopk];
  if (threadIdx.x < world) tokens_of[threadIdx.x] = matrix[threadIdx.x * row_len + sends_col + me];
  const unsigned epoch = load_seq(seq);
  route_off = by_parity(route_off, route_copy, epoch);
  stage_off = by_parity(stage_off, stage_copy, epoch);
  lists_off = by_parity(lists_off, lists_copy, epoch) + (long long)me * list_stride * 4;
  // the rows past N zeroed first: a dispatch whose counts exchange failed (N = 0) returns no stale rows either
  const long long n_rows = *num_rows;
  zero_rows<FROM_ROUTE>(out, hidden, n_rows, tail_to, out_weights, out_src_rank, out_src_token);
  if (!wait_peers(flags, world, epoch, timeout_ns, status, 1)) {  // failed here: the piece's rows zeroed, not stale
    const long long written_to = min(min(n_rows, row_hi), max_rows);
    zero_rows<FROM_ROUTE>(out, hidden, row_lo, written_to, out_weights, out_src_rank, out_src_token);
    return;
  }
  long long items = 0;
  for (int s = 0; s < world; ++s) items += tokens_of[s];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long warps = (long long)gridDim.x * Tuning::kWarps;
  using Load = typename Codec<WireT, FP8>::type;
  const Segments seg = split_rows(items, hidden, warps);
  const long long works = items * seg.count;
  auto listed = [&](long long work) {  // the token of a work's item, from its source's list
    int s, j;
    item_of(work / seg.count, tokens_of, world, &s, &j);
    return __ldcg(reinterpret_cast<const int*>(data_ptrs[s] + lists_off) + j);
  };
  long long work = (long long)blockIdx.x * Tuning::kWarps + warp;
  int next = FROM_ROUTE && work < works ? listed(work) : 0;  // one item ahead: its read in flight
  for (; work < works; work += warps) {
    const long long item = work / seg.count, part = work % seg.count;
    const bool first = part == 0;  // the segment that writes the item's plan and places
    int s, j;
    item_of(item, tokens_of, world, &s, &j);
    const long long at_item = (long long)s * tstride + j;
    int t;
    if constexpr (FROM_ROUTE) {
      t = next;
      if (work + warps < works) next = listed(work + warps);
      if (first && lane == 0) tokens_at[at_item] = t;
    } else {
      t = tokens_at[at_item];
    }
    const long long at = at_item * width;
    int count;
    if constexpr (FROM_ROUTE) {
      Slot slot = {-1, -1, 0, 0};
      if (lane < topk) {
        const int4 raw = __ldcg(reinterpret_cast<const int4*>(data_ptrs[s] + route_off) + (long long)t * topk + lane);
        slot = {raw.x, raw.y, raw.z, raw.w};
      }
      const int local = slot.expert - me * experts_per_rank;
      const bool here = slot.expert >= 0 && local >= 0 && local < experts_per_rank;
      if (first && here && slot.pos < 0) record(status, kBadRoute, s, 1);  // its row names the expert twice
      const bool mine = here && slot.pos >= 0;
      const unsigned mask = __ballot_sync(0xffffffffu, mine);
      count = __popc(mask);
      int order = 0;  // place among this item's slots here, by local expert
      for (int i = 0; i < topk; ++i) {
        const int other = __shfl_sync(0xffffffffu, local, i);
        if (((mask >> i) & 1u) && other < local) ++order;
      }
      if (mine && order < width) {
        const long long row = (long long)src_start[s * experts_per_rank + local] + slot.pos;
        dest[warp][order] = row;
        const bool placed = row >= 0 && row < max_rows;  // else a route no dispatch makes
        if (first && !placed) record(status, kTooManyRows, s, 1);
        if (first && placed && row >= row_lo && row < row_hi) {
          if constexpr (sizeof(WOutT) == 8) {
            const long long bits = ((long long)(unsigned)slot.w_lo) | ((long long)slot.w_hi << 32);
            out_weights[row] = (WOutT)__longlong_as_double(bits);
          } else {
            out_weights[row] = (WOutT)__int_as_float(slot.w_lo);
          }
          out_src_rank[row] = s;
          out_src_token[row] = t;
        }
        if (first) {
          presum[at + order] = (int)row;
          slot_k[at + order] = lane;
        }
      }
      count = min(count, width);
      if (first && lane >= count && lane < width) {
        presum[at + lane] = -1;
        slot_k[at + lane] = -1;
      }
    } else {
      const int row = lane < width ? presum[at + lane] : -1;
      const unsigned mask = __ballot_sync(0xffffffffu, row >= 0);
      count = __popc(mask);
      if (row >= 0) dest[warp][lane] = row;
    }
    __syncwarp();
    // the item's places in this piece (its places ascend: dest[0] is its first)
    const long long mine_row = lane < count ? dest[warp][lane] : -1;
    if (__ballot_sync(0xffffffffu, mine_row >= row_lo && mine_row < row_hi && mine_row < max_rows) == 0) {
      __syncwarp();  // dest is rewritten by the next item
      continue;
    }
    const long long first_row = dest[warp][0];
    const bool local = first_row >= 0 && first_row < row_lo;  // an earlier piece brought it: copy it here
    const OutT* copy = out + (local ? first_row : 0) * hidden;
    const char* src = reinterpret_cast<const char*>(data_ptrs[s] + stage_off + (long long)t * stage_row);
    if ((hidden & 7) == 0) {
      const long long begin = part * seg.units, units = min(hidden / 8LL, begin + seg.units);
      constexpr int kU = Tuning::kUnroll;  // units in flight per lane
      for (long long base = begin + lane; base < units; base += 32 * kU) {
        Vec8<OutT> o[kU];
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const long long unit = base + 32 * u;
          if (unit < units) {
            if (local) {
              o[u] = load8(copy + unit * 8);
            } else if constexpr (FP8 == 0 && same_type<WireT, OutT>) {  // the wire is the output: its bits
              o[u] = Wire<WireT, 0>::load8_cg(reinterpret_cast<const WireT*>(src) + unit * 8);
            } else {
              A v[8];
              Load::template load<A>(src, unit, scales_at, out_max, v);
#pragma unroll
              for (int i = 0; i < 8; ++i) o[u].v[i] = narrow<OutT>(v[i]);
            }
          }
        }
        for (int j = 0; j < count; ++j) {
          const long long row = dest[warp][j];
          if (row < row_lo || row >= row_hi || row >= max_rows) continue;
#pragma unroll
          for (int u = 0; u < kU; ++u) {
            const long long unit = base + 32 * u;
            if (unit < units) store8(out + row * hidden + unit * 8, o[u]);
          }
        }
      }
    } else {
      for (long long col = lane; col < hidden; col += 32) {
        const OutT o = local ? copy[col] : narrow<OutT>(load_one<WireT, FP8, A>(src, col, scales_at, out_max));
        for (int j = 0; j < count; ++j) {
          const long long row = dest[warp][j];
          if (row >= row_lo && row < row_hi && row < max_rows) out[row * hidden + col] = o;
        }
      }
    }
    __syncwarp();
  }
}
