/* devices.c — the device table: the process-wide pools, one per device, created lazily.
 * Owns: the shared configuration, the choice of backend (CUDA or sim), and pool lifetimes. */
#include "devices/devices.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda.h"
#include "backend/sim.h"
#include "base/fork.h"
#include "core/snapshot.h"

/* Note [Device table]
 * pools[d] is written once, under `lock`, when device d is first used, and read without the
 * lock on every allocation (an acquire load pairs with the release store). The lock also
 * serialises configuration and the sim switch, which are refused once any pool exists, so a
 * pool never sees its configuration change. cpd_shutdown is the only writer that clears
 * entries; it must not race with allocations (interpreter exit, tests). */

static pthread_mutex_t cpd_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic(cp_pool_t *) cpd_pools[CP_MAX_DEVICES];
static cp_sim_t *cpd_sims[CP_MAX_DEVICES];
static cp_config_t cpd_cfg;
static int cpd_cfg_set;
static int cpd_pool_count;
static int cpd_sim_mode;
static size_t cpd_history; /* cpd_set_history's setting */
static size_t cpd_sim_capacity;
static int cpd_sim_count;
static unsigned cpd_sim_flags;
static size_t cpd_event_log_cap = CPD_DEFAULT_EVENT_LOG;
static double cpd_fractions[CP_MAX_DEVICES];           /* set through cpd_set_memory_fraction */
static unsigned char cpd_fraction_set[CP_MAX_DEVICES]; /* 1 where cpd_fractions[d] holds one */
static pthread_once_t cpd_fork_once = PTHREAD_ONCE_INIT;
/* Note [Hooks of the device table] (devices.h): added under the lock; read up to the count, which
 * is published after its slot. */
static const cpd_table_hooks_t *cpd_hooks[CPD_TABLE_HOOKS_MAX];
static atomic_int cpd_hook_count;

static void cpd_register_for_fork(void) { cp_fork_register_outer(&cpd_lock); }

void cpd_fork_register_table(void) { pthread_once(&cpd_fork_once, cpd_register_for_fork); }

/* Every taker of the table lock comes through here, so the lock is known to the fork handlers
 * (Note [Locks across fork]) before anyone can hold it. */
static void cpd_table_lock(void) {
  cpd_fork_register_table();
  pthread_mutex_lock(&cpd_lock);
}

void cpd_table_hooks_add(const cpd_table_hooks_t *hooks) {
  cpd_table_lock();
  const int n = atomic_load_explicit(&cpd_hook_count, memory_order_relaxed);
  if (n == CPD_TABLE_HOOKS_MAX) {
    fprintf(stderr, "cudapool: more than %d sets of device table hooks\n", CPD_TABLE_HOOKS_MAX);
    abort();
  }
  cpd_hooks[n] = hooks;
  atomic_store_explicit(&cpd_hook_count, n + 1, memory_order_release);
  pthread_mutex_unlock(&cpd_lock);
}

static void cpd_config_locked(cp_config_t *out) {
  if (!cpd_cfg_set) {
    cp_config_default(&cpd_cfg);
    cpd_cfg_set = 1;
  }
  *out = cpd_cfg;
}

int cpd_configure(const cp_config_t *cfg) {
  int rc = cp_config_validate(cfg);
  if (rc != CP_OK) return rc;
  cpd_table_lock();
  if (cpd_pool_count > 0) {
    rc = cp_set_error(CP_ERR_STATE,
                      "cudapool: the configuration cannot change once a device pool exists "
                      "(configure before the first CUDA allocation)");
  } else {
    cpd_cfg = *cfg;
    cpd_cfg_set = 1;
  }
  pthread_mutex_unlock(&cpd_lock);
  return rc;
}

void cpd_config(cp_config_t *out_cfg) {
  cpd_table_lock();
  cpd_config_locked(out_cfg);
  pthread_mutex_unlock(&cpd_lock);
}

int cpd_use_sim(size_t capacity, int count, unsigned sim_flags) {
  if (capacity == 0 || count < 1 || count > CP_MAX_DEVICES) {
    return cp_set_error(CP_ERR_INVALID, "cudapool: simulated devices need a capacity > 0 and 1..%d devices",
                        CP_MAX_DEVICES);
  }
  cpd_table_lock();
  int rc = CP_OK;
  if (cpd_pool_count > 0) {
    rc = cp_set_error(CP_ERR_STATE, "cudapool: cannot switch to simulated devices once a device pool exists");
  } else {
    cpd_sim_mode = 1;
    cpd_sim_capacity = capacity;
    cpd_sim_count = count;
    cpd_sim_flags = sim_flags;
  }
  pthread_mutex_unlock(&cpd_lock);
  return rc;
}

int cpd_using_sim(void) {
  cpd_table_lock();
  int on = cpd_sim_mode;
  pthread_mutex_unlock(&cpd_lock);
  return on;
}

cp_sim_t *cpd_sim(int device) {
  if (device < 0 || device >= CP_MAX_DEVICES) return NULL;
  cpd_table_lock();
  cp_sim_t *sim = cpd_sim_mode ? cpd_sims[device] : NULL;
  pthread_mutex_unlock(&cpd_lock);
  return sim;
}

int cpd_device_count(int *out_count) {
  cpd_table_lock();
  int rc = CP_OK;
  if (cpd_sim_mode) {
    *out_count = cpd_sim_count;
  } else {
    rc = cp_cuda_device_count(out_count);
  }
  pthread_mutex_unlock(&cpd_lock);
  return rc;
}

static int cpd_create_locked(int device, cp_pool_t **out_pool) {
  cp_backend_t backend;
  int rc;
  if (cpd_sim_mode) {
    if (device >= cpd_sim_count) {
      return cp_set_error(CP_ERR_INVALID, "cudapool: device %d does not exist (%d simulated devices)", device,
                          cpd_sim_count);
    }
    rc = cp_sim_create(cpd_sim_capacity, cpd_sim_flags, &cpd_sims[device]);
    if (rc != CP_OK) return rc;
    cp_sim_backend(cpd_sims[device], &backend);
    backend.device = device;
  } else {
    rc = cp_cuda_backend(device, &backend);
    if (rc != CP_OK) return rc;
  }
  cp_config_t cfg;
  cpd_config_locked(&cfg);
  rc = cp_pool_create(&cfg, &backend, out_pool);
  if (rc == CP_OK) cpd_observe_pool(*out_pool, device);
  if (rc == CP_OK && cpd_history > 0 && (rc = cp_pool_history_enable(*out_pool, cpd_history)) != CP_OK) {
    cp_pool_destroy(*out_pool);
    *out_pool = NULL;
  }
  if (rc == CP_OK && cpd_event_log_cap != 0 && cp_pool_set_event_log(*out_pool, cpd_event_log_cap) != CP_OK) {
    cp_pool_destroy(*out_pool);
    *out_pool = NULL;
    rc = CP_ERR_HOST_OOM;
  }
  if (rc != CP_OK && cpd_sims[device] != NULL) {
    cp_sim_destroy(cpd_sims[device]);
    cpd_sims[device] = NULL;
  }
  return rc;
}

int cpd_pool(int device, cp_pool_t **out_pool) {
  if (device < 0 || device >= CP_MAX_DEVICES) {
    return cp_set_error(CP_ERR_INVALID, "cudapool: invalid device %d", device);
  }
  cp_pool_t *pool = atomic_load_explicit(&cpd_pools[device], memory_order_acquire);
  if (pool != NULL) {
    *out_pool = pool;
    return CP_OK;
  }
  cpd_table_lock();
  int rc = CP_OK;
  pool = atomic_load_explicit(&cpd_pools[device], memory_order_relaxed);
  if (pool == NULL) {
    rc = cpd_create_locked(device, &pool);
    if (rc == CP_OK) {
      atomic_store_explicit(&cpd_pools[device], pool, memory_order_release);
      cpd_pool_count++;
    }
  }
  pthread_mutex_unlock(&cpd_lock);
  if (rc == CP_OK) *out_pool = pool;
  return rc;
}

cp_pool_t *cpd_pool_if_created(int device) {
  if (device < 0 || device >= CP_MAX_DEVICES) return NULL;
  return atomic_load_explicit(&cpd_pools[device], memory_order_acquire);
}

int cpd_owner(const void *ptr, cp_pool_t **out_pool) {
  for (int d = 0; ptr != NULL && d < CP_MAX_DEVICES; d++) {
    cp_pool_t *pool = cpd_pool_if_created(d);
    if (pool != NULL && cp_pool_lookup(pool, (void *)ptr, NULL)) {
      if (out_pool != NULL) *out_pool = pool;
      return d;
    }
  }
  return -1;
}

int cpd_owner_segment(const void *ptr, int *out_device, void **out_base, size_t *out_size) {
  for (int d = 0; ptr != NULL && d < CP_MAX_DEVICES; d++) {
    cp_pool_t *pool = cpd_pool_if_created(d);
    const int kind = pool != NULL ? cp_pool_base_of(pool, ptr, out_base, out_size) : CP_PTR_FOREIGN;
    if (kind != CP_PTR_FOREIGN) {
      if (out_device != NULL) *out_device = d;
      return kind;
    }
  }
  return CP_PTR_FOREIGN;
}

void cpd_note_memory_fraction(int device, double fraction) {
  if (device < 0 || device >= CP_MAX_DEVICES) return;
  cpd_table_lock();
  cpd_fractions[device] = fraction;
  cpd_fraction_set[device] = 1;
  pthread_mutex_unlock(&cpd_lock);
}

double cpd_memory_fraction(int device) {
  cpd_table_lock();
  double fraction = 1.0;
  if (device >= 0 && device < CP_MAX_DEVICES && cpd_fraction_set[device]) {
    fraction = cpd_fractions[device];
  } else {
    cp_config_t cfg;
    cpd_config_locked(&cfg);
    if (cfg.memory_fraction > 0) fraction = cfg.memory_fraction;
  }
  pthread_mutex_unlock(&cpd_lock);
  return fraction;
}

static _Atomic(cp_segment_observer_t) cpd_segment_observer;

void cpd_observe_pool(cp_pool_t *pool, int device) {
  cp_segment_observer_t fn = atomic_load_explicit(&cpd_segment_observer, memory_order_acquire);
  if (fn != NULL) (void)cp_pool_set_segment_observer(pool, fn, (void *)(intptr_t)device);
}

void cpd_set_segment_observer(cp_segment_observer_t fn) {
  cpd_table_lock();
  atomic_store_explicit(&cpd_segment_observer, fn, memory_order_release);
  for (int d = 0; d < CP_MAX_DEVICES; d++) {
    cp_pool_t *pool = atomic_load_explicit(&cpd_pools[d], memory_order_relaxed);
    if (pool != NULL) (void)cp_pool_set_segment_observer(pool, fn, (void *)(intptr_t)d);
  }
  /* Read under the lock that hooks are added under: a pool made after this call by a file that
   * added its hooks later loads the observer stored above. */
  const int hooks = atomic_load_explicit(&cpd_hook_count, memory_order_relaxed);
  pthread_mutex_unlock(&cpd_lock);
  /* Private pools made before: they get it here (the graph lock is inner to the table's). */
  for (int i = 0; i < hooks; i++) {
    if (cpd_hooks[i]->observe_pools != NULL) cpd_hooks[i]->observe_pools();
  }
}

int cpd_set_history(size_t max_entries) {
  cpd_table_lock();
  int rc = CP_OK;
  for (int d = 0; d < CP_MAX_DEVICES && rc == CP_OK; d++) {
    cp_pool_t *pool = atomic_load_explicit(&cpd_pools[d], memory_order_relaxed);
    if (pool != NULL) rc = cp_pool_history_enable(pool, max_entries);
  }
  cpd_history = rc == CP_OK ? max_entries : 0;
  if (rc != CP_OK) { /* all or nothing: the pools that took it stop too */
    for (int d = 0; d < CP_MAX_DEVICES; d++) {
      cp_pool_t *pool = atomic_load_explicit(&cpd_pools[d], memory_order_relaxed);
      if (pool != NULL) (void)cp_pool_history_enable(pool, 0);
    }
  }
  pthread_mutex_unlock(&cpd_lock);
  return rc;
}

size_t cpd_history_entries(void) {
  cpd_table_lock();
  size_t n = cpd_history;
  pthread_mutex_unlock(&cpd_lock);
  return n;
}

int cpd_set_event_log(size_t capacity) {
  if (capacity > CP_EVENT_LOG_MAX) {
    return cp_set_error(CP_ERR_INVALID, "cudapool: an event log of %zu events is more than the %zu allowed", capacity,
                        CP_EVENT_LOG_MAX);
  }
  cpd_table_lock();
  int rc = CP_OK;
  for (int d = 0; d < CP_MAX_DEVICES && rc == CP_OK; d++) {
    cp_pool_t *pool = atomic_load_explicit(&cpd_pools[d], memory_order_relaxed);
    if (pool != NULL) rc = cp_pool_set_event_log(pool, capacity);
  }
  if (rc == CP_OK) cpd_event_log_cap = capacity;
  pthread_mutex_unlock(&cpd_lock);
  return rc;
}

size_t cpd_event_log(void) {
  cpd_table_lock();
  size_t cap = cpd_event_log_cap;
  pthread_mutex_unlock(&cpd_lock);
  return cap;
}

void cpd_shutdown(void) {
  const int hooks = atomic_load_explicit(&cpd_hook_count, memory_order_acquire);
  for (int i = 0; i < hooks; i++) { /* descriptors kept for receivers of shared blocks */
    if (cpd_hooks[i]->shutdown_first != NULL) cpd_hooks[i]->shutdown_first();
  }
  cpd_table_lock();
  for (int i = 0; i < hooks; i++) { /* private pools first: they use the devices' backends */
    if (cpd_hooks[i]->shutdown_locked != NULL) cpd_hooks[i]->shutdown_locked();
  }
  for (int d = 0; d < CP_MAX_DEVICES; d++) {
    cp_pool_t *pool = atomic_exchange_explicit(&cpd_pools[d], NULL, memory_order_acq_rel);
    if (pool != NULL) cp_pool_destroy(pool);
    if (cpd_sims[d] != NULL) {
      cp_sim_destroy(cpd_sims[d]);
      cpd_sims[d] = NULL;
    }
  }
  memset(cpd_fraction_set, 0, sizeof cpd_fraction_set);
  cpd_pool_count = 0;
  cpd_sim_mode = 0;
  cpd_cfg_set = 0;
  cpd_history = 0;
  cpd_event_log_cap = CPD_DEFAULT_EVENT_LOG;
  pthread_mutex_unlock(&cpd_lock);
}
