/* cuda.c — the CUDA backend behind cuda.h: libcuda loaded with dlopen, the driver functions
 * resolved through cuGetProcAddress, a retained primary context per device, the operation table. */
#include "backend/cuda.h"

#include <dlfcn.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda_internal.h"
#include "base/fork.h"
#include "base/ptrmap.h"

/* The driver's types, the function table (CUDA_DRIVER_FUNCTIONS, CUDA_VMM_FUNCTIONS) and the
 * device slot are in cuda_internal.h, shared with cuda_vmm.c. */

typedef struct cuda_symbol_s {
  const char *name; /* base name given to cuGetProcAddress */
  size_t offset;    /* where its pointer lives in cuda_driver_t */
} cuda_symbol_t;

static const cuda_symbol_t cuda_symbols[] = {
#define CP_X(name, ret, params) {#name, offsetof(cuda_driver_t, name)},
    CUDA_DRIVER_FUNCTIONS(CP_X)
#undef CP_X
};

static const cuda_symbol_t cuda_vmm_symbols[] = {
#define CP_X(name, ret, params) {#name, offsetof(cuda_driver_t, name)},
    CUDA_VMM_FUNCTIONS(CP_X)
#undef CP_X
};

static const cuda_symbol_t cuda_optional_symbols[] = {
#define CP_X(name, ret, params) {#name, offsetof(cuda_driver_t, name)},
    CUDA_OPTIONAL_FUNCTIONS(CP_X)
#undef CP_X
};

/* The two entry points the loader may find with dlsym (CUDA 12.0+, and 11.3+). */
typedef CUresult (*cuda_get_proc_v2_fn)(const char *symbol, void **pfn, int cuda_version, cuuint64_t flags,
                                        CUdriverProcAddressQueryResult *status);
typedef CUresult (*cuda_get_proc_v1_fn)(const char *symbol, void **pfn, int cuda_version, cuuint64_t flags);

/* ------------------------------------------------------------------------------------------
 * Process-wide state
 * ---------------------------------------------------------------------------------------- */

/* Written only by cuda_load_once (pthread_once publishes it to every caller of cp_cuda_load):
 * cuda_load_status is CP_OK exactly when every required entry of cp_cuda_fn is non-NULL and
 * cuInit(0) succeeded; otherwise cuda_load_error holds the message every later call repeats.
 * cuda_loaded mirrors cuda_load_status == CP_OK for cp_cuda_shutdown, which must not load. */
static pthread_once_t cuda_load_once = PTHREAD_ONCE_INIT;
static int cuda_load_status = CP_ERR_BACKEND;
static char cuda_load_error[CUDA_MESSAGE_BYTES];
cuda_driver_t cp_cuda_fn;
char cp_cuda_vmm_missing[CUDA_MESSAGE_BYTES];
static atomic_int cuda_loaded;

static pthread_mutex_t cuda_devices_lock = PTHREAD_MUTEX_INITIALIZER;
static cuda_device_t cuda_devices[CP_MAX_DEVICES];

/* ------------------------------------------------------------------------------------------
 * Loading
 * ---------------------------------------------------------------------------------------- */

typedef struct cuda_get_proc_s {
  cuda_get_proc_v2_fn v2; /* preferred when the driver exports it */
  cuda_get_proc_v1_fn v1;
} cuda_get_proc_t;

/* Look up `name` for API `version`. A lookup that succeeds without a function (not on this
 * platform, or not at this version) leaves *out_fn NULL. */
static CUresult cuda_get_proc(const cuda_get_proc_t *gp, const char *name, int version, void **out_fn) {
  void *fn = NULL;
  CUresult r;
  if (gp->v2 != NULL) {
    CUdriverProcAddressQueryResult found = CU_GET_PROC_ADDRESS_SUCCESS;
    r = gp->v2(name, &fn, version, CU_GET_PROC_ADDRESS_DEFAULT, &found);
    if (found != CU_GET_PROC_ADDRESS_SUCCESS) fn = NULL;
  } else {
    r = gp->v1(name, &fn, version, CU_GET_PROC_ADDRESS_DEFAULT);
  }
  *out_fn = r == CUDA_SUCCESS ? fn : NULL;
  return r;
}

/* dlsym for a function: POSIX guarantees a function address survives the trip through void *;
 * the copy keeps ISO C's pedantic rule on pointer conversions intact. */
static int cuda_dlsym_fn(void *library, const char *name, void *out_fn, size_t fn_bytes) {
  void *sym = dlsym(library, name);
  if (sym == NULL || fn_bytes != sizeof sym) return -1;
  memcpy(out_fn, &sym, sizeof sym);
  return 0;
}

/* Resolve one driver function into cp_cuda_fn: 0, or -1 with the reason in `why`. */
static int cuda_resolve(const cuda_get_proc_t *gp, const cuda_symbol_t *sym, char *why, size_t why_bytes) {
  void *addr = NULL;
  CUresult r = cuda_get_proc(gp, sym->name, CUDA_API_VERSION, &addr);
  if (addr == NULL) r = cuda_get_proc(gp, sym->name, CUDA_API_VERSION_FALLBACK, &addr);
  if (addr == NULL) {
    if (r == CUDA_SUCCESS)
      snprintf(why, why_bytes, "not provided by this driver");
    else
      cp_cuda_why(r, why, why_bytes);
    return -1;
  }
  memcpy((char *)&cp_cuda_fn + sym->offset, &addr, sizeof addr);
  return 0;
}

/* Note [Which libcuda]
 * The driver is libcuda.so.1 (libcuda.so, the toolkit's development link, as a fallback). When
 * the environment variable CUDAPOOL_CUDA_DRIVER is set and not empty, the library it names (a
 * path, or a name for dlopen's search) is loaded instead, with no fallback: the C tests point it
 * at the stand-in for libcuda of csrc/standin/ (make test-c-standin), so that this backend's own
 * code runs without a GPU. It is read once, by the first cp_cuda_load. */

/* Everything cp_cuda_load promises; on failure the thread's last error says why. Runs once. */
static int cuda_load_driver(void) {
  const char *named = getenv("CUDAPOOL_CUDA_DRIVER"); /* Note [Which libcuda] */
  const int use_named = named != NULL && named[0] != '\0';
  void *library = dlopen(use_named ? named : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (library == NULL && use_named) {
    const char *reason = dlerror();
    return cp_set_error(CP_ERR_BACKEND, "cudapool: no CUDA driver: CUDAPOOL_CUDA_DRIVER=%s: %s", named,
                        reason != NULL ? reason : "dlopen failed");
  }
  if (library == NULL) {
    /* Keep the first reason: libcuda.so.1 is the driver's real name, the other a dev link. */
    char first[CUDA_MESSAGE_BYTES];
    const char *reason = dlerror();
    snprintf(first, sizeof first, "%s", reason != NULL ? reason : "libcuda.so.1: dlopen failed");
    library = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
    if (library == NULL) {
      (void)dlerror();
      return cp_set_error(CP_ERR_BACKEND, "cudapool: no CUDA driver: %s", first);
    }
  }
  /* The library stays loaded for the life of the process, even on failure below: the driver
   * does not support being unloaded, and nothing here is worth the risk. */

  cuda_get_proc_t gp = {NULL, NULL};
  if (cuda_dlsym_fn(library, "cuGetProcAddress_v2", &gp.v2, sizeof gp.v2) != 0 &&
      cuda_dlsym_fn(library, "cuGetProcAddress", &gp.v1, sizeof gp.v1) != 0) {
    return cp_set_error(CP_ERR_BACKEND,
                        "cudapool: no CUDA driver: libcuda has no "
                        "cuGetProcAddress (a driver for CUDA 11.3 or newer is needed)");
  }

  /* Straight into cp_cuda_fn: nothing reads it unless the whole load succeeds, and this way the
   * error naming functions (first in the list) name every later failure. */
  char why[CUDA_WHY_BYTES];
  for (size_t i = 0; i < sizeof cuda_symbols / sizeof cuda_symbols[0]; i++) {
    if (cuda_resolve(&gp, &cuda_symbols[i], why, sizeof why) != 0)
      return cp_set_error(CP_ERR_BACKEND, "cudapool: no CUDA driver: cuGetProcAddress(\"%s\") for CUDA %d or %d: %s",
                          cuda_symbols[i].name, CUDA_API_VERSION, CUDA_API_VERSION_FALLBACK, why);
  }
  /* The optional ones: the first that is missing is remembered, and the load goes on. */
  for (size_t i = 0; i < sizeof cuda_vmm_symbols / sizeof cuda_vmm_symbols[0]; i++) {
    if (cuda_resolve(&gp, &cuda_vmm_symbols[i], why, sizeof why) != 0 && cp_cuda_vmm_missing[0] == '\0')
      snprintf(cp_cuda_vmm_missing, sizeof cp_cuda_vmm_missing, "cuGetProcAddress(\"%s\") for CUDA %d or %d: %s",
               cuda_vmm_symbols[i].name, CUDA_API_VERSION, CUDA_API_VERSION_FALLBACK, why);
  }

  for (size_t i = 0; i < sizeof cuda_optional_symbols / sizeof cuda_optional_symbols[0]; i++) {
    (void)cuda_resolve(&gp, &cuda_optional_symbols[i], why, sizeof why); /* NULL when missing */
  }

  const CUresult r = cp_cuda_fn.cuInit(0);
  if (r != CUDA_SUCCESS) return cp_cuda_fail(CP_ERR_BACKEND, r, "cuInit");
  return CP_OK;
}

static void cuda_load_once_routine(void) {
  cuda_load_status = cuda_load_driver();
  if (cuda_load_status == CP_OK) {
    atomic_store_explicit(&cuda_loaded, 1, memory_order_release);
  } else {
    snprintf(cuda_load_error, sizeof cuda_load_error, "%s", cp_last_error());
  }
}

int cp_cuda_load(void) {
  if (pthread_once(&cuda_load_once, cuda_load_once_routine) != 0)
    return cp_set_error(CP_ERR_BACKEND, "cudapool: loading the CUDA driver: pthread_once failed");
  if (cuda_load_status != CP_OK) return cp_set_error(cuda_load_status, "%s", cuda_load_error);
  return CP_OK;
}

/* ------------------------------------------------------------------------------------------
 * Backend entries (the operation table)
 * ---------------------------------------------------------------------------------------- */

static int cuda_reserve(void *ctx, size_t size, uintptr_t *out_addr) {
  cuda_device_t *d = ctx;
  if (out_addr == NULL || size == 0)
    return cp_set_error(CP_ERR_INVALID, "cudapool: cuda reserve(%zu bytes): %s", size,
                        size == 0 ? "size must be > 0" : "out_addr is NULL");
  cuda_call_t c; /* never join a capture under way */
  int rc = cp_cuda_begin(d, "cuMemAlloc", &c);
  if (rc != CP_OK) return rc;
  CUdeviceptr ptr = 0;
  rc = cp_cuda_result(&c, cp_cuda_fn.cuMemAlloc(&ptr, size), CP_ERR_OOM, "cuMemAlloc(%zu bytes) on device %d", size,
                      d->ordinal);
  if (rc == CP_OK && ptr % CUDA_ALIGN_BYTES != 0) {
    (void)cp_cuda_fn.cuMemFree(ptr);
    rc = cp_set_error(CP_ERR_BACKEND,
                      "cudapool: cuMemAlloc(%zu bytes) on device %d returned "
                      "0x%llx, which is not %llu-byte aligned",
                      size, d->ordinal, ptr, (unsigned long long)CUDA_ALIGN_BYTES);
  }
  const int acquired = rc == CP_OK;
  rc = cp_cuda_leave(d, "cuMemAlloc", &c.scope, rc);
  if (acquired && rc != CP_OK) (void)cp_cuda_fn.cuMemFree(ptr); /* still in our context */
  if (rc == CP_OK) *out_addr = (uintptr_t)ptr;
  return rc;
}

static int cuda_release(void *ctx, uintptr_t addr, size_t size) {
  cuda_device_t *d = ctx;
  cuda_call_t c; /* never break a capture under way */
  int rc = cp_cuda_begin(d, "cuMemFree", &c);
  if (rc != CP_OK) return rc;
  rc = cp_cuda_result(&c, cp_cuda_fn.cuMemFree((CUdeviceptr)addr), CP_ERR_BACKEND,
                      "cuMemFree(0x%" PRIxPTR ", %zu bytes) on device %d", addr, size, d->ordinal);
  (void)cp_cuda_leave(d, "cuMemFree", &c.scope, CP_ERR_BACKEND); /* Note [Context scope] */
  return rc;
}

/* Note [Capture and contexts]
 * An event can be recorded only on a stream of the context it was created in
 * (cuEventRecord fails with CUDA_ERROR_INVALID_HANDLE otherwise), and Tensor.record_stream may
 * name a stream of another device or context. So an event is a small record of the CUevent
 * and the context it lives in; recording it on a stream of another context (cuStreamGetCtx)
 * replaces the CUevent by one created there, and query, synchronize and destroy run in the
 * event's own context. The default-stream handles (0, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD)
 * mean "of the current context", which is this device's during a free: a use declared on one
 * of them while another device's context is current is remembered as a token naming that
 * context (stream_resolve), and its events are recorded there.
 *
 * During a graph capture the pool makes no event call (Note [Capture in the pool]); a device
 * allocation then must not join the capture, so cuMemAlloc runs in the relaxed capture mode
 * (cuThreadExchangeStreamCaptureMode), as torch's allocator does, and so do cuMemFree and
 * every VMM call (cuda_vmm.c): made in the global mode while another thread captures, such a
 * call would fail and invalidate that capture (the driver API reference). cuStreamIsCapturing
 * on the legacy stream answers CUDA_ERROR_STREAM_CAPTURE_IMPLICIT while a blocking stream of
 * its context captures: using it would break that capture, so it counts as capturing. Each of
 * these driver functions is optional: without cuStreamIsCapturing no stream counts as
 * capturing (the capture windows torch opens still hold), without cuStreamGetCtx every stream
 * is taken for this device's. */
typedef struct cuda_event_s {
  CUevent event;
  CUcontext ctx; /* the context `event` was created in */
} cuda_event_t;

/* Note [Event handles]
 * A cp_event_t of this backend is a number, never reused, that cuda_events maps to its
 * cuda_event_t; only a handle found there reaches the driver. event_destroy takes the handle
 * out first and frees the record whatever cuEventDestroy answers (after a sticky error it
 * fails, and a caller could not do anything better with the handle than try again): the
 * handle is gone either way, and a second destroy, or any other use, is refused with
 * CP_ERR_INVALID without a driver call and without touching freed memory. A handle must not be
 * destroyed while another call is using it (the pool never does). */
static pthread_mutex_t cuda_events_lock = PTHREAD_MUTEX_INITIALIZER;
static cp_ptrmap_t cuda_events; /* handle -> cuda_event_t *, set up by the first event_create */
static int cuda_events_ready;
static uintptr_t cuda_events_last; /* the last handle handed out */

static cuda_event_t *cuda_event_find(cp_event_t event) {
  pthread_mutex_lock(&cuda_events_lock);
  cuda_event_t *ev = cuda_events_ready && event != 0 ? cp_ptrmap_get(&cuda_events, event) : NULL;
  pthread_mutex_unlock(&cuda_events_lock);
  return ev;
}

/* A new handle for `ev`: CP_OK, or CP_ERR_HOST_OOM. */
static int cuda_event_publish(cuda_event_t *ev, cp_event_t *out) {
  int rc = CP_OK;
  pthread_mutex_lock(&cuda_events_lock);
  if (!cuda_events_ready) {
    rc = cp_ptrmap_init(&cuda_events, 64);
    cuda_events_ready = rc == CP_OK;
  }
  if (rc == CP_OK) rc = cp_ptrmap_insert(&cuda_events, cuda_events_last + 1, ev);
  if (rc == CP_OK) *out = ++cuda_events_last;
  pthread_mutex_unlock(&cuda_events_lock);
  return rc;
}

/* Default streams of other contexts (Note [Capture and contexts]): a token is the address of
 * an entry, which no driver stream handle can equal; entries are never removed. */
#define CUDA_TOKENS 64
typedef struct cuda_token_s {
  CUcontext ctx;
  uintptr_t handle; /* 0, CU_STREAM_LEGACY or CU_STREAM_PER_THREAD */
} cuda_token_t;
static cuda_token_t cuda_tokens[CUDA_TOKENS];
static size_t cuda_token_count;
static pthread_mutex_t cuda_tokens_lock = PTHREAD_MUTEX_INITIALIZER;

static const cuda_token_t *cuda_token_of(cp_stream_t stream) {
  const uintptr_t lo = (uintptr_t)&cuda_tokens[0], hi = (uintptr_t)&cuda_tokens[CUDA_TOKENS];
  if (stream < lo || stream >= hi || (stream - lo) % sizeof(cuda_token_t) != 0) return NULL;
  return (const cuda_token_t *)stream;
}

/* Make `ctx` current for `call` (the previous context in `scope`); cp_cuda_leave undoes it. */
static int cuda_enter_ctx(CUcontext ctx, const char *call, cuda_scope_t *scope) {
  scope->prev_ctx = NULL;
  scope->switched = 0;
  CUcontext current = NULL;
  CUresult r = cp_cuda_fn.cuCtxGetCurrent(&current);
  if (r != CUDA_SUCCESS) return cp_cuda_fail(CP_ERR_BACKEND, r, "cuCtxGetCurrent (before %s)", call);
  if (current == ctx) return CP_OK;
  r = cp_cuda_fn.cuCtxSetCurrent(ctx);
  if (r != CUDA_SUCCESS) return cp_cuda_fail(CP_ERR_BACKEND, r, "cuCtxSetCurrent(the event's context) before %s", call);
  scope->prev_ctx = current;
  scope->switched = 1;
  return CP_OK;
}

/* A CUevent in `ctx` (made current for the call). */
static int cuda_event_new(cuda_device_t *d, CUcontext ctx, CUevent *out) {
  cuda_scope_t scope;
  int rc = cuda_enter_ctx(ctx, "cuEventCreate", &scope);
  if (rc != CP_OK) return rc;
  CUevent event = NULL;
  const CUresult r = cp_cuda_fn.cuEventCreate(&event, CU_EVENT_DISABLE_TIMING);
  if (r != CUDA_SUCCESS)
    rc = cp_cuda_fail(CP_ERR_BACKEND, r, "cuEventCreate(CU_EVENT_DISABLE_TIMING) for device %d", d->ordinal);
  const int acquired = rc == CP_OK;
  rc = cp_cuda_leave(d, "cuEventCreate", &scope, rc);
  if (acquired && rc != CP_OK) (void)cp_cuda_fn.cuEventDestroy(event);
  if (rc == CP_OK) *out = event;
  return rc;
}

static int cuda_event_free(cuda_device_t *d, CUevent event, CUcontext ctx) {
  cuda_scope_t scope;
  int rc = cuda_enter_ctx(ctx, "cuEventDestroy", &scope);
  if (rc != CP_OK) return rc;
  const CUresult r = cp_cuda_fn.cuEventDestroy(event);
  if (r != CUDA_SUCCESS) rc = cp_cuda_fail(CP_ERR_BACKEND, r, "cuEventDestroy for device %d", d->ordinal);
  (void)cp_cuda_leave(d, "cuEventDestroy", &scope, CP_ERR_BACKEND); /* Note [Context scope] */
  return rc;
}

static int cuda_event_create(void *ctx, cp_event_t *out_event) {
  cuda_device_t *d = ctx;
  if (out_event == NULL) return cp_set_error(CP_ERR_INVALID, "cudapool: cuda event_create: out_event is NULL");
  cuda_scope_t scope; /* checks that the device is live */
  int rc = cp_cuda_enter(d, "cuEventCreate", &scope);
  if (rc != CP_OK) return rc;
  rc = cp_cuda_leave(d, "cuEventCreate", &scope, rc);
  if (rc != CP_OK) return rc;
  cuda_event_t *ev = malloc(sizeof *ev);
  if (ev == NULL) return cp_set_error(CP_ERR_HOST_OOM, "cudapool: cuda event_create: no host memory");
  ev->ctx = d->ctx;
  rc = cuda_event_new(d, d->ctx, &ev->event);
  if (rc == CP_OK && cuda_event_publish(ev, out_event) != CP_OK) {
    (void)cuda_event_free(d, ev->event, ev->ctx);
    rc = cp_set_error(CP_ERR_HOST_OOM, "cudapool: cuda event_create: no host memory for the handle");
  }
  if (rc != CP_OK) free(ev);
  return rc;
}

/* Note [Event handles]: the handle is gone when this returns, whatever the driver said. */
static int cuda_event_destroy(void *ctx, cp_event_t event) {
  cuda_device_t *d = ctx;
  pthread_mutex_lock(&cuda_events_lock);
  cuda_event_t *ev = cuda_events_ready && event != 0 ? cp_ptrmap_remove(&cuda_events, event) : NULL;
  pthread_mutex_unlock(&cuda_events_lock);
  if (ev == NULL)
    return cp_set_error(CP_ERR_INVALID, "cudapool: cuda event_destroy: 0x%" PRIxPTR " is not a live event", event);
  int rc = cuda_event_free(d, ev->event, ev->ctx);
  free(ev);
  return rc;
}

/* The context and driver handle that `stream` is recorded on. */
static void cuda_stream_target(cuda_device_t *d, cp_stream_t stream, CUcontext *out_ctx, CUstream *out_handle) {
  *out_ctx = d->ctx;
  *out_handle = (CUstream)stream;
  const cuda_token_t *tok = cuda_token_of(stream);
  if (tok != NULL) {
    *out_ctx = tok->ctx;
    *out_handle = (CUstream)tok->handle;
  } else if (stream > CUDA_STREAM_HANDLE_SPECIAL_MAX && cp_cuda_fn.cuStreamGetCtx != NULL) {
    CUcontext owner = NULL;
    if (cp_cuda_fn.cuStreamGetCtx((CUstream)stream, &owner) == CUDA_SUCCESS && owner != NULL) *out_ctx = owner;
  }
}

static int cuda_event_record(void *ctx, cp_event_t event, cp_stream_t stream) {
  cuda_device_t *d = ctx;
  cuda_event_t *ev = cuda_event_find(event);
  if (ev == NULL)
    return cp_set_error(CP_ERR_INVALID, "cudapool: cuda event_record: 0x%" PRIxPTR " is not a live event", event);
  CUcontext target;
  CUstream handle;
  cuda_stream_target(d, stream, &target, &handle);
  if (target != ev->ctx) { /* a stream of another context: the event moves there */
    CUevent moved = NULL;
    int rc = cuda_event_new(d, target, &moved);
    if (rc != CP_OK) return rc;
    (void)cuda_event_free(d, ev->event, ev->ctx);
    ev->event = moved;
    ev->ctx = target;
  }
  cuda_scope_t scope;
  int rc = cuda_enter_ctx(target, "cuEventRecord", &scope);
  if (rc != CP_OK) return rc;
  const CUresult r = cp_cuda_fn.cuEventRecord(ev->event, handle);
  if (r != CUDA_SUCCESS)
    rc = cp_cuda_fail(CP_ERR_BACKEND, r, "cuEventRecord(stream 0x%" PRIxPTR ") for device %d", stream, d->ordinal);
  return cp_cuda_leave(d, "cuEventRecord", &scope, rc);
}

static int cuda_event_query(void *ctx, cp_event_t event, int *out_done) {
  cuda_device_t *d = ctx;
  cuda_event_t *ev = cuda_event_find(event);
  if (out_done == NULL || ev == NULL)
    return cp_set_error(CP_ERR_INVALID, "cudapool: cuda event_query: %s",
                        ev == NULL ? "not a live event" : "out_done is NULL");
  cuda_scope_t scope;
  int rc = cuda_enter_ctx(ev->ctx, "cuEventQuery", &scope);
  if (rc != CP_OK) return rc;
  int done = 0;
  const CUresult r = cp_cuda_fn.cuEventQuery(ev->event);
  if (r == CUDA_SUCCESS)
    done = 1;
  else if (r != CUDA_ERROR_NOT_READY)
    rc = cp_cuda_fail(CP_ERR_BACKEND, r, "cuEventQuery for device %d", d->ordinal);
  rc = cp_cuda_leave(d, "cuEventQuery", &scope, rc);
  if (rc == CP_OK) *out_done = done;
  return rc;
}

static int cuda_event_synchronize(void *ctx, cp_event_t event) {
  cuda_device_t *d = ctx;
  cuda_event_t *ev = cuda_event_find(event);
  if (ev == NULL)
    return cp_set_error(CP_ERR_INVALID, "cudapool: cuda event_synchronize: 0x%" PRIxPTR " is not a live event", event);
  cuda_scope_t scope;
  int rc = cuda_enter_ctx(ev->ctx, "cuEventSynchronize", &scope);
  if (rc != CP_OK) return rc;
  const CUresult r = cp_cuda_fn.cuEventSynchronize(ev->event);
  if (r != CUDA_SUCCESS) rc = cp_cuda_fail(CP_ERR_BACKEND, r, "cuEventSynchronize for device %d", d->ordinal);
  return cp_cuda_leave(d, "cuEventSynchronize", &scope, rc);
}

static int cuda_stream_capturing(void *ctx, cp_stream_t stream, int *out_capturing) {
  cuda_device_t *d = ctx;
  if (out_capturing == NULL) return cp_set_error(CP_ERR_INVALID, "cudapool: cuda stream_capturing: out is NULL");
  if (cp_cuda_fn.cuStreamIsCapturing == NULL || cuda_token_of(stream) != NULL) {
    *out_capturing = 0; /* Note [Capture and contexts] */
    return CP_OK;
  }
  cuda_scope_t scope;
  int rc = cp_cuda_enter(d, "cuStreamIsCapturing", &scope);
  if (rc != CP_OK) return rc;
  int status = CU_STREAM_CAPTURE_STATUS_NONE;
  const CUresult r = cp_cuda_fn.cuStreamIsCapturing((CUstream)stream, &status);
  if (r == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)
    status = CU_STREAM_CAPTURE_STATUS_ACTIVE; /* the legacy stream during a capture: Note [Capture and contexts] */
  else if (r != CUDA_SUCCESS)
    rc = cp_cuda_fail(CP_ERR_BACKEND, r, "cuStreamIsCapturing(0x%" PRIxPTR ") on device %d", stream, d->ordinal);
  rc = cp_cuda_leave(d, "cuStreamIsCapturing", &scope, rc);
  if (rc == CP_OK) *out_capturing = status != CU_STREAM_CAPTURE_STATUS_NONE; /* active or invalidated */
  return rc;
}

static int cuda_stream_resolve(void *ctx, cp_stream_t stream, cp_stream_t *out_stream) {
  cuda_device_t *d = ctx;
  *out_stream = stream;
  if (stream > CUDA_STREAM_HANDLE_SPECIAL_MAX) return CP_OK;
  CUcontext current = NULL;
  if (cp_cuda_fn.cuCtxGetCurrent(&current) != CUDA_SUCCESS || current == NULL || current == d->ctx) return CP_OK;
  int rc = CP_OK;
  pthread_mutex_lock(&cuda_tokens_lock);
  size_t i = 0;
  while (i < cuda_token_count && !(cuda_tokens[i].ctx == current && cuda_tokens[i].handle == stream)) i++;
  if (i == cuda_token_count) {
    if (i == CUDA_TOKENS) {
      rc = cp_set_error(CP_ERR_INVALID,
                        "cudapool: record_stream on the default stream of more than %d other contexts: not supported",
                        CUDA_TOKENS);
    } else {
      cuda_tokens[i].ctx = current;
      cuda_tokens[i].handle = stream;
      cuda_token_count++;
    }
  }
  pthread_mutex_unlock(&cuda_tokens_lock);
  if (rc == CP_OK) *out_stream = (cp_stream_t)&cuda_tokens[i];
  return rc;
}

static int cuda_mem_info(void *ctx, size_t *out_free, size_t *out_total) {
  cuda_device_t *d = ctx;
  if (out_free == NULL || out_total == NULL)
    return cp_set_error(CP_ERR_INVALID, "cudapool: cuda mem_info: out_free or out_total is NULL");
  cuda_scope_t scope;
  int rc = cp_cuda_enter(d, "cuMemGetInfo", &scope);
  if (rc != CP_OK) return rc;
  size_t free_bytes = 0, total_bytes = 0;
  const CUresult r = cp_cuda_fn.cuMemGetInfo(&free_bytes, &total_bytes);
  if (r != CUDA_SUCCESS) rc = cp_cuda_fail(CP_ERR_BACKEND, r, "cuMemGetInfo on device %d", d->ordinal);
  rc = cp_cuda_leave(d, "cuMemGetInfo", &scope, rc);
  if (rc == CP_OK) {
    *out_free = free_bytes;
    *out_total = total_bytes;
  }
  return rc;
}

/* ------------------------------------------------------------------------------------------
 * Lifetime
 * ---------------------------------------------------------------------------------------- */

/* The backend's own locks, taken under a pool's lock (event handles, default-stream tokens,
 * page handles), are held across fork() as backend locks (Note [Locks across fork]). */
static pthread_once_t cuda_fork_once = PTHREAD_ONCE_INIT;
static cp_fork_lock_t cuda_events_fork_node, cuda_tokens_fork_node;

static void cuda_register_for_fork(void) {
  cp_fork_register(&cuda_events_fork_node, &cuda_events_lock, CP_FORK_LEVEL_BACKEND);
  cp_fork_register(&cuda_tokens_fork_node, &cuda_tokens_lock, CP_FORK_LEVEL_BACKEND);
  cp_cuda_vmm_register_for_fork();
}

int cp_cuda_backend(int device, cp_backend_t *out) {
  if (out == NULL) return cp_set_error(CP_ERR_INVALID, "cp_cuda_backend: out is NULL");
  int rc = cp_cuda_load();
  if (rc == CP_OK) rc = cp_cuda_check_ordinal(device);
  if (rc != CP_OK) return rc;
  if (device >= CP_MAX_DEVICES)
    return cp_set_error(CP_ERR_INVALID,
                        "cudapool: CUDA device %d is beyond the %d devices "
                        "cudapool serves",
                        device, CP_MAX_DEVICES);

  int device_count = 0;
  if (cp_cuda_fn.cuDeviceGetCount(&device_count) != CUDA_SUCCESS) device_count = device + 1;
  cuda_device_t *d = &cuda_devices[device];
  cp_fork_register_outer(&cuda_devices_lock); /* after the device table's: it nests inside */
  (void)pthread_once(&cuda_fork_once, cuda_register_for_fork);
  pthread_mutex_lock(&cuda_devices_lock);
  if (!atomic_load_explicit(&d->live, memory_order_relaxed)) {
    CUdevice dev = 0;
    CUcontext primary = NULL;
    CUresult r = cp_cuda_fn.cuDeviceGet(&dev, device);
    if (r != CUDA_SUCCESS) {
      rc = cp_cuda_fail(CP_ERR_BACKEND, r, "cuDeviceGet(%d)", device);
    } else {
      r = cp_cuda_fn.cuDevicePrimaryCtxRetain(&primary, dev);
      if (r != CUDA_SUCCESS) rc = cp_cuda_fail(CP_ERR_BACKEND, r, "cuDevicePrimaryCtxRetain(device %d)", device);
    }
    if (rc == CP_OK) {
      d->ordinal = device;
      d->dev = dev;
      d->ctx = primary;
      cp_cuda_vmm_probe_device(d, device_count);
      atomic_store_explicit(&d->live, 1, memory_order_release);
    }
  }
  pthread_mutex_unlock(&cuda_devices_lock);
  if (rc != CP_OK) return rc;

  memset(out, 0, sizeof *out);
  out->name = "cuda";
  out->ctx = d;
  out->device = device;
  out->reserve = cuda_reserve;
  out->release = cuda_release;
  out->event_create = cuda_event_create;
  out->event_destroy = cuda_event_destroy;
  out->event_record = cuda_event_record;
  out->event_query = cuda_event_query;
  out->event_synchronize = cuda_event_synchronize;
  out->mem_info = cuda_mem_info;
  out->stream_capturing = cuda_stream_capturing;
  out->stream_resolve = cuda_stream_resolve;
  /* Page-mapped entries only where the driver has them all and the device supports them; a
   * failed query means none (cp_cuda_vmm_support reports it), never a failed table. */
  char why[CUDA_MESSAGE_BYTES];
  CUresult r = CUDA_SUCCESS;
  if (cp_cuda_vmm_probe(device, d->dev, why, sizeof why, &r) == 1) cp_cuda_vmm_table(out);
  cp_cuda_copy_table(out);
  cp_cuda_ipc_table(out);
  return CP_OK;
}

void cp_cuda_shutdown(void) {
  if (!atomic_load_explicit(&cuda_loaded, memory_order_acquire)) return; /* never loaded */
  pthread_mutex_lock(&cuda_devices_lock);
  /* At process exit the driver may have torn itself down already; then every call fails and
   * the retains are gone with it, so nothing is released. */
  CUcontext current = NULL;
  const int usable = cp_cuda_fn.cuCtxGetCurrent(&current) == CUDA_SUCCESS;
  for (int i = 0; i < CP_MAX_DEVICES; i++) {
    cuda_device_t *d = &cuda_devices[i];
    if (!atomic_load_explicit(&d->live, memory_order_relaxed)) continue;
    atomic_store_explicit(&d->live, 0, memory_order_release);
    if (usable) (void)cp_cuda_fn.cuDevicePrimaryCtxRelease(d->dev);
  }
  pthread_mutex_unlock(&cuda_devices_lock);
}
