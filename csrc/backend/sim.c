/* sim.c — the simulated device behind sim.h: capacity-bounded host memory, streams and events
 * that complete only when the test says so, per-call counters and fault injection. */
#include "backend/sim.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/sim_internal.h"

/* ------------------------------------------------------------------------------------------
 * Constants
 * ---------------------------------------------------------------------------------------- */

#define SIM_ALIGN_BYTES    ((size_t)512) /* alignment of real reservations */
#define SIM_FAKE_BASE_ADDR ((uintptr_t)0x7f0000000000ull)
#define SIM_FLAGS_KNOWN    (CP_SIM_AUTO_COMPLETE | CP_SIM_NO_TOUCH | CP_SIM_NO_VMM)

/* Fake NO_TOUCH addresses start high in a 64-bit address space. */
_Static_assert(sizeof(uintptr_t) >= 8, "sim.c assumes 64-bit addresses");

/* ------------------------------------------------------------------------------------------
 * Table values: the device keeps its reservations, streams and events in base/ptrmap.h maps,
 * whose values are non-NULL pointers. A reservation's value is its size (> 0, so never NULL);
 * streams and events own a small heap struct each, freed when the entry goes.
 * ---------------------------------------------------------------------------------------- */

typedef struct sim_event_s {
  cp_stream_t stream; /* stream of the last record (meaningless until recorded) */
  uint64_t seq;       /* the launches of that stream it waits for: those numbered <= seq */
  int recorded;       /* event_record was called on it */
} sim_event_t;

/* The device itself (struct cp_sim_s) and its streams are in sim_internal.h, shared with
 * sim_vmm.c and sim_work.c. */

static const char *const sim_call_names[CP_SIM_CALL_COUNT] = {
#define CP_X(id, name) name,
    CP_SIM_CALLS(CP_X)
#undef CP_X
};

/* ------------------------------------------------------------------------------------------
 * Locking, counting and fault injection
 * ---------------------------------------------------------------------------------------- */

static int sim_kind_valid(cp_sim_call_t kind) { return (int)kind >= 0 && kind < CP_SIM_CALL_COUNT; }

/* sim_internal.h */
int cp_sim_enter_locked(cp_sim_t *sim, cp_sim_call_t kind) {
  const uint64_t call_no = ++sim->calls[kind];
  sim_delay_t *d = &sim->delays[kind];
  if (d->countdown != 0 && --d->countdown == 0) {
    atomic_fetch_add_explicit(&sim->delays_entered, 1, memory_order_release);
    struct timespec ts = {(time_t)(d->ms / 1000u), (long)(d->ms % 1000u) * 1000000L};
    while (nanosleep(&ts, &ts) != 0) {}
  }
  if (sim->lost) {
    return cp_set_error(CP_ERR_BACKEND, "sim: %s: device lost (the driver has shut down)", sim_call_names[kind]);
  }
  sim_fault_t *f = &sim->faults[kind];
  if (f->countdown == 0) return CP_OK;
  if (--f->countdown != 0) return CP_OK;
  sim->faults_injected++;
  return cp_set_error(f->status, "sim: injected failure in %s (call #%" PRIu64 ")", sim_call_names[kind], call_no);
}

/* Reservation values are sizes; both conversions in one place. */
static void *sim_size_value(size_t size) { return (void *)(uintptr_t)size; /* size > 0: never NULL */ }

static size_t sim_value_size(const void *value) { return (size_t)(uintptr_t)value; }

static sim_stream_t *sim_stream_find(const cp_sim_t *sim, cp_stream_t stream) {
  return cp_ptrmap_get(&sim->streams, stream);
}

static sim_event_t *sim_event_find(const cp_sim_t *sim, cp_event_t event) { return cp_ptrmap_get(&sim->events, event); }

/* sim_internal.h. The stream map is unchanged when host memory is short. */
sim_stream_t *cp_sim_stream_get_locked(cp_sim_t *sim, cp_stream_t stream) {
  sim_stream_t *st = sim_stream_find(sim, stream);
  if (st != NULL) return st;
  st = calloc(1, sizeof *st);
  if (st == NULL) return NULL;
  if (cp_ptrmap_insert(&sim->streams, stream, st) != CP_OK) {
    free(st);
    return NULL;
  }
  return st;
}

/* sim_internal.h */
uint64_t cp_sim_submit_locked(cp_sim_t *sim, sim_stream_t *st) {
  const uint64_t seq = ++st->submitted_seq;
  if (sim->lag == 0) {
    st->completed_seq = seq;
  } else if (sim->lag != UINT64_MAX && seq > sim->lag && st->completed_seq < seq - sim->lag) {
    st->completed_seq = seq - sim->lag;
  }
  return seq;
}

/* An unknown event handle: a device fault when it was handed out once (used after its
 * destroy), CP_ERR_INVALID either way. */
static int sim_event_unknown_locked(cp_sim_t *sim, cp_sim_call_t kind, cp_event_t event) {
  if (event != 0 && event < sim->next_event_id) {
    cp_sim_fault_locked(sim, "event handle used after it was destroyed", sim_call_names[kind], event, 0, 0);
    return cp_set_error(CP_ERR_INVALID, "sim: %s(0x%" PRIxPTR "): the event was destroyed", sim_call_names[kind],
                        event);
  }
  return cp_set_error(CP_ERR_INVALID, "sim: %s(0x%" PRIxPTR "): unknown event", sim_call_names[kind], event);
}

/* Whether a known event has completed; a never-recorded one has (CUDA semantics). */
static int sim_event_done(const cp_sim_t *sim, const sim_event_t *ev) {
  if (!ev->recorded) return 1;
  const sim_stream_t *st = sim_stream_find(sim, ev->stream);
  return st != NULL && st->completed_seq >= ev->seq;
}

/* Refuse a call the driver refuses while a stream is captured (Note [Simulated capture]). */
int cp_sim_refuse_if_capturing_locked(cp_sim_t *sim, cp_sim_call_t kind) {
  if (sim->capturing_streams == 0) return CP_OK;
  sim->capture_violations++;
  cp_sim_fault_locked(sim, "call the driver refuses while a stream captures (the capture is invalidated)",
                      sim_call_names[kind], 0, 0, 0);
  return cp_set_error(CP_ERR_BACKEND, "sim: %s: operation not permitted when stream is capturing",
                      sim_call_names[kind]);
}

/* ------------------------------------------------------------------------------------------
 * Backend entries (the operation table)
 * ---------------------------------------------------------------------------------------- */

static int sim_reserve(void *ctx, size_t size, uintptr_t *out_addr) {
  cp_sim_t *sim = ctx;
  if (sim == NULL) return cp_set_error(CP_ERR_INVALID, "sim: reserve: no device");
  sim_lock(sim);
  sim->bytes[CP_SIM_RESERVE] += size;
  int rc = cp_sim_enter_locked(sim, CP_SIM_RESERVE);
  if (rc != CP_OK) goto out;
  if (out_addr == NULL || size == 0) {
    rc = cp_set_error(CP_ERR_INVALID, "sim: reserve(%zu bytes): %s", size,
                      size == 0 ? "size must be > 0" : "out_addr is NULL");
    goto out;
  }
  if (size > sim->capacity_bytes - sim->used_bytes) {
    rc = cp_set_error(CP_ERR_OOM, "sim: reserve(%zu bytes): out of memory (%zu of %zu bytes used)", size,
                      sim->used_bytes, sim->capacity_bytes);
    goto out;
  }
  /* Room first, so that the inserts below cannot fail once memory is taken. */
  if (cp_ptrmap_reserve(&sim->reservations, 1) != CP_OK || cp_sim_index_room_locked(sim) != CP_OK) {
    rc = cp_set_error(CP_ERR_BACKEND,
                      "sim: reserve(%zu bytes): host memory for the "
                      "reservation table is short",
                      size);
    goto out;
  }

  uintptr_t addr;
  if (sim->flags & CP_SIM_NO_TOUCH) {
    /* Fake address: the next 2 MiB boundary; the span of `size` bytes is skipped for good. */
    const uintptr_t room = UINTPTR_MAX - sim->next_fake_addr;
    if ((uintptr_t)size > room - (room % SIM_FAKE_ALIGN_BYTES)) {
      rc = cp_set_error(CP_ERR_OOM, "sim: reserve(%zu bytes): fake address space exhausted", size);
      goto out;
    }
    const uintptr_t span = ((uintptr_t)size + SIM_FAKE_ALIGN_BYTES - 1) & ~(SIM_FAKE_ALIGN_BYTES - 1);
    addr = sim->next_fake_addr;
    sim->next_fake_addr += span;
  } else {
    /* Real host memory of exactly `size` bytes (posix_memalign needs no rounding), so that
     * AddressSanitizer flags even a one-byte overrun past the reservation. */
    void *p = NULL;
    if (posix_memalign(&p, SIM_ALIGN_BYTES, size) != 0 || p == NULL) {
      rc = cp_set_error(CP_ERR_OOM,
                        "sim: reserve(%zu bytes): host memory is short "
                        "(%zu of %zu bytes used)",
                        size, sim->used_bytes, sim->capacity_bytes);
      goto out;
    }
    addr = (uintptr_t)p;
  }

  (void)cp_ptrmap_insert(&sim->reservations, addr, sim_size_value(size)); /* room made above */
  cp_sim_index_add_locked(sim, addr, size);
  sim->used_bytes += size;
  *out_addr = addr;
out:
  sim_unlock(sim);
  return rc;
}

static int sim_release(void *ctx, uintptr_t addr, size_t size) {
  cp_sim_t *sim = ctx;
  if (sim == NULL) return cp_set_error(CP_ERR_INVALID, "sim: release: no device");
  sim_lock(sim);
  sim->bytes[CP_SIM_RELEASE] += size;
  int rc = cp_sim_enter_locked(sim, CP_SIM_RELEASE);
  if (rc == CP_OK) rc = cp_sim_refuse_if_capturing_locked(sim, CP_SIM_RELEASE);
  if (rc != CP_OK) goto out;
  const void *value = cp_ptrmap_get(&sim->reservations, addr);
  if (value == NULL) {
    rc = cp_set_error(CP_ERR_INVALID, "sim: release(0x%" PRIxPTR ", %zu bytes): unknown address", addr, size);
    goto out;
  }
  if (sim_value_size(value) != size) {
    rc = cp_set_error(CP_ERR_INVALID,
                      "sim: release(0x%" PRIxPTR
                      ", %zu bytes): address was "
                      "reserved with %zu bytes",
                      addr, size, sim_value_size(value));
    goto out;
  }
  /* cudaFree waits for the device: every stream's queued work completes first. */
  cp_sim_drain_locked(sim);
  if (!(sim->flags & CP_SIM_NO_TOUCH)) free((void *)addr);
  sim->used_bytes -= size;
  cp_ptrmap_remove(&sim->reservations, addr);
  cp_sim_index_remove_locked(sim, addr);
out:
  sim_unlock(sim);
  return rc;
}

static int sim_event_create(void *ctx, cp_event_t *out_event) {
  cp_sim_t *sim = ctx;
  if (sim == NULL) return cp_set_error(CP_ERR_INVALID, "sim: event_create: no device");
  sim_lock(sim);
  int rc = cp_sim_enter_locked(sim, CP_SIM_EVENT_CREATE);
  if (rc != CP_OK) goto out;
  if (out_event == NULL) {
    rc = cp_set_error(CP_ERR_INVALID, "sim: event_create: out_event is NULL");
    goto out;
  }
  sim_event_t *ev = calloc(1, sizeof *ev); /* seq 0: never recorded */
  if (ev == NULL || cp_ptrmap_insert(&sim->events, sim->next_event_id, ev) != CP_OK) {
    free(ev);
    rc = cp_set_error(CP_ERR_BACKEND, "sim: event_create: host memory for the event table is short");
    goto out;
  }
  *out_event = sim->next_event_id++;
out:
  sim_unlock(sim);
  return rc;
}

static int sim_event_destroy(void *ctx, cp_event_t event) {
  cp_sim_t *sim = ctx;
  if (sim == NULL) return cp_set_error(CP_ERR_INVALID, "sim: event_destroy: no device");
  sim_lock(sim);
  int rc = cp_sim_enter_locked(sim, CP_SIM_EVENT_DESTROY);
  if (rc != CP_OK && sim->lost) goto out;
  /* A failed destroy still ends the handle (Note [Simulated asynchrony]): the driver may have
   * freed the event before it failed, so the caller must never use it again. */
  sim_event_t *ev = cp_ptrmap_remove(&sim->events, event);
  if (ev == NULL) {
    const int unknown = sim_event_unknown_locked(sim, CP_SIM_EVENT_DESTROY, event);
    if (rc == CP_OK) rc = unknown;
    goto out;
  }
  free(ev);
out:
  sim_unlock(sim);
  return rc;
}

static int sim_event_record(void *ctx, cp_event_t event, cp_stream_t stream) {
  cp_sim_t *sim = ctx;
  if (sim == NULL) return cp_set_error(CP_ERR_INVALID, "sim: event_record: no device");
  sim_lock(sim);
  int rc = cp_sim_enter_locked(sim, CP_SIM_EVENT_RECORD);
  if (rc == CP_OK) rc = cp_sim_refuse_if_capturing_locked(sim, CP_SIM_EVENT_RECORD);
  if (rc != CP_OK) goto out;
  sim_event_t *ev = sim_event_find(sim, event);
  if (ev == NULL) {
    rc = sim_event_unknown_locked(sim, CP_SIM_EVENT_RECORD, event);
    goto out;
  }
  /* `ev` is a heap struct of its own, so it stays valid if the stream map grows. */
  sim_stream_t *st = cp_sim_stream_get_locked(sim, stream);
  if (st == NULL) {
    rc = cp_set_error(CP_ERR_BACKEND,
                      "sim: event_record(0x%" PRIxPTR ", stream 0x%" PRIxPTR
                      "): host memory for the stream table is short",
                      event, stream);
    goto out;
  }
  if (st->invalid) {
    rc = cp_set_error(CP_ERR_BACKEND,
                      "sim: event_record(0x%" PRIxPTR ", stream 0x%" PRIxPTR
                      "): invalid resource handle (the stream is invalid)",
                      event, stream);
    goto out;
  }
  ev->stream = stream;
  /* An event completes when the work queued before it has: a marker after the stream's last
   * launch, done at once on an idle stream. */
  ev->seq = st->submitted_seq;
  ev->recorded = 1;
out:
  sim_unlock(sim);
  return rc;
}

static int sim_event_query(void *ctx, cp_event_t event, int *out_done) {
  cp_sim_t *sim = ctx;
  if (sim == NULL) return cp_set_error(CP_ERR_INVALID, "sim: event_query: no device");
  sim_lock(sim);
  int rc = cp_sim_enter_locked(sim, CP_SIM_EVENT_QUERY);
  if (rc == CP_OK) rc = cp_sim_refuse_if_capturing_locked(sim, CP_SIM_EVENT_QUERY);
  if (rc != CP_OK) goto out;
  if (out_done == NULL) {
    rc = cp_set_error(CP_ERR_INVALID, "sim: event_query(0x%" PRIxPTR "): out_done is NULL", event);
    goto out;
  }
  const sim_event_t *ev = sim_event_find(sim, event);
  if (ev == NULL) {
    rc = sim_event_unknown_locked(sim, CP_SIM_EVENT_QUERY, event);
    goto out;
  }
  *out_done = sim_event_done(sim, ev);
out:
  sim_unlock(sim);
  return rc;
}

static int sim_event_synchronize(void *ctx, cp_event_t event) {
  cp_sim_t *sim = ctx;
  if (sim == NULL) return cp_set_error(CP_ERR_INVALID, "sim: event_synchronize: no device");
  sim_lock(sim);
  int rc = cp_sim_enter_locked(sim, CP_SIM_EVENT_SYNCHRONIZE);
  if (rc == CP_OK) rc = cp_sim_refuse_if_capturing_locked(sim, CP_SIM_EVENT_SYNCHRONIZE);
  if (rc != CP_OK) goto out;
  const sim_event_t *ev = sim_event_find(sim, event);
  if (ev == NULL) {
    rc = sim_event_unknown_locked(sim, CP_SIM_EVENT_SYNCHRONIZE, event);
    goto out;
  }
  /* The device "runs" the stream up to the event; later work on it stays pending. */
  if (ev->recorded) {
    sim_stream_t *st = sim_stream_find(sim, ev->stream);
    if (st != NULL && st->completed_seq < ev->seq) st->completed_seq = ev->seq;
  }
out:
  sim_unlock(sim);
  return rc;
}

static int sim_stream_capturing(void *ctx, cp_stream_t stream, int *out_capturing) {
  cp_sim_t *sim = ctx;
  if (sim == NULL) return cp_set_error(CP_ERR_INVALID, "sim: stream_capturing: no device");
  sim_lock(sim);
  int rc = cp_sim_enter_locked(sim, CP_SIM_STREAM_CAPTURING);
  if (rc == CP_OK && out_capturing == NULL) {
    rc = cp_set_error(CP_ERR_INVALID, "sim: stream_capturing(0x%" PRIxPTR "): out_capturing is NULL", stream);
  }
  if (rc == CP_OK) {
    const sim_stream_t *st = sim_stream_find(sim, stream);
    *out_capturing = st != NULL && st->capturing;
  }
  sim_unlock(sim);
  return rc;
}

static int sim_mem_info(void *ctx, size_t *out_free, size_t *out_total) {
  cp_sim_t *sim = ctx;
  if (sim == NULL) return cp_set_error(CP_ERR_INVALID, "sim: mem_info: no device");
  sim_lock(sim);
  int rc = cp_sim_enter_locked(sim, CP_SIM_MEM_INFO);
  if (rc != CP_OK) goto out;
  if (out_free == NULL || out_total == NULL) {
    rc = cp_set_error(CP_ERR_INVALID, "sim: mem_info: out_free or out_total is NULL");
    goto out;
  }
  *out_free = sim->capacity_bytes - sim->used_bytes;
  *out_total = sim->capacity_bytes;
out:
  sim_unlock(sim);
  return rc;
}

/* ------------------------------------------------------------------------------------------
 * Lifetime
 * ---------------------------------------------------------------------------------------- */

int cp_sim_create(size_t capacity, unsigned flags, cp_sim_t **out_sim) {
  if (out_sim == NULL) return cp_set_error(CP_ERR_INVALID, "cp_sim_create: out_sim is NULL");
  if (flags & ~(unsigned)SIM_FLAGS_KNOWN)
    return cp_set_error(CP_ERR_INVALID, "cp_sim_create: unknown flags 0x%x", flags & ~(unsigned)SIM_FLAGS_KNOWN);
  cp_sim_t *sim = calloc(1, sizeof *sim);
  if (sim == NULL) goto no_host_memory;
  if (cp_ptrmap_init(&sim->reservations, SIM_MAP_MIN_SLOTS) != CP_OK ||
      cp_ptrmap_init(&sim->streams, SIM_MAP_MIN_SLOTS) != CP_OK ||
      cp_ptrmap_init(&sim->events, SIM_MAP_MIN_SLOTS) != CP_OK || cp_sim_vmm_init(sim) != CP_OK)
    goto no_host_memory;
  sim->flags = flags;
  if (cp_sim_work_init(sim) != CP_OK) goto no_host_memory;
  if (pthread_mutex_init(&sim->lock, NULL) != 0) {
    cp_sim_work_destroy(sim);
    cp_sim_vmm_destroy(sim);
    cp_ptrmap_destroy(&sim->reservations);
    cp_ptrmap_destroy(&sim->streams);
    cp_ptrmap_destroy(&sim->events);
    free(sim);
    return cp_set_error(CP_ERR_HOST_OOM, "cp_sim_create: pthread_mutex_init failed");
  }
  cp_fork_register(&sim->fork_node, &sim->lock, CP_FORK_LEVEL_BACKEND);
  sim->capacity_bytes = capacity;
  sim->next_fake_addr = SIM_FAKE_BASE_ADDR;
  sim->next_event_id = 1;
  *out_sim = sim;
  return CP_OK;

no_host_memory:
  if (sim != NULL) {
    cp_sim_work_destroy(sim); /* fine on maps never set up (all empty) */
    cp_sim_vmm_destroy(sim);
    cp_ptrmap_destroy(&sim->reservations); /* free(NULL) is fine for maps never set up */
    cp_ptrmap_destroy(&sim->streams);
    cp_ptrmap_destroy(&sim->events);
    free(sim);
  }
  return cp_set_error(CP_ERR_HOST_OOM, "cp_sim_create: host memory is short");
}

/* cp_ptrmap_each callbacks of cp_sim_destroy: the host memory behind a reservation (its key),
 * and the struct a stream or event owns (its value). */
static void sim_free_key(uintptr_t key, void *value, void *arg) {
  (void)value;
  (void)arg;
  free((void *)key);
}

static void sim_free_value(uintptr_t key, void *value, void *arg) {
  (void)key;
  (void)arg;
  free(value);
}

void cp_sim_destroy(cp_sim_t *sim) {
  if (sim == NULL) return;
  cp_fork_unregister(&sim->fork_node);
  cp_sim_work_destroy(sim);
  cp_sim_vmm_destroy(sim);
  if (!(sim->flags & CP_SIM_NO_TOUCH)) cp_ptrmap_each(&sim->reservations, sim_free_key, NULL);
  cp_ptrmap_each(&sim->streams, sim_free_value, NULL);
  cp_ptrmap_each(&sim->events, sim_free_value, NULL);
  cp_ptrmap_destroy(&sim->reservations);
  cp_ptrmap_destroy(&sim->streams);
  cp_ptrmap_destroy(&sim->events);
  pthread_mutex_destroy(&sim->lock);
  free(sim);
}

void cp_sim_backend(cp_sim_t *sim, cp_backend_t *out) {
  if (out == NULL) return;
  memset(out, 0, sizeof *out);
  out->name = "sim";
  out->ctx = sim;
  out->device = 0;
  out->reserve = sim_reserve;
  out->release = sim_release;
  out->event_create = sim_event_create;
  out->event_destroy = sim_event_destroy;
  out->event_record = sim_event_record;
  out->event_query = sim_event_query;
  out->event_synchronize = sim_event_synchronize;
  out->mem_info = sim_mem_info;
  out->stream_capturing = sim_stream_capturing;
  if (sim != NULL && !(sim->flags & CP_SIM_NO_VMM)) cp_sim_vmm_table(sim, out);
  cp_sim_copy_table(sim, out);
}

/* ------------------------------------------------------------------------------------------
 * Test controls
 * ---------------------------------------------------------------------------------------- */

void cp_sim_complete(cp_sim_t *sim, cp_stream_t stream) {
  if (sim == NULL) return;
  sim_lock(sim);
  sim_stream_t *st = sim_stream_find(sim, stream);
  if (st != NULL) st->completed_seq = st->submitted_seq; /* its launches are dropped as they are scanned */
  sim_unlock(sim); /* an unknown stream has nothing recorded, so nothing to complete */
}

int cp_sim_stream_idle(cp_sim_t *sim, cp_stream_t stream) {
  if (sim == NULL) return 1;
  sim_lock(sim);
  const sim_stream_t *st = sim_stream_find(sim, stream);
  int idle = st == NULL || st->completed_seq >= st->submitted_seq;
  sim_unlock(sim);
  return idle;
}

void cp_sim_complete_all(cp_sim_t *sim) {
  if (sim == NULL) return;
  sim_lock(sim);
  cp_sim_drain_locked(sim);
  sim_unlock(sim);
}

void cp_sim_set_auto_complete(cp_sim_t *sim, int on) {
  cp_sim_set_lag(sim, on ? 0 : UINT64_MAX); /* affects later submissions only */
}

void cp_sim_fail_nth(cp_sim_t *sim, cp_sim_call_t kind, uint64_t n, int status) {
  if (sim == NULL || !sim_kind_valid(kind)) return;
  sim_lock(sim);
  sim->faults[kind].countdown = n;
  sim->faults[kind].status = status == CP_ERR_OOM ? CP_ERR_OOM : CP_ERR_BACKEND;
  sim_unlock(sim);
}

void cp_sim_delay_nth(cp_sim_t *sim, cp_sim_call_t kind, uint64_t n, unsigned ms) {
  if (sim == NULL || !sim_kind_valid(kind)) return;
  sim_lock(sim);
  sim->delays[kind].countdown = n;
  sim->delays[kind].ms = ms;
  sim_unlock(sim);
}

uint64_t cp_sim_delays_entered(const cp_sim_t *sim) {
  if (sim == NULL) return 0;
  return atomic_load_explicit(&sim->delays_entered, memory_order_acquire);
}

void cp_sim_set_lost(cp_sim_t *sim, int lost) {
  if (sim == NULL) return;
  sim_lock(sim);
  sim->lost = lost != 0;
  sim_unlock(sim);
}

int cp_sim_invalidate_stream(cp_sim_t *sim, cp_stream_t stream) {
  if (sim == NULL) return cp_set_error(CP_ERR_INVALID, "cp_sim_invalidate_stream: no device");
  sim_lock(sim);
  sim_stream_t *st = cp_sim_stream_get_locked(sim, stream);
  if (st != NULL) st->invalid = 1;
  sim_unlock(sim);
  if (st == NULL) {
    return cp_set_error(CP_ERR_HOST_OOM,
                        "cp_sim_invalidate_stream(0x%" PRIxPTR
                        "): host memory for the "
                        "stream table is short",
                        stream);
  }
  return CP_OK;
}

int cp_sim_set_capturing(cp_sim_t *sim, cp_stream_t stream, int on) {
  if (sim == NULL) return cp_set_error(CP_ERR_INVALID, "cp_sim_set_capturing: no device");
  sim_lock(sim);
  sim_stream_t *st = cp_sim_stream_get_locked(sim, stream);
  if (st != NULL && st->capturing != (on != 0)) {
    st->capturing = on != 0;
    if (on)
      sim->capturing_streams++;
    else
      sim->capturing_streams--;
  }
  sim_unlock(sim);
  if (st == NULL) {
    return cp_set_error(CP_ERR_HOST_OOM,
                        "cp_sim_set_capturing(0x%" PRIxPTR "): host memory for the stream table is short", stream);
  }
  return CP_OK;
}

uint64_t cp_sim_capture_violations(const cp_sim_t *sim) {
  if (sim == NULL) return 0;
  sim_lock(sim);
  const uint64_t n = sim->capture_violations;
  sim_unlock(sim);
  return n;
}

uint64_t cp_sim_calls(const cp_sim_t *sim, cp_sim_call_t kind) {
  if (sim == NULL || !sim_kind_valid(kind)) return 0;
  sim_lock(sim);
  const uint64_t n = sim->calls[kind];
  sim_unlock(sim);
  return n;
}

uint64_t cp_sim_call_bytes(const cp_sim_t *sim, cp_sim_call_t kind) {
  if (sim == NULL || !sim_kind_valid(kind)) return 0;
  sim_lock(sim);
  const uint64_t n = sim->bytes[kind];
  sim_unlock(sim);
  return n;
}

uint64_t cp_sim_faults_injected(const cp_sim_t *sim) {
  if (sim == NULL) return 0;
  sim_lock(sim);
  const uint64_t n = sim->faults_injected;
  sim_unlock(sim);
  return n;
}

void cp_sim_reset_counters(cp_sim_t *sim) {
  if (sim == NULL) return;
  sim_lock(sim);
  memset(sim->calls, 0, sizeof sim->calls);
  memset(sim->bytes, 0, sizeof sim->bytes);
  sim->faults_injected = 0;
  sim_unlock(sim); /* armed faults keep counting down */
}

const char *cp_sim_call_name(cp_sim_call_t kind) { return sim_kind_valid(kind) ? sim_call_names[kind] : "unknown"; }

/* ------------------------------------------------------------------------------------------
 * What is live
 * ---------------------------------------------------------------------------------------- */

size_t cp_sim_reserved_bytes(const cp_sim_t *sim) {
  if (sim == NULL) return 0;
  sim_lock(sim);
  const size_t n = sim->used_bytes;
  sim_unlock(sim);
  return n;
}

size_t cp_sim_live_reservations(const cp_sim_t *sim) {
  if (sim == NULL) return 0;
  sim_lock(sim);
  const size_t n = sim->reservations.count;
  sim_unlock(sim);
  return n;
}

size_t cp_sim_live_events(const cp_sim_t *sim) {
  if (sim == NULL) return 0;
  sim_lock(sim);
  const size_t n = sim->events.count;
  sim_unlock(sim);
  return n;
}

size_t cp_sim_capacity(const cp_sim_t *sim) { return sim == NULL ? 0 : sim->capacity_bytes; /* fixed at create */ }
