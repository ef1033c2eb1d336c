/* sim.c — the simulated device behind sim.h: capacity-bounded host memory, streams and events
 * that complete only when the test says so, per-call counters and fault injection. */
#include "backend/sim.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/fork.h"

/* ------------------------------------------------------------------------------------------
 * Constants
 * ---------------------------------------------------------------------------------------- */

#define SIM_ALIGN_BYTES        ((size_t)512)           /* alignment of real reservations */
#define SIM_FAKE_BASE_ADDR     ((uintptr_t)0x7f0000000000ull)
#define SIM_FAKE_ALIGN_BYTES   ((uintptr_t)2 << 20)     /* 2 MiB between fake reservations */
#define SIM_TABLE_MIN_SLOTS    ((size_t)64)            /* initial slots of every table */
#define SIM_FLAGS_KNOWN        (CP_SIM_AUTO_COMPLETE | CP_SIM_NO_TOUCH)

/* Fake NO_TOUCH addresses start high in a 64-bit address space. */
_Static_assert(sizeof(uintptr_t) >= 8, "sim.c assumes 64-bit addresses");

/* ------------------------------------------------------------------------------------------
 * Hash table: open addressing, linear probing, backward-shift deletion (no tombstones, so
 * heavy reserve/release churn never degrades probing). One table type serves reservations,
 * streams and events; what the value means depends on the table.
 * ---------------------------------------------------------------------------------------- */

typedef union sim_value_u {
  struct {
    size_t size_bytes;       /* size asked for at reserve (not rounded) */
  } res;
  struct {
    uint64_t recorded_seq;   /* sequence number of the last event_record on this stream */
    uint64_t completed_seq;  /* every record with seq <= this has completed */
    int invalid;             /* cp_sim_invalidate_stream: records on it fail */
  } stream;
  struct {
    cp_stream_t stream;      /* stream of the last record (meaningless while seq == 0) */
    uint64_t seq;            /* position on that stream; 0 = never recorded */
  } event;
} sim_value_t;

typedef struct sim_slot_s {
  uintptr_t key;             /* address, stream handle or event handle */
  sim_value_t value;
  unsigned char used;        /* 1 when the slot holds an entry */
} sim_slot_t;

/* Invariants:
 *  - slot_count is a power of two >= SIM_TABLE_MIN_SLOTS, and 4 * live_count <= 3 * slot_count,
 *    so every probe sequence reaches an unused slot;
 *  - every live entry sits in the probe run that starts at its home slot with no unused slot
 *    between its home and itself (what backward-shift deletion keeps true). */
typedef struct sim_table_s {
  sim_slot_t *slots;
  size_t slot_count;         /* capacity in slots, a power of two */
  size_t live_count;         /* used slots */
} sim_table_t;

/* ------------------------------------------------------------------------------------------
 * The device
 * ---------------------------------------------------------------------------------------- */

typedef struct sim_delay_s {
  uint64_t countdown;        /* calls left until the delayed one; 0 = disarmed */
  unsigned ms;               /* how long it sleeps, with the device lock held */
} sim_delay_t;

typedef struct sim_fault_s {
  uint64_t countdown;        /* calls left until the injected failure; 0 = disarmed */
  int status;                /* what the failing call returns */
} sim_fault_t;

/* Invariants (all under `lock`):
 *  - used_bytes == sum of res.size_bytes over `reservations`, and used_bytes <= capacity_bytes;
 *  - every event with seq > 0 names a stream present in `streams` whose recorded_seq >= seq;
 *  - for every stream, completed_seq <= recorded_seq; both only grow;
 *  - with CP_SIM_NO_TOUCH, no reservation has host memory behind it and next_fake_addr is above
 *    every address handed out so far (addresses are never reused). */
struct cp_sim_s {
  pthread_mutex_t lock;
  cp_fork_lock_t fork_node;       /* `lock` is held across fork() */
  size_t capacity_bytes;
  size_t used_bytes;
  unsigned flags;                 /* CP_SIM_* given at create */
  int auto_complete;              /* events complete at record time */
  uintptr_t next_fake_addr;       /* NO_TOUCH bump pointer, 2 MiB aligned */
  uintptr_t next_event_id;        /* handles are never reused, so a stale one is detected */
  sim_table_t reservations;       /* address -> res */
  sim_table_t streams;            /* stream handle -> stream */
  sim_table_t events;             /* event handle -> event */
  uint64_t calls[CP_SIM_CALL_COUNT];
  sim_fault_t faults[CP_SIM_CALL_COUNT];
  uint64_t faults_injected;
  sim_delay_t delays[CP_SIM_CALL_COUNT];
  atomic_uint_fast64_t delays_entered; /* read without the lock, while a delay holds it */
  int lost;                       /* every call fails: the driver is gone */
};

static const char *const sim_call_names[CP_SIM_CALL_COUNT] = {
#define CP_X(id, name) name,
    CP_SIM_CALLS(CP_X)
#undef CP_X
};

/* ------------------------------------------------------------------------------------------
 * Hash table helpers
 * ---------------------------------------------------------------------------------------- */

/* A 64-bit finalizer: addresses are 512-aligned and handles are small integers, so the raw
 * key is a poor index; mixing spreads every input bit over the low bits. */
static size_t sim_hash(uintptr_t key) {
  uint64_t x = (uint64_t)key;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return (size_t)x;
}

static int sim_table_init(sim_table_t *t) {
  t->slots = calloc(SIM_TABLE_MIN_SLOTS, sizeof *t->slots);
  if (t->slots == NULL) return -1;
  t->slot_count = SIM_TABLE_MIN_SLOTS;
  t->live_count = 0;
  return 0;
}

static void sim_table_free(sim_table_t *t) {
  free(t->slots);
  t->slots = NULL;
  t->slot_count = 0;
  t->live_count = 0;
}

static sim_slot_t *sim_table_find(const sim_table_t *t, uintptr_t key) {
  const size_t mask = t->slot_count - 1;
  for (size_t i = sim_hash(key) & mask;; i = (i + 1) & mask) {
    sim_slot_t *s = &t->slots[i];
    if (!s->used) return NULL;
    if (s->key == key) return s;
  }
}

/* Place an entry known to be absent into a table known to have room. */
static sim_slot_t *sim_table_place(sim_table_t *t, uintptr_t key) {
  const size_t mask = t->slot_count - 1;
  size_t i = sim_hash(key) & mask;
  while (t->slots[i].used) i = (i + 1) & mask;
  sim_slot_t *s = &t->slots[i];
  memset(s, 0, sizeof *s);
  s->key = key;
  s->used = 1;
  t->live_count++;
  return s;
}

/* Make room for one more entry, growing if the load would pass 3/4. Returns 0, or -1 when host
 * memory is short; the table is unchanged then. Pointers into the table are invalidated. */
static int sim_table_make_room(sim_table_t *t) {
  if (4 * (t->live_count + 1) <= 3 * t->slot_count) return 0;
  if (t->slot_count > SIZE_MAX / 2 / sizeof(sim_slot_t)) return -1;
  sim_table_t grown;
  grown.slot_count = t->slot_count * 2;
  grown.live_count = 0;
  grown.slots = calloc(grown.slot_count, sizeof *grown.slots);
  if (grown.slots == NULL) return -1;
  for (size_t i = 0; i < t->slot_count; i++) {
    const sim_slot_t *old = &t->slots[i];
    if (!old->used) continue;
    sim_table_place(&grown, old->key)->value = old->value;
  }
  free(t->slots);
  *t = grown;
  return 0;
}

/* Insert an absent key; the caller called sim_table_make_room first. Value is zeroed. */
static sim_slot_t *sim_table_insert(sim_table_t *t, uintptr_t key) {
  return sim_table_place(t, key);
}

/* Remove the entry in `slot`, then shift later members of its probe run back so that no run
 * has a hole (linear-probing deletion without tombstones). */
static void sim_table_remove(sim_table_t *t, sim_slot_t *slot) {
  const size_t mask = t->slot_count - 1;
  size_t hole = (size_t)(slot - t->slots);
  size_t j = hole;
  for (;;) {
    j = (j + 1) & mask;
    sim_slot_t *s = &t->slots[j];
    if (!s->used) break;
    const size_t home = sim_hash(s->key) & mask;
    /* The entry at j may stay only if its home lies cyclically in (hole, j]. */
    const int stays = (hole <= j) ? (hole < home && home <= j) : (hole < home || home <= j);
    if (stays) continue;
    t->slots[hole] = *s;
    hole = j;
  }
  memset(&t->slots[hole], 0, sizeof t->slots[hole]);
  t->live_count--;
}

/* ------------------------------------------------------------------------------------------
 * Locking, counting and fault injection
 * ---------------------------------------------------------------------------------------- */

/* The getters take a const device; the lock inside it is still mutable state (the device is
 * always heap-allocated, never a const object, so dropping the qualifier here is sound). */
static void sim_lock(const cp_sim_t *sim) {
  pthread_mutex_lock(&((cp_sim_t *)sim)->lock);
}

static void sim_unlock(const cp_sim_t *sim) {
  pthread_mutex_unlock(&((cp_sim_t *)sim)->lock);
}

static int sim_kind_valid(cp_sim_call_t kind) {
  return (int)kind >= 0 && kind < CP_SIM_CALL_COUNT;
}

/* Count one call of `kind` and fire its armed failure if this is the one. Returns CP_OK or the
 * injected status (last error set). Called with the lock held, before any side effect. */
static int sim_enter(cp_sim_t *sim, cp_sim_call_t kind) {
  const uint64_t call_no = ++sim->calls[kind];
  sim_delay_t *d = &sim->delays[kind];
  if (d->countdown != 0 && --d->countdown == 0) {
    atomic_fetch_add_explicit(&sim->delays_entered, 1, memory_order_release);
    struct timespec ts = {(time_t)(d->ms / 1000u), (long)(d->ms % 1000u) * 1000000L};
    while (nanosleep(&ts, &ts) != 0) {
    }
  }
  if (sim->lost) {
    return cp_set_error(CP_ERR_BACKEND, "sim: %s: device lost (the driver has shut down)",
                        sim_call_names[kind]);
  }
  sim_fault_t *f = &sim->faults[kind];
  if (f->countdown == 0) return CP_OK;
  if (--f->countdown != 0) return CP_OK;
  sim->faults_injected++;
  return cp_set_error(f->status, "sim: injected failure in %s (call #%" PRIu64 ")",
                      sim_call_names[kind], call_no);
}

/* The stream's state, created on first use. NULL when host memory for it is short. */
static sim_slot_t *sim_stream_get_or_add(cp_sim_t *sim, cp_stream_t stream) {
  sim_slot_t *s = sim_table_find(&sim->streams, stream);
  if (s != NULL) return s;
  if (sim_table_make_room(&sim->streams) != 0) return NULL;
  return sim_table_insert(&sim->streams, stream);
}

/* Whether a known event has completed; a never-recorded one has (CUDA semantics). */
static int sim_event_done(const cp_sim_t *sim, const sim_slot_t *ev) {
  if (ev->value.event.seq == 0) return 1;
  const sim_slot_t *st = sim_table_find(&sim->streams, ev->value.event.stream);
  return st != NULL && st->value.stream.completed_seq >= ev->value.event.seq;
}

/* ------------------------------------------------------------------------------------------
 * Backend entries (the operation table)
 * ---------------------------------------------------------------------------------------- */

static int sim_reserve(void *ctx, size_t size, uintptr_t *out_addr) {
  cp_sim_t *sim = ctx;
  if (sim == NULL) return cp_set_error(CP_ERR_INVALID, "sim: reserve: no device");
  sim_lock(sim);
  int rc = sim_enter(sim, CP_SIM_RESERVE);
  if (rc != CP_OK) goto out;
  if (out_addr == NULL || size == 0) {
    rc = cp_set_error(CP_ERR_INVALID, "sim: reserve(%zu bytes): %s", size,
                      size == 0 ? "size must be > 0" : "out_addr is NULL");
    goto out;
  }
  if (size > sim->capacity_bytes - sim->used_bytes) {
    rc = cp_set_error(CP_ERR_OOM, "sim: reserve(%zu bytes): out of memory (%zu of %zu bytes used)",
                      size, sim->used_bytes, sim->capacity_bytes);
    goto out;
  }
  if (sim_table_make_room(&sim->reservations) != 0) {
    rc = cp_set_error(CP_ERR_BACKEND, "sim: reserve(%zu bytes): host memory for the "
                      "reservation table is short", size);
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
    const uintptr_t span =
        ((uintptr_t)size + SIM_FAKE_ALIGN_BYTES - 1) & ~(SIM_FAKE_ALIGN_BYTES - 1);
    addr = sim->next_fake_addr;
    sim->next_fake_addr += span;
  } else {
    /* Real host memory of exactly `size` bytes (posix_memalign needs no rounding), so that
     * AddressSanitizer flags even a one-byte overrun past the reservation. */
    void *p = NULL;
    if (posix_memalign(&p, SIM_ALIGN_BYTES, size) != 0 || p == NULL) {
      rc = cp_set_error(CP_ERR_OOM, "sim: reserve(%zu bytes): host memory is short "
                        "(%zu of %zu bytes used)", size, sim->used_bytes, sim->capacity_bytes);
      goto out;
    }
    addr = (uintptr_t)p;
  }

  sim_table_insert(&sim->reservations, addr)->value.res.size_bytes = size;
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
  int rc = sim_enter(sim, CP_SIM_RELEASE);
  if (rc != CP_OK) goto out;
  sim_slot_t *s = sim_table_find(&sim->reservations, addr);
  if (s == NULL) {
    rc = cp_set_error(CP_ERR_INVALID, "sim: release(0x%" PRIxPTR ", %zu bytes): unknown address",
                      addr, size);
    goto out;
  }
  if (s->value.res.size_bytes != size) {
    rc = cp_set_error(CP_ERR_INVALID, "sim: release(0x%" PRIxPTR ", %zu bytes): address was "
                      "reserved with %zu bytes", addr, size, s->value.res.size_bytes);
    goto out;
  }
  if (!(sim->flags & CP_SIM_NO_TOUCH)) free((void *)addr);
  sim->used_bytes -= size;
  sim_table_remove(&sim->reservations, s);
out:
  sim_unlock(sim);
  return rc;
}

static int sim_event_create(void *ctx, cp_event_t *out_event) {
  cp_sim_t *sim = ctx;
  if (sim == NULL) return cp_set_error(CP_ERR_INVALID, "sim: event_create: no device");
  sim_lock(sim);
  int rc = sim_enter(sim, CP_SIM_EVENT_CREATE);
  if (rc != CP_OK) goto out;
  if (out_event == NULL) {
    rc = cp_set_error(CP_ERR_INVALID, "sim: event_create: out_event is NULL");
    goto out;
  }
  if (sim_table_make_room(&sim->events) != 0) {
    rc = cp_set_error(CP_ERR_BACKEND,
                      "sim: event_create: host memory for the event table is short");
    goto out;
  }
  const uintptr_t id = sim->next_event_id++;
  sim_table_insert(&sim->events, id); /* zeroed value: never recorded */
  *out_event = id;
out:
  sim_unlock(sim);
  return rc;
}

static int sim_event_destroy(void *ctx, cp_event_t event) {
  cp_sim_t *sim = ctx;
  if (sim == NULL) return cp_set_error(CP_ERR_INVALID, "sim: event_destroy: no device");
  sim_lock(sim);
  int rc = sim_enter(sim, CP_SIM_EVENT_DESTROY);
  if (rc != CP_OK) goto out;
  sim_slot_t *ev = sim_table_find(&sim->events, event);
  if (ev == NULL) {
    rc = cp_set_error(CP_ERR_INVALID, "sim: event_destroy(0x%" PRIxPTR "): unknown event", event);
    goto out;
  }
  sim_table_remove(&sim->events, ev);
out:
  sim_unlock(sim);
  return rc;
}

static int sim_event_record(void *ctx, cp_event_t event, cp_stream_t stream) {
  cp_sim_t *sim = ctx;
  if (sim == NULL) return cp_set_error(CP_ERR_INVALID, "sim: event_record: no device");
  sim_lock(sim);
  int rc = sim_enter(sim, CP_SIM_EVENT_RECORD);
  if (rc != CP_OK) goto out;
  sim_slot_t *ev = sim_table_find(&sim->events, event);
  if (ev == NULL) {
    rc = cp_set_error(CP_ERR_INVALID, "sim: event_record(0x%" PRIxPTR ", stream 0x%" PRIxPTR
                      "): unknown event", event, stream);
    goto out;
  }
  /* Streams live in their own table, so `ev` stays valid if that one grows. */
  sim_slot_t *st = sim_stream_get_or_add(sim, stream);
  if (st == NULL) {
    rc = cp_set_error(CP_ERR_BACKEND, "sim: event_record(0x%" PRIxPTR ", stream 0x%" PRIxPTR
                      "): host memory for the stream table is short", event, stream);
    goto out;
  }
  if (st->value.stream.invalid) {
    rc = cp_set_error(CP_ERR_BACKEND, "sim: event_record(0x%" PRIxPTR ", stream 0x%" PRIxPTR
                      "): invalid resource handle (the stream is invalid)", event, stream);
    goto out;
  }
  const uint64_t seq = ++st->value.stream.recorded_seq;
  ev->value.event.stream = stream;
  ev->value.event.seq = seq;
  if (sim->auto_complete) st->value.stream.completed_seq = seq;
out:
  sim_unlock(sim);
  return rc;
}

static int sim_event_query(void *ctx, cp_event_t event, int *out_done) {
  cp_sim_t *sim = ctx;
  if (sim == NULL) return cp_set_error(CP_ERR_INVALID, "sim: event_query: no device");
  sim_lock(sim);
  int rc = sim_enter(sim, CP_SIM_EVENT_QUERY);
  if (rc != CP_OK) goto out;
  if (out_done == NULL) {
    rc = cp_set_error(CP_ERR_INVALID, "sim: event_query(0x%" PRIxPTR "): out_done is NULL", event);
    goto out;
  }
  const sim_slot_t *ev = sim_table_find(&sim->events, event);
  if (ev == NULL) {
    rc = cp_set_error(CP_ERR_INVALID, "sim: event_query(0x%" PRIxPTR "): unknown event", event);
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
  int rc = sim_enter(sim, CP_SIM_EVENT_SYNCHRONIZE);
  if (rc != CP_OK) goto out;
  const sim_slot_t *ev = sim_table_find(&sim->events, event);
  if (ev == NULL) {
    rc = cp_set_error(CP_ERR_INVALID, "sim: event_synchronize(0x%" PRIxPTR "): unknown event",
                      event);
    goto out;
  }
  /* The device "runs" the stream up to the event; later work on it stays pending. */
  if (ev->value.event.seq != 0) {
    sim_slot_t *st = sim_table_find(&sim->streams, ev->value.event.stream);
    if (st != NULL && st->value.stream.completed_seq < ev->value.event.seq)
      st->value.stream.completed_seq = ev->value.event.seq;
  }
out:
  sim_unlock(sim);
  return rc;
}

static int sim_mem_info(void *ctx, size_t *out_free, size_t *out_total) {
  cp_sim_t *sim = ctx;
  if (sim == NULL) return cp_set_error(CP_ERR_INVALID, "sim: mem_info: no device");
  sim_lock(sim);
  int rc = sim_enter(sim, CP_SIM_MEM_INFO);
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
    return cp_set_error(CP_ERR_INVALID, "cp_sim_create: unknown flags 0x%x",
                        flags & ~(unsigned)SIM_FLAGS_KNOWN);
  cp_sim_t *sim = calloc(1, sizeof *sim);
  if (sim == NULL) goto no_host_memory;
  if (sim_table_init(&sim->reservations) != 0 || sim_table_init(&sim->streams) != 0 ||
      sim_table_init(&sim->events) != 0)
    goto no_host_memory;
  if (pthread_mutex_init(&sim->lock, NULL) != 0) {
    sim_table_free(&sim->reservations);
    sim_table_free(&sim->streams);
    sim_table_free(&sim->events);
    free(sim);
    return cp_set_error(CP_ERR_HOST_OOM, "cp_sim_create: pthread_mutex_init failed");
  }
  cp_fork_register(&sim->fork_node, &sim->lock, CP_FORK_LEVEL_BACKEND);
  sim->capacity_bytes = capacity;
  sim->flags = flags;
  sim->auto_complete = (flags & CP_SIM_AUTO_COMPLETE) != 0;
  sim->next_fake_addr = SIM_FAKE_BASE_ADDR;
  sim->next_event_id = 1;
  *out_sim = sim;
  return CP_OK;

no_host_memory:
  if (sim != NULL) {
    sim_table_free(&sim->reservations); /* free(NULL) is fine for tables never set up */
    sim_table_free(&sim->streams);
    sim_table_free(&sim->events);
    free(sim);
  }
  return cp_set_error(CP_ERR_HOST_OOM, "cp_sim_create: host memory is short");
}

void cp_sim_destroy(cp_sim_t *sim) {
  if (sim == NULL) return;
  cp_fork_unregister(&sim->fork_node);
  if (!(sim->flags & CP_SIM_NO_TOUCH)) {
    for (size_t i = 0; i < sim->reservations.slot_count; i++) {
      const sim_slot_t *s = &sim->reservations.slots[i];
      if (s->used) free((void *)s->key);
    }
  }
  sim_table_free(&sim->reservations);
  sim_table_free(&sim->streams);
  sim_table_free(&sim->events);
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
}

/* ------------------------------------------------------------------------------------------
 * Test controls
 * ---------------------------------------------------------------------------------------- */

void cp_sim_complete(cp_sim_t *sim, cp_stream_t stream) {
  if (sim == NULL) return;
  sim_lock(sim);
  sim_slot_t *st = sim_table_find(&sim->streams, stream);
  if (st != NULL) st->value.stream.completed_seq = st->value.stream.recorded_seq;
  sim_unlock(sim); /* an unknown stream has nothing recorded, so nothing to complete */
}

int cp_sim_stream_idle(cp_sim_t *sim, cp_stream_t stream) {
  if (sim == NULL) return 1;
  sim_lock(sim);
  sim_slot_t *st = sim_table_find(&sim->streams, stream);
  int idle = st == NULL || st->value.stream.completed_seq >= st->value.stream.recorded_seq;
  sim_unlock(sim);
  return idle;
}

void cp_sim_complete_all(cp_sim_t *sim) {
  if (sim == NULL) return;
  sim_lock(sim);
  for (size_t i = 0; i < sim->streams.slot_count; i++) {
    sim_slot_t *st = &sim->streams.slots[i];
    if (st->used) st->value.stream.completed_seq = st->value.stream.recorded_seq;
  }
  sim_unlock(sim);
}

void cp_sim_set_auto_complete(cp_sim_t *sim, int on) {
  if (sim == NULL) return;
  sim_lock(sim);
  sim->auto_complete = on != 0; /* affects later records only */
  sim_unlock(sim);
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
  sim_slot_t *st = sim_stream_get_or_add(sim, stream);
  if (st != NULL) st->value.stream.invalid = 1;
  sim_unlock(sim);
  if (st == NULL) {
    return cp_set_error(CP_ERR_HOST_OOM, "cp_sim_invalidate_stream(0x%" PRIxPTR "): host memory for the "
                        "stream table is short", stream);
  }
  return CP_OK;
}

uint64_t cp_sim_calls(const cp_sim_t *sim, cp_sim_call_t kind) {
  if (sim == NULL || !sim_kind_valid(kind)) return 0;
  sim_lock(sim);
  const uint64_t n = sim->calls[kind];
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
  sim->faults_injected = 0;
  sim_unlock(sim); /* armed faults keep counting down */
}

const char *cp_sim_call_name(cp_sim_call_t kind) {
  return sim_kind_valid(kind) ? sim_call_names[kind] : "unknown";
}

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
  const size_t n = sim->reservations.live_count;
  sim_unlock(sim);
  return n;
}

size_t cp_sim_live_events(const cp_sim_t *sim) {
  if (sim == NULL) return 0;
  sim_lock(sim);
  const size_t n = sim->events.live_count;
  sim_unlock(sim);
  return n;
}

size_t cp_sim_capacity(const cp_sim_t *sim) {
  return sim == NULL ? 0 : sim->capacity_bytes; /* fixed at create */
}
