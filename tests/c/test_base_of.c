/* test_base_of.c — where a pointer lies: cp_pool_base_of (core), and the torch entry points
 * built on it: the base_alloc hook, calls on pointers no pool holds (counted, silent), and
 * the memory fraction torch sets (0 forbids growth; the device table remembers it). */
#include <stdint.h>

#include "check.h"
#include "devices/abi.h"
#include "devices/devices.h"
#include "fixture.h"

TEST(live_block_start_and_interior_give_the_segment) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, "") == 0);
  char *a = must_alloc(&fx, 1000, 0); /* small pool: a 2 MiB segment */
  char *b = must_alloc(&fx, 3000, 0); /* the same segment, after a */
  void *base = NULL;
  size_t size = 0;
  CHECK(cp_pool_base_of(fx.pool, a, &base, &size) == CP_PTR_LIVE);
  CHECK(base == (void *)a);
  CHECK_EQ_U(size, 2 * MiB);
  base = NULL;
  size = 0;
  CHECK(cp_pool_base_of(fx.pool, b, &base, &size) == CP_PTR_LIVE);
  CHECK(base == (void *)a && size == 2 * MiB);
  CHECK(cp_pool_base_of(fx.pool, b + 2999, &base, &size) == CP_PTR_LIVE); /* interior */
  CHECK(base == (void *)a);
  CHECK(cp_pool_base_of(fx.pool, b, NULL, NULL) == CP_PTR_LIVE); /* outputs optional */
  /* a large block: its own segment */
  char *c = must_alloc(&fx, 12 * MiB, 0);
  CHECK(cp_pool_base_of(fx.pool, c + MiB, &base, &size) == CP_PTR_LIVE);
  CHECK(base == (void *)c && size == 12 * MiB);
  CHECK(cp_free(fx.pool, b) == CP_OK);
  CHECK(cp_free(fx.pool, a) == CP_OK);
  CHECK(cp_free(fx.pool, c) == CP_OK);
  fx_close(&fx);
}

TEST(page_mapped_blocks_give_themselves) {
  /* A page-mapped segment is address space far larger than what is mapped: the answer is the
   * block, which is mapped and the caller's, never the whole reservation. */
  const char *confs[] = {"expandable_segments:True", "expandable_segments:True,page_stitching:True"};
  for (int c = 0; c < 2; c++) {
    fixture_t fx;
    REQUIRE(fx_open(&fx, 256 * MiB, confs[c]) == 0);
    char *a = must_alloc(&fx, 3 * MiB, 0);
    void *base = NULL;
    size_t size = 0;
    CHECK(cp_pool_base_of(fx.pool, a + 4096, &base, &size) == CP_PTR_LIVE);
    CHECK(base == a);
    CHECK(size >= 3 * MiB && size < 4 * MiB);
    CHECK(size < info_of(&fx).address_space);
    CHECK(cp_free(fx.pool, a) == CP_OK);
    fx_close(&fx);
  }
}

TEST(freed_and_never_handed_out_memory_is_held_and_the_rest_foreign) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, "") == 0);
  char *a = must_alloc(&fx, 1000, 0);
  char *b = must_alloc(&fx, 1000, 0);
  CHECK(cp_free(fx.pool, a) == CP_OK);
  void *base = NULL;
  size_t size = 0;
  CHECK(cp_pool_base_of(fx.pool, a, &base, &size) == CP_PTR_HELD); /* freed: a double free's target */
  CHECK(base == (void *)a && size == 2 * MiB);
  CHECK(cp_pool_base_of(fx.pool, a + 2 * MiB - 1, NULL, NULL) == CP_PTR_HELD); /* last byte, free tail */
  base = (void *)1;
  size = 7;
  CHECK(cp_pool_base_of(fx.pool, a + 2 * MiB, &base, &size) == CP_PTR_FOREIGN); /* one past the end */
  CHECK(base == (void *)1 && size == 7);                                        /* untouched */
  CHECK(cp_pool_base_of(fx.pool, a - 1, NULL, NULL) == CP_PTR_FOREIGN);
  int on_stack = 0;
  CHECK(cp_pool_base_of(fx.pool, &on_stack, NULL, NULL) == CP_PTR_FOREIGN);
  CHECK(cp_pool_base_of(fx.pool, NULL, NULL, NULL) == CP_PTR_FOREIGN);
  CHECK(cp_pool_base_of(NULL, b, NULL, NULL) == CP_PTR_FOREIGN);
  CHECK(cp_free(fx.pool, b) == CP_OK);
  CHECK(cp_empty_cache(fx.pool) == CP_OK); /* the segment goes back: its addresses are no longer ours */
  CHECK(cp_pool_base_of(fx.pool, b, NULL, NULL) == CP_PTR_FOREIGN);
  fx_close(&fx);
}

TEST(entry_points_base_alloc_and_foreign_pointers) {
  REQUIRE(cpd_use_sim(64 * MiB, 2, 0) == CP_OK);
  char *p = NULL;
  REQUIRE(cpd_alloc(1000, 1, NULL, (void **)&p) == CP_OK && p != NULL);
  size_t size = 0;
  CHECK(cudapool_base_alloc(p, &size) == (void *)p && size == 2 * MiB);
  CHECK(cudapool_base_alloc(p + 100, &size) == (void *)p && size == 2 * MiB);
  size = 5;
  int on_stack = 0;
  CHECK(cudapool_base_alloc(&on_stack, &size) == (void *)&on_stack && size == 0);
  CHECK(cudapool_base_alloc(NULL, &size) == NULL && size == 0);
  CHECK(cudapool_base_alloc(p, NULL) == (void *)p);

  unsigned long long frees0, records0, frees, records;
  cpd_foreign_calls(&frees0, &records0);
  cudapool_record_stream(&on_stack, (void *)7); /* silent, counted */
  cudapool_free(&on_stack, 4, 0, NULL);
  cudapool_free(&on_stack, 4, 70, NULL); /* whatever the device */
  cpd_foreign_calls(&frees, &records);
  CHECK_EQ_U(frees - frees0, 2);
  CHECK_EQ_U(records - records0, 1);
  cudapool_free(p + 512, 1000, 1, NULL); /* inside the segment: loud, not counted */
  cpd_foreign_calls(&frees, &records);
  CHECK_EQ_U(frees - frees0, 2);
  cudapool_free(p, 1000, 1, NULL);
  cpd_shutdown();
}

TEST(fraction_zero_forbids_growth_and_is_remembered) {
  REQUIRE(cpd_use_sim(64 * MiB, 2, 0) == CP_OK);
  CHECK(cpd_memory_fraction(0) == 1.0);
  void *p = NULL;
  REQUIRE(cpd_alloc(1000, 0, NULL, &p) == CP_OK); /* a 2 MiB segment that keeps serving */
  CHECK(cpd_set_memory_fraction(0.0, 0) == CP_OK);
  CHECK(cpd_memory_fraction(0) == 0.0);
  CHECK(cpd_memory_fraction(1) == 1.0);
  void *q = NULL;
  CHECK(cpd_alloc(1000, 0, NULL, &q) == CP_OK); /* cached memory still serves */
  void *r = NULL;
  CHECK(cpd_alloc(4 * MiB, 0, NULL, &r) == CP_ERR_OOM); /* but nothing grows */
  CHECK(cpd_set_memory_fraction(-0.0, 0) == CP_OK);
  CHECK(cpd_memory_fraction(0) == 0.0);
  CHECK(cpd_set_memory_fraction(0.5, 0) == CP_OK);
  CHECK(cpd_memory_fraction(0) == 0.5);
  CHECK(cpd_alloc(4 * MiB, 0, NULL, &r) == CP_OK);
  CHECK(cpd_set_memory_fraction(1.5, 0) == CP_ERR_INVALID);
  CHECK(cpd_memory_fraction(0) == 0.5);
  cudapool_free(r, 4 * MiB, 0, NULL);
  cudapool_free(q, 1000, 0, NULL);
  cudapool_free(p, 1000, 0, NULL);
  cpd_shutdown();
  CHECK(cpd_memory_fraction(0) == 1.0); /* forgotten with the pools */
  cp_config_t cfg;
  cp_config_default(&cfg);
  REQUIRE(cp_config_parse(&cfg, "memory_fraction:0.25") == CP_OK);
  REQUIRE(cpd_configure(&cfg) == CP_OK);
  CHECK(cpd_memory_fraction(3) == 0.25); /* the configuration's, until one is set */
  cp_config_default(&cfg);
  REQUIRE(cpd_configure(&cfg) == CP_OK);
  cpd_shutdown();
}

int main(void) {
  RUN(live_block_start_and_interior_give_the_segment);
  RUN(page_mapped_blocks_give_themselves);
  RUN(freed_and_never_handed_out_memory_is_held_and_the_rest_foreign);
  RUN(entry_points_base_alloc_and_foreign_pointers);
  RUN(fraction_zero_forbids_growth_and_is_remembered);
  return check_summary("test_base_of");
}
