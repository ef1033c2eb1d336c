/* cuda_internal.h — what the CUDA backend's files share: the driver's types, the table of driver
 * functions (required and optional), the device slots, context scopes and error reporting. */
#ifndef CP_CUDA_INTERNAL_H
#define CP_CUDA_INTERNAL_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/cuda.h"

/* ------------------------------------------------------------------------------------------
 * Driver types and constants. cuda.h of the toolkit is not included (it is not needed to build,
 * and a machine without CUDA has none); the few declarations used here follow the CUDA driver
 * API documentation, and were checked against cuda.h of CUDA 12. Every driver function returns
 * a CUresult; 0 is success.
 * ---------------------------------------------------------------------------------------- */

typedef int CUresult;
typedef int CUdevice; /* device handle (an ordinal in practice) */
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream; /* NULL is the legacy default stream */
typedef struct CUevent_st *CUevent;
typedef unsigned long long CUdeviceptr; /* 64-bit builds */
typedef uint64_t cuuint64_t;
typedef int CUdriverProcAddressQueryResult;

enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_READY = 600,
  CUDA_ERROR_NOT_PERMITTED = 800,
  CUDA_ERROR_NOT_SUPPORTED = 801,
  CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906 /* cuStreamIsCapturing on the legacy stream during a capture */
};

enum { CU_GET_PROC_ADDRESS_SUCCESS = 0 };

#define CU_GET_PROC_ADDRESS_DEFAULT ((cuuint64_t)0) /* legacy default stream semantics */
#define CU_EVENT_DISABLE_TIMING     0x2u

/* Virtual memory management (cuda_vmm.c). The enums are ints in the driver's ABI. */
typedef unsigned long long CUmemGenericAllocationHandle;
typedef int CUdevice_attribute;

enum {
  CU_MEM_ALLOCATION_TYPE_PINNED = 1,
  CU_MEM_HANDLE_TYPE_NONE = 0,
  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1,
  CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1,
  CU_MEM_LOCATION_TYPE_DEVICE = 1,
  CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0,
  CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3,
  CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102,
  CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103,
  CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED = 110
};

typedef struct CUmemLocation_st {
  int type; /* CUmemLocationType */
  int id;   /* the device ordinal for CU_MEM_LOCATION_TYPE_DEVICE */
} CUmemLocation;

typedef struct CUmemAllocationProp_st {
  int type;                 /* CUmemAllocationType */
  int requestedHandleTypes; /* CUmemAllocationHandleType */
  CUmemLocation location;
  void *win32HandleMetaData; /* Windows only; must be NULL elsewhere */
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
} CUmemAllocationProp;

#define CU_IPC_HANDLE_SIZE 64
typedef struct CUipcMemHandle_st {
  char reserved[CU_IPC_HANDLE_SIZE];
} CUipcMemHandle;

typedef struct CUmemAccessDesc_st {
  CUmemLocation location;
  int flags; /* CUmemAccess_flags */
} CUmemAccessDesc;

_Static_assert(sizeof(CUmemLocation) == 8, "CUmemLocation as in cuda.h");
_Static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc as in cuda.h");
_Static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp as in cuda.h (64-bit)");
_Static_assert(offsetof(CUmemAllocationProp, win32HandleMetaData) == 16, "CUmemAllocationProp layout");
_Static_assert(offsetof(CUmemAllocationProp, allocFlags) == 24, "CUmemAllocationProp layout");

/* ------------------------------------------------------------------------------------------
 * Constants
 * ---------------------------------------------------------------------------------------- */

/* API versions asked of cuGetProcAddress: the 12.0 ABI of every function below, or the 11.3
 * one on an older driver (asking for a version above the driver's own fails). */
#define CUDA_API_VERSION          12000
#define CUDA_API_VERSION_FALLBACK 11030

#define CUDA_ALIGN_BYTES   ((CUdeviceptr)512) /* what backend.h promises for reserve */
#define CUDA_MESSAGE_BYTES 512                /* a remembered load failure, a call description */
#define CUDA_WHY_BYTES     256                /* "CUDA_ERROR_X (text)" */
#define CUDA_NAME_BYTES    256                /* device names (the runtime's limit as well) */

_Static_assert(sizeof(void *) == 8, "cuda.c assumes a 64-bit build (CUdeviceptr)");
_Static_assert(sizeof(CUdeviceptr) == sizeof(uintptr_t), "a device address fits a uintptr_t");
_Static_assert(sizeof(CUmemGenericAllocationHandle) == sizeof(cp_page_t), "a page handle fits a cp_page_t");
_Static_assert(sizeof(void *) == sizeof(void (*)(void)), "POSIX: a function address travels through a void *");

/* ------------------------------------------------------------------------------------------
 * The driver-function table, defined once: X(name, return type, parameters). It generates the
 * pointer types, the table and the lists the loader walks. Resolved by base name, so the driver
 * hands back the variant (e.g. cuMemAlloc_v2) matching the requested API version.
 * CUDA_DRIVER_FUNCTIONS are required: the load fails without any of them.
 * CUDA_VMM_FUNCTIONS are optional: a driver without one still loads, and no device gets the
 * page-mapped entries (cp_cuda_vmm_support says why).
 * ---------------------------------------------------------------------------------------- */

#define CUDA_DRIVER_FUNCTIONS(X)                                                 \
  X(cuGetErrorName, CUresult, (CUresult result, const char **out_name))          \
  X(cuGetErrorString, CUresult, (CUresult result, const char **out_text))        \
  X(cuInit, CUresult, (unsigned int init_flags))                                 \
  X(cuDriverGetVersion, CUresult, (int *out_version))                            \
  X(cuDeviceGetCount, CUresult, (int *out_count))                                \
  X(cuDeviceGet, CUresult, (CUdevice * out_dev, int ordinal))                    \
  X(cuDeviceGetName, CUresult, (char *out_name, int name_bytes, CUdevice dev))   \
  X(cuDeviceTotalMem, CUresult, (size_t * out_bytes, CUdevice dev))              \
  X(cuDevicePrimaryCtxRetain, CUresult, (CUcontext * out_ctx, CUdevice dev))     \
  X(cuDevicePrimaryCtxRelease, CUresult, (CUdevice dev))                         \
  X(cuCtxGetCurrent, CUresult, (CUcontext * out_ctx))                            \
  X(cuCtxSetCurrent, CUresult, (CUcontext cu_ctx))                               \
  X(cuMemAlloc, CUresult, (CUdeviceptr * out_ptr, size_t size_bytes))            \
  X(cuMemFree, CUresult, (CUdeviceptr ptr))                                      \
  X(cuMemGetInfo, CUresult, (size_t * out_free_bytes, size_t * out_total_bytes)) \
  X(cuEventCreate, CUresult, (CUevent * out_event, unsigned int event_flags))    \
  X(cuEventDestroy, CUresult, (CUevent cu_event))                                \
  X(cuEventRecord, CUresult, (CUevent cu_event, CUstream cu_stream))             \
  X(cuEventQuery, CUresult, (CUevent cu_event))                                  \
  X(cuEventSynchronize, CUresult, (CUevent cu_event))

#define CUDA_VMM_FUNCTIONS(X)                                                                                         \
  X(cuDeviceGetAttribute, CUresult, (int *out_value, CUdevice_attribute attrib, CUdevice dev))                        \
  X(cuMemGetAllocationGranularity, CUresult, (size_t * out_bytes, const CUmemAllocationProp *prop, int option))       \
  X(cuMemAddressReserve, CUresult,                                                                                    \
    (CUdeviceptr * out_ptr, size_t size, size_t alignment, CUdeviceptr addr, unsigned long long reserve_flags))       \
  X(cuMemAddressFree, CUresult, (CUdeviceptr ptr, size_t size))                                                       \
  X(cuMemCreate, CUresult,                                                                                            \
    (CUmemGenericAllocationHandle * out_handle, size_t size, const CUmemAllocationProp *prop,                         \
     unsigned long long create_flags))                                                                                \
  X(cuMemRelease, CUresult, (CUmemGenericAllocationHandle handle))                                                    \
  X(cuMemMap, CUresult,                                                                                               \
    (CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle, unsigned long long map_flags)) \
  X(cuMemUnmap, CUresult, (CUdeviceptr ptr, size_t size))                                                             \
  X(cuMemSetAccess, CUresult, (CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count))

/* Optional too, each on its own (Note [Capture and contexts] in cuda.c, Note [Peers] in
 * cuda_vmm.c, cuda_copy.c): a driver without one leaves its entry NULL and the backend does
 * without. */
#define CUDA_OPTIONAL_FUNCTIONS(X)                                                                                \
  X(cuStreamIsCapturing, CUresult, (CUstream cu_stream, int *out_status))                                         \
  X(cuThreadExchangeStreamCaptureMode, CUresult, (int *inout_mode))                                               \
  X(cuStreamGetCtx, CUresult, (CUstream cu_stream, CUcontext * out_ctx))                                          \
  X(cuDeviceCanAccessPeer, CUresult, (int *out_can, CUdevice dev, CUdevice peer_dev))                             \
  X(cuMemAllocHost, CUresult, (void **out_ptr, size_t size_bytes))                                                \
  X(cuMemFreeHost, CUresult, (void *ptr))                                                                         \
  X(cuMemcpyDtoH, CUresult, (void *dst, CUdeviceptr src, size_t size_bytes))                                      \
  X(cuMemcpyHtoD, CUresult, (CUdeviceptr dst, const void *src, size_t size_bytes))                                \
  X(cuIpcGetMemHandle, CUresult, (CUipcMemHandle * out_handle, CUdeviceptr ptr))                                  \
  X(cuIpcOpenMemHandle, CUresult, (CUdeviceptr * out_ptr, CUipcMemHandle handle, unsigned int ipc_flags))         \
  X(cuIpcCloseMemHandle, CUresult, (CUdeviceptr ptr))                                                             \
  X(cuMemRetainAllocationHandle, CUresult, (CUmemGenericAllocationHandle * out_handle, void *addr))               \
  X(cuMemExportToShareableHandle, CUresult,                                                                       \
    (void *out_shareable, CUmemGenericAllocationHandle handle, int handle_type, unsigned long long export_flags)) \
  X(cuMemImportFromShareableHandle, CUresult,                                                                     \
    (CUmemGenericAllocationHandle * out_handle, void *os_handle, int handle_type))

enum {
  CU_STREAM_CAPTURE_STATUS_NONE = 0,
  CU_STREAM_CAPTURE_MODE_RELAXED = 2,
  CU_STREAM_CAPTURE_STATUS_ACTIVE = 1,
  CUDA_STREAM_HANDLE_SPECIAL_MAX = 2 /* 0 the default stream, 1 CU_STREAM_LEGACY, 2 CU_STREAM_PER_THREAD */
};

#define CP_X(name, ret, params) typedef ret(*cuda_##name##_fn) params;
CUDA_DRIVER_FUNCTIONS(CP_X)
CUDA_VMM_FUNCTIONS(CP_X)
CUDA_OPTIONAL_FUNCTIONS(CP_X)
#undef CP_X

typedef struct cuda_driver_s {
#define CP_X(name, ret, params) cuda_##name##_fn name;
  CUDA_DRIVER_FUNCTIONS(CP_X)
  CUDA_VMM_FUNCTIONS(CP_X)
  CUDA_OPTIONAL_FUNCTIONS(CP_X)
#undef CP_X
} cuda_driver_t;

/* The driver's functions (cuda.c). Written only by the load, which pthread_once publishes to
 * every caller of cp_cuda_load: after a successful load, every required entry is non-NULL;
 * an optional one is NULL when this driver does not provide it. */
extern cuda_driver_t cp_cuda_fn;

/* Around a driver call that must never join, nor break, a stream capture under way (an
 * allocation, a mapping, and every call that gives memory back: cuMemFree, cuMemUnmap,
 * cuMemRelease, cuMemAddressFree): the thread's capture mode is relaxed, as torch's allocator
 * does, and restored after (Note [Capture and contexts] in cuda.c). Made in the global mode
 * while another thread captures, such a call would fail and invalidate that capture (the
 * driver API reference, cuThreadExchangeStreamCaptureMode). *mode carries the one to restore. */
static inline int cp_cuda_relax(int *mode) {
  *mode = CU_STREAM_CAPTURE_MODE_RELAXED;
  return cp_cuda_fn.cuThreadExchangeStreamCaptureMode != NULL &&
         cp_cuda_fn.cuThreadExchangeStreamCaptureMode(mode) == CUDA_SUCCESS;
}
static inline void cp_cuda_unrelax(int relaxed, int *mode) {
  if (relaxed) (void)cp_cuda_fn.cuThreadExchangeStreamCaptureMode(mode);
}

/* When a CUDA_VMM_FUNCTIONS entry could not be resolved: which, and why; "" when all were.
 * Written by the load, like cp_cuda_fn. */
extern char cp_cuda_vmm_missing[CUDA_MESSAGE_BYTES];

/* ------------------------------------------------------------------------------------------
 * Devices (cuda.c) and context scopes (cuda_call.c, Note [Context scope] there)
 * ---------------------------------------------------------------------------------------- */

/* One slot per device ordinal; the backend's ctx points at it.
 * Invariants:
 *  - live == 1  <=>  this process holds exactly one retain of dev's primary context, ctx;
 *  - ordinal, dev, ctx, rdma and the peers are written under cuda_devices_lock while
 *    live == 0, before the release store of live = 1; operations read them only after an
 *    acquire load saw live == 1. */
typedef struct cuda_device_s {
  atomic_int live;
  int ordinal;
  CUdevice dev;
  CUcontext ctx; /* the device's primary context */
  /* Page-mapped memory (cuda_vmm.c), found once when the slot goes live: whether the device
   * takes gpuDirectRDMACapable in cuMemCreate, and the other devices that can reach its memory
   * (cuDeviceCanAccessPeer), which every cuMemSetAccess grants access too (Note [Peers]). */
  int rdma;
  atomic_int posix_fd; /* pages are created exportable as POSIX file descriptors (Note [Sharing pages]) */
  int peer_count;
  CUdevice peers[CP_MAX_DEVICES];
} cuda_device_t;

typedef struct cuda_scope_s {
  CUcontext prev_ctx; /* current before the operation; NULL when none was */
  int switched;       /* 1 when prev_ctx must be put back */
} cuda_scope_t;

/* Make d's primary context current for `call` (CP_OK), or fail with the last error set. */
int cp_cuda_enter(cuda_device_t *d, const char *call, cuda_scope_t *scope);
/* Put the previous context back. Returns `rc` when the operation already failed (its message
 * stands), else CP_OK or the failure to restore. */
int cp_cuda_leave(const cuda_device_t *d, const char *call, const cuda_scope_t *scope, int rc);

/* One driver call that makes or gives back memory, in d's context with the thread's capture
 * mode relaxed (cp_cuda_relax): the frame each such backend entry takes.
 *
 *   cuda_call_t c;
 *   int rc = cp_cuda_begin(d, "cuMemMap", &c);   d's context current, the mode relaxed
 *   if (rc != CP_OK) return rc;
 *   rc = cp_cuda_result(&c, cp_cuda_fn.cuMemMap(...), CP_ERR_OOM, "cuMemMap(...) on device %d", ...);
 *   rc = cp_cuda_leave(d, "cuMemMap", &c.scope, rc);
 *
 * The driver call is an argument of cp_cuda_result, so it is made before cp_cuda_result puts the
 * mode back. cp_cuda_result: CP_OK when `r` is CUDA_SUCCESS; else the failure set (the call named
 * by fmt) and returned: `oom_status` for CUDA_ERROR_OUT_OF_MEMORY (CP_ERR_OOM where the call makes
 * memory, CP_ERR_BACKEND where it gives memory back), CP_ERR_BACKEND for any other error. */
typedef struct cuda_call_s {
  cuda_scope_t scope;
  int mode;    /* the capture mode to put back */
  int relaxed; /* 1 when it was exchanged */
} cuda_call_t;
int cp_cuda_begin(cuda_device_t *d, const char *call, cuda_call_t *c);
int cp_cuda_result(cuda_call_t *c, CUresult r, int oom_status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;

/* CP_OK when `device` names a visible device, else the last error set (cuda_vmm.c); the driver is
 * loaded. */
int cp_cuda_check_ordinal(int device);

/* "CUDA_ERROR_OUT_OF_MEMORY (out of memory)", or the bare number when the driver cannot name it.
 * Returns `buf`. */
const char *cp_cuda_why(CUresult result, char *buf, size_t buf_bytes);

/* Set the last error "cudapool: <call> failed: <driver error>" and return `status`. */
int cp_cuda_fail(int status, CUresult result, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* ------------------------------------------------------------------------------------------
 * Page-mapped memory (cuda_vmm.c)
 * ---------------------------------------------------------------------------------------- */

/* Whether device `ordinal` (handle `dev`; the driver is loaded) can take page-mapped memory:
 * 1 or 0 with the reason in `why` (never NULL), or -1 when asking the driver failed (*out_r
 * then holds its error; the last error is not set, so cp_cuda_backend can go on without). */
int cp_cuda_vmm_probe(int ordinal, CUdevice dev, char *why, size_t why_bytes, CUresult *out_r);

/* Fill the page-mapped entries of `out` (its ctx is the device's slot). */
void cp_cuda_vmm_table(cp_backend_t *out);

/* Find the slot's rdma flag and peers (`count` devices visible; the driver is loaded). Called
 * under cuda_devices_lock before the slot goes live; a failed query means "no": never an error. */
void cp_cuda_vmm_probe_device(cuda_device_t *d, int count);

/* Fill the IPC entries of Note [Sharing between processes] (base/backend.h) when the driver
 * has them (cuda_ipc.c); the page entries are cp_cuda_vmm_table's. */
void cp_cuda_ipc_table(cp_backend_t *out);

/* Fill the entries of Note [Copies for a backup] (base/backend.h) when the driver has all four
 * functions (cuda_copy.c). */
void cp_cuda_copy_table(cp_backend_t *out);

/* Hold cuda_vmm.c's lock across fork() (base/fork.h); called once, by cuda.c. */
void cp_cuda_vmm_register_for_fork(void);

#endif /* CP_CUDA_INTERNAL_H */
