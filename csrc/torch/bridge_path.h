// bridge_path.h — the hot path of the bridge (bridge.cpp): an allocation made into torch's
// DataPtr and its deleter. Owns nothing; it is the few lines between torch and the pool that
// every tensor goes through, kept apart so that the micro-benchmark (benchmarks/bench_bridge.cpp)
// runs exactly this code. Needs torch's c10 headers only (no CUDA header).
//
// Note [The bridge's data pointers]
// torch's own allocator hands out a DataPtr whose context is the device address, and frees
// through a lookup in a hash map under a mutex; torch's pluggable wrapper adds one more map and
// one more mutex. Here the context is the address too, but the deleter is one of
// CP_MAX_DEVICES functions, one per device: it knows the device's pool without any lookup, and
// the pool's own pointer map (which the free reads anyway) knows the block and its size. So a
// tensor's free is one call into the pool: no lock or table of the bridge's. While torch's
// history records stacks (recordHistory with a context), the allocation and the free also tell
// the bridge (cudapool_bridge_note_alloc / _free), behind one predictable branch.
#ifndef CP_BRIDGE_PATH_H
#define CP_BRIDGE_PATH_H

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/macros/Macros.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <utility>

extern "C" {
#include "core/cp.h"
#include "torch/abi.h"
}

namespace cudapool_bridge {

// Set while torch's history records contexts (bridge.cpp); read on every allocation and free.
extern std::atomic<bool> recording;
void note_alloc(void *ptr) noexcept;
void note_free(void *ptr) noexcept;
// A failed allocation: tell torch's out-of-memory observers, then throw what torch expects
// (c10::OutOfMemoryError for CP_ERR_OOM, c10::Error otherwise). Defined by the bridge (and by
// the benchmark, which never fails).
[[noreturn]] void fail(int status, size_t size, int device);

template <int D>
void delete_on(void *ptr) noexcept {
  if (C10_UNLIKELY(recording.load(std::memory_order_relaxed))) note_free(ptr);
  cpd_free(ptr, D);
}

template <int... D>
constexpr std::array<c10::DeleterFnPtr, sizeof...(D)> make_deleters(std::integer_sequence<int, D...>) {
  return {{&delete_on<D>...}};
}

// deleters[d] frees a pointer of device d's pools.
inline constexpr std::array<c10::DeleterFnPtr, CP_MAX_DEVICES> deleters =
    make_deleters(std::make_integer_sequence<int, CP_MAX_DEVICES>{});

// The allocation: `size` bytes on `device` for use on `stream` (the current ones, as torch's
// own allocator takes them). Size 0 is a null DataPtr, as with torch's.
inline void *alloc_raw(size_t size, int device, void *stream) {
  void *ptr = nullptr;
  const int rc = cpd_alloc(size, device, stream, &ptr);
  if (C10_UNLIKELY(rc != CP_OK)) fail(rc, size, device);
  if (C10_UNLIKELY(recording.load(std::memory_order_relaxed)) && ptr != nullptr) note_alloc(ptr);
  return ptr;
}

inline c10::DataPtr allocate_on(size_t size, int device, void *stream) {
  void *ptr = alloc_raw(size, device, stream);
  const c10::Device where(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device));
  // Size 0 succeeds before the device is looked at: no deleter is picked for it.
  if (C10_UNLIKELY(ptr == nullptr)) return c10::DataPtr(nullptr, where);
  return c10::DataPtr(ptr, ptr, deleters[static_cast<size_t>(device)], where);
}

} // namespace cudapool_bridge

#endif // CP_BRIDGE_PATH_H
