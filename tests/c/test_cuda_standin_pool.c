/* test_cuda_standin_pool.c — the pool's conformance suite (conformance.h) through the CUDA
 * backend on the driver stand-in (make test-c-standin), for plain, page-mapped and stitching
 * pools: the same cases as test_pool.c on the simulated device. */
#include "conformance.h"
#include "standin_open.h"

int main(void) {
  if (!standin_open_or_skip(&g_sa, "test_cuda_standin_pool")) return 0;
  cf_suite(1);
  cp_cuda_shutdown();
  g_sa.reset();
  return check_summary("test_cuda_standin_pool");
}
