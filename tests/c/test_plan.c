/* test_plan.c — the step plan (plan_steps:True, core/plan.c, Note [Learning the step]) on the
 * simulated device: a loop's step is learned from its allocations, served from the plan with no
 * device call, the planned blocks' bytes are distinct memory while they live, and every way off
 * the plan (an extra tensor, a skipped one, a block held too long or used on another stream, a
 * new shape, out of memory, empty_cache) falls back to the pool without harm. The ASan build runs
 * the invariant checker after every operation. */
#include <pthread.h>
#include <string.h>

#include "check.h"
#include "core/plan.h"
#include "core/snapshot.h"
#include "fixture.h"

#define PLANNED "expandable_segments:True,page_stitching:True,release_before_grow:True,plan_steps:True"

static uint64_t calls_of(fixture_t *fx) {
  uint64_t n = 0;
  for (int k = 0; k < CP_SIM_CALL_COUNT; k++) n += cp_sim_calls(fx->sim, (cp_sim_call_t)k);
  return n;
}

/* One training-like step: a persistent-looking input, activations kept for a backward pass
 * (freed in reverse), temporaries, and a gradient that lives into the next step (`carry`,
 * freed at the start of the next one). `scale` changes every size (a new shape). Each block's
 * bytes get a pattern, checked before its free: planned blocks that overlap while they live
 * would overwrite each other. */
static void step(fixture_t *fx, size_t scale, void **carry, unsigned seed) {
  static const size_t act[6] = {3, 5, 2, 7, 1, 4};
  void *a[6];
  if (*carry != NULL) {
    CHECK(cp_free(fx->pool, *carry) == CP_OK);
    *carry = NULL;
  }
  for (int i = 0; i < 6; i++) {
    a[i] = must_alloc(fx, act[i] * scale * MiB + 1000, 0);
    memset(a[i], (int)(seed + (unsigned)i), 4096);
    void *tmp = must_alloc(fx, scale * MiB / 2, 0);
    memset(tmp, 0x5a, 4096);
    CHECK(cp_free(fx->pool, tmp) == CP_OK);
  }
  *carry = must_alloc(fx, 2 * scale * MiB, 0);
  for (int i = 5; i >= 0; i--) {
    const unsigned char *p = a[i];
    CHECK(p[0] == (unsigned char)(seed + (unsigned)i) && p[4095] == (unsigned char)(seed + (unsigned)i));
    CHECK(cp_free(fx->pool, a[i]) == CP_OK);
  }
}

TEST(config_key) {
  cp_config_t cfg;
  cp_config_default(&cfg);
  char text[1024];
  cp_config_format(&cfg, text, sizeof text);
  CHECK(!contains(text, "plan_steps")); /* written only when True */
  CHECK(cp_config_parse(&cfg, "plan_steps:True") == CP_OK);
  cp_config_format(&cfg, text, sizeof text);
  CHECK(contains(text, "plan_steps:True"));
  /* Without page stitching the plan is off, and says so. */
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, "plan_steps:True") == 0);
  CHECK_EQ_U(info_of(&fx).plan_state, CP_PLAN_OFF);
  fx_close(&fx);
}

TEST(a_repeating_step_is_learned_and_served_without_device_calls) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 1 * GiB, PLANNED) == 0);
  void *carry = NULL;
  for (unsigned s = 0; s < 4; s++) step(&fx, 1, &carry, s);
  cp_pool_info_t in = info_of(&fx);
  CHECK_EQ_U(in.plans, 1);
  CHECK_EQ_U(in.plan_state, CP_PLAN_SERVING);
  CHECK_EQ_U(in.plan_step_allocs, 13);
  CHECK_EQ_U(in.plan_planned, 13);
  CHECK(in.plan_bytes > 0);
  const uint64_t calls = calls_of(&fx);
  const size_t served = in.plan_served;
  for (unsigned s = 4; s < 20; s++) step(&fx, 1, &carry, s);
  CHECK_EQ_U(calls_of(&fx), calls); /* nothing asked of the device once planned */
  in = info_of(&fx);
  CHECK_EQ_U(in.plan_served - served, 16 * 13);
  CHECK_EQ_U(in.plan_missed, 0);
  /* Planned blocks count as allocated, the plan's memory as reserved. */
  cp_stats_t st;
  cp_pool_stats(fx.pool, &st);
  CHECK_EQ_U((size_t)st.family[CP_STAT_ALLOCATED_BYTES][CP_KIND_ALL].current, 2 * MiB);
  CHECK_EQ_U((size_t)st.family[CP_STAT_ALLOCATION][CP_KIND_ALL].current, 1);
  CHECK(in.reserved >= in.plan_bytes);
  size_t size = 0;
  CHECK(cp_pool_lookup(fx.pool, carry, &size) == 1 && size == 2 * MiB);
  CHECK(cp_free(fx.pool, carry) == CP_OK);
  fx_close(&fx);
}

TEST(snapshots_and_figures_show_planned_blocks_as_blocks) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 1 * GiB, PLANNED) == 0);
  void *carry = NULL;
  for (unsigned s = 0; s < 5; s++) step(&fx, 1, &carry, s);
  REQUIRE(info_of(&fx).plan_state == CP_PLAN_SERVING);
  void *a = must_alloc(&fx, 3 * MiB + 1000, 0); /* position 0 and 1: two planned blocks in use */
  void *t = must_alloc(&fx, MiB / 2, 0);
  cp_snapshot_t snap;
  REQUIRE(cp_pool_snapshot(fx.pool, &snap) == CP_OK);
  size_t live = 0, total = 0, found = 0;
  for (size_t i = 0; i < snap.segment_count; i++) {
    const cp_snapshot_segment_t *seg = &snap.segments[i];
    uintptr_t at = seg->addr;
    for (size_t k = 0; k < seg->block_count; k++) {
      const cp_snapshot_block_t *b = &snap.blocks[seg->first_block + k];
      CHECK(b->addr == at); /* the records tile the segment */
      at = b->addr + b->size;
      total += b->size;
      if (b->state == CP_SNAP_LIVE) live += b->size;
      if (b->state == CP_SNAP_LIVE && (b->addr == (uintptr_t)a || b->addr == (uintptr_t)t)) found++;
    }
    CHECK(at == seg->addr + seg->size);
  }
  cp_snapshot_free(&snap);
  cp_pool_info_t in = info_of(&fx);
  CHECK_EQ_U(found, 2);
  CHECK_EQ_U(live, in.allocated);
  /* Reserved is what is allocated, cached (the plan's idle memory included) and pending. */
  CHECK_EQ_U(in.reserved, in.allocated + in.cached_free + in.pending_free);
  CHECK(cp_free(fx.pool, t) == CP_OK);
  CHECK(cp_free(fx.pool, a) == CP_OK);
  CHECK(cp_free(fx.pool, carry) == CP_OK);
  fx_close(&fx);
}

TEST(extra_and_skipped_allocations_keep_the_plan) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 1 * GiB, PLANNED) == 0);
  void *carry = NULL;
  for (unsigned s = 0; s < 5; s++) step(&fx, 1, &carry, s);
  REQUIRE(info_of(&fx).plan_state == CP_PLAN_SERVING);
  /* An extra tensor in the middle of a step: the pool's, and the plan goes on. */
  CHECK(cp_free(fx.pool, carry) == CP_OK);
  carry = NULL;
  void *x = must_alloc(&fx, 3 * MiB + 1000, 0); /* position 0 */
  void *extra = must_alloc(&fx, 9 * MiB, 0);    /* off the plan */
  void *y = must_alloc(&fx, MiB / 2, 0);        /* position 1 */
  CHECK(cp_free(fx.pool, y) == CP_OK);
  CHECK(cp_free(fx.pool, extra) == CP_OK);
  CHECK(cp_free(fx.pool, x) == CP_OK);
  cp_pool_info_t in = info_of(&fx);
  CHECK_EQ_U(in.plan_state, CP_PLAN_SERVING);
  CHECK_EQ_U(in.plan_missed, 1);
  fx_close(&fx);
}

TEST(a_block_held_past_its_time_loses_the_step_not_the_memory) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 1 * GiB, PLANNED) == 0);
  void *carry = NULL;
  for (unsigned s = 0; s < 5; s++) step(&fx, 1, &carry, s);
  REQUIRE(info_of(&fx).plan_state == CP_PLAN_SERVING);
  /* The carried gradient is kept (a user holds it) over the next step: its bytes may be what
   * a later planned block would take, so that step goes to the pool. */
  void *held = carry;
  carry = NULL;
  memset(held, 0x77, 4096);
  step(&fx, 1, &carry, 50);
  const unsigned char *h = held;
  CHECK(h[0] == 0x77 && h[4095] == 0x77);
  CHECK(info_of(&fx).plan_missed > 0);
  CHECK(cp_free(fx.pool, held) == CP_OK);
  /* Back at the step's start with nothing out of place: served again. */
  const size_t served = info_of(&fx).plan_served;
  step(&fx, 1, &carry, 51);
  step(&fx, 1, &carry, 52);
  CHECK(info_of(&fx).plan_served > served);
  CHECK(cp_free(fx.pool, carry) == CP_OK);
  fx_close(&fx);
}

TEST(a_new_shape_drops_the_plan_and_learns_the_next) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 1 * GiB, PLANNED) == 0);
  void *carry = NULL;
  for (unsigned s = 0; s < 5; s++) step(&fx, 1, &carry, s);
  REQUIRE(info_of(&fx).plans == 1);
  for (unsigned s = 0; s < 8; s++) step(&fx, 2, &carry, 100 + s); /* every size doubles */
  cp_pool_info_t in = info_of(&fx);
  CHECK_EQ_U(in.plan_drops, 1);
  CHECK_EQ_U(in.plans, 2); /* the new step, learned */
  CHECK_EQ_U(in.plan_state, CP_PLAN_SERVING);
  CHECK(cp_free(fx.pool, carry) == CP_OK);
  fx_close(&fx);
}

TEST(a_block_used_on_another_stream_waits_for_its_event) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 1 * GiB, PLANNED) == 0);
  void *carry = NULL;
  for (unsigned s = 0; s < 5; s++) step(&fx, 1, &carry, s);
  REQUIRE(info_of(&fx).plan_state == CP_PLAN_SERVING);
  /* The carried block is used on stream 7 and freed: PENDING until stream 7's work is done;
   * its place in the plan stays taken, so the next step is the pool's where it would reuse it. */
  CHECK(cp_record_stream(fx.pool, carry, 7) == CP_OK);
  CHECK(cp_free(fx.pool, carry) == CP_OK);
  carry = NULL;
  cp_pool_info_t in = info_of(&fx);
  CHECK_EQ_U(in.pending_blocks, 1);
  step(&fx, 1, &carry, 60);
  cp_sim_complete_all(fx.sim);
  step(&fx, 1, &carry, 61);
  step(&fx, 1, &carry, 62);
  CHECK_EQ_U(info_of(&fx).pending_blocks, 0);
  CHECK(cp_free(fx.pool, carry) == CP_OK);
  fx_close(&fx);
}

TEST(out_of_memory_gives_the_plan_up_first) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 64 * MiB, PLANNED) == 0);
  void *carry = NULL;
  for (unsigned s = 0; s < 5; s++) step(&fx, 1, &carry, s);
  REQUIRE(info_of(&fx).plan_state == CP_PLAN_SERVING);
  CHECK(cp_free(fx.pool, carry) == CP_OK);
  /* Nothing planned is in use: a request the rest of the device cannot hold takes the
   * plan's memory back instead of failing. */
  const size_t reserved = info_of(&fx).reserved;
  void *big = NULL;
  CHECK(cp_alloc(fx.pool, 64 * MiB - reserved + 20 * MiB, 0, &big) == CP_OK);
  cp_pool_info_t in = info_of(&fx);
  CHECK_EQ_U(in.plan_drops, 1);
  CHECK_EQ_U(in.plan_bytes, 0);
  CHECK(cp_free(fx.pool, big) == CP_OK);
  fx_close(&fx);
}

TEST(empty_cache_gives_an_idle_plan_back) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 1 * GiB, PLANNED) == 0);
  void *carry = NULL;
  for (unsigned s = 0; s < 5; s++) step(&fx, 1, &carry, s);
  REQUIRE(info_of(&fx).plan_bytes > 0);
  CHECK(cp_empty_cache(fx.pool) == CP_OK); /* a planned block (carry) is in use: kept */
  CHECK(info_of(&fx).plan_bytes > 0);
  CHECK(cp_free(fx.pool, carry) == CP_OK);
  CHECK(cp_empty_cache(fx.pool) == CP_OK);
  cp_sim_complete_all(fx.sim);
  CHECK(cp_empty_cache(fx.pool) == CP_OK);
  cp_pool_info_t in = info_of(&fx);
  CHECK_EQ_U(in.plan_bytes, 0);
  CHECK_EQ_U(in.plan_state, CP_PLAN_LEARNING);
  CHECK_EQ_U(in.allocated, 0);
  fx_close(&fx);
}

TEST(regions_and_captures_are_never_planned) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 1 * GiB, PLANNED) == 0);
  void *carry = NULL;
  for (unsigned s = 0; s < 5; s++) step(&fx, 1, &carry, s);
  REQUIRE(info_of(&fx).plan_state == CP_PLAN_SERVING);
  const size_t served = info_of(&fx).plan_served;
  CHECK(cp_free(fx.pool, carry) == CP_OK);
  CHECK(cp_pool_capture_begin(fx.pool) == CP_OK);
  void *in_capture = must_alloc(&fx, 3 * MiB + 1000, 0); /* position 0's key, but captured */
  CHECK(cp_pool_capture_end(fx.pool) == CP_OK);
  uint32_t tag = 0;
  CHECK(cp_region_id("r", &tag) == CP_OK);
  void *tagged = NULL;
  CHECK(cp_alloc_in(fx.pool, 3 * MiB + 1000, 0, tag, &tagged) == CP_OK);
  CHECK_EQ_U(info_of(&fx).plan_served, served);
  CHECK(cp_free(fx.pool, tagged) == CP_OK);
  CHECK(cp_free(fx.pool, in_capture) == CP_OK);
  fx_close(&fx);
}

TEST(a_loop_that_never_repeats_is_never_planned) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 1 * GiB, PLANNED) == 0);
  void *carry = NULL;
  for (unsigned s = 0; s < 12; s++) step(&fx, 1 + s % 7 + s / 7, &carry, s); /* all different */
  CHECK_EQ_U(info_of(&fx).plans, 0);
  CHECK(cp_free(fx.pool, carry) == CP_OK);
  fx_close(&fx);
}

/* A loop whose steps stray at random: extra tensors, skipped ones, blocks kept for a few steps,
 * blocks used on another stream, frees out of order, empty_cache, a new shape for a while.
 * Every block carries its own pattern, checked at its free: a planned block placed over one
 * still in use would overwrite it. The checker runs after every operation (ASan build). */
TEST(random_deviations_never_corrupt_a_block) {
  fixture_t fx;
  REQUIRE(fx_open_sim(&fx, 1 * GiB, CP_SIM_AUTO_COMPLETE, PLANNED) == 0);
  uint64_t rng = 0x2545f4914f6cdd1dull;
#define RND(n) ((unsigned)((rng = rng * 6364136223846793005ull + 1442695040888963407ull) >> 33) % (n))
  enum { SLOTS = 64 };
  void *held[SLOTS] = {0};
  unsigned char tag[SLOTS] = {0};
  size_t bytes[SLOTS] = {0};
  int ttl[SLOTS] = {0};
  unsigned stamp = 1;
  for (int s = 0; s < 240; s++) {
    const size_t k = (s / 40) % 3 == 2 ? 2 : 1; /* a new shape for a while, then back */
    static const size_t act[6] = {3, 5, 2, 7, 1, 4};
    int mine[6];
    for (int i = 0; i < 6; i++) {
      if (RND(50) == 0) { /* skipped this step */
        mine[i] = -1;
        continue;
      }
      int slot = -1;
      for (int j = 0; j < SLOTS && slot < 0; j++)
        if (held[j] == NULL) slot = j;
      REQUIRE(slot >= 0);
      bytes[slot] = act[i] * k * MiB + 1000;
      held[slot] = must_alloc(&fx, bytes[slot], 0);
      tag[slot] = (unsigned char)stamp++;
      memset(held[slot], tag[slot], 256);
      memset((char *)held[slot] + bytes[slot] - 256, tag[slot], 256);
      ttl[slot] = RND(40) == 0 ? 1 + (int)RND(3) : 0; /* kept a few steps */
      mine[i] = slot;
      if (RND(30) == 0) CHECK(cp_record_stream(fx.pool, held[slot], 3) == CP_OK);
      if (RND(25) == 0) { /* an extra tensor */
        void *x = must_alloc(&fx, (1 + RND(9)) * MiB, 0);
        memset(x, 0xee, 4096);
        CHECK(cp_free(fx.pool, x) == CP_OK);
      }
    }
    if (RND(60) == 0) CHECK(cp_empty_cache(fx.pool) == CP_OK);
    const int order = (int)RND(8) == 0; /* frees out of order, once in a while */
    for (int n = 0; n < 6; n++) {
      const int i = order ? (n * 5 + 3) % 6 : 5 - n;
      const int slot = mine[i];
      if (slot < 0 || ttl[slot] > 0) continue;
      const unsigned char *p = held[slot];
      CHECK(p[0] == tag[slot] && p[255] == tag[slot] && p[bytes[slot] - 1] == tag[slot]);
      CHECK(cp_free(fx.pool, held[slot]) == CP_OK);
      held[slot] = NULL;
    }
    for (int j = 0; j < SLOTS; j++) { /* the kept ones, when their time is up */
      if (held[j] == NULL || ttl[j] == 0) continue;
      if (--ttl[j] == 0) {
        const unsigned char *p = held[j];
        CHECK(p[0] == tag[j] && p[bytes[j] - 1] == tag[j]);
        CHECK(cp_free(fx.pool, held[j]) == CP_OK);
        held[j] = NULL;
      }
    }
  }
#undef RND
  cp_pool_info_t in = info_of(&fx);
  printf("test_plan: deviations: %zu plans, %zu dropped, %zu served, %zu missed\n", in.plans, in.plan_drops,
         in.plan_served, in.plan_missed);
  CHECK(in.plans >= 2); /* the first shape, the second, the first again */
  CHECK(in.plan_served > in.plan_missed);
  for (int j = 0; j < SLOTS; j++)
    if (held[j] != NULL) CHECK(cp_free(fx.pool, held[j]) == CP_OK);
  fx_close(&fx);
}

/* Threads beside a planned loop: one runs the loop on stream 0 (its blocks carry patterns,
 * checked at their free), three allocate and free in regions on their own streams (never
 * watched), give the cache back (which gives an idle plan up) and ask for more than the device
 * has (which gives a plan up before failing). Built under TSan too. */
typedef struct helper_s {
  fixture_t *fx;
  cp_stream_t stream;
  unsigned seed;
  int rounds;
} helper_t;

static void *helper_main(void *arg) {
  helper_t *h = arg;
  uint32_t tag = 0;
  char name[16];
  snprintf(name, sizeof name, "helper%u", h->seed);
  CHECK(cp_region_id(name, &tag) == CP_OK);
  uint64_t rng = h->seed * 0x9e3779b97f4a7c15ull + 1;
  for (int i = 0; i < h->rounds; i++) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    const unsigned r = (unsigned)(rng >> 33);
    void *p = NULL;
    if (cp_alloc_in(h->fx->pool, (1 + r % 6) * MiB / 2, h->stream, tag, &p) == CP_OK) {
      memset(p, 0x33, 512);
      CHECK(cp_free(h->fx->pool, p) == CP_OK);
    }
    if (r % 97 == 0) CHECK(cp_empty_cache(h->fx->pool) == CP_OK);
    if (r % 211 == 0) { /* more than the device has: fails, after giving any idle plan up */
      void *big = NULL;
      CHECK(cp_alloc(h->fx->pool, 2 * GiB, h->stream, &big) == CP_ERR_OOM);
    }
  }
  return NULL;
}

TEST(threads_beside_a_planned_loop) {
  fixture_t fx;
  REQUIRE(fx_open_sim(&fx, 1 * GiB, CP_SIM_AUTO_COMPLETE, PLANNED) == 0);
  pthread_t th[3];
  helper_t hs[3];
  for (int i = 0; i < 3; i++) {
    hs[i] = (helper_t){&fx, (cp_stream_t)(11 + i), (unsigned)i + 1, 3000};
    CHECK(pthread_create(&th[i], NULL, helper_main, &hs[i]) == 0);
  }
  void *carry = NULL;
  for (unsigned s = 0; s < 200; s++) step(&fx, 1, &carry, s);
  for (int i = 0; i < 3; i++) CHECK(pthread_join(th[i], NULL) == 0);
  for (unsigned s = 200; s < 240; s++) step(&fx, 1, &carry, s); /* learned again if a helper made it go */
  cp_pool_info_t in = info_of(&fx);
  CHECK(in.plans >= 1);
  CHECK_EQ_U(in.plan_state, CP_PLAN_SERVING);
  CHECK(cp_free(fx.pool, carry) == CP_OK);
  fx_close(&fx);
}

int main(void) {
  RUN(config_key);
  RUN(a_repeating_step_is_learned_and_served_without_device_calls);
  RUN(snapshots_and_figures_show_planned_blocks_as_blocks);
  RUN(extra_and_skipped_allocations_keep_the_plan);
  RUN(a_block_held_past_its_time_loses_the_step_not_the_memory);
  RUN(a_new_shape_drops_the_plan_and_learns_the_next);
  RUN(a_block_used_on_another_stream_waits_for_its_event);
  RUN(out_of_memory_gives_the_plan_up_first);
  RUN(empty_cache_gives_an_idle_plan_back);
  RUN(regions_and_captures_are_never_planned);
  RUN(a_loop_that_never_repeats_is_never_planned);
  RUN(random_deviations_never_corrupt_a_block);
  RUN(threads_beside_a_planned_loop);
  return check_summary("test_plan");
}
