/* test_devices.c — the torch ABI layer: the device table and the entry points torch calls.
 * Owns: several simulated devices behind one table, the entry points against them, threads
 * on several devices at once, and shutdown (everything back, fresh pools afterwards). Runs
 * under ASan+UBSan (with the invariant check after every pool operation) and under TSan. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "backend/sim.h"
#include "check.h"
#include "core/cp.h"
#include "devices/abi.h"
#include "devices/devices.h"

#define MiB      ((size_t)1 << 20)
#define CAPACITY (64 * MiB)
#define DEVICES  3

/* Bytes in live blocks (which = 0) or reserved (which = 1) on `device`; 0 without a pool. */
static size_t usage_on(int device, int which) {
  cp_pool_t *pool = cpd_pool_if_created(device);
  size_t bytes[2] = {0, 0};
  if (pool != NULL) cp_pool_usage(pool, &bytes[0], &bytes[1]);
  return bytes[which];
}
#define allocated_on(device) usage_on((device), 0)
#define reserved_on(device)  usage_on((device), 1)

/* Every pool healthy and holding no live block, no device fault on any simulated device
 * (Note [Simulated asynchrony] in backend/sim.h); then, once each device has run what is
 * queued on it (destroying a pool unmaps at once), everything goes back. */
static void check_clean_and_shut_down(void) {
  for (int d = 0; d < CP_MAX_DEVICES; d++) {
    cp_pool_t *pool = cpd_pool_if_created(d);
    if (pool == NULL) continue;
    CHECK_EQ_U(cp_pool_check(pool, stderr), 0);
    CHECK_EQ_U(allocated_on(d), 0);
    cp_sim_t *sim = cpd_sim(d);
    if (sim == NULL) continue;
    CHECK_EQ_U(cp_sim_print_device_faults(sim, stderr), 0);
    cp_sim_complete_all(sim);
  }
  cpd_shutdown();
  for (int d = 0; d < CP_MAX_DEVICES; d++) CHECK(cpd_pool_if_created(d) == NULL);
}

TEST(several_devices) {
  REQUIRE(cpd_use_sim(CAPACITY, DEVICES, 0) == CP_OK);
  CHECK(cpd_using_sim());
  int count = 0;
  CHECK(cpd_device_count(&count) == CP_OK);
  CHECK_EQ_U(count, DEVICES);
  void *p[DEVICES] = {NULL};
  for (int d = 0; d < DEVICES; d++) {
    CHECK(cpd_pool_if_created(d) == NULL); /* pools are created on first use */
    REQUIRE(cpd_alloc((size_t)(d + 1) * MiB, d, NULL, &p[d]) == CP_OK);
    REQUIRE(p[d] != NULL);
    CHECK(cpd_pool_if_created(d) != NULL);
    CHECK(cpd_sim(d) != NULL);
    CHECK_EQ_U(allocated_on(d), (size_t)(d + 1) * MiB);
  }
  for (int d = 0; d < DEVICES; d++) {
    for (int e = 0; e < DEVICES; e++) CHECK(d == e || p[d] != p[e]);
    memset(p[d], 0xa5, (size_t)(d + 1) * MiB); /* simulated memory is real host memory */
  }
  /* Size 0 is NULL without creating anything; devices outside the table are refused. */
  void *q = (void *)1;
  CHECK(cpd_alloc(0, DEVICES + 5, NULL, &q) == CP_OK && q == NULL);
  CHECK(cpd_alloc(MiB, DEVICES, NULL, &q) == CP_ERR_INVALID);
  CHECK(strstr(cp_last_error(), "does not exist") != NULL);
  CHECK(cpd_alloc(MiB, -1, NULL, &q) == CP_ERR_INVALID);
  CHECK(cpd_alloc(MiB, CP_MAX_DEVICES, NULL, &q) == CP_ERR_INVALID);
  for (int d = 0; d < DEVICES; d++) cudapool_free(p[d], (size_t)(d + 1) * MiB, d, NULL);
  for (int d = 0; d < DEVICES; d++) CHECK_EQ_U(allocated_on(d), 0);
  /* empty_cache reaches every device. */
  cudapool_empty_cache();
  for (int d = 0; d < DEVICES; d++) CHECK_EQ_U(reserved_on(d), 0);
  check_clean_and_shut_down();
}

TEST(configuration_fixed_once_a_pool_exists) {
  cp_config_t cfg;
  cp_config_default(&cfg);
  REQUIRE(cp_config_parse(&cfg, "max_split_size_mb:64") == CP_OK);
  REQUIRE(cpd_use_sim(CAPACITY, 2, 0) == CP_OK);
  CHECK(cpd_configure(&cfg) == CP_OK);
  void *p = NULL;
  REQUIRE(cpd_alloc(MiB, 1, NULL, &p) == CP_OK);
  cp_config_t now;
  cp_pool_config(cpd_pool_if_created(1), &now);
  CHECK_EQ_U(now.max_split_size, 64 * MiB);
  CHECK(cpd_configure(&cfg) == CP_ERR_STATE);
  CHECK(cpd_use_sim(CAPACITY, 2, 0) == CP_ERR_STATE);
  cudapool_free(p, MiB, 1, NULL);
  check_clean_and_shut_down();
  /* After shutdown the table starts over: defaults, and the CUDA driver unless told otherwise. */
  CHECK(!cpd_using_sim());
  cpd_config(&now);
  CHECK(now.max_split_size == SIZE_MAX);
}

TEST(frees_that_do_not_match_change_nothing) {
  REQUIRE(cpd_use_sim(CAPACITY, 2, 0) == CP_OK);
  void *p = NULL;
  REQUIRE(cpd_alloc(3 * MiB, 0, NULL, &p) == CP_OK);
  size_t size = 0;
  /* Wrong size, wrong device, a device without a pool: each says so on stderr and leaves the
   * block allocated. Memory no pool holds is ignored, silently, and counted. */
  cudapool_free(p, 2 * MiB, 0, NULL);
  CHECK(cp_pool_lookup(cpd_pool_if_created(0), p, &size) && size == 3 * MiB);
  cudapool_free(p, 3 * MiB, 1, NULL);
  cudapool_free(p, 3 * MiB, CP_MAX_DEVICES + 1, NULL);
  CHECK(cp_pool_lookup(cpd_pool_if_created(0), p, NULL));
  CHECK(cpd_pool_if_created(1) == NULL); /* a failed free creates no pool */
  unsigned long long frees0, records0, frees, records;
  cpd_foreign_calls(&frees0, &records0);
  int local = 0;
  cudapool_free(&local, 4, 0, NULL);
  cudapool_record_stream(&local, (void *)(uintptr_t)7);
  cpd_foreign_calls(&frees, &records);
  CHECK_EQ_U(frees - frees0, 1);
  CHECK_EQ_U(records - records0, 1);
  CHECK_EQ_U(allocated_on(0), 3 * MiB);
  cudapool_free(p, 3 * MiB, 0, NULL);
  CHECK_EQ_U(allocated_on(0), 0);
  check_clean_and_shut_down();
}

TEST(record_stream_through_the_table) {
  REQUIRE(cpd_use_sim(CAPACITY, 2, 0) == CP_OK);
  void *p = NULL, *q = NULL;
  const uintptr_t s1 = 1, s2 = 2;
  REQUIRE(cpd_alloc(MiB, 1, (void *)s1, &p) == CP_OK);
  cp_sim_t *sim = cpd_sim(1);
  REQUIRE(sim != NULL);
  /* Stream 2 uses the block only after its free's event: a stream idle at the free has
   * nothing that could still touch it, so the block is back at once. */
  cudapool_record_stream(p, (void *)s2);
  cudapool_free(p, MiB, 1, (void *)s1);
  REQUIRE(cpd_alloc(MiB, 1, (void *)s1, &q) == CP_OK);
  CHECK(q == p);
  CHECK_EQ_U(cp_sim_check_handoff(sim, s1, (uintptr_t)q, MiB), 0);
  /* Work queued on stream 2 over the block: the free's event waits for it. */
  cudapool_record_stream(p, (void *)s2);
  CHECK(cp_sim_launch(sim, s2, (uintptr_t)p, MiB) == CP_OK);
  cudapool_free(p, MiB, 1, (void *)s1);
  /* The block waits for stream 2: a new request on stream 1 gets other memory. */
  REQUIRE(cpd_alloc(MiB, 1, (void *)s1, &q) == CP_OK);
  CHECK(q != p);
  CHECK_EQ_U(cp_sim_check_handoff(sim, s1, (uintptr_t)q, MiB), 0);
  cudapool_free(q, MiB, 1, (void *)s1);
  cp_pool_info_t info;
  cp_pool_info(cpd_pool_if_created(1), &info);
  CHECK_EQ_U(info.pending_blocks, 1);
  cp_sim_complete(sim, s2);
  REQUIRE(cpd_alloc(MiB, 1, (void *)s1, &q) == CP_OK);
  CHECK(q == p); /* back once stream 2's event completed: the lowest address again */
  CHECK_EQ_U(cp_sim_check_handoff(sim, s1, (uintptr_t)q, MiB), 0);
  cudapool_free(q, MiB, 1, (void *)s1);
  check_clean_and_shut_down();
}

TEST(memory_fraction) {
  REQUIRE(cpd_use_sim(CAPACITY, 2, 0) == CP_OK);
  CHECK(cpd_set_memory_fraction(1.5, 0) == CP_ERR_INVALID);
  CHECK(cpd_pool_if_created(0) == NULL); /* a refused fraction creates nothing */
  cudapool_set_memory_fraction(-1.0, 0); /* reported on stderr */
  CHECK(cpd_pool_if_created(0) == NULL);
  cudapool_set_memory_fraction(0.25, 0);
  REQUIRE(cpd_pool_if_created(0) != NULL);
  void *p = NULL;
  CHECK(cpd_alloc(20 * MiB, 0, NULL, &p) == CP_ERR_OOM); /* 16 MiB allowed */
  char msg[4096];
  cpd_alloc_error_message(CP_ERR_OOM, 20 * MiB, 0, msg, sizeof msg);
  CHECK(strncmp(msg, "CUDA out of memory. Tried to allocate 20.00 MiB", 47) == 0);
  CHECK(cpd_alloc(20 * MiB, 1, NULL, &p) == CP_OK); /* the other device has no cap */
  cudapool_free(p, 20 * MiB, 1, NULL);
  check_clean_and_shut_down();
}

/* ---- threads on several devices ---------------------------------------------------------- */

#define THREADS 4
#define ROUNDS  3000

typedef struct worker_s {
  int index;
  atomic_int *failures;
} worker_t;

static uint64_t next_random(uint64_t *state) {
  *state ^= *state << 13;
  *state ^= *state >> 7;
  *state ^= *state << 17;
  return *state;
}

/* Allocations, frees, record_stream and empty_cache over every device; each block carries a
 * cookie that must survive until it is freed. */
static void *worker_main(void *arg) {
  worker_t *w = arg;
  uint64_t rng = 0x9e3779b97f4a7c15ull * (uint64_t)(w->index + 1);
  enum { LIVE = 16 };
  void *ptr[LIVE] = {NULL};
  size_t size[LIVE] = {0};
  int dev[LIVE] = {0};
  uintptr_t stream[LIVE] = {0};
  for (int round = 0; round < ROUNDS; round++) {
    int slot = (int)(next_random(&rng) % LIVE);
    if (ptr[slot] != NULL) {
      if (*(volatile uint64_t *)ptr[slot] != (uintptr_t)ptr[slot]) atomic_fetch_add(w->failures, 1);
      cudapool_free(ptr[slot], size[slot], dev[slot], (void *)stream[slot]);
      ptr[slot] = NULL;
      continue;
    }
    size[slot] = 512 + (size_t)(next_random(&rng) % (3 * MiB));
    dev[slot] = (int)(next_random(&rng) % DEVICES);
    stream[slot] = (uintptr_t)(next_random(&rng) % 3);
    if (cpd_alloc(size[slot], dev[slot], (void *)stream[slot], &ptr[slot]) != CP_OK) {
      ptr[slot] = NULL; /* out of memory is allowed under this load */
      continue;
    }
    *(volatile uint64_t *)ptr[slot] = (uintptr_t)ptr[slot];
    /* Work on the block, on its stream and on the one it is recorded on: it must be the
     * device's memory (a launch elsewhere is a device fault, checked at shutdown). */
    cp_sim_t *sim = cpd_sim(dev[slot]);
    if (cp_sim_launch(sim, stream[slot], (uintptr_t)ptr[slot], size[slot]) != CP_OK) atomic_fetch_add(w->failures, 1);
    if (next_random(&rng) % 4 == 0) {
      cudapool_record_stream(ptr[slot], (void *)(uintptr_t)(3 + w->index));
      if (cp_sim_launch(sim, 3 + (uintptr_t)w->index, (uintptr_t)ptr[slot], size[slot]) != CP_OK)
        atomic_fetch_add(w->failures, 1);
    }
    if (next_random(&rng) % 256 == 0) cudapool_empty_cache();
  }
  for (int slot = 0; slot < LIVE; slot++) {
    if (ptr[slot] != NULL) cudapool_free(ptr[slot], size[slot], dev[slot], (void *)stream[slot]);
  }
  return NULL;
}

static atomic_int reader_stop;

/* Statistics and reports read while the workers run, as memory_summary() does. */
static void *reader_main(void *arg) {
  (void)arg;
  while (!atomic_load(&reader_stop)) {
    for (int d = 0; d < DEVICES; d++) {
      cp_pool_t *pool = cpd_pool_if_created(d);
      if (pool == NULL) continue;
      cp_stats_t stats;
      cp_pool_stats(pool, &stats);
      char report[2048];
      cp_pool_oom_report(pool, MiB, report, sizeof report);
    }
  }
  return NULL;
}

TEST(threads_on_several_devices) {
  REQUIRE(cpd_use_sim(CAPACITY, DEVICES, CP_SIM_AUTO_COMPLETE) == CP_OK);
  atomic_int failures = 0;
  worker_t workers[THREADS];
  pthread_t threads[THREADS], reader;
  atomic_store(&reader_stop, 0);
  REQUIRE(pthread_create(&reader, NULL, reader_main, NULL) == 0);
  for (int i = 0; i < THREADS; i++) {
    workers[i] = (worker_t){i, &failures};
    REQUIRE(pthread_create(&threads[i], NULL, worker_main, &workers[i]) == 0);
  }
  for (int i = 0; i < THREADS; i++) pthread_join(threads[i], NULL);
  atomic_store(&reader_stop, 1);
  pthread_join(reader, NULL);
  CHECK_EQ_U(atomic_load(&failures), 0);
  for (int d = 0; d < DEVICES; d++) CHECK(cpd_pool_if_created(d) != NULL);
  cudapool_empty_cache();
  for (int d = 0; d < DEVICES; d++) CHECK_EQ_U(reserved_on(d), 0);
  check_clean_and_shut_down();
}

/* Last: the exiting flag is process-wide and never cleared. */
TEST(failures_at_exit_are_counted_not_printed) {
  REQUIRE(cpd_use_sim(CAPACITY, 1, 0) == CP_OK);
  void *p = NULL;
  REQUIRE(cpd_alloc(MiB, 0, NULL, &p) == CP_OK);
  unsigned long before = cpd_failures_at_exit();
  cpd_set_exiting();
  char *inside = (char *)p + 512; /* inside the block: a failure (memory no pool holds is not one) */
  cudapool_free(inside, 4, 0, NULL);
  cudapool_record_stream(inside, NULL);
  CHECK_EQ_U(cpd_failures_at_exit() - before, 2);
  cudapool_free(p, MiB, 0, NULL);
  CHECK_EQ_U(cpd_failures_at_exit() - before, 2);
  check_clean_and_shut_down();
}

int main(void) {
  RUN(several_devices);
  RUN(configuration_fixed_once_a_pool_exists);
  RUN(frees_that_do_not_match_change_nothing);
  RUN(record_stream_through_the_table);
  RUN(memory_fraction);
  RUN(threads_on_several_devices);
  RUN(failures_at_exit_are_counted_not_printed);
  return check_summary("test_devices");
}
