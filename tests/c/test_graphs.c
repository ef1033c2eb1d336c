/* test_graphs.c — graph capture: the pool's capture windows (no event call, no memory back,
 * deferred frees), the simulated device's capture, and the private pools of CUDA graphs and
 * MemPool ids behind the device table (routing, isolation, release). Runs under ASan+UBSan
 * with the invariant check after every pool operation. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/sim.h"
#include "check.h"
#include "core/checkpoint.h"
#include "core/cp.h"
#include "core/snapshot.h"
#include "devices/abi.h"
#include "devices/devices.h"
#include "devices/graphs.h"

#define MiB ((size_t)1 << 20)

static uint64_t event_calls(const cp_sim_t *sim) {
  return cp_sim_calls(sim, CP_SIM_EVENT_RECORD) + cp_sim_calls(sim, CP_SIM_EVENT_QUERY) +
         cp_sim_calls(sim, CP_SIM_EVENT_SYNCHRONIZE);
}

static int make_pool(cp_sim_t **sim, cp_pool_t **pool, size_t capacity) {
  cp_config_t cfg;
  cp_config_default(&cfg);
  if (cp_sim_create(capacity, 0, sim) != CP_OK) return 0;
  cp_backend_t backend;
  cp_sim_backend(*sim, &backend);
  return cp_pool_create(&cfg, &backend, pool) == CP_OK;
}

TEST(capture_window_makes_no_event_call_and_gives_nothing_back) {
  cp_sim_t *sim;
  cp_pool_t *pool;
  REQUIRE(make_pool(&sim, &pool, 64 * MiB));
  void *a, *b, *c, *d;
  REQUIRE(cp_alloc(pool, MiB, 1, &a) == CP_OK);
  REQUIRE(cp_alloc(pool, MiB, 1, &b) == CP_OK);
  REQUIRE(cp_record_stream(pool, a, 2) == CP_OK);
  REQUIRE(cp_free(pool, b) == CP_OK); /* cached, reusable on stream 1 */
  REQUIRE(cp_pool_capture_begin(pool) == CP_OK);
  cp_sim_reset_counters(sim);
  /* A free with a use on another stream waits for the end of the capture, allocated. */
  CHECK(cp_free(pool, a) == CP_OK);
  CHECK(cp_free(pool, a) == CP_ERR_INVALID); /* its second free is refused */
  unsigned windows;
  size_t deferred;
  cp_pool_capture_state(pool, &windows, &deferred);
  CHECK_EQ_U(windows, 1);
  CHECK_EQ_U(deferred, 1);
  CHECK(cp_pool_lookup(pool, a, NULL));
  /* Reuse of the cache, growth, empty_cache: no event call, nothing released. */
  CHECK(cp_alloc(pool, MiB, 1, &c) == CP_OK && c == b);
  CHECK(cp_alloc(pool, 30 * MiB, 1, &d) == CP_OK);
  CHECK(cp_empty_cache(pool) == CP_OK);
  CHECK(cp_free(pool, d) == CP_OK);
  /* Out of memory fails at once: no wait for pending frees, no cache emptied. */
  void *e = NULL;
  CHECK(cp_alloc(pool, 60 * MiB, 1, &e) == CP_ERR_OOM);
  CHECK_EQ_U(event_calls(sim), 0);
  CHECK_EQ_U(cp_sim_calls(sim, CP_SIM_RELEASE), 0);
  CHECK_EQ_U(cp_sim_calls(sim, CP_SIM_RESERVE), 2); /* the 30 MiB segment and the refused try */
  CHECK_EQ_U(cp_pool_check(pool, stderr), 0);
  /* Closing the last window frees the deferred block: its event is recorded now. */
  CHECK(cp_pool_capture_end(pool) == CP_OK);
  CHECK(cp_pool_capture_end(pool) == CP_ERR_STATE);
  cp_pool_capture_state(pool, &windows, &deferred);
  CHECK_EQ_U(windows, 0);
  CHECK_EQ_U(deferred, 0);
  CHECK_EQ_U(cp_sim_calls(sim, CP_SIM_EVENT_RECORD), 1);
  CHECK(!cp_pool_lookup(pool, a, NULL));
  CHECK(cp_free(pool, c) == CP_OK);
  cp_sim_complete_all(sim);
  CHECK(cp_empty_cache(pool) == CP_OK);
  size_t allocated, reserved;
  cp_pool_usage(pool, &allocated, &reserved);
  CHECK_EQ_U(allocated, 0);
  CHECK_EQ_U(reserved, 0);
  CHECK_EQ_U(cp_sim_capture_violations(sim), 0);
  CHECK_EQ_U(cp_pool_check(pool, stderr), 0);
  cp_pool_destroy(pool);
  cp_sim_destroy(sim);
}

TEST(a_capturing_stream_without_a_window_is_respected) {
  cp_sim_t *sim;
  cp_pool_t *pool;
  REQUIRE(make_pool(&sim, &pool, 64 * MiB));
  void *a, *b, *c;
  REQUIRE(cp_alloc(pool, MiB, 1, &a) == CP_OK);
  REQUIRE(cp_alloc(pool, MiB, 1, &b) == CP_OK);
  REQUIRE(cp_record_stream(pool, a, 2) == CP_OK);
  REQUIRE(cp_free(pool, a) == CP_OK); /* PENDING: an event on stream 2 */
  REQUIRE(cp_record_stream(pool, b, 2) == CP_OK);
  /* The simulated device refuses event calls while a stream captures, as the driver does. */
  REQUIRE(cp_sim_set_capturing(sim, 1, 1) == CP_OK);
  cp_backend_t backend;
  cp_sim_backend(sim, &backend);
  int done = 0, capturing = 0;
  CHECK(backend.event_query(sim, 1, &done) == CP_ERR_BACKEND);
  CHECK(strstr(cp_last_error(), "capturing") != NULL);
  CHECK_EQ_U(cp_sim_capture_violations(sim), 1);
  CHECK(backend.stream_capturing(sim, 1, &capturing) == CP_OK && capturing == 1);
  CHECK(backend.stream_capturing(sim, 3, &capturing) == CP_OK && capturing == 0);
  CHECK(backend.stream_capturing(sim, 3, NULL) == CP_ERR_INVALID);
  /* The pool asks and polls nothing: an allocation on the capturing stream grows instead of
   * waiting for the pending block, and a free with uses is deferred. */
  CHECK(cp_alloc(pool, MiB, 1, &c) == CP_OK && c != a);
  CHECK(cp_free(pool, b) == CP_OK);
  size_t deferred;
  cp_pool_capture_state(pool, NULL, &deferred);
  CHECK_EQ_U(deferred, 1);
  CHECK_EQ_U(cp_sim_capture_violations(sim), 1);
  CHECK(cp_sim_calls(sim, CP_SIM_STREAM_CAPTURING) > 0);
  /* The capture ends: the next allocation frees the deferred block and polls again. */
  REQUIRE(cp_sim_set_capturing(sim, 1, 0) == CP_OK);
  void *e;
  CHECK(cp_alloc(pool, 4096, 1, &e) == CP_OK);
  cp_pool_capture_state(pool, NULL, &deferred);
  CHECK_EQ_U(deferred, 0);
  CHECK(!cp_pool_lookup(pool, b, NULL));
  CHECK_EQ_U(cp_sim_capture_violations(sim), 1);
  CHECK(cp_free(pool, c) == CP_OK && cp_free(pool, e) == CP_OK);
  CHECK(cp_sim_set_capturing(NULL, 1, 1) == CP_ERR_INVALID);
  CHECK_EQ_U(cp_pool_check(pool, stderr), 0);
  cp_pool_destroy(pool);
  cp_sim_destroy(sim);
}

/* Filters as torch's: an allocation on stream `*ctx` goes to the window's pool. */
static int filters_freed;
static int on_stream(void *ctx, void *stream) { return (uintptr_t)stream == *(uintptr_t *)ctx; }
static void free_filter(void *ctx) {
  filters_freed++;
  free(ctx);
}
static void *stream_ctx(uintptr_t stream) {
  uintptr_t *p = malloc(sizeof *p);
  *p = stream;
  return p;
}

static size_t shared_allocated(int device) {
  size_t allocated = 0, reserved = 0;
  cp_pool_usage(cpd_pool_if_created(device), &allocated, &reserved);
  return allocated;
}

TEST(graph_pools_route_isolate_and_go_when_released) {
  REQUIRE(cpd_use_sim(64 * MiB, 2, 0) == CP_OK);
  filters_freed = 0;
  void *cached, *p, *q, *r;
  REQUIRE(cpd_alloc(MiB, 0, (void *)5, &cached) == CP_OK);
  cudapool_free(cached, MiB, 0, (void *)5); /* a cached block in the shared pool */
  CHECK(!cpd_graph_pools_exist());
  REQUIRE(cpd_graph_begin(0, 7, 0, on_stream, stream_ctx(5), free_filter) == CP_OK);
  CHECK(cpd_graph_pools_exist());
  cp_pool_t *shared = cpd_pool_if_created(0);
  unsigned windows;
  cp_pool_capture_state(shared, &windows, NULL);
  CHECK_EQ_U(windows, 1); /* the shared pool is in the capture too */
  /* Stream 5 goes to the graph's pool (not to the shared cache), stream 6 to the shared one. */
  REQUIRE(cpd_alloc(MiB, 0, (void *)5, &p) == CP_OK);
  REQUIRE(cpd_alloc(MiB, 0, (void *)6, &q) == CP_OK);
  CHECK(p != cached);
  cp_pool_t *gpool = cpd_graph_pool(0, 7, 0);
  REQUIRE(gpool != NULL);
  CHECK(cp_pool_lookup(gpool, p, NULL) && !cp_pool_lookup(gpool, q, NULL));
  CHECK_EQ_U(shared_allocated(0), MiB);
  /* Device 1 has no window: nothing is routed there. */
  REQUIRE(cpd_alloc(MiB, 1, (void *)5, &r) == CP_OK);
  CHECK(!cp_pool_lookup(gpool, r, NULL));
  cudapool_free(r, MiB, 1, (void *)5);
  /* A second window on the same pool is refused; its filter is freed. */
  CHECK(cpd_graph_begin(0, 7, 0, on_stream, stream_ctx(5), free_filter) == CP_ERR_STATE);
  CHECK_EQ_U(filters_freed, 1);
  /* Frees, record_stream and base_alloc find the graph's pool. */
  cudapool_record_stream(p, (void *)9);
  size_t seg = 0;
  CHECK(cudapool_base_alloc(p, &seg) == p && seg == 2 * MiB);
  cudapool_free(p, MiB, 0, (void *)5); /* deferred: a use on stream 9, inside the window */
  void *k;
  REQUIRE(cpd_alloc(3 * MiB, 0, (void *)5, &k) == CP_OK);
  CHECK(cp_pool_lookup(gpool, k, NULL));
  cudapool_free(k, 3 * MiB, 0, (void *)5); /* cached in the graph's pool at once */
  CHECK(cpd_graph_end(0, 7, 0) == CP_OK);
  CHECK_EQ_U(filters_freed, 2);
  CHECK(cpd_graph_end(0, 7, 0) == CP_ERR_STATE);
  cp_pool_capture_state(shared, &windows, NULL);
  CHECK_EQ_U(windows, 0);
  /* Outside the window stream 5 is the shared pool's again; the graph's block stays its own. */
  void *s;
  REQUIRE(cpd_alloc(MiB, 0, (void *)5, &s) == CP_OK);
  CHECK(s == cached && !cp_pool_lookup(gpool, s, NULL));
  /* A second capture into the same pool (a graph sharing another's pool) reuses its blocks. */
  REQUIRE(cpd_graph_begin(0, 7, 0, on_stream, stream_ctx(5), free_filter) == CP_OK);
  void *p2;
  REQUIRE(cpd_alloc(3 * MiB, 0, (void *)5, &p2) == CP_OK);
  CHECK(p2 == k);
  CHECK(cpd_graph_end(0, 7, 0) == CP_OK);
  cpd_graph_info_t info[4];
  CHECK_EQ_U(cpd_graph_pools(info, 4), 1);
  CHECK(info[0].device == 0 && info[0].id0 == 7 && info[0].uses == 2 && !info[0].window_open);
  CHECK_EQ_U(info[0].allocated, 3 * MiB);
  /* Released twice (two captures), with a live output: the pool stays until it is freed. */
  CHECK(cpd_graph_release(0, 7, 0) == CP_OK);
  CHECK(cpd_graph_release(0, 7, 0) == CP_OK);
  CHECK(cpd_graph_release(0, 7, 0) == CP_ERR_STATE);
  CHECK_EQ_U(cpd_graph_pools(info, 4), 1);
  size_t before = cp_sim_reserved_bytes(cpd_sim(0));
  cudapool_free(p2, 3 * MiB, 0, (void *)5); /* the pending one is waited for, then all goes */
  CHECK_EQ_U(cpd_graph_pools(info, 4), 0);
  CHECK(!cpd_graph_pools_exist());
  CHECK_EQ_U(cp_sim_reserved_bytes(cpd_sim(0)), before - 2 * MiB - 20 * MiB);
  cudapool_free(q, MiB, 0, (void *)6);
  cudapool_free(s, MiB, 0, (void *)5);
  CHECK_EQ_U(shared_allocated(0), 0);
  CHECK_EQ_U(cp_sim_capture_violations(cpd_sim(0)), 0);
  cpd_shutdown();
}

TEST(graph_pools_keep_plain_segments_under_page_stitching) {
  /* page_stitching alone turns paging on: a graph's private pool must clear it too (its
   * captured kernels keep their addresses, and nothing of it may be unmapped or stitched). */
  cp_config_t cfg;
  cp_config_default(&cfg);
  REQUIRE(cp_config_parse(&cfg, "page_stitching:True") == CP_OK);
  REQUIRE(cpd_configure(&cfg) == CP_OK);
  REQUIRE(cpd_use_sim(64 * MiB, 1, 0) == CP_OK);
  REQUIRE(cpd_graph_begin(0, 11, 0, on_stream, stream_ctx(5), free_filter) == CP_OK);
  void *p = NULL;
  REQUIRE(cpd_alloc(3 * MiB, 0, (void *)5, &p) == CP_OK);
  cp_pool_t *gpool = cpd_graph_pool(0, 11, 0);
  REQUIRE(gpool != NULL);
  cp_pool_info_t in;
  cp_pool_info(gpool, &in);
  CHECK_EQ_U(in.page_mapped, 0);
  CHECK_EQ_U(in.page_segments, 0);
  CHECK(cpd_graph_end(0, 11, 0) == CP_OK);
  cudapool_free(p, 3 * MiB, 0, (void *)5);
  CHECK(cpd_graph_release(0, 11, 0) == CP_OK);
  CHECK_EQ_U(cp_sim_device_faults(cpd_sim(0)), 0);
  cpd_shutdown();
  cp_config_default(&cfg);
  REQUIRE(cpd_configure(&cfg) == CP_OK);
}

/* Note [Graph regions]: a graph captured in a region gets a page-mapped private pool of that
 * region; pausing the region gives back every byte of it, the intermediates freed during the
 * capture included, and resuming maps them at the same addresses so that a replay (work on
 * those addresses) runs without a fault. */
TEST(graph_region_pause_gives_back_every_byte_a_replay_uses) {
  cp_config_t cfg;
  cp_config_default(&cfg);
  REQUIRE(cp_config_parse(&cfg, "expandable_segments:True,page_stitching:True") == CP_OK);
  REQUIRE(cpd_configure(&cfg) == CP_OK);
  REQUIRE(cpd_use_sim(256 * MiB, 1, 0) == CP_OK);
  uint32_t tag = 0;
  REQUIRE(cp_region_id("graph_test", &tag) == CP_OK);
  const uint32_t outer = cp_region_enter(tag);
  REQUIRE(cpd_graph_begin(0, 21, 0, on_stream, stream_ctx(5), free_filter) == CP_OK);
  void *tmp = NULL, *out = NULL;
  REQUIRE(cpd_alloc(8 * MiB, 0, (void *)5, &tmp) == CP_OK); /* an intermediate */
  REQUIRE(cpd_alloc(4 * MiB, 0, (void *)5, &out) == CP_OK); /* the graph's output, kept */
  cudapool_free(tmp, 8 * MiB, 0, (void *)5);                /* freed during the capture */
  CHECK(cpd_graph_end(0, 21, 0) == CP_OK);
  cp_region_enter(outer);
  cp_pool_t *gpool = cpd_graph_pool(0, 21, 0);
  REQUIRE(gpool != NULL);
  cp_pool_info_t in;
  cp_pool_info(gpool, &in);
  CHECK_EQ_U(in.page_mapped, 1);
  cpd_graph_info_t info[2];
  CHECK_EQ_U(cpd_graph_pools(info, 2), 1);
  CHECK(info[0].tag == tag);
  cp_sim_t *sim = cpd_sim(0);
  /* A replay: kernels on both addresses, still queued when the pause comes. */
  CHECK(cp_sim_launch(sim, 5, (uintptr_t)tmp, 8 * MiB) == CP_OK);
  CHECK(cp_sim_launch(sim, 5, (uintptr_t)out, 4 * MiB) == CP_OK);
  const size_t before = cp_sim_reserved_bytes(sim);
  CHECK(cpd_graph_pause(0, tag, 0) == CP_OK);
  CHECK_EQ_U(cp_sim_device_faults(sim), 0); /* it waited for the replay */
  cp_pool_info(gpool, &in);
  CHECK(in.paused_bytes >= 12 * MiB); /* the freed intermediate's memory too */
  CHECK_EQ_U(cp_sim_reserved_bytes(sim), before - in.paused_bytes);
  CHECK(cpd_graph_resume(0, tag) == CP_OK);
  CHECK(cp_sim_launch(sim, 5, (uintptr_t)tmp, 8 * MiB) == CP_OK); /* the replay runs again */
  CHECK(cp_sim_launch(sim, 5, (uintptr_t)out, 4 * MiB) == CP_OK);
  CHECK_EQ_U(cp_sim_device_faults(sim), 0);
  cp_sim_complete_all(sim);
  CHECK_EQ_U(cp_pool_check(gpool, stderr), 0);
  cudapool_free(out, 4 * MiB, 0, (void *)5);
  CHECK(cpd_graph_release(0, 21, 0) == CP_OK);
  CHECK_EQ_U(cpd_graph_pools(info, 2), 0);
  CHECK_EQ_U(cp_sim_capture_violations(sim), 0);
  cpd_shutdown();
  cp_config_default(&cfg);
  REQUIRE(cpd_configure(&cfg) == CP_OK);
}

/* What cudagraph trees do with their pool, on the device table: record (capture window),
 * checkpoint, replay (kernels still queued), restore while they are, record again around the
 * restored outputs. Under the default policy (the shared pool stitches; graph pools never do)
 * and in a region (the graph pool is page-mapped). */
static void graph_tree_round(const char *conf, const char *region_name) {
  cp_config_t cfg;
  cp_config_default(&cfg);
  REQUIRE(cp_config_parse(&cfg, conf) == CP_OK);
  REQUIRE(cpd_configure(&cfg) == CP_OK);
  REQUIRE(cpd_use_sim(256 * MiB, 1, 0) == CP_OK);
  uint32_t tag = 0, outer = 0;
  if (region_name != NULL) {
    REQUIRE(cp_region_id(region_name, &tag) == CP_OK);
    outer = cp_region_enter(tag);
  }
  REQUIRE(cpd_graph_begin(0, 31, 0, on_stream, stream_ctx(5), free_filter) == CP_OK);
  void *tmp = NULL, *o1 = NULL, *o2 = NULL;
  REQUIRE(cpd_alloc(8 * MiB, 0, (void *)5, &tmp) == CP_OK);
  cp_sim_t *sim = cpd_sim(0); /* made with the device's pool */
  REQUIRE(sim != NULL);
  REQUIRE(cpd_alloc(4 * MiB, 0, (void *)5, &o1) == CP_OK);
  REQUIRE(cpd_alloc(512 * 1024, 0, (void *)5, &o2) == CP_OK);
  cudapool_free(tmp, 8 * MiB, 0, (void *)5);
  CHECK(cpd_graph_end(0, 31, 0) == CP_OK);
  cp_checkpoint_t *ck = NULL;
  REQUIRE(cpd_graph_checkpoint(0, 31, 0, &ck) == CP_OK);
  CHECK_EQ_U(cp_checkpoint_live_count(ck), 2);
  void **live = NULL;
  size_t n = 0;
  CHECK(cpd_graph_live_blocks(0, 31, 0, &live, &n) == CP_OK);
  CHECK(n == 2 && ((live[0] == o1 && live[1] == o2) || (live[0] == o2 && live[1] == o1)));
  free(live);
  /* The outputs die, a replay is queued over all three addresses and has not run. */
  cudapool_free(o1, 4 * MiB, 0, (void *)5);
  cudapool_free(o2, 512 * 1024, 0, (void *)5);
  CHECK(cp_sim_launch(sim, 5, (uintptr_t)tmp, 8 * MiB) == CP_OK);
  CHECK(cp_sim_launch(sim, 5, (uintptr_t)o1, 4 * MiB) == CP_OK);
  CHECK(cp_sim_launch(sim, 5, (uintptr_t)o2, 512 * 1024) == CP_OK);
  /* A warm-up in the pool allocates after the checkpoint. */
  REQUIRE(cpd_graph_begin(0, 31, 0, on_stream, stream_ctx(5), free_filter) == CP_OK);
  void *w = NULL;
  REQUIRE(cpd_alloc(2 * MiB, 0, (void *)5, &w) == CP_OK);
  CHECK(cpd_graph_end(0, 31, 0) == CP_OK);
  cp_restore_t r;
  const size_t reserved = cp_sim_reserved_bytes(sim);
  CHECK(cpd_graph_restore(0, 31, 0, ck, &r) == CP_OK);
  CHECK_EQ_U(r.freed_count, 1);
  CHECK(r.freed_count == 1 && r.freed[0] == w);
  CHECK_EQ_U(r.made_live_count, 2);
  CHECK_EQ_U(cp_sim_reserved_bytes(sim), reserved); /* nothing given back, nothing reserved */
  CHECK_EQ_U(cp_sim_queued_launches(sim), 3);       /* the replay still queued ... */
  CHECK_EQ_U(cp_sim_device_faults(sim), 0);         /* ... and untouched */
  cp_restore_release(&r);
  /* Recording again goes around the restored outputs. */
  REQUIRE(cpd_graph_begin(0, 31, 0, on_stream, stream_ctx(5), free_filter) == CP_OK);
  void *x = NULL;
  REQUIRE(cpd_alloc(4 * MiB, 0, (void *)5, &x) == CP_OK);
  CHECK((char *)x + 4 * MiB <= (char *)o1 || (char *)x >= (char *)o1 + 4 * MiB);
  CHECK(cp_sim_check_handoff(sim, 5, (uintptr_t)x, 4 * MiB) == 0);
  CHECK(cpd_graph_end(0, 31, 0) == CP_OK);
  cudapool_free(x, 4 * MiB, 0, (void *)5);
  cp_sim_complete_all(sim);
  CHECK_EQ_U(cp_sim_device_faults(sim), 0);
  CHECK_EQ_U(cp_sim_capture_violations(sim), 0);
  /* Unknown pools are refused by name. */
  cp_checkpoint_t *none = NULL;
  CHECK(cpd_graph_checkpoint(0, 99, 0, &none) == CP_ERR_INVALID);
  CHECK(strstr(cp_last_error(), "no private pool") != NULL);
  CHECK(cpd_graph_restore(0, 99, 0, ck, &r) == CP_ERR_INVALID);
  cp_restore_release(&r);
  CHECK(cpd_graph_live_blocks(-1, 31, 0, &live, &n) == CP_ERR_INVALID);
  cp_checkpoint_destroy(ck);
  cudapool_free(o1, 4 * MiB, 0, (void *)5);
  cudapool_free(o2, 512 * 1024, 0, (void *)5);
  for (int i = 0; i < 3; i++) CHECK(cpd_graph_release(0, 31, 0) == CP_OK);
  cpd_graph_info_t info[2];
  CHECK_EQ_U(cpd_graph_pools(info, 2), 0);
  if (region_name != NULL) cp_region_enter(outer);
  cpd_shutdown();
  cp_config_default(&cfg);
  REQUIRE(cpd_configure(&cfg) == CP_OK);
}

TEST(graph_trees_restore_with_a_replay_queued) {
  graph_tree_round("expandable_segments:True,page_stitching:True", NULL);
}

TEST(graph_trees_restore_in_a_region) { graph_tree_round("expandable_segments:True,page_stitching:True", "tree"); }

TEST(bad_calls_are_refused_and_shutdown_frees_everything) {
  REQUIRE(cpd_use_sim(64 * MiB, 1, 0) == CP_OK);
  filters_freed = 0;
  CHECK(cpd_graph_begin(-1, 1, 0, on_stream, stream_ctx(5), free_filter) == CP_ERR_INVALID);
  CHECK(cpd_graph_begin(CP_MAX_DEVICES, 1, 0, on_stream, stream_ctx(5), free_filter) == CP_ERR_INVALID);
  CHECK(cpd_graph_begin(3, 1, 0, on_stream, stream_ctx(5), free_filter) == CP_ERR_INVALID); /* no device 3 */
  CHECK(cpd_graph_begin(0, 1, 0, NULL, stream_ctx(5), free_filter) == CP_ERR_INVALID);
  CHECK_EQ_U(filters_freed, 4);
  CHECK(cpd_graph_end(-1, 1, 0) == CP_ERR_INVALID);
  CHECK(cpd_graph_release(0, 1, 0) == CP_ERR_STATE);
  CHECK(strstr(cp_last_error(), "no pool (1, 0)") != NULL);
  /* A pool released while another window is open on the device goes when that one closes. */
  REQUIRE(cpd_graph_begin(0, 1, 0, on_stream, stream_ctx(5), free_filter) == CP_OK);
  REQUIRE(cpd_graph_begin(0, 2, 0, on_stream, stream_ctx(6), free_filter) == CP_OK);
  void *p;
  REQUIRE(cpd_alloc(MiB, 0, (void *)5, &p) == CP_OK);
  cudapool_free(p, MiB, 0, (void *)5);
  CHECK(cpd_graph_end(0, 1, 0) == CP_OK);
  CHECK(cpd_graph_release(0, 1, 0) == CP_OK);
  cpd_graph_info_t info[4];
  CHECK_EQ_U(cpd_graph_pools(info, 4), 2); /* device 0 is still capturing into pool 2 */
  CHECK(cpd_graph_end(0, 2, 0) == CP_OK);
  CHECK_EQ_U(cpd_graph_pools(info, 4), 1);
  /* Shutdown with a window open and pools left: everything goes (ASan checks for leaks). */
  REQUIRE(cpd_graph_begin(0, 3, 0, on_stream, stream_ctx(5), free_filter) == CP_OK);
  REQUIRE(cpd_alloc(MiB, 0, (void *)5, &p) == CP_OK);
  cpd_shutdown();
  CHECK(!cpd_graph_pools_exist());
  CHECK_EQ_U(cpd_graph_pools(info, 4), 0);
}

/* torch's MemPool through the bridge: createOrIncrefPool makes the pool without a window,
 * beginAllocateToPool adds a use, each releasePool ends one; the bridge's frees (cpd_free, no
 * size) find private pools too; emptyCache(id) gives one id's free memory back. */
TEST(mem_pool_use_counts_and_frees_without_a_size) {
  REQUIRE(cpd_use_sim(64 * MiB, 2, 0) == CP_OK);
  CHECK_EQ_U(cpd_graph_use_count(0, 0, 9), 0);
  REQUIRE(cpd_graph_incref(0, 0, 9) == CP_OK);
  CHECK_EQ_U(cpd_graph_use_count(0, 0, 9), 1);
  CHECK(cpd_graph_pools_exist());
  CHECK(!cpd_graph_window_open(0));
  REQUIRE(cpd_graph_begin(0, 0, 9, on_stream, stream_ctx(5), free_filter) == CP_OK);
  CHECK(cpd_graph_window_open(0) && !cpd_graph_window_open(1));
  CHECK_EQ_U(cpd_graph_use_count(0, 0, 9), 2);
  void *p, *q;
  REQUIRE(cpd_alloc(3 * MiB, 0, (void *)5, &p) == CP_OK); /* routed into (0, 9) */
  REQUIRE(cpd_alloc(MiB, 0, (void *)6, &q) == CP_OK);     /* another stream: the shared pool */
  CHECK(cpd_graph_end(0, 0, 9) == CP_OK);
  CHECK_EQ_U(shared_allocated(0), MiB);
  CHECK_EQ_U(cpd_device_of(p), 0);
  CHECK(cpd_graph_release(0, 0, 9) == CP_OK);
  CHECK_EQ_U(cpd_graph_use_count(0, 0, 9), 1);
  cpd_free(p, -1);                        /* no size, no device: found in the private pool */
  CHECK(cpd_graph_pool(0, 0, 9) != NULL); /* one use left: it stays */
  CHECK(cpd_graph_empty(0, 9) == CP_OK);
  size_t allocated = 0, reserved = 0;
  cp_pool_usage(cpd_graph_pool(0, 0, 9), &allocated, &reserved);
  CHECK_EQ_U(allocated, 0);
  CHECK_EQ_U(reserved, 0); /* its free memory went back */
  CHECK(cpd_graph_release(0, 0, 9) == CP_OK);
  CHECK(cpd_graph_pool(0, 0, 9) == NULL); /* the last use: gone */
  CHECK(cpd_graph_release(0, 0, 9) == CP_ERR_STATE);
  CHECK(cpd_graph_incref(CP_MAX_DEVICES, 0, 1) == CP_ERR_INVALID);
  CHECK(cpd_graph_incref(5, 0, 1) == CP_ERR_INVALID); /* no device 5 */
  cpd_free(q, 0);
  CHECK_EQ_U(shared_allocated(0), 0);
  /* The device is a hint: a pointer of device 1 given with device 0 is freed on device 1. */
  void *on1;
  REQUIRE(cpd_alloc(MiB, 1, NULL, &on1) == CP_OK);
  CHECK_EQ_U(cpd_device_of(on1), 1);
  cpd_free(on1, 0);
  CHECK_EQ_U(shared_allocated(1), 0);
  CHECK(cpd_device_of(on1) == -1);
  /* A free without a size of a pointer no pool holds is left alone and counted. */
  unsigned long long frees_before, frees_after, rs;
  cpd_foreign_calls(&frees_before, &rs);
  cpd_free((void *)0x1000, 0);
  cpd_free((void *)0x1000, -1);
  cpd_foreign_calls(&frees_after, &rs);
  CHECK_EQ_U(frees_after - frees_before, 2);
  /* A size that does not match is still refused on the sized entry point: SIZE_MAX is no
   * wildcard there. */
  REQUIRE(cpd_alloc(MiB, 0, (void *)5, &p) == CP_OK);
  cudapool_free(p, SIZE_MAX, 0, (void *)5);
  CHECK_EQ_U(shared_allocated(0), MiB);
  cudapool_free(p, MiB, 0, (void *)5);
  CHECK_EQ_U(shared_allocated(0), 0);
  cpd_shutdown();
}

/* The segment observer (Note [Segment observer]) sees every segment reserved and given back,
 * on pools made before and after it was set, private pools included. */
static int seen_alloc[2], seen_free[2];
static void observe(void *ctx, int action, uintptr_t addr, size_t size, cp_stream_t stream) {
  const int device = (int)(intptr_t)ctx;
  (void)addr, (void)stream;
  if (device < 0 || device > 1 || size == 0) return;
  if (action == CP_HIST_SEGMENT_ALLOC) seen_alloc[device]++;
  if (action == CP_HIST_SEGMENT_FREE) seen_free[device]++;
}

TEST(segment_observer_sees_every_segment) {
  REQUIRE(cpd_use_sim(64 * MiB, 2, 0) == CP_OK);
  memset(seen_alloc, 0, sizeof seen_alloc);
  memset(seen_free, 0, sizeof seen_free);
  void *a, *b, *c;
  REQUIRE(cpd_alloc(3 * MiB, 0, NULL, &a) == CP_OK); /* device 0's pool exists before */
  cpd_set_segment_observer(observe);
  REQUIRE(cpd_alloc(25 * MiB, 0, NULL, &b) == CP_OK); /* a segment of its own */
  REQUIRE(cpd_alloc(MiB, 1, NULL, &c) == CP_OK);      /* device 1's pool is made after */
  CHECK_EQ_U(seen_alloc[0], 1);
  CHECK_EQ_U(seen_alloc[1], 1);
  REQUIRE(cpd_graph_incref(1, 0, 4) == CP_OK);
  REQUIRE(cpd_graph_begin(1, 0, 4, on_stream, stream_ctx(5), free_filter) == CP_OK);
  void *g;
  REQUIRE(cpd_alloc(MiB, 1, (void *)5, &g) == CP_OK); /* a private pool's segment */
  CHECK(cpd_graph_end(1, 0, 4) == CP_OK);
  CHECK_EQ_U(seen_alloc[1], 2);
  cpd_free(a, 0);
  cpd_free(b, 0);
  cpd_free(c, 1);
  cudapool_empty_cache();
  CHECK_EQ_U(seen_free[0], 2);
  CHECK_EQ_U(seen_free[1], 1);
  cpd_free(g, 1);
  CHECK(cpd_graph_release(1, 0, 4) == CP_OK);
  CHECK(cpd_graph_release(1, 0, 4) == CP_OK); /* the last use: emptied and destroyed */
  CHECK_EQ_U(seen_free[1], 2);
  cpd_set_segment_observer(NULL);
  REQUIRE(cpd_alloc(3 * MiB, 0, NULL, &a) == CP_OK);
  CHECK_EQ_U(seen_alloc[0], 1); /* nothing more seen once it is removed */
  cpd_free(a, 0);
  cpd_shutdown();
}

int main(void) {
  RUN(capture_window_makes_no_event_call_and_gives_nothing_back);
  RUN(a_capturing_stream_without_a_window_is_respected);
  RUN(graph_pools_route_isolate_and_go_when_released);
  RUN(graph_pools_keep_plain_segments_under_page_stitching);
  RUN(graph_region_pause_gives_back_every_byte_a_replay_uses);
  RUN(graph_trees_restore_with_a_replay_queued);
  RUN(graph_trees_restore_in_a_region);
  RUN(bad_calls_are_refused_and_shutdown_frees_everything);
  RUN(mem_pool_use_counts_and_frees_without_a_size);
  RUN(segment_observer_sees_every_segment);
  return check_summary("test_graphs");
}
