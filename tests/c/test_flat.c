/* test_flat.c — a long periodic run stays flat: reserved memory, device calls per iteration and
 * host time per operation do not grow after warm-up, under each policy (the built-in rules,
 * expandable segments, cudapool's default policy: page stitching).
 * Owns: a training-like loop on the simulated device with its asynchrony (streams run up to 16
 * launches behind): weights and optimizer state kept, activations of a sequence length that
 * cycles through 7 buckets made in the forward pass and freed in reverse in the backward pass,
 * gradients made and freed each step, a loader's buffer on a side stream used on the compute
 * stream (record_stream), temporaries freed at once, and every 125 iterations an evaluation
 * pass at twice the longest length. A figure per window of 1,000 iterations is printed; after
 * the first window (warm-up) a window fails when its peak reserved memory is above the second
 * window's, when it makes more device calls per operation than the second (2 % allowed: a
 * window may hold one evaluation more), when it maps or reserves memory the second did not
 * need, or when what the pool walks grows: its segments, free blocks, blocks waiting for
 * events, stitched ranges and streams, at their most in the window, more than a quarter (and
 * 8) above the second window's (a creep: work per operation growing with the run). Host time
 * per operation is printed, not checked: it says as much of the machine as of the pool.
 *
 *   test_flat [--iterations N]     (default 10,000; 2,000 with the checker after every operation) */
#include <inttypes.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/sim.h"
#include "check.h"
#include "core/cp.h"
#include "rand.h"

#define MiB ((size_t)1 << 20)
#define GiB ((size_t)1 << 30)

#ifdef CP_CHECK_EVERY_OP
#define DEFAULT_ITERATIONS 2000
#else
#define DEFAULT_ITERATIONS 10000
#endif
#define WINDOWS    10
#define LAYERS     24
#define ACTS       3 /* activations kept per layer for the backward pass */
#define COMPUTE    ((cp_stream_t)1)
#define LOADER     ((cp_stream_t)2)
#define EVAL_EVERY 125
#define SIM_LAG    16

typedef struct run_s {
  cp_sim_t *sim;
  cp_pool_t *pool;
  uint64_t ops;
  uint64_t rng;
} run_t;

static double cpu_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void *get(run_t *r, size_t size, cp_stream_t stream) {
  void *p = NULL;
  const int rc = cp_alloc(r->pool, size, stream, &p);
  if (rc != CP_OK || cp_sim_queue(r->sim, stream, (uintptr_t)p, size) != CP_OK) {
    fprintf(stderr, "test_flat: cp_alloc(%zu) on stream %lu: %s\n", size, (unsigned long)stream, cp_last_error());
    exit(1); /* the rest of the run would mean nothing */
  }
  r->ops++;
  return p;
}

static void put(run_t *r, void *p) {
  REQUIRE(cp_free(r->pool, p) == CP_OK);
  r->ops++;
}

/* Sizes of the model (bytes): weights per layer, and activations per layer at `tokens` tokens. */
static size_t weight_bytes(int layer) { return (size_t)(4 + (layer % 4) * 3) * MiB + (size_t)layer * 4096; }
static size_t act_bytes(int layer, int k, size_t tokens) {
  return tokens * (size_t)(1024 + 512 * k + (layer % 3) * 256);
}

/* One step: the loader's batch, the forward pass, the backward pass, the optimizer. */
static void step(run_t *r, void **weights, size_t tokens, int train) {
  void *batch = get(r, tokens * 8, LOADER); /* copied in on the loader's stream */
  REQUIRE(cp_record_stream(r->pool, batch, COMPUTE) == CP_OK);
  REQUIRE(cp_sim_queue(r->sim, COMPUTE, (uintptr_t)batch, tokens * 8) == CP_OK);
  void *acts[LAYERS][ACTS];
  for (int l = 0; l < LAYERS; l++) {
    void *tmp = get(r, act_bytes(l, 2, tokens) * 2, COMPUTE); /* a temporary of the layer */
    for (int k = 0; k < ACTS; k++) acts[l][k] = get(r, act_bytes(l, k, tokens), COMPUTE);
    put(r, tmp);
    if (!train)
      for (int k = 0; k < ACTS; k++) put(r, acts[l][k]);
  }
  put(r, batch);
  if (!train) return;
  void *grads[LAYERS];
  for (int l = LAYERS - 1; l >= 0; l--) {
    void *g_in = get(r, act_bytes(l, 0, tokens), COMPUTE);
    grads[l] = get(r, weight_bytes(l), COMPUTE);
    for (int k = ACTS - 1; k >= 0; k--) put(r, acts[l][k]);
    put(r, g_in);
  }
  for (int l = 0; l < LAYERS; l++) { /* the optimizer: a temporary per weight, then the gradient goes */
    void *t = get(r, weight_bytes(l), COMPUTE);
    REQUIRE(cp_sim_queue(r->sim, COMPUTE, (uintptr_t)weights[l], weight_bytes(l)) == CP_OK);
    put(r, t);
    put(r, grads[l]);
  }
}

typedef struct window_s {
  size_t peak_reserved;
  uint64_t calls, memory_calls, ops;
  size_t held; /* the most segments + free and pending blocks + stitched ranges + streams */
  double cpu;
} window_t;

/* What the pool's operations walk or search, in entries. */
static size_t pool_entries(cp_pool_t *pool) {
  cp_pool_info_t in;
  cp_pool_info(pool, &in);
  return in.segments + in.free_blocks + in.pending_blocks + in.stitched_ranges + in.streams;
}

static uint64_t all_calls(cp_sim_t *sim) {
  uint64_t n = 0;
  for (int k = 0; k < CP_SIM_CALL_COUNT; k++) n += cp_sim_calls(sim, (cp_sim_call_t)k);
  return n;
}

static uint64_t memory_calls(cp_sim_t *sim) {
  static const cp_sim_call_t kinds[] = {CP_SIM_RESERVE,     CP_SIM_RELEASE,  CP_SIM_VA_RESERVE, CP_SIM_VA_FREE,
                                        CP_SIM_PAGE_CREATE, CP_SIM_PAGE_MAP, CP_SIM_PAGE_UNMAP};
  uint64_t n = 0;
  for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) n += cp_sim_calls(sim, kinds[k]);
  return n;
}

static long g_iterations = DEFAULT_ITERATIONS;

static void run_policy(const char *name, const char *conf) {
  run_t r;
  memset(&r, 0, sizeof r);
  r.rng = 0x5EEDull;
  REQUIRE(cp_sim_create(16 * GiB, CP_SIM_NO_TOUCH, &r.sim) == CP_OK);
  cp_sim_set_lag(r.sim, SIM_LAG);
  cp_backend_t be;
  cp_sim_backend(r.sim, &be);
  cp_config_t cfg;
  cp_config_default(&cfg);
  REQUIRE(cp_config_parse(&cfg, conf) == CP_OK);
  REQUIRE(cp_pool_create(&cfg, &be, &r.pool) == CP_OK);
  void *weights[LAYERS], *state[LAYERS];
  for (int l = 0; l < LAYERS; l++) {
    weights[l] = get(&r, weight_bytes(l), COMPUTE);
    state[l] = get(&r, 2 * weight_bytes(l), COMPUTE);
  }

  const long per_window = g_iterations / WINDOWS;
  window_t w[WINDOWS];
  memset(w, 0, sizeof w);
  printf("test_flat: %s (%s), %ld iterations, windows of %ld:\n", name, conf[0] ? conf : "defaults", g_iterations,
         per_window);
  printf("  %-8s %14s %14s %12s %14s %12s %12s\n", "window", "peak reserved", "device calls", "per iter",
         "memory calls", "pool entries", "ns/op (cpu)");
  for (int k = 0; k < WINDOWS; k++) {
    cp_pool_reset_peak_stats(r.pool);
    const uint64_t calls0 = all_calls(r.sim), mem0 = memory_calls(r.sim), ops0 = r.ops;
    const double t0 = cpu_s();
    for (long i = 0; i < per_window; i++) {
      const long it = (long)k * per_window + i;
      const size_t tokens = (size_t)(512 + 256 * (it % 7)) * 8; /* 7 sequence-length buckets */
      const int eval = it % EVAL_EVERY == EVAL_EVERY - 1;       /* at twice the longest */
      step(&r, weights, eval ? (size_t)(512 + 256 * 6) * 16 : tokens, !eval);
      /* The host waits for the device now and then (a loss printed, a metric read). */
      if (rng_next(&r.rng) % 8 == 0) cp_sim_complete(r.sim, COMPUTE);
      if (rng_next(&r.rng) % 3 == 0) cp_sim_complete(r.sim, LOADER);
      const size_t held = pool_entries(r.pool);
      if (held > w[k].held) w[k].held = held;
    }
    w[k].cpu = cpu_s() - t0;
    w[k].ops = r.ops - ops0;
    w[k].calls = all_calls(r.sim) - calls0;
    w[k].memory_calls = memory_calls(r.sim) - mem0;
    cp_stats_t st;
    cp_pool_stats(r.pool, &st);
    w[k].peak_reserved = (size_t)st.family[CP_STAT_RESERVED_BYTES][CP_KIND_ALL].peak;
    printf("  %-8d %10.1f MiB %14" PRIu64 " %12.1f %14" PRIu64 " %12zu %12.0f\n", k + 1,
           (double)w[k].peak_reserved / (double)MiB, w[k].calls, (double)w[k].calls / (double)per_window,
           w[k].memory_calls, w[k].held, w[k].cpu * 1e9 / (double)w[k].ops);
  }
  fflush(stdout);
  /* The second window is the reference: the first holds the warm-up. */
  for (int k = 2; k < WINDOWS; k++) {
    if (w[k].peak_reserved > w[1].peak_reserved)
      fprintf(stderr, "test_flat: %s: window %d reserves %zu bytes at its peak, window 2 %zu\n", name, k + 1,
              w[k].peak_reserved, w[1].peak_reserved);
    CHECK(w[k].peak_reserved <= w[1].peak_reserved);
    /* Per iteration: a window holds one evaluation more or less than another (they differ by
     * the calls of one step, well under 2 %). */
    CHECK((double)w[k].calls / (double)w[k].ops <= 1.02 * (double)w[1].calls / (double)w[1].ops);
    CHECK(w[k].memory_calls <= w[1].memory_calls);
    if (w[k].held > w[1].held + w[1].held / 4 + 8)
      fprintf(stderr, "test_flat: %s: window %d holds %zu pool entries at its most, window 2 %zu\n", name, k + 1,
              w[k].held, w[1].held);
    CHECK(w[k].held <= w[1].held + w[1].held / 4 + 8);
  }

  for (int l = 0; l < LAYERS; l++) {
    put(&r, weights[l]);
    put(&r, state[l]);
  }
  cp_sim_complete_all(r.sim);
  CHECK(cp_empty_cache(r.pool) == CP_OK);
  CHECK_EQ_U(cp_pool_check(r.pool, stderr), 0);
  cp_pool_info_t in;
  cp_pool_info(r.pool, &in);
  CHECK_EQ_U(in.allocated, 0);
  CHECK_EQ_U(in.reserved, 0);
  CHECK_EQ_U(cp_sim_print_device_faults(r.sim, stderr), 0);
  cp_pool_destroy(r.pool);
  CHECK_EQ_U(cp_sim_reserved_bytes(r.sim), 0);
  cp_sim_destroy(r.sim);
}

TEST(flat_builtin) { run_policy("built-in rules", ""); }
TEST(flat_expandable) { run_policy("expandable segments", "expandable_segments:True"); }
TEST(flat_stitching) {
  run_policy("cudapool's default policy (page stitching)",
             "expandable_segments:True,page_stitching:True,release_before_grow:True");
}

int main(int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    char *end = NULL;
    const long v = i + 1 < argc ? strtol(argv[i + 1], &end, 10) : 0;
    if (strcmp(argv[i], "--iterations") != 0 || end == NULL || *end != '\0' || v < WINDOWS * 3) {
      fprintf(stderr, "usage: test_flat [--iterations N]   (N >= %d)\n", WINDOWS * 3);
      return 2;
    }
    g_iterations = v;
    i++;
  }
  RUN(flat_builtin);
  RUN(flat_expandable);
  RUN(flat_stitching);
  return check_summary("test_flat");
}
