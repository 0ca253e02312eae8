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

/* green contexts (dispatch/partition.py): a device of fake_sm_count SMs, split in
 * multiples of 8 as compute capability 9.0 does; the contexts made and destroyed
 * are counted, and the n-th green context made can be set to fail. */
typedef struct {
  int type;
  unsigned char padding[92];
  unsigned int sm_count, min_partition, alignment;
  unsigned char rest[36];
} Resource;

static unsigned int sm_total = 132;
static int contexts_made = 0, contexts_destroyed = 0, fail_context = -1;

void fake_set_green(unsigned int sms, int fail_at) {
  sm_total = sms;
  fail_context = fail_at;
  contexts_made = contexts_destroyed = 0;
}

int fake_green_contexts(int destroyed) { return destroyed ? contexts_destroyed : contexts_made; }

int cuDeviceGet(int* device, int ordinal) {
  *device = ordinal;
  return 0;
}

static void sm_resource(Resource* r, unsigned int count) {
  memset(r, 0, sizeof(*r));
  r->type = 1;
  r->sm_count = count;
  r->min_partition = 8;
  r->alignment = 8;
}

int cuDeviceGetDevResource(int device, Resource* resource, int type) {
  (void)device;
  if (type != 1) return 1;
  sm_resource(resource, sm_total);
  return 0;
}

int cuDevSmResourceSplitByCount(Resource* result, unsigned int* groups, const Resource* input, Resource* remaining,
                                unsigned int flags, unsigned int min_count) {
  (void)flags;
  if (min_count > input->sm_count) return 1; /* CUDA_ERROR_INVALID_VALUE */
  unsigned int size = (min_count + 7) / 8 * 8;
  unsigned int made = size <= input->sm_count ? (*groups < input->sm_count / size ? *groups : input->sm_count / size)
                                              : 0;
  for (unsigned int g = 0; g < made; ++g) sm_resource(&result[g], size);
  *groups = made;
  if (remaining) sm_resource(remaining, input->sm_count - made * size);
  return 0;
}

int cuDevResourceGenerateDesc(void** desc, const Resource* resources, unsigned int count) {
  (void)count;
  *desc = (void*)resources;
  return 0;
}

int cuGreenCtxCreate(void** context, void* desc, int device, unsigned int flags) {
  (void)desc; (void)device; (void)flags;
  if (contexts_made == fail_context) return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
  *context = (void*)(size_t)(0x1000 + ++contexts_made);
  return 0;
}

int cuGreenCtxDestroy(void* context) {
  (void)context;
  ++contexts_destroyed;
  return 0;
}
