// The NVSHMEM transport's exchanges, put by the sender straight to their places
// at the receivers (dispatch/kernels/nvshmem_puts.py): the rows to the experts
// from the tokens themselves (row send_token[i] of x; no send buffer, no pack
// pass), and every other exchange from rows made in send order (send_token
// null: row i of x). Built with NVSHMEM's device library (nvcc -rdc,
// nvlink with the wheel's libnvshmem_device.a) into a cubin, initialised in the
// NVSHMEM instance torch's symmetric memory started.
//
// Rows go out destination-major (sends[d] rows to rank d, in the send order of
// send_token); rank d keeps them source-major, this rank's at row at[d] of its
// receive buffer. The caller brackets the launch with NVSHMEM's barrier: before,
// so that no receiver still reads its buffer; after, so that every row landed.

#include <nvshmem.h>
#include <nvshmemx.h>

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
