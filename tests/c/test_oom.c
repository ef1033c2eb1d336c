/* test_oom.c — the out-of-memory record (its figures equal the statistics at the failure, and
 * the report is written from it), the per-stream breakdown, and the event log. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/sim.h"
#include "check.h"
#include "core/cp.h"
#include "fixture.h"

#define CUR(s, fam) ((s).family[CP_STAT_##fam][CP_KIND_ALL].current)

TEST(no_failure_no_record) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 64 * MiB, NULL) == 0);
  cp_oom_info_t in;
  memset(&in, 0xab, sizeof in);
  CHECK(cp_pool_last_oom(fx.pool, &in) == 0);
  CHECK_EQ_U(in.sequence, 0);
  CHECK_EQ_U(in.requested, 0);
  fx_close(&fx);
}

/* 20 MiB device, one 20 MiB segment: 6 MiB live, 14 MiB free in two blocks; 12 MiB fails. */
TEST(record_equals_the_statistics_at_the_failure) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 20 * MiB, NULL) == 0);
  void *a = must_alloc(&fx, 3 * MiB, 5);
  void *b = must_alloc(&fx, 3 * MiB, 5);
  void *c = must_alloc(&fx, 3 * MiB, 5);
  CHECK(cp_free(fx.pool, b) == CP_OK);
  void *p = NULL;
  cp_clear_error();
  REQUIRE(cp_alloc(fx.pool, 12 * MiB, 5, &p) == CP_ERR_OOM);
  char message[4096];
  snprintf(message, sizeof message, "%s", cp_last_error());
  cp_stats_t s = stats_of(&fx);
  cp_oom_info_t in;
  REQUIRE(cp_pool_last_oom(fx.pool, &in) == 1);
  CHECK_EQ_U(in.sequence, 1);
  CHECK(in.time_ns > 0);
  CHECK_EQ_U(in.device, 0);
  CHECK(strcmp(in.backend, "sim") == 0);
  CHECK_EQ_U(in.stream, 5);
  CHECK_EQ_U(in.requested, 12 * MiB);
  CHECK_EQ_U(in.rounded, 12 * MiB);
  CHECK_EQ_U(in.reserved, CUR(s, RESERVED_BYTES));
  CHECK_EQ_U(in.allocated, CUR(s, ALLOCATED_BYTES));
  CHECK_EQ_U(in.reserved, 20 * MiB);
  CHECK_EQ_U(in.allocated, 6 * MiB);
  CHECK_EQ_U(in.cached_free, 14 * MiB);
  CHECK_EQ_U(in.free_blocks, 2);
  CHECK_EQ_U(in.largest_free_block, 11 * MiB);
  CHECK(in.fragmentation > 0.2142 && in.fragmentation < 0.2143); /* 1 - 11/14 */
  CHECK_EQ_U(in.pending_free, 0);
  CHECK_EQ_U(in.segments, (uint64_t)CUR(s, SEGMENT));
  CHECK_EQ_U(in.live_blocks, (uint64_t)CUR(s, ALLOCATION));
  CHECK_EQ_U(in.device_total, 20 * MiB);
  CHECK_EQ_U(in.device_free, 0);
  CHECK_EQ_U(in.memory_cap, 0);
  CHECK_EQ_U(in.num_ooms, (uint64_t)s.num_ooms);
  CHECK_EQ_U(in.num_ooms, 1);
  CHECK_EQ_U(in.log_event, UINT64_MAX); /* no log kept */
  CHECK_EQ_U(in.stream_count, 1);
  CHECK_EQ_U(in.streams[0].stream, 5);
  CHECK_EQ_U(in.streams[0].cached_free, 14 * MiB);
  CHECK_EQ_U(in.other_streams, 0);
  /* The exception's text is the record's. */
  char again[4096];
  int n = cp_oom_format(&in, again, sizeof again);
  CHECK(n > 0 && (size_t)n < sizeof again);
  CHECK(strcmp(message, again) == 0);
  CHECK(contains(message, "Tried to allocate 12.00 MiB (12582912 bytes) on stream 0x5."));
  CHECK(contains(message, "largest free block 11.00 MiB, fragmentation 21.4%"));
  CHECK(contains(message, "By stream: stream 0x5 (this request's): 14.00 MiB free in 2 blocks (largest 11.00 MiB)"));
  CHECK(contains(message, "fragmented"));
  /* A second failure replaces the record. */
  cp_pool_set_memory_cap(fx.pool, 20 * MiB);
  REQUIRE(cp_alloc(fx.pool, 13 * MiB, 5, &p) == CP_ERR_OOM);
  REQUIRE(cp_pool_last_oom(fx.pool, &in) == 1);
  CHECK_EQ_U(in.sequence, 2);
  CHECK_EQ_U(in.requested, 13 * MiB);
  CHECK_EQ_U(in.memory_cap, 20 * MiB);
  CHECK(cp_free(fx.pool, a) == CP_OK);
  CHECK(cp_free(fx.pool, c) == CP_OK);
  fx_close(&fx);
}

/* Free blocks of each stream, pending ones back to their allocation stream; beyond
 * CP_OOM_STREAMS streams, the ones with the least unused memory are summed in `other`. */
TEST(per_stream_breakdown) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 1 << 30, NULL) == 0);
  enum { STREAMS = CP_OOM_STREAMS + 3 };
  void *keep[STREAMS];
  for (int i = 0; i < STREAMS; i++) {
    /* stream i+1: a 2 MiB small segment with (i + 1) * 64 KiB live, the rest free */
    keep[i] = must_alloc(&fx, (size_t)(i + 1) * 64 * KiB, (cp_stream_t)(i + 1));
  }
  void *used = must_alloc(&fx, 100 * KiB, 1);
  CHECK(cp_record_stream(fx.pool, used, 99) == CP_OK);
  launch(&fx, 99, used, 1);
  CHECK(cp_free(fx.pool, used) == CP_OK); /* PENDING: waits for stream 99, returns to stream 1 */
  cp_oom_info_t in;
  cp_pool_oom_now(fx.pool, 4 * MiB, 2, &in);
  CHECK_EQ_U(in.sequence, 0);
  CHECK_EQ_U(in.stream, 2);
  CHECK_EQ_U(in.stream_count, CP_OOM_STREAMS);
  CHECK_EQ_U(in.other_streams, STREAMS - CP_OOM_STREAMS + 1); /* and stream 99, with nothing unused */
  /* most unused first: stream 1 (free + the pending 100 KiB), then 2, 3, ... */
  CHECK_EQ_U(in.streams[0].stream, 1);
  CHECK_EQ_U(in.streams[0].pending_free, 100 * KiB);
  CHECK_EQ_U(in.streams[0].pending_blocks, 1);
  CHECK_EQ_U(in.streams[0].cached_free, 2 * MiB - 64 * KiB - 100 * KiB);
  for (size_t i = 1; i < in.stream_count; i++) {
    CHECK_EQ_U(in.streams[i].stream, i + 1);
    CHECK_EQ_U(in.streams[i].cached_free, 2 * MiB - (i + 1) * 64 * KiB);
    CHECK_EQ_U(in.streams[i].pending_free, 0);
  }
  size_t other = 0;
  for (int i = CP_OOM_STREAMS; i < STREAMS; i++) other += 2 * MiB - (size_t)(i + 1) * 64 * KiB;
  CHECK_EQ_U(in.other.cached_free, other);
  CHECK_EQ_U(in.other.free_blocks, STREAMS - CP_OOM_STREAMS);
  /* the totals are the sums */
  size_t cached = in.other.cached_free, pending = in.other.pending_free;
  for (size_t i = 0; i < in.stream_count; i++) {
    cached += in.streams[i].cached_free;
    pending += in.streams[i].pending_free;
  }
  CHECK_EQ_U(in.cached_free, cached);
  CHECK_EQ_U(in.pending_free, pending);
  CHECK_EQ_U(in.pending_free, 100 * KiB);
  cp_pool_info_t info;
  cp_pool_info(fx.pool, &info);
  CHECK_EQ_U(in.cached_free, info.cached_free);
  CHECK_EQ_U(in.pending_free, info.pending_free);
  CHECK_EQ_U(in.reserved, in.allocated + in.cached_free + in.pending_free);
  char text[4096];
  int n = cp_oom_format(&in, text, sizeof text);
  CHECK(n > 0 && (size_t)n < sizeof text);
  CHECK(contains(text, "stream 0x1: "));
  CHECK(contains(text, "100.00 KiB waiting in 1 block"));
  CHECK(contains(text, "stream 0x2 (this request's)"));
  CHECK(contains(text, "4 other streams: "));
  /* a short buffer: snprintf's rule, NUL-terminated */
  char small[40];
  CHECK(cp_oom_format(&in, small, sizeof small) == n);
  CHECK(strlen(small) == sizeof small - 1);
  cp_sim_complete_all(fx.sim);
  for (int i = 0; i < STREAMS; i++) CHECK(cp_free(fx.pool, keep[i]) == CP_OK);
  fx_close(&fx);
}

/* A free block big enough exists, but on another stream. */
TEST(large_enough_block_on_another_stream) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 20 * MiB, NULL) == 0);
  void *a = must_alloc(&fx, 12 * MiB, 1);
  CHECK(cp_free(fx.pool, a) == CP_OK);
  void *p;
  REQUIRE(cp_alloc(fx.pool, 12 * MiB, 2, &p) == CP_OK); /* the retry gave the segment back */
  CHECK(cp_free(fx.pool, p) == CP_OK);
  cp_oom_info_t in;
  cp_pool_oom_now(fx.pool, 12 * MiB, 1, &in);
  char text[4096];
  cp_oom_format(&in, text, sizeof text);
  CHECK(contains(text, "A free block large enough is cached, but for another stream."));
  fx_close(&fx);
}

TEST(event_log) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 32 * MiB, NULL) == 0);
  cp_event_log_t log;
  REQUIRE(cp_pool_event_log(fx.pool, &log) == CP_OK);
  CHECK_EQ_U(log.capacity, 0);
  CHECK_EQ_U(log.n_events, 0);
  CHECK_EQ_U(log.n_live, 0);
  cp_event_log_release(&log);
  void *x = must_alloc(&fx, 1000, 0); /* before the log: not in it, but live */

  CHECK(cp_pool_set_event_log(fx.pool, CP_EVENT_LOG_MAX + 1) == CP_ERR_INVALID);
  CHECK(contains(cp_last_error(), "more than"));
  CHECK(cp_pool_set_event_log(NULL, 4) == CP_ERR_INVALID);
  REQUIRE(cp_pool_set_event_log(fx.pool, 3) == CP_OK); /* rounds up to 4 */
  void *a = must_alloc(&fx, 3 * MiB, 7);               /* event 0 */
  void *b = must_alloc(&fx, 3 * MiB, 7);               /* 1 */
  CHECK(cp_free(fx.pool, a) == CP_OK);                 /* 2 */
  REQUIRE(cp_pool_event_log(fx.pool, &log) == CP_OK);
  CHECK_EQ_U(log.capacity, 4);
  CHECK_EQ_U(log.first, 0);
  CHECK_EQ_U(log.next, 3);
  REQUIRE(log.n_events == 3);
  CHECK(log.events[0].action == CP_TRACE_ALLOC && log.events[0].id == (uintptr_t)a);
  CHECK_EQ_U(log.events[0].size, 3 * MiB);
  CHECK_EQ_U(log.events[0].stream, 7);
  CHECK(log.events[0].time_ns == -1 && log.events[0].device == 0);
  CHECK(log.events[2].action == CP_TRACE_FREE && log.events[2].id == (uintptr_t)a);
  CHECK_EQ_U(log.events[2].stream, 7);
  REQUIRE(log.n_live == 2); /* x and b, whatever their order */
  uint64_t ids = log.live[0].id ^ log.live[1].id;
  CHECK(ids == ((uintptr_t)x ^ (uintptr_t)b));
  for (size_t i = 0; i < log.n_live; i++) {
    CHECK(log.live[i].action == CP_TRACE_ALLOC);
    CHECK_EQ_U(log.live[i].size, log.live[i].id == (uintptr_t)x ? 1000 : 3 * MiB);
  }
  cp_event_log_release(&log);
  CHECK(log.events == NULL && log.live == NULL);
  cp_event_log_release(NULL);

  void *p;
  REQUIRE(cp_alloc(fx.pool, 30 * MiB, 7, &p) == CP_ERR_OOM); /* 3: logged as failed */
  void *c = must_alloc(&fx, 2 * MiB, 7);                     /* 4 */
  CHECK(cp_free(fx.pool, c) == CP_OK);                       /* 5 */
  cp_oom_info_t in;
  REQUIRE(cp_pool_last_oom(fx.pool, &in) == 1);
  CHECK_EQ_U(in.log_event, 3);
  REQUIRE(cp_pool_event_log(fx.pool, &log) == CP_OK);
  CHECK_EQ_U(log.first, 2); /* the ring holds the latest 4 */
  CHECK_EQ_U(log.next, 6);
  REQUIRE(log.n_events == 4);
  CHECK(log.events[1].action == CP_TRACE_ALLOC_FAILED && log.events[1].id == 0);
  CHECK_EQ_U(log.events[1].size, 30 * MiB);
  CHECK(log.events[3].action == CP_TRACE_FREE && log.events[3].id == (uintptr_t)c);
  cp_event_log_release(&log);

  REQUIRE(cp_pool_set_event_log(fx.pool, 0) == CP_OK); /* off: nothing kept, numbering goes on */
  CHECK(cp_free(fx.pool, b) == CP_OK);
  REQUIRE(cp_pool_event_log(fx.pool, &log) == CP_OK);
  CHECK_EQ_U(log.capacity, 0);
  CHECK_EQ_U(log.n_events, 0);
  CHECK_EQ_U(log.next, 6);
  cp_event_log_release(&log);
  REQUIRE(cp_pool_set_event_log(fx.pool, 8) == CP_OK);
  CHECK(cp_free(fx.pool, x) == CP_OK);
  REQUIRE(cp_pool_event_log(fx.pool, &log) == CP_OK);
  CHECK_EQ_U(log.first, 6);
  CHECK_EQ_U(log.n_events, 1);
  CHECK_EQ_U(log.n_live, 0);
  cp_event_log_release(&log);
  CHECK(cp_pool_event_log(NULL, &log) == CP_ERR_INVALID);
  fx_close(&fx);
}

int main(void) {
  RUN(no_failure_no_record);
  RUN(record_equals_the_statistics_at_the_failure);
  RUN(per_stream_breakdown);
  RUN(large_enough_block_on_another_stream);
  RUN(event_log);
  return check_summary("test_oom");
}
