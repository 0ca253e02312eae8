// The NVLink engine's shared device code: tuned constants, status words, flags
// between ranks (acquire/release at system scope, bounded waits), and element
// conversions that round exactly as torch does.
//
// Notation: W ranks, E experts (E_local = epr per rank), T tokens of a rank,
// K slots per token, H hidden size, J = min(K, E_local) slots of one token on one
// rank, N rows handed to this rank's experts (canonical, expert-major order).
//
// Host entry points (launched from dispatch/nvlink.py through dispatch/cuda.py):
//   layout.cu             route_layout (with the rows staged beside it), exchange_counts
//   intranode_dispatch.cu stage_rows, pull_rows
//   intranode_combine.cu  push_partials, home_sum, push_slots, home_slots
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

namespace engine {

#ifndef ENGINE_UNROLL  // a study may compile with another (bench/engine_tuning.py)
#define ENGINE_UNROLL 4
#endif

// One table of tuned constants; it checks its own invariants.
struct Tuning {
  static constexpr int kThreads = 512;        // threads of a block, every kernel
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kMaxWorld = 32;        // a token's ranks are one 32-bit mask
  static constexpr int kMaxTopk = 32;         // a token's slots are one warp's lanes
  static constexpr int kUnit = 8;             // elements a lane moves per step (16 bytes of bf16)
  static constexpr int kUnroll = ENGINE_UNROLL;  // steps a lane has in flight
  static constexpr int kSumRows = 4;          // rows a lane of a pre-sum loads together where items have more than 2
  static constexpr int kSumUnits = 2;         // units of each of those rows (kUnroll of one row otherwise)
  static constexpr int kHomeRanks = 2;        // ranks whose partials a lane of the home sum loads together
  static constexpr unsigned kSleepNs = 100;   // back-off between polls of a flag
  static constexpr int kScanTiles = 4;        // tiles of 32 slots a warp of route_layout's scan holds
  // dynamic shared bytes of a layout kernel (the scan's per-warp counts, the counts exchange's), at most:
  // a block's 48 KiB without opting in to more, less 1 KiB for the kernels' own __shared__ words
  static constexpr int kScanShared = 47 * 1024;
  // (a layout, not a tuned value) words of a flags region per rank: its flag, failure mark, failed epoch
  static constexpr int kFlagWords = 3;
};
static_assert(Tuning::kThreads % 32 == 0 && Tuning::kThreads <= 1024, "whole warps, one block");
static_assert(Tuning::kMaxWorld <= 32 && Tuning::kMaxTopk <= 32, "masks and lanes are 32 wide");
static_assert(Tuning::kUnit == 8, "the vector loads below move 8 elements");

// Status words (int32, device memory of the caller): [0] code, [1] peer, [2] where.
// kOverBudget, kMismatch and kPeerInput are found by the counts exchange where some
// rank dispatches without a host read (a row budget, max_rows), so that every rank
// of the group records the same failure and skips the same work.
enum Code : int {
  kOk = 0,
  kTimeout = 1,       // a peer did not arrive in time
  kTooManyRows = 2,   // a route places a row past the rows counted
  kBadRoute = 3,      // a route no checked dispatch makes
  kOverBudget = 4,    // the peer's rows exceed its budget (max_rows)
  kMismatch = 5,      // the peer's call, K, H or dtypes differ from this rank's
  kPeerInput = 6,     // the peer marked its own input bad (values, or more tokens than the buffers hold)
  kPeerFailed = 7,    // the peer signalled this operation as failed: what it moves here is not there
};

// Columns of a rank's row of the counts matrix (dispatch/nvlink.py names them):
// the header (plan.HEADER: the call's verb, number and handle's dispatch (0), K, H, x dtype, weights dtype,
// x grad, weights grad, failed, max_rows (-1: none), the rows its free memory holds
// (checked on the host)), then T, staged, the groups of experts the dispatch moves by (G, the
// same on every rank), tokens per destination rank [W], tokens per global
// expert [E].
struct Row {
  static constexpr int kAgreed = 7;  // columns [0, kAgreed) must be equal on every rank (checks.AGREED)
  static constexpr int kFailed = 9;
  static constexpr int kBudget = 10;
  static constexpr int kMemory = 11;
  static constexpr int kTokens = 12;
  static constexpr int kStaged = 13;
  static constexpr int kGroups = 14;
  static constexpr int kSends = 15;
};

// The group of local expert e among G groups of E_local (plan.expert_groups:
// group g is experts [g E_local / G, (g + 1) E_local / G)).
__device__ __forceinline__ int group_of(int e, int groups, int experts_per_rank) {
  return (int)(((long long)(e + 1) * groups - 1) / experts_per_rank);
}

// The first local expert of group g (g = G: E_local).
__device__ __forceinline__ int group_first(int g, int groups, int experts_per_rank) {
  return (int)((long long)g * experts_per_rank / groups);
}

// Programmatic dependent launch (compute capability 9.0 and later, where the
// host allows it at every launch). Every kernel calls this first, before it
// reads or writes memory: it lets the next kernel of the stream be launched now
// (its blocks then wait likewise), and waits until the kernel before it has
// completed and its writes are visible.
__device__ __forceinline__ void follow_previous() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The epoch of an operation lives on the device (`seq`, one word of the engine),
// so that a captured CUDA graph replays with fresh epochs: the kernel that raises
// the flags of an operation takes seq + 1 and stores it; kernels before it in the
// operation write the copy of seq + 1, kernels after it read the copy of seq.
// Regions peers read are double-buffered by the epoch's parity.
__device__ __forceinline__ unsigned load_seq(const unsigned* seq) { return *((volatile const unsigned*)seq); }

__device__ __forceinline__ long long by_parity(long long base, long long copy_bytes, unsigned epoch) {
  return base + (long long)(epoch & 1u) * copy_bytes;
}

__device__ __forceinline__ void record(int* status, int code, int peer, int where) {
  if (atomicCAS(status, kOk, code) == kOk) {
    status[1] = peer;
    status[2] = where;
    __threadfence_system();
  }
}

__device__ __forceinline__ bool failed(const int* status) {
  return *((volatile const int*)status) != kOk;
}

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Acquire load and release store of a flag word: at system scope (flags between
// the ranks' GPUs) or, with kSystem false, GPU scope (between the blocks of one launch).
template <bool kSystem = true> __device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  if constexpr (kSystem) {
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  } else {
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  }
  return v;
}

template <bool kSystem = true> __device__ __forceinline__ void st_release(unsigned* p, unsigned v) {
  if constexpr (kSystem) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  } else {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  }
}

// out[0, n) zeroed by the whole grid: the output of a home kernel whose
// operation failed (no stale values, as a failed dispatch's rows).
template <typename T>
__device__ void zero_all(T* out, long long n) {
  const long long threads = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += threads) out[i] = T(0.0f);
}

// A rank's flags region (Tuning::kFlagWords words per rank of the group): [W]
// flags (word s raised by rank s to the epoch it reached), then [W] failure
// marks and [W] failed epochs: rank s, once failed, marks word s and stores
// there the first epoch it signalled as failed (it is failed for good after it).
// flags: this rank's own flags region. Threads s < W of the block each wait for
// one peer, then the block meets. False (and the status recorded) if a peer did
// not arrive in time, or arrived having failed at this epoch or before it
// (kPeerFailed: its writes of the operation are not there).
__device__ bool wait_peers(const unsigned* flags, int world, unsigned epoch, unsigned long long timeout_ns,
                           int* status, int where) {
  __shared__ int late;
  if (threadIdx.x == 0) late = 0;
  __syncthreads();
  if ((int)threadIdx.x < world && !failed(status)) {
    const unsigned long long start = now_ns();
    bool arrived = true;
    while ((int)(ld_acquire(flags + threadIdx.x) - epoch) < 0) {
      if (failed(status)) {
        arrived = false;
        break;
      }
      if (now_ns() - start > timeout_ns) {
        record(status, kTimeout, threadIdx.x, where);
        arrived = false;
        break;
      }
      __nanosleep(Tuning::kSleepNs);
    }
    // (the mark and its epoch were written before the flag's release: visible after its acquire)
    if (arrived && ld_acquire(flags + world + threadIdx.x) != 0 &&
        (int)(epoch - ld_acquire(flags + 2 * world + threadIdx.x)) >= 0)
      record(status, kPeerFailed, threadIdx.x, where);
  }
  __syncthreads();
  if (threadIdx.x == 0 && failed(status)) late = 1;
  __syncthreads();
  return late == 0;
}

// One thread: raise word `me` of every rank's flags (flag_ptrs) to `epoch`,
// after this thread's earlier writes are visible to the whole system. A rank
// whose status is failed still raises its flags, so that no peer waits out a
// timeout, but marks them failed first, once (the failed epoch visible before
// the mark, the mark before the flag: wait_peers), so that no peer takes what
// it skipped for what it wrote.
__device__ void raise_flags(unsigned long long const* flag_ptrs, int world, int me, unsigned epoch,
                            const int* status) {
  if (failed(status)) {
    for (int p = 0; p < world; ++p) {
      unsigned* region = reinterpret_cast<unsigned*>(flag_ptrs[p]);
      if (*((volatile unsigned*)(region + world + me)) == 0) {
        *((volatile unsigned*)(region + 2 * world + me)) = epoch;
        __threadfence_system();
        *((volatile unsigned*)(region + world + me)) = 1;
      }
    }
  }
  __threadfence_system();
  for (int p = 0; p < world; ++p) st_release(reinterpret_cast<unsigned*>(flag_ptrs[p]) + me, epoch);
}

// Raise the flags of `epoch` (raise_flags) and store it in seq, after this
// block's writes (and, through the counter, every block's writes of this
// launch) are visible to the whole system. counter: a zeroed int of the caller,
// reset here.
__device__ void signal_when_done(unsigned long long const* flag_ptrs, int world, int me, unsigned epoch,
                                 int* counter, unsigned* seq, const int* status) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    const int ticket = atomicAdd(counter, 1);
    if (ticket == (int)gridDim.x - 1) {
      raise_flags(flag_ptrs, world, me, epoch, status);
      *counter = 0;
      *seq = epoch;
    }
  }
}

// Rows [rows] of row_bytes each (at src, src_stride bytes apart) to dst
// (dst_stride bytes apart), a warp a row: this warp is `warp` of the `warps` that
// copy. 16-byte words where the rows, strides and src allow, else bytes.
__device__ __forceinline__ void copy_rows(const char* src, long long src_stride, long long row_bytes, long long rows,
                                          char* dst, long long dst_stride, long long warp, long long warps) {
  const int lane = threadIdx.x & 31;
  const bool wide = (row_bytes % 16) == 0 && (src_stride % 16) == 0 && (dst_stride % 16) == 0 &&
                    (reinterpret_cast<unsigned long long>(src) % 16) == 0;
  for (long long r = warp; r < rows; r += warps) {
    const char* from = src + r * src_stride;
    char* to = dst + r * dst_stride;
    if (wide) {
      for (long long i = lane; i < row_bytes / 16; i += 32)
        reinterpret_cast<uint4*>(to)[i] = __ldg(reinterpret_cast<const uint4*>(from) + i);
    } else {
      for (long long i = lane; i < row_bytes; i += 32) to[i] = from[i];
    }
  }
}

// -- element conversions (round to nearest even, as torch's casts) -----------

template <typename T> struct Elem;
template <> struct Elem<float> {
  static __device__ __forceinline__ float load(float v) { return v; }
  static __device__ __forceinline__ float store(float v) { return v; }
};
template <> struct Elem<double> {
  static __device__ __forceinline__ double load(double v) { return v; }
  static __device__ __forceinline__ double store(double v) { return v; }
};
template <> struct Elem<__half> {
  static __device__ __forceinline__ float load(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half store(float v) { return __float2half_rn(v); }
};
template <> struct Elem<__nv_bfloat16> {
  static __device__ __forceinline__ float load(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 store(float v) { return __float2bfloat16_rn(v); }
};

// Widen to the accumulator type A (float or double).
template <typename A, typename T> __device__ __forceinline__ A widen(T v) { return (A)Elem<T>::load(v); }

// Narrow an accumulator to T; fp64 goes through fp32 first (as torch and the
// Triton kernels convert), except to fp64 itself.
template <typename T> __device__ __forceinline__ T narrow(float v) { return Elem<T>::store(v); }
template <typename T> __device__ __forceinline__ T narrow(double v) {
  return Elem<T>::store(__double2float_rn(v));
}
template <> __device__ __forceinline__ double narrow<double>(double v) { return v; }
template <> __device__ __forceinline__ double narrow<double>(float v) { return (double)v; }

// Whether A and B are one type (NVRTC has no <type_traits> of its own).
template <typename A, typename B> inline constexpr bool same_type = false;
template <typename A> inline constexpr bool same_type<A, A> = true;

// 8 consecutive elements at a 16-byte-aligned (for 2-byte types) address.
template <typename T> struct alignas(16) Vec8 { T v[8]; };  // its 16-byte words aligned

template <typename T> __device__ __forceinline__ Vec8<T> load8(const T* p) {
  Vec8<T> out;
  constexpr int kWords = sizeof(Vec8<T>) / 16;
  static_assert(sizeof(Vec8<T>) % 16 == 0, "whole 16-byte words");
#pragma unroll
  for (int i = 0; i < kWords; ++i)
    reinterpret_cast<uint4*>(&out)[i] = reinterpret_cast<const uint4*>(p)[i];
  return out;
}

template <typename T> __device__ __forceinline__ void store8(T* p, const Vec8<T>& v) {
  constexpr int kWords = sizeof(Vec8<T>) / 16;
#pragma unroll
  for (int i = 0; i < kWords; ++i) {
    uint4 word;
    memcpy(&word, reinterpret_cast<const char*>(&v) + 16 * i, 16);
    __stwb(reinterpret_cast<uint4*>(p) + i, word);  // one 16-byte store (a plain assignment may be split in four)
  }
}

// A lane's U accumulated units (32 units apart from base; acc[u] the 8 elements
// of unit base + 32 u) narrowed to T and stored at out, those below units.
template <typename T, int U, typename A>
__device__ __forceinline__ void store_units(T* out, long long base, long long units, const A (&acc)[U][8]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (base + 32 * u >= units) continue;
    Vec8<T> o;
#pragma unroll
    for (int i = 0; i < 8; ++i) o.v[i] = narrow<T>(acc[u][i]);
    store8(out + (base + 32 * u) * 8, o);
  }
}

// One lane's units [first, units) (32 apart in groups of U) of a pre-sum: for
// each unit the count rows' values (weighted by scale) summed in ascending row
// order from zero, stored once as WireT. R rows' loads go out together, before
// any is summed (R * U units in flight); a row past the count re-reads the last
// one, unused, so that no branch comes between the loads.
template <int R, int U, bool WEIGHTED, typename A, typename YT, typename WireT>
__device__ __forceinline__ void presum_rows(const YT* const* rows, const A* scale, int count, long long first,
                                            long long units, WireT* out) {
  for (long long base = first; base < units; base += 32 * U) {
    A acc[U][8];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[u][i] = (A)0;
    for (int j0 = 0; j0 < count; j0 += R) {
      Vec8<YT> v[R][U];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const YT* row = rows[min(j0 + r, count - 1)];
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (base + 32 * u < units) v[r][u] = load8(row + (base + 32 * u) * 8);
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const bool live = j0 + r < count;
        const A w = WEIGHTED ? scale[min(j0 + r, count - 1)] : (A)1;
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            A next;
            if constexpr (WEIGHTED) next = fma(widen<A>(v[r][u].v[i]), w, acc[u][i]);
            else next = acc[u][i] + widen<A>(v[r][u].v[i]);
            acc[u][i] = live ? next : acc[u][i];
          }
      }
    }
    store_units(out, base, units, acc);
  }
}

// The route of one slot of a source token, written by route_layout.
struct Slot {
  int expert;  // global expert id, -1 for an empty slot
  int pos;     // place among the source's tokens sent to that expert (token order)
  int w_lo;    // routing weight bits (fp32 in w_lo, or fp64 in both)
  int w_hi;
};
static_assert(sizeof(Slot) == 16, "one 16-byte load per slot");

// Rows cut into segments, so that few rows (a decode step) still give every
// warp of the grid work and keep its loads in flight: `count` segments of
// `units` 8-element units each (a multiple of 32), at most one pass of a warp's
// lanes (kUnroll units each) per segment once rows are plenty. Rows whose H is
// not a multiple of 8 stay whole.
struct Segments {
  long long count;
  long long units;
};

__device__ __forceinline__ Segments split_rows(long long rows, int hidden, long long warps) {
  if ((hidden & 7) != 0 || rows <= 0) return {1, (long long)hidden};
  const long long units = hidden / 8;
  const long long pass = 32LL * Tuning::kUnroll;
  const long long wanted = (2 * warps + rows - 1) / rows;  // two work items per warp
  const long long count = max(1LL, min(wanted, (units + pass - 1) / pass));
  return {count, ((units + count - 1) / count + 31) / 32 * 32};
}

// Which (source rank, index) item `item` is, from the items of each source
// (tokens_of: the tokens each source sends this rank). Items interleave the
// sources one by one (while every source has items left: the first W * the
// least items), so that the warps of a grid work on every source at once and
// the NVLink transfers of the peers' items run beside the local items' HBM
// traffic; then the rest of each source in turn.
__device__ __forceinline__ void item_of(long long item, const int* tokens_of, int world, int* src, int* tok) {
  int least = tokens_of[0];
  for (int s = 1; s < world; ++s) least = min(least, tokens_of[s]);
  const long long mixed = (long long)least * world;
  if (item < mixed) {
    *src = (int)(item % world);
    *tok = (int)(item / world);
    return;
  }
  item -= mixed;
  int s = 0;
  while (s + 1 < world && item >= tokens_of[s] - least) {
    item -= tokens_of[s] - least;
    ++s;
  }
  *src = s;
  *tok = least + (int)item;
}

}  // namespace engine
