// The engine's per-call host work, compiled (dispatch/host.py builds it at first use).
//
// A Launcher is one kernel's launches of one shape: its parameter block with the
// values that hold for every such launch packed once (by dispatch.cuda.Launch,
// from the kernel's signature in csrc/); each launch writes only the free values
// at their places and calls the driver.
//
// `counts_plan` is the host side of a dispatch's counts exchange on the engine
// (dispatch/nvlink.py, Engine.exchange_counts with its host read) in one call:
// the dispatch's int32 words and its tokens per expert allocated, the routing
// layout and the counts exchange launched, the counts matrix read back, and
// what the host needs of it summed (every rank's header, sends and rows); in
// the usual case also the handle's tensors and, for a dispatch that moves at
// once, its pull. `pull` and `to_home` are a dispatch's pull and a combine's push
// and home sum, each with its output allocated, in one call.
//
// The driver's entry points are found in libcuda.so.1 at first use (nothing is
// linked): the extension builds wherever torch's headers and CUDA's cuda.h are.
// `reserved_bytes` reads torch's CUDA caching allocator (where torch has CUDA);
// `board_agree` is the agreement of dispatch/board.py on its shared words.
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/python_variable.h>
#if __has_include(<c10/cuda/impl/cuda_cmake_macros.h>)  // torch's CUDA headers (a CPU build of torch lacks them)
#include <c10/cuda/CUDACachingAllocator.h>
#define DISPATCH_HOST_ALLOCATOR 1
#endif
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>
#include <cuda.h>
#include <dlfcn.h>

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <thread>
#include <vector>

namespace {

namespace py = pybind11;

using LaunchEx = CUresult (*)(const CUlaunchConfig*, CUfunction, void**, void**);
using CopyDtoH = CUresult (*)(void*, CUdeviceptr, size_t, CUstream);
using Synchronize = CUresult (*)(CUstream);
using ErrorText = CUresult (*)(CUresult, const char**);
using Record = CUresult (*)(CUevent, CUstream);
using MemInfo = CUresult (*)(size_t*, size_t*);
using CtxDevice = CUresult (*)(CUdevice*);

struct Driver {
  LaunchEx launch = nullptr;
  CopyDtoH copy_to_host = nullptr;
  Synchronize synchronize = nullptr;
  ErrorText name = nullptr, text = nullptr;
  Record record = nullptr;
  MemInfo mem_info = nullptr;
  CtxDevice ctx_device = nullptr;
};

const Driver& driver() {
  static const Driver found = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (lib == nullptr) throw std::runtime_error("libcuda.so.1 could not be opened");
    Driver d;
    d.launch = reinterpret_cast<LaunchEx>(dlsym(lib, "cuLaunchKernelEx"));
    d.copy_to_host = reinterpret_cast<CopyDtoH>(dlsym(lib, "cuMemcpyDtoHAsync_v2"));
    d.synchronize = reinterpret_cast<Synchronize>(dlsym(lib, "cuStreamSynchronize"));
    d.name = reinterpret_cast<ErrorText>(dlsym(lib, "cuGetErrorName"));
    d.text = reinterpret_cast<ErrorText>(dlsym(lib, "cuGetErrorString"));
    d.record = reinterpret_cast<Record>(dlsym(lib, "cuEventRecord"));
    d.mem_info = reinterpret_cast<MemInfo>(dlsym(lib, "cuMemGetInfo_v2"));
    d.ctx_device = reinterpret_cast<CtxDevice>(dlsym(lib, "cuCtxGetDevice"));
    if (!d.launch || !d.copy_to_host || !d.synchronize || !d.name || !d.text || !d.record || !d.mem_info ||
        !d.ctx_device)
      throw std::runtime_error("libcuda.so.1 lacks cuLaunchKernelEx, cuMemcpyDtoHAsync_v2, cuStreamSynchronize, "
                               "cuEventRecord, cuMemGetInfo_v2 or cuCtxGetDevice");
    return d;
  }();
  return found;
}

void check(CUresult result, const char* call) {
  if (result == CUDA_SUCCESS) return;
  const char* name = nullptr;
  const char* text = nullptr;
  driver().name(result, &name);
  driver().text(result, &text);
  throw std::runtime_error(std::string(call) + " failed: " + (name ? name : "?") + " (" +
                           std::to_string(static_cast<int>(result)) + "): " + (text ? text : ""));
}

// The order of an operation issued here (dispatch/nvlink_order.py): where `event` is
// not 0, it is recorded on `stream` after every launch the call made: by `now()` as the
// call returns (a failed record raises, as a failed launch does), else as it unwinds
// from an exception (best effort: a destructor does not throw). The event is the
// engine's eager one, which the next operation on another stream waits for.
class RecordAtExit {
 public:
  RecordAtExit(uint64_t event, uint64_t stream) : event_(event), stream_(stream) {}
  RecordAtExit(const RecordAtExit&) = delete;
  RecordAtExit& operator=(const RecordAtExit&) = delete;
  void now() {
    const uint64_t event = event_;
    event_ = 0;
    if (event != 0)
      check(driver().record(reinterpret_cast<CUevent>(event), reinterpret_cast<CUstream>(stream_)), "cuEventRecord");
  }
  ~RecordAtExit() {
    if (event_ != 0)
      (void)driver().record(reinterpret_cast<CUevent>(event_), reinterpret_cast<CUstream>(stream_));
  }

 private:
  uint64_t event_;
  const uint64_t stream_;
};

// One kernel's launches of one shape (dispatch.cuda.Launch): its parameter block
// with the bound values packed, and the place and C type of each free value. It
// does not change once made: each launch writes its free values into a copy of
// the block (the driver copies the parameters at the call), so launches from
// several threads do not meet.
class Launcher {
 public:
  Launcher(uint64_t function, unsigned threads, bool dependent, const std::string& block, const std::string& codes,
           const std::vector<int64_t>& offsets, const std::vector<int64_t>& free)
      : function_(reinterpret_cast<CUfunction>(function)), threads_(threads), dependent_(dependent),
        block_(block.begin(), block.end()), offsets_(offsets) {
    if (offsets.size() != codes.size()) throw std::invalid_argument("Launcher: one offset a parameter");
    for (size_t p = 0; p < offsets.size(); ++p) {
      if (offsets[p] < 0 || offsets[p] + size_of(codes[p]) > static_cast<int64_t>(block_.size()))
        throw std::invalid_argument("Launcher: the block is shorter than its parameters");
    }
    for (int64_t p : free) {
      if (p < 0 || p >= static_cast<int64_t>(codes.size())) throw std::invalid_argument("Launcher: free place");
      free_at_.push_back(offsets[p]);
      free_code_.push_back(codes[p]);
    }
  }
  Launcher(const Launcher&) = delete;
  Launcher& operator=(const Launcher&) = delete;

  // free values from Python (ints; floats where the parameter is one), in order
  void launch_py(unsigned blocks, unsigned shared, uint64_t stream, const py::tuple& values) {
    std::vector<unsigned char> block = block_;
    fill_py(block, values);
    launch(block, blocks, shared, stream);
  }

  // the parameter block a launch with these free values hands the driver
  py::bytes block_of(const py::tuple& values) const {
    std::vector<unsigned char> block = block_;
    fill_py(block, values);
    return py::bytes(reinterpret_cast<const char*>(block.data()), block.size());
  }

  // the free values as 64-bit words (an int parameter's as a signed one), from C++
  void launch_words(unsigned blocks, unsigned shared, uint64_t stream, std::initializer_list<uint64_t> values) const {
    if (values.size() != free_at_.size()) throw std::invalid_argument("Launcher: one value a free parameter");
    std::vector<unsigned char> block = block_;
    size_t i = 0;
    for (uint64_t v : values) {
      const char code = free_code_[i];
      const auto value = static_cast<int64_t>(v);
      if ((code == 'i' && (value < INT32_MIN || value > INT32_MAX)) || (code == 'I' && v > UINT32_MAX))
        throw py::value_error("Launcher: argument " + std::to_string(i) + " out of range for its C type");
      put(block, i++, v);
    }
    launch(block, blocks, shared, stream);
  }

 private:
  // each integer within its C type, as struct.pack holds a Python launch's
  void fill_py(std::vector<unsigned char>& block, const py::tuple& values) const {
    if (values.size() != free_at_.size()) throw std::invalid_argument("Launcher: one value a free parameter");
    for (size_t i = 0; i < free_at_.size(); ++i) {
      PyObject* v = values[i].ptr();
      const char code = free_code_[i];
      if (code == 'f' || code == 'd') {
        const double real = PyFloat_AsDouble(v);
        if (PyErr_Occurred()) throw py::error_already_set();
        if (code == 'f') {
          const float f = static_cast<float>(real);
          std::memcpy(block.data() + free_at_[i], &f, 4);
        } else {
          std::memcpy(block.data() + free_at_[i], &real, 8);
        }
        continue;
      }
      int overflow = 0;
      const long long value = PyLong_AsLongLongAndOverflow(v, &overflow);
      if (PyErr_Occurred()) throw py::error_already_set();
      uint64_t word = static_cast<uint64_t>(value);
      bool fits = overflow == 0;
      if (code == 'i') fits = fits && value >= INT32_MIN && value <= INT32_MAX;
      if (code == 'I') fits = fits && value >= 0 && value <= UINT32_MAX;
      if (code == 'Q' && overflow > 0) {  // an address past 2^63
        word = PyLong_AsUnsignedLongLong(v);
        fits = !PyErr_Occurred();
        PyErr_Clear();
      } else if (code == 'Q') {
        fits = fits && value >= 0;
      }
      if (!fits) throw py::value_error("Launcher: argument " + std::to_string(i) + " out of range for its C type");
      put(block, i, word);
    }
  }

  static int64_t size_of(char code) { return code == 'i' || code == 'I' || code == 'f' ? 4 : 8; }

  void put(std::vector<unsigned char>& block, size_t i, uint64_t v) const {
    unsigned char* at = block.data() + free_at_[i];
    switch (free_code_[i]) {
      case 'i': case 'I': { const auto w = static_cast<uint32_t>(v); std::memcpy(at, &w, 4); break; }
      case 'q': case 'Q': std::memcpy(at, &v, 8); break;
      default: throw std::invalid_argument("Launcher: a real parameter takes a float");
    }
  }

  void launch(std::vector<unsigned char>& block, unsigned blocks, unsigned shared, uint64_t stream) const {
    std::vector<void*> params(offsets_.size() + 1, nullptr);  // (one past for a kernel of no parameters)
    for (size_t p = 0; p < offsets_.size(); ++p) params[p] = block.data() + offsets_[p];
    CUlaunchAttribute attribute{};
    attribute.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attribute.value.programmaticStreamSerializationAllowed = 1;
    CUlaunchConfig config{};
    config.gridDimX = blocks > 0 ? blocks : 1;
    config.gridDimY = config.gridDimZ = 1;
    config.blockDimX = threads_;
    config.blockDimY = config.blockDimZ = 1;
    config.sharedMemBytes = shared;
    config.hStream = reinterpret_cast<CUstream>(stream);
    config.attrs = &attribute;
    config.numAttrs = dependent_ ? 1 : 0;
    check(driver().launch(&config, function_, params.data(), nullptr), "cuLaunchKernelEx");
  }

  const CUfunction function_;
  const unsigned threads_;
  const bool dependent_;
  const std::vector<unsigned char> block_;
  const std::vector<int64_t> offsets_;
  std::vector<int64_t> free_at_;
  std::vector<char> free_code_;
};

// What one shape of dispatch asks of the counts exchange on the host, fixed for
// the shape (dispatch/host.py: counts_launchers).
struct CountsShape {
  int64_t tokens, topk, world, rank, row_len, counts_col, experts_per_rank;
  int64_t tokens_col, staged_col, sends_col, header_len, failed_col;
  std::vector<int64_t> sizes;  // int32 words of the routes, lists, hits, exchange output, scan sums
  int64_t layout_blocks, layout_shared, counts_shared;
  // the header's columns (plan.HEADER): those every rank must agree on come first
  int64_t agreed, x_grad_col, weights_grad_col, max_rows_col, memory_rows_col;
};

// Whether every rank's header agrees with rank 0's on the columns that must agree,
// none is marked failed and every rank's rows are within its budgets: the usual
// case, in which the checks of dispatch/checks.py (check_peer_headers,
// check_row_budgets) pass and say nothing; anything else is left to them.
bool usual(const CountsShape& s, const int32_t* rows, const std::vector<int64_t>& rows_of) {
  for (int64_t r = 0; r < s.world; ++r) {
    const int32_t* h = rows + r * s.row_len;
    if (h[s.failed_col] != 0 || std::memcmp(h, rows, 4 * s.agreed) != 0) return false;
    const int64_t n = rows_of[r], m = h[s.max_rows_col], f = h[s.memory_rows_col];
    if ((0 <= m && m < n) || (0 <= f && f < (n > m ? n : m))) return false;
  }
  return true;
}

// Bytes torch's CUDA caching allocator holds on ``device`` (reserved from the device, in
// use or not), read from the allocator itself (in libc10_cuda, which torch's CUDA build
// loads; found at first use, nothing linked); -1 where there is none (a CPU build) or it
// cannot say. It is called through the class of torch's headers this was built against:
// the build is one per torch version (dispatch/host.py).
int64_t reserved_bytes(int64_t device) {
#ifndef DISPATCH_HOST_ALLOCATOR
  (void)device;
  return -1;
#else
  using Allocator = c10::cuda::CUDACachingAllocator::CUDAAllocator;
  static auto* const found = reinterpret_cast<std::atomic<Allocator*>*>(
      dlsym(RTLD_DEFAULT, "_ZN3c104cuda20CUDACachingAllocator9allocatorE"));
  Allocator* allocator = found == nullptr ? nullptr : found->load();
  if (allocator == nullptr || !allocator->initialized()) return -1;
  try {
    return allocator->getDeviceStats(static_cast<c10::DeviceIndex>(device)).reserved_bytes[0].current;
  } catch (const std::exception&) {  // a device it does not serve
    return -1;
  }
#endif
}

// A device's free memory as the dispatches' budgets read it (dispatch/checks.py,
// FreeMemory, which this serves where the compiled path is loaded): the driver's
// reading kept ``age`` seconds, less what torch's caching allocator reserved from
// the device since (``reserved``: its reserved bytes now, reserved_bytes, where
// they count every allocation of this process; else -1: the driver read every
// time), read again where older or forgotten (forget_free_bytes: memory allocated
// outside torch). -2 where ``device`` is not the current one (the caller reads the
// driver itself).
struct FreeReading {
  std::chrono::steady_clock::time_point when;
  int64_t free = 0, reserved = 0;
  bool valid = false;
};
std::vector<FreeReading> free_readings;

int64_t free_bytes(int64_t device, double age, int64_t reserved) {
  CUdevice current = -1;
  if (device < 0 || driver().ctx_device(&current) != CUDA_SUCCESS || current != device) return -2;
  if (free_readings.size() <= static_cast<size_t>(device)) free_readings.resize(device + 1);
  FreeReading& read = free_readings[device];
  const auto now = std::chrono::steady_clock::now();
  if (reserved >= 0 && read.valid && std::chrono::duration<double>(now - read.when).count() < age)
    return read.free - (reserved - read.reserved);
  size_t free = 0, total = 0;
  check(driver().mem_info(&free, &total), "cuMemGetInfo");
  if (reserved >= 0) read = FreeReading{now, static_cast<int64_t>(free), reserved, true};
  return static_cast<int64_t>(free);
}

void forget_free_bytes() { free_readings.clear(); }

// A tensor of ``dtype`` over ``base``'s memory, ``offset`` elements of ``dtype`` from
// its start, of ``sizes`` and ``strides``: what slice, view and as_strided give, made
// without the dispatcher (microseconds each on every dispatch). Its version counter is
// its own (no autograd ever sees these: the handle's tables and the places' sources).
at::Tensor alias(const at::Tensor& base, at::ScalarType dtype, c10::IntArrayRef sizes, c10::IntArrayRef strides,
                 int64_t offset) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(base.storage()), base.key_set(),
                                                   c10::scalarTypeToTypeMeta(dtype));
  impl->set_sizes_and_strides(sizes, strides, base.storage_offset() * base.element_size() /
                                                  static_cast<int64_t>(c10::elementSize(dtype)) + offset);
  return at::Tensor(std::move(impl));
}

// How long the last host read of a counts exchange (in this process) waited for
// the GPU, in ns: what a measure of the host's own time leaves out (bench/).
std::atomic<int64_t> last_wait_ns{0};

int64_t word_at(const std::vector<int64_t>& sizes, size_t part) {
  int64_t at = 0;
  for (size_t i = 0; i < part; ++i) at += sizes[i];
  return at;
}

// The counts exchange of one dispatch, read back: see the file's comment. Returns
// (status code, peer, where) where the kernels recorded a failure; else
// (words: the dispatch's int32 words, its routes, lists, hits and the exchange's output
// (dispatch/nvlink_layout.py, WordsAt), then its tokens per expert; tokens_per_expert,
// a view of them; tokens_at; headers: every rank's header; sends: every rank's tokens to every rank;
// rows: the N of every rank; this rank's rows of each local expert, a CPU int64
// tensor; bound: the largest T; received: this rank's (source, token) items;
// staged: every rank staged its rows with the counts; and, where ``width`` > 0 and the
// usual case holds (``usual``), the handle's tensors and what the checks would give:
// (x_grad and weights_grad of any rank, presum, slot_k [W * bound, width] int32,
// weights [N] of weights_dtype, src_rank, src_token [N] int64, then the rows pulled:
// [N, H] of ``rows``' dtype where ``pull`` is given and every rank staged, else None),
// else None).
//
// ``pull``: the dispatch's own pull (dispatch/nvlink_moves.py, EngineMoves.to_experts)
// of its rows ``x`` [T, H], issued here in the usual case, after the handle's tensors
// it writes; its grid as
// EngineMoves._row_grid: min(pull_cap, max(pull_min, ceil(rows / rows_per_block))).
//
// ``record``: the engine's eager event, recorded after its launches as it returns or
// raises (or 0: the caller orders the operation). An allocation or launch that fails raises; the engine's state
// is then that of a Python launch that failed.
py::tuple counts_plan(const CountsShape& s, Launcher* layout, Launcher& counts, const at::Tensor& topk_idx,
                      const at::Tensor& weights, uint64_t stage_src, int64_t src_stride, uint64_t row_at, bool bad,
                      const std::vector<int64_t>& header, uint64_t stream, const at::Tensor& host, int64_t width,
                      at::ScalarType weights_dtype, Launcher* pull, const at::Tensor& x, int64_t pull_cap,
                      int64_t pull_min, int64_t rows_per_block, uint64_t record) {
  RecordAtExit order(record, stream);
  const int64_t T = s.tokens, K = s.topk, W = s.world, L = s.row_len, local = s.experts_per_rank;
  TORCH_CHECK(topk_idx.is_contiguous() && topk_idx.numel() == T * K && weights.is_contiguous() &&
                  weights.numel() == T * K && weights.device() == topk_idx.device(),
              "counts_plan: topk_idx and weights must be contiguous [T, K] of the shape, on one device");
  TORCH_CHECK(host.device().is_cpu() && host.scalar_type() == at::kInt && host.is_contiguous() &&
                  host.numel() >= 4 + W * L,
              "counts_plan: the host words must be int32 on the host, 4 + W L of them");
  TORCH_CHECK(header.size() == static_cast<size_t>(s.header_len), "counts_plan: the header has ", s.header_len,
              " entries");
  auto device = topk_idx.device();
  int64_t words = 0;
  for (int64_t n : s.sizes) words += n;
  // the dispatch's int32 words and, after them (8-byte aligned), its tokens per expert: one allocation
  const int64_t per_at = (words + 1) / 2 * 2;
  at::Tensor meta = at::empty({per_at + 2 * local}, at::TensorOptions().dtype(at::kInt).device(device));
  at::Tensor per_expert = alias(meta, at::kLong, {local}, {1}, per_at / 2);
  auto base = reinterpret_cast<uint64_t>(meta.data_ptr<int32_t>());
  const uint64_t route = base, lists = base + 4 * word_at(s.sizes, 1), hit = base + 4 * word_at(s.sizes, 2);
  const uint64_t out = base + 4 * word_at(s.sizes, 3), scan_sums = base + 4 * word_at(s.sizes, 4);
  if (T > 0) {
    if (layout == nullptr) throw std::invalid_argument("counts_plan: tokens without a layout launch");
    layout->launch_words(
        s.layout_blocks, s.layout_shared, stream,
        {reinterpret_cast<uint64_t>(topk_idx.data_ptr()), reinterpret_cast<uint64_t>(weights.data_ptr()), route,
         row_at + 4 * s.counts_col, row_at + 4 * s.sends_col, lists, row_at + 4 * s.row_len, scan_sums, hit,
         bad ? row_at + 4 * s.failed_col : 0, stage_src, static_cast<uint64_t>(src_stride)});
  }
  const int64_t places_words = 4 + W * L;  // src_start, then num_rows, then group_end
  counts.launch_words(
      1, s.counts_shared, stream,
      {row_at, static_cast<uint64_t>(header[0]), static_cast<uint64_t>(header[1]), static_cast<uint64_t>(header[2]),
       static_cast<uint64_t>(header[3]), static_cast<uint64_t>(header[4]), static_cast<uint64_t>(header[5]),
       static_cast<uint64_t>(header[6]), static_cast<uint64_t>(header[7]), static_cast<uint64_t>(header[8]),
       static_cast<uint64_t>(header[9]), static_cast<uint64_t>(header[10]), static_cast<uint64_t>(header[11]), out,
       reinterpret_cast<uint64_t>(per_expert.data_ptr()), out + 4 * places_words,
       out + 4 * (places_words + W * local), out + 4 * (places_words + W * local + 1)});
  // host sync: the counts matrix and the status, into this engine's pinned words
  auto* words_host = host.data_ptr<int32_t>();
  {
    py::gil_scoped_release release;
    check(driver().copy_to_host(words_host, static_cast<CUdeviceptr>(out), 4 * (4 + W * L),
                                reinterpret_cast<CUstream>(stream)), "cuMemcpyDtoHAsync");
    const auto waited = std::chrono::steady_clock::now();
    check(driver().synchronize(reinterpret_cast<CUstream>(stream)), "cuStreamSynchronize");
    last_wait_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - waited)
                       .count();
  }
  if (words_host[0] != 0) {
    order.now();
    return py::make_tuple(words_host[0], words_host[1], words_host[2]);
  }
  py::list headers(W), sends(W), rows(W);
  std::vector<int64_t> rows_of(W, 0);
  at::Tensor mine_host = at::zeros({local}, at::TensorOptions().dtype(at::kLong));
  auto* per = mine_host.data_ptr<int64_t>();
  int64_t bound = 1, received = 0;
  bool staged = true;
  for (int64_t r = 0; r < W; ++r) {
    const int32_t* row = words_host + 4 + r * L;
    py::list h(s.header_len);
    for (int64_t c = 0; c < s.header_len; ++c) h[c] = row[c];
    headers[r] = h;
    py::tuple to(W);
    for (int64_t d = 0; d < W; ++d) to[d] = row[s.sends_col + d];
    sends[r] = to;
    staged = staged && row[s.staged_col] != 0;
    if (row[s.tokens_col] > bound) bound = row[s.tokens_col];
    received += row[s.sends_col + s.rank];
    const int32_t* by_expert = row + s.counts_col;
    for (int64_t d = 0; d < W; ++d)
      for (int64_t e = 0; e < local; ++e) rows_of[d] += by_expert[d * local + e];
    for (int64_t e = 0; e < local; ++e) per[e] += by_expert[s.rank * local + e];
  }
  for (int64_t d = 0; d < W; ++d) rows[d] = rows_of[d];
  // the handle's int32 tables: each item's token (tokens_at), then, in the usual case,
  // its rows here and their slots (presum, slot_k [W * bound, width])
  const int64_t items = W * bound;
  const bool planned = width > 0 && usual(s, words_host + 4, rows_of);
  // in the usual case one allocation: the tables, then (8-byte aligned) the places' sources [2, N] int64;
  // their weights [N] apart (a dispatch's output that combine's backward keeps: a tensor of its own, whose
  // version no in-place change of another output moves)
  const int64_t n = rows_of[s.rank];
  const int64_t table_words = items * (planned ? 1 + 2 * width : 1), sources_at = (table_words + 1) / 2 * 2;
  at::Tensor tables = at::empty({planned ? sources_at + 4 * n : table_words}, meta.options());
  py::object handle = py::none();
  if (planned) {
    bool x_grad = false, weights_grad = false;
    for (int64_t r = 0; r < W; ++r) {
      x_grad = x_grad || words_host[4 + r * L + s.x_grad_col] != 0;
      weights_grad = weights_grad || words_host[4 + r * L + s.weights_grad_col] != 0;
    }
    const int64_t sources = sources_at / 2;  // (in int64 words)
    at::Tensor places = at::empty({n}, weights.options().dtype(weights_dtype));
    py::object pulled = py::none();
    if (pull != nullptr && staged) {
      TORCH_CHECK(x.dim() == 2 && x.size(0) == T && rows_per_block > 0,
                  "counts_plan: the rows to pull are [T, H] of the shape");
      at::Tensor tokens = at::empty({n, x.size(1)}, x.options());
      const int64_t most = received > n ? received : n;
      int64_t blocks = (most + rows_per_block - 1) / rows_per_block;
      blocks = blocks > pull_min ? blocks : pull_min;
      blocks = blocks < pull_cap ? blocks : pull_cap;
      const auto table = reinterpret_cast<uint64_t>(tables.data_ptr<int32_t>());
      const auto from = reinterpret_cast<uint64_t>(tables.data_ptr<int32_t>()) + 8 * sources;
      const auto un = static_cast<uint64_t>(n);
      pull->launch_words(static_cast<unsigned>(blocks), 0, stream,
                         {out + 16, table, table + 4 * items, static_cast<uint64_t>(bound), out + 4 * places_words,
                          out + 4 * (places_words + W * local), reinterpret_cast<uint64_t>(tokens.data_ptr()), un,
                          table + 4 * items * (1 + width), reinterpret_cast<uint64_t>(places.data_ptr()), from,
                          from + 8 * un, 0, un, un});
      pulled = py::cast(tokens);
    }
    handle = py::make_tuple(x_grad, weights_grad, alias(tables, at::kInt, {items, width}, {width, 1}, items),
                            alias(tables, at::kInt, {items, width}, {width, 1}, items * (1 + width)), places,
                            alias(tables, at::kLong, {n}, {1}, sources),
                            alias(tables, at::kLong, {n}, {1}, sources + n), pulled);
  }
  order.now();
  return py::make_tuple(
      meta, per_expert, alias(tables, at::kInt, {items}, {1}, 0), py::tuple(headers), py::tuple(sends), py::tuple(rows),
      mine_host,
      bound, received, staged, handle);
}

// The rows of a dispatch pulled to this rank's experts (dispatch/nvlink_moves.py,
// EngineMoves.to_experts for a dispatch's own rows staged with its counts): new
// [N, H] rows of rows' dtype, the places' weights and sources written beside.
at::Tensor pull(Launcher& launcher, unsigned blocks, const at::Tensor& rows, int64_t num_rows, uint64_t matrix,
                uint64_t tokens_at, uint64_t presum, int64_t tstride, uint64_t src_start, uint64_t num_rows_at,
                uint64_t slot_k, uint64_t weights, uint64_t src_rank, uint64_t src_token, uint64_t stream) {
  at::Tensor out = at::empty({num_rows, rows.size(1)}, rows.options());
  const auto n = static_cast<uint64_t>(num_rows);
  launcher.launch_words(blocks, 0, stream,
                        {matrix, tokens_at, presum, static_cast<uint64_t>(tstride), src_start, num_rows_at,
                         reinterpret_cast<uint64_t>(out.data_ptr()), n, slot_k, weights, src_rank, src_token, 0, n, n});
  return out;
}

// A combine's movement on the engine (dispatch/nvlink_moves.py, EngineMoves.to_home):
// every pre-sum pushed home (push_partials), then summed there (home_sum) into new
// [T, H] rows of rows' dtype; ``record`` as counts_plan's.
at::Tensor to_home(Launcher& push, unsigned push_blocks, Launcher& home, unsigned home_blocks,
                   const at::Tensor& rows, uint64_t weights, uint64_t matrix, uint64_t tokens_at, uint64_t presum,
                   int64_t tstride, uint64_t hit, int64_t tokens, uint64_t stream, uint64_t record) {
  RecordAtExit order(record, stream);
  push.launch_words(push_blocks, 0, stream,
                    {reinterpret_cast<uint64_t>(rows.data_ptr()), weights, 0, 0, 0, 0, 0, uint64_t{1} << 62, matrix,
                     tokens_at, presum, static_cast<uint64_t>(tstride), 1});
  at::Tensor out = at::empty({tokens, rows.size(1)}, rows.options());
  home.launch_words(home_blocks, 0, stream,
                    {hit, static_cast<uint64_t>(tokens), reinterpret_cast<uint64_t>(out.data_ptr())});
  order.now();
  return out;
}

// The time this process's compiled agreements waited for their peers, in ns, summed:
// what a measure of the host's own time leaves out (bench/), as last_wait_ns.
std::atomic<int64_t> board_wait_ns{0};

// The board's agreement (dispatch/board.py: the protocol, the words and their
// order), compiled: each word written with release and read with acquire order,
// so that it holds wherever the ranks share memory, not only where stores keep
// their program order (x86-64, which the agreement in Python relies on). The
// words are the board's mapped page at ``words_at``: two copies of W slots
// [arrived, confirmed, row...] of ``slot`` int64 words; ``count_at`` the int64
// count of this rank's agreements (shared with the Python agreement). The
// waits release the GIL: spinning with a yield for 2 ms, then sleeping from
// 20 us, doubling up to 1 ms, with the GIL taken after each sleep to run
// Python's signal handlers (a KeyboardInterrupt withdraws, then raises).
// Returns every rank's first ``width`` row words ([W][width] lists), or
// (missing ranks, peers that withdrew) where this rank gave up, past
// ``timeout`` seconds or at a peer's withdrawal, having withdrawn (-k in its
// first word) as board.py's Board._wait does.
class BoardWait {
 public:
  BoardWait(int64_t* copy, int64_t world, int64_t slot, int64_t rank, int64_t k, double timeout)
      : copy_(copy), world_(world), slot_(slot), rank_(rank), k_(k), timeout_(timeout) {}

  // until word ``word`` of every slot reads k; false where this rank gave up
  bool until(int64_t word) {
    if (all_at(word)) return true;
    py::gil_scoped_release release;
    const auto entered = std::chrono::steady_clock::now();
    struct Waited {  // the time waited, counted as the wait ends (board_wait_ns)
      std::chrono::steady_clock::time_point from;
      ~Waited() {
        board_wait_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - from)
                             .count();
      }
    } waited_for{entered};
    if (!started_) {  // the clock runs from the first wait, through the agreement's two
      start_ = entered;
      started_ = true;
    }
    auto pause = std::chrono::microseconds(20);
    while (true) {
      if (all_at(word)) return true;
      bool withdrawn = false;
      for (int64_t r = 0; r < world_; ++r) withdrawn = withdrawn || load(r, 0) == -k_;
      const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - start_;
      if (withdrawn || waited.count() > timeout_) {
        __atomic_store_n(copy_ + rank_ * slot_, -k_, __ATOMIC_SEQ_CST);  // withdrawn: the others stop too
        if (word == 1 && all_at(1)) {  // every rank confirmed meanwhile
          __atomic_store_n(copy_ + rank_ * slot_, k_, __ATOMIC_SEQ_CST);
          return true;
        }
        return false;
      }
      if (waited.count() < 2e-3) {
        sched_yield();
      } else {
        std::this_thread::sleep_for(pause);
        pause = std::min(2 * pause, std::chrono::microseconds(1000));
        py::gil_scoped_acquire acquire;  // a signal (Ctrl-C) ends a long wait, as in Python's sleep
        if (PyErr_CheckSignals() != 0) {
          __atomic_store_n(copy_ + rank_ * slot_, -k_, __ATOMIC_SEQ_CST);  // withdrawn: the others stop too
          throw py::error_already_set();
        }
      }
    }
  }

  // (missing, withdrawn) of a wait for ``word`` given up
  py::tuple who(int64_t word) const {
    py::list missing, withdrawn;
    for (int64_t r = 0; r < world_; ++r) {
      if (r != rank_ && load(r, 0) == -k_) withdrawn.append(r);  // (this rank withdrew too, as it gave up)
      if (load(r, word) != k_ && load(r, 0) != -k_) missing.append(r);
    }
    return py::make_tuple(missing, withdrawn);
  }

 private:
  int64_t load(int64_t r, int64_t word) const { return __atomic_load_n(copy_ + r * slot_ + word, __ATOMIC_ACQUIRE); }
  bool all_at(int64_t word) const {
    for (int64_t r = 0; r < world_; ++r)
      if (load(r, word) != k_) return false;
    return true;
  }

  int64_t* const copy_;
  const int64_t world_, slot_, rank_, k_;
  const double timeout_;
  bool started_ = false;
  std::chrono::steady_clock::time_point start_;
};

// The board's words of one group (dispatch/board.py, Board): its mapped page, the
// int64 words of a slot, this rank's count of agreements, the dispatcher's timeout.
struct BoardAt {
  uint64_t words_at = 0, count_at = 0;
  int64_t world = 0, rank = 0, slot = 0;
  double timeout = 0;
};

// One agreement on the board: ``row`` written, every rank's first ``width`` words
// read into ``out`` ([W][width]). Returns None, or (missing, withdrawn) where this
// rank gave up waiting and withdrew (board.py's Board._wait).
py::object agree_into(const BoardAt& b, const int64_t* row, int64_t len, int64_t width, int64_t* out) {
  if (len > b.slot - 2 || width > b.slot - 2 || b.world < 1 || b.rank < 0 || b.rank >= b.world)
    throw std::invalid_argument("board_agree: a row longer than a slot's, or no such rank");
  auto* count = reinterpret_cast<int64_t*>(b.count_at);
  const int64_t k = ++*count;
  int64_t* copy = reinterpret_cast<int64_t*>(b.words_at) + (k % 2) * b.world * b.slot;
  int64_t* mine = copy + b.rank * b.slot;
  for (int64_t i = 0; i < len; ++i) __atomic_store_n(mine + 2 + i, row[i], __ATOMIC_RELAXED);
  __atomic_store_n(mine, k, __ATOMIC_RELEASE);  // after the row: a peer that reads k reads the row
  BoardWait wait(copy, b.world, b.slot, b.rank, k, b.timeout);
  if (!wait.until(0)) return wait.who(0);
  __atomic_store_n(mine + 1, k, __ATOMIC_RELEASE);  // saw every rank arrive
  if (!wait.until(1)) return wait.who(1);
  for (int64_t r = 0; r < b.world; ++r)
    for (int64_t i = 0; i < width; ++i)
      out[r * width + i] = __atomic_load_n(copy + r * b.slot + 2 + i, __ATOMIC_RELAXED);
  return py::none();
}

py::list rows_list(const int64_t* rows, int64_t world, int64_t width) {
  py::list out(world);
  for (int64_t r = 0; r < world; ++r) {
    py::list got(width);
    for (int64_t i = 0; i < width; ++i) got[i] = rows[r * width + i];
    out[r] = got;
  }
  return out;
}

py::object board_agree(uint64_t words_at, int64_t world, int64_t rank, int64_t slot, uint64_t count_at,
                       const std::vector<int64_t>& row, double timeout, int64_t width) {
  const BoardAt board{words_at, count_at, world, rank, slot, timeout};
  std::vector<int64_t> rows(static_cast<size_t>(std::max<int64_t>(world, 0) * std::max<int64_t>(width, 0)));
  py::object gave_up = agree_into(board, row.data(), static_cast<int64_t>(row.size()), width, rows.data());
  return gave_up.is_none() ? py::object(rows_list(rows.data(), world, width)) : gave_up;
}

// Named fields of a compiled object's constructor (CountsShape, UsualDispatch, UsualCombine): each
// read once by its name; a missing or unknown name raises.
class Fields {
 public:
  Fields(const char* what, const py::kwargs& named) : what_(what), named_(named) {}
  template <typename T>
  T get(const char* name) {
    if (!named_.contains(name)) throw std::invalid_argument(std::string(what_) + ": no " + name);
    ++used_;
    return named_[name].cast<T>();
  }
  void done() const {
    if (named_.size() != used_) throw std::invalid_argument(std::string(what_) + ": unknown fields");
  }

 private:
  const char* what_;
  const py::kwargs& named_;
  size_t used_ = 0;
};

// A verb's call compiled (UsualDispatch, UsualCombine): its number, counted in the
// dispatcher's int64 count of the verb's calls at ``made_at`` (agreement.Calls; from 1
// again after ``call_wrap``, agreement.CALL_WRAP), and
// its row on the group's board, ``call_row`` (plan.call_header) with its verb (grad
// mode off: plus ``grad_off``) and number at their columns.
struct CallOnBoard {
  int64_t verb = 0, grad_off = 0, verb_col = 0, call_col = 0, call_wrap = 0;
  std::vector<int64_t> call_row;
  uint64_t made_at = 0;
  BoardAt board;

  void read(Fields& f) {
    verb = f.get<int64_t>("verb");
    grad_off = f.get<int64_t>("grad_off");
    verb_col = f.get<int64_t>("verb_col");
    call_col = f.get<int64_t>("call_col");
    call_wrap = f.get<int64_t>("call_wrap");
    call_row = f.get<std::vector<int64_t>>("call_row");
    made_at = f.get<uint64_t>("made_at");
    board.words_at = f.get<uint64_t>("board_words");
    board.count_at = f.get<uint64_t>("board_count");
    board.slot = f.get<int64_t>("board_slot");
    board.timeout = f.get<double>("timeout");
    const auto len = static_cast<int64_t>(call_row.size());
    if (made_at == 0 || call_wrap < 1 || len < 1 || len > board.slot - 2 || std::max(verb_col, call_col) >= len ||
        std::min(verb_col, call_col) < 0)
      throw std::invalid_argument("a compiled call: its call counter, and a call row within a board slot with its "
                                  "verb's and number's columns");
  }

  // the next call's number, and its row (its verb and number set) into ``row``
  int64_t next(bool grad, std::vector<int64_t>& row) const {
    int64_t& made = *reinterpret_cast<int64_t*>(made_at);
    const int64_t number = made = made % call_wrap + 1;
    row = call_row;
    row[verb_col] = verb + (grad ? 0 : grad_off);
    row[call_col] = number;
    return number;
  }
};

// What a combine along the handle of a usual dispatch needs of it (dispatch/usual.py,
// Counts.core), made by UsualDispatch where counts_plan made the handle's tables (the
// usual case): the dispatch's number, T, K, J (the pre-sum table's width), N, its
// items (source rank, token) received, the largest T of the group, whether every
// rank has rows, and the addresses of its counts matrix, hits, items' tokens and
// pre-sum table (the tensors that hold them kept here too).
struct HandleCore {
  int64_t call = 0, tokens = 0, topk = 0, width = 0, rows = 0, items = 0, bound = 0;
  bool every_rank_rows = false;
  uint64_t matrix = 0, hit = 0, tokens_at = 0, presum = 0;
  at::Tensor words, tables;
};

// The usual dispatch on the engine, compiled whole (dispatch/usual.py): for one
// signature of its arguments (exact tensors of one shape, dtype and device,
// contiguous), with grad mode as it comes, no max_rows, one group, no async_op,
// rows that travel as they are: the call's number, its agreement on the board,
// its header with its memory budget, the routing weights in their wire dtype and
// counts_plan with the dispatch's own pull, in one call. Returns None where the
// arguments are not of its signature, or the engine's device is not the current
// one (nothing done: the front end takes the call); else (what, number, ...):
// ("planned", number, counts_plan's tuple), or where the call went no further than
// its agreement ("differ", number, every rank's row: the ranks' calls differ, or
// a word asks for the front end's raise) or ("gave up", number, (missing, withdrawn)).
class UsualDispatch {
 public:
  explicit UsualDispatch(const py::kwargs& named) {
    Fields f("UsualDispatch", named);
    shape_ = f.get<CountsShape>("shape");
    layout_ = f.get<py::object>("layout");
    counts_ = f.get<py::object>("counts");
    pull_ = f.get<py::object>("pull");
    pull_cap_ = f.get<int64_t>("pull_cap");
    pull_min_ = f.get<int64_t>("pull_min");
    per_block_ = f.get<int64_t>("rows_per_block");
    hidden_ = f.get<int64_t>("hidden");
    device_ = f.get<at::Device>("device");
    x_dtype_ = f.get<at::ScalarType>("x_dtype");
    idx_dtype_ = f.get<at::ScalarType>("idx_dtype");
    weights_dtype_ = f.get<at::ScalarType>("weights_dtype");
    wire_dtype_ = f.get<at::ScalarType>("wire_dtype");
    call_.read(f);
    header_ = f.get<std::vector<int64_t>>("header");
    x_grad_bit_ = f.get<int64_t>("x_grad_bit");
    weights_grad_bit_ = f.get<int64_t>("weights_grad_bit");
    raise_bits_ = f.get<int64_t>("raise_bits");
    row_bytes_ = f.get<int64_t>("row_bytes");
    allocator_ = f.get<bool>("allocator");
    age_ = f.get<double>("age");
    row_at_ = f.get<uint64_t>("row_at");
    host_words_ = f.get<at::Tensor>("host_words");
    check_values_ = f.get<bool>("check_values");
    width_ = f.get<int64_t>("width");
    stage_ = f.get<bool>("stage");
    record_ = f.get<uint64_t>("record");
    f.done();
    call_.board.world = shape_.world;
    call_.board.rank = shape_.rank;
    if (counts_.is_none() || (shape_.tokens > 0 && layout_.is_none()) || row_bytes_ <= 0 || width_ <= 0 ||
        hidden_ <= 0 || static_cast<int64_t>(call_.call_row.size()) != shape_.header_len + 1 ||
        static_cast<int64_t>(header_.size()) != shape_.header_len ||
        std::max(call_.verb_col, call_.call_col) >= shape_.header_len)
      throw std::invalid_argument("UsualDispatch: a counts launch, a layout one where T > 0, positive row bytes, "
                                  "J and H, a call row of the header and a word, a header, and their columns");
  }

  py::object dispatch(py::handle x_obj, py::handle idx_obj, py::handle weights_obj, uint64_t stream) {
    if (!THPVariable_CheckExact(x_obj.ptr()) || !THPVariable_CheckExact(idx_obj.ptr()) ||
        !THPVariable_CheckExact(weights_obj.ptr()))
      return py::none();
    const at::Tensor& x = THPVariable_Unpack(x_obj.ptr());
    const at::Tensor& idx = THPVariable_Unpack(idx_obj.ptr());
    const at::Tensor& weights = THPVariable_Unpack(weights_obj.ptr());
    const int64_t T = shape_.tokens, K = shape_.topk, W = shape_.world, len = shape_.header_len + 1;
    if (!of(x, x_dtype_, T, hidden_) || !x.is_contiguous() || !of(idx, idx_dtype_, T, K) || !idx.is_contiguous() ||
        !of(weights, weights_dtype_, T, K))
      return py::none();
    CUdevice current = -1;
    if (device_.is_cuda() && (driver().ctx_device(&current) != CUDA_SUCCESS || current != device_.index()))
      return py::none();
    const bool grad = at::GradMode::is_enabled();
    const bool x_grad = grad && x.requires_grad(), weights_grad = grad && weights.requires_grad();
    // the call's agreement: its header (plan.call_header), then this rank's word (Transport.dispatch_word)
    std::vector<int64_t> row, rows(W * len);
    const int64_t number = call_.next(grad, row), verb = row[call_.verb_col];
    row[len - 1] = (x_grad ? x_grad_bit_ : 0) | (weights_grad ? weights_grad_bit_ : 0);
    py::object gave_up = agree_into(call_.board, row.data(), len, len, rows.data());
    if (!gave_up.is_none()) return py::make_tuple("gave up", number, gave_up);
    bool plain = true;
    for (int64_t r = 0; r < W; ++r) {
      const int64_t* theirs = rows.data() + r * len;
      plain = plain && std::memcmp(theirs, row.data(), 8 * (len - 1)) == 0 && (theirs[len - 1] & raise_bits_) == 0;
    }
    if (!plain) return py::make_tuple("differ", number, rows_list(rows.data(), W, len));
    // its row budgets (checks.row_budgets): none of its own, the rows its free device memory holds
    // (checks.memory_rows: floor division, as Python's)
    std::vector<int64_t> header(header_);
    header[call_.verb_col] = verb;
    header[call_.call_col] = number;
    header[shape_.x_grad_col] = x_grad;
    header[shape_.weights_grad_col] = weights_grad;
    if (device_.is_cuda()) {
      const int64_t free = free_bytes(device_.index(), age_, allocator_ ? reserved_bytes(device_.index()) : -1);
      const int64_t held = free >= 0 ? free / row_bytes_ : -((-free + row_bytes_ - 1) / row_bytes_);
      header[shape_.memory_rows_col] = std::min<int64_t>(held, INT32_MAX);
    }
    at::Tensor wire = weights;
    if (weights.scalar_type() != wire_dtype_ || !weights.is_contiguous()) {
      at::NoGradGuard no_grad;
      wire = weights.to(wire_dtype_).contiguous();
    }
    const uint64_t stage_src = stage_ ? reinterpret_cast<uint64_t>(x.data_ptr()) : 0;
    const int64_t src_stride = stage_ ? hidden_ * static_cast<int64_t>(x.element_size()) : 0;
    Launcher* layout = layout_.is_none() ? nullptr : layout_.cast<Launcher*>();
    Launcher* pull = pull_.is_none() ? nullptr : pull_.cast<Launcher*>();
    py::tuple got = counts_plan(shape_, layout, *counts_.cast<Launcher*>(), idx, wire, stage_src, src_stride, row_at_,
                                check_values_, header, stream, host_words_, width_, wire_dtype_, pull, x, pull_cap_,
                                pull_min_, per_block_, record_);
    // (a failure recorded: the status words; or not the usual case: the handle's tables are the front end's)
    if (got.size() == 3 || got[10].is_none()) return py::make_tuple("planned", number, got, py::none());
    auto core = std::make_unique<HandleCore>();
    core->call = number;
    core->tokens = T;
    core->topk = K;
    core->width = width_;
    core->words = got[0].cast<at::Tensor>();
    core->tables = got[2].cast<at::Tensor>();
    const py::tuple rows_of = got[5].cast<py::tuple>();
    core->rows = rows_of[shape_.rank].cast<int64_t>();
    core->every_rank_rows = true;
    for (const auto& n : rows_of) core->every_rank_rows = core->every_rank_rows && n.cast<int64_t>() > 0;
    core->bound = got[7].cast<int64_t>();
    core->items = got[8].cast<int64_t>();
    const auto base = reinterpret_cast<uint64_t>(core->words.data_ptr<int32_t>());
    core->matrix = base + 4 * (word_at(shape_.sizes, 3) + 4);
    core->hit = T > 0 ? base + 4 * word_at(shape_.sizes, 2) : 0;
    core->tokens_at = reinterpret_cast<uint64_t>(core->tables.data_ptr<int32_t>());
    core->presum = core->tokens_at + 4 * W * core->bound;
    return py::make_tuple("planned", number, got, py::cast(std::move(core)));
  }

 private:
  bool of(const at::Tensor& t, at::ScalarType dtype, int64_t rows, int64_t cols) const {
    return t.defined() && t.layout() == at::kStrided && t.scalar_type() == dtype && t.dim() == 2 &&
           t.size(0) == rows && t.size(1) == cols && t.device() == device_;
  }

  CountsShape shape_{};
  py::object layout_, counts_, pull_;
  int64_t pull_cap_ = 0, pull_min_ = 0, per_block_ = 1, hidden_ = 0;
  at::Device device_{at::kCPU};
  at::ScalarType x_dtype_{}, idx_dtype_{}, weights_dtype_{}, wire_dtype_{};
  CallOnBoard call_;  // its row: the call's header and a word
  std::vector<int64_t> header_;  // the header of its counts exchange, as a template
  int64_t x_grad_bit_ = 0, weights_grad_bit_ = 0, raise_bits_ = 0;
  int64_t row_bytes_ = 1;
  bool allocator_ = false;
  double age_ = 0;
  uint64_t row_at_ = 0;
  at::Tensor host_words_;
  bool check_values_ = false;
  int64_t width_ = 0;
  bool stage_ = false;
  uint64_t record_ = 0;
};

// The usual combine along the handle of a usual dispatch, compiled whole
// (dispatch/usual.py): for one signature of its rows (exact tensors, [N, H] of one
// dtype, contiguous at a 16-byte-aligned address; weights of one dtype or none)
// along handles of one J,
// every rank having rows, eager: the call's number, its agreement on the board and
// to_home (the push and the home sum, the output allocated), in one call. Returns
// None where the arguments are not of its signature, the handle's buffers
// are not the engine's now, or the rows want a gradient the handle's dispatch will
// not give (nothing done: the front end takes the call); else ("done", number,
// the output) or, where the call went no further than its agreement, ("differ",
// number, every rank's row) or ("gave up", number, (missing, withdrawn)).
class UsualCombine {
 public:
  explicit UsualCombine(const py::kwargs& named) {
    Fields f("UsualCombine", named);
    push_ = f.get<py::object>("push");
    home_ = f.get<py::object>("home");
    hidden_ = f.get<int64_t>("hidden");
    device_ = f.get<at::Device>("device");
    dtype_ = f.get<at::ScalarType>("dtype");
    weighted_ = f.get<bool>("weighted");
    weights_dtype_ = f.get<at::ScalarType>("weights_dtype");
    width_ = f.get<int64_t>("width");
    call_.read(f);
    along_col_ = f.get<int64_t>("along_col");
    call_.board.world = f.get<int64_t>("world");
    call_.board.rank = f.get<int64_t>("rank");
    capacity_tokens_ = f.get<int64_t>("capacity_tokens");
    capacity_topk_ = f.get<int64_t>("capacity_topk");
    blocks_ = f.get<int64_t>("blocks");
    sms_ = f.get<int64_t>("sms");
    per_block_ = f.get<int64_t>("rows_per_block");
    record_ = f.get<uint64_t>("record");
    f.done();
    if (push_.is_none() || home_.is_none() || per_block_ <= 0 || along_col_ < 0 ||
        along_col_ >= static_cast<int64_t>(call_.call_row.size()))
      throw std::invalid_argument("UsualCombine: its launches, rows a block, and the along column of its call row");
  }

  py::object combine(py::handle rows_obj, py::handle weights_obj, const HandleCore& core, bool linked,
                     uint64_t stream) {
    if (!THPVariable_CheckExact(rows_obj.ptr()) || weighted_ != !weights_obj.is_none() ||
        (weighted_ && !THPVariable_CheckExact(weights_obj.ptr())))
      return py::none();
    const at::Tensor& rows = THPVariable_Unpack(rows_obj.ptr());
    const bool grad = at::GradMode::is_enabled();
    bool wants_grad = grad && rows.requires_grad();
    uint64_t weights_at = 0;
    if (weighted_) {
      const at::Tensor& w = THPVariable_Unpack(weights_obj.ptr());
      if (!w.defined() || w.layout() != at::kStrided || w.scalar_type() != weights_dtype_ || w.dim() != 1 ||
          w.size(0) != core.rows || w.device() != device_ || !w.is_contiguous())
        return py::none();
      wants_grad = wants_grad || (grad && w.requires_grad());
      weights_at = reinterpret_cast<uint64_t>(w.data_ptr());
    }
    if (!rows.defined() || rows.layout() != at::kStrided || rows.scalar_type() != dtype_ || rows.dim() != 2 ||
        rows.size(0) != core.rows || rows.size(1) != hidden_ || rows.device() != device_ || !rows.is_contiguous() ||
        reinterpret_cast<uint64_t>(rows.data_ptr()) % 16 != 0 || !core.every_rank_rows || (wants_grad && !linked) ||
        core.width != width_ || core.bound > capacity_tokens_ || core.topk > capacity_topk_)
      return py::none();
    CUdevice current = -1;
    if (device_.is_cuda() && (driver().ctx_device(&current) != CUDA_SUCCESS || current != device_.index()))
      return py::none();
    const int64_t len = static_cast<int64_t>(call_.call_row.size()), W = call_.board.world;
    std::vector<int64_t> row, agreed(W * len);
    const int64_t number = call_.next(grad, row);
    row[along_col_] = core.call;
    py::object gave_up = agree_into(call_.board, row.data(), len, len, agreed.data());
    if (!gave_up.is_none()) return py::make_tuple("gave up", number, gave_up);
    for (int64_t r = 0; r < W; ++r)
      if (std::memcmp(agreed.data() + r * len, row.data(), 8 * len) != 0)
        return py::make_tuple("differ", number, rows_list(agreed.data(), W, len));
    const auto grid = [this](int64_t n) {
      return static_cast<unsigned>(std::min(blocks_, std::max(sms_, (n + per_block_ - 1) / per_block_)));
    };
    at::Tensor out = to_home(*push_.cast<Launcher*>(), grid(core.items), *home_.cast<Launcher*>(), grid(core.tokens),
                             rows, weights_at, core.matrix, core.tokens_at, core.presum, core.bound, core.hit,
                             core.tokens, stream, record_);
    return py::make_tuple("done", number, out);
  }

 private:
  py::object push_, home_;
  int64_t hidden_ = 0;
  at::Device device_{at::kCPU};
  at::ScalarType dtype_{}, weights_dtype_{};
  bool weighted_ = false;
  int64_t width_ = 0;  // J of the handles it moves along (its push walks their pre-sum tables so)
  CallOnBoard call_;  // its row: the call's header (along its dispatch) and a 0
  int64_t along_col_ = 0;
  int64_t capacity_tokens_ = 0, capacity_topk_ = 0, blocks_ = 1, sms_ = 1, per_block_ = 1;
  uint64_t record_ = 0;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Launcher>(m, "Launcher")
      .def(py::init<uint64_t, unsigned, bool, const std::string&, const std::string&, const std::vector<int64_t>&,
                    const std::vector<int64_t>&>())
      .def("launch", &Launcher::launch_py)
      .def("block_of", &Launcher::block_of);
  py::class_<CountsShape>(m, "CountsShape")
      .def_readonly("world", &CountsShape::world)
      .def_readonly("rank", &CountsShape::rank)
      .def_readonly("row_len", &CountsShape::row_len)
      .def_readonly("counts_col", &CountsShape::counts_col)
      .def_readonly("experts_per_rank", &CountsShape::experts_per_rank)
      .def_readonly("sizes", &CountsShape::sizes)
      .def(py::init([](const py::kwargs& named) {  // every field by its name (dispatch/host.py: counts_launchers)
        Fields f("CountsShape", named);
        CountsShape s{};
        for (auto [name, field] : {std::pair<const char*, int64_t*>{"tokens", &s.tokens}, {"topk", &s.topk},
                                   {"world", &s.world}, {"rank", &s.rank}, {"row_len", &s.row_len},
                                   {"counts_col", &s.counts_col}, {"experts_per_rank", &s.experts_per_rank},
                                   {"tokens_col", &s.tokens_col}, {"staged_col", &s.staged_col},
                                   {"sends_col", &s.sends_col}, {"header_len", &s.header_len},
                                   {"failed_col", &s.failed_col}, {"layout_blocks", &s.layout_blocks},
                                   {"layout_shared", &s.layout_shared}, {"counts_shared", &s.counts_shared},
                                   {"agreed", &s.agreed}, {"x_grad_col", &s.x_grad_col},
                                   {"weights_grad_col", &s.weights_grad_col}, {"max_rows_col", &s.max_rows_col},
                                   {"memory_rows_col", &s.memory_rows_col}})
          *field = f.get<int64_t>(name);
        s.sizes = f.get<std::vector<int64_t>>("sizes");
        f.done();
        if (s.sizes.size() != 5) throw std::invalid_argument("CountsShape: five sizes");
        return s;
      }));
  py::class_<HandleCore>(m, "HandleCore")
      .def_readonly("call", &HandleCore::call)
      .def_readonly("rows", &HandleCore::rows)
      .def_readonly("width", &HandleCore::width)
      .def_readonly("every_rank_rows", &HandleCore::every_rank_rows);
  py::class_<UsualCombine>(m, "UsualCombine")
      .def(py::init<const py::kwargs&>())
      .def("combine", &UsualCombine::combine);
  py::class_<UsualDispatch>(m, "UsualDispatch")
      .def(py::init<const py::kwargs&>())
      .def("dispatch", &UsualDispatch::dispatch);
  m.def("counts_plan", &counts_plan);
  m.def("free_bytes", &free_bytes);
  m.def("forget_free_bytes", &forget_free_bytes);
  m.def("last_wait_ns", [] { return last_wait_ns.load(); });
  m.def("reserved_bytes", &reserved_bytes);
  m.def("pull", &pull);
  m.def("to_home", &to_home);
  m.def("board_agree", &board_agree);
  m.def("board_wait_ns", [] { return board_wait_ns.load(); });
  m.def("usual", [](const CountsShape& s, const std::vector<int32_t>& rows, const std::vector<int64_t>& rows_of) {
    if (rows.size() != static_cast<size_t>(s.world * s.row_len) || rows_of.size() != static_cast<size_t>(s.world))
      throw std::invalid_argument("usual: W rows of the counts matrix and W row counts");
    return usual(s, rows.data(), rows_of);
  });
}
