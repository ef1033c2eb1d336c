/* test_checkpoint.c — checkpoints of a pool and their restore (Note
 * [Checkpoints] in core/checkpoint.c) on the simulated device with real memory and its asynchrony
 * model: a restore frees what was allocated after the checkpoint, re-creates the checkpoint's
 * live blocks at their addresses with their bytes untouched, waits for frees that wait for
 * other streams, faults nothing while a replay is still queued on the memory, and refuses,
 * changing nothing, what it cannot honour. The ASan build runs the invariant checker after
 * every operation. */
#include <string.h>

#include "check.h"
#include "core/checkpoint.h"
#include "fixture.h"

#define EX "expandable_segments:True"

typedef struct {
  void *ptr[16];
  size_t n;
} ptrs_t;

static ptrs_t live_of(fixture_t *fx) {
  ptrs_t out;
  memset(&out, 0, sizeof out);
  void **p = NULL;
  size_t n = 0;
  CHECK(cp_pool_live_blocks(fx->pool, &p, &n) == CP_OK);
  for (size_t i = 0; i < n && i < 16; i++) out.ptr[i] = p[i];
  out.n = n;
  free(p);
  return out;
}

static size_t allocated_of(fixture_t *fx) {
  return (size_t)stats_of(fx).family[CP_STAT_ALLOCATED_BYTES][CP_KIND_ALL].current;
}

static cp_checkpoint_t *checkpoint(fixture_t *fx) {
  cp_checkpoint_t *ck = NULL;
  const int rc = cp_pool_checkpoint(fx->pool, &ck);
  if (rc != CP_OK) fprintf(stderr, "checkpoint failed: %s\n", cp_last_error());
  CHECK(rc == CP_OK);
  return ck;
}

static void restore_ok(fixture_t *fx, const cp_checkpoint_t *ck, cp_restore_t *r) {
  const int rc = cp_pool_restore(fx->pool, ck, r);
  if (rc != CP_OK) fprintf(stderr, "restore failed: %s\n", cp_last_error());
  CHECK(rc == CP_OK);
}

/* The core of torch's use: a graph's outputs live at the checkpoint, everything after it goes. */
static void restore_brings_back_the_checkpoint(const char *conf) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 512 * MiB, conf) == 0);
  char *a = must_alloc(&fx, 3 * MiB, 5);
  char *tmp = must_alloc(&fx, 6 * MiB, 5);
  char *c = must_alloc(&fx, 1000, 5);
  cp_free(fx.pool, tmp);
  fill(a, 3 * MiB, 11);
  fill(c, 1000, 22);
  const size_t allocated = allocated_of(&fx);
  cp_checkpoint_t *ck = checkpoint(&fx);
  REQUIRE(ck != NULL);
  CHECK_EQ_U(cp_checkpoint_live_count(ck), 2);
  void *p0 = NULL, *p1 = NULL;
  size_t s0 = 0, s1 = 0;
  cp_checkpoint_live(ck, 0, &p0, &s0);
  cp_checkpoint_live(ck, 1, &p1, &s1);
  CHECK((p0 == a && s0 == 3 * MiB && p1 == c && s1 == 1000) || (p0 == c && s0 == 1000 && p1 == a && s1 == 3 * MiB));
  /* The outputs die; a replay writes them again (queued, not run yet); other allocations come. */
  cp_free(fx.pool, a);
  cp_free(fx.pool, c);
  launch(&fx, 5, a, 3 * MiB);
  launch(&fx, 5, c, 1000);
  char *d = must_alloc(&fx, 2 * MiB, 5);
  char *e = must_alloc(&fx, 5 * MiB, 5);
  cp_restore_t r;
  restore_ok(&fx, ck, &r);
  CHECK_EQ_U(r.freed_count, 2);
  CHECK((r.freed[0] == d && r.freed[1] == e) || (r.freed[0] == e && r.freed[1] == d));
  CHECK_EQ_U(r.made_live_count, 2);
  ptrs_t live = live_of(&fx);
  CHECK_EQ_U(live.n, 2);
  CHECK(live.n == 2 && ((live.ptr[0] == a && live.ptr[1] == c) || (live.ptr[0] == c && live.ptr[1] == a)));
  CHECK_EQ_U(allocated_of(&fx), allocated);
  CHECK(holds(a, 3 * MiB, 11)); /* no byte moved */
  CHECK(holds(c, 1000, 22));
  size_t size = 0;
  CHECK(cp_pool_lookup(fx.pool, a, &size) && size == 3 * MiB);
  CHECK(cp_pool_lookup(fx.pool, c, &size) && size == 1000);
  CHECK(d == a || d == c || !cp_pool_lookup(fx.pool, d, NULL));
  CHECK(e == a || e == c || !cp_pool_lookup(fx.pool, e, NULL));
  CHECK_EQ_U(cp_sim_device_faults(fx.sim), 0); /* the queued replay was never in the way */
  /* New allocations of the stream go around the restored blocks. */
  char *f = must_alloc(&fx, 4 * MiB, 5);
  CHECK(f + 4 * MiB <= a || f >= a + 3 * MiB);
  /* The same checkpoint restores again (torch restores one checkpoint many times). */
  cp_restore_t r2;
  restore_ok(&fx, ck, &r2);
  CHECK_EQ_U(r2.freed_count, 3); /* a, c and f */
  CHECK_EQ_U(live_of(&fx).n, 2);
  cp_restore_release(&r);
  cp_restore_release(&r2);
  cp_checkpoint_destroy(ck);
  cp_free(fx.pool, a);
  cp_free(fx.pool, c);
  CHECK_EQ_U(allocated_of(&fx), 0);
  fx_close(&fx);
}

TEST(restore_brings_back_the_checkpoint_plain) { restore_brings_back_the_checkpoint(""); }
TEST(restore_brings_back_the_checkpoint_page_mapped) { restore_brings_back_the_checkpoint(EX); }

TEST(an_empty_checkpoint_restores_to_nothing_live) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, "") == 0);
  cp_checkpoint_t *ck = checkpoint(&fx);
  REQUIRE(ck != NULL);
  CHECK_EQ_U(cp_checkpoint_live_count(ck), 0);
  void *x = must_alloc(&fx, 1 * MiB, 0);
  cp_restore_t r;
  restore_ok(&fx, ck, &r);
  CHECK_EQ_U(r.freed_count, 1);
  CHECK(r.freed_count == 1 && r.freed[0] == x);
  CHECK_EQ_U(r.made_live_count, 0);
  CHECK_EQ_U(live_of(&fx).n, 0);
  cp_restore_release(&r);
  cp_checkpoint_destroy(ck);
  fx_close(&fx);
}

/* A block allocated after the checkpoint, over a checkpointed block's bytes, was used on another
 * stream whose work is still queued: the restore waits for it before handing the bytes back. */
TEST(restore_waits_for_frees_that_wait_for_other_streams) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, "") == 0);
  char *x = must_alloc(&fx, 2 * MiB, 5);
  cp_checkpoint_t *ck = checkpoint(&fx);
  REQUIRE(ck != NULL);
  cp_free(fx.pool, x);
  char *y = must_alloc(&fx, 2 * MiB, 5);
  CHECK(y == x); /* best fit: the same bytes */
  CHECK(cp_record_stream(fx.pool, y, 7) == CP_OK);
  launch(&fx, 7, y, 2 * MiB); /* queued on stream 7, not run */
  cp_restore_t r;
  restore_ok(&fx, ck, &r);
  CHECK_EQ_U(r.freed_count, 1);
  CHECK_EQ_U(cp_sim_check_handoff(fx.sim, 5, (uintptr_t)x, 2 * MiB), 0);
  CHECK_EQ_U(cp_sim_device_faults(fx.sim), 0);
  CHECK(cp_pool_lookup(fx.pool, x, NULL));
  cp_restore_release(&r);
  cp_checkpoint_destroy(ck);
  cp_free(fx.pool, x);
  fx_close(&fx);
}

/* A free waiting for the end of a capture is not live: the checkpoint leaves it out, and a
 * restore while the window is open is refused until it closes. */
TEST(frees_waiting_for_a_capture_are_not_live) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, "") == 0);
  CHECK(cp_pool_capture_begin(fx.pool) == CP_OK);
  char *a = must_alloc(&fx, 1 * MiB, 5);
  char *b = must_alloc(&fx, 1 * MiB, 5);
  CHECK(cp_record_stream(fx.pool, a, 7) == CP_OK);
  CHECK(cp_free(fx.pool, a) == CP_OK); /* deferred: the block stays allocated */
  size_t deferred = 0;
  cp_pool_capture_state(fx.pool, NULL, &deferred);
  CHECK_EQ_U(deferred, 1);
  cp_checkpoint_t *ck = checkpoint(&fx);
  REQUIRE(ck != NULL);
  CHECK_EQ_U(cp_checkpoint_live_count(ck), 1);
  ptrs_t live = live_of(&fx);
  CHECK(live.n == 1 && live.ptr[0] == b);
  cp_restore_t r;
  CHECK(cp_pool_restore(fx.pool, ck, &r) == CP_ERR_STATE);
  CHECK(contains(cp_last_error(), "capture window is open"));
  CHECK_EQ_U(r.freed_count, 0);
  cp_restore_release(&r);
  CHECK(cp_pool_lookup(fx.pool, b, NULL)); /* nothing changed */
  CHECK(cp_pool_capture_end(fx.pool) == CP_OK);
  restore_ok(&fx, ck, &r);
  CHECK_EQ_U(r.freed_count, 1); /* b, freed and made live again */
  CHECK_EQ_U(r.made_live_count, 1);
  CHECK(cp_pool_lookup(fx.pool, b, NULL));
  CHECK_EQ_U(cp_sim_capture_violations(fx.sim), 0);
  cp_restore_release(&r);
  cp_checkpoint_destroy(ck);
  cp_free(fx.pool, b);
  fx_close(&fx);
}

TEST(restore_refuses_what_it_cannot_honour_and_changes_nothing) {
  fixture_t fx, other;
  REQUIRE(fx_open(&fx, 256 * MiB, "") == 0);
  REQUIRE(fx_open(&other, 256 * MiB, "") == 0);
  char *a = must_alloc(&fx, 1 * MiB, 0);
  cp_checkpoint_t *ck = checkpoint(&fx);
  REQUIRE(ck != NULL);
  cp_restore_t r;
  /* Another pool's checkpoint. */
  CHECK(cp_pool_restore(other.pool, ck, &r) == CP_ERR_STATE);
  CHECK(contains(cp_last_error(), "another pool"));
  cp_restore_release(&r);
  /* Its segment given back since. */
  cp_free(fx.pool, a);
  CHECK(empty_cache_idle(&fx) == CP_OK);
  char *big = must_alloc(&fx, 30 * MiB, 0); /* a segment of another size */
  CHECK(cp_pool_restore(fx.pool, ck, &r) == CP_ERR_STATE);
  CHECK(contains(cp_last_error(), "no longer held"));
  CHECK_EQ_U(r.freed_count, 0);
  cp_restore_release(&r);
  CHECK(cp_pool_lookup(fx.pool, big, NULL)); /* still live */
  /* Bad arguments. */
  CHECK(cp_pool_restore(NULL, ck, &r) == CP_ERR_INVALID);
  CHECK(cp_pool_restore(fx.pool, NULL, &r) == CP_ERR_INVALID);
  CHECK(cp_pool_checkpoint(fx.pool, NULL) == CP_ERR_INVALID);
  CHECK(cp_pool_live_blocks(NULL, NULL, NULL) == CP_ERR_INVALID);
  CHECK_EQ_U(cp_checkpoint_live_count(NULL), 0);
  cp_checkpoint_destroy(NULL);
  cp_restore_release(NULL);
  cp_checkpoint_destroy(ck);
  cp_free(fx.pool, big);
  fx_close(&other);
  fx_close(&fx);
}

TEST(page_mapped_memory_given_back_cannot_be_restored) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 512 * MiB, EX) == 0);
  char *keep = must_alloc(&fx, 25 * MiB, 0); /* keeps the (large) segment */
  char *a = must_alloc(&fx, 40 * MiB, 0);
  cp_checkpoint_t *ck = checkpoint(&fx);
  REQUIRE(ck != NULL);
  cp_free(fx.pool, a);
  CHECK(empty_cache_idle(&fx) == CP_OK);
  CHECK(empty_cache_idle(&fx) == CP_OK); /* retired, then unmapped */
  cp_restore_t r;
  CHECK(cp_pool_restore(fx.pool, ck, &r) == CP_ERR_STATE);
  if (!contains(cp_last_error(), "unmapped")) fprintf(stderr, "error: %s\n", cp_last_error());
  CHECK(contains(cp_last_error(), "unmapped"));
  cp_restore_release(&r);
  CHECK(cp_pool_lookup(fx.pool, keep, NULL));
  cp_checkpoint_destroy(ck);
  cp_free(fx.pool, keep);
  fx_close(&fx);
}

TEST(stitching_pools_are_not_checkpointed) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, "expandable_segments:True,page_stitching:True") == 0);
  cp_checkpoint_t *ck = NULL;
  CHECK(cp_pool_checkpoint(fx.pool, &ck) == CP_ERR_INVALID);
  CHECK(ck == NULL);
  CHECK(contains(cp_last_error(), "stitches pages"));
  fx_close(&fx);
}

/* A region's pool: restore is refused while the region is paused, and works once resumed, the
 * restored bytes those the resume brought back. */
TEST(region_pools_restore_after_resume) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 512 * MiB, EX) == 0);
  uint32_t tag = 0;
  REQUIRE(cp_region_id("checkpointed", &tag) == CP_OK);
  void *p = NULL;
  REQUIRE(cp_alloc_in(fx.pool, 4 * MiB, 5, tag, &p) == CP_OK);
  fill(p, 4 * MiB, 33);
  cp_checkpoint_t *ck = checkpoint(&fx);
  REQUIRE(ck != NULL);
  void *q = NULL;
  REQUIRE(cp_alloc_in(fx.pool, 2 * MiB, 5, tag, &q) == CP_OK);
  cp_sim_complete_all(fx.sim);
  REQUIRE(cp_pool_pause(fx.pool, tag, CP_PAUSE_BACKUP | CP_PAUSE_KEEP_FREE) == CP_OK);
  cp_restore_t r;
  CHECK(cp_pool_restore(fx.pool, ck, &r) == CP_ERR_STATE);
  CHECK(contains(cp_last_error(), "paused"));
  cp_restore_release(&r);
  REQUIRE(cp_pool_resume(fx.pool, tag) == CP_OK);
  restore_ok(&fx, ck, &r);
  CHECK_EQ_U(r.freed_count, 2);
  CHECK_EQ_U(r.made_live_count, 1);
  CHECK(holds(p, 4 * MiB, 33));
  CHECK(!cp_pool_lookup(fx.pool, q, NULL));
  CHECK_EQ_U(cp_sim_device_faults(fx.sim), 0);
  cp_restore_release(&r);
  cp_checkpoint_destroy(ck);
  cp_free(fx.pool, p);
  fx_close(&fx);
}

int main(void) {
  RUN(restore_brings_back_the_checkpoint_plain);
  RUN(restore_brings_back_the_checkpoint_page_mapped);
  RUN(an_empty_checkpoint_restores_to_nothing_live);
  RUN(restore_waits_for_frees_that_wait_for_other_streams);
  RUN(frees_waiting_for_a_capture_are_not_live);
  RUN(restore_refuses_what_it_cannot_honour_and_changes_nothing);
  RUN(page_mapped_memory_given_back_cannot_be_restored);
  RUN(stitching_pools_are_not_checkpointed);
  RUN(region_pools_restore_after_resume);
  return check_summary("test_checkpoint");
}
