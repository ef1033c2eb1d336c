/* test_cuda_standin.c — the CUDA backend (csrc/backend/cuda*.c) and a pool over it, against the
 * stand-in for libcuda (make test-c-standin): faults, injected failures, captures, peers, threads. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda.h"
#include "check.h"
#include "core/cp.h"
#include "standin/standin.h"

#define MiB  ((size_t)1 << 20)
#define GRAN (2 * MiB) /* the stand-in's default granularity */

enum { ERR_INVALID_VALUE = 1, ERR_OUT_OF_MEMORY = 2, ERR_ILLEGAL_ADDRESS = 700, ERR_UNKNOWN = 999 };

static cpstandin_api_t sa;
static int have_standin; /* the library the backend loaded is the stand-in */

static int contains(const char *haystack, const char *needle) { return strstr(haystack, needle) != NULL; }

/* Everything back to the start: the backend's contexts released, the stand-in reset, with
 * `devices` devices of 256 MiB. */
static void fresh(int devices) {
  cp_cuda_shutdown();
  sa.reset();
  CHECK(sa.set_devices(devices, 256 * MiB) == 0);
}

static void print_faults(void) {
  char text[256];
  for (size_t i = 0; i < sa.faults() && sa.fault_text(i, text, sizeof text) == 0; i++)
    fprintf(stderr, "  stand-in fault %zu: %s\n", i, text);
}

/* What every test ends with: the work completes, nothing faulted, the contexts are released. */
static void finish(void) {
  sa.complete_all();
  if (sa.faults() != 0) print_faults();
  CHECK_EQ_U(sa.faults(), 0);
  cp_cuda_shutdown();
  CHECK_EQ_U(sa.live(CPSTANDIN_LIVE_CONTEXTS), 0);
}

static int backend(int device, cp_backend_t *be) {
  const int rc = cp_cuda_backend(device, be);
  if (rc != CP_OK) fprintf(stderr, "cp_cuda_backend(%d): %s\n", device, cp_last_error());
  return rc == CP_OK && be->page_map != NULL ? 0 : -1;
}

/* A stream created in device `device`'s primary context (retained by its backend already). */
static uintptr_t new_stream(int device, unsigned flags) {
  void *prev = NULL, *ctx = NULL, *stream = NULL;
  CHECK(sa.cuCtxGetCurrent(&prev) == 0);
  CHECK(sa.cuDevicePrimaryCtxRetain(&ctx, device) == 0);
  CHECK(sa.cuCtxSetCurrent(ctx) == 0);
  CHECK(sa.cuStreamCreate(&stream, flags) == 0);
  CHECK(sa.cuCtxSetCurrent(prev) == 0);
  CHECK(sa.cuDevicePrimaryCtxRelease(device) == 0);
  return (uintptr_t)stream;
}

/* One granule of page-mapped memory at the start of a fresh range of `granules` granules. */
typedef struct mapped_s {
  uintptr_t range;
  cp_page_t page;
  size_t granules;
} mapped_t;

static int map_one(const cp_backend_t *be, size_t granules, mapped_t *m) {
  m->granules = granules;
  if (be->va_reserve(be->ctx, granules * GRAN, &m->range) != CP_OK) return -1;
  if (be->page_create(be->ctx, GRAN, &m->page) != CP_OK) return -1;
  if (be->page_map(be->ctx, m->range, GRAN, m->page) != CP_OK) return -1;
  return be->page_set_access(be->ctx, m->range, GRAN) == CP_OK ? 0 : -1;
}

static void unmap_one(const cp_backend_t *be, const mapped_t *m) {
  CHECK(be->page_unmap(be->ctx, m->range, GRAN) == CP_OK);
  CHECK(be->page_release(be->ctx, m->page) == CP_OK);
  CHECK(be->va_free(be->ctx, m->range, m->granules * GRAN) == CP_OK);
}

static cp_pool_t *pool_over(const cp_backend_t *be, const char *conf) {
  cp_config_t cfg;
  cp_config_default(&cfg);
  cp_pool_t *pool = NULL;
  if (cp_config_parse(&cfg, conf) != CP_OK || cp_pool_create(&cfg, be, &pool) != CP_OK) {
    fprintf(stderr, "pool (%s): %s\n", conf, cp_last_error());
    return NULL;
  }
  return pool;
}

/* ---- The library ----------------------------------------------------------------------------- */

TEST(standin_loaded) {
  char why[512] = "";
  const int load = cp_cuda_load();
  if (load != CP_OK) {
    printf("not the stand-in (cp_cuda_load: %s): the tests below are skipped\n", cp_last_error());
    return;
  }
  if (cpstandin_open(&sa, 0, why, sizeof why) != 0) {
    printf("not the stand-in (%s): the tests below are skipped\n", why);
    return;
  }
  CHECK(sa.version() == CPSTANDIN_VERSION);
  have_standin = 1;
  printf("stand-in %d: %s\n", sa.version(), getenv("CUDAPOOL_CUDA_DRIVER"));
}

/* ---- a. event_destroy: the handle is gone whatever the driver says --------------------------- */

TEST(event_destroy_is_final) {
  if (!have_standin) return;
  fresh(1);
  cp_backend_t be;
  REQUIRE(backend(0, &be) == 0);
  cp_event_t ev = 0;
  REQUIRE(be.event_create(be.ctx, &ev) == CP_OK);
  CHECK(be.event_record(be.ctx, ev, 0) == CP_OK);
  sa.set_sticky(ERR_ILLEGAL_ADDRESS); /* as after a device fault */
  CHECK(be.event_destroy(be.ctx, ev) == CP_ERR_BACKEND);
  CHECK(contains(cp_last_error(), "cuEventDestroy"));
  CHECK(contains(cp_last_error(), "CUDA_ERROR_ILLEGAL_ADDRESS"));
  CHECK_EQ_U(sa.calls("cuEventDestroy"), 1);
  /* A retry, or any use, of the handle: refused here, no driver call, no freed memory touched. */
  CHECK(be.event_destroy(be.ctx, ev) == CP_ERR_INVALID);
  CHECK(contains(cp_last_error(), "not a live event"));
  int done = -1;
  CHECK(be.event_record(be.ctx, ev, 0) == CP_ERR_INVALID);
  CHECK(be.event_query(be.ctx, ev, &done) == CP_ERR_INVALID);
  CHECK(done == -1);
  CHECK(be.event_synchronize(be.ctx, ev) == CP_ERR_INVALID);
  CHECK(be.event_destroy(be.ctx, 0) == CP_ERR_INVALID);
  CHECK_EQ_U(sa.calls("cuEventDestroy"), 1);
  sa.set_sticky(0);
  finish();
}

/* A pool over page-mapped memory after a sticky error: empty_cache reports it (whatever the core
 * retries) instead of aborting in the allocator, and destroying the pool frees every event
 * handle although the driver refuses every destroy (LeakSanitizer would see one kept). */
TEST(pool_after_sticky_error) {
  if (!have_standin) return;
  fresh(1);
  cp_backend_t be;
  REQUIRE(backend(0, &be) == 0);
  const uintptr_t s = new_stream(0, 0);
  cp_pool_t *pool = pool_over(&be, "expandable_segments:True");
  REQUIRE(pool != NULL);
  void *p = NULL, *q = NULL;
  REQUIRE(cp_alloc(pool, 8 * MiB, s, &p) == CP_OK);
  REQUIRE(cp_alloc(pool, 4 * MiB, 0, &q) == CP_OK);
  CHECK(cp_record_stream(pool, q, s) == CP_OK);
  CHECK(sa.launch(s, (uintptr_t)p, 8 * MiB) == 0);
  CHECK(cp_free(pool, p) == CP_OK);
  CHECK(cp_free(pool, q) == CP_OK);
  CHECK(cp_empty_cache(pool) == CP_OK);
  sa.set_sticky(ERR_ILLEGAL_ADDRESS); /* as after a device fault */
  const int rc = cp_empty_cache(pool);
  CHECK(rc == CP_OK || rc == CP_ERR_BACKEND);
  if (rc != CP_OK) CHECK(contains(cp_last_error(), "CUDA_ERROR_ILLEGAL_ADDRESS"));
  void *r = NULL;
  CHECK(cp_alloc(pool, 64 * MiB, s, &r) != CP_OK);
  const unsigned long long destroys = sa.calls("cuEventDestroy");
  cp_pool_destroy(pool); /* every call fails: unmaps, releases, event destroys */
  CHECK(sa.calls("cuEventDestroy") > destroys);
  cp_cuda_shutdown();
  sa.reset();
}

/* ---- b. frees during another thread's global-mode capture ------------------------------------ */

static void *begin_capture_thread(void *arg) {
  const uintptr_t s = *(const uintptr_t *)arg;
  CHECK(sa.begin_capture(s, CPSTANDIN_CAPTURE_GLOBAL) == 0);
  return NULL;
}

TEST(frees_do_not_break_a_capture) {
  if (!have_standin) return;
  fresh(1);
  cp_backend_t be;
  REQUIRE(backend(0, &be) == 0);
  uintptr_t s = new_stream(0, 0);
  mapped_t m;
  REQUIRE(map_one(&be, 2, &m) == 0);
  uintptr_t seg = 0;
  REQUIRE(be.reserve(be.ctx, 2 * MiB, &seg) == CP_OK);
  pthread_t t;
  REQUIRE(pthread_create(&t, NULL, begin_capture_thread, &s) == 0);
  pthread_join(t, NULL);
  REQUIRE(sa.capture_status(s) == 1);
  /* This thread is in the global mode: only relaxed calls leave the capture alone. */
  CHECK(be.page_unmap(be.ctx, m.range, GRAN) == CP_OK);
  CHECK(be.page_release(be.ctx, m.page) == CP_OK);
  CHECK(be.va_free(be.ctx, m.range, 2 * GRAN) == CP_OK);
  CHECK(be.release(be.ctx, seg, 2 * MiB) == CP_OK);
  CHECK(map_one(&be, 1, &m) == 0); /* and the mapping calls, as before */
  unmap_one(&be, &m);
  CHECK(be.reserve(be.ctx, 2 * MiB, &seg) == CP_OK);
  CHECK(be.release(be.ctx, seg, 2 * MiB) == CP_OK);
  CHECK(sa.capture_status(s) == 1);
  CHECK(sa.end_capture(s) == 0); /* not invalidated */
  CHECK(sa.cuStreamDestroy((void *)s) == 0);
  finish();
}

/* ---- c. out of memory from cuMemMap and cuMemSetAccess ---------------------------------------- */

TEST(map_and_access_oom_is_oom) {
  if (!have_standin) return;
  fresh(1);
  cp_backend_t be;
  REQUIRE(backend(0, &be) == 0);
  uintptr_t r = 0;
  cp_page_t p = 0;
  REQUIRE(be.va_reserve(be.ctx, 2 * GRAN, &r) == CP_OK);
  REQUIRE(be.page_create(be.ctx, GRAN, &p) == CP_OK);
  CHECK(sa.fail_nth("cuMemMap", 1, ERR_OUT_OF_MEMORY) == 0);
  CHECK(be.page_map(be.ctx, r, GRAN, p) == CP_ERR_OOM);
  CHECK(contains(cp_last_error(), "cuMemMap(") && contains(cp_last_error(), "CUDA_ERROR_OUT_OF_MEMORY"));
  CHECK(be.page_map(be.ctx, r, GRAN, p) == CP_OK);
  CHECK(sa.fail_nth("cuMemSetAccess", 1, ERR_OUT_OF_MEMORY) == 0);
  CHECK(be.page_set_access(be.ctx, r, GRAN) == CP_ERR_OOM);
  CHECK(contains(cp_last_error(), "cuMemSetAccess(") && contains(cp_last_error(), "CUDA_ERROR_OUT_OF_MEMORY"));
  CHECK(be.page_set_access(be.ctx, r, GRAN) == CP_OK);
  CHECK(be.page_unmap(be.ctx, r, GRAN) == CP_OK);
  CHECK(be.page_release(be.ctx, p) == CP_OK);
  CHECK(be.va_free(be.ctx, r, 2 * GRAN) == CP_OK);
  finish();
}

/* The pool sees that out of memory as such: its ladder frees the cache and tries again. */
TEST(pool_map_oom_runs_the_ladder) {
  if (!have_standin) return;
  fresh(1);
  cp_backend_t be;
  REQUIRE(backend(0, &be) == 0);
  cp_pool_t *pool = pool_over(&be, "expandable_segments:True");
  REQUIRE(pool != NULL);
  void *a = NULL, *b = NULL;
  REQUIRE(cp_alloc(pool, 40 * MiB, 0, &a) == CP_OK);
  CHECK(cp_free(pool, a) == CP_OK); /* cached, mapped */
  CHECK(sa.fail_nth("cuMemMap", 1, ERR_OUT_OF_MEMORY) == 0);
  const int rc = cp_alloc(pool, 100 * MiB, 0, &b); /* needs more chunks mapped */
  if (rc != CP_OK) fprintf(stderr, "alloc after an OOM from cuMemMap: %s\n", cp_last_error());
  CHECK(rc == CP_OK || rc == CP_ERR_OOM);
  CHECK(rc != CP_ERR_BACKEND);
  if (rc == CP_OK) CHECK(cp_free(pool, b) == CP_OK);
  CHECK_EQ_U(cp_pool_check(pool, stderr), 0);
  cp_pool_destroy(pool);
  CHECK_EQ_U(sa.live(CPSTANDIN_LIVE_MAPPINGS), 0);
  CHECK_EQ_U(sa.live(CPSTANDIN_LIVE_HANDLES), 0);
  CHECK_EQ_U(sa.live(CPSTANDIN_LIVE_RESERVATIONS), 0);
  finish();
}

/* ---- d. GPUDirect RDMA capable pages where the device supports it ----------------------------- */

TEST(rdma_flag_follows_the_device) {
  if (!have_standin) return;
  fresh(2);
  CHECK(sa.set_device_attr(1, CPSTANDIN_ATTR_RDMA, 0) == 0);
  cp_backend_t be0, be1;
  REQUIRE(backend(0, &be0) == 0 && backend(1, &be1) == 0);
  const unsigned long long queries = sa.calls("cuDeviceGetAttribute");
  cp_page_t p[6];
  for (int i = 0; i < 6; i++) {
    const cp_backend_t *be = i % 2 == 0 ? &be0 : &be1;
    REQUIRE(be->page_create(be->ctx, GRAN, &p[i]) == CP_OK);
    cpstandin_handle_info_t info;
    REQUIRE(sa.handle_info(p[i], &info) == 0);
    CHECK(info.device == i % 2);
    CHECK(info.rdma == (i % 2 == 0)); /* device 0 reports the attribute, device 1 does not */
  }
  CHECK_EQ_U(sa.calls("cuDeviceGetAttribute"), queries); /* asked once per device, not per page */
  for (int i = 0; i < 6; i++) {
    const cp_backend_t *be = i % 2 == 0 ? &be0 : &be1;
    CHECK(be->page_release(be->ctx, p[i]) == CP_OK);
  }
  CHECK_EQ_U(sa.live(CPSTANDIN_LIVE_HANDLES), 0);
  finish();
}

/* ---- e. the legacy stream during a capture counts as capturing -------------------------------- */

TEST(legacy_stream_during_capture) {
  if (!have_standin) return;
  fresh(1);
  cp_backend_t be;
  REQUIRE(backend(0, &be) == 0);
  const uintptr_t s = new_stream(0, 0), nb = new_stream(0, 1 /* CU_STREAM_NON_BLOCKING */);
  int c = -1;
  CHECK(be.stream_capturing(be.ctx, 0, &c) == CP_OK && c == 0);
  REQUIRE(sa.begin_capture(s, CPSTANDIN_CAPTURE_GLOBAL) == 0);
  c = -1;
  CHECK(be.stream_capturing(be.ctx, 0, &c) == CP_OK);
  CHECK(c == 1);
  c = -1;
  CHECK(be.stream_capturing(be.ctx, 1 /* CU_STREAM_LEGACY */, &c) == CP_OK && c == 1);
  c = -1;
  CHECK(be.stream_capturing(be.ctx, s, &c) == CP_OK && c == 1);
  c = -1;
  CHECK(be.stream_capturing(be.ctx, nb, &c) == CP_OK && c == 0);
  CHECK(sa.capture_status(s) == 1); /* asking does not invalidate */
  CHECK(sa.end_capture(s) == 0);
  c = -1;
  CHECK(be.stream_capturing(be.ctx, 0, &c) == CP_OK && c == 0);
  CHECK(sa.cuStreamDestroy((void *)s) == 0 && sa.cuStreamDestroy((void *)nb) == 0);
  finish();
}

/* ---- f. cuMemRelease is never given the same handle twice -------------------------------------- */

TEST(page_release_is_not_retried) {
  if (!have_standin) return;
  fresh(1);
  cp_backend_t be;
  REQUIRE(backend(0, &be) == 0);
  cp_page_t p = 0;
  REQUIRE(be.page_create(be.ctx, GRAN, &p) == CP_OK);
  /* The driver releases the handle but reports an error. */
  CHECK(sa.fail_nth_after("cuMemRelease", 1, ERR_UNKNOWN) == 0);
  CHECK(be.page_release(be.ctx, p) == CP_ERR_BACKEND);
  CHECK(contains(cp_last_error(), "cuMemRelease(") && contains(cp_last_error(), "CUDA_ERROR_UNKNOWN"));
  cpstandin_handle_info_t info;
  REQUIRE(sa.handle_info(p, &info) == 0);
  CHECK(info.released && !info.holds_memory);
  /* A caller's retry reaches no driver. */
  CHECK(be.page_release(be.ctx, p) == CP_ERR_INVALID);
  CHECK(contains(cp_last_error(), "not a live page"));
  CHECK_EQ_U(sa.calls("cuMemRelease"), 1);
  CHECK(be.page_release(be.ctx, (cp_page_t)12345) == CP_ERR_INVALID); /* never created */
  CHECK_EQ_U(sa.calls("cuMemRelease"), 1);
  finish();
}

/* ---- g. peers get access to page-mapped memory ------------------------------------------------- */

/* A page of device 0, written by a launch from each of `devices` devices; `blocked`, when >= 0,
 * is a device that cannot reach device 0. */
static void peer_round(int devices, int blocked) {
  fresh(devices);
  if (blocked >= 0) CHECK(sa.set_peer(blocked, 0, 0) == 0);
  cp_backend_t be[4];
  for (int i = 0; i < devices; i++) REQUIRE(backend(i, &be[i]) == 0);
  mapped_t m;
  REQUIRE(map_one(&be[0], 1, &m) == 0);
  for (int i = 0; i < devices; i++) CHECK(sa.access(m.range, i) == (i == blocked ? 0 : 3));
  for (int i = 0; i < devices; i++) {
    if (i == blocked) continue;
    const uintptr_t s = new_stream(i, 0);
    CHECK(sa.launch(s, m.range + 4096, 8192) == 0);
    CHECK(sa.complete(s) == 0);
    unsigned char byte = 0;
    CHECK(sa.peek(m.range + 4096, &byte) == 0 && byte == (unsigned char)(s - 0x570000000ull));
    CHECK(sa.cuStreamDestroy((void *)s) == 0);
  }
  CHECK_EQ_U(sa.faults(), 0);
  if (blocked >= 0) { /* the device that cannot reach it faults, as a GPU would */
    const uintptr_t s = new_stream(blocked, 0);
    CHECK(sa.launch(s, m.range, 4096) == ERR_ILLEGAL_ADDRESS);
    CHECK(sa.faults() == 1 && sa.fault_kind(0) == CPSTANDIN_FAULT_ILLEGAL_ADDRESS);
    cp_cuda_shutdown();
    sa.reset();
    return;
  }
  unmap_one(&be[0], &m);
  finish();
}

TEST(peers_get_access) {
  if (!have_standin) return;
  peer_round(2, -1);
  peer_round(4, -1);
  peer_round(4, 2);
}

/* ---- Capacity and support --------------------------------------------------------------------- */

/* A device without virtual memory management gets no page-mapped entries, and a pool over it
 * uses plain segments; out of memory on either kind of device is CP_ERR_OOM, and freeing makes
 * room again. */
TEST(support_and_capacity) {
  if (!have_standin) return;
  fresh(2);
  CHECK(sa.set_device_attr(1, CPSTANDIN_ATTR_VMM, 0) == 0);
  int supported = -1;
  char why[256] = "";
  CHECK(cp_cuda_vmm_support(1, &supported, why, sizeof why) == CP_OK && supported == 0);
  CHECK(contains(why, "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0"));
  CHECK(cp_cuda_vmm_support(0, &supported, why, sizeof why) == CP_OK && supported == 1);
  cp_backend_t be[2];
  REQUIRE(backend(0, &be[0]) == 0);
  REQUIRE(cp_cuda_backend(1, &be[1]) == CP_OK);
  CHECK(be[1].page_map == NULL && be[1].va_reserve == NULL);
  for (int d = 0; d < 2; d++) {
    cp_pool_t *pool = pool_over(&be[d], "expandable_segments:True");
    REQUIRE(pool != NULL);
    void *held[16] = {NULL};
    int n = 0, rc = CP_OK;
    while (n < 16 && (rc = cp_alloc(pool, 40 * MiB, 0, &held[n])) == CP_OK) n++;
    CHECK(rc == CP_ERR_OOM);
    CHECK(n >= 4 && n < 7); /* 256 MiB hold six 40 MiB blocks at most */
    CHECK(sa.faults() == 0);
    CHECK(cp_free(pool, held[0]) == CP_OK);
    CHECK(cp_alloc(pool, 40 * MiB, 0, &held[0]) == CP_OK);
    for (int k = 0; k < n; k++) CHECK(cp_free(pool, held[k]) == CP_OK);
    CHECK_EQ_U(cp_pool_check(pool, stderr), 0);
    cp_pool_destroy(pool);
    CHECK_EQ_U(sa.used(d), 0);
  }
  finish();
}

/* ---- Device faults the stand-in catches through the backend ------------------------------------- */

TEST(unmap_under_work_is_a_device_fault) {
  if (!have_standin) return;
  fresh(1);
  cp_backend_t be;
  REQUIRE(backend(0, &be) == 0);
  const uintptr_t s = new_stream(0, 0);
  mapped_t m;
  REQUIRE(map_one(&be, 1, &m) == 0);
  CHECK(sa.launch(s, m.range, GRAN) == 0);
  CHECK_EQ_U(sa.pending(s), 1);
  CHECK(be.page_unmap(be.ctx, m.range, GRAN) == CP_OK); /* the GPU finds out later */
  CHECK(sa.faults() == 1 && sa.fault_kind(0) == CPSTANDIN_FAULT_IN_USE);
  size_t free_b = 0, total_b = 0;
  CHECK(be.mem_info(be.ctx, &free_b, &total_b) == CP_ERR_BACKEND); /* sticky from now on */
  CHECK(contains(cp_last_error(), "CUDA_ERROR_ILLEGAL_ADDRESS"));
  cp_cuda_shutdown();
  sa.reset(); /* the only way back, as a GPU reset */
  /* With the work completed first, the same unmap is fine. */
  fresh(1);
  REQUIRE(backend(0, &be) == 0);
  const uintptr_t s2 = new_stream(0, 0);
  REQUIRE(map_one(&be, 1, &m) == 0);
  CHECK(sa.launch(s2, m.range, GRAN) == 0);
  CHECK(sa.complete(s2) == 0);
  unmap_one(&be, &m);
  finish();
}

/* A pool waits for a stream's work before it unmaps or frees what that work touches. */
TEST(pool_waits_before_giving_back) {
  if (!have_standin) return;
  static const char *const confs[] = {"", "expandable_segments:True", "expandable_segments:True,page_stitching:True"};
  for (size_t k = 0; k < sizeof confs / sizeof confs[0]; k++) {
    fresh(1);
    cp_backend_t be;
    REQUIRE(backend(0, &be) == 0);
    const uintptr_t s = new_stream(0, 0), other = new_stream(0, 0);
    cp_pool_t *pool = pool_over(&be, confs[k]);
    if (pool == NULL) continue; /* a configuration this core does not know */
    void *a = NULL, *b = NULL;
    REQUIRE(cp_alloc(pool, 6 * MiB, s, &a) == CP_OK);
    REQUIRE(cp_alloc(pool, 3 * MiB, s, &b) == CP_OK);
    CHECK(sa.launch(s, (uintptr_t)a, 6 * MiB) == 0);
    CHECK(cp_record_stream(pool, b, other) == CP_OK);
    CHECK(sa.launch(other, (uintptr_t)b, 3 * MiB) == 0);
    CHECK(cp_free(pool, a) == CP_OK);
    CHECK(cp_free(pool, b) == CP_OK);
    CHECK(cp_empty_cache(pool) == CP_OK);
    if (sa.faults() != 0) {
      fprintf(stderr, "configuration \"%s\":\n", confs[k]);
      print_faults();
    }
    CHECK_EQ_U(sa.faults(), 0);
    sa.complete_all();
    CHECK(cp_empty_cache(pool) == CP_OK);
    CHECK_EQ_U(cp_pool_check(pool, stderr), 0);
    cp_pool_destroy(pool);
    CHECK_EQ_U(sa.used(0), 0);
    CHECK_EQ_U(sa.live(CPSTANDIN_LIVE_EVENTS), 0);
    CHECK(sa.cuStreamDestroy((void *)s) == 0 && sa.cuStreamDestroy((void *)other) == 0);
    finish();
  }
}

/* An event moves to the context of the stream it is recorded on, and its completion follows
 * that stream's work. */
TEST(events_follow_their_stream) {
  if (!have_standin) return;
  fresh(2);
  cp_backend_t be0, be1;
  REQUIRE(backend(0, &be0) == 0 && backend(1, &be1) == 0);
  const uintptr_t s1 = new_stream(1, 0);
  uintptr_t mem1 = 0;
  REQUIRE(be1.reserve(be1.ctx, MiB, &mem1) == CP_OK);
  cp_event_t ev = 0;
  REQUIRE(be0.event_create(be0.ctx, &ev) == CP_OK);
  CHECK(sa.launch(s1, mem1, MiB) == 0);
  CHECK(be0.event_record(be0.ctx, ev, s1) == CP_OK); /* a stream of device 1 */
  int done = -1;
  CHECK(be0.event_query(be0.ctx, ev, &done) == CP_OK && done == 0);
  CHECK(sa.complete(s1) == 0);
  CHECK(be0.event_query(be0.ctx, ev, &done) == CP_OK && done == 1);
  CHECK(sa.launch(s1, mem1, MiB) == 0);
  CHECK(be0.event_record(be0.ctx, ev, s1) == CP_OK);
  CHECK(be0.event_synchronize(be0.ctx, ev) == CP_OK); /* drains s1 up to the event */
  CHECK_EQ_U(sa.pending(s1), 0);
  CHECK(be0.event_record(be0.ctx, ev, 0) == CP_OK); /* and back to device 0 */
  CHECK(be0.event_query(be0.ctx, ev, &done) == CP_OK && done == 1);
  CHECK(be0.event_destroy(be0.ctx, ev) == CP_OK);
  CHECK(be1.release(be1.ctx, mem1, MiB) == CP_OK);
  CHECK_EQ_U(sa.live(CPSTANDIN_LIVE_EVENTS), 0);
  CHECK(sa.cuStreamDestroy((void *)s1) == 0);
  finish();
}

/* ---- Every driver call the backend makes, failing once ------------------------------------------ */

TEST(injected_failures_are_named) {
  if (!have_standin) return;
  static const char *const calls[] = {"cuMemAlloc",          "cuMemFree",           "cuEventCreate",
                                      "cuEventRecord",       "cuEventQuery",        "cuEventSynchronize",
                                      "cuEventDestroy",      "cuMemGetInfo",        "cuMemGetAllocationGranularity",
                                      "cuMemAddressReserve", "cuMemCreate",         "cuMemMap",
                                      "cuMemSetAccess",      "cuMemUnmap",          "cuMemRelease",
                                      "cuMemAddressFree",    "cuStreamIsCapturing", "cuCtxGetCurrent"};
  for (size_t k = 0; k < sizeof calls / sizeof calls[0]; k++) {
    fresh(1);
    cp_backend_t be;
    REQUIRE(backend(0, &be) == 0);
    int failed = 0;
    CHECK(sa.fail_nth(calls[k], 1, ERR_UNKNOWN) == 0);
/* The one call that fails names the driver call and its error; every other call succeeds. */
#define TRY(expr)                                                                                                    \
  do {                                                                                                               \
    const int rc_ = (expr);                                                                                          \
    if (rc_ != CP_OK) {                                                                                              \
      const int named_ = contains(cp_last_error(), calls[k]) && contains(cp_last_error(), "CUDA_ERROR_UNKNOWN");     \
      if (failed || rc_ != CP_ERR_BACKEND || !named_)                                                                \
        fprintf(stderr, "%s failing once, %s gave %s: %s\n", calls[k], #expr, cp_status_name(rc_), cp_last_error()); \
      CHECK(!failed && rc_ == CP_ERR_BACKEND && named_);                                                             \
      failed = 1;                                                                                                    \
    }                                                                                                                \
  } while (0)
    uintptr_t seg = 0, range = 0;
    cp_event_t ev = 0;
    cp_page_t page = 0;
    size_t g = 0, fb = 0, tb = 0;
    int done = 0, cap = 0;
    TRY(be.reserve(be.ctx, MiB, &seg));
    if (seg != 0) TRY(be.release(be.ctx, seg, MiB));
    TRY(be.event_create(be.ctx, &ev));
    if (ev != 0) {
      TRY(be.event_record(be.ctx, ev, 0));
      TRY(be.event_query(be.ctx, ev, &done));
      TRY(be.event_synchronize(be.ctx, ev));
      TRY(be.event_destroy(be.ctx, ev));
    }
    TRY(be.mem_info(be.ctx, &fb, &tb));
    TRY(be.vmm_granularity(be.ctx, &g));
    TRY(be.va_reserve(be.ctx, 2 * GRAN, &range));
    TRY(be.page_create(be.ctx, GRAN, &page));
    if (range != 0 && page != 0) {
      const int mapped = be.page_map(be.ctx, range, GRAN, page);
      TRY(mapped);
      if (mapped == CP_OK) {
        TRY(be.page_set_access(be.ctx, range, GRAN));
        const int unmapped = be.page_unmap(be.ctx, range, GRAN);
        TRY(unmapped);
        if (unmapped != CP_OK) CHECK(be.page_unmap(be.ctx, range, GRAN) == CP_OK);
      }
    }
    if (page != 0) TRY(be.page_release(be.ctx, page));
    if (range != 0) {
      const int freed = be.va_free(be.ctx, range, 2 * GRAN);
      TRY(freed);
      if (freed != CP_OK) CHECK(be.va_free(be.ctx, range, 2 * GRAN) == CP_OK);
    }
    TRY(be.stream_capturing(be.ctx, 0, &cap));
#undef TRY
    if (!failed) fprintf(stderr, "no backend call failed with %s failing\n", calls[k]);
    CHECK(failed);
    finish();
    /* What failed was not acquired, or was given back; a failed release stays on the device. */
    const int release_failed = strcmp(calls[k], "cuMemFree") == 0 || strcmp(calls[k], "cuMemRelease") == 0;
    if (!release_failed) {
      CHECK_EQ_U(sa.used(0), 0);
      CHECK_EQ_U(sa.live(CPSTANDIN_LIVE_RESERVATIONS), 0);
    }
    CHECK_EQ_U(sa.live(CPSTANDIN_LIVE_MAPPINGS), 0);
  }
}

/* ---- Threads (TSan runs this): pools on two devices, streams, launches, frees ---------------- */

#define THREADS 4
#define ROUNDS  150

typedef struct worker_s {
  cp_pool_t *pool;
  uintptr_t stream, side;
  unsigned seed;
  int failures;
} worker_t;

static void *worker(void *arg) {
  worker_t *w = arg;
  void *held[4] = {NULL, NULL, NULL, NULL};
  for (int i = 0; i < ROUNDS; i++) {
    w->seed = w->seed * 1103515245u + 12345u;
    const unsigned r = w->seed >> 8;
    const int slot = (int)(r % 4);
    if (held[slot] != NULL) {
      w->failures += cp_free(w->pool, held[slot]) != CP_OK;
      held[slot] = NULL;
    }
    const size_t size = (size_t)(r % 7 + 1) * (r % 3 == 0 ? MiB : 64 * 1024);
    if (cp_alloc(w->pool, size, w->stream, &held[slot]) != CP_OK) {
      w->failures++;
      continue;
    }
    w->failures += sa.launch(w->stream, (uintptr_t)held[slot], size) != 0;
    if (r % 5 == 0) {
      w->failures += cp_record_stream(w->pool, held[slot], w->side) != CP_OK;
      w->failures += sa.launch(w->side, (uintptr_t)held[slot], size) != 0;
    }
    if (r % 3 == 0) w->failures += sa.complete(w->stream) != 0;
    if (r % 7 == 0) w->failures += sa.complete(w->side) != 0;
    if (r % 11 == 0) w->failures += cp_empty_cache(w->pool) != CP_OK;
  }
  for (int k = 0; k < 4; k++)
    if (held[k] != NULL) w->failures += cp_free(w->pool, held[k]) != CP_OK;
  return NULL;
}

TEST(threads) {
  if (!have_standin) return;
  static const char *const confs[] = {"", "expandable_segments:True"};
  for (size_t k = 0; k < sizeof confs / sizeof confs[0]; k++) {
    fresh(2);
    cp_backend_t be[2];
    REQUIRE(backend(0, &be[0]) == 0 && backend(1, &be[1]) == 0);
    cp_pool_t *pools[2] = {pool_over(&be[0], confs[k]), pool_over(&be[1], confs[k])};
    REQUIRE(pools[0] != NULL && pools[1] != NULL);
    worker_t w[THREADS];
    pthread_t t[THREADS];
    for (int i = 0; i < THREADS; i++) {
      w[i] = (worker_t){pools[i % 2], new_stream(i % 2, 0), new_stream(i % 2, 1), 7u * (unsigned)i + 1, 0};
      REQUIRE(pthread_create(&t[i], NULL, worker, &w[i]) == 0);
    }
    for (int i = 0; i < THREADS; i++) {
      pthread_join(t[i], NULL);
      CHECK_EQ_U(w[i].failures, 0);
    }
    sa.complete_all();
    for (int d = 0; d < 2; d++) {
      CHECK(cp_empty_cache(pools[d]) == CP_OK);
      CHECK_EQ_U(cp_pool_check(pools[d], stderr), 0);
      cp_pool_destroy(pools[d]);
      CHECK_EQ_U(sa.used(d), 0);
    }
    for (int i = 0; i < THREADS; i++)
      CHECK(sa.cuStreamDestroy((void *)w[i].stream) == 0 && sa.cuStreamDestroy((void *)w[i].side) == 0);
    CHECK_EQ_U(sa.live(CPSTANDIN_LIVE_EVENTS), 0);
    finish();
  }
}

int main(void) {
  RUN(standin_loaded);
  RUN(event_destroy_is_final);
  RUN(pool_after_sticky_error);
  RUN(frees_do_not_break_a_capture);
  RUN(map_and_access_oom_is_oom);
  RUN(pool_map_oom_runs_the_ladder);
  RUN(rdma_flag_follows_the_device);
  RUN(legacy_stream_during_capture);
  RUN(page_release_is_not_retried);
  RUN(peers_get_access);
  RUN(support_and_capacity);
  RUN(unmap_under_work_is_a_device_fault);
  RUN(pool_waits_before_giving_back);
  RUN(events_follow_their_stream);
  RUN(injected_failures_are_named);
  RUN(threads);
  if (have_standin) {
    cp_cuda_shutdown();
    sa.reset();
  }
  return check_summary("test_cuda_standin");
}
