// bridge_path.h — the hot path of the bridge (bridge.cpp): an allocation made into torch's
// DataPtr and its deleter. Owns nothing; it is the few lines between torch and the pool that
// every tensor goes through, kept apart so that the micro-benchmark (benchmarks/bench_bridge.cpp)
// runs exactly this code. Needs torch's c10 headers only (no CUDA header).
//
// Note [The bridge's data pointers]
// torch's own allocator hands out a DataPtr whose context is the device address, and frees
// through a lookup in a hash map under a mutex; torch's pluggable wrapper adds one more map and
// one more mutex. Here the context is the address with the device in its low bits (every
// address the pools hand out is a multiple of the granule, at least 256 bytes, and there are at
// most CP_MAX_DEVICES = 64 devices), and the deleter, raw_deleter() as with torch's own, takes the
// device back out: it knows the device's pool without any lookup, and the pool's own pointer
// map (which the free reads anyway) knows the block and its size. So a tensor's free is one call
// into the pool: no lock or table of the bridge's. A plain address given to the deleter (device
// bits 0) is found in whichever pool holds it (cpd_free). While torch's history records stacks
// (recordHistory with a context), the allocation and the free also tell the bridge
// (cudapool_bridge::note_alloc / note_free), behind one predictable branch.
#ifndef CP_BRIDGE_PATH_H
#define CP_BRIDGE_PATH_H

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/macros/Macros.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

extern "C" {
#include "core/cp.h"
#include "devices/abi.h"
}

#include "bridge/bridge_notes.h"

namespace cudapool_bridge {

// The device bits of a context (Note [The bridge's data pointers]).
constexpr uintptr_t kDeviceBits = 255;
static_assert(CP_MAX_DEVICES <= kDeviceBits + 1, "a device ordinal fits in the low bits of an address");

inline void *context_of(void *ptr, int device) {
  return reinterpret_cast<void *>(reinterpret_cast<uintptr_t>(ptr) | static_cast<uintptr_t>(device));
}

// The free of a block the bridge handed out, noted in the history when it records; `device` is
// where the block is, or -1 when that is not known (cpd_free looks).
inline void free_noted(void *ptr, int device) noexcept {
  if (C10_UNLIKELY(recording.load(std::memory_order_relaxed))) note_free(ptr);
  cpd_free(ptr, device);
}

// The deleter of every DataPtr the bridge makes (its raw_deleter()).
inline void delete_context(void *ctx) noexcept {
  const uintptr_t bits = reinterpret_cast<uintptr_t>(ctx);
  free_noted(reinterpret_cast<void *>(bits & ~kDeviceBits), static_cast<int>(bits & kDeviceBits));
}

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
  if (C10_UNLIKELY(ptr == nullptr)) return c10::DataPtr(nullptr, where); // size 0
  return c10::DataPtr(ptr, context_of(ptr, device), &delete_context, where);
}

} // namespace cudapool_bridge

#endif // CP_BRIDGE_PATH_H
