/* test_seed.c — cp_replay_seed_segment: a replay that begins with memory already held. */
#include <string.h>

#include "check.h"
#include "core/seed.h"
#include "fixture.h"

static cp_trace_event_t ev(int action, uint64_t id, uint64_t size, uint64_t stream) {
  cp_trace_event_t e;
  memset(&e, 0, sizeof e);
  e.action = (uint8_t)action;
  e.id = id;
  e.size = size;
  e.stream = stream;
  e.time_ns = -1;
  return e;
}

static cp_stat_t stat_of(fixture_t *fx, cp_stat_family_t fam, int kind) { return stats_of(fx).family[fam][kind]; }

/* The blocks of the pool's only segment, as (state, offset, size). */
static size_t layout(fixture_t *fx, int *state, size_t *offset, size_t *size, size_t max) {
  cp_pool_t *pool = fx->pool;
  if (pool->segments == NULL) return 0;
  size_t n = 0;
  for (cp_block_t *b = pool->segments->head; b != NULL && n < max; b = b->next, n++) {
    state[n] = b->state;
    offset[n] = (size_t)(b->addr - pool->segments->addr);
    size[n] = b->size;
  }
  return n;
}

TEST(exact_size_offsets_and_merged_gaps) {
  fixture_t fx;
  REQUIRE(fx_open_sim(&fx, 4 * GiB, CP_SIM_AUTO_COMPLETE | CP_SIM_NO_TOUCH, "") == 0);
  cp_replay_t *r;
  REQUIRE(cp_replay_create(fx.pool, -1, &r) == CP_OK);
  /* 20 MiB (a large segment's size) + 512: no size the pool would choose. */
  const size_t seg = 20 * MiB + 512;
  cp_seed_block_t blocks[] = {
      {0xA0, 0, 1 * MiB, 1000000},
      {0xA1, 4 * MiB, 3 * MiB, 3 * MiB},
      {0xA2, 7 * MiB, 2 * MiB, 2 * MiB - 100}, /* touches A1: no gap between them */
  };
  REQUIRE(cp_replay_seed_segment(r, 7, CP_KIND_LARGE, seg, blocks, 3) == CP_OK);
  CHECK_EQ_U(cp_pool_check(fx.pool, stderr), 0);
  int state[8];
  size_t off[8], size[8];
  size_t n = layout(&fx, state, off, size, 8);
  REQUIRE(n == 5);
  const int want_state[] = {CP_BLOCK_LIVE, CP_BLOCK_FREE, CP_BLOCK_LIVE, CP_BLOCK_LIVE, CP_BLOCK_FREE};
  const size_t want_off[] = {0, 1 * MiB, 4 * MiB, 7 * MiB, 9 * MiB};
  const size_t want_size[] = {1 * MiB, 3 * MiB, 3 * MiB, 2 * MiB, seg - 9 * MiB};
  for (size_t i = 0; i < n; i++) {
    CHECK_EQ_U(state[i], want_state[i]);
    CHECK_EQ_U(off[i], want_off[i]);
    CHECK_EQ_U(size[i], want_size[i]);
  }
  CHECK_EQ_U(fx.pool->segments->size, seg);
  CHECK_EQ_U(fx.pool->segments->stream->handle, 7);
  CHECK_EQ_U(fx.pool->segments->kind, CP_KIND_LARGE);
  /* Stats as for any segment and live blocks. */
  CHECK_EQ_U(stat_of(&fx, CP_STAT_RESERVED_BYTES, CP_KIND_LARGE).current, seg);
  CHECK_EQ_U(stat_of(&fx, CP_STAT_SEGMENT, CP_KIND_ALL).current, 1);
  CHECK_EQ_U(stat_of(&fx, CP_STAT_ALLOCATION, CP_KIND_LARGE).current, 3);
  CHECK_EQ_U(stat_of(&fx, CP_STAT_ALLOCATED_BYTES, CP_KIND_ALL).current, 6 * MiB);
  CHECK_EQ_U(stat_of(&fx, CP_STAT_REQUESTED_BYTES, CP_KIND_ALL).current, 1000000 + 3 * MiB + 2 * MiB - 100);
  CHECK_EQ_U(stat_of(&fx, CP_STAT_INACTIVE_SPLIT, CP_KIND_ALL).current, 2);
  CHECK_EQ_U(stats_of(&fx).num_device_alloc, 1);
  CHECK_EQ_U(cp_sim_reserved_bytes(fx.sim), seg);
  cp_replay_result_t res;
  cp_replay_result(r, &res);
  CHECK_EQ_U(res.peak_reserved, seg);
  CHECK_EQ_U(res.device_allocs, 1);
  CHECK_EQ_U(res.allocs, 0);

  /* Later events: FREE of a seeded id frees it, and the gaps merge with it. */
  cp_trace_event_t e[] = {ev(CP_TRACE_FREE, 0xA1, 0, 7), ev(CP_TRACE_FREE, 0xA0, 0, 7),
                          ev(CP_TRACE_ALLOC, 0xB0, 3 * MiB, 7)};
  REQUIRE(cp_replay_feed(r, e, 3) == CP_OK);
  cp_replay_result(r, &res);
  CHECK_EQ_U(res.frees, 2);
  CHECK_EQ_U(res.bad_events, 0);
  n = layout(&fx, state, off, size, 8);
  REQUIRE(n == 4); /* [B0 3 MiB live][free 4 MiB][A2 live][free] */
  CHECK_EQ_U(state[0], CP_BLOCK_LIVE);
  CHECK_EQ_U(size[0], 3 * MiB);
  CHECK_EQ_U(state[1], CP_BLOCK_FREE);
  CHECK_EQ_U(size[1], 4 * MiB);
  CHECK_EQ_U(res.peak_reserved, seg); /* served from the seeded segment: no growth */
  CHECK_EQ_U(stats_of(&fx).num_device_alloc, 1);
  CHECK_EQ_U(cp_pool_check(fx.pool, stderr), 0);
  cp_replay_destroy(r); /* frees the seeded A2 and B0 */
  CHECK_EQ_U(stat_of(&fx, CP_STAT_ALLOCATION, CP_KIND_ALL).current, 0);
  fx_close(&fx);
}

TEST(empty_and_small_segments) {
  fixture_t fx;
  REQUIRE(fx_open_sim(&fx, 4 * GiB, CP_SIM_AUTO_COMPLETE | CP_SIM_NO_TOUCH, "") == 0);
  cp_replay_t *r;
  REQUIRE(cp_replay_create(fx.pool, -1, &r) == CP_OK);
  /* A wholly free segment (cached at the start) is one FREE block, reusable at once. */
  REQUIRE(cp_replay_seed_segment(r, 0, CP_KIND_SMALL, 2 * MiB, NULL, 0) == CP_OK);
  cp_seed_block_t tail = {0xC0, 2 * MiB - 512, 512, 1};
  REQUIRE(cp_replay_seed_segment(r, 0, CP_KIND_SMALL, 2 * MiB, &tail, 1) == CP_OK);
  CHECK_EQ_U(stat_of(&fx, CP_STAT_RESERVED_BYTES, CP_KIND_SMALL).current, 4 * MiB);
  CHECK_EQ_U(cp_pool_check(fx.pool, stderr), 0);
  cp_trace_event_t e = ev(CP_TRACE_ALLOC, 0xD0, 1000, 0);
  REQUIRE(cp_replay_feed(r, &e, 1) == CP_OK);
  CHECK_EQ_U(stats_of(&fx).num_device_alloc, 2); /* no third segment */
  e = ev(CP_TRACE_FREE, 0xC0, 0, 0);
  REQUIRE(cp_replay_feed(r, &e, 1) == CP_OK);
  CHECK_EQ_U(cp_pool_check(fx.pool, stderr), 0);
  /* empty_cache gives back the segment that is wholly free again. */
  REQUIRE(cp_empty_cache(fx.pool) == CP_OK);
  CHECK_EQ_U(stat_of(&fx, CP_STAT_RESERVED_BYTES, CP_KIND_ALL).current, 2 * MiB);
  cp_replay_destroy(r);
  fx_close(&fx);
}

TEST(bad_layouts_are_refused_and_change_nothing) {
  fixture_t fx;
  REQUIRE(fx_open_sim(&fx, 64 * MiB, CP_SIM_AUTO_COMPLETE | CP_SIM_NO_TOUCH, "") == 0);
  cp_replay_t *r;
  REQUIRE(cp_replay_create(fx.pool, -1, &r) == CP_OK);
  cp_seed_block_t live = {0x1, 0, 512, 512};
  REQUIRE(cp_replay_seed_segment(r, 0, CP_KIND_SMALL, 2 * MiB, &live, 1) == CP_OK);
  cp_stats_t before = stats_of(&fx);
  struct {
    int kind;
    size_t seg;
    cp_seed_block_t b[2];
    size_t n;
    const char *says;
  } bad[] = {
      {CP_KIND_ALL, 2 * MiB, {{0x2, 0, 512, 512}}, 1, "kind"},
      {CP_KIND_LARGE, 0, {{0x2, 0, 512, 512}}, 0, "size 0"},
      {CP_KIND_LARGE, 2 * MiB + 100, {{0x2, 0, 512, 512}}, 0, "granule"},
      {CP_KIND_LARGE, 2 * MiB, {{0x2, 100, 512, 512}}, 1, "block 0"},
      {CP_KIND_LARGE, 2 * MiB, {{0x2, 0, 1000, 512}}, 1, "block 0"},
      {CP_KIND_LARGE, 2 * MiB, {{0x2, 0, 512, 0}}, 1, "requested"},
      {CP_KIND_LARGE, 2 * MiB, {{0x2, 0, 512, 513}}, 1, "requested"},
      {CP_KIND_LARGE, 2 * MiB, {{0x2, 2 * MiB - 512, 1024, 1024}}, 1, "ends past"},
      {CP_KIND_LARGE, 2 * MiB, {{0x2, 1024, 1024, 1024}, {0x3, 1536, 512, 512}}, 2, "block 1"},
      {CP_KIND_LARGE, 2 * MiB, {{0x2, 1024, 512, 512}, {0x3, 0, 512, 512}}, 2, "sorted"},
      {CP_KIND_LARGE, 2 * MiB, {{0x2, 0, 512, 512}, {0x2, 512, 512, 512}}, 2, "id 0x2"},
      {CP_KIND_LARGE, 2 * MiB, {{0x1, 0, 512, 512}}, 1, "live already"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    int rc = cp_replay_seed_segment(r, 0, bad[i].kind, bad[i].seg, bad[i].b, bad[i].n);
    if (rc != CP_ERR_INVALID || strstr(cp_last_error(), bad[i].says) == NULL)
      fprintf(stderr, "case %zu: rc %d, %s\n", i, rc, cp_last_error());
    CHECK(rc == CP_ERR_INVALID);
    CHECK(strstr(cp_last_error(), bad[i].says) != NULL);
  }
  /* Too large for the device: out of memory, nothing reserved. */
  CHECK(cp_replay_seed_segment(r, 0, CP_KIND_LARGE, 128 * MiB, NULL, 0) == CP_ERR_OOM);
  cp_stats_t after = stats_of(&fx);
  CHECK(memcmp(&before.family, &after.family, sizeof before.family) == 0);
  CHECK_EQ_U(after.num_device_alloc, before.num_device_alloc);
  CHECK_EQ_U(cp_sim_reserved_bytes(fx.sim), 2 * MiB);
  CHECK_EQ_U(fx.pool->segment_count, 1);
  CHECK_EQ_U(cp_pool_check(fx.pool, stderr), 0);
  /* The refused ids were not registered: an ALLOC of 0x2 is a fresh allocation. */
  cp_trace_event_t e = ev(CP_TRACE_ALLOC, 0x2, 512, 0);
  REQUIRE(cp_replay_feed(r, &e, 1) == CP_OK);
  cp_replay_result_t res;
  cp_replay_result(r, &res);
  CHECK_EQ_U(res.bad_events, 0);
  CHECK_EQ_U(res.allocs, 1);
  cp_replay_destroy(r);
  fx_close(&fx);
}

TEST(cap_counts_seeded_segments) {
  fixture_t fx;
  REQUIRE(fx_open_sim(&fx, 4 * GiB, CP_SIM_AUTO_COMPLETE | CP_SIM_NO_TOUCH, "memory_cap_mb:30") == 0);
  cp_replay_t *r;
  REQUIRE(cp_replay_create(fx.pool, -1, &r) == CP_OK);
  cp_seed_block_t b = {0x1, 0, 20 * MiB, 20 * MiB};
  REQUIRE(cp_replay_seed_segment(r, 0, CP_KIND_LARGE, 20 * MiB, &b, 1) == CP_OK);
  CHECK(cp_replay_seed_segment(r, 0, CP_KIND_LARGE, 20 * MiB, NULL, 0) == CP_ERR_OOM);
  cp_trace_event_t e = ev(CP_TRACE_ALLOC, 0x2, 12 * MiB, 0);
  CHECK(cp_replay_feed(r, &e, 1) == CP_ERR_OOM); /* 20 + 12 > 30 */
  cp_replay_destroy(r);
  CHECK_EQ_U(cp_pool_check(fx.pool, stderr), 0);
  fx_close(&fx);
}

int main(void) {
  RUN(exact_size_offsets_and_merged_gaps);
  RUN(empty_and_small_segments);
  RUN(bad_layouts_are_refused_and_change_nothing);
  RUN(cap_counts_seeded_segments);
  return check_summary("test_seed");
}
