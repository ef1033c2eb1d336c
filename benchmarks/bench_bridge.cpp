// bench_bridge.cpp — the allocation and free that torch makes through cudapool's bridge, counted:
// the DataPtr path of csrc/bridge/bridge_path.h (cpd_alloc, the DataPtr with the device's
// deleter, the deleter's cpd_free) on a simulated device behind the device table, without the
// torch lookups of the current device and stream that the bridge's allocate() adds on a GPU
// (and torch's own allocator makes too). For instruction counts (callgrind), as bench_micro's
// counting mode: run N pairs untimed, so that (I(N) - I(0)) / N is one pair.
//
//   bench_bridge --case bridge|c_entry --pairs N [--size BYTES]
//
//   bridge   allocate_on() + the DataPtr's destruction (its deleter);
//   c_entry  cpd_alloc + cudapool_free: the pair of C entry points torch's pluggable allocator
//            calls (without the wrapper's mutex and map, which are torch's).
// Built by the Makefile (build/bench_bridge) when torch's headers and libc10 are there.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "bridge/bridge_path.h"

extern "C" {
#include "backend/sim.h"
#include "devices/devices.h"
}

namespace cudapool_bridge {
std::atomic<bool> recording{false};
void note_alloc(void *) noexcept {}
void note_free(void *) noexcept {}
[[noreturn]] void fail(int status, size_t size, int device) {
  std::fprintf(stderr, "bench_bridge: allocating %zu bytes on device %d failed (%d): %s\n", size, device, status,
               cp_last_error());
  std::exit(1);
}
} // namespace cudapool_bridge

int main(int argc, char **argv) {
  std::string which = "bridge";
  long pairs = 0;
  size_t size = 4096; // as bench_micro's pair
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--case") == 0) {
      which = argv[i + 1];
    } else if (std::strcmp(argv[i], "--pairs") == 0) {
      pairs = std::strtol(argv[i + 1], nullptr, 10);
    } else if (std::strcmp(argv[i], "--size") == 0) {
      size = std::strtoull(argv[i + 1], nullptr, 10);
    } else {
      std::fprintf(stderr, "usage: bench_bridge --case bridge|c_entry --pairs N [--size BYTES]\n");
      return 2;
    }
  }
  if (which != "bridge" && which != "c_entry") {
    std::fprintf(stderr, "bench_bridge: unknown case %s\n", which.c_str());
    return 2;
  }
  // As bench_micro's pair: a 64 GiB simulated device without host memory, the default
  // configuration (torch's rules), stream 0.
  if (cpd_use_sim(size_t(64) << 30, 1, CP_SIM_NO_TOUCH) != CP_OK) return 1;
  // Warm: the first segment and the stream's state, so that the pairs counted are all reuses.
  void *warm = cudapool_bridge::alloc_raw(size, 0, nullptr);
  cpd_free(warm, 0);
  for (long k = 0; k < pairs; k++) {
    if (which == "bridge") {
      c10::DataPtr dp = cudapool_bridge::allocate_on(size, 0, nullptr);
      (void)dp; // destroyed here: the deleter frees
    } else {
      void *p = nullptr;
      if (cpd_alloc(size, 0, nullptr, &p) != CP_OK) return 1;
      cudapool_free(p, size, 0, nullptr);
    }
  }
  cp_pool_t *pool = cpd_pool_if_created(0);
  size_t allocated = 0, reserved = 0;
  cp_pool_usage(pool, &allocated, &reserved);
  if (allocated != 0 || cp_pool_check(pool, stderr) != 0) {
    std::fprintf(stderr, "bench_bridge: the pool is not clean after the pairs\n");
    return 1;
  }
  cpd_shutdown();
  std::printf("%s: %ld pairs of %zu bytes\n", which.c_str(), pairs, size);
  return 0;
}
