/* standin.h — the control API of the libcuda stand-in (libcudapool-standin.so), for the tests.
 * Owns: the cpstandin_* declarations and the loader that finds them in the library the backend loaded. */
#ifndef CP_STANDIN_H
#define CP_STANDIN_H

#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Note [The stand-in]
 * libcudapool-standin.so is a small driver of its own, backed by host memory, that exports
 * cuGetProcAddress and the driver functions cudapool's CUDA backend resolves. It was written
 * from the CUDA driver API reference (each call's documented contract), not from the backend,
 * and refuses what the reference forbids with the driver's own error codes. The backend opens
 * it when CUDAPOOL_CUDA_DRIVER names it (csrc/backend/cuda.c); tests then reach the functions
 * below through dlsym on that same library (cpstandin_open).
 *
 * What it models beyond single calls:
 *  - devices: a count, a capacity each, attributes, which device can reach which (peers);
 *  - asynchrony: work queued on a stream by cpstandin_launch and cuEventRecord completes only
 *    when a control call says so (complete, complete_all) or a synchronizing call drains it
 *    (cuEventSynchronize up to its event, cuMemFree and cuCtxSynchronize the whole device);
 *    the legacy stream waits for, and is waited for by, the blocking streams of its context;
 *  - device faults, sticky as a GPU's: a launch on memory its device may not touch, and an
 *    unmap of memory that incomplete work touches. Every driver call then fails with
 *    CUDA_ERROR_ILLEGAL_ADDRESS (700) until cpstandin_reset;
 *  - stream capture: a stream put into capture by cpstandin_begin_capture, the calling
 *    thread's capture mode (cuThreadExchangeStreamCaptureMode), and the calls the reference
 *    calls potentially unsafe during a capture (memory allocation, mapping and release, event
 *    query and synchronize): made in a prohibited mode they fail with
 *    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (900) and invalidate the capture;
 *  - per-call fault injection, call counters, and the list of faults seen.
 * Handles and device addresses are plain numbers: nothing behind a device address may be
 * dereferenced by the host (cpstandin_peek reads the bytes behind one).
 *
 * Every control function is thread-safe; those returning int give 0 or a CUresult value. */

#define CPSTANDIN_VERSION 1

/* cpstandin_set_device_attr: what to set. */
enum {
  CPSTANDIN_ATTR_CAPACITY = 0,    /* bytes of memory */
  CPSTANDIN_ATTR_VMM = 1,         /* CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED */
  CPSTANDIN_ATTR_RDMA = 2,        /* CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED */
  CPSTANDIN_ATTR_GRANULARITY = 3, /* the minimum granularity, a power of two >= 4096 */
  CPSTANDIN_ATTR_POSIX_FD = 4,    /* CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED */
  CPSTANDIN_ATTR_COUNT = 5
};

/* cpstandin_live: which objects to count. */
enum {
  CPSTANDIN_LIVE_ALLOCATIONS = 0,  /* cuMemAlloc memory not freed */
  CPSTANDIN_LIVE_RESERVATIONS = 1, /* address ranges not freed */
  CPSTANDIN_LIVE_HANDLES = 2,      /* cuMemCreate memory still held (a handle or a mapping) */
  CPSTANDIN_LIVE_MAPPINGS = 3,
  CPSTANDIN_LIVE_EVENTS = 4,
  CPSTANDIN_LIVE_STREAMS = 5,  /* created streams not destroyed */
  CPSTANDIN_LIVE_CONTEXTS = 6, /* primary contexts retained */
  CPSTANDIN_LIVE_HOST = 7      /* cuMemAllocHost blocks not freed */
};

/* cpstandin_fault_kind. */
enum {
  CPSTANDIN_FAULT_ILLEGAL_ADDRESS = 1, /* device fault: a launch on memory its device may not touch */
  CPSTANDIN_FAULT_IN_USE = 2,          /* device fault: memory unmapped while incomplete work touches it */
  CPSTANDIN_FAULT_CAPTURE = 3,         /* a capture invalidated, or a captured event waited on */
  CPSTANDIN_FAULT_MISUSE = 4           /* a call whose outcome the reference leaves undefined */
};

/* cpstandin_begin_capture: the modes of the reference (CUstreamCaptureMode). */
enum { CPSTANDIN_CAPTURE_GLOBAL = 0, CPSTANDIN_CAPTURE_THREAD_LOCAL = 1, CPSTANDIN_CAPTURE_RELAXED = 2 };

typedef struct cpstandin_handle_info_s {
  size_t size;
  int device;
  int rdma;     /* created with allocFlags.gpuDirectRDMACapable set */
  int released; /* cuMemRelease was called */
  unsigned mappings;
  int holds_memory; /* its memory is still on the device */
} cpstandin_handle_info_t;

/* X(return type, name without the cpstandin_ prefix, parameters). Streams are CUstream values
 * (0, 1 = CU_STREAM_LEGACY and 2 = CU_STREAM_PER_THREAD mean the calling thread's current
 * context's); pointers are CUdeviceptr values; handles CUmemGenericAllocationHandle values. */
#define CPSTANDIN_API(X)                                                                           \
  /* CPSTANDIN_VERSION; its presence says the library is the stand-in. */                          \
  X(int, version, (void))                                                                          \
  /* Everything back to the start, the configuration to the environment's defaults             \
   * (CPSTANDIN_DEVICES, default 2; CPSTANDIN_MEMORY_MB, default 1024, per device): no memory,   \
   * context, stream or event, no fault, injection or count. cuInit stays done. */   \
  X(void, reset, (void))                                                                           \
  /* `count` devices (1..16) of `capacity` bytes each, every one reaching every other; refused   \
   * (CUDA_ERROR_ILLEGAL_STATE) while a primary context is retained. */ \
  X(int, set_devices, (int count, size_t capacity))                                                \
  X(int, set_device_attr, (int device, int attr, long long value))                                 \
  /* Whether `device` can reach memory of `peer` (cuDeviceCanAccessPeer(&can, device, peer)). */   \
  X(int, set_peer, (int device, int peer, int can))                                                \
  /* Work on `stream` that writes [ptr, ptr + bytes): its device must have read-write access     \
   * there (cuMemAlloc memory of its own, or mappings it was granted), else a device fault       \
   * (CUDA_ERROR_ILLEGAL_ADDRESS back). Queued until completed; on a capturing stream it joins   \
   * the capture and queues nothing. */ \
  X(int, launch, (uintptr_t stream, unsigned long long ptr, size_t bytes))                         \
  /* All work queued on `stream` completes (and what it waits for). */                             \
  X(int, complete, (uintptr_t stream))                                                             \
  X(void, complete_all, (void))                                                                    \
  /* Incomplete items (launches, event records) queued on `stream`; SIZE_MAX for a bad handle. */  \
  X(size_t, pending, (uintptr_t stream))                                                           \
  /* Put a created stream into capture in `mode`, as cuStreamBeginCapture does, by this thread; \
   * end_capture ends it: 0, or CUDA_ERROR_STREAM_CAPTURE_INVALIDATED when it was invalidated. */  \
  X(int, begin_capture, (uintptr_t stream, int mode))                                              \
  X(int, end_capture, (uintptr_t stream))                                                          \
  /* 0 none, 1 active, 2 invalidated (CUstreamCaptureStatus); -1 for a bad handle. */              \
  X(int, capture_status, (uintptr_t stream))                                                       \
  /* The n-th next call (n >= 1) of driver function `name` (its base name, "cuMemMap") fails    \
   * with `result` and does nothing; _after: it does its work, then reports `result`. */  \
  X(int, fail_nth, (const char *name, unsigned n, int result))                                     \
  X(int, fail_nth_after, (const char *name, unsigned n, int result))                               \
  /* From now on every driver call fails with `result` (0 clears it), as after a device fault. */  \
  X(void, set_sticky, (int result))                                                                \
  X(int, sticky, (void))                                                                           \
  /* Faults recorded since the reset; the kind and one line of text for each of the first 64. */   \
  X(size_t, faults, (void))                                                                        \
  X(int, fault_kind, (size_t i))                                                                   \
  X(int, fault_text, (size_t i, char *buf, size_t n))                                              \
  /* Calls of driver function `name` since the reset, failed ones included. */                     \
  X(unsigned long long, calls, (const char *name))                                                 \
  /* Device memory in use on `device` (cuMemAlloc, cuMemCreate until no handle holds it). */       \
  X(size_t, used, (int device))                                                                    \
  X(size_t, live, (int what))                                                                      \
  X(int, handle_info, (unsigned long long handle, cpstandin_handle_info_t *out))                   \
  /* The access `device` has at `ptr`: 0 none, 1 read, 3 read-write; -1 when nothing is there.  */ \
  X(int, access, (unsigned long long ptr, int device))                                             \
  /* The byte behind device address `ptr` (the last launch on it wrote its stream's low byte). */  \
  X(int, peek, (unsigned long long ptr, unsigned char *out))

#define CPSTANDIN_DECLARE(ret, name, params) ret cpstandin_##name params;
CPSTANDIN_API(CPSTANDIN_DECLARE)
#undef CPSTANDIN_DECLARE

/* Driver functions the tests call themselves: X(member, exported name, parameters), all
 * returning a CUresult (int). Handles (CUcontext, CUstream, CUevent) travel as void *, device
 * pointers and allocation handles as unsigned long long, enumerations and CUdevice as int;
 * `prop` and `desc` point at structures laid out as the reference's CUmemAllocationProp and
 * CUmemAccessDesc. */
#define CPSTANDIN_DRIVER(X)                                                                                        \
  X(cuInit, cuInit, (unsigned flags))                                                                              \
  X(cuGetProcAddress, cuGetProcAddress_v2,                                                                         \
    (const char *symbol, void **pfn, int version, unsigned long long flags, int *status))                          \
  X(cuGetErrorName, cuGetErrorName, (int error, const char **out))                                                 \
  X(cuDeviceGetCount, cuDeviceGetCount, (int *out))                                                                \
  X(cuDeviceCanAccessPeer, cuDeviceCanAccessPeer, (int *out, int dev, int peer))                                   \
  X(cuDeviceGetAttribute, cuDeviceGetAttribute, (int *out, int attrib, int dev))                                   \
  X(cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain, (void **out, int dev))                                     \
  X(cuDevicePrimaryCtxRelease, cuDevicePrimaryCtxRelease_v2, (int dev))                                            \
  X(cuCtxGetCurrent, cuCtxGetCurrent, (void **out))                                                                \
  X(cuCtxSetCurrent, cuCtxSetCurrent, (void *ctx))                                                                 \
  X(cuCtxSynchronize, cuCtxSynchronize, (void))                                                                    \
  X(cuMemAlloc, cuMemAlloc_v2, (unsigned long long *out, size_t size))                                             \
  X(cuMemFree, cuMemFree_v2, (unsigned long long ptr))                                                             \
  X(cuMemGetInfo, cuMemGetInfo_v2, (size_t * out_free, size_t * out_total))                                        \
  X(cuMemGetAllocationGranularity, cuMemGetAllocationGranularity, (size_t * out, const void *prop, int o))         \
  X(cuMemAddressReserve, cuMemAddressReserve,                                                                      \
    (unsigned long long *out, size_t size, size_t align, unsigned long long addr, unsigned long long f))           \
  X(cuMemAddressFree, cuMemAddressFree, (unsigned long long ptr, size_t size))                                     \
  X(cuMemCreate, cuMemCreate, (unsigned long long *out, size_t size, const void *prop, unsigned long long f))      \
  X(cuMemRelease, cuMemRelease, (unsigned long long handle))                                                       \
  X(cuMemMap, cuMemMap,                                                                                            \
    (unsigned long long ptr, size_t size, size_t offset, unsigned long long handle, unsigned long long f))         \
  X(cuMemUnmap, cuMemUnmap, (unsigned long long ptr, size_t size))                                                 \
  X(cuMemSetAccess, cuMemSetAccess, (unsigned long long ptr, size_t size, const void *desc, size_t count))         \
  X(cuMemExportToShareableHandle, cuMemExportToShareableHandle,                                                    \
    (void *out, unsigned long long handle, int type, unsigned long long f))                                        \
  X(cuMemImportFromShareableHandle, cuMemImportFromShareableHandle, (unsigned long long *out, void *fd, int type)) \
  X(cuStreamCreate, cuStreamCreate, (void **out, unsigned flags))                                                  \
  X(cuStreamDestroy, cuStreamDestroy_v2, (void *stream))                                                           \
  X(cuStreamGetCtx, cuStreamGetCtx, (void *stream, void **out))                                                    \
  X(cuStreamIsCapturing, cuStreamIsCapturing, (void *stream, int *out))                                            \
  X(cuThreadExchangeStreamCaptureMode, cuThreadExchangeStreamCaptureMode, (int *mode))                             \
  X(cuEventCreate, cuEventCreate, (void **out, unsigned flags))                                                    \
  X(cuEventDestroy, cuEventDestroy_v2, (void *event))                                                              \
  X(cuEventRecord, cuEventRecord, (void *event, void *stream))                                                     \
  X(cuEventQuery, cuEventQuery, (void *event))                                                                     \
  X(cuEventSynchronize, cuEventSynchronize, (void *event))

/* The control API and those driver functions as function pointers, found with dlsym. */
typedef struct cpstandin_api_s {
#define CPSTANDIN_MEMBER(ret, name, params) ret(*name) params;
  CPSTANDIN_API(CPSTANDIN_MEMBER)
#undef CPSTANDIN_MEMBER
#define CPSTANDIN_DRIVER_MEMBER(member, symbol, params) int(*member) params;
  CPSTANDIN_DRIVER(CPSTANDIN_DRIVER_MEMBER)
#undef CPSTANDIN_DRIVER_MEMBER
} cpstandin_api_t;

/* Fill `api` from the library CUDAPOOL_CUDA_DRIVER names: 0, or -1 with one line in `why`
 * saying why this is not the stand-in. With `load` 0 the library must be loaded already (by
 * cp_cuda_load), else it is loaded here. */
static inline int cpstandin_open(cpstandin_api_t *api, int load, char *why, size_t why_bytes) {
  const char *path = getenv("CUDAPOOL_CUDA_DRIVER");
  if (path == NULL || path[0] == '\0') {
    snprintf(why, why_bytes, "CUDAPOOL_CUDA_DRIVER is not set: the backend loads the system's libcuda");
    return -1;
  }
  void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL | (load ? 0 : RTLD_NOLOAD));
  if (lib == NULL) {
    snprintf(why, why_bytes, "CUDAPOOL_CUDA_DRIVER=%s is not %s", path, load ? "a library" : "loaded");
    return -1;
  }
  void *sym = NULL;
#define CPSTANDIN_FIND(ret, name, params)                                                 \
  sym = dlsym(lib, "cpstandin_" #name);                                                   \
  if (sym == NULL || sizeof sym != sizeof api->name) {                                    \
    snprintf(why, why_bytes, "%s is not the stand-in: it has no cpstandin_" #name, path); \
    return -1;                                                                            \
  }                                                                                       \
  memcpy(&api->name, &sym, sizeof sym);
  CPSTANDIN_API(CPSTANDIN_FIND)
#undef CPSTANDIN_FIND
#define CPSTANDIN_FIND_DRIVER(member, symbol, params)                             \
  sym = dlsym(lib, #symbol);                                                      \
  if (sym == NULL || sizeof sym != sizeof api->member) {                          \
    snprintf(why, why_bytes, "%s is not the stand-in: it has no " #symbol, path); \
    return -1;                                                                    \
  }                                                                               \
  memcpy(&api->member, &sym, sizeof sym);
  CPSTANDIN_DRIVER(CPSTANDIN_FIND_DRIVER)
#undef CPSTANDIN_FIND_DRIVER
  /* The library stays loaded: the backend holds it for the life of the process. */
  return 0;
}

#endif /* CP_STANDIN_H */
