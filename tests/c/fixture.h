/* fixture.h — a pool on a simulated device, for the C tests.
 * fx_open makes one (configuration text on the defaults); fx_close checks the pool is whole
 * and that destroying it gives every byte, event and page-mapped range, page and mapping back
 * to the device. Include after check.h. */
#ifndef CP_TEST_FIXTURE_H
#define CP_TEST_FIXTURE_H

#include <stdio.h>
#include <string.h>

#include "backend/sim.h"
#include "check.h"
#include "core/cp.h"

#define KiB ((size_t)1024)
#define MiB ((size_t)1024 * 1024)
#define GiB ((size_t)1024 * 1024 * 1024)

typedef struct fixture_s {
  cp_sim_t *sim;
  cp_backend_t backend;
  cp_pool_t *pool;
} fixture_t;

/* A fresh simulated device and its operation table; NULL when it cannot be made. */
static inline cp_sim_t *make_sim(size_t capacity, unsigned flags, cp_backend_t *be) {
  cp_sim_t *sim = NULL;
  if (cp_sim_create(capacity, flags, &sim) != CP_OK) return NULL;
  cp_sim_backend(sim, be);
  return sim;
}

static inline int contains(const char *haystack, const char *needle) { return strstr(haystack, needle) != NULL; }

/* sim_flags: CP_SIM_* (0: events complete only when the test says so). */
static inline int fx_open_sim(fixture_t *fx, size_t capacity, unsigned sim_flags, const char *conf) {
  cp_config_t cfg;
  cp_config_default(&cfg);
  if (cp_config_parse(&cfg, conf) != CP_OK) return -1;
  if (cp_sim_create(capacity, sim_flags, &fx->sim) != CP_OK) return -1;
  cp_sim_backend(fx->sim, &fx->backend);
  if (cp_pool_create(&cfg, &fx->backend, &fx->pool) != CP_OK) return -1;
  return 0;
}

static inline int fx_open(fixture_t *fx, size_t capacity, const char *conf) {
  return fx_open_sim(fx, capacity, 0, conf);
}

/* No device fault so far (Note [Simulated asynchrony] in backend/sim.h); they are printed. */
static inline void fx_no_faults(cp_sim_t *sim) { CHECK_EQ_U(cp_sim_print_device_faults(sim, stderr), 0); }

static inline void fx_close(fixture_t *fx) {
  CHECK_EQ_U(cp_pool_check(fx->pool, stderr), 0);
  fx_no_faults(fx->sim);
  /* Destroying a pool unmaps everything at once: its caller waits for the device first. */
  cp_sim_complete_all(fx->sim);
  cp_pool_destroy(fx->pool);
  fx_no_faults(fx->sim);
  CHECK_EQ_U(cp_sim_reserved_bytes(fx->sim), 0);
  CHECK_EQ_U(cp_sim_live_reservations(fx->sim), 0);
  CHECK_EQ_U(cp_sim_live_events(fx->sim), 0);
  CHECK_EQ_U(cp_sim_vmm_ranges(fx->sim), 0);
  CHECK_EQ_U(cp_sim_vmm_pages(fx->sim), 0);
  CHECK_EQ_U(cp_sim_vmm_mappings(fx->sim), 0);
  cp_sim_destroy(fx->sim);
}

static inline cp_stats_t stats_of(fixture_t *fx) {
  cp_stats_t s;
  cp_pool_stats(fx->pool, &s);
  return s;
}

static inline cp_pool_info_t info_of(fixture_t *fx) {
  cp_pool_info_t i;
  cp_pool_info(fx->pool, &i);
  return i;
}

static inline size_t reserved_of(fixture_t *fx) {
  return (size_t)stats_of(fx).family[CP_STAT_RESERVED_BYTES][CP_KIND_ALL].current;
}

/* A pattern over `n` bytes (one byte per 4 KiB and the last), and whether it is still there:
 * for memory that must keep its bytes while the pool maps and unmaps around it. */
static inline void fill(void *p, size_t n, unsigned char seed) {
  unsigned char *c = p;
  for (size_t i = 0; i < n; i += 4096) c[i] = (unsigned char)(seed + i / 4096);
  c[n - 1] = seed;
}

static inline int holds(const void *p, size_t n, unsigned char seed) {
  const unsigned char *c = p;
  for (size_t i = 0; i < n; i += 4096)
    if (c[i] != (unsigned char)(seed + i / 4096)) return 0;
  return c[n - 1] == seed;
}

/* An allocation that must succeed (a failure is recorded with the pool's message). */
static inline void *must_alloc(fixture_t *fx, size_t size, cp_stream_t stream) {
  void *p = NULL;
  int rc = cp_alloc(fx->pool, size, stream, &p);
  if (rc != CP_OK) fprintf(stderr, "alloc(%zu) failed: %s\n", size, cp_last_error());
  CHECK(rc == CP_OK);
  CHECK(p != NULL);
  /* Handing memory to this stream while another stream's queued work touches it is a fault. */
  if (p != NULL && size > 0) CHECK_EQ_U(cp_sim_check_handoff(fx->sim, stream, (uintptr_t)p, size), 0);
  return p;
}

/* empty_cache once the device has run everything queued so far: the memory it gives back is
 * what a first empty_cache retires and a later call unmaps on a GPU (Note [Stream-ordered
 * release] in core/drain.c). */
static inline int empty_cache_idle(fixture_t *fx) {
  cp_sim_complete_all(fx->sim);
  return cp_empty_cache(fx->pool);
}

/* Work queued on `stream` over the live allocation [p, p + n). */
static inline void launch(fixture_t *fx, cp_stream_t stream, const void *p, size_t n) {
  CHECK(cp_sim_launch(fx->sim, stream, (uintptr_t)p, n) == CP_OK);
}

#endif /* CP_TEST_FIXTURE_H */
