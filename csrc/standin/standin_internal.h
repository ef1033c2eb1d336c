/* standin_internal.h — what the stand-in's files share: the driver types and codes as the CUDA
 * driver API reference lays them out, the driver functions it exports, its state and its lock. */
#ifndef CP_STANDIN_INTERNAL_H
#define CP_STANDIN_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "standin/standin.h"

/* Only the cu* driver functions and the cpstandin_* control functions leave the library (it is
 * built with -fvisibility=hidden). */
#define STI_EXPORT __attribute__((visibility("default")))

/* ------------------------------------------------------------------------------------------
 * Driver types and constants, declared here from the driver API reference (no toolkit header
 * is used). Enumerations are ints in the driver's ABI.
 * ---------------------------------------------------------------------------------------- */

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef uint64_t cuuint64_t;

enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_NO_DEVICE = 100,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_INVALID_CONTEXT = 201,
  CUDA_ERROR_INVALID_HANDLE = 400,
  CUDA_ERROR_ILLEGAL_STATE = 401,
  CUDA_ERROR_NOT_FOUND = 500,
  CUDA_ERROR_NOT_READY = 600,
  CUDA_ERROR_ILLEGAL_ADDRESS = 700,
  CUDA_ERROR_CONTEXT_IS_DESTROYED = 709,
  CUDA_ERROR_NOT_PERMITTED = 800,
  CUDA_ERROR_NOT_SUPPORTED = 801,
  CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
  CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901,
  CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906,
  CUDA_ERROR_CAPTURED_EVENT = 907,
  CUDA_ERROR_UNKNOWN = 999
};

/* Device attributes this stand-in answers (CUdevice_attribute). */
enum {
  CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16,
  CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41,
  CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
  CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
  CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102,
  CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103,
  CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED = 110
};

enum { CU_STREAM_DEFAULT = 0x0, CU_STREAM_NON_BLOCKING = 0x1 };
#define STI_STREAM_LEGACY     ((uintptr_t)0x1) /* CU_STREAM_LEGACY */
#define STI_STREAM_PER_THREAD ((uintptr_t)0x2) /* CU_STREAM_PER_THREAD */

enum { CU_EVENT_BLOCKING_SYNC = 0x1, CU_EVENT_DISABLE_TIMING = 0x2, CU_EVENT_INTERPROCESS = 0x4 };

enum {
  CU_STREAM_CAPTURE_STATUS_NONE = 0,
  CU_STREAM_CAPTURE_STATUS_ACTIVE = 1,
  CU_STREAM_CAPTURE_STATUS_INVALIDATED = 2
};
enum { CU_STREAM_CAPTURE_MODE_GLOBAL = 0, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1, CU_STREAM_CAPTURE_MODE_RELAXED = 2 };

enum {
  CU_GET_PROC_ADDRESS_SUCCESS = 0,
  CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND = 1,
  CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT = 2
};

enum { CU_MEM_ALLOCATION_TYPE_PINNED = 0x1 };
#define CU_IPC_HANDLE_SIZE 64
typedef struct CUipcMemHandle_st {
  char reserved[CU_IPC_HANDLE_SIZE];
} CUipcMemHandle;
enum { CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1 };
enum { CU_MEM_HANDLE_TYPE_NONE = 0x0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1 };
enum { CU_MEM_LOCATION_TYPE_DEVICE = 0x1 };
enum { CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 0x1 };
enum {
  CU_MEM_ACCESS_FLAGS_PROT_NONE = 0x0,
  CU_MEM_ACCESS_FLAGS_PROT_READ = 0x1,
  CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3
};

typedef struct CUmemLocation_st {
  int type; /* CUmemLocationType */
  int id;   /* a device ordinal for CU_MEM_LOCATION_TYPE_DEVICE */
} CUmemLocation;

typedef struct CUmemAllocationProp_st {
  int type;                 /* CUmemAllocationType */
  int requestedHandleTypes; /* CUmemAllocationHandleType */
  CUmemLocation location;
  void *win32HandleMetaData; /* zero except with Windows handles */
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
} CUmemAllocationProp;

typedef struct CUmemAccessDesc_st {
  CUmemLocation location;
  int flags; /* CUmemAccess_flags */
} CUmemAccessDesc;

_Static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp is 32 bytes on 64-bit builds");
_Static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc is 12 bytes");
_Static_assert(sizeof(void *) == 8, "the stand-in assumes a 64-bit build");

/* The driver functions the stand-in exports, by their ABI names. */
STI_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags);
STI_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags, int *status);
STI_EXPORT CUresult cuGetErrorName(CUresult error, const char **out);
STI_EXPORT CUresult cuGetErrorString(CUresult error, const char **out);
STI_EXPORT CUresult cuInit(unsigned int flags);
STI_EXPORT CUresult cuDriverGetVersion(int *out);
STI_EXPORT CUresult cuDeviceGetCount(int *out);
STI_EXPORT CUresult cuDeviceGet(CUdevice *out, int ordinal);
STI_EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev);
STI_EXPORT CUresult cuDeviceTotalMem_v2(size_t *out, CUdevice dev);
STI_EXPORT CUresult cuDeviceGetAttribute(int *out, int attrib, CUdevice dev);
STI_EXPORT CUresult cuDeviceCanAccessPeer(int *out, CUdevice dev, CUdevice peer);
STI_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *out, CUdevice dev);
STI_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev);
STI_EXPORT CUresult cuCtxGetCurrent(CUcontext *out);
STI_EXPORT CUresult cuCtxSetCurrent(CUcontext ctx);
STI_EXPORT CUresult cuCtxSynchronize(void);
STI_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *out, size_t size);
STI_EXPORT CUresult cuMemFree_v2(CUdeviceptr ptr);
STI_EXPORT CUresult cuMemGetInfo_v2(size_t *out_free, size_t *out_total);
STI_EXPORT CUresult cuMemGetAllocationGranularity(size_t *out, const CUmemAllocationProp *prop, int option);
STI_EXPORT CUresult cuMemAddressReserve(CUdeviceptr *out, size_t size, size_t alignment, CUdeviceptr addr,
                                        unsigned long long flags);
STI_EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size);
STI_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *out, size_t size, const CUmemAllocationProp *prop,
                                unsigned long long flags);
STI_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle);
STI_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                             unsigned long long flags);
STI_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size);
STI_EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count);
STI_EXPORT CUresult cuStreamCreate(CUstream *out, unsigned int flags);
STI_EXPORT CUresult cuStreamDestroy_v2(CUstream stream);
STI_EXPORT CUresult cuStreamGetCtx(CUstream stream, CUcontext *out);
STI_EXPORT CUresult cuStreamIsCapturing(CUstream stream, int *out_status);
STI_EXPORT CUresult cuThreadExchangeStreamCaptureMode(int *mode);
STI_EXPORT CUresult cuEventCreate(CUevent *out, unsigned int flags);
STI_EXPORT CUresult cuEventDestroy_v2(CUevent event);
STI_EXPORT CUresult cuEventRecord(CUevent event, CUstream stream);
STI_EXPORT CUresult cuEventQuery(CUevent event);
STI_EXPORT CUresult cuEventSynchronize(CUevent event);
STI_EXPORT CUresult cuMemAllocHost_v2(void **out, size_t size);
STI_EXPORT CUresult cuMemFreeHost(void *ptr);
STI_EXPORT CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t size);
STI_EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t size);
STI_EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *out, CUdeviceptr ptr);
STI_EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *out, CUipcMemHandle handle, unsigned int flags);
STI_EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr ptr);
STI_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *out, void *addr);
STI_EXPORT CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle handle, int type,
                                                 unsigned long long flags);
STI_EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *out, void *os_handle, int type);

/* ------------------------------------------------------------------------------------------
 * Entry points: X(base name, flags). The base name is what cuGetProcAddress is asked for and
 * what the control API's counters and injections take.
 * ---------------------------------------------------------------------------------------- */

enum {
  STI_F_NOINIT = 1u,   /* allowed before cuInit */
  STI_F_NOSTICKY = 2u, /* still answers after a sticky error (no device state involved) */
  STI_F_UNSAFE = 4u    /* potentially unsafe during a stream capture (Note [Capture prohibition]) */
};

#define STI_ENTRIES(X)                                 \
  X(cuGetProcAddress, STI_F_NOINIT | STI_F_NOSTICKY)   \
  X(cuGetErrorName, STI_F_NOINIT | STI_F_NOSTICKY)     \
  X(cuGetErrorString, STI_F_NOINIT | STI_F_NOSTICKY)   \
  X(cuInit, STI_F_NOINIT)                              \
  X(cuDriverGetVersion, STI_F_NOINIT | STI_F_NOSTICKY) \
  X(cuDeviceGetCount, STI_F_NOSTICKY)                  \
  X(cuDeviceGet, STI_F_NOSTICKY)                       \
  X(cuDeviceGetName, STI_F_NOSTICKY)                   \
  X(cuDeviceTotalMem, STI_F_NOSTICKY)                  \
  X(cuDeviceGetAttribute, STI_F_NOSTICKY)              \
  X(cuDeviceCanAccessPeer, STI_F_NOSTICKY)             \
  X(cuDevicePrimaryCtxRetain, 0)                       \
  X(cuDevicePrimaryCtxRelease, STI_F_NOSTICKY)         \
  X(cuCtxGetCurrent, STI_F_NOSTICKY)                   \
  X(cuCtxSetCurrent, STI_F_NOSTICKY)                   \
  X(cuCtxSynchronize, STI_F_UNSAFE)                    \
  X(cuMemAlloc, STI_F_UNSAFE)                          \
  X(cuMemFree, STI_F_UNSAFE)                           \
  X(cuMemGetInfo, 0)                                   \
  X(cuMemGetAllocationGranularity, 0)                  \
  X(cuMemAddressReserve, STI_F_UNSAFE)                 \
  X(cuMemAddressFree, STI_F_UNSAFE)                    \
  X(cuMemCreate, STI_F_UNSAFE)                         \
  X(cuMemRelease, STI_F_UNSAFE)                        \
  X(cuMemMap, STI_F_UNSAFE)                            \
  X(cuMemUnmap, STI_F_UNSAFE)                          \
  X(cuMemSetAccess, STI_F_UNSAFE)                      \
  X(cuStreamCreate, 0)                                 \
  X(cuStreamDestroy, 0)                                \
  X(cuStreamGetCtx, 0)                                 \
  X(cuStreamIsCapturing, 0)                            \
  X(cuThreadExchangeStreamCaptureMode, STI_F_NOSTICKY) \
  X(cuEventCreate, 0)                                  \
  X(cuEventDestroy, 0)                                 \
  X(cuEventRecord, 0)                                  \
  X(cuEventQuery, STI_F_UNSAFE)                        \
  X(cuEventSynchronize, STI_F_UNSAFE)                  \
  X(cuMemAllocHost, STI_F_UNSAFE)                      \
  X(cuMemFreeHost, STI_F_UNSAFE)                       \
  X(cuMemcpyDtoH, 0)                                   \
  X(cuMemcpyHtoD, 0)                                   \
  X(cuIpcGetMemHandle, 0)                              \
  X(cuIpcOpenMemHandle, STI_F_UNSAFE)                  \
  X(cuIpcCloseMemHandle, STI_F_UNSAFE)                 \
  X(cuMemRetainAllocationHandle, 0)                    \
  X(cuMemExportToShareableHandle, 0)                   \
  X(cuMemImportFromShareableHandle, STI_F_UNSAFE)

typedef enum sti_fn_e {
#define STI_X(name, flags) STI_FN_##name,
  STI_ENTRIES(STI_X)
#undef STI_X
      STI_FN_COUNT
} sti_fn_t;

/* ------------------------------------------------------------------------------------------
 * State, all of it under sti.lock (one mutex: the stand-in is small, and TSan checks it).
 * Objects live in arrays indexed by id - 1 and are never removed before a reset, so a stale
 * handle is always recognised as one; handles are tagged numbers (STI_TAG_*), never pointers.
 * ---------------------------------------------------------------------------------------- */

#define STI_MAX_DEVICES 16
#define STI_MAX_FAULTS  64
#define STI_FAULT_BYTES 256

#define STI_TAG_CTX         ((uintptr_t)0xC70000000ull)
#define STI_TAG_STREAM      ((uintptr_t)0x570000000ull)
#define STI_TAG_EVENT       ((uintptr_t)0xE70000000ull)
#define STI_TAG_HANDLE      ((uintptr_t)0x470000000ull)
#define STI_HOST_PAGE_BYTES ((size_t)4096)
#define STI_ALLOC_ALIGN     512                         /* what cuMemAlloc's addresses are aligned to at least */
#define STI_TAG_SPAN        ((uintptr_t)0x010000000ull) /* ids run from 1 below the next tag */

typedef struct sti_device_s {
  size_t capacity, used;
  size_t granularity;
  int vmm, rdma;
  int posix_fd;                /* CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED */
  unsigned retains;            /* of the primary context; active while > 0 */
  uint32_t legacy, per_thread; /* stream ids of the active context's default streams */
} sti_device_t;

/* Note [Memory shared between processes]
 * Bytes behind device memory are anonymous host memory until the memory is exported (cuIpcGetMemHandle
 * of a cuMemAlloc allocation, cuMemExportToShareableHandle of a handle): then they move, at the same
 * host address, into a memfd (`fd` holds its descriptor + 1; 0: none), which another process maps
 * too: it takes the descriptor with pidfd_getfd (an IPC handle carries the exporter's pid and the
 * descriptor's number) or is handed it (a POSIX file descriptor export). Both processes then see
 * the same bytes, and the memory lives while any of them maps it. */
typedef struct sti_alloc_s { /* cuMemAlloc, or memory of another process (cuIpcOpenMemHandle) */
  CUdeviceptr addr;
  size_t size;
  int device;
  int live;
  unsigned char *backing;
  int fd;     /* the memfd + 1 once shared, else 0 */
  int opened; /* opened by cuIpcOpenMemHandle: closed with cuIpcCloseMemHandle, never charged */
} sti_alloc_t;

typedef struct sti_reservation_s {
  CUdeviceptr addr;
  size_t size;
  int live;
} sti_reservation_t;

/* Note [Handles to one physical allocation]
 * The reference: cuMemImportFromShareableHandle gives a new handle to the memory the descriptor
 * names, which another handle created; no memory is created, and the memory is freed only when
 * every handle to it, the creator's and each importer's in any process, is released (and
 * unmapped). So an import is never charged to a device, and a creator's release may leave its
 * memory on the device. Each process runs a stand-in of its own, so the handles to one memory
 * are counted where every process sees them: the memfd holds one page past the memory's bytes,
 * the tail (sti_tail_t), with a slot per process holding handles (its pid and how many). A
 * created handle settled (released, unmapped) while other handles hold the memory leaves its
 * charge on the device, listed in sti.lingers, until a sweep (before a charge is refused,
 * cuMemGetInfo, cpstandin_used, after a handle settles) finds no holder left. A holder whose
 * process has ended holds nothing, as a driver reclaims an ended process's handles.
 * What the stand-in assumes where the reference is silent: (1) the descriptor alone does not
 * keep the memory: an import from the descriptor of memory no handle holds any more fails with
 * CUDA_ERROR_INVALID_HANDLE; (2) an import in the creating process is on the creator's device,
 * an import elsewhere on the importer's current device (device numbers are per process); (3)
 * each process's device is its own: memory created elsewhere is charged there, not here. */
#define STI_TAIL_SLOTS ((STI_HOST_PAGE_BYTES - 16) / 8)
#define STI_TAIL_MAGIC 0x6c696174u /* "tail" */
typedef struct sti_tail_s {
  uint32_t magic;
  int32_t origin_pid, origin_device; /* the creator's process and device */
  uint32_t unused;
  _Atomic uint64_t slots[STI_TAIL_SLOTS]; /* pid << 32 | that process's handles to it; 0: free */
} sti_tail_t;
_Static_assert(sizeof(sti_tail_t) == STI_HOST_PAGE_BYTES, "the tail is one page");

typedef struct sti_handle_s { /* cuMemCreate, or cuMemImportFromShareableHandle */
  size_t size;
  int device;
  int rdma;
  int released;
  unsigned maps;
  int holds;    /* this handle's bytes still there (not settled) */
  int imported; /* charged nothing (Note [Handles to one physical allocation]) */
  unsigned char *backing;
  int exportable;   /* created with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, or imported */
  int fd;           /* the memfd + 1 once exported or imported, else 0 */
  sti_tail_t *tail; /* the memfd's tail, mapped, once exported or imported; else NULL */
  unsigned retains; /* cuMemRetainAllocationHandle references not released yet */
} sti_handle_t;

/* Memory created here, its handle settled, that handles elsewhere still hold: charged until then. */
typedef struct sti_linger_s {
  int device;
  size_t size;
  sti_tail_t *tail;
} sti_linger_t;

typedef struct sti_mapping_s {
  CUdeviceptr addr;
  size_t size;
  uint32_t handle;      /* id */
  uint32_t read, write; /* device masks */
  int live;
} sti_mapping_t;

enum { STI_ITEM_LAUNCH = 1, STI_ITEM_MARKER = 2 };

typedef struct sti_item_s {
  uint64_t ticket; /* global order of submission */
  int kind;
  CUdeviceptr addr; /* launches: what they touch */
  size_t bytes;
} sti_item_t;

enum { STI_STREAM_USER = 0, STI_STREAM_IS_LEGACY = 1, STI_STREAM_IS_PER_THREAD = 2 };

typedef struct sti_stream_s {
  int device;
  int kind;
  unsigned flags; /* CU_STREAM_NON_BLOCKING */
  int live;       /* 0 once destroyed (its queue still drains) */
  int capture;    /* CU_STREAM_CAPTURE_STATUS_* */
  int capture_mode;
  pthread_t capture_thread;
  sti_item_t *items; /* incomplete work, oldest first, from head */
  size_t head, count, cap;
  uint64_t done; /* highest ticket completed on it */
} sti_stream_t;

typedef struct sti_event_s {
  int device;
  int live;
  int recorded; /* 0: never recorded, complete */
  int captured; /* last recorded into a capture */
  uint32_t stream;
  uint64_t ticket;
} sti_event_t;

typedef struct sti_fault_s {
  int kind;
  char text[STI_FAULT_BYTES];
} sti_fault_t;

typedef struct sti_injection_s {
  sti_fn_t fn;
  unsigned countdown;
  CUresult result;
  int after;
} sti_injection_t;

#define STI_MAX_INJECTIONS 32

typedef struct sti_state_s {
  pthread_mutex_t lock;
  int initialized; /* cuInit(0) succeeded; survives resets */
  int device_count;
  sti_device_t devices[STI_MAX_DEVICES];
  unsigned char peer[STI_MAX_DEVICES][STI_MAX_DEVICES]; /* [dev][peer]: dev reaches peer's memory */
  CUresult sticky;
  CUdeviceptr next_va;
  uint64_t next_ticket;
  unsigned long long calls[STI_FN_COUNT];
  sti_injection_t injections[STI_MAX_INJECTIONS];
  size_t injection_count;
  size_t host_allocs; /* cuMemAllocHost blocks not freed (standin_copy.c) */
  size_t fault_count;
  sti_fault_t faults[STI_MAX_FAULTS];
#define STI_TABLE(type, name) \
  type *name;                 \
  size_t name##_count, name##_cap;
  STI_TABLE(sti_alloc_t, allocs)
  STI_TABLE(sti_reservation_t, reservations)
  STI_TABLE(sti_handle_t, handles)
  STI_TABLE(sti_mapping_t, mappings)
  STI_TABLE(sti_stream_t, streams)
  STI_TABLE(sti_event_t, events)
  STI_TABLE(sti_linger_t, lingers)
#undef STI_TABLE
} sti_state_t;

extern sti_state_t sti;

/* The calling thread's current context (device + 1; 0 when none) and capture mode. */
extern _Thread_local int sti_current;
extern _Thread_local int sti_mode;

/* One driver call: sti_enter takes the lock and applies the call's rules (initialised, injected
 * failure, sticky error, capture prohibition); sti_leave reports and releases it. Every driver
 * function is `r = sti_enter(&c, fn); if (r == 0) r = <work>; return sti_leave(&c, r);`. */
typedef struct sti_call_s {
  sti_fn_t fn;
  CUresult after; /* an injected failure reported after the work */
} sti_call_t;

CUresult sti_enter(sti_call_t *c, sti_fn_t fn);
/* Take the lock (the control calls); the first taker sets the configuration up. */
void sti_lock(void);
CUresult sti_leave(const sti_call_t *c, CUresult r);
const char *sti_fn_name(sti_fn_t fn);

/* Record a fault (standin.c); device faults (ILLEGAL_ADDRESS, IN_USE) also make
 * CUDA_ERROR_ILLEGAL_ADDRESS sticky. */
void sti_fault(int kind, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Grow a table to hold one more entry: 0, or -1 without host memory. */
int sti_grow(void **table, size_t *cap, size_t count, size_t entry_bytes);
/* Room for one more entry at the end of a table of allocations, reservations or mappings.
 * When the table is full, the entries given back since (live 0) are dropped first, so that
 * the lookups, which walk the table, cost what is live rather than everything made since the
 * reset; it still doubles when more than half of it is live (each drop then pays for itself).
 * No index into these tables is kept between calls (handles, named by their index, never
 * move). -1: no host memory. */
int sti_room(void **table, size_t *count, size_t *cap, size_t entry_bytes, size_t live_offset);
#define STI_ROOM(table, count, cap, type) \
  sti_room((void **)&(table), &(count), &(cap), sizeof(type), offsetof(type, live))

/* The calling thread's current device, or INVALID_CONTEXT (none) / CONTEXT_IS_DESTROYED. */
CUresult sti_current_device(int *out_device);
int sti_device_ok(int device);

/* standin_mem.c */
void sti_mem_clear(void);                                     /* reset: every allocation, range, handle, mapping */
void sti_mem_drop_context(int device);                        /* the context's cuMemAlloc memory, at its reset */
void sti_backing_free(unsigned char *p, size_t size, int fd); /* `fd`: a memfd + 1, or 0 */
CUdeviceptr sti_va_take(size_t size, size_t alignment);       /* a fresh device range, or 0 */
sti_alloc_t *sti_alloc_at(CUdeviceptr ptr, size_t bytes);     /* the allocation holding them, or NULL */
sti_handle_t *sti_handle_of(CUmemGenericAllocationHandle h);  /* or NULL */
CUresult sti_handle_room(void);                               /* room for one more handle */
CUmemGenericAllocationHandle sti_handle_push(sti_handle_t h); /* after sti_handle_room */

/* standin_share.c (Note [Handles to one physical allocation]) */
void sti_share_sweep(void);          /* lingering charges no handle holds any more, given back */
int sti_share_drop(sti_handle_t *h); /* a settled handle's count dropped: 1 when its charge lingers */
void sti_share_clear(void);          /* reset: this process's counts dropped, nothing lingers */
int sti_mem_writable(int device, CUdeviceptr ptr, size_t bytes);
void sti_mem_touch(CUdeviceptr ptr, size_t bytes, unsigned char value);
/* The host bytes behind device address `ptr` and how many follow in the same allocation or
 * mapping (*out_len); NULL when nothing is there. */
unsigned char *sti_mem_bytes(CUdeviceptr ptr, size_t *out_len);

/* standin_stream.c */
void sti_stream_clear(void);                                        /* reset: every stream and event */
int sti_stream_activate(int device);                                /* the default streams of a new context: 0 or -1 */
void sti_stream_drop_context(int device);                           /* its streams and events, at its reset */
void sti_drain_device(int device);                                  /* complete every stream of the device */
int sti_in_use(CUdeviceptr ptr, size_t size, uint32_t *out_stream); /* a pending launch touches it */
CUresult sti_capture_check(sti_fn_t fn);                            /* Note [Capture prohibition] */
uintptr_t sti_stream_handle(uint32_t id);

#endif /* CP_STANDIN_INTERNAL_H */
