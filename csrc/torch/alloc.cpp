// alloc.cpp — the allocation entry point torch calls, the one place that throws.
// Owns: turning a failed allocation into a C++ exception that reaches Python.
//
// torch's CUDAPluggableAllocator does not check the pointer it gets back: a NULL for a
// non-zero size would become a tensor on address 0. The only way to refuse is to throw;
// torch's Python bindings turn a std::exception into a RuntimeError carrying its message,
// and the process goes on. The message starts like torch's own ("CUDA out of memory. Tried
// to allocate ...") so that tools that look for it still find it.
#include <cstddef>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "base/status.h"
#include "torch/abi.h"

namespace {

// An out-of-memory failure, distinct from every other one.
class OutOfMemory : public std::runtime_error {
 public:
  explicit OutOfMemory(const std::string &what) : std::runtime_error(what) {}
};

[[noreturn]] void throw_for(int status, size_t size, int device) {
  char buf[4096];
  cpd_alloc_error_message(status, size, device, buf, sizeof buf);
  if (status == CP_ERR_OOM) throw OutOfMemory(buf);
  throw std::runtime_error(buf);
}

} // namespace

extern "C" void *cudapool_alloc(size_t size, int device, void *stream) {
  void *ptr = nullptr;
  int status = cpd_alloc(size, device, stream, &ptr);
  if (status != CP_OK) throw_for(status, size, device);
  return ptr;
}

// For tests: the same path, with the exception caught here, since ctypes cannot catch one.
// Returns the status; on failure the message is in buf.
extern "C" int cudapool_alloc_catching(size_t size, int device, void *stream, void **out_ptr, char *buf,
                                       size_t buf_size) {
  try {
    *out_ptr = cudapool_alloc(size, device, stream);
    return CP_OK;
  } catch (const OutOfMemory &e) {
    std::snprintf(buf, buf_size, "%s", e.what());
    return CP_ERR_OOM;
  } catch (const std::exception &e) {
    std::snprintf(buf, buf_size, "%s", e.what());
    return CP_ERR_BACKEND;
  }
}
