// Routing plan on the device: each slot's place in its destination's
// expert-major order, and the counts exchange between the ranks of one host.
#include "engine.cuh"

using namespace engine;

// The sums of the warps before `warp` (*before) and of all (*total), from each
// warp's sum in shared memory.
__device__ __forceinline__ void warps_before(const int* warp_sums, int warp, int* before, int* total) {
  int b = 0, t = 0;
#pragma unroll
  for (int w = 0; w < Tuning::kWarps; ++w) {
    b += (w < warp) ? warp_sums[w] : 0;
    t += warp_sums[w];
  }
  *before = b;
  *total = t;
}

// In-place exclusive prefix of v[0, n) (shared memory) by the whole block, tile
// by tile of one value a thread; v[n] = the total. Every thread of the block calls it.
__device__ void block_exclusive_scan(int* v, int n) {
  __shared__ int warp_sums[Tuning::kWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int carry = 0;  // the same on every thread: the total of the earlier tiles
  for (int base = 0; base < n; base += blockDim.x) {
    const int i = base + threadIdx.x;
    const int x = i < n ? v[i] : 0;
    int inclusive = x;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, inclusive, d);
      if (lane >= d) inclusive += y;
    }
    if (lane == 31) warp_sums[warp] = inclusive;
    __syncthreads();
    int before, tile;
    warps_before(warp_sums, warp, &before, &tile);
    if (i < n) v[i] = carry + before + inclusive - x;
    carry += tile;
    __syncthreads();  // warp_sums read by every thread before the next tile writes them
  }
  if (threadIdx.x == 0) v[n] = carry;
  __syncthreads();
}

// The per-slot fields of one slot (route_layout's blocks from E on): a token takes
// `width` lanes (the power of two >= K, so that a token's lanes share a warp), its
// lane k slot k, so that each slot's loads and stores are one lane's, coalesced over
// the warp; the token's mask of ranks, its sends and the check of a repeated expert
// come from its lanes by shuffles. Every lane of the block calls it (shuffles).
template <typename IdxT, typename WT>
__device__ __forceinline__ void layout_slot(const IdxT* topk_idx, const WT* weights, int block, int tokens, int topk,
                                            int width, int experts, int experts_per_rank, Slot* route, Slot* shared,
                                            unsigned* hit, int* bad) {
  const int lane = threadIdx.x & 31, k = lane & (width - 1), leader = lane - k;
  const int t = block * (Tuning::kThreads / width) + (int)threadIdx.x / width;
  const bool mine = t < tokens && k < topk;
  long long e = -1;
  double w = 0.0;
  bool valid = false;
  if (mine) {
    const long long at = (long long)t * topk + k;
    e = (long long)topk_idx[at];
    w = (double)weights[at];
    valid = e >= 0 && e < experts;
    int w_lo, w_hi = 0;
    if (sizeof(WT) == 8) {
      const long long bits = __double_as_longlong(w);
      w_lo = (int)(bits & 0xffffffffll);
      w_hi = (int)(bits >> 32);
    } else {
      w_lo = __float_as_int((float)w);  // a float weight round-trips through double exactly
    }
    // pos is the expert blocks' (another block); these fields are this lane's
    Slot* const targets[2] = {route + at, shared == nullptr ? nullptr : shared + at};
    for (Slot* s : targets) {
      if (s == nullptr) continue;
      s->expert = valid ? (int)e : -1;
      if (!valid) s->pos = -1;
      s->w_lo = w_lo;
      s->w_hi = w_hi;
    }
  }
  unsigned mask = valid ? 1u << (int)(e / experts_per_rank) : 0u;  // the token's ranks: OR over its lanes
  for (int d = 1; d < width; d <<= 1) mask |= __shfl_xor_sync(0xffffffffu, mask, d);
  if (k == 0 && t < tokens) hit[t] = mask;
  if (bad != nullptr) {
    bool wrong = mine && (e < -1 || e >= experts || !(fabs(w) <= 1.7976931348623157e308));
    for (int j = 0; j + 1 < width; ++j) {  // an expert named by an earlier slot of the token
      const long long earlier = __shfl_sync(0xffffffffu, e, leader + j);
      wrong |= mine && j < k && e >= 0 && earlier == e;
    }
    if (wrong) atomicExch(bad, 1);
  }
}

// The ranks a token goes to (a mask), from its lanes' experts (-1, -2: none);
// every lane of the warp calls it.
__device__ __forceinline__ unsigned token_ranks(int e, int experts_per_rank, int width) {
  unsigned mask = e >= 0 ? 1u << (e / experts_per_rank) : 0u;
  for (int d = 1; d < width; d <<= 1) mask |= __shfl_xor_sync(0xffffffffu, mask, d);
  return mask;
}

// One chunk of this rank's tokens, placed (route_layout's scan blocks): each
// slot's place among the tokens sent to its expert, each token's among those
// sent to each of its ranks (the lists). A warp holds kScanTiles tiles of 32
// slots, lane l slot l % width of token l / width of the tile (width: the power
// of two >= K); a chunk is scan_warps warps' tiles, in token order. The slots
// of one expert in a tile are found by __match_any_sync, so that a slot's place
// in its tile is the lanes of its expert below it. Each warp counts its slots
// per expert and its tokens per rank into its row of shared memory ([scan_warps]
// [E + W]); the block turns the rows into each warp's first places in the chunk,
// then adds the places of the chunks before it (a decoupled look-back): chunks
// take their turn by a ticket (state[0]), publish their totals (sums [chunks]
// [E + W]) and, once they have the sums of every chunk before them, those
// through themselves (sums + chunks (E + W)), raising state[1 + chunk] to 1 and
// 2; a chunk adds the totals back to the nearest chunk that has raised 2. The
// chunks before it took their tickets earlier, so they run, and none waits for
// a later one. The last chunk writes counts [E] and sends [W] (one chunk: its
// sums are those, and it publishes nothing). The warps place their slots from
// the ids they kept in registers. Not inlined: its registers are its own, and
// the staging blocks of the launch spill none.
template <typename IdxT>
__device__ __noinline__ void scan_chunk(const IdxT* topk_idx, int tokens, int topk, int width, int experts,
                                        int experts_per_rank, int world, int scan_warps, int chunks, int* state,
                                        int* sums, Slot* route, Slot* shared, int* counts, int* sends, int* lists,
                                        int* peer_lists, long long list_stride) {
  extern __shared__ int rows[];  // [scan_warps][E + W]: each warp's counts, then its next places
  __shared__ int chunk_of, nearest;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int cols = experts + world;
  if (threadIdx.x == 0) chunk_of = chunks == 1 ? 0 : atomicAdd(state, 1);
  for (int i = threadIdx.x; i < scan_warps * cols; i += blockDim.x) rows[i] = 0;
  __syncthreads();
  const int chunk = chunk_of;
  unsigned* ready = reinterpret_cast<unsigned*>(state) + 1;
  const int k = lane & (width - 1);
  const unsigned below = (1u << lane) - 1u;
  const unsigned token_lanes = (width == 32 ? 0xffffffffu : (1u << width) - 1u) << (lane - k);
  const int per_tile = 32 / width;
  const long long first = ((long long)chunk * scan_warps + warp) * Tuning::kScanTiles * per_tile + lane / width;
  const bool scans = warp < scan_warps;  // the same on the warp's lanes
  int* row = rows + warp * cols;
  // the lane's slot of each tile: its expert, -1 (none: empty, out of range,
  // past the tokens) or -2 (an expert the token named before: no place)
  int id[Tuning::kScanTiles];
#pragma unroll
  for (int j = 0; j < Tuning::kScanTiles; ++j) {
    const long long t = first + (long long)j * per_tile;
    id[j] = -1;
    if (scans && t < tokens && k < topk) {
      const long long e = (long long)topk_idx[t * topk + k];
      if (e >= 0 && e < experts) id[j] = (int)e;
    }
  }
  if (scans) {
#pragma unroll
    for (int j = 0; j < Tuning::kScanTiles; ++j) {
      const unsigned same = __match_any_sync(0xffffffffu, id[j]);
      if (id[j] >= 0 && (same & token_lanes & below) != 0u) id[j] = -2;
      const unsigned group = same & __ballot_sync(0xffffffffu, id[j] >= 0);
      if (id[j] >= 0 && (group & below) == 0u) row[id[j]] += __popc(group);  // the group's lowest lane
      const unsigned ranks = token_ranks(id[j], experts_per_rank, width);
      for (int d = 0; d < world; ++d) {
        const unsigned to_d = __ballot_sync(0xffffffffu, k == 0 && ((ranks >> d) & 1u));
        if (lane == 0) row[experts + d] += __popc(to_d);
      }
      __syncwarp();
    }
  }
  __syncthreads();
  // each warp's first places in the chunk; the chunk's totals
  int* totals = sums;                                // [chunks][E + W]
  int* through = sums + (long long)chunks * cols;    // [chunks][E + W]
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    int sum = 0;
    for (int w = 0; w < scan_warps; ++w) {
      const int v = rows[w * cols + c];
      rows[w * cols + c] = sum;
      sum += v;
    }
    if (chunks == 1) {  // the sums are this rank's: nothing to publish
      if (c < experts) counts[c] = sum;
      else sends[c - experts] = sum;
    } else {
      totals[(long long)chunk * cols + c] = sum;
    }
  }
  if (chunks > 1) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0 && chunk > 0) st_release<false>(ready + chunk, 1u);
    if (warp == 0) {  // the nearest chunk before this one with its sums through it (-1: none, chunk 0)
      int from = chunk - 1, found = -1;
      while (found < 0 && from >= 0) {
        const int p = from - lane;
        unsigned got = 0u;
        if (p >= 0) {
          while ((got = ld_acquire<false>(ready + p)) == 0u) {
          }
        }
        const unsigned done = __ballot_sync(0xffffffffu, got == 2u);
        if (done != 0u) found = from - (__ffs(done) - 1);
        from -= 32;
      }
      if (lane == 0) nearest = found;
    }
    __syncthreads();
    const int from = nearest;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
      int before = 0;
      if (from >= 0) {
        before = __ldcg(through + (long long)from * cols + c);
        for (int q = from + 1; q < chunk; ++q) before += __ldcg(totals + (long long)q * cols + c);
      }
      const int sum = before + totals[(long long)chunk * cols + c];
      through[(long long)chunk * cols + c] = sum;
      for (int w = 0; w < scan_warps; ++w) rows[w * cols + c] += before;
      if (chunk == chunks - 1) {
        if (c < experts) counts[c] = sum;
        else sends[c - experts] = sum;
      }
    }
    __threadfence();
  }
  __syncthreads();
  if (chunks > 1 && threadIdx.x == 0) st_release<false>(ready + chunk, 2u);
  if (!scans) return;
#pragma unroll
  for (int j = 0; j < Tuning::kScanTiles; ++j) {
    const long long t = first + (long long)j * per_tile;
    const unsigned same = __match_any_sync(0xffffffffu, id[j]);
    const unsigned group = same & __ballot_sync(0xffffffffu, id[j] >= 0);
    const int at = id[j] >= 0 ? row[id[j]] : 0;
    if (id[j] != -1) {
      const int pos = id[j] >= 0 ? at + __popc(group & below) : -1;
      route[t * topk + k].pos = pos;
      if (shared != nullptr) shared[t * topk + k].pos = pos;
    }
    const unsigned ranks = token_ranks(id[j], experts_per_rank, width);
    for (int d = 0; d < world; ++d) {
      const bool to_me = k == 0 && ((ranks >> d) & 1u);
      const unsigned to_d = __ballot_sync(0xffffffffu, to_me);
      const int next = row[experts + d];
      if (to_me) {
        const int place = next + __popc(to_d & below);
        lists[(long long)d * tokens + place] = (int)t;
        if (peer_lists != nullptr) peer_lists[(long long)d * list_stride + place] = (int)t;
      }
      __syncwarp();
      if (lane == 0) row[experts + d] = next + __popc(to_d);
    }
    __syncwarp();
    if (id[j] >= 0 && (group & below) == 0u) row[id[j]] = at + __popc(group);
    __syncwarp();
  }
}

// topk_idx [T, K] (IdxT) and weights [T, K] (WT: float or double) of this rank ->
//   route [T, K]: expert (-1 if empty or out of range), place among this rank's
//     tokens sent to that expert (token order), weight bits; written too, if
//     shared_route is not 0, into the copy of the data buffer's route region
//     (copy 0 at shared_route, copy_bytes apart) of the next epoch (seq + 1),
//     where the peers read it;
//   counts [E]: this rank's tokens per expert (the counts part of its row);
//   sends [W]: this rank's tokens per destination rank;
//   lists [W, T]: the tokens each destination rank d gets, ascending, at
//     [d, 0 .. sends[d]); written too, if shared_lists is not 0, into the
//     next epoch's copy of the data buffer's lists region (copy 0 at
//     shared_lists, lists_copy bytes apart; destination d's at d list_stride
//     ints), where rank d reads its own: a receiver walks only its items;
//   hit [T]: mask of the ranks each token goes to;
//   bad (if not null; zeroed by the caller): set to 1 where some row holds an
//     id outside [-1, E), an expert twice, or a non-finite weight.
//   with stage_blocks > 0, the last stage_blocks blocks copy this rank's rows
//     [T, row_bytes] (wire format, at stage_src, src_stride bytes apart) into the
//     next epoch's copy of the data buffer's stage region (copy 0 at stage_dst,
//     stage_copy bytes apart; dst_stride bytes apart), where the peers pull them:
//     the copy runs beside the layout instead of after it.
// Where this rank has failed (status), nothing the peers read is written (no
// shared route, lists or staged rows): it waits for no peer any more, so it
// must not overtake one still reading an earlier epoch of those regions (the
// counts exchange after it raises its flags, marked failed: no peer reads them).
// Blocks [0, chunks) place the slots and list the tokens, a chunk of tokens
// each (scan_chunk: scan_warps warps of kScanTiles tiles; scan_state [1 +
// chunks] zeroed by the caller, scan_sums [2 chunks (E + W)]; dynamic shared
// memory scan_warps (E + W) ints); the blocks after them, up to the staging
// blocks, fill the per-slot fields, a lane a slot (kThreads / width tokens a
// block, width the power of two >= K). Held to four blocks per SM (32
// registers), so that most staging blocks run beside the layout's, not after.
template <typename IdxT, typename WT>
__global__ void __launch_bounds__(Tuning::kThreads, 4) route_layout(const IdxT* topk_idx, const WT* weights, int tokens,
                                                                 int topk, int experts, int experts_per_rank,
                                                                 Slot* route, unsigned long long shared_route,
                                                                 long long copy_bytes, const unsigned* seq,
                                                                 int* counts, int* sends, int* lists,
                                                                 unsigned long long shared_lists,
                                                                 long long lists_copy, long long list_stride,
                                                                 int chunks, int scan_warps, int* scan_state,
                                                                 int* scan_sums, unsigned* hit, int* bad,
                                                                 const char* stage_src, long long src_stride,
                                                                 long long row_bytes, unsigned long long stage_dst,
                                                                 long long stage_copy, long long dst_stride,
                                                                 int stage_blocks, const int* status) {
  follow_previous();
  const bool stopped = engine::failed(status);  // (this rank's own: its earlier kernels are done)
  Slot* shared = shared_route == 0 || stopped
                     ? nullptr
                     : reinterpret_cast<Slot*>(by_parity((long long)shared_route, copy_bytes, load_seq(seq) + 1));
  const int first_stage = (int)gridDim.x - stage_blocks;
  if ((int)blockIdx.x >= first_stage) {  // this rank's rows staged for the peers, beside the layout
    char* dst = reinterpret_cast<char*>(by_parity((long long)stage_dst, stage_copy, load_seq(seq) + 1));
    if (!stopped)
      copy_rows(stage_src, src_stride, row_bytes, tokens, dst, dst_stride,
                (long long)(blockIdx.x - first_stage) * Tuning::kWarps + (threadIdx.x >> 5),
                (long long)stage_blocks * Tuning::kWarps);
    return;
  }
  int width = 1;
  while (width < topk) width <<= 1;
  const int world = experts / experts_per_rank;
  if ((int)blockIdx.x < chunks) {
    int* peer_lists = shared_lists == 0 || stopped
                          ? nullptr
                          : reinterpret_cast<int*>(by_parity((long long)shared_lists, lists_copy, load_seq(seq) + 1));
    scan_chunk(topk_idx, tokens, topk, width, experts, experts_per_rank, world, scan_warps, chunks, scan_state,
               scan_sums, route, shared, counts, sends, lists, peer_lists, list_stride);
    return;
  }
  layout_slot(topk_idx, weights, (int)blockIdx.x - chunks, tokens, topk, width, experts, experts_per_rank, route,
              shared, hit, bad);
}

// What the experts and the later kernels read of a failed counts exchange: no
// rows (every expert's count and N zero, each group of a padded dispatch empty),
// so that nothing sized by the counts (the experts' grouped GEMMs on a bounded
// dispatch's rows) reads or writes past the bound before the failure is raised.
// Every thread of the block calls it.
__device__ void no_rows(long long* tokens_per_expert, int* num_rows, int* group_end, int experts_per_rank,
                        int groups, int budget) {
  for (int e = threadIdx.x; e < experts_per_rank; e += blockDim.x) tokens_per_expert[e] = 0;
  const bool padded = groups > 1 && budget >= 0;
  const long long bound = padded ? ((long long)budget + groups - 1) / groups : 0;
  for (int g = threadIdx.x; padded && g < groups; g += blockDim.x) group_end[g] = (int)(g * bound);
  if (threadIdx.x == 0) *num_rows = 0;
}

// One block, the operation's epoch = seq + 1 (stored in seq once the flags are
// raised). Writes this rank's row into row `me` of the epoch's copy of every
// rank's counts matrix: the header from the arguments (failed: the larger of
// the argument and row[Row::kFailed], where route_layout marks bad values), the
// rest (sends, counts) from `row`; raises its flag there, waits for every
// rank's, then writes out [4 + W * row_len]: the status words, then the matrix;
// and computes, for this rank's experts: tokens_per_expert [E_local] (int64),
// src_start [W][E_local], the first expanded row of (source rank, local expert)
// in canonical order, and num_rows [1], N.
// A dispatch by G > 1 groups of experts with a row budget M (max_rows) gives
// each group B = ceil(M / G) rows: group g's rows start at g B (src_start in
// those places), group_end [G] = g B + the group's rows.
// Where some rank has a row budget (no host read there), every rank checks
// every row in rank order: the same header and G, no failed mark, N of that
// rank (each group's rows, by groups) within its budget; the first that fails
// is recorded (the same on every rank), so that every later kernel of the group
// skips its work; a failed exchange gives no rows (``no_rows``).
// meta_ptrs: [W] base of every rank's meta buffer (its flags region at 0:
// Tuning::kFlagWords W u32, wait_peers; the two copies of the counts matrix
// from rows_offset, matrix_bytes apart). Dynamic
// shared memory: E_local + 1 + W E_local ints. Every step after the wait is
// spread over the block (a scan of the places, each rank's group rows by
// shared-memory atomics).
// row: the first row_len of the scratch_words words route_layout wrote (its
// row, then the scan's ticket and chunk states), zero before it ran; they are
// zeroed again once read, so that the next operation's layout finds them so
// (the engine keeps them from one operation to the next, no memset between).
__global__ void __launch_bounds__(Tuning::kThreads) exchange_counts(
    const unsigned long long* meta_ptrs, long long rows_offset, long long matrix_bytes, int me, int world,
    int row_len, int count_start, int experts_per_rank, int* row, int scratch_words, int verb, int call,
    int along, int topk, int hidden, int x_dtype, int weights_dtype, int x_grad, int weights_grad, int failed, int max_rows,
    int memory_rows, int tokens, int staged, int groups, unsigned* seq, unsigned long long timeout_ns, int* status, int* out,
    long long* tokens_per_expert, int* src_start, int* num_rows, int* group_end) {
  follow_previous();
  extern __shared__ int shared_ints[];
  __shared__ unsigned epoch_of;
  __shared__ int stop;  // the block's one reading of a failure
  int* matrix = out + 4;
  if (threadIdx.x == 0) {
    epoch_of = load_seq(seq) + 1;
    stop = engine::failed(status);
  }
  if (threadIdx.x < 4) out[threadIdx.x] = status[threadIdx.x];
  __syncthreads();
  const unsigned epoch = epoch_of;
  if (stop) {  // its flags raised, marked failed (raise_flags): no peer waits for it, none reads its stale row
    for (int i = threadIdx.x; i < scratch_words; i += blockDim.x) row[i] = 0;
    no_rows(tokens_per_expert, num_rows, group_end, experts_per_rank, groups, max_rows);
    if (threadIdx.x == 0) {
      raise_flags(meta_ptrs, world, me, epoch, status);
      *seq = epoch;
    }
    return;
  }
  const int head[Row::kSends] = {verb, call, along, topk, hidden, x_dtype, weights_dtype, x_grad, weights_grad,
                                 max(failed, row[Row::kFailed]), max_rows, memory_rows, tokens, staged, groups};
  const long long copy = by_parity(rows_offset, matrix_bytes, epoch);
  for (int p = 0; p < world; ++p) {
    int* dst = reinterpret_cast<int*>(meta_ptrs[p] + copy) + (long long)me * row_len;
    for (int i = threadIdx.x; i < row_len; i += blockDim.x) dst[i] = i < Row::kSends ? head[i] : row[i];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < scratch_words; i += blockDim.x) row[i] = 0;  // read: zero for the next layout
  if (threadIdx.x == 0) {
    raise_flags(meta_ptrs, world, me, epoch, status);
    *seq = epoch;
  }
  const unsigned* own_flags = reinterpret_cast<const unsigned*>(meta_ptrs[me]);
  if (!wait_peers(own_flags, world, epoch, timeout_ns, status, 0)) {
    if (threadIdx.x < 4) out[threadIdx.x] = status[threadIdx.x];
    no_rows(tokens_per_expert, num_rows, group_end, experts_per_rank, groups, max_rows);
    return;
  }
  const volatile int* rows = reinterpret_cast<const volatile int*>(meta_ptrs[me] + copy);
  for (int i = threadIdx.x; i < world * row_len; i += blockDim.x) matrix[i] = rows[i];
  __syncthreads();
  const int experts = world * experts_per_rank;
  int* place = shared_ints;  // [E_local + 1]
  int* group_rows = shared_ints + experts_per_rank + 1;  // [W * E_local]: rank r's group g at r E_local + g
  const int first = count_start + me * experts_per_rank;  // this rank's experts in a row
  for (int e = threadIdx.x; e < experts_per_rank; e += blockDim.x) {
    int sum = 0;
    for (int s = 0; s < world; ++s) sum += matrix[s * row_len + first + e];
    place[e] = sum;
    tokens_per_expert[e] = sum;
  }
  __syncthreads();
  block_exclusive_scan(place, experts_per_rank);  // place[e]: rows before expert e; place[E_local] = N
  // by groups with a max_rows, each group from its first place: g B + the rows of its earlier experts
  const bool padded = groups > 1 && max_rows >= 0;
  const long long bound = padded ? ((long long)max_rows + groups - 1) / groups : 0;
  for (int e = threadIdx.x; e < experts_per_rank; e += blockDim.x) {
    int start = place[e];
    if (padded) {
      const int g = group_of(e, groups, experts_per_rank);
      start = (int)(g * bound) + start - place[group_first(g, groups, experts_per_rank)];
    }
    for (int s = 0; s < world; ++s) {
      src_start[s * experts_per_rank + e] = start;
      start += matrix[s * row_len + first + e];
    }
  }
  for (int g = threadIdx.x; padded && g < groups; g += blockDim.x)
    group_end[g] = (int)(g * bound) + place[group_first(g + 1, groups, experts_per_rank)] -
                   place[group_first(g, groups, experts_per_rank)];
  if (threadIdx.x == 0) *num_rows = place[experts_per_rank];
  bool budgeted = false;  // the same on every thread
  for (int r = 0; r < world; ++r) budgeted |= matrix[r * row_len + Row::kBudget] >= 0;
  if (!budgeted) {
    if (threadIdx.x < 4) out[threadIdx.x] = status[threadIdx.x];
    return;
  }
  // rows of each group of every rank r (by its own G, kept within [1, E_local] here:
  // a G that differs from ours fails the header check below), then its fullest group
  __shared__ int most[32];  // W <= 32
  for (int i = threadIdx.x; i < experts; i += blockDim.x) group_rows[i] = 0;
  if (threadIdx.x < world) most[threadIdx.x] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < experts; i += blockDim.x) {
    const int r = i / experts_per_rank, e = i - r * experts_per_rank;
    const int g_of_r = min(max(matrix[r * row_len + Row::kGroups], 1), experts_per_rank);
    int sum = 0;
    for (int s = 0; s < world; ++s) sum += matrix[s * row_len + count_start + i];
    atomicAdd(group_rows + r * experts_per_rank + group_of(e, g_of_r, experts_per_rank), sum);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < experts; i += blockDim.x) {
    const int r = i / experts_per_rank;
    if (group_rows[i] > 0) atomicMax(most + r, group_rows[i]);
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // in rank order: the first that fails is recorded, the same on every rank
    const int* mine = matrix + me * row_len;
    for (int r = 0; r < world; ++r) {
      const int* other = matrix + r * row_len;
      bool same = other[Row::kGroups] == mine[Row::kGroups];
      for (int c = 0; c < Row::kAgreed; ++c) same &= other[c] == mine[c];
      // rank r over its max_rows: its N, or by groups the rows of its fullest group against B
      const int g_of_r = max(other[Row::kGroups], 1);
      const long long budget_r = other[Row::kBudget];
      const long long bound_r = g_of_r > 1 ? (budget_r + g_of_r - 1) / g_of_r : budget_r;
      const int code = other[Row::kFailed] ? kPeerInput
                       : !same ? kMismatch
                       : (budget_r >= 0 && most[r] > bound_r) ? kOverBudget : kOk;
      if (code != kOk) {
        record(status, code, r, 0);
        break;
      }
    }
    for (int i = 0; i < 4; ++i) out[i] = status[i];
    stop = engine::failed(status);
  }
  __syncthreads();
  if (stop) no_rows(tokens_per_expert, num_rows, group_end, experts_per_rank, groups, max_rows);
}
