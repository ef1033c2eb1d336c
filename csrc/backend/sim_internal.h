/* sim_internal.h — what the simulated device's files share: the device struct and its lock,
 * the per-call hook (count, delay, lost device, injected fault), the page-mapped state. */
#ifndef CP_SIM_INTERNAL_H
#define CP_SIM_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/sim.h"
#include "base/fork.h"
#include "base/ptrmap.h"

typedef struct sim_delay_s {
  uint64_t countdown; /* calls left until the delayed one; 0 = disarmed */
  unsigned ms;        /* how long it sleeps, with the device lock held */
} sim_delay_t;

typedef struct sim_fault_s {
  uint64_t countdown; /* calls left until the injected failure; 0 = disarmed */
  int status;         /* what the failing call returns */
} sim_fault_t;

/* Page-mapped memory (sim_vmm.c), Note [Page-mapped memory] in base/backend.h.
 * Invariants (under the device lock):
 *  - page_bytes == sum of the sizes in `pages`, and it is part of the device's used_bytes;
 *  - a page stays in `pages` while it is not released or still mapped (maps > 0);
 *  - mapped_bytes == sum of the sizes in `mappings`; mappings never overlap, each lies inside
 *    one range of `ranges` and names a page of `pages` of the same size;
 *  - every size and address in the three maps is a multiple of `granularity`;
 *  - without CP_SIM_NO_TOUCH, every range is a PROT_NONE host mapping of its size, every
 *    mapping the page's file mapped at its address (read-write once `access` is set), and
 *    every page owns an open file descriptor; with it, no host memory is behind any of them. */
typedef struct sim_page_s {
  size_t size;
  int fd;       /* the page's memory (memfd); -1 with CP_SIM_NO_TOUCH */
  int released; /* page_release was called; gone with the last unmap */
  size_t maps;  /* mappings of this page */
} sim_page_t;

typedef struct sim_mapping_s {
  size_t size;
  cp_page_t page;
  int access; /* page_set_access was called on it */
} sim_mapping_t;

typedef struct sim_vmm_s {
  size_t granularity;     /* bytes, a power of two; fixed once `started` */
  int started;            /* a page-mapped call was made */
  uintptr_t next_page_id; /* page handles are never reused, so a stale one is detected */
  size_t page_bytes;
  size_t mapped_bytes;
  size_t max_mapping;   /* the longest mapping ever made, in bytes */
  size_t aliased_pages; /* pages mapped at two addresses or more (maps >= 2) */
  uintptr_t last_range; /* the range vmm_holder found last (a hint, checked before use) */
  cp_ptrmap_t ranges;   /* range address -> size in bytes (never NULL: size > 0) */
  cp_ptrmap_t pages;    /* page handle -> sim_page_t (owned) */
  cp_ptrmap_t mappings; /* mapping address -> sim_mapping_t (owned) */
} sim_vmm_t;

/* A stream of the device (sim.c). Launches are its work, numbered in the order they were
 * submitted; the device runs them in that order. An event recorded on it is a marker after
 * the last launch so far.
 * Invariants: completed_seq <= submitted_seq; both only grow. */
typedef struct sim_stream_s {
  uint64_t submitted_seq; /* number of the last launch on this stream */
  uint64_t completed_seq; /* every item with seq <= this has completed */
  int invalid;            /* cp_sim_invalidate_stream: records on it fail */
  int capturing;          /* cp_sim_set_capturing: being captured (Note [Simulated capture]) */
} sim_stream_t;

/* Work still queued (sim_work.c), Note [Simulated asynchrony] in sim.h: one launch of
 * `stream` that touches [addr, addr + size) and completes with item `seq` of its stream.
 * Kept in `work`, keyed by addr; launches at one address chain through `next`. */
typedef struct sim_work_s {
  struct sim_work_s *next;
  cp_stream_t stream;
  uint64_t seq;
  size_t size;
} sim_work_t;

#define SIM_FAULT_LOG 64 /* device faults kept in detail; the count goes on */

/* A reservation in the sorted index of sim_work.c. */
typedef struct sim_span_s {
  uintptr_t addr;
  size_t size;
} sim_span_t;

/* Invariants (all under `lock`):
 *  - used_bytes == sum of the sizes in `reservations` + vmm.page_bytes, and
 *    used_bytes <= capacity_bytes;
 *  - every event with seq > 0 names a stream present in `streams` whose submitted_seq >= seq;
 *  - every item of `work` names a stream present in `streams` whose submitted_seq >= seq;
 *    work_items counts the items; completed ones may linger until the next scan drops them;
 *  - with CP_SIM_NO_TOUCH, no reservation has host memory behind it and next_fake_addr is above
 *    every address handed out so far (addresses are never reused). */
struct cp_sim_s {
  pthread_mutex_t lock;
  cp_fork_lock_t fork_node; /* `lock` is held across fork() */
  size_t capacity_bytes;
  size_t used_bytes;
  unsigned flags;           /* CP_SIM_* given at create */
  uintptr_t next_fake_addr; /* NO_TOUCH bump pointer, 2 MiB aligned */
  uintptr_t next_event_id;  /* handles are never reused, so a stale one is detected */
  cp_ptrmap_t reservations; /* address -> size in bytes as asked for (not rounded) */
  cp_ptrmap_t streams;      /* stream handle -> sim_stream_t (owned) */
  cp_ptrmap_t events;       /* event handle -> sim_event_t (owned) */
  sim_vmm_t vmm;
  uint64_t calls[CP_SIM_CALL_COUNT];
  uint64_t bytes[CP_SIM_CALL_COUNT]; /* bytes named by the calls of each kind (cp_sim_call_bytes) */
  sim_fault_t faults[CP_SIM_CALL_COUNT];
  uint64_t faults_injected;
  sim_delay_t delays[CP_SIM_CALL_COUNT];
  atomic_uint_fast64_t delays_entered; /* read without the lock, while a delay holds it */
  int lost;                            /* every call fails: the driver is gone */
  size_t capturing_streams;            /* streams with `capturing` set */
  uint64_t capture_violations;         /* calls refused because a stream was capturing */
  uint64_t lag;                        /* items a stream runs behind; UINT64_MAX: until told */
  cp_ptrmap_t work;                    /* address -> sim_work_t chain (owned) */
  sim_span_t *res_index;               /* every reservation, by address (a launch's lookup) */
  size_t res_count, res_cap;
  sim_work_t *spare_work; /* unused work nodes, linked through `next` */
  size_t work_items;
  size_t host_allocs;                             /* host_alloc blocks not freed yet (sim_copy.c) */
  size_t host_bytes;                              /*   and their bytes */
  uint64_t device_faults;                         /* every fault so far */
  cp_sim_device_fault_t fault_log[SIM_FAULT_LOG]; /* the first ones, in order */
};

#define SIM_MAP_MIN_SLOTS    ((size_t)64)         /* initial slots of every map */
#define SIM_FAKE_ALIGN_BYTES ((uintptr_t)2 << 20) /* 2 MiB between fake reservations */

/* The getters take a const device; the lock inside it is still mutable state (the device is
 * always heap-allocated, never a const object, so dropping the qualifier here is sound). */
static inline void sim_lock(const cp_sim_t *sim) { pthread_mutex_lock(&((cp_sim_t *)sim)->lock); }

static inline void sim_unlock(const cp_sim_t *sim) { pthread_mutex_unlock(&((cp_sim_t *)sim)->lock); }

/* sim.c: count one call of `kind`, sleep if it is the delayed one, fail when the device is
 * lost, fire its armed failure if this is the one. Returns CP_OK or the failure (last error
 * set). Called with the lock held, before any side effect. */
int cp_sim_enter_locked(cp_sim_t *sim, cp_sim_call_t kind);

/* sim.c: the state of `stream`, created on first use; NULL when host memory is short. */
sim_stream_t *cp_sim_stream_get_locked(cp_sim_t *sim, cp_stream_t stream);
/* sim.c: the next item of `stream` is submitted: its number, completed at once when the
 * stream may run no further behind (lag). */
uint64_t cp_sim_submit_locked(cp_sim_t *sim, sim_stream_t *st);

/* sim.c: CP_OK, or (while any stream captures) a device fault and CP_ERR_BACKEND. */
int cp_sim_refuse_if_capturing_locked(cp_sim_t *sim, cp_sim_call_t kind);

/* sim_work.c: record a device fault (Note [Simulated asynchrony]). */
void cp_sim_fault_locked(cp_sim_t *sim, const char *what, const char *call, uintptr_t addr, size_t size,
                         cp_stream_t stream);
/* sim_work.c: a fault for each launch not yet complete that touches [addr, addr + size);
 * returns how many. */
size_t cp_sim_fault_if_busy_locked(cp_sim_t *sim, const char *what, const char *call, uintptr_t addr, size_t size);
/* sim_work.c: every stream completes what was submitted to it (a device-wide drain), and the
 * work table empties. */
void cp_sim_drain_locked(cp_sim_t *sim);
/* sim_work.c: the index of reservations a launch looks its memory up in. Room for one more
 * is made first (CP_ERR_HOST_OOM), so that adding cannot fail. */
int cp_sim_index_room_locked(cp_sim_t *sim);
void cp_sim_index_add_locked(cp_sim_t *sim, uintptr_t addr, size_t size);
void cp_sim_index_remove_locked(cp_sim_t *sim, uintptr_t addr);
/* sim_work.c: whether [ptr, ptr + bytes) lies inside one plain reservation. */
int cp_sim_reserved_locked(const cp_sim_t *sim, uintptr_t ptr, size_t bytes);
int cp_sim_work_init(cp_sim_t *sim);
void cp_sim_work_destroy(cp_sim_t *sim);

/* sim_vmm.c: whether [a, a + a_size) and [b, b + b_size) share a byte of device memory (the
 * same address, or one page mapped under both); 0 when either is not page-mapped memory. */
int cp_sim_vmm_shares_locked(const cp_sim_t *sim, uintptr_t a, size_t a_size, uintptr_t b, size_t b_size);
/* sim_vmm.c: whether all of [addr, addr + size) is page-mapped with access set. */
int cp_sim_vmm_accessible_locked(const cp_sim_t *sim, uintptr_t addr, size_t size);

/* sim_vmm.c: the page-mapped state of a new device (CP_ERR_HOST_OOM, nothing to undo), all of
 * it freed by destroy (host mappings, files, tables), and the entries of the operation table. */
int cp_sim_vmm_init(cp_sim_t *sim);
void cp_sim_vmm_destroy(cp_sim_t *sim);
void cp_sim_vmm_table(cp_sim_t *sim, cp_backend_t *out);
/* sim_copy.c: the entries of Note [Copies for a backup] (base/backend.h). */
void cp_sim_copy_table(cp_sim_t *sim, cp_backend_t *out);

#endif /* CP_SIM_INTERNAL_H */
