// alloc.cpp — the allocation entry point torch calls, the one place that throws.
// Owns: turning a failed allocation into a C++ exception that reaches Python.
//
// torch's CUDAPluggableAllocator does not check the pointer it gets back: a NULL for a
// non-zero size would become a tensor on address 0. The only way to refuse is to throw.
// Out of memory throws c10::OutOfMemoryError through the registered thrower when there is one
// (Note [Out-of-memory type] in abi.h), which torch turns into torch.OutOfMemoryError; without
// it, and for every other failure, a std::exception, which torch's Python bindings turn into a
// RuntimeError carrying its message. The message starts like torch's own ("CUDA out of
// memory. Tried to allocate ...") so that tools that look for it still find it.
#include <cstddef>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "base/status.h"
#include "devices/abi.h"

namespace {

// An out-of-memory failure, distinct from every other one (the fallback without a thrower).
class OutOfMemory : public std::runtime_error {
 public:
  explicit OutOfMemory(const std::string &what) : std::runtime_error(what) {}
};

// The allocation; *status is its result (CP_OK, or what was thrown for).
void *alloc_or_throw(size_t size, int device, void *stream, int *status) {
  void *ptr = nullptr;
  *status = cpd_alloc(size, device, stream, &ptr);
  if (*status != CP_OK) cpd_throw_alloc_failure(*status, size, device, nullptr);
  return ptr;
}

} // namespace

extern "C" [[noreturn]] void cpd_throw_alloc_failure(int status, size_t size, int device,
                                                     const cpd_alloc_throw_t *how) {
  const cpd_alloc_throw_t none = {nullptr, nullptr, nullptr};
  if (how == nullptr) how = &none;
  char buf[4096];
  cpd_alloc_error_message(status, size, device, buf, sizeof buf);
  if (status != CP_ERR_OOM) {
    if (how->other != nullptr) how->other(buf);
    throw std::runtime_error(buf);
  }
  if (how->oom_seen != nullptr) how->oom_seen(size, device);
  cpd_oom_thrower_t thrower = how->oom != nullptr ? how->oom : cpd_oom_thrower();
  if (thrower != nullptr) thrower(buf); // throws c10::OutOfMemoryError
  throw OutOfMemory(buf);
}

extern "C" void *cudapool_alloc(size_t size, int device, void *stream) {
  int status;
  return alloc_or_throw(size, device, stream, &status);
}

// For tests: the same path, with the exception caught here, since ctypes cannot catch one.
// Returns the status; on failure the exception's message is in buf.
extern "C" int cudapool_alloc_catching(size_t size, int device, void *stream, void **out_ptr, char *buf,
                                       size_t buf_size) {
  int status = CP_OK;
  try {
    *out_ptr = alloc_or_throw(size, device, stream, &status);
    return CP_OK;
  } catch (const std::exception &e) {
    std::snprintf(buf, buf_size, "%s", e.what());
  } catch (...) {
    std::snprintf(buf, buf_size, "cudapool: an exception that is not a std::exception");
  }
  return status != CP_OK ? status : CP_ERR_BACKEND;
}
