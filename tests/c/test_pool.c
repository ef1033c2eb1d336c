/* test_pool.c — the pool's conformance suite (conformance.h) on the simulated device, for
 * plain, page-mapped and stitching pools. */
#include "conformance.h"

int main(void) {
  cf_suite(0);
  return check_summary("test_pool");
}
