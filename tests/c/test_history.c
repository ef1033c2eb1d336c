/* test_history.c — snapshots and history (core/history.c) on the simulated device: the
 * snapshot's segments and blocks, each recorded action at its point, the ring buffer's
 * wrap-around, contexts, page-mapped map/unmap records, and bad arguments. */
#include <string.h>

#include "check.h"
#include "core/snapshot.h"
#include "fixture.h"

#define RING 64

static size_t read_all(fixture_t *fx, cp_history_entry_t *out, uint64_t *recorded) {
  return cp_pool_history_read(fx->pool, out, RING, recorded, NULL);
}

/* The index of the first record of `action` at or after `from`, or n. */
static size_t find(const cp_history_entry_t *e, size_t n, size_t from, int action) {
  for (size_t i = from; i < n; i++)
    if ((int)e[i].action == action) return i;
  return n;
}

TEST(off_by_default) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 64 * MiB, "") == 0);
  cp_free(fx.pool, must_alloc(&fx, 1000, 0));
  cp_history_entry_t e[RING];
  uint64_t recorded = 99;
  size_t capacity = 99;
  CHECK_EQ_U(cp_pool_history_read(fx.pool, e, RING, &recorded, &capacity), 0);
  CHECK_EQ_U(recorded, 0);
  CHECK_EQ_U(capacity, 0);
  fx_close(&fx);
}

TEST(records_each_action_in_order) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 64 * MiB, "") == 0);
  REQUIRE(cp_pool_history_enable(fx.pool, RING) == CP_OK);
  cp_history_set_context(42);
  char *p = must_alloc(&fx, 1000, 7); /* a new 2 MiB small segment, then the block */
  cp_history_set_context(0);
  CHECK(cp_free(fx.pool, p) == CP_OK);
  CHECK(cp_empty_cache(fx.pool) == CP_OK);
  cp_history_entry_t e[RING];
  uint64_t recorded = 0;
  size_t n = read_all(&fx, e, &recorded);
  REQUIRE(n == 5);
  CHECK_EQ_U(recorded, 5);
  const int want[5] = {CP_HIST_SEGMENT_ALLOC, CP_HIST_ALLOC, CP_HIST_FREE_REQUESTED, CP_HIST_FREE_COMPLETED,
                       CP_HIST_SEGMENT_FREE};
  for (size_t i = 0; i < n; i++) {
    CHECK_EQ_U(e[i].action, want[i]);
    CHECK_EQ_U(e[i].seq, i + 1);
    CHECK_EQ_U(e[i].stream, 7);
    CHECK(e[i].time_ns > 0);
    if (i > 0) CHECK(e[i].time_ns >= e[i - 1].time_ns);
  }
  CHECK_EQ_U(e[0].size, 2 * MiB);
  CHECK_EQ_U(e[1].addr, (uintptr_t)p);
  CHECK_EQ_U(e[1].size, 1024); /* the block's rounded size */
  CHECK_EQ_U(e[1].context, 42);
  CHECK_EQ_U(e[2].context, 0);
  CHECK_EQ_U(e[3].context, 0);
  CHECK_EQ_U(e[4].addr, e[0].addr);
  CHECK(strcmp(cp_history_action_names[CP_HIST_FREE_REQUESTED], "free_requested") == 0);
  CHECK(strcmp(cp_history_action_names[CP_HIST_SEGMENT_UNMAP], "segment_unmap") == 0);
  fx_close(&fx);
}

TEST(reuse_records_alloc_without_segment) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 64 * MiB, "") == 0);
  cp_free(fx.pool, must_alloc(&fx, 4096, 0)); /* before recording: not in the history */
  REQUIRE(cp_pool_history_enable(fx.pool, RING) == CP_OK);
  void *p = must_alloc(&fx, 4096, 0); /* from the cache */
  cp_history_entry_t e[RING];
  size_t n = read_all(&fx, e, NULL);
  REQUIRE(n == 1);
  CHECK_EQ_U(e[0].action, CP_HIST_ALLOC);
  CHECK_EQ_U(e[0].addr, (uintptr_t)p);
  cp_free(fx.pool, p);
  fx_close(&fx);
}

TEST(pending_free_completes_later) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 64 * MiB, "") == 0);
  REQUIRE(cp_pool_history_enable(fx.pool, RING) == CP_OK);
  void *p = must_alloc(&fx, 4096, 1);
  CHECK(cp_record_stream(fx.pool, p, 2) == CP_OK);
  launch(&fx, 2, p, 1);
  CHECK(cp_free(fx.pool, p) == CP_OK);
  cp_history_entry_t e[RING];
  size_t n = read_all(&fx, e, NULL);
  REQUIRE(n == 3);
  CHECK_EQ_U(e[2].action, CP_HIST_FREE_REQUESTED);
  cp_snapshot_t snap;
  REQUIRE(cp_pool_snapshot(fx.pool, &snap) == CP_OK);
  REQUIRE(snap.segment_count == 1);
  CHECK_EQ_U(snap.blocks[snap.segments[0].first_block].state, CP_SNAP_PENDING);
  CHECK_EQ_U(snap.blocks[snap.segments[0].first_block].requested, 4096);
  cp_snapshot_free(&snap);
  cp_sim_complete(fx.sim, 2);
  cp_free(fx.pool, must_alloc(&fx, 8192, 1)); /* the next allocation reclaims it */
  n = read_all(&fx, e, NULL);
  size_t done = find(e, n, 3, CP_HIST_FREE_COMPLETED);
  REQUIRE(done < n);
  CHECK_EQ_U(e[done].addr, (uintptr_t)p);
  CHECK_EQ_U(e[done].stream, 1);
  CHECK(done < find(e, n, 3, CP_HIST_ALLOC)); /* reclaimed before the block is chosen */
  fx_close(&fx);
}

TEST(ring_wraps_and_keeps_the_newest) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 64 * MiB, "") == 0);
  void *keep = must_alloc(&fx, 512, 0); /* the segment exists before recording */
  REQUIRE(cp_pool_history_enable(fx.pool, 5) == CP_OK);
  for (int i = 0; i < 7; i++) cp_free(fx.pool, must_alloc(&fx, 512, 0)); /* 3 records each */
  cp_history_entry_t e[RING];
  uint64_t recorded = 0;
  size_t capacity = 0;
  size_t n = cp_pool_history_read(fx.pool, e, RING, &recorded, &capacity);
  CHECK_EQ_U(recorded, 21);
  CHECK_EQ_U(capacity, 5);
  REQUIRE(n == 5);
  for (size_t i = 0; i < n; i++) CHECK_EQ_U(e[i].seq, 17 + i);
  CHECK_EQ_U(e[4].action, CP_HIST_FREE_COMPLETED);
  CHECK_EQ_U(e[3].action, CP_HIST_FREE_REQUESTED);
  CHECK_EQ_U(e[2].action, CP_HIST_ALLOC);
  /* Fewer slots than records held: the newest. */
  n = cp_pool_history_read(fx.pool, e, 2, NULL, NULL);
  REQUIRE(n == 2);
  CHECK_EQ_U(e[0].seq, 20);
  CHECK_EQ_U(e[1].seq, 21);
  /* Exactly full, before and after one more wrap. */
  REQUIRE(cp_pool_history_enable(fx.pool, 3) == CP_OK); /* resizing drops; numbering goes on */
  CHECK_EQ_U(cp_pool_history_read(fx.pool, e, RING, NULL, NULL), 0);
  cp_free(fx.pool, must_alloc(&fx, 512, 0));
  n = cp_pool_history_read(fx.pool, e, RING, &recorded, NULL);
  REQUIRE(n == 3);
  CHECK_EQ_U(e[0].seq, 22);
  CHECK_EQ_U(e[2].seq, 24);
  CHECK_EQ_U(recorded, 24);
  cp_free(fx.pool, must_alloc(&fx, 512, 0));
  n = cp_pool_history_read(fx.pool, e, RING, NULL, NULL);
  REQUIRE(n == 3);
  CHECK_EQ_U(e[0].seq, 25);
  CHECK_EQ_U(e[0].action, CP_HIST_ALLOC);
  /* Off: nothing held, nothing recorded. */
  REQUIRE(cp_pool_history_enable(fx.pool, 0) == CP_OK);
  cp_free(fx.pool, must_alloc(&fx, 512, 0));
  CHECK_EQ_U(cp_pool_history_read(fx.pool, e, RING, &recorded, &capacity), 0);
  CHECK_EQ_U(capacity, 0);
  CHECK_EQ_U(recorded, 27);
  cp_free(fx.pool, keep);
  fx_close(&fx);
}

TEST(oom_is_recorded_with_its_context) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 8 * MiB, "") == 0);
  REQUIRE(cp_pool_history_enable(fx.pool, RING) == CP_OK);
  void *p = NULL;
  cp_history_set_context(5);
  CHECK(cp_alloc(fx.pool, 64 * MiB, 3, &p) == CP_ERR_OOM);
  cp_history_set_context(0);
  cp_history_entry_t e[RING];
  size_t n = read_all(&fx, e, NULL);
  REQUIRE(n >= 1);
  CHECK_EQ_U(e[n - 1].action, CP_HIST_OOM);
  CHECK_EQ_U(e[n - 1].size, 64 * MiB);
  CHECK_EQ_U(e[n - 1].stream, 3);
  CHECK_EQ_U(e[n - 1].context, 5);
  fx_close(&fx);
}

TEST(snapshot_of_plain_segments) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, "") == 0);
  cp_snapshot_t snap;
  REQUIRE(cp_pool_snapshot(fx.pool, &snap) == CP_OK); /* empty pool */
  CHECK_EQ_U(snap.segment_count, 0);
  CHECK_EQ_U(snap.block_count, 0);
  cp_snapshot_free(&snap);
  void *a = must_alloc(&fx, 1000, 0);
  void *b = must_alloc(&fx, 3000, 0);
  void *c = must_alloc(&fx, 5 * MiB, 4);
  cp_free(fx.pool, a);
  REQUIRE(cp_pool_snapshot(fx.pool, &snap) == CP_OK);
  REQUIRE(snap.segment_count == 2);
  size_t blocks = 0;
  for (size_t i = 0; i < snap.segment_count; i++) {
    const cp_snapshot_segment_t *s = &snap.segments[i];
    if (i > 0) CHECK(s->addr > snap.segments[i - 1].addr);
    CHECK_EQ_U(s->page_mapped, 0);
    CHECK_EQ_U(s->mapped, s->size);
    uintptr_t at = s->addr;
    for (size_t k = 0; k < s->block_count; k++) { /* the blocks tile the segment */
      const cp_snapshot_block_t *bl = &snap.blocks[s->first_block + k];
      CHECK_EQ_U(bl->addr, at);
      at += bl->size;
    }
    CHECK_EQ_U(at, s->addr + s->size);
    blocks += s->block_count;
    if (s->kind == CP_KIND_SMALL) {
      CHECK_EQ_U(s->size, 2 * MiB);
      CHECK_EQ_U(s->stream, 0);
      REQUIRE(s->block_count == 3); /* a freed, b live, the rest free */
      const cp_snapshot_block_t *bl = &snap.blocks[s->first_block];
      CHECK_EQ_U(bl[0].state, CP_SNAP_FREE);
      CHECK_EQ_U(bl[0].requested, 0);
      CHECK_EQ_U(bl[1].state, CP_SNAP_LIVE);
      CHECK_EQ_U(bl[1].addr, (uintptr_t)b);
      CHECK_EQ_U(bl[1].requested, 3000);
      CHECK_EQ_U(bl[2].state, CP_SNAP_FREE);
    } else {
      CHECK_EQ_U(s->kind, CP_KIND_LARGE);
      CHECK_EQ_U(s->stream, 4);
      CHECK_EQ_U(s->size, 20 * MiB);
    }
  }
  CHECK_EQ_U(blocks, snap.block_count);
  cp_snapshot_free(&snap);
  cp_snapshot_free(&snap); /* twice: already empty */
  cp_free(fx.pool, b);
  cp_free(fx.pool, c);
  fx_close(&fx);
}

TEST(page_mapped_segments_and_their_records) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, "expandable_segments:True") == 0);
  REQUIRE(cp_pool_history_enable(fx.pool, RING) == CP_OK);
  void *a = must_alloc(&fx, 4 * MiB, 0);
  void *b = must_alloc(&fx, 30 * MiB, 0); /* grows the segment in place */
  cp_snapshot_t snap;
  REQUIRE(cp_pool_snapshot(fx.pool, &snap) == CP_OK);
  REQUIRE(snap.segment_count == 1);
  const cp_snapshot_segment_t *s = &snap.segments[0];
  CHECK_EQ_U(s->page_mapped, 1);
  CHECK_EQ_U(s->mapped, 40 * MiB);
  CHECK(s->size > s->mapped);
  const cp_snapshot_block_t *last = &snap.blocks[s->first_block + s->block_count - 1];
  CHECK_EQ_U(last->state, CP_SNAP_UNMAPPED);
  CHECK_EQ_U(snap.blocks[s->first_block].state, CP_SNAP_LIVE);
  cp_snapshot_free(&snap);
  cp_free(fx.pool, b);
  CHECK(cp_empty_cache(fx.pool) == CP_OK);
  cp_history_entry_t e[RING];
  size_t n = read_all(&fx, e, NULL);
  size_t map1 = find(e, n, 0, CP_HIST_SEGMENT_MAP);
  REQUIRE(map1 < n);
  CHECK_EQ_U(e[map1].size, 20 * MiB);
  CHECK(map1 < find(e, n, 0, CP_HIST_ALLOC));
  size_t map2 = find(e, n, map1 + 1, CP_HIST_SEGMENT_MAP);
  REQUIRE(map2 < n);
  CHECK_EQ_U(e[map2].addr, e[map1].addr + 20 * MiB);
  size_t unmap = find(e, n, 0, CP_HIST_SEGMENT_UNMAP);
  REQUIRE(unmap < n);
  CHECK_EQ_U(e[unmap].addr, e[map1].addr + 20 * MiB); /* the first chunk still holds `a` */
  CHECK_EQ_U(e[unmap].size, 20 * MiB);
  CHECK_EQ_U(find(e, n, 0, CP_HIST_SEGMENT_ALLOC), n); /* no plain segment */
  cp_free(fx.pool, a);
  fx_close(&fx);
}

TEST(bad_arguments) {
  cp_snapshot_t snap;
  CHECK(cp_pool_snapshot(NULL, &snap) == CP_ERR_INVALID);
  CHECK_EQ_U(snap.segment_count, 0);
  CHECK(cp_pool_snapshot(NULL, NULL) == CP_ERR_INVALID);
  cp_snapshot_free(NULL);
  CHECK(cp_pool_history_enable(NULL, 4) == CP_ERR_INVALID);
  uint64_t recorded = 1;
  size_t capacity = 1;
  CHECK_EQ_U(cp_pool_history_read(NULL, NULL, 0, &recorded, &capacity), 0);
  CHECK_EQ_U(recorded + capacity, 0);
  fixture_t fx;
  REQUIRE(fx_open(&fx, 64 * MiB, "") == 0);
  CHECK(cp_pool_history_enable(fx.pool, SIZE_MAX) == CP_ERR_INVALID);
  CHECK(contains(cp_last_error(), "do not fit"));
  size_t capacity2 = 9;
  CHECK_EQ_U(cp_pool_history_read(fx.pool, NULL, 10, NULL, &capacity2), 0);
  CHECK_EQ_U(capacity2, 0);
  fx_close(&fx);
}

int main(void) {
  RUN(off_by_default);
  RUN(records_each_action_in_order);
  RUN(reuse_records_alloc_without_segment);
  RUN(pending_free_completes_later);
  RUN(ring_wraps_and_keeps_the_newest);
  RUN(oom_is_recorded_with_its_context);
  RUN(snapshot_of_plain_segments);
  RUN(page_mapped_segments_and_their_records);
  RUN(bad_arguments);
  return check_summary("test_history");
}
