/* test_bad_input.c — every bad input the C API takes: each call must fail with a clear status
 * and message, or do nothing, as the README's "Bad input" table says; never crash, hang, wrap
 * a size into a small allocation, or leave the pool broken. Each test names its table row. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/sim.h"
#include "check.h"
#include "core/cp.h"
#include "fixture.h"

static int same_stats(fixture_t *fx, const cp_stats_t *before) {
  cp_stats_t now = stats_of(fx);
  return memcmp(&now, before, sizeof now) == 0;
}

static int has(const char *needle) {
  if (strstr(cp_last_error(), needle) != NULL) return 1;
  fprintf(stderr, "  message \"%s\" lacks \"%s\"\n", cp_last_error(), needle);
  return 0;
}

/* ---- sizes ------------------------------------------------------------------------------ */

TEST(row_size_zero_alloc_gives_null_without_a_device_call) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 64 * MiB, NULL) == 0);
  void *p = (void *)1;
  CHECK(cp_alloc(fx.pool, 0, 7, &p) == CP_OK);
  CHECK(p == NULL);
  CHECK_EQ_U(cp_sim_calls(fx.sim, CP_SIM_RESERVE), 0);
  CHECK_EQ_U(stats_of(&fx).family[CP_STAT_ALLOCATION][CP_KIND_ALL].allocated, 0);
  CHECK(cp_free(fx.pool, p) == CP_OK); /* what size 0 gave back frees as a no-op */
  fx_close(&fx);
}

/* Rounding near SIZE_MAX gives 0 ("too large") or a value >= the size that is a multiple of
 * the granule: never a wrapped, small one. */
TEST(row_huge_sizes_round_size_never_wraps) {
  static const char *const confs[] = {
      NULL,
      "roundup_power2_divisions:4",
      "roundup_power2_divisions:[1:16,64:8,>:2]",
      "granule_bytes:4096",
      "granule_bytes:4096,roundup_power2_divisions:32",
  };
  for (size_t c = 0; c < sizeof confs / sizeof *confs; c++) {
    cp_config_t cfg;
    cp_config_default(&cfg);
    REQUIRE(cp_config_parse(&cfg, confs[c]) == CP_OK);
    for (unsigned shift = 20; shift < 64; shift++) {
      const size_t p2 = (size_t)1 << shift;
      const size_t around[] = {p2 - 1, p2, p2 + 1, p2 + p2 / 3, SIZE_MAX - p2 + 1, SIZE_MAX - p2};
      for (size_t k = 0; k < sizeof around / sizeof *around; k++) {
        size_t size = around[k];
        size_t r = cp_round_size(&cfg, size);
        if (r != 0 && (r < size || r % cfg.granule != 0)) {
          fprintf(stderr, "  conf %s: round(%zu) = %zu\n", confs[c] ? confs[c] : "(defaults)", size, r);
          CHECK(0);
        }
      }
    }
    const size_t edge[] = {SIZE_MAX, SIZE_MAX - 1, SIZE_MAX - 510, SIZE_MAX - cfg.granule + 2};
    for (size_t k = 0; k < sizeof edge / sizeof *edge; k++) CHECK_EQ_U(cp_round_size(&cfg, edge[k]), 0);
    /* The largest multiple of the granule stays itself, or is "too large" where divisions
     * would round it further up. */
    size_t top = cp_round_size(&cfg, SIZE_MAX - cfg.granule + 1);
    CHECK(top == 0 || top == SIZE_MAX - cfg.granule + 1);
  }
}

/* SIZE_MAX, SIZE_MAX - 511, a size whose segment rounding reaches SIZE_MAX, 2^63, and just
 * above the device: CP_ERR_OOM with the report, *out_ptr untouched, nothing kept. */
TEST(row_huge_sizes_alloc_is_oom_and_changes_nothing) {
  static const char *const confs[] = {NULL, "release_before_grow:True", "roundup_power2_divisions:8",
                                      "garbage_collection_threshold:0.5", "memory_cap_mb:32"};
  for (size_t c = 0; c < sizeof confs / sizeof *confs; c++) {
    fixture_t fx;
    REQUIRE(fx_open(&fx, 64 * MiB, confs[c]) == 0);
    void *keep = must_alloc(&fx, 4 * KiB, 0);
    const size_t sizes[] = {SIZE_MAX,        SIZE_MAX - 511,        SIZE_MAX - 4 * MiB, SIZE_MAX - 20 * MiB,
                            (size_t)1 << 63, ((size_t)1 << 63) + 1, 64 * MiB + 1};
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
      void *p = (void *)1;
      cp_clear_error();
      CHECK(cp_alloc(fx.pool, sizes[i], 0, &p) == CP_ERR_OOM);
      CHECK(p == (void *)1);
      CHECK(has("Tried to allocate"));
      CHECK_EQ_U(cp_pool_check(fx.pool, stderr), 0);
    }
    cp_stats_t s = stats_of(&fx);
    CHECK_EQ_U(s.num_ooms, sizeof sizes / sizeof *sizes);
    CHECK_EQ_U(s.family[CP_STAT_ALLOCATION][CP_KIND_ALL].current, 1);
    CHECK_EQ_U(s.family[CP_STAT_RESERVED_BYTES][CP_KIND_ALL].current, 2 * MiB); /* keep's segment */
    void *q = must_alloc(&fx, 3 * MiB, 0);                                      /* a fitting request still works */
    CHECK(cp_free(fx.pool, q) == CP_OK);
    CHECK(cp_free(fx.pool, keep) == CP_OK);
    fx_close(&fx);
  }
}

/* A refused huge request must not move the high-water mark: release_before_grow keeps
 * giving back cached segments afterwards. (The mark used to take the refused segment's size,
 * near SIZE_MAX or wrapped, which switched the policy off for the rest of the run.) */
TEST(row_huge_sizes_alloc_leaves_release_before_grow_working) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 64 * MiB, "release_before_grow:True") == 0);
  void *p = (void *)1;
  CHECK(cp_alloc(fx.pool, SIZE_MAX - 4 * MiB, 0, &p) == CP_ERR_OOM);
  CHECK(cp_alloc(fx.pool, SIZE_MAX - 20 * MiB, 0, &p) == CP_ERR_OOM);
  void *a = must_alloc(&fx, 30 * MiB, 0); /* high-water mark: 30 MiB */
  CHECK(cp_free(fx.pool, a) == CP_OK);
  void *b = must_alloc(&fx, 12 * MiB, 1); /* 30 + 12 > 30: a's cached segment goes first */
  cp_stats_t s = stats_of(&fx);
  CHECK_EQ_U(s.num_device_free, 1);
  CHECK_EQ_U(s.family[CP_STAT_RESERVED_BYTES][CP_KIND_ALL].current, 12 * MiB);
  CHECK(cp_free(fx.pool, b) == CP_OK);
  fx_close(&fx);
}

/* ---- NULL arguments ---------------------------------------------------------------------- */

TEST(row_null_arguments_are_invalid) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 64 * MiB, NULL) == 0);
  void *p = NULL;
  int local = 0;
  CHECK(cp_alloc(NULL, 100, 0, &p) == CP_ERR_INVALID);
  CHECK(cp_alloc(fx.pool, 100, 0, NULL) == CP_ERR_INVALID);
  CHECK(cp_free(NULL, &local) == CP_ERR_INVALID);
  CHECK(cp_free_sized(NULL, &local, 4) == CP_ERR_INVALID);
  CHECK(cp_record_stream(NULL, &local, 1) == CP_ERR_INVALID);
  CHECK(cp_empty_cache(NULL) == CP_ERR_INVALID);
  CHECK(cp_pool_set_memory_cap(NULL, 1) == CP_ERR_INVALID);
  CHECK(cp_pool_set_memory_fraction(NULL, 0.5) == CP_ERR_INVALID);
  CHECK(cp_config_parse(NULL, "memory_cap_mb:1") == CP_ERR_INVALID);
  CHECK(cp_pool_lookup(NULL, &local, NULL) == 0);
  CHECK(cp_pool_create(NULL, &fx.backend, &fx.pool) == CP_ERR_INVALID);
  CHECK_EQ_U(cp_sim_calls(fx.sim, CP_SIM_RESERVE), 0);
  fx_close(&fx);
}

/* ---- pointers ----------------------------------------------------------------------------- */

TEST(row_free_null_is_a_noop) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 64 * MiB, NULL) == 0);
  cp_stats_t before = stats_of(&fx);
  CHECK(cp_free(fx.pool, NULL) == CP_OK);
  CHECK(cp_free_sized(fx.pool, NULL, 12345) == CP_OK);
  CHECK(cp_free(NULL, NULL) == CP_OK);
  CHECK(same_stats(&fx, &before));
  fx_close(&fx);
}

TEST(row_free_unknown_pointer_is_invalid_and_changes_nothing) {
  fixture_t fx, other;
  REQUIRE(fx_open(&fx, 64 * MiB, NULL) == 0);
  REQUIRE(fx_open(&other, 64 * MiB, NULL) == 0);
  void *p = must_alloc(&fx, 4096, 0);
  void *foreign = must_alloc(&other, 4096, 0);
  int local = 0;
  cp_stats_t before = stats_of(&fx);
  void *bad[] = {&local, foreign, (void *)(uintptr_t)1, (void *)UINTPTR_MAX};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    cp_clear_error();
    CHECK(cp_free(fx.pool, bad[i]) == CP_ERR_INVALID);
    CHECK(has("was not allocated by this pool, or was already freed"));
  }
  CHECK(same_stats(&fx, &before));
  CHECK(cp_pool_lookup(fx.pool, foreign, NULL) == 0);
  CHECK(cp_free(other.pool, foreign) == CP_OK); /* its own pool still frees it */
  CHECK(cp_free(fx.pool, p) == CP_OK);
  fx_close(&other);
  fx_close(&fx);
}

TEST(row_free_twice_is_invalid_and_changes_nothing) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 64 * MiB, NULL) == 0);
  void *p = must_alloc(&fx, 4096, 0);
  void *keep = must_alloc(&fx, 4096, 0);
  CHECK(cp_free(fx.pool, p) == CP_OK);
  cp_stats_t before = stats_of(&fx);
  cp_clear_error();
  CHECK(cp_free(fx.pool, p) == CP_ERR_INVALID);
  CHECK(has("or was already freed"));
  CHECK(cp_free_sized(fx.pool, p, 4096) == CP_ERR_INVALID);
  CHECK(same_stats(&fx, &before));
  void *again = must_alloc(&fx, 4096, 0); /* the block comes back once, not twice */
  void *next = must_alloc(&fx, 4096, 0);
  CHECK(again == p);
  CHECK(next != p && next != keep);
  CHECK(cp_free(fx.pool, again) == CP_OK);
  CHECK(cp_free(fx.pool, next) == CP_OK);
  CHECK(cp_free(fx.pool, keep) == CP_OK);
  fx_close(&fx);
}

TEST(row_free_interior_pointer_is_invalid_and_changes_nothing) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 64 * MiB, NULL) == 0);
  char *p = must_alloc(&fx, 8192, 0);
  cp_stats_t before = stats_of(&fx);
  const size_t offsets[] = {1, 511, 512, 4096, 8191, 8192};
  for (size_t i = 0; i < sizeof offsets / sizeof *offsets; i++) {
    CHECK(cp_free(fx.pool, p + offsets[i]) == CP_ERR_INVALID);
    CHECK(cp_record_stream(fx.pool, p + offsets[i], 3) == CP_ERR_INVALID);
  }
  CHECK(same_stats(&fx, &before));
  CHECK(cp_free(fx.pool, p) == CP_OK);
  fx_close(&fx);
}

/* The size given back must be the size asked for: anything else is refused and the block
 * stays allocated (Note [Frees that do not match] in devices.c says why). */
TEST(row_free_size_mismatch_is_refused_and_the_block_stays) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 64 * MiB, NULL) == 0);
  void *p = must_alloc(&fx, 1000, 0); /* a 1024-byte block */
  size_t asked = 0;
  CHECK(cp_pool_lookup(fx.pool, p, &asked) == 1);
  CHECK_EQ_U(asked, 1000);
  cp_stats_t before = stats_of(&fx);
  const size_t wrong[] = {0, 999, 1001, 1024, SIZE_MAX};
  for (size_t i = 0; i < sizeof wrong / sizeof *wrong; i++) {
    cp_clear_error();
    CHECK(cp_free_sized(fx.pool, p, wrong[i]) == CP_ERR_INVALID);
    CHECK(has("was allocated with 1000 bytes, not"));
    CHECK(has("the block stays allocated"));
    CHECK(cp_pool_lookup(fx.pool, p, NULL) == 1);
  }
  CHECK(same_stats(&fx, &before));
  CHECK(cp_free_sized(fx.pool, p, 1000) == CP_OK);
  CHECK(cp_pool_lookup(fx.pool, p, NULL) == 0);
  fx_close(&fx);
}

TEST(row_record_stream_unknown_freed_or_null_pointer_is_invalid) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 64 * MiB, NULL) == 0);
  void *p = must_alloc(&fx, 4096, 0);
  int local = 0;
  cp_stats_t before = stats_of(&fx);
  cp_clear_error();
  CHECK(cp_record_stream(fx.pool, &local, 3) == CP_ERR_INVALID);
  CHECK(has("is not a live allocation of this pool"));
  CHECK(cp_record_stream(fx.pool, NULL, 3) == CP_ERR_INVALID);
  CHECK(same_stats(&fx, &before));
  CHECK(cp_free(fx.pool, p) == CP_OK);
  CHECK(cp_record_stream(fx.pool, p, 3) == CP_ERR_INVALID); /* after its free */
  CHECK(cp_record_stream(fx.pool, p, 0) == CP_ERR_INVALID);
  fx_close(&fx);
}

/* ---- invalid streams ----------------------------------------------------------------------- */

enum { S_GOOD = 2, S_BAD = 5, S_BAD_ALLOC = 9, S_LATE = 11 };

/* The simulated device's invalid stream behaves as a destroyed CUDA stream does. */
TEST(row_invalid_stream_sim_refuses_records) {
  cp_backend_t be;
  cp_sim_t *sim = NULL;
  REQUIRE(cp_sim_create(64 * MiB, 0, &sim) == CP_OK);
  cp_sim_backend(sim, &be);
  cp_event_t ev = 0;
  REQUIRE(be.event_create(be.ctx, &ev) == CP_OK);
  CHECK(cp_sim_invalidate_stream(sim, S_BAD) == CP_OK);
  CHECK(cp_sim_invalidate_stream(NULL, S_BAD) == CP_ERR_INVALID);
  cp_clear_error();
  CHECK(be.event_record(be.ctx, ev, S_BAD) == CP_ERR_BACKEND);
  CHECK(has("invalid resource handle"));
  CHECK(be.event_record(be.ctx, ev, S_GOOD) == CP_OK); /* other streams are unaffected */
  CHECK(be.event_destroy(be.ctx, ev) == CP_OK);
  cp_sim_destroy(sim);
}

/* No device call is made for the allocation stream, so an invalid one does not show:
 * allocating and freeing on it work, and its cache serves it as any other stream's. */
TEST(row_invalid_stream_alloc_and_plain_free_work) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 64 * MiB, NULL) == 0);
  REQUIRE(cp_sim_invalidate_stream(fx.sim, S_BAD_ALLOC) == CP_OK);
  void *p = must_alloc(&fx, 1000, S_BAD_ALLOC);
  CHECK(cp_free(fx.pool, p) == CP_OK);
  void *q = must_alloc(&fx, 1000, S_BAD_ALLOC);
  CHECK(q == p);
  CHECK(cp_record_stream(fx.pool, q, S_GOOD) == CP_OK);
  launch(&fx, S_GOOD, q, 1); /* events go on S_GOOD only */
  CHECK(cp_free(fx.pool, q) == CP_OK);
  CHECK(cp_empty_cache(fx.pool) == CP_OK);
  fx_close(&fx);
}

/* record_stream on an invalid stream succeeds (no device call); the free that must record an
 * event there fails with the device's error, undoes the events it recorded on other streams,
 * and leaves the block allocated; the pool stays whole and destroying it returns everything. */
TEST(row_invalid_stream_free_after_record_stream_is_refused_and_nothing_leaks) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 64 * MiB, NULL) == 0);
  void *p = must_alloc(&fx, 1000, 0);
  CHECK(cp_record_stream(fx.pool, p, S_GOOD) == CP_OK);
  launch(&fx, S_GOOD, p, 1);
  CHECK(cp_sim_invalidate_stream(fx.sim, S_BAD) == CP_OK);
  CHECK(cp_record_stream(fx.pool, p, S_BAD) == CP_OK);
  launch(&fx, S_BAD, p, 1);
  cp_stats_t before = stats_of(&fx);
  size_t events = 0;
  for (int attempt = 0; attempt < 3; attempt++) {
    cp_clear_error();
    CHECK(cp_free(fx.pool, p) == CP_ERR_BACKEND);
    CHECK(has("invalid resource handle"));
    CHECK(has("the block stays allocated"));
    CHECK_EQ_U(cp_pool_check(fx.pool, stderr), 0);
    CHECK(same_stats(&fx, &before));
    cp_pool_info_t info;
    cp_pool_info(fx.pool, &info);
    CHECK_EQ_U(info.live_blocks, 1);
    CHECK_EQ_U(info.pending_blocks, 0);
    CHECK(cp_pool_lookup(fx.pool, p, NULL) == 1);
    /* The events taken for the attempt went back to the pool's spares: no more each time. */
    if (attempt == 0) events = cp_sim_live_events(fx.sim);
    CHECK(events <= 2);
    CHECK_EQ_U(cp_sim_live_events(fx.sim), events);
  }
  cp_clear_error();
  CHECK(cp_free_sized(fx.pool, p, 1000) == CP_ERR_BACKEND);
  CHECK(has("invalid resource handle"));
  /* The pool keeps working around the stuck block. */
  void *q = must_alloc(&fx, 1000, 0);
  CHECK(q != p);
  CHECK(cp_free(fx.pool, q) == CP_OK);
  CHECK(cp_empty_cache(fx.pool) == CP_OK);
  fx_close(&fx); /* the stuck block goes back to the device with the pool */
}

/* A stream that goes bad after a free recorded its event there: the event still completes,
 * and the block comes back. */
TEST(row_invalid_stream_after_free_pending_block_still_returns) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 64 * MiB, NULL) == 0);
  void *p = must_alloc(&fx, 1000, 0);
  CHECK(cp_record_stream(fx.pool, p, S_LATE) == CP_OK);
  launch(&fx, S_LATE, p, 1);
  CHECK(cp_free(fx.pool, p) == CP_OK);
  CHECK(cp_sim_invalidate_stream(fx.sim, S_LATE) == CP_OK);
  cp_sim_complete(fx.sim, S_LATE);
  void *q = must_alloc(&fx, 1000, 0);
  CHECK(q == p);
  CHECK(cp_free(fx.pool, q) == CP_OK);
  fx_close(&fx);
}

/* ---- limits ------------------------------------------------------------------------------ */

TEST(row_memory_cap_below_reserved_only_stops_growth) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 64 * MiB, NULL) == 0);
  void *a = must_alloc(&fx, 30 * MiB, 0);
  CHECK(cp_pool_set_memory_cap(fx.pool, 1) == CP_OK);
  CHECK_EQ_U(cp_sim_reserved_bytes(fx.sim), 30 * MiB); /* nothing released */
  void *p = NULL;
  CHECK(cp_alloc(fx.pool, 4096, 0, &p) == CP_ERR_OOM);
  CHECK(has("Memory cap: 1 bytes"));
  CHECK(cp_free(fx.pool, a) == CP_OK);
  void *b = must_alloc(&fx, 20 * MiB, 0); /* the cached segment still serves */
  CHECK(b == a);
  CHECK(cp_free(fx.pool, b) == CP_OK);
  CHECK(cp_pool_set_memory_cap(fx.pool, SIZE_MAX) == CP_OK); /* as good as none */
  void *c = must_alloc(&fx, 40 * MiB, 1);
  CHECK(cp_free(fx.pool, c) == CP_OK);
  fx_close(&fx);
}

TEST(row_memory_fraction_out_of_range_is_invalid_and_keeps_the_cap) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 64 * MiB, NULL) == 0);
  CHECK(cp_pool_set_memory_fraction(fx.pool, 0.5) == CP_OK);
  const double bad[] = {NAN, -NAN, INFINITY, -INFINITY, -0.1, 1.0000001, 2.0, -1e-300};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    cp_clear_error();
    CHECK(cp_pool_set_memory_fraction(fx.pool, bad[i]) == CP_ERR_INVALID);
    CHECK(has("is outside [0, 1]"));
  }
  cp_pool_info_t info;
  cp_pool_info(fx.pool, &info);
  CHECK_EQ_U(info.memory_cap, 32 * MiB);
  CHECK(cp_pool_set_memory_fraction(fx.pool, -0.0) == CP_OK); /* zero: unset */
  cp_pool_info(fx.pool, &info);
  CHECK_EQ_U(info.memory_cap, 0);
  fx_close(&fx);
}

/* A fraction worth less than one byte caps at one byte: every growth is refused. (It used to
 * give a cap of 0 bytes, which means "no cap".) */
TEST(row_memory_fraction_tiny_caps_everything) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 64 * MiB, NULL) == 0);
  CHECK(cp_pool_set_memory_fraction(fx.pool, 1e-300) == CP_OK);
  cp_pool_info_t info;
  cp_pool_info(fx.pool, &info);
  CHECK_EQ_U(info.memory_cap, 1);
  void *p = NULL;
  CHECK(cp_alloc(fx.pool, 512, 0, &p) == CP_ERR_OOM);
  CHECK_EQ_U(cp_sim_calls(fx.sim, CP_SIM_RESERVE), 0);
  fx_close(&fx);

  REQUIRE(fx_open(&fx, 64 * MiB, "memory_fraction:1e-300") == 0); /* the same from the config */
  cp_pool_info(fx.pool, &info);
  CHECK_EQ_U(info.memory_cap, 1);
  CHECK(cp_alloc(fx.pool, 512, 0, &p) == CP_ERR_OOM);
  fx_close(&fx);
}

TEST(row_memory_fraction_with_unknown_device_total_is_a_backend_error) {
  cp_sim_t *sim = NULL;
  cp_backend_t be;
  cp_pool_t *pool = NULL;
  cp_config_t cfg;
  cp_config_default(&cfg);
  REQUIRE(cp_sim_create(64 * MiB, 0, &sim) == CP_OK);
  cp_sim_backend(sim, &be);
  cp_sim_fail_nth(sim, CP_SIM_MEM_INFO, 1, CP_ERR_BACKEND); /* at creation */
  REQUIRE(cp_pool_create(&cfg, &be, &pool) == CP_OK);
  cp_sim_fail_nth(sim, CP_SIM_MEM_INFO, 1, CP_ERR_BACKEND); /* and when the fraction is set */
  cp_clear_error();
  CHECK(cp_pool_set_memory_fraction(pool, 0.5) == CP_ERR_BACKEND);
  CHECK(has("the device's total memory is unknown"));
  void *p = NULL;
  CHECK(cp_alloc(pool, 4096, 0, &p) == CP_OK); /* no cap was set */
  CHECK(cp_free(pool, p) == CP_OK);
  CHECK_EQ_U(cp_pool_check(pool, stderr), 0);
  cp_pool_destroy(pool);
  cp_sim_destroy(sim);
}

/* ---- configuration ------------------------------------------------------------------------ */

/* Each bad string is refused with CP_ERR_INVALID, names what is wrong, and applies nothing. */
TEST(row_config_malformed_is_invalid_and_applies_nothing) {
  static const struct {
    const char *text;
    const char *want;
  } bad[] = {
      {"no_such_key:1", "unknown key 'no_such_key' (known: "},
      {"max_split_size_mb:abc", "bad value 'abc' for max_split_size_mb"},
      {"memory_cap_mb:-1", "a size must not be negative"},
      {"memory_fraction:-0.5", "not a negative number"},
      {"memory_fraction:nan", "bad value 'nan' for memory_fraction"},
      {"memory_fraction:inf", "bad value 'inf' for memory_fraction"},
      {"garbage_collection_threshold:1e999", "out of range"},
      {"memory_cap_mb:1,,max_split_size_mb:64", "empty entry"},
      {",memory_cap_mb:1", "empty entry"},
      {"memory_cap_mb:1,", "empty entry"},
      {"memory_cap_mb:", "empty value for memory_cap_mb"},
      {":1", "has no key"},
      {"memory_cap_mb", "is not key:value"},
      {"memory_cap_mb:1,memory_cap_mb:1", "duplicate key 'memory_cap_mb'"},
      {"memory_cap_mb:99999999999999999999999", "overflows size_t"},
      {"granule_bytes:18446744073709551616", "overflows size_t"},
      {"roundup_power2_divisions:4294967296", "power of two"},
      {"memory_cap_mb:1x", "bad value '1x' for memory_cap_mb"},
      {"memory_cap_mb:1 junk", "bad value '1 junk' for memory_cap_mb"},
      {"release_before_grow:yes", "expected True or False"},
      {"memory_cap_mb:1;max_split_size_mb:64", "bad value '1;max_split_size_mb:64'"},
  };
  cp_config_t start;
  cp_config_default(&start);
  REQUIRE(cp_config_parse(&start, "max_split_size_mb:64,memory_cap_mb:512") == CP_OK);
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    cp_config_t cfg = start;
    cp_clear_error();
    int rc = cp_config_parse(&cfg, bad[i].text);
    if (rc != CP_ERR_INVALID) fprintf(stderr, "  parse(\"%s\") gave %s\n", bad[i].text, cp_status_name(rc));
    CHECK(rc == CP_ERR_INVALID);
    CHECK(has(bad[i].want));
    CHECK(has("CUDAPOOL_CONF: "));
    CHECK(memcmp(&cfg, &start, sizeof cfg) == 0);
  }
  /* Empty and blank text are no-ops. */
  cp_config_t cfg = start;
  CHECK(cp_config_parse(&cfg, "") == CP_OK);
  CHECK(cp_config_parse(&cfg, " \t ") == CP_OK);
  CHECK(cp_config_parse(&cfg, NULL) == CP_OK);
  CHECK(memcmp(&cfg, &start, sizeof cfg) == 0);
}

int main(void) {
  RUN(row_size_zero_alloc_gives_null_without_a_device_call);
  RUN(row_huge_sizes_round_size_never_wraps);
  RUN(row_huge_sizes_alloc_is_oom_and_changes_nothing);
  RUN(row_huge_sizes_alloc_leaves_release_before_grow_working);
  RUN(row_null_arguments_are_invalid);
  RUN(row_free_null_is_a_noop);
  RUN(row_free_unknown_pointer_is_invalid_and_changes_nothing);
  RUN(row_free_twice_is_invalid_and_changes_nothing);
  RUN(row_free_interior_pointer_is_invalid_and_changes_nothing);
  RUN(row_free_size_mismatch_is_refused_and_the_block_stays);
  RUN(row_record_stream_unknown_freed_or_null_pointer_is_invalid);
  RUN(row_invalid_stream_sim_refuses_records);
  RUN(row_invalid_stream_alloc_and_plain_free_work);
  RUN(row_invalid_stream_free_after_record_stream_is_refused_and_nothing_leaks);
  RUN(row_invalid_stream_after_free_pending_block_still_returns);
  RUN(row_memory_cap_below_reserved_only_stops_growth);
  RUN(row_memory_fraction_out_of_range_is_invalid_and_keeps_the_cap);
  RUN(row_memory_fraction_tiny_caps_everything);
  RUN(row_memory_fraction_with_unknown_device_total_is_a_backend_error);
  RUN(row_config_malformed_is_invalid_and_applies_nothing);
  return check_summary("test_bad_input");
}
