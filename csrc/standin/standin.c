/* standin.c — the libcuda stand-in's core: its state and lock, call accounting (injection, sticky
 * errors, counters), faults, cuGetProcAddress, initialisation, devices, primary contexts, control. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "standin/standin_internal.h"

sti_state_t sti = {.lock = PTHREAD_MUTEX_INITIALIZER};
_Thread_local int sti_current;
_Thread_local int sti_mode; /* CU_STREAM_CAPTURE_MODE_GLOBAL (0) until exchanged */

#define STI_DRIVER_VERSION 12040 /* the CUDA version this stand-in answers as */
#define MiB                ((size_t)1 << 20)

static const char *const sti_names[STI_FN_COUNT] = {
#define STI_X(name, flags) #name,
    STI_ENTRIES(STI_X)
#undef STI_X
};

static const unsigned sti_flags[STI_FN_COUNT] = {
#define STI_X(name, flags) flags,
    STI_ENTRIES(STI_X)
#undef STI_X
};

const char *sti_fn_name(sti_fn_t fn) { return fn < STI_FN_COUNT ? sti_names[fn] : "?"; }

static int sti_fn_find(const char *name) {
  if (name == NULL) return -1;
  for (int i = 0; i < STI_FN_COUNT; i++)
    if (strcmp(sti_names[i], name) == 0) return i;
  return -1;
}

/* ------------------------------------------------------------------------------------------
 * Calls
 * ---------------------------------------------------------------------------------------- */

CUresult sti_enter(sti_call_t *c, sti_fn_t fn) {
  c->fn = fn;
  c->after = CUDA_SUCCESS;
  sti_lock();
  sti.calls[fn]++;
  const unsigned flags = sti_flags[fn];
  /* Injections count calls of their function; the one that reaches zero fires. */
  CUresult injected = CUDA_SUCCESS;
  for (size_t i = 0; i < sti.injection_count;) {
    sti_injection_t *inj = &sti.injections[i];
    if (inj->fn == fn && --inj->countdown == 0) {
      if (inj->after)
        c->after = inj->result;
      else if (injected == CUDA_SUCCESS)
        injected = inj->result;
      sti.injections[i] = sti.injections[--sti.injection_count];
      continue;
    }
    i++;
  }
  /* The reference: every call but a few returns CUDA_ERROR_NOT_INITIALIZED before cuInit. */
  if (!(flags & STI_F_NOINIT) && !sti.initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (injected != CUDA_SUCCESS) return injected;
  if (sti.sticky != CUDA_SUCCESS && !(flags & STI_F_NOSTICKY)) return sti.sticky;
  if (flags & STI_F_UNSAFE) return sti_capture_check(fn);
  return CUDA_SUCCESS;
}

CUresult sti_leave(const sti_call_t *c, CUresult r) {
  if (r == CUDA_SUCCESS && c->after != CUDA_SUCCESS) r = c->after;
  pthread_mutex_unlock(&sti.lock);
  return r;
}

void sti_fault(int kind, const char *fmt, ...) {
  if (sti.fault_count < STI_MAX_FAULTS) {
    sti_fault_t *f = &sti.faults[sti.fault_count];
    f->kind = kind;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(f->text, sizeof f->text, fmt, ap);
    va_end(ap);
  }
  sti.fault_count++;
  /* A device fault corrupts the context, as on a GPU: everything fails from now on. */
  if (kind == CPSTANDIN_FAULT_ILLEGAL_ADDRESS || kind == CPSTANDIN_FAULT_IN_USE)
    sti.sticky = CUDA_ERROR_ILLEGAL_ADDRESS;
}

int sti_grow(void **table, size_t *cap, size_t count, size_t entry_bytes) {
  if (count < *cap) return 0;
  const size_t n = *cap == 0 ? 16 : 2 * *cap;
  void *p = realloc(*table, n * entry_bytes);
  if (p == NULL) return -1;
  *table = p;
  *cap = n;
  return 0;
}

int sti_room(void **table, size_t *count, size_t *cap, size_t entry_bytes, size_t live_offset) {
  if (*count < *cap || *table == NULL) return sti_grow(table, cap, *count, entry_bytes);
  unsigned char *t = *table;
  size_t kept = 0;
  for (size_t i = 0; i < *count; i++) {
    int live;
    memcpy(&live, t + i * entry_bytes + live_offset, sizeof live);
    if (!live) continue;
    if (kept != i) memmove(t + kept * entry_bytes, t + i * entry_bytes, entry_bytes);
    kept++;
  }
  *count = kept;
  return kept > *cap / 2 ? sti_grow(table, cap, *cap, entry_bytes) : 0;
}

int sti_device_ok(int device) { return device >= 0 && device < sti.device_count; }

CUresult sti_current_device(int *out_device) {
  if (sti_current == 0) return CUDA_ERROR_INVALID_CONTEXT;
  const int device = sti_current - 1;
  /* A primary context whose last retain was released is reset: it is not usable until retained. */
  if (!sti_device_ok(device) || sti.devices[device].retains == 0) return CUDA_ERROR_CONTEXT_IS_DESTROYED;
  *out_device = device;
  return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------------------------------
 * Configuration and reset
 * ---------------------------------------------------------------------------------------- */

static long sti_env_long(const char *name, long fallback, long lo, long hi) {
  const char *text = getenv(name);
  if (text == NULL || text[0] == '\0') return fallback;
  char *end = NULL;
  const long v = strtol(text, &end, 10);
  return end != NULL && *end == '\0' && v >= lo && v <= hi ? v : fallback;
}

static void sti_configure(int count, size_t capacity) {
  sti.device_count = count;
  for (int i = 0; i < STI_MAX_DEVICES; i++) {
    sti_device_t *d = &sti.devices[i];
    memset(d, 0, sizeof *d);
    d->capacity = capacity;
    d->granularity = 2 * MiB;
    d->vmm = 1;
    d->rdma = 1;
    d->posix_fd = 1;
    for (int j = 0; j < STI_MAX_DEVICES; j++) sti.peer[i][j] = i != j;
  }
}

/* Everything but the initialisation, back to the start. Called with the lock held. */
static void sti_reset_locked(void) {
  sti_stream_clear();
  sti_mem_clear();
  const long count = sti_env_long("CPSTANDIN_DEVICES", 2, 1, STI_MAX_DEVICES);
  const long mb = sti_env_long("CPSTANDIN_MEMORY_MB", 1024, 1, 1L << 24);
  sti_configure((int)count, (size_t)mb * MiB);
  sti.sticky = CUDA_SUCCESS;
  sti.next_va = 0x200000000000ull; /* where device addresses start */
  sti.next_ticket = 1;
  memset(sti.calls, 0, sizeof sti.calls);
  sti.injection_count = 0;
  sti.fault_count = 0;
}

static int sti_configured; /* the first call of anything sets the defaults up */

void sti_lock(void) {
  pthread_mutex_lock(&sti.lock);
  if (!sti_configured) {
    sti_configured = 1;
    sti_reset_locked();
  }
}

/* ------------------------------------------------------------------------------------------
 * Errors, versions, cuGetProcAddress
 * ---------------------------------------------------------------------------------------- */

typedef struct sti_error_s {
  CUresult code;
  const char *name;
  const char *text; /* this stand-in's own wording */
} sti_error_t;

static const sti_error_t sti_errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {CUDA_ERROR_CONTEXT_IS_DESTROYED, "CUDA_ERROR_CONTEXT_IS_DESTROYED", "context is destroyed"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
     "operation not permitted when stream is capturing"},
    {CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
     "operation failed due to a previous error during capture"},
    {CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
     "operation would make the legacy stream depend on a capturing blocking stream"},
    {CUDA_ERROR_CAPTURED_EVENT, "CUDA_ERROR_CAPTURED_EVENT",
     "operation not permitted on an event last recorded in a capturing stream"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static const sti_error_t *sti_error(CUresult code) {
  for (size_t i = 0; i < sizeof sti_errors / sizeof sti_errors[0]; i++)
    if (sti_errors[i].code == code) return &sti_errors[i];
  return NULL;
}

/* The reference: an unknown code gives CUDA_ERROR_INVALID_VALUE and a NULL string. */
CUresult cuGetErrorName(CUresult error, const char **out) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuGetErrorName);
  if (r == CUDA_SUCCESS && out == NULL) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) {
    const sti_error_t *e = sti_error(error);
    *out = e != NULL ? e->name : NULL;
    if (e == NULL) r = CUDA_ERROR_INVALID_VALUE;
  }
  return sti_leave(&c, r);
}

CUresult cuGetErrorString(CUresult error, const char **out) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuGetErrorString);
  if (r == CUDA_SUCCESS && out == NULL) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) {
    const sti_error_t *e = sti_error(error);
    *out = e != NULL ? e->text : NULL;
    if (e == NULL) r = CUDA_ERROR_INVALID_VALUE;
  }
  return sti_leave(&c, r);
}

/* What cuGetProcAddress hands out: base name, the version that introduced the ABI given, and
 * the function. One ABI per name here (no per-thread-stream variants: the default-stream flags
 * all find the same function). */
typedef struct sti_proc_s {
  const char *name;
  int since;
  void (*fn)(void);
} sti_proc_t;

#define STI_PROC(name, since, fn) \
  { name, since, (void (*)(void))fn }
static const sti_proc_t sti_procs[] = {
    STI_PROC("cuGetProcAddress", 12000, cuGetProcAddress_v2),
    STI_PROC("cuGetErrorName", 6000, cuGetErrorName),
    STI_PROC("cuGetErrorString", 6000, cuGetErrorString),
    STI_PROC("cuInit", 2000, cuInit),
    STI_PROC("cuDriverGetVersion", 2020, cuDriverGetVersion),
    STI_PROC("cuDeviceGetCount", 2000, cuDeviceGetCount),
    STI_PROC("cuDeviceGet", 2000, cuDeviceGet),
    STI_PROC("cuDeviceGetName", 2000, cuDeviceGetName),
    STI_PROC("cuDeviceTotalMem", 3020, cuDeviceTotalMem_v2),
    STI_PROC("cuDeviceGetAttribute", 2000, cuDeviceGetAttribute),
    STI_PROC("cuDeviceCanAccessPeer", 4000, cuDeviceCanAccessPeer),
    STI_PROC("cuDevicePrimaryCtxRetain", 7000, cuDevicePrimaryCtxRetain),
    STI_PROC("cuDevicePrimaryCtxRelease", 11000, cuDevicePrimaryCtxRelease_v2),
    STI_PROC("cuCtxGetCurrent", 4000, cuCtxGetCurrent),
    STI_PROC("cuCtxSetCurrent", 4000, cuCtxSetCurrent),
    STI_PROC("cuCtxSynchronize", 2000, cuCtxSynchronize),
    STI_PROC("cuMemAlloc", 3020, cuMemAlloc_v2),
    STI_PROC("cuMemFree", 3020, cuMemFree_v2),
    STI_PROC("cuMemGetInfo", 3020, cuMemGetInfo_v2),
    STI_PROC("cuMemGetAllocationGranularity", 10020, cuMemGetAllocationGranularity),
    STI_PROC("cuMemAddressReserve", 10020, cuMemAddressReserve),
    STI_PROC("cuMemAddressFree", 10020, cuMemAddressFree),
    STI_PROC("cuMemCreate", 10020, cuMemCreate),
    STI_PROC("cuMemRelease", 10020, cuMemRelease),
    STI_PROC("cuMemMap", 10020, cuMemMap),
    STI_PROC("cuMemUnmap", 10020, cuMemUnmap),
    STI_PROC("cuMemSetAccess", 10020, cuMemSetAccess),
    STI_PROC("cuStreamCreate", 2000, cuStreamCreate),
    STI_PROC("cuStreamDestroy", 4000, cuStreamDestroy_v2),
    STI_PROC("cuStreamGetCtx", 9020, cuStreamGetCtx),
    STI_PROC("cuStreamIsCapturing", 10000, cuStreamIsCapturing),
    STI_PROC("cuThreadExchangeStreamCaptureMode", 10010, cuThreadExchangeStreamCaptureMode),
    STI_PROC("cuEventCreate", 2000, cuEventCreate),
    STI_PROC("cuEventDestroy", 4000, cuEventDestroy_v2),
    STI_PROC("cuEventRecord", 2000, cuEventRecord),
    STI_PROC("cuEventQuery", 2000, cuEventQuery),
    STI_PROC("cuEventSynchronize", 2000, cuEventSynchronize),
    STI_PROC("cuMemAllocHost", 3020, cuMemAllocHost_v2),
    STI_PROC("cuMemFreeHost", 2000, cuMemFreeHost),
    STI_PROC("cuMemcpyDtoH", 3020, cuMemcpyDtoH_v2),
    STI_PROC("cuMemcpyHtoD", 3020, cuMemcpyHtoD_v2),
    STI_PROC("cuIpcGetMemHandle", 4010, cuIpcGetMemHandle),
    STI_PROC("cuIpcOpenMemHandle", 11000, cuIpcOpenMemHandle_v2),
    STI_PROC("cuIpcCloseMemHandle", 4010, cuIpcCloseMemHandle),
    STI_PROC("cuMemRetainAllocationHandle", 11000, cuMemRetainAllocationHandle),
    STI_PROC("cuMemExportToShareableHandle", 10020, cuMemExportToShareableHandle),
    STI_PROC("cuMemImportFromShareableHandle", 10020, cuMemImportFromShareableHandle),
};
#undef STI_PROC

/* The reference: a version above the driver's is CUDA_ERROR_INVALID_VALUE; a symbol that is
 * unknown, or too new for `version`, is CUDA_SUCCESS with *pfn NULL and the reason in *status.
 * It works before cuInit. */
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags, int *status) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuGetProcAddress);
  if (r == CUDA_SUCCESS && (symbol == NULL || pfn == NULL || version > STI_DRIVER_VERSION || flags > 3))
    r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) {
    int found = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    *pfn = NULL;
    for (size_t i = 0; i < sizeof sti_procs / sizeof sti_procs[0]; i++) {
      if (strcmp(sti_procs[i].name, symbol) != 0) continue;
      found = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
      if (version < sti_procs[i].since) break;
      found = CU_GET_PROC_ADDRESS_SUCCESS;
      memcpy(pfn, &sti_procs[i].fn, sizeof *pfn); /* POSIX: a function address fits a void * */
      break;
    }
    if (status != NULL) *status = found;
  }
  return sti_leave(&c, r);
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags) {
  return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}

/* ------------------------------------------------------------------------------------------
 * Initialisation and devices
 * ---------------------------------------------------------------------------------------- */

CUresult cuInit(unsigned int flags) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuInit);
  if (r == CUDA_SUCCESS && flags != 0) r = CUDA_ERROR_INVALID_VALUE; /* the reference: must be 0 */
  if (r == CUDA_SUCCESS && sti.device_count == 0) r = CUDA_ERROR_NO_DEVICE;
  if (r == CUDA_SUCCESS) sti.initialized = 1;
  return sti_leave(&c, r);
}

CUresult cuDriverGetVersion(int *out) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuDriverGetVersion);
  if (r == CUDA_SUCCESS && out == NULL) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) *out = STI_DRIVER_VERSION;
  return sti_leave(&c, r);
}

CUresult cuDeviceGetCount(int *out) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuDeviceGetCount);
  if (r == CUDA_SUCCESS && out == NULL) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) *out = sti.device_count;
  return sti_leave(&c, r);
}

CUresult cuDeviceGet(CUdevice *out, int ordinal) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuDeviceGet);
  if (r == CUDA_SUCCESS && out == NULL) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS && !sti_device_ok(ordinal)) r = CUDA_ERROR_INVALID_DEVICE;
  if (r == CUDA_SUCCESS) *out = ordinal; /* a device handle is its ordinal here */
  return sti_leave(&c, r);
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuDeviceGetName);
  if (r == CUDA_SUCCESS && (name == NULL || len <= 0)) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS && !sti_device_ok(dev)) r = CUDA_ERROR_INVALID_DEVICE;
  if (r == CUDA_SUCCESS) snprintf(name, (size_t)len, "cudapool stand-in device %d", dev);
  return sti_leave(&c, r);
}

CUresult cuDeviceTotalMem_v2(size_t *out, CUdevice dev) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuDeviceTotalMem);
  if (r == CUDA_SUCCESS && out == NULL) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS && !sti_device_ok(dev)) r = CUDA_ERROR_INVALID_DEVICE;
  if (r == CUDA_SUCCESS) *out = sti.devices[dev].capacity;
  return sti_leave(&c, r);
}

CUresult cuDeviceGetAttribute(int *out, int attrib, CUdevice dev) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuDeviceGetAttribute);
  if (r == CUDA_SUCCESS && out == NULL) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS && !sti_device_ok(dev)) r = CUDA_ERROR_INVALID_DEVICE;
  if (r == CUDA_SUCCESS) {
    const sti_device_t *d = &sti.devices[dev];
    switch (attrib) {
      case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *out = 132; break;
      case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: *out = 1; break;
      case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *out = 9; break;
      case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *out = 0; break;
      case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: *out = d->vmm; break;
      case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: *out = d->vmm && d->posix_fd; break;
      case CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED: *out = d->vmm && d->rdma; break;
      default: r = CUDA_ERROR_INVALID_VALUE; /* an attribute this stand-in does not know */
    }
  }
  return sti_leave(&c, r);
}

/* The reference: 1 when contexts on `dev` can access memory of `peer`; a device is not its
 * own peer here. */
CUresult cuDeviceCanAccessPeer(int *out, CUdevice dev, CUdevice peer) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuDeviceCanAccessPeer);
  if (r == CUDA_SUCCESS && out == NULL) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS && (!sti_device_ok(dev) || !sti_device_ok(peer))) r = CUDA_ERROR_INVALID_DEVICE;
  if (r == CUDA_SUCCESS) *out = dev != peer && sti.peer[dev][peer];
  return sti_leave(&c, r);
}

/* ------------------------------------------------------------------------------------------
 * Primary contexts. A context handle names its device; the context is active while retained.
 * The reference: the context is reset when its last retain is released (its memory, streams
 * and events go), and releasing one that is not retained is CUDA_ERROR_INVALID_CONTEXT.
 * ---------------------------------------------------------------------------------------- */

CUresult cuDevicePrimaryCtxRetain(CUcontext *out, CUdevice dev) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuDevicePrimaryCtxRetain);
  if (r == CUDA_SUCCESS && out == NULL) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS && !sti_device_ok(dev)) r = CUDA_ERROR_INVALID_DEVICE;
  if (r == CUDA_SUCCESS && sti.devices[dev].retains == 0 && sti_stream_activate(dev) != 0) r = CUDA_ERROR_OUT_OF_MEMORY;
  if (r == CUDA_SUCCESS) {
    sti.devices[dev].retains++;
    *out = (CUcontext)(STI_TAG_CTX + (uintptr_t)dev + 1);
  }
  return sti_leave(&c, r);
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuDevicePrimaryCtxRelease);
  if (r == CUDA_SUCCESS && !sti_device_ok(dev)) r = CUDA_ERROR_INVALID_DEVICE;
  if (r == CUDA_SUCCESS && sti.devices[dev].retains == 0) r = CUDA_ERROR_INVALID_CONTEXT;
  if (r == CUDA_SUCCESS && --sti.devices[dev].retains == 0) {
    sti_stream_drop_context(dev);
    sti_mem_drop_context(dev);
  }
  return sti_leave(&c, r);
}

CUresult cuCtxGetCurrent(CUcontext *out) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuCtxGetCurrent);
  if (r == CUDA_SUCCESS && out == NULL) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) *out = sti_current == 0 ? NULL : (CUcontext)(STI_TAG_CTX + (uintptr_t)sti_current);
  return sti_leave(&c, r);
}

/* NULL unbinds; a handle that names no context is CUDA_ERROR_INVALID_CONTEXT. A reset primary
 * context may be bound, but calls in it fail until it is retained again. */
CUresult cuCtxSetCurrent(CUcontext ctx) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuCtxSetCurrent);
  const uintptr_t v = (uintptr_t)ctx;
  if (r == CUDA_SUCCESS && ctx != NULL && (v <= STI_TAG_CTX || v > STI_TAG_CTX + (uintptr_t)sti.device_count))
    r = CUDA_ERROR_INVALID_CONTEXT;
  if (r == CUDA_SUCCESS) sti_current = ctx == NULL ? 0 : (int)(v - STI_TAG_CTX);
  return sti_leave(&c, r);
}

CUresult cuCtxSynchronize(void) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuCtxSynchronize);
  int device = 0;
  if (r == CUDA_SUCCESS) r = sti_current_device(&device);
  if (r == CUDA_SUCCESS) sti_drain_device(device);
  return sti_leave(&c, r);
}

/* ------------------------------------------------------------------------------------------
 * Control API (standin.h)
 * ---------------------------------------------------------------------------------------- */

STI_EXPORT int cpstandin_version(void) { return CPSTANDIN_VERSION; }

STI_EXPORT void cpstandin_reset(void) {
  sti_lock();
  sti_reset_locked();
  sti_current = 0;
  sti_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;
  pthread_mutex_unlock(&sti.lock);
}

static int sti_any_retained(void) {
  for (int i = 0; i < STI_MAX_DEVICES; i++)
    if (sti.devices[i].retains != 0) return 1;
  return 0;
}

STI_EXPORT int cpstandin_set_devices(int count, size_t capacity) {
  sti_lock();
  int r = CUDA_SUCCESS;
  if (count < 1 || count > STI_MAX_DEVICES || capacity == 0)
    r = CUDA_ERROR_INVALID_VALUE;
  else if (sti_any_retained())
    r = CUDA_ERROR_ILLEGAL_STATE;
  else
    sti_configure(count, capacity);
  pthread_mutex_unlock(&sti.lock);
  return r;
}

STI_EXPORT int cpstandin_set_device_attr(int device, int attr, long long value) {
  sti_lock();
  int r = CUDA_SUCCESS;
  if (!sti_device_ok(device) || value < 0) {
    r = CUDA_ERROR_INVALID_VALUE;
  } else {
    sti_device_t *d = &sti.devices[device];
    switch (attr) {
      case CPSTANDIN_ATTR_CAPACITY: d->capacity = (size_t)value; break;
      case CPSTANDIN_ATTR_VMM: d->vmm = value != 0; break;
      case CPSTANDIN_ATTR_RDMA: d->rdma = value != 0; break;
      case CPSTANDIN_ATTR_POSIX_FD: d->posix_fd = value != 0; break;
      case CPSTANDIN_ATTR_GRANULARITY:
        if (value < 4096 || (value & (value - 1)) != 0)
          r = CUDA_ERROR_INVALID_VALUE;
        else
          d->granularity = (size_t)value;
        break;
      default: r = CUDA_ERROR_INVALID_VALUE;
    }
  }
  pthread_mutex_unlock(&sti.lock);
  return r;
}

STI_EXPORT int cpstandin_set_peer(int device, int peer, int can) {
  sti_lock();
  int r = CUDA_SUCCESS;
  if (!sti_device_ok(device) || !sti_device_ok(peer) || device == peer)
    r = CUDA_ERROR_INVALID_VALUE;
  else
    sti.peer[device][peer] = can != 0;
  pthread_mutex_unlock(&sti.lock);
  return r;
}

static int sti_inject(const char *name, unsigned n, int result, int after) {
  sti_lock();
  const int fn = sti_fn_find(name);
  int r = CUDA_SUCCESS;
  if (fn < 0 || n == 0 || result == CUDA_SUCCESS || sti.injection_count == STI_MAX_INJECTIONS) {
    r = CUDA_ERROR_INVALID_VALUE;
  } else {
    sti.injections[sti.injection_count++] = (sti_injection_t){(sti_fn_t)fn, n, result, after};
  }
  pthread_mutex_unlock(&sti.lock);
  return r;
}

STI_EXPORT int cpstandin_fail_nth(const char *name, unsigned n, int result) { return sti_inject(name, n, result, 0); }

STI_EXPORT int cpstandin_fail_nth_after(const char *name, unsigned n, int result) {
  return sti_inject(name, n, result, 1);
}

STI_EXPORT void cpstandin_set_sticky(int result) {
  sti_lock();
  sti.sticky = result;
  pthread_mutex_unlock(&sti.lock);
}

STI_EXPORT int cpstandin_sticky(void) {
  sti_lock();
  const int r = sti.sticky;
  pthread_mutex_unlock(&sti.lock);
  return r;
}

STI_EXPORT size_t cpstandin_faults(void) {
  sti_lock();
  const size_t n = sti.fault_count;
  pthread_mutex_unlock(&sti.lock);
  return n;
}

STI_EXPORT int cpstandin_fault_kind(size_t i) {
  sti_lock();
  const int kind = i < sti.fault_count && i < STI_MAX_FAULTS ? sti.faults[i].kind : 0;
  pthread_mutex_unlock(&sti.lock);
  return kind;
}

STI_EXPORT int cpstandin_fault_text(size_t i, char *buf, size_t n) {
  sti_lock();
  int r = CUDA_SUCCESS;
  if (buf == NULL || n == 0 || i >= sti.fault_count || i >= STI_MAX_FAULTS)
    r = CUDA_ERROR_INVALID_VALUE;
  else
    snprintf(buf, n, "%s", sti.faults[i].text);
  pthread_mutex_unlock(&sti.lock);
  return r;
}

STI_EXPORT unsigned long long cpstandin_calls(const char *name) {
  sti_lock();
  const int fn = sti_fn_find(name);
  const unsigned long long n = fn < 0 ? 0 : sti.calls[fn];
  pthread_mutex_unlock(&sti.lock);
  return n;
}

STI_EXPORT size_t cpstandin_used(int device) {
  sti_lock();
  sti_share_sweep();
  const size_t n = sti_device_ok(device) ? sti.devices[device].used : 0;
  pthread_mutex_unlock(&sti.lock);
  return n;
}

STI_EXPORT size_t cpstandin_live(int what) {
  sti_lock();
  size_t n = 0;
  switch (what) {
    case CPSTANDIN_LIVE_ALLOCATIONS:
      for (size_t i = 0; i < sti.allocs_count; i++) n += sti.allocs[i].live != 0;
      break;
    case CPSTANDIN_LIVE_RESERVATIONS:
      for (size_t i = 0; i < sti.reservations_count; i++) n += sti.reservations[i].live != 0;
      break;
    case CPSTANDIN_LIVE_HANDLES:
      for (size_t i = 0; i < sti.handles_count; i++) n += sti.handles[i].holds != 0;
      break;
    case CPSTANDIN_LIVE_HOST: n = sti.host_allocs; break;
    case CPSTANDIN_LIVE_MAPPINGS:
      for (size_t i = 0; i < sti.mappings_count; i++) n += sti.mappings[i].live != 0;
      break;
    case CPSTANDIN_LIVE_EVENTS:
      for (size_t i = 0; i < sti.events_count; i++) n += sti.events[i].live != 0;
      break;
    case CPSTANDIN_LIVE_STREAMS:
      for (size_t i = 0; i < sti.streams_count; i++)
        n += sti.streams[i].live != 0 && sti.streams[i].kind == STI_STREAM_USER;
      break;
    case CPSTANDIN_LIVE_CONTEXTS:
      for (int i = 0; i < STI_MAX_DEVICES; i++) n += sti.devices[i].retains != 0;
      break;
    default: break;
  }
  pthread_mutex_unlock(&sti.lock);
  return n;
}
