// Combine inside one host: the expert side pre-sums each (source rank, token)'s
// rows in fp32 (fp64 for fp64) as it reads them and pushes the partial into the
// home rank's symmetric buffer; the home rank sums its partials in ascending
// rank order and casts once. The routing-weight gradients go home the same way.
#include "engine.cuh"

using namespace engine;

// Expert side. Items are (source rank s, j) as the dispatch's pull walked them
// (j < n_s, column sends_col + me of the counts matrix), item (s, j) s's token
// tokens_at[s tstride + j]; presum [W * tstride, J] lists this rank's rows of
// each item (ascending local expert, -1 padded). The partial
// of item (s, t) goes to rank s's buffer at [me, t] of its partials region
// ([W, tcap] rows of part_row bytes; copy 0 at part_off, part_copy bytes apart)
// of the operation's epoch, seq + 1, raised (and stored in seq) at the end
// (with `signal`).
// A piece of a combine by groups pushes the items whose last row lies in
// [row_lo, row_hi) (the items that group completes), reading each row from its
// group's rows: with parts > 0, rows [bounds[p], bounds[p + 1]) are those of
// y_parts[p] (and their weights w_parts[p]); only the last piece signals. Each
// partial is summed whole, from zero, in one piece: the bits of one combine.
// The whole combine is one piece (parts 0: rows of y and weights, every item).
// A: accumulator (float or double). ROWS: rows a lane loads together, 1 (kUnroll
// units of each row) or, where an item has more than 2 rows here (J > 2),
// kSumRows (kSumUnits units of each); one body per instantiation (both bodies
// in one kernel spill registers).
template <typename YT, typename WT, bool WEIGHTED, typename WireT, typename A, int ROWS>
__global__ void __launch_bounds__(Tuning::kThreads) push_partials(
    const YT* y, const WT* weights, const long long* y_parts, const long long* w_parts, const long long* bounds,
    int parts, long long row_lo, long long row_hi, const int* presum, const int* tokens_at, int width,
    long long tstride, const int* matrix, int row_len, int sends_col, int hidden, const unsigned long long* data_ptrs,
    long long part_off, long long part_copy, long long part_row, long long tcap, int me, int world,
    const unsigned long long* flag_ptrs, unsigned* seq, int* counter, const int* status, int signal) {
  follow_previous();
  __shared__ int tokens_of[Tuning::kMaxWorld];
  __shared__ const YT* rows[Tuning::kWarps][Tuning::kMaxTopk];
  __shared__ A scale[Tuning::kWarps][Tuning::kMaxTopk];
  if (threadIdx.x < world) tokens_of[threadIdx.x] = matrix[threadIdx.x * row_len + sends_col + me];
  const unsigned epoch = load_seq(seq) + 1;
  part_off = by_parity(part_off, part_copy, epoch);
  __syncthreads();
  const bool ok = !failed(status);
  long long items = 0;
  for (int s = 0; s < world; ++s) items += tokens_of[s];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long warps = (long long)gridDim.x * Tuning::kWarps;
  const Segments seg = split_rows(items, hidden, warps);
  for (long long work = (long long)blockIdx.x * Tuning::kWarps + warp; ok && work < items * seg.count;
       work += warps) {
    const long long item = work / seg.count, part = work % seg.count;
    int s, j;
    item_of(item, tokens_of, world, &s, &j);
    const int t = tokens_at[(long long)s * tstride + j];
    const long long at = ((long long)s * tstride + j) * width;
    const int row = lane < width ? presum[at + lane] : -1;
    const int count = __popc(__ballot_sync(0xffffffffu, row >= 0));
    const int last = __shfl_sync(0xffffffffu, row, max(count - 1, 0));  // rows ascend in the list
    const bool mine = count > 0 && last >= row_lo && last < row_hi;
    if (mine && row >= 0) {
      const YT* from = y;
      const WT* w = weights;
      long long r = row;
      if (parts > 0) {  // the group holding the row: the last p with bounds[p] <= row
        int lo = 0, hi = parts - 1;
        while (lo < hi) {
          const int mid = (lo + hi + 1) / 2;
          if (bounds[mid] <= row) lo = mid;
          else hi = mid - 1;
        }
        from = reinterpret_cast<const YT*>(y_parts[lo]);
        if constexpr (WEIGHTED) w = reinterpret_cast<const WT*>(w_parts[lo]);
        r = row - bounds[lo];
      }
      rows[warp][lane] = from + r * hidden;
      if constexpr (WEIGHTED) scale[warp][lane] = widen<A>(w[r]);
    }
    __syncwarp();
    if (mine) {
      char* dst = reinterpret_cast<char*>(data_ptrs[s] + part_off + ((long long)me * tcap + t) * part_row);
      if ((hidden & 7) == 0) {
        const long long begin = part * seg.units, units = min(hidden / 8LL, begin + seg.units);
        WireT* out = reinterpret_cast<WireT*>(dst);
        presum_rows<ROWS, ROWS == 1 ? Tuning::kUnroll : Tuning::kSumUnits, WEIGHTED, A>(rows[warp], scale[warp],
                                                                                     count, begin + lane, units, out);
      } else {
        for (long long col = lane; col < hidden; col += 32) {
          A acc = (A)0;
          for (int j = 0; j < count; ++j) {
            const A v = widen<A>(rows[warp][j][col]);
            if constexpr (WEIGHTED) acc = fma(v, scale[warp][j], acc);
            else acc += v;
          }
          reinterpret_cast<WireT*>(dst)[col] = narrow<WireT>(acc);
        }
      }
    }
    __syncwarp();
  }
  if (signal) {
    signal_when_done(flag_ptrs, world, me, epoch, counter, seq, status);
  } else {  // a group before the last: its writes visible before the last group's raise
    __syncthreads();
    if (threadIdx.x == 0) __threadfence_system();
  }
}

// Home side: out [T, H] = for each token, the sum in ascending rank order of the
// partials of the ranks in hit[t] (zero for a token that went nowhere), cast once.
// The operation's epoch is seq (raised by push_partials); partials: copy 0 of
// this rank's partials region, part_copy bytes apart.
template <typename WireT, typename OutT, typename A>
__global__ void __launch_bounds__(Tuning::kThreads) home_sum(
    const unsigned* hit, int tokens, int hidden, const char* partials, long long part_copy, long long part_row,
    long long tcap, int world, OutT* out, const unsigned* flags, const unsigned* seq, unsigned long long timeout_ns,
    int* status) {
  follow_previous();
  const unsigned epoch = load_seq(seq);
  partials += (long long)(epoch & 1u) * part_copy;
  if (!wait_peers(flags, world, epoch, timeout_ns, status, 2)) {  // failed: zero sums, not stale ones
    zero_all(out, (long long)tokens * hidden);
    return;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long warps = (long long)gridDim.x * Tuning::kWarps;
  const Segments seg = split_rows(tokens, hidden, warps);
  for (long long work = (long long)blockIdx.x * Tuning::kWarps + warp; work < tokens * seg.count; work += warps) {
    const long long t = work / seg.count, part = work % seg.count;
    const unsigned mask = hit[t];
    OutT* dst = out + t * hidden;
    if ((hidden & 7) == 0) {
      const long long begin = part * seg.units, units = min(hidden / 8LL, begin + seg.units);
      constexpr int kU = Tuning::kUnroll;  // units in flight per lane
      constexpr int kWords = sizeof(Vec8<WireT>) / 16;
      for (long long base = begin + lane; base < units; base += 32 * kU) {
        A acc[kU][8];
#pragma unroll
        for (int u = 0; u < kU; ++u)
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[u][i] = (A)0;
        constexpr int kR = Tuning::kHomeRanks;  // ranks whose partials' loads are in flight together
        for (int r0 = 0; r0 < world; r0 += kR) {
          Vec8<WireT> v[kR][kU];
#pragma unroll
          for (int q = 0; q < kR; ++q) {
            const int r = r0 + q;
            if (r >= world || !((mask >> r) & 1u)) continue;
            const WireT* p = reinterpret_cast<const WireT*>(partials + ((long long)r * tcap + t) * part_row);
#pragma unroll
            for (int u = 0; u < kU; ++u)
              if (base + 32 * u < units)
#pragma unroll
                for (int i = 0; i < kWords; ++i)
                  reinterpret_cast<uint4*>(&v[q][u])[i] =
                      __ldcg(reinterpret_cast<const uint4*>(p + (base + 32 * u) * 8) + i);
          }
#pragma unroll
          for (int q = 0; q < kR; ++q) {  // summed in ascending rank order
            const int r = r0 + q;
            if (r >= world || !((mask >> r) & 1u)) continue;
#pragma unroll
            for (int u = 0; u < kU; ++u)
#pragma unroll
              for (int i = 0; i < 8; ++i) acc[u][i] += widen<A>(v[q][u].v[i]);
          }
        }
        store_units(dst, base, units, acc);
      }
    } else {
      for (long long col = lane; col < hidden; col += 32) {
        A acc = (A)0;
        for (int r = 0; r < world; ++r) {
          if (!((mask >> r) & 1u)) continue;
          acc += widen<A>(__ldcg(reinterpret_cast<const WireT*>(partials + ((long long)r * tcap + t) * part_row) + col));
        }
        dst[col] = narrow<OutT>(acc);
      }
    }
  }
}

// Expert side of the routing-weight gradients: values [N] of this rank's rows
// go to slot (t, k) of their home rank's slots region ([T, K] of VT; copy 0 at
// slots_off, slots_copy bytes apart) of the epoch seq + 1, raised at the end.
// Items as push_partials'.
template <typename VT>
__global__ void __launch_bounds__(Tuning::kThreads) push_slots(
    const VT* values, const int* presum, const int* slot_k, const int* tokens_at, int width, long long tstride,
    const int* matrix, int row_len, int sends_col, int topk, const unsigned long long* data_ptrs, long long slots_off,
    long long slots_copy, int me, int world, const unsigned long long* flag_ptrs, unsigned* seq, int* counter,
    const int* status) {
  follow_previous();
  __shared__ int tokens_of[Tuning::kMaxWorld];
  if (threadIdx.x < world) tokens_of[threadIdx.x] = matrix[threadIdx.x * row_len + sends_col + me];
  const unsigned epoch = load_seq(seq) + 1;
  slots_off = by_parity(slots_off, slots_copy, epoch);
  __syncthreads();
  long long items = 0;
  for (int s = 0; s < world; ++s) items += tokens_of[s];
  const long long threads = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; !failed(status) && i < items * width;
       i += threads) {
    const long long item = i / width;
    int s, j;
    item_of(item, tokens_of, world, &s, &j);
    const long long at = ((long long)s * tstride + j) * width + i % width;
    const int row = presum[at];
    if (row < 0) continue;
    VT* dst = reinterpret_cast<VT*>(data_ptrs[s] + slots_off);
    dst[(long long)tokens_at[(long long)s * tstride + j] * topk + slot_k[at]] = values[row];
  }
  signal_when_done(flag_ptrs, world, me, epoch, counter, seq, status);
}

// Home side: out [T, K] = the pushed value of each slot, 0 for an empty slot;
// the epoch is seq (raised by push_slots), pushed: copy 0, pushed_copy bytes apart.
template <typename VT>
__global__ void __launch_bounds__(Tuning::kThreads) home_slots(
    const Slot* route, long long slots, const VT* pushed, long long pushed_copy, VT* out, int world,
    const unsigned* flags, const unsigned* seq, unsigned long long timeout_ns, int* status) {
  follow_previous();
  const unsigned epoch = load_seq(seq);
  pushed = reinterpret_cast<const VT*>(reinterpret_cast<const char*>(pushed) + (long long)(epoch & 1u) * pushed_copy);
  if (!wait_peers(flags, world, epoch, timeout_ns, status, 3)) {  // failed: zero values, not stale ones
    zero_all(out, slots);
    return;
  }
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < slots; i += (long long)gridDim.x * blockDim.x)
    out[i] = route[i].expert >= 0 ? __ldcg(pushed + i) : (VT)0;
}

// table[at] = a and table[stride + at] = b (one thread): the row and weight
// pointers of one group of a combine by groups, written on the device so that a
// CUDA graph replays them.
__global__ void __launch_bounds__(Tuning::kThreads) store_pair(long long* table, int at, int stride, long long a,
                                                                long long b) {
  follow_previous();
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    table[at] = a;
    table[stride + at] = b;
  }
}
