/* sim_work.c — the simulated device's queued work: launches that run behind the host, and the
 * device faults of memory given back, handed over or touched while that work may still run.
 * Owns: the work table, the fault log and Note [Simulated asynchrony] (sim.h). */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "backend/sim_internal.h"

#define SIM_WORK_MIN_SLOTS ((size_t)256)

/* ------------------------------------------------------------------------------------------
 * The work table
 * ---------------------------------------------------------------------------------------- */

int cp_sim_work_init(cp_sim_t *sim) {
  sim->lag = (sim->flags & CP_SIM_AUTO_COMPLETE) ? 0 : UINT64_MAX;
  return cp_ptrmap_init(&sim->work, SIM_WORK_MIN_SLOTS);
}

/* Work nodes are kept for reuse: a replay queues one per free. */
static sim_work_t *sim_work_node(cp_sim_t *sim) {
  sim_work_t *w = sim->spare_work;
  if (w == NULL) return malloc(sizeof *w);
  sim->spare_work = w->next;
  return w;
}

static void sim_work_unnode(cp_sim_t *sim, sim_work_t *w) {
  w->next = sim->spare_work;
  sim->spare_work = w;
}

static void sim_work_free_chain(uintptr_t key, void *value, void *arg) {
  (void)key;
  cp_sim_t *sim = arg;
  for (sim_work_t *w = value, *next; w != NULL; w = next) {
    next = w->next;
    sim_work_unnode(sim, w);
  }
}

void cp_sim_work_destroy(cp_sim_t *sim) {
  if (sim->work.slots != NULL) cp_ptrmap_each(&sim->work, sim_work_free_chain, sim);
  cp_ptrmap_destroy(&sim->work);
  sim->work_items = 0;
  for (sim_work_t *w = sim->spare_work, *next; w != NULL; w = next) {
    next = w->next;
    free(w);
  }
  sim->spare_work = NULL;
  free(sim->res_index);
  sim->res_index = NULL;
  sim->res_count = sim->res_cap = 0;
}

/* ------------------------------------------------------------------------------------------
 * The index of reservations (sorted by address; a launch looks its memory up by bisection)
 * ---------------------------------------------------------------------------------------- */

/* The first entry whose address is above `addr`. */
static size_t sim_index_upper(const cp_sim_t *sim, uintptr_t addr) {
  size_t lo = 0, hi = sim->res_count;
  while (lo < hi) {
    const size_t mid = lo + (hi - lo) / 2;
    if (sim->res_index[mid].addr <= addr)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

int cp_sim_index_room_locked(cp_sim_t *sim) {
  if (sim->res_count < sim->res_cap) return CP_OK;
  const size_t cap = sim->res_cap != 0 ? 2 * sim->res_cap : 64;
  sim_span_t *grown = realloc(sim->res_index, cap * sizeof *grown);
  if (grown == NULL) return CP_ERR_HOST_OOM;
  sim->res_index = grown;
  sim->res_cap = cap;
  return CP_OK;
}

void cp_sim_index_add_locked(cp_sim_t *sim, uintptr_t addr, size_t size) {
  const size_t at = sim_index_upper(sim, addr);
  memmove(sim->res_index + at + 1, sim->res_index + at, (sim->res_count - at) * sizeof *sim->res_index);
  sim->res_index[at] = (sim_span_t){addr, size};
  sim->res_count++;
}

void cp_sim_index_remove_locked(cp_sim_t *sim, uintptr_t addr) {
  const size_t at = sim_index_upper(sim, addr);
  if (at == 0 || sim->res_index[at - 1].addr != addr) return;
  memmove(sim->res_index + at - 1, sim->res_index + at, (sim->res_count - at) * sizeof *sim->res_index);
  sim->res_count--;
}

/* Whether the launch `w` has not completed yet. */
static int sim_work_busy(const cp_sim_t *sim, const sim_work_t *w) {
  const sim_stream_t *st = cp_ptrmap_get(&sim->streams, w->stream);
  return st == NULL || st->completed_seq < w->seq;
}

void cp_sim_drain_locked(cp_sim_t *sim) {
  if (sim->work_items != 0 || sim->work.count != 0) {
    /* Every launch is done: the table empties in place (all slots empty is a valid map). */
    cp_ptrmap_each(&sim->work, sim_work_free_chain, sim);
    memset(sim->work.slots, 0, (sim->work.mask + 1) * sizeof *sim->work.slots);
    sim->work.count = 0;
    sim->work_items = 0;
  }
  for (size_t i = 0; i <= sim->streams.mask && sim->streams.slots != NULL; i++) {
    sim_stream_t *st = sim->streams.slots[i].value;
    if (st != NULL) st->completed_seq = st->submitted_seq;
  }
}

/* Drop the launches of the chain at `addr` that are complete, or that a new launch of
 * `stream` over `size` bytes there covers (it completes after them, on the same stream). */
static void sim_work_prune_at(cp_sim_t *sim, uintptr_t addr, cp_stream_t stream, size_t size) {
  sim_work_t *head = cp_ptrmap_get(&sim->work, addr);
  sim_work_t **link = &head;
  while (*link != NULL) {
    sim_work_t *w = *link;
    if (sim_work_busy(sim, w) && !(w->stream == stream && w->size <= size)) {
      link = &w->next;
      continue;
    }
    *link = w->next;
    sim_work_unnode(sim, w);
    sim->work_items--;
  }
  if (head == NULL) {
    (void)cp_ptrmap_remove(&sim->work, addr);
  } else if (cp_ptrmap_get(&sim->work, addr) != head) {
    (void)cp_ptrmap_remove(&sim->work, addr);
    (void)cp_ptrmap_insert(&sim->work, addr, head); /* a removal leaves room for the key */
  }
}

/* ------------------------------------------------------------------------------------------
 * Faults
 * ---------------------------------------------------------------------------------------- */

void cp_sim_fault_locked(cp_sim_t *sim, const char *what, const char *call, uintptr_t addr, size_t size,
                         cp_stream_t stream) {
  if (sim->device_faults < SIM_FAULT_LOG) {
    sim->fault_log[sim->device_faults] = (cp_sim_device_fault_t){what, call, addr, size, stream};
  }
  sim->device_faults++;
}

/* What a scan of the work table looks for: incomplete launches touching [addr, end), of any
 * stream but `skip` when `skip_on` is set, by address or (physical) through shared pages. */
typedef struct sim_busy_scan_s {
  const cp_sim_t *sim;
  uintptr_t addr, end;
  int skip_on;
  cp_stream_t skip;
  int physical;
  size_t found;
  size_t stale;                  /* completed launches seen (dropped when they are many) */
  uintptr_t keys[SIM_FAULT_LOG]; /* where the first ones were, for their faults */
  const sim_work_t *items[SIM_FAULT_LOG];
} sim_busy_scan_t;

static void sim_busy_visit(uintptr_t key, void *value, void *arg) {
  sim_busy_scan_t *s = arg;
  for (const sim_work_t *w = value; w != NULL; w = w->next) {
    if (!sim_work_busy(s->sim, w)) {
      s->stale++;
      continue;
    }
    if (s->skip_on && w->stream == s->skip) continue;
    int hit = key < s->end && key + w->size > s->addr;
    if (!hit && s->physical) hit = cp_sim_vmm_shares_locked(s->sim, key, w->size, s->addr, (size_t)(s->end - s->addr));
    if (!hit) continue;
    if (s->found < SIM_FAULT_LOG) {
      s->keys[s->found] = key;
      s->items[s->found] = w;
    }
    s->found++;
  }
}

/* Drop every completed launch (a scan found many): the table is built anew from the others. A
 * table that cannot be built for want of host memory stays as it was (stale entries are only
 * slower to scan). */
static void sim_work_compact(cp_sim_t *sim) {
  cp_ptrmap_t fresh;
  if (cp_ptrmap_init(&fresh, 2 * sim->work.count + SIM_WORK_MIN_SLOTS) != CP_OK) return;
  size_t items = 0;
  for (size_t i = 0; i <= sim->work.mask; i++) {
    sim_work_t *head = sim->work.slots[i].value, *kept = NULL;
    if (head == NULL) continue;
    for (sim_work_t *w = head, *next; w != NULL; w = next) {
      next = w->next;
      if (sim_work_busy(sim, w)) {
        w->next = kept;
        kept = w;
        items++;
      } else {
        sim_work_unnode(sim, w);
      }
    }
    if (kept != NULL) (void)cp_ptrmap_insert(&fresh, sim->work.slots[i].key, kept); /* room made at init */
  }
  cp_ptrmap_destroy(&sim->work);
  sim->work = fresh;
  sim->work_items = items;
}

static size_t sim_busy_fault(cp_sim_t *sim, sim_busy_scan_t *s, const char *what, const char *call) {
  if (sim->work_items == 0) return 0;
  cp_ptrmap_each(&sim->work, sim_busy_visit, s);
  for (size_t i = 0; i < s->found && i < SIM_FAULT_LOG; i++) {
    cp_sim_fault_locked(sim, what, call, s->keys[i], s->items[i]->size, s->items[i]->stream);
  }
  if (s->stale > SIM_WORK_MIN_SLOTS && 2 * s->stale > sim->work_items) sim_work_compact(sim);
  return s->found;
}

size_t cp_sim_fault_if_busy_locked(cp_sim_t *sim, const char *what, const char *call, uintptr_t addr, size_t size) {
  sim_busy_scan_t s;
  memset(&s, 0, sizeof s);
  s.sim = sim;
  s.addr = addr;
  s.end = addr + size;
  return sim_busy_fault(sim, &s, what, call);
}

/* ------------------------------------------------------------------------------------------
 * Entry points (sim.h)
 * ---------------------------------------------------------------------------------------- */

/* sim_internal.h */
int cp_sim_reserved_locked(const cp_sim_t *sim, uintptr_t ptr, size_t bytes) {
  const size_t at = sim_index_upper(sim, ptr);
  if (at == 0) return 0;
  const sim_span_t *r = &sim->res_index[at - 1];
  return ptr - r->addr < r->size && bytes <= r->size - (ptr - r->addr);
}

static int sim_launch(cp_sim_t *sim, cp_stream_t stream, uintptr_t ptr, size_t bytes, int check) {
  if (sim == NULL) return cp_set_error(CP_ERR_INVALID, "cp_sim_launch: no device");
  if (bytes == 0) return cp_set_error(CP_ERR_INVALID, "cp_sim_launch: bytes must be > 0");
  sim_lock(sim);
  int rc = CP_OK;
  if (sim->lost) {
    rc = cp_set_error(CP_ERR_BACKEND, "sim: launch: device lost (the driver has shut down)");
    goto out;
  }
  if (bytes > UINTPTR_MAX - ptr ||
      (check && !cp_sim_reserved_locked(sim, ptr, bytes) && !cp_sim_vmm_accessible_locked(sim, ptr, bytes))) {
    cp_sim_fault_locked(sim, "launch on memory that is not the device's (not reserved, or not mapped with access)",
                        "launch", ptr, bytes, stream);
    rc = cp_set_error(CP_ERR_INVALID, "sim: launch(0x%" PRIxPTR ", %zu bytes, stream 0x%" PRIxPTR "): device fault",
                      ptr, bytes, stream);
    goto out;
  }
  sim_stream_t *st = cp_sim_stream_get_locked(sim, stream);
  if (st != NULL && sim->lag == 0) { /* an always idle device: it ran at once, after all before it */
    st->completed_seq = ++st->submitted_seq;
    goto out;
  }
  sim_work_t *w = st != NULL ? sim_work_node(sim) : NULL;
  if (w == NULL || cp_ptrmap_reserve(&sim->work, 1) != CP_OK) {
    if (w != NULL) sim_work_unnode(sim, w);
    rc = cp_set_error(CP_ERR_HOST_OOM, "sim: launch: host memory for the work queue is short");
    goto out;
  }
  sim_work_prune_at(sim, ptr, stream, bytes); /* what ran, or this launch covers, is forgotten */
  w->stream = stream;
  w->size = bytes;
  w->seq = cp_sim_submit_locked(sim, st);
  if (!sim_work_busy(sim, w)) { /* ran at once (lag 0) */
    sim_work_unnode(sim, w);
    goto out;
  }
  w->next = cp_ptrmap_remove(&sim->work, ptr);
  (void)cp_ptrmap_insert(&sim->work, ptr, w); /* room made above */
  sim->work_items++;
out:
  sim_unlock(sim);
  return rc;
}

int cp_sim_launch(cp_sim_t *sim, cp_stream_t stream, uintptr_t ptr, size_t bytes) {
  return sim_launch(sim, stream, ptr, bytes, 1);
}

int cp_sim_queue(cp_sim_t *sim, cp_stream_t stream, uintptr_t ptr, size_t bytes) {
  return sim_launch(sim, stream, ptr, bytes, 0);
}

void cp_sim_set_lag(cp_sim_t *sim, uint64_t items) {
  if (sim == NULL) return;
  sim_lock(sim);
  sim->lag = items;
  sim_unlock(sim);
}

size_t cp_sim_check_handoff(cp_sim_t *sim, cp_stream_t stream, uintptr_t ptr, size_t bytes) {
  if (sim == NULL || bytes == 0) return 0;
  sim_lock(sim);
  sim_busy_scan_t s;
  memset(&s, 0, sizeof s);
  s.sim = sim;
  s.addr = ptr;
  s.end = ptr + bytes;
  s.skip_on = 1;
  s.skip = stream;
  s.physical = 1;
  const size_t n = sim_busy_fault(
      sim, &s, "memory handed to another stream while work that touches it is not known done", "handoff");
  sim_unlock(sim);
  return n;
}

typedef struct sim_count_scan_s {
  const cp_sim_t *sim;
  size_t busy;
} sim_count_scan_t;

static void sim_count_visit(uintptr_t key, void *value, void *arg) {
  (void)key;
  sim_count_scan_t *s = arg;
  for (const sim_work_t *w = value; w != NULL; w = w->next) s->busy += (size_t)sim_work_busy(s->sim, w);
}

size_t cp_sim_queued_launches(const cp_sim_t *sim) {
  if (sim == NULL) return 0;
  sim_lock(sim);
  sim_count_scan_t s = {sim, 0};
  if (sim->work_items != 0) cp_ptrmap_each(&sim->work, sim_count_visit, &s);
  sim_unlock(sim);
  return s.busy;
}

uint64_t cp_sim_device_faults(const cp_sim_t *sim) {
  if (sim == NULL) return 0;
  sim_lock(sim);
  const uint64_t n = sim->device_faults;
  sim_unlock(sim);
  return n;
}

int cp_sim_device_fault(const cp_sim_t *sim, size_t i, cp_sim_device_fault_t *out) {
  if (sim == NULL || out == NULL) return cp_set_error(CP_ERR_INVALID, "cp_sim_device_fault: NULL argument");
  sim_lock(sim);
  const int known = i < sim->device_faults && i < SIM_FAULT_LOG;
  if (known) *out = sim->fault_log[i];
  sim_unlock(sim);
  return known ? CP_OK : cp_set_error(CP_ERR_INVALID, "cp_sim_device_fault: no fault #%zu kept", i);
}

void cp_sim_note_fault(cp_sim_t *sim, const char *what, uintptr_t addr, size_t size, cp_stream_t stream) {
  if (sim == NULL) return;
  sim_lock(sim);
  cp_sim_fault_locked(sim, what != NULL ? what : "fault noted by the harness", "harness", addr, size, stream);
  sim_unlock(sim);
}

void cp_sim_clear_device_faults(cp_sim_t *sim) {
  if (sim == NULL) return;
  sim_lock(sim);
  sim->device_faults = 0;
  sim_unlock(sim);
}

uint64_t cp_sim_print_device_faults(const cp_sim_t *sim, FILE *out) {
  if (sim == NULL) return 0;
  sim_lock(sim);
  const uint64_t n = sim->device_faults;
  for (uint64_t i = 0; out != NULL && i < n && i < SIM_FAULT_LOG; i++) {
    const cp_sim_device_fault_t *f = &sim->fault_log[i];
    fprintf(out, "device fault #%" PRIu64 ": %s: %s at 0x%" PRIxPTR " (%zu bytes), stream 0x%" PRIxPTR "\n", i + 1,
            f->call, f->what, f->addr, f->size, f->stream);
  }
  if (out != NULL && n > SIM_FAULT_LOG) fprintf(out, "... and %" PRIu64 " more\n", n - SIM_FAULT_LOG);
  sim_unlock(sim);
  return n;
}
