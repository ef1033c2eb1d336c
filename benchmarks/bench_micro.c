/* bench_micro.c — micro-benchmark of the pool's hot path: one cp_alloc + cp_free pair.
 *
 * Runs on the simulated device with CP_SIM_NO_TOUCH (no host memory behind reservations), so
 * what is measured is the pool's own bookkeeping: locking, size rounding, best fit in the
 * free index, split and merge, the live map and the statistics.
 *
 * Cases:
 *   pair            one thread, stream 0, the same size allocated and freed again and again.
 *   pair_100k_live  as `pair`, but with 100 000 blocks of mixed sizes live and every 10th of
 *                   them freed again, so that the live map is large and the free index holds
 *                   thousands of holes of various sizes.
 *   pair_4_threads  4 threads on one pool, each on its own stream (1..4); ns per pair is the
 *                   wall time of a batch divided by the pairs of all threads together.
 *
 * Usage:
 *   bench_micro [--case pair|pair_100k_live|pair_4_threads|all] [--json PATH]
 *               [--reps R] [--batch N] [--thread-reps R] [--thread-batch N]
 *               [--size BYTES] [--pairs N]
 *
 * Timing mode (default): R batches of N pairs, each batch timed with CLOCK_MONOTONIC; the
 * table gives median, min and p90 of ns per pair over batches.
 * Batches are short (10 000 pairs, about 1 ms) and many (201), so that most of them fit in
 * one scheduler time slice: on a shared machine the median then reflects the pool rather than
 * the neighbours (with 10 ms batches nearly every batch was preempted). The batches of pair
 * and pair_100k_live alternate, so that drift in the machine's speed affects both alike and
 * their ratio holds. The threaded case uses longer batches (50 000 pairs per thread) so that
 * the threads really run at the same time and contend for the pool.
 *
 * Counting mode (--pairs N): set up the case, run exactly N pairs untimed, check and tear
 * down. Meant for instruction counters (callgrind): the count of a run with --pairs 0 is the
 * setup and teardown alone, so (I(N) - I(0)) / N is the cost of one pair.
 *
 * Every call is checked; any failure, or a pool check that finds a violation after a case,
 * ends the program with a non-zero status. */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/sim.h"
#include "core/cp.h"

/* ------------------------------------------------------------------------------------------
 * Parameters
 * ---------------------------------------------------------------------------------------- */

#define BM_CAPACITY             ((size_t)64 << 30) /* 64 GiB simulated device */
#define BM_DEFAULT_SIZE         ((size_t)4096)     /* bytes per measured allocation */
#define BM_DEFAULT_REPS         201
#define BM_DEFAULT_BATCH        10000L
#define BM_DEFAULT_THREAD_REPS  31
#define BM_DEFAULT_THREAD_BATCH 50000L /* per thread: long enough for the threads to overlap */
#define BM_LIVE_BLOCKS          100000
#define BM_LIVE_HOLE_GAP        10            /* free every 10th live block again */
#define BM_LIVE_MIN             ((size_t)512) /* live block sizes: granule multiples in [min, max] */
#define BM_LIVE_MAX             ((size_t)64 << 10)
#define BM_LIVE_SEED            0x5eed0001u
#define BM_THREADS              4

typedef enum bm_case_e { BM_PAIR = 0, BM_PAIR_LIVE = 1, BM_PAIR_THREADS = 2, BM_CASE_COUNT = 3 } bm_case_t;

static const char *const bm_case_names[BM_CASE_COUNT] = {"pair", "pair_100k_live", "pair_4_threads"};
static const char *const bm_json_keys[BM_CASE_COUNT] = {"pair_ns", "pair_ns_100k_live", "pair_ns_4_threads"};

typedef struct bm_options_s {
  int run_case[BM_CASE_COUNT];
  const char *json_path;
  int reps;
  long batch;
  int thread_reps;
  long thread_batch;
  long pairs; /* >= 0: counting mode */
  size_t size;
} bm_options_t;

/* ------------------------------------------------------------------------------------------
 * Failure handling: any failure ends the program.
 * ---------------------------------------------------------------------------------------- */

static void bm_fail_rc(const char *what, int rc, const char *file, int line) {
  fprintf(stderr, "bench_micro: %s:%d: %s failed: %s (%s)\n", file, line, what, cp_status_name(rc), cp_last_error());
  exit(1);
}

#define BM_CALL(expr)                                                   \
  do {                                                                  \
    int bm_rc_ = (expr);                                                \
    if (bm_rc_ != CP_OK) bm_fail_rc(#expr, bm_rc_, __FILE__, __LINE__); \
  } while (0)

static void bm_die(const char *fmt, const char *arg) {
  fprintf(stderr, "bench_micro: ");
  fprintf(stderr, fmt, arg);
  fputc('\n', stderr);
  exit(1);
}

/* ------------------------------------------------------------------------------------------
 * Helpers
 * ---------------------------------------------------------------------------------------- */

static uint64_t bm_now_ns(void) {
  struct timespec ts;
  if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0) bm_die("clock_gettime failed: %s", strerror(errno));
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* splitmix64: a fixed, portable sequence for the live-block sizes. */
static uint64_t bm_rand(uint64_t *state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static int bm_cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

typedef struct bm_summary_s {
  double median;
  double min;
  double p90;
  double max;
} bm_summary_t;

/* Median, min, p90 (nearest rank) and max of n > 0 samples; `v` is sorted in place. */
static bm_summary_t bm_summarize(double *v, size_t n) {
  qsort(v, n, sizeof *v, bm_cmp_double);
  bm_summary_t s;
  s.min = v[0];
  s.max = v[n - 1];
  s.median = (n % 2) ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  size_t rank = (size_t)((90 * n + 99) / 100); /* ceil(0.9 n), 1-based */
  if (rank < 1) rank = 1;
  s.p90 = v[rank - 1];
  return s;
}

/* ------------------------------------------------------------------------------------------
 * The device and the pool of one case
 * ---------------------------------------------------------------------------------------- */

typedef struct bm_env_s {
  cp_sim_t *sim;
  cp_pool_t *pool;
} bm_env_t;

/* --config: a configuration on top of the defaults (the built-in allocator's rules). */
static const char *bm_config = NULL;

static void bm_env_open(bm_env_t *env) {
  cp_config_t cfg;
  cp_backend_t backend;
  cp_config_default(&cfg);
  if (bm_config != NULL) BM_CALL(cp_config_parse(&cfg, bm_config));
  BM_CALL(cp_sim_create(BM_CAPACITY, CP_SIM_NO_TOUCH, &env->sim));
  cp_sim_backend(env->sim, &backend);
  BM_CALL(cp_pool_create(&cfg, &backend, &env->pool));
}

/* The pool must be healthy after every case. */
static void bm_env_close(bm_env_t *env, const char *case_name) {
  size_t violations = cp_pool_check(env->pool, stderr);
  if (violations != 0) {
    fprintf(stderr, "bench_micro: %s: cp_pool_check found %zu violation(s)\n", case_name, violations);
    exit(1);
  }
  cp_pool_destroy(env->pool);
  cp_sim_destroy(env->sim);
  env->pool = NULL;
  env->sim = NULL;
}

/* n pairs of alloc + free of `size` bytes on `stream`. */
static void bm_pairs(cp_pool_t *pool, size_t size, cp_stream_t stream, long n) {
  for (long i = 0; i < n; i++) {
    void *p = NULL;
    BM_CALL(cp_alloc(pool, size, stream, &p));
    if (p == NULL) bm_die("cp_alloc returned NULL for a non-zero size%s", "");
    BM_CALL(cp_free(pool, p));
  }
}

/* ------------------------------------------------------------------------------------------
 * Live blocks for pair_100k_live
 * ---------------------------------------------------------------------------------------- */

typedef struct bm_live_s {
  void **ptrs;
  size_t count; /* allocated at setup */
  size_t holes; /* freed again at setup */
  size_t live;  /* count - holes */
  size_t live_bytes;
  size_t hole_bytes;
} bm_live_t;

static void bm_live_setup(cp_pool_t *pool, bm_live_t *lv) {
  memset(lv, 0, sizeof *lv);
  lv->count = BM_LIVE_BLOCKS;
  lv->ptrs = calloc(lv->count, sizeof *lv->ptrs);
  if (lv->ptrs == NULL) bm_die("no host memory for %s", "the live-block table");
  uint64_t seed = BM_LIVE_SEED;
  const size_t granules = BM_LIVE_MAX / BM_LIVE_MIN; /* sizes 512 * [1, 128] */
  size_t *sizes = malloc(lv->count * sizeof *sizes);
  if (sizes == NULL) bm_die("no host memory for %s", "the live-block sizes");
  for (size_t i = 0; i < lv->count; i++) {
    sizes[i] = BM_LIVE_MIN * (1 + (size_t)(bm_rand(&seed) % granules));
    BM_CALL(cp_alloc(pool, sizes[i], 0, &lv->ptrs[i]));
    lv->live_bytes += sizes[i];
  }
  for (size_t i = 0; i < lv->count; i += BM_LIVE_HOLE_GAP) {
    BM_CALL(cp_free(pool, lv->ptrs[i]));
    lv->ptrs[i] = NULL;
    lv->holes++;
    lv->hole_bytes += sizes[i];
    lv->live_bytes -= sizes[i];
  }
  lv->live = lv->count - lv->holes;
  free(sizes);
}

static void bm_live_teardown(cp_pool_t *pool, bm_live_t *lv) {
  for (size_t i = 0; i < lv->count; i++) {
    if (lv->ptrs[i] != NULL) BM_CALL(cp_free(pool, lv->ptrs[i]));
  }
  free(lv->ptrs);
  lv->ptrs = NULL;
}

/* ------------------------------------------------------------------------------------------
 * Threads for pair_4_threads
 * ---------------------------------------------------------------------------------------- */

typedef struct bm_thread_s {
  pthread_t tid;
  cp_pool_t *pool;
  cp_stream_t stream;
  size_t size;
  int reps;   /* timing mode: batches; counting mode: 0 */
  long batch; /* pairs per batch, or the pairs of counting mode */
  pthread_barrier_t *start;
  pthread_barrier_t *end;
  double *ns_per_pair; /* [reps]: this thread's own time per pair in each batch */
  uint64_t *t_start;   /* [reps]: when this thread began each batch */
  uint64_t *t_end;     /* [reps]: when it finished it */
} bm_thread_t;

static void bm_barrier_wait(pthread_barrier_t *b) {
  int rc = pthread_barrier_wait(b);
  if (rc != 0 && rc != PTHREAD_BARRIER_SERIAL_THREAD) bm_die("pthread_barrier_wait failed: %s", strerror(rc));
}

static void *bm_thread_main(void *arg) {
  bm_thread_t *t = arg;
  bm_pairs(t->pool, t->size, t->stream, 1); /* warm: the stream's first segment */
  if (t->reps == 0) {                       /* counting mode */
    bm_pairs(t->pool, t->size, t->stream, t->batch);
    return NULL;
  }
  for (int r = 0; r < t->reps; r++) {
    bm_barrier_wait(t->start);
    uint64_t t0 = bm_now_ns();
    bm_pairs(t->pool, t->size, t->stream, t->batch);
    uint64_t t1 = bm_now_ns();
    t->ns_per_pair[r] = (double)(t1 - t0) / (double)t->batch;
    t->t_start[r] = t0;
    t->t_end[r] = t1;
    bm_barrier_wait(t->end);
  }
  return NULL;
}

/* ------------------------------------------------------------------------------------------
 * Results
 * ---------------------------------------------------------------------------------------- */

typedef struct bm_result_s {
  int ran;
  bm_summary_t s;
  double *samples; /* ns per pair of each batch, sorted */
  int reps;
  long batch; /* pairs per batch (all threads together for the threaded case) */
  /* pair_100k_live */
  bm_live_t live;
  cp_pool_info_t info; /* the pool just before the measured loop */
  /* pair_4_threads */
  bm_summary_t thread_s[BM_THREADS]; /* each thread's own ns per pair */
  double seconds;                    /* wall time of the measured batches */
} bm_result_t;

/* ------------------------------------------------------------------------------------------
 * The cases
 * ---------------------------------------------------------------------------------------- */

/* The two single-thread cases share one shape: a pool, optional live blocks, then pairs of
 * one size on stream 0. When both run, their batches alternate (pair, live, pair, live, ...)
 * so that a machine whose speed drifts (frequency, neighbours) slows both alike and their
 * ratio stays meaningful. */
typedef struct bm_single_s {
  bm_case_t which;
  bm_env_t env;
  bm_result_t *res;
} bm_single_t;

static void bm_single_open(bm_single_t *c, bm_case_t which, const bm_options_t *o, bm_result_t *res) {
  c->which = which;
  c->res = res;
  bm_env_open(&c->env);
  if (which == BM_PAIR_LIVE) bm_live_setup(c->env.pool, &res->live);
  bm_pairs(c->env.pool, o->size, 0, 1); /* warm: a segment for this size exists from here on */
  if (o->pairs < 0) {
    res->samples = calloc((size_t)o->reps, sizeof *res->samples);
    if (res->samples == NULL) bm_die("no host memory for %s", "samples");
  }
  cp_pool_info(c->env.pool, &res->info);
}

static void bm_single_close(bm_single_t *c, const bm_options_t *o) {
  bm_result_t *res = c->res;
  const char *name = bm_case_names[c->which];
  if (o->pairs < 0) {
    res->s = bm_summarize(res->samples, (size_t)o->reps);
    res->reps = o->reps;
    res->batch = o->batch;
    res->ran = 1;
  }
  if (c->which == BM_PAIR_LIVE) {
    /* Check with the live blocks still in place (the interesting state), then free them. */
    size_t violations = cp_pool_check(c->env.pool, stderr);
    if (violations != 0) {
      fprintf(stderr, "bench_micro: %s: cp_pool_check found %zu violation(s)\n", name, violations);
      exit(1);
    }
    bm_live_teardown(c->env.pool, &res->live);
  }
  bm_env_close(&c->env, name);
}

/* Run the selected single-thread cases (pair, pair_100k_live). */
static void bm_cases_single(const bm_options_t *o, bm_result_t *res) {
  bm_single_t cases[2];
  int n = 0;
  if (o->run_case[BM_PAIR]) bm_single_open(&cases[n++], BM_PAIR, o, &res[BM_PAIR]);
  if (o->run_case[BM_PAIR_LIVE]) bm_single_open(&cases[n++], BM_PAIR_LIVE, o, &res[BM_PAIR_LIVE]);
  if (o->pairs >= 0) {
    for (int i = 0; i < n; i++) bm_pairs(cases[i].env.pool, o->size, 0, o->pairs);
  } else {
    for (int r = 0; r < o->reps; r++) {
      for (int i = 0; i < n; i++) {
        bm_result_t *cr = cases[i].res;
        uint64_t t0 = bm_now_ns();
        bm_pairs(cases[i].env.pool, o->size, 0, o->batch);
        uint64_t t1 = bm_now_ns();
        cr->samples[r] = (double)(t1 - t0) / (double)o->batch;
        cr->seconds += (double)(t1 - t0) * 1e-9;
      }
    }
  }
  for (int i = 0; i < n; i++) bm_single_close(&cases[i], o);
}

static void bm_case_pair_threads(const bm_options_t *o, bm_result_t *res) {
  bm_env_t env;
  bm_env_open(&env);
  bm_thread_t th[BM_THREADS];
  pthread_barrier_t start, end;
  const int timing = o->pairs < 0;
  int rc;
  if (timing) {
    if ((rc = pthread_barrier_init(&start, NULL, BM_THREADS + 1)) != 0 ||
        (rc = pthread_barrier_init(&end, NULL, BM_THREADS + 1)) != 0) {
      bm_die("pthread_barrier_init failed: %s", strerror(rc));
    }
    res->samples = calloc((size_t)o->thread_reps, sizeof *res->samples);
    if (res->samples == NULL) bm_die("no host memory for %s", "samples");
  }
  for (int i = 0; i < BM_THREADS; i++) {
    bm_thread_t *t = &th[i];
    memset(t, 0, sizeof *t);
    t->pool = env.pool;
    t->stream = (cp_stream_t)(i + 1);
    t->size = o->size;
    if (timing) {
      t->reps = o->thread_reps;
      t->batch = o->thread_batch;
      t->start = &start;
      t->end = &end;
      t->ns_per_pair = calloc((size_t)t->reps, sizeof *t->ns_per_pair);
      t->t_start = calloc((size_t)t->reps, sizeof *t->t_start);
      t->t_end = calloc((size_t)t->reps, sizeof *t->t_end);
      if (t->ns_per_pair == NULL || t->t_start == NULL || t->t_end == NULL) {
        bm_die("no host memory for %s", "samples");
      }
    } else { /* counting mode: o->pairs in all, spread over the threads */
      t->reps = 0;
      t->batch = o->pairs / BM_THREADS + (i < o->pairs % BM_THREADS ? 1 : 0);
    }
    if ((rc = pthread_create(&t->tid, NULL, bm_thread_main, t)) != 0) {
      bm_die("pthread_create failed: %s", strerror(rc));
    }
  }
  if (timing) {
    for (int r = 0; r < o->thread_reps; r++) {
      bm_barrier_wait(&start);
      bm_barrier_wait(&end);
    }
  }
  for (int i = 0; i < BM_THREADS; i++) {
    if ((rc = pthread_join(th[i].tid, NULL)) != 0) bm_die("pthread_join failed: %s", strerror(rc));
  }
  if (timing) {
    /* Wall time of a batch: first start to last end over the threads, from the threads' own
     * clock readings (the coordinating thread may be scheduled late on a busy machine). */
    for (int r = 0; r < o->thread_reps; r++) {
      uint64_t t0 = th[0].t_start[r], t1 = th[0].t_end[r];
      for (int i = 1; i < BM_THREADS; i++) {
        if (th[i].t_start[r] < t0) t0 = th[i].t_start[r];
        if (th[i].t_end[r] > t1) t1 = th[i].t_end[r];
      }
      res->samples[r] = (double)(t1 - t0) / ((double)o->thread_batch * BM_THREADS);
      res->seconds += (double)(t1 - t0) * 1e-9;
    }
    pthread_barrier_destroy(&start);
    pthread_barrier_destroy(&end);
    res->s = bm_summarize(res->samples, (size_t)o->thread_reps);
    for (int i = 0; i < BM_THREADS; i++) {
      res->thread_s[i] = bm_summarize(th[i].ns_per_pair, (size_t)o->thread_reps);
      free(th[i].ns_per_pair);
      free(th[i].t_start);
      free(th[i].t_end);
    }
    res->reps = o->thread_reps;
    res->batch = o->thread_batch * BM_THREADS;
    res->ran = 1;
  }
  cp_pool_info(env.pool, &res->info);
  bm_env_close(&env, "pair_4_threads");
}

/* ------------------------------------------------------------------------------------------
 * Output
 * ---------------------------------------------------------------------------------------- */

static void bm_print_table(const bm_result_t *res) {
  printf("%-16s | %15s | %8s | %8s\n", "case", "median ns/pair", "min", "p90");
  printf("-----------------+-----------------+----------+---------\n");
  for (int c = 0; c < BM_CASE_COUNT; c++) {
    if (!res[c].ran) continue;
    printf("%-16s | %15.1f | %8.1f | %8.1f\n", bm_case_names[c], res[c].s.median, res[c].s.min, res[c].s.p90);
  }
  const bm_result_t *t = &res[BM_PAIR_THREADS];
  if (t->ran) {
    printf("\npair_4_threads, each thread's own time per pair (median over batches):\n");
    for (int i = 0; i < BM_THREADS; i++) {
      printf("  thread %d (stream %d): %8.1f ns/pair  (%.2f M pairs/s)\n", i, i + 1, t->thread_s[i].median,
             t->thread_s[i].median > 0 ? 1e3 / t->thread_s[i].median : 0.0);
    }
    printf("  all threads together: %.2f M pairs/s\n", t->s.median > 0 ? 1e3 / t->s.median : 0.0);
  }
  const bm_result_t *l = &res[BM_PAIR_LIVE];
  if (l->ran) {
    printf(
        "\npair_100k_live: %zu blocks allocated, %zu freed again; %zu live blocks, %zu free blocks "
        "in the index, %zu segments\n",
        l->live.count, l->live.holes, l->info.live_blocks, l->info.free_blocks, l->info.segments);
  }
}

static void bm_json_summary(FILE *f, const bm_summary_t *s) {
  fprintf(f, "{\"median\": %.3f, \"min\": %.3f, \"p90\": %.3f, \"max\": %.3f}", s->median, s->min, s->p90, s->max);
}

static void bm_write_json(const char *path, const bm_options_t *o, const bm_result_t *res) {
  FILE *f = fopen(path, "w");
  if (f == NULL) bm_die("cannot open the JSON output: %s", path);
  fprintf(f, "{\n");
  for (int c = 0; c < BM_CASE_COUNT; c++) {
    if (res[c].ran) fprintf(f, "  \"%s\": %.3f,\n", bm_json_keys[c], res[c].s.median);
  }
  fprintf(f, "  \"unit\": \"ns per alloc+free pair (median over batches)\",\n");
  fprintf(f, "  \"size_bytes\": %zu,\n", o->size);
  fprintf(f, "  \"details\": {");
  const char *sep = "\n";
  for (int c = 0; c < BM_CASE_COUNT; c++) {
    const bm_result_t *r = &res[c];
    if (!r->ran) continue;
    fprintf(f, "%s    \"%s\": {\"ns_per_pair\": ", sep, bm_case_names[c]);
    bm_json_summary(f, &r->s);
    fprintf(f, ", \"reps\": %d, \"pairs_per_batch\": %ld, \"seconds\": %.3f", r->reps, r->batch, r->seconds);
    if (c == BM_PAIR_LIVE) {
      fprintf(f,
              ", \"setup_blocks\": %zu, \"holes\": %zu, \"live_blocks\": %zu, \"free_blocks\": %zu, "
              "\"segments\": %zu, \"live_bytes\": %zu, \"hole_bytes\": %zu",
              r->live.count, r->live.holes, r->info.live_blocks, r->info.free_blocks, r->info.segments,
              r->live.live_bytes, r->live.hole_bytes);
    }
    if (c == BM_PAIR_THREADS) {
      fprintf(f, ", \"threads\": %d, \"per_thread_ns_per_pair\": [", BM_THREADS);
      for (int i = 0; i < BM_THREADS; i++) {
        fprintf(f, "%s", i ? ", " : "");
        bm_json_summary(f, &r->thread_s[i]);
      }
      fprintf(f, "]");
    }
    fprintf(f, ", \"samples\": [");
    for (int k = 0; k < r->reps; k++) fprintf(f, "%s%.3f", k ? ", " : "", r->samples[k]);
    fprintf(f, "]}");
    sep = ",\n";
  }
  fprintf(f, "\n  }\n}\n");
  if (ferror(f) || fclose(f) != 0) bm_die("failed to write the JSON output: %s", path);
}

/* ------------------------------------------------------------------------------------------
 * Command line
 * ---------------------------------------------------------------------------------------- */

static void bm_usage(FILE *f) {
  fprintf(f,
          "usage: bench_micro [--case pair|pair_100k_live|pair_4_threads|all] [--json PATH]\n"
          "                   [--reps R] [--batch N] [--thread-reps R] [--thread-batch N]\n"
          "                   [--size BYTES] [--pairs N] [--config TEXT]\n"
          "  --reps R          timed batches of the single-thread cases (default %d)\n"
          "  --batch N         alloc+free pairs per batch (default %ld)\n"
          "  --thread-reps R   timed batches of pair_4_threads (default %d)\n"
          "  --thread-batch N  pairs per batch and thread in pair_4_threads (default %ld)\n"
          "  --size B          bytes per measured allocation (default %zu)\n"
          "  --pairs N         counting mode: exactly N pairs after setup (spread over the\n"
          "                    threads in pair_4_threads), untimed, no table\n"
          "  --config TEXT     the pool's configuration on top of the defaults (key:value,...)\n",
          BM_DEFAULT_REPS, BM_DEFAULT_BATCH, BM_DEFAULT_THREAD_REPS, BM_DEFAULT_THREAD_BATCH, BM_DEFAULT_SIZE);
}

static long bm_parse_long(const char *opt, const char *text, long min) {
  char *end = NULL;
  errno = 0;
  long v = strtol(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || v < min) {
    fprintf(stderr, "bench_micro: bad value for %s: '%s'\n", opt, text);
    bm_usage(stderr);
    exit(2);
  }
  return v;
}

static void bm_parse_args(int argc, char **argv, bm_options_t *o) {
  memset(o, 0, sizeof *o);
  o->reps = BM_DEFAULT_REPS;
  o->batch = BM_DEFAULT_BATCH;
  o->thread_reps = BM_DEFAULT_THREAD_REPS;
  o->thread_batch = BM_DEFAULT_THREAD_BATCH;
  o->pairs = -1;
  o->size = BM_DEFAULT_SIZE;
  const char *which = "all";
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
      bm_usage(stdout);
      exit(0);
    }
    if (i + 1 >= argc) {
      fprintf(stderr, "bench_micro: %s: missing value or unknown option\n", a);
      bm_usage(stderr);
      exit(2);
    }
    const char *v = argv[++i];
    if (strcmp(a, "--case") == 0)
      which = v;
    else if (strcmp(a, "--json") == 0)
      o->json_path = v;
    else if (strcmp(a, "--reps") == 0)
      o->reps = (int)bm_parse_long(a, v, 1);
    else if (strcmp(a, "--batch") == 0)
      o->batch = bm_parse_long(a, v, 1);
    else if (strcmp(a, "--thread-reps") == 0)
      o->thread_reps = (int)bm_parse_long(a, v, 1);
    else if (strcmp(a, "--thread-batch") == 0)
      o->thread_batch = bm_parse_long(a, v, 1);
    else if (strcmp(a, "--size") == 0)
      o->size = (size_t)bm_parse_long(a, v, 1);
    else if (strcmp(a, "--pairs") == 0)
      o->pairs = bm_parse_long(a, v, 0);
    else if (strcmp(a, "--config") == 0)
      bm_config = v;
    else {
      fprintf(stderr, "bench_micro: unknown option %s\n", a);
      bm_usage(stderr);
      exit(2);
    }
  }
  if (o->reps > 100000) o->reps = 100000;
  if (o->thread_reps > 100000) o->thread_reps = 100000;
  int found = 0;
  for (int c = 0; c < BM_CASE_COUNT; c++) {
    if (strcmp(which, "all") == 0 || strcmp(which, bm_case_names[c]) == 0) {
      o->run_case[c] = 1;
      found = 1;
    }
  }
  if (!found) {
    fprintf(stderr, "bench_micro: unknown case '%s'\n", which);
    bm_usage(stderr);
    exit(2);
  }
}

int main(int argc, char **argv) {
  bm_options_t o;
  bm_parse_args(argc, argv, &o);
  static bm_result_t res[BM_CASE_COUNT];
  if (o.run_case[BM_PAIR] || o.run_case[BM_PAIR_LIVE]) bm_cases_single(&o, res);
  if (o.run_case[BM_PAIR_THREADS]) bm_case_pair_threads(&o, &res[BM_PAIR_THREADS]);
  if (o.pairs >= 0) {
    printf("bench_micro: %ld pairs done\n", o.pairs);
    return 0;
  }
  bm_print_table(res);
  if (o.json_path != NULL) bm_write_json(o.json_path, &o, res);
  for (int c = 0; c < BM_CASE_COUNT; c++) free(res[c].samples);
  return 0;
}
