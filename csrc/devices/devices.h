/* devices.h — the device table: the process-wide pools, one per device, created lazily.
 * Owns: which backend serves a device, the shared configuration, pool lifetimes. */
#ifndef CP_DEVICES_H
#define CP_DEVICES_H

#include <stddef.h>
#include <stdint.h>

#include "core/cp.h"
#include "core/snapshot.h"

/* The configuration every pool created from now on gets. CP_ERR_STATE once a pool exists
 * (a pool's size classes cannot change under live blocks). */
int cpd_configure(const cp_config_t *cfg);
void cpd_config(cp_config_t *out_cfg);

/* Serve devices from simulated devices of `capacity` bytes each instead of the CUDA driver
 * (`count` devices). For tests and for exploring without a GPU. CP_ERR_STATE once a pool
 * exists. */
int cpd_use_sim(size_t capacity, int count, unsigned sim_flags);
int cpd_using_sim(void);
/* The simulated device behind `device` (sim mode only), NULL otherwise. */
struct cp_sim_s *cpd_sim(int device);

/* The pool of `device`, created on first use. */
int cpd_pool(int device, cp_pool_t **out_pool);
/* The pool of `device` when it exists, else NULL (never creates one). */
cp_pool_t *cpd_pool_if_created(int device);
int cpd_device_count(int *out_count);

/* Note [Pointer owners]
 * Which device pool holds a pointer is asked in two ways, each answered here only: a free,
 * record_stream, share or device_of takes a live allocation's first byte (cp_pool_lookup);
 * base_alloc and the test for memory cudapool does not own take any address, inside a live
 * allocation or only inside a segment (cp_pool_base_of). A pointer is in at most one pool's
 * segments. These look at the device pools only (which live until cpd_shutdown, so the pool
 * handed back stays valid); the private pools of graphs.h, which may go at any free, are
 * asked under the graph lock there (cpd_graph_device_of, cpd_graph_base_of).
 * cpd_owner: the device whose pool holds `ptr` as a live allocation, with that pool in
 * *out_pool (unless NULL); -1 when none does (NULL included). */
int cpd_owner(const void *ptr, cp_pool_t **out_pool);
/* Where `ptr` lies among the device pools: the CP_PTR_* of the pool whose segments hold it
 * (cp_pool_base_of, with *out_base and *out_size), its device in *out_device (each unless
 * NULL); CP_PTR_FOREIGN when none does. */
int cpd_owner_segment(const void *ptr, int *out_device, void **out_base, size_t *out_size);

/* The memory fraction of `device` as torch's get_per_process_memory_fraction reports it: the
 * last one cpd_set_memory_fraction set (0 included), else the configuration's memory_fraction,
 * else 1.0 (no fraction). cpd_note_memory_fraction records a fraction that was set. */
double cpd_memory_fraction(int device);
void cpd_note_memory_fraction(int device, double fraction);

/* Record the history of every device pool, now and created later, in a ring of `max_entries`
 * records (0: off); cp_pool_history_enable's rules. cpd_history_entries: the setting. */
int cpd_set_history(size_t max_entries);
size_t cpd_history_entries(void);
/* Events each device pool keeps in its event log (cp_pool_set_event_log): the history an
 * out-of-memory failure is replayed from under other configurations. Applies to the pools that
 * exist (their events so far are dropped) and to those created later (cpd_shutdown restores
 * the default); 0 keeps none. The first
 * error (CP_ERR_INVALID above CP_EVENT_LOG_MAX, CP_ERR_HOST_OOM) leaves the setting as it was, and the
 * pools before the failing one with the new log. */
#define CPD_DEFAULT_EVENT_LOG ((size_t)16384)
int cpd_set_event_log(size_t capacity);
size_t cpd_event_log(void);
/* The segment observer of every device pool, now and created later, private pools included
 * (Note [Segment observer] in core/snapshot.h); its ctx is the device ordinal, as (void *)(intptr_t).
 * NULL removes it. cpd_observe_pool gives a new pool of `device` the current one. */
void cpd_set_segment_observer(cp_segment_observer_t fn);
void cpd_observe_pool(cp_pool_t *pool, int device);

/* Note [Hooks of the device table]
 * The table is the floor of csrc/devices: graphs.c and ipc.c call it (for a device's pool, the
 * configuration, the segment observer), so it calls neither of them by name, or the files would
 * call each other in a circle. What it must still do to what they own (give a new segment
 * observer to the private pools; at shutdown close the descriptors kept for IPC receivers, then
 * destroy the private pools, which use the devices' backends, before the devices' own pools) it
 * does through hooks that each of them adds once, at its first use: before its first private
 * pool or kept descriptor exists, so nothing they own escapes the hooks. Hooks are never
 * removed (cpd_shutdown keeps them: a file with nothing left to tear down does nothing). Any
 * member may be NULL; hooks of one kind run in the order they were added. */
typedef struct cpd_table_hooks_s {
  void (*shutdown_first)(void);  /* cpd_shutdown, before it takes the table lock */
  void (*shutdown_locked)(void); /* cpd_shutdown, under the table lock, before the pools go */
  void (*observe_pools)(void);   /* cpd_set_segment_observer, after the table's pools: cpd_observe_pool on each */
} cpd_table_hooks_t;
/* Add `hooks` (which must outlive the process: a static). Takes the table lock: call it with no
 * lock of csrc/devices held. At most CPD_TABLE_HOOKS_MAX sets; one more aborts. */
#define CPD_TABLE_HOOKS_MAX 4
void cpd_table_hooks_add(const cpd_table_hooks_t *hooks);

/* Register the table's lock with the fork handlers (Note [Locks across fork]) unless it is
 * already; it takes no lock. Locks nested inside the table's register after calling this. */
void cpd_fork_register_table(void);

/* Destroy every pool and backend: all memory goes back to the device. Later calls create
 * fresh pools. Used at interpreter exit and by tests. */
void cpd_shutdown(void);

#endif /* CP_DEVICES_H */
