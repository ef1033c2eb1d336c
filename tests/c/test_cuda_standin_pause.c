/* test_cuda_standin_pause.c — a region paused and resumed through the CUDA backend, against the
 * stand-in for libcuda (make test-c-standin): the driver's contracts for unmapping several
 * mappings at once, mapping one handle over a whole stretch, access, pinned host memory and
 * copies, with work still queued when the pause starts. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda.h"
#include "check.h"
#include "core/cp.h"
#include "standin/standin.h"
#include "standin_open.h"

#define MiB ((size_t)1 << 20)

static cpstandin_api_t sa;

static void print_faults(void) {
  char text[256];
  for (size_t i = 0; i < sa.faults() && sa.fault_text(i, text, sizeof text) == 0; i++)
    fprintf(stderr, "  stand-in fault %zu: %s\n", i, text);
}

static unsigned char peek(uintptr_t addr) {
  unsigned char b = 0;
  CHECK(sa.peek(addr, &b) == 0);
  return b;
}

TEST(pause_and_resume_through_the_driver) {
  static const char *const confs[] = {"expandable_segments:True", "expandable_segments:True,page_stitching:True"};
  for (size_t k = 0; k < sizeof confs / sizeof confs[0]; k++) {
    cp_cuda_shutdown();
    sa.reset();
    CHECK(sa.set_devices(1, 512 * MiB) == 0);
    cp_backend_t be;
    REQUIRE(cp_cuda_backend(0, &be) == CP_OK);
    REQUIRE(be.page_map != NULL && be.copy_to_host != NULL);
    /* A non-blocking stream of the device's context, as torch's side streams are. */
    void *prev = NULL, *ctx = NULL, *stream = NULL;
    CHECK(sa.cuCtxGetCurrent(&prev) == 0);
    CHECK(sa.cuDevicePrimaryCtxRetain(&ctx, 0) == 0);
    CHECK(sa.cuCtxSetCurrent(ctx) == 0);
    CHECK(sa.cuStreamCreate(&stream, 1) == 0);
    CHECK(sa.cuCtxSetCurrent(prev) == 0);
    CHECK(sa.cuDevicePrimaryCtxRelease(0) == 0);
    const uintptr_t s = (uintptr_t)stream;
    cp_config_t cfg;
    cp_config_default(&cfg);
    REQUIRE(cp_config_parse(&cfg, confs[k]) == CP_OK);
    cp_pool_t *pool = NULL;
    REQUIRE(cp_pool_create(&cfg, &be, &pool) == CP_OK);
    uint32_t kv = 0;
    REQUIRE(cp_region_id("standin_kv", &kv) == CP_OK);
    void *a = NULL, *b = NULL;
    REQUIRE(cp_alloc_in(pool, 30 * MiB, s, kv, &a) == CP_OK);
    REQUIRE(cp_alloc_in(pool, 5 * MiB, s, kv, &b) == CP_OK);
    CHECK(sa.launch(s, (uintptr_t)a, 30 * MiB) == 0); /* writes the stream's number; still queued */
    CHECK(sa.launch(s, (uintptr_t)b, 5 * MiB) == 0);
    const size_t used = sa.used(0);
    CHECK(used >= 35 * MiB);
    CHECK(cp_pool_pause(pool, kv, CP_PAUSE_BACKUP) == CP_OK);
    if (sa.faults() != 0) print_faults();
    CHECK_EQ_U(sa.faults(), 0); /* it waited for the stream before copying and unmapping */
    CHECK_EQ_U(sa.used(0), 0);  /* every byte back on the device */
    CHECK_EQ_U(sa.live(CPSTANDIN_LIVE_HANDLES), 0);
    CHECK_EQ_U(sa.live(CPSTANDIN_LIVE_MAPPINGS), 0);
    CHECK_EQ_U(sa.live(CPSTANDIN_LIVE_HOST), 2); /* the two backups */
    CHECK(sa.access((uintptr_t)a, 0) == -1);     /* nothing is there now */
    CHECK(cp_pool_resume(pool, kv) == CP_OK);
    CHECK_EQ_U(sa.used(0), used);
    CHECK_EQ_U(sa.live(CPSTANDIN_LIVE_HOST), 0);
    CHECK(sa.access((uintptr_t)a, 0) == 3);
    const unsigned char mark = peek((uintptr_t)a);
    CHECK(mark != 0);
    CHECK(peek((uintptr_t)a + 30 * MiB - 1) == mark); /* the bytes came back, first to last */
    CHECK(peek((uintptr_t)b + 4096) == mark);
    CHECK(sa.launch(s, (uintptr_t)a, 30 * MiB) == 0); /* usable again */
    sa.complete_all();
    CHECK(cp_free(pool, a) == CP_OK);
    CHECK(cp_free(pool, b) == CP_OK);
    CHECK_EQ_U(cp_pool_check(pool, stderr), 0);
    cp_pool_destroy(pool);
    CHECK_EQ_U(sa.used(0), 0);
    CHECK(sa.cuStreamDestroy(stream) == 0);
    if (sa.faults() != 0) print_faults();
    CHECK_EQ_U(sa.faults(), 0);
    cp_cuda_shutdown();
  }
}

int main(void) {
  if (!standin_open_or_skip(&sa, "test_cuda_standin_pause")) return 0;
  RUN(pause_and_resume_through_the_driver);
  return check_summary("test_cuda_standin_pause");
}
