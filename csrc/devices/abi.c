/* abi.c — the C entry points torch's CUDAPluggableAllocator calls, except the allocation
 * (alloc.cpp, which throws). Owns: mapping each call onto the device table's pools, and
 * reporting the failures that a deleter cannot return. */
#include "devices/abi.h"

#include <float.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>

#include "core/snapshot.h"
#include "devices/devices.h"
#include "devices/graphs.h"

/* Note [Failures at exit]
 * The deleters torch calls cannot return an error, so a failed free or record_stream is
 * reported on stderr. Once the interpreter has begun to exit (cpd_set_exiting, from an atexit
 * handler) tensors are freed in no particular order and the CUDA driver may already have shut
 * down, so every event call fails: such failures are expected, change nothing in the pool
 * (a block whose event could not be recorded stays allocated, which the process's end makes
 * moot) and are counted instead of printed. */
static atomic_int cpd_exiting;
static atomic_ulong cpd_quiet_failures;

void cpd_set_exiting(void) { atomic_store_explicit(&cpd_exiting, 1, memory_order_relaxed); }

unsigned long cpd_failures_at_exit(void) { return atomic_load_explicit(&cpd_quiet_failures, memory_order_relaxed); }

void cpd_report(const char *fmt, ...) {
  if (atomic_load_explicit(&cpd_exiting, memory_order_relaxed)) {
    atomic_fetch_add_explicit(&cpd_quiet_failures, 1, memory_order_relaxed);
    return;
  }
  va_list ap;
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
}

static _Atomic(cpd_oom_thrower_t) cpd_thrower;

void cudapool_set_oom_thrower(cpd_oom_thrower_t thrower) {
  atomic_store_explicit(&cpd_thrower, thrower, memory_order_release);
}

cpd_oom_thrower_t cpd_oom_thrower(void) { return atomic_load_explicit(&cpd_thrower, memory_order_acquire); }

static _Atomic(cpd_context_fn_t) cpd_context_fn;
static _Atomic(cpd_context_fn_t) cpd_free_context_fn;

void cpd_set_context_fn(cpd_context_fn_t fn) { cpd_set_context_fns(fn, fn); }

void cpd_set_context_fns(cpd_context_fn_t alloc_fn, cpd_context_fn_t free_fn) {
  atomic_store_explicit(&cpd_context_fn, alloc_fn, memory_order_release);
  atomic_store_explicit(&cpd_free_context_fn, free_fn, memory_order_release);
}

int cpd_alloc(size_t size, int device, void *stream, void **out_ptr) {
  cp_pool_t *pool;
  if (size == 0) {
    *out_ptr = NULL;
    return CP_OK;
  }
  int rc;
  if (cpd_graph_window_open(device)) { /* Note [Graph pools] */
    int routed;
    rc = cpd_graph_alloc(size, device, stream, out_ptr, &routed);
    if (routed) return rc;
  }
  rc = cpd_pool(device, &pool);
  if (rc != CP_OK) return rc;
  const uint32_t tag = cp_region_of_thread(); /* Note [Regions] */
  cpd_context_fn_t context = atomic_load_explicit(&cpd_context_fn, memory_order_acquire);
  if (context == NULL) return cp_alloc_in(pool, size, (cp_stream_t)stream, tag, out_ptr);
  cp_history_set_context(context());
  rc = cp_alloc_in(pool, size, (cp_stream_t)stream, tag, out_ptr);
  cp_history_set_context(0);
  return rc;
}

int cpd_alloc_error_message(int status, size_t size, int device, char *buf, size_t buf_size) {
  if (status == CP_ERR_OOM) {
    /* The pool's report starts with "Tried to allocate ...". */
    return snprintf(buf, buf_size,
                    "CUDA out of memory. %s cudapool.last_oom() has these figures and the configuration change "
                    "that makes the latest allocations fit, found by replaying them.",
                    cp_last_error());
  }
  return snprintf(buf, buf_size, "cudapool: allocating %zu bytes on device %d failed (%s): %s", size, device,
                  cp_status_name(status), cp_last_error());
}

/* Note [Pointers cudapool does not own]
 * A tensor's memory may come from elsewhere: a DLPack import, another allocator. The
 * built-in allocator ignores record_stream on such memory, and so does cudapool: a
 * record_stream or a free of a pointer that no pool's segment holds (cp_pool_base_of says
 * CP_PTR_FOREIGN for every pool) does nothing, prints nothing, and is counted
 * (cpd_foreign_calls, _C.foreign_pointer_calls()). A pointer that a segment does hold is
 * cudapool's memory, and a call that does not match it is a bug of the caller's: it stays
 * loud (Note [Frees that do not match]). Once a pool has given a segment back (empty_cache,
 * shutdown), a stale pointer into it is foreign too. */
static atomic_ullong cpd_foreign_frees;
static atomic_ullong cpd_foreign_record_streams;

void cpd_foreign_calls(unsigned long long *out_frees, unsigned long long *out_record_streams) {
  *out_frees = atomic_load_explicit(&cpd_foreign_frees, memory_order_relaxed);
  *out_record_streams = atomic_load_explicit(&cpd_foreign_record_streams, memory_order_relaxed);
}

/* Where `ptr` lies among every pool, device and private (Note [Pointer owners] in devices.h):
 * cp_pool_base_of's answer from the pool whose segments hold it, CP_PTR_FOREIGN when none does. */
static int cpd_where(const void *ptr, void **out_base, size_t *out_size) {
  const int kind = cpd_owner_segment(ptr, NULL, out_base, out_size);
  if (kind != CP_PTR_FOREIGN || ptr == NULL || !cpd_graph_pools_exist()) return kind;
  return cpd_graph_base_of(ptr, out_base, out_size);
}

/* Note [Frees that do not match]
 * torch hands back exactly the size and device it allocated with (the stream too, which the
 * block already knows, so it is ignored). A free whose size or device differs from the
 * pool's record therefore comes from a caller that lost track of the pointer: most likely a
 * stale copy whose address a newer allocation now holds. Freeing would give memory still in
 * use to the next request, silently; refusing leaves one block allocated and says so on
 * stderr. The refusal is the one that cannot corrupt anything, so it is what happens: the
 * pool changes nothing (cp_free_sized), and a pointer that another device's pool holds is
 * named with that device. A pointer no pool holds is not cudapool's (Note [Pointers cudapool
 * does not own]). */
/* The free of both entry points: `size` NULL frees whatever size the block has (the bridge's
 * frees, which know the pointer only); else it must match (Note [Frees that do not match]). */
static void cpd_release(void *ptr, const size_t *size_or_null, int device) {
  if (ptr == NULL) return;
  const size_t size = size_or_null != NULL ? *size_or_null : 0; /* for the messages */
  cp_pool_t *pool = cpd_pool_if_created(device);
  int rc;
  if (cpd_graph_pools_exist() && (pool == NULL || !cp_pool_lookup(pool, ptr, NULL))) {
    int handled; /* a private pool's pointer (Note [Graph pools]) */
    rc = cpd_graph_free(ptr, size_or_null, device, &handled);
    if (handled) {
      if (rc != CP_OK)
        cpd_report("cudapool: free(%p, %zu bytes, device %d) failed: %s\n", ptr, size, device, cp_last_error());
      return;
    }
  }
  if (pool != NULL) {
    cpd_context_fn_t context = atomic_load_explicit(&cpd_free_context_fn, memory_order_acquire);
    if (context != NULL) cp_history_set_context(context());
    rc = size_or_null == NULL ? cp_free(pool, ptr) : cp_free_sized(pool, ptr, size);
    if (context != NULL) cp_history_set_context(0);
  } else if (device < 0 || device >= CP_MAX_DEVICES) {
    rc = cp_set_error(CP_ERR_INVALID, "invalid device %d (expected 0..%d)", device, CP_MAX_DEVICES - 1);
  } else {
    rc = cp_set_error(CP_ERR_INVALID, "device %d has no cudapool pool", device);
  }
  if (rc == CP_OK) return;
  /* A deleter cannot report failure to torch: say it loudly and leave the pool as it is. */
  const int owner = rc == CP_ERR_INVALID ? cpd_owner(ptr, NULL) : -1;
  if (owner >= 0 && owner != device) {
    cpd_report(
        "cudapool: free(%p, %zu bytes, device %d) failed: the pointer is a live allocation of device %d, "
        "not of device %d: not freed\n",
        ptr, size, device, owner, device);
  } else if (rc == CP_ERR_INVALID && cpd_where(ptr, NULL, NULL) == CP_PTR_FOREIGN) {
    atomic_fetch_add_explicit(&cpd_foreign_frees, 1, memory_order_relaxed);
  } else {
    cpd_report("cudapool: free(%p, %zu bytes, device %d) failed: %s\n", ptr, size, device, cp_last_error());
  }
}

void cudapool_free(void *ptr, size_t size, int device, void *stream) {
  (void)stream; /* the block remembers its allocation stream */
  cpd_release(ptr, &size, device);
}

void cpd_free(void *ptr, int device) {
  /* The bridge's deleters (Note [The bridge's data pointers]): with no private pool and no
   * history context to take, the device's pool frees it; anything else (a failure included,
   * which changes nothing) takes cudapool_free's way, which reports. */
  if (device >= 0 && !cpd_graph_pools_exist() &&
      atomic_load_explicit(&cpd_free_context_fn, memory_order_relaxed) == NULL) {
    cp_pool_t *pool = cpd_pool_if_created(device);
    if (pool != NULL && cp_free(pool, ptr) == CP_OK) return;
  }
  /* The device is a hint here: a pointer another device's pool holds is freed there. */
  const int owner = cpd_device_of(ptr);
  cpd_release(ptr, NULL, owner >= 0 ? owner : device < 0 ? 0 : device);
}

int cpd_device_of(const void *ptr) {
  int device = cpd_owner(ptr, NULL);
  if (device < 0 && ptr != NULL && cpd_graph_pools_exist()) (void)cpd_graph_device_of(ptr, &device);
  return device;
}

void cudapool_record_stream(void *ptr, void *stream) {
  if (ptr == NULL) return;
  cp_pool_t *pool;
  if (cpd_owner(ptr, &pool) >= 0 && cp_record_stream(pool, ptr, (cp_stream_t)stream) == CP_OK) return;
  if (cpd_graph_pools_exist()) {
    int handled;
    int rc = cpd_graph_record_stream(ptr, stream, &handled);
    if (handled) {
      if (rc != CP_OK) cpd_report("cudapool: record_stream(%p): %s\n", ptr, cp_last_error());
      return;
    }
  }
  if (cpd_where(ptr, NULL, NULL) == CP_PTR_FOREIGN) {
    atomic_fetch_add_explicit(&cpd_foreign_record_streams, 1, memory_order_relaxed);
    return;
  }
  cpd_report("cudapool: record_stream(%p): not a live allocation of cudapool (freed, or inside one)\n", ptr);
}

void *cudapool_base_alloc(void *ptr, size_t *size) {
  void *base;
  size_t bytes;
  if (cpd_where(ptr, &base, &bytes) == CP_PTR_LIVE) {
    if (size != NULL) *size = bytes;
    return base;
  }
  if (size != NULL) *size = 0;
  return ptr;
}

void cudapool_empty_cache(void) {
  for (int d = 0; d < CP_MAX_DEVICES; d++) {
    cp_pool_t *pool = cpd_pool_if_created(d);
    if (pool != NULL && cp_empty_cache(pool) != CP_OK) {
      cpd_report("cudapool: empty_cache on device %d: %s\n", d, cp_last_error());
    }
  }
  if (cpd_graph_pools_exist() && cpd_graph_collect() != CP_OK) {
    cpd_report("cudapool: empty_cache of a released graph pool: %s\n", cp_last_error());
  }
}

/* Note [Fraction zero]
 * torch caps a device at fraction × total memory for any fraction below 1, 0 included: after
 * set_per_process_memory_fraction(0.0) nothing more can be reserved, while cached memory
 * still serves. The pool reads a fraction of 0 as "no fraction" (as the memory_fraction
 * configuration key, which refuses 0, leaves it), so a 0 set here reaches the pool as the
 * smallest positive fraction: worth less than one byte, it caps the pool at one byte
 * (cp_pool_set_memory_fraction), and no segment fits. The device table remembers the 0 for
 * get_per_process_memory_fraction. */
int cpd_set_memory_fraction(double fraction, int device) {
  /* Checked before the pool is looked up: a refused call must not create the device's pool
   * (which would also fix the configuration for good). */
  int rc = cp_check_memory_fraction(fraction);
  if (rc != CP_OK) return rc;
  cp_pool_t *pool;
  rc = cpd_pool(device, &pool);
  if (rc == CP_OK) rc = cp_pool_set_memory_fraction(pool, fraction > 0 ? fraction : DBL_TRUE_MIN);
  if (rc == CP_OK) cpd_note_memory_fraction(device, fraction > 0 ? fraction : 0.0);
  return rc;
}

void cudapool_set_memory_fraction(double fraction, int device) {
  int rc = cpd_set_memory_fraction(fraction, device);
  if (rc != CP_OK) cpd_report("cudapool: set_memory_fraction(%g, %d): %s\n", fraction, device, cp_last_error());
}

void cudapool_init(int device_count) {
  (void)device_count; /* pools are created lazily, on each device's first allocation */
}
