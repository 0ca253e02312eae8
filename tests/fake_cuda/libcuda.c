/* A stand-in for the CUDA driver (libcuda.so.1) on a machine without one, for
 * tests/test_host.py: the entry points csrc/host.cpp and dispatch/cuda.py call,
 * each launch (and event record) handed to the test's hook, copies done as plain
 * memory copies (the tensors are the host's), synchronisation a no-op. */
#include <stddef.h>
#include <string.h>

typedef int (*Hook)(const void* config, void* function, void** params);
static Hook hook = 0;

void fake_set_hook(Hook h) { hook = h; }

int cuLaunchKernelEx(const void* config, void* function, void** params, void** extra) {
  (void)extra;
  return hook ? hook(config, function, params) : 0;
}

int cuMemcpyDtoHAsync_v2(void* dst, unsigned long long src, size_t bytes, void* stream) {
  (void)stream;
  memcpy(dst, (const void*)src, bytes);
  return 0;
}

int cuStreamSynchronize(void* stream) {
  (void)stream;
  return 0;
}

/* the events recorded, in order with the launches: each record calls the hook too,
 * with a null config and the event as the function (the stream as params[0]) */
int cuEventRecord(void* event, void* stream) {
  void* params[1] = {stream};
  return hook ? hook(0, event, params) : 0;
}

static const char* fake = "fake driver";

int cuGetErrorName(int result, const char** name) {
  (void)result;
  *name = fake;
  return 0;
}

int cuGetErrorString(int result, const char** text) {
  (void)result;
  *text = fake;
  return 0;
}

/* the free memory a test sets (fake_set_free), the reads of it (fake_free_reads),
 * and the current device: 0 */
static size_t free_bytes = (size_t)1 << 34;
static int free_reads = 0;

void fake_set_free(size_t bytes) { free_bytes = bytes; }

int fake_free_reads(void) { return free_reads; }

int cuMemGetInfo_v2(size_t* free, size_t* total) {
  ++free_reads;
  *free = free_bytes;
  *total = free_bytes;
  return 0;
}

int cuCtxGetDevice(int* device) {
  *device = 0;
  return 0;
}
