// Routing plan on the device: each slot's place in its destination's
// expert-major order, and the counts exchange between the ranks of one host.
#include "engine.cuh"

using namespace engine;

// Block-wide exclusive scan of one flag per thread; returns the thread's offset
// and writes the block's total to *total (every thread sees it).
__device__ __forceinline__ int block_scan(bool flag, int* total) {
  __shared__ int warp_sums[Tuning::kWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned ballot = __ballot_sync(0xffffffffu, flag);
  const int in_warp = __popc(ballot & ((1u << lane) - 1u));
  if (lane == 0) warp_sums[warp] = __popc(ballot);
  __syncthreads();
  int before = 0, sum = 0;
#pragma unroll
  for (int w = 0; w < Tuning::kWarps; ++w) {
    before += (w < warp) ? warp_sums[w] : 0;
    sum += warp_sums[w];
  }
  __syncthreads();
  *total = sum;
  return before + in_warp;
}

// topk_idx [T, K] (IdxT) and weights [T, K] (WT: float or double) of this rank ->
//   route [T, K]: expert (-1 if empty or out of range), place among this rank's
//     tokens sent to that expert (token order), weight bits;
//   counts [E]: this rank's tokens per expert (the counts part of its row);
//   sends [W]: this rank's tokens per destination rank (zeroed by the caller);
//   hit [T]: mask of the ranks each token goes to;
//   bad (if not null; zeroed by the caller): set to 1 where some row holds an
//     id outside [-1, E), an expert twice, or a non-finite weight.
// Blocks [0, E) each scan every token for one expert; blocks from E on fill the
// per-slot fields, one token a thread.
template <typename IdxT, typename WT>
__global__ void __launch_bounds__(Tuning::kThreads) route_layout(const IdxT* topk_idx, const WT* weights, int tokens,
                                                                 int topk, int experts, int experts_per_rank,
                                                                 Slot* route, int* counts, int* sends,
                                                                 unsigned* hit, int* bad) {
  if ((int)blockIdx.x < experts) {
    const int e = blockIdx.x;
    int running = 0;
    for (int base = 0; base < tokens; base += Tuning::kThreads) {
      const int t = base + threadIdx.x;
      int slot = -1;
      if (t < tokens) {
        for (int k = 0; k < topk; ++k) {
          if ((long long)topk_idx[(long long)t * topk + k] != e) continue;
          if (slot < 0) slot = k;
          else route[(long long)t * topk + k].pos = -1;  // e again in the row (unchecked input): no place
        }
      }
      int total;
      const int offset = block_scan(slot >= 0, &total);
      if (slot >= 0) route[(long long)t * topk + slot].pos = running + offset;
      running += total;
    }
    if (threadIdx.x == 0) counts[e] = running;
    return;
  }
  const int t = (blockIdx.x - experts) * Tuning::kThreads + threadIdx.x;
  if (t >= tokens) return;
  unsigned mask = 0;
  for (int k = 0; k < topk; ++k) {
    const long long at = (long long)t * topk + k;
    const long long e = (long long)topk_idx[at];
    const bool valid = e >= 0 && e < experts;
    Slot* s = route + at;
    s->expert = valid ? (int)e : -1;
    if (!valid) s->pos = -1;
    if (sizeof(WT) == 8) {
      const long long bits = __double_as_longlong((double)weights[at]);
      s->w_lo = (int)(bits & 0xffffffffll);
      s->w_hi = (int)(bits >> 32);
    } else {
      s->w_lo = __float_as_int((float)weights[at]);
      s->w_hi = 0;
    }
    if (valid) mask |= 1u << (int)(e / experts_per_rank);
  }
  hit[t] = mask;
  for (unsigned m = mask; m; m &= m - 1) atomicAdd(sends + __ffs(m) - 1, 1);
  if (bad != nullptr) {
    bool wrong = false;
    for (int k = 0; k < topk; ++k) {
      const long long at = (long long)t * topk + k;
      const long long e = (long long)topk_idx[at];
      const double w = (double)weights[at];
      wrong |= e < -1 || e >= experts || !(fabs(w) <= 1.7976931348623157e308);
      for (int j = 0; j < k && e >= 0; ++j) wrong |= (long long)topk_idx[(long long)t * topk + j] == e;
    }
    if (wrong) atomicExch(bad, 1);
  }
}

// One block. Writes this rank's row (header, T, ..., counts [E]) into row `me`
// of every rank's counts matrix, raises its flag there, waits for every rank's,
// then writes out [4 + W * row_len]: the status words, then the matrix; and
// computes, for this rank's experts: tokens_per_expert [E_local] (int64) and
// src_start [W][E_local], the first expanded row of (source rank, local expert)
// in canonical order. meta_ptrs: [W] base of every rank's meta buffer (flags
// [W] u32 at 0, the counts matrix at rows_offset). Dynamic shared memory:
// E_local ints.
__global__ void __launch_bounds__(Tuning::kThreads) exchange_counts(
    const unsigned long long* meta_ptrs, long long rows_offset, int me, int world, int row_len, int count_start,
    int experts_per_rank, const int* row, unsigned epoch, unsigned long long timeout_ns, int* status, int* out,
    long long* tokens_per_expert, int* src_start) {
  extern __shared__ int totals[];
  int* matrix = out + 4;
  if (threadIdx.x < 4) out[threadIdx.x] = status[threadIdx.x];
  if (failed(status)) return;
  for (int p = 0; p < world; ++p) {
    int* dst = reinterpret_cast<int*>(meta_ptrs[p] + rows_offset) + (long long)me * row_len;
    for (int i = threadIdx.x; i < row_len; i += blockDim.x) dst[i] = row[i];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    for (int p = 0; p < world; ++p) st_release(reinterpret_cast<unsigned*>(meta_ptrs[p]) + me, epoch);
  }
  const unsigned* own_flags = reinterpret_cast<const unsigned*>(meta_ptrs[me]);
  if (!wait_peers(own_flags, world, epoch, timeout_ns, status, 0)) {
    if (threadIdx.x < 4) out[threadIdx.x] = status[threadIdx.x];
    return;
  }
  const volatile int* rows = reinterpret_cast<const volatile int*>(meta_ptrs[me] + rows_offset);
  for (int i = threadIdx.x; i < world * row_len; i += blockDim.x) matrix[i] = rows[i];
  __syncthreads();
  const int first = count_start + me * experts_per_rank;  // this rank's experts in a row
  for (int e = threadIdx.x; e < experts_per_rank; e += blockDim.x) {
    int sum = 0;
    for (int s = 0; s < world; ++s) sum += matrix[s * row_len + first + e];
    totals[e] = sum;
    tokens_per_expert[e] = sum;
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // exclusive prefix over the experts
    int running = 0;
    for (int e = 0; e < experts_per_rank; ++e) {
      const int n = totals[e];
      totals[e] = running;
      running += n;
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < experts_per_rank; e += blockDim.x) {
    int start = totals[e];
    for (int s = 0; s < world; ++s) {
      src_start[s * experts_per_rank + e] = start;
      start += matrix[s * row_len + first + e];
    }
  }
}

// One block: raise word `me` of every rank's flags to `epoch` once this rank's
// earlier work on the stream (staged rows and routes) is visible to the system.
__global__ void raise_flags(const unsigned long long* flag_ptrs, int world, int me, unsigned epoch) {
  if (threadIdx.x == 0) {
    __threadfence_system();
    for (int p = 0; p < world; ++p) st_release(reinterpret_cast<unsigned*>(flag_ptrs[p]) + me, epoch);
  }
}
