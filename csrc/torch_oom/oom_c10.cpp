// oom_c10.cpp — the library cudapool._torch_oom: throws torch's own out-of-memory type for
// cudapool_alloc (Note [Out-of-memory type] in abi.h). Built by setup.py only when torch is
// importable at build time, against its headers and its libc10; loaded with ctypes by
// enable(), which registers cudapool_torch_oom_throw with cudapool_set_oom_thrower once
// cudapool_torch_oom_torch_version() equals the running torch's version. It links nothing of
// cudapool and includes no Python header: it is a plain shared library.
#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdio>
#include <exception>

#include "torch_oom/oom_c10.h"

#ifndef CUDAPOOL_TORCH_VERSION
#error "CUDAPOOL_TORCH_VERSION (the version of torch this is built against) must be defined"
#endif

extern "C" {

// The torch version whose headers and libc10 this library was built against.
const char *cudapool_torch_oom_torch_version(void) { return CUDAPOOL_TORCH_VERSION; }

// The thrower (oom_c10.h).
[[noreturn]] void cudapool_torch_oom_throw(const char *message) { cudapool_torch_oom::throw_oom(message); }

// For tests: call `alloc` (cudapool_alloc) and say which C++ type it threw, as torch's catch
// sites would see it. Returns 0 (nothing thrown; *out_ptr is the pointer), 1
// (c10::OutOfMemoryError), 2 (another c10::Error), 3 (another std::exception) or 4 (anything
// else); buf receives the message (what_without_backtrace() for c10's types).
int cudapool_torch_oom_catch(void *(*alloc)(size_t, int, void *), size_t size, int device, void *stream, void **out_ptr,
                             char *buf, size_t buf_size) {
  buf[0] = '\0';
  try {
    *out_ptr = alloc(size, device, stream);
    return 0;
  } catch (const c10::OutOfMemoryError &e) {
    std::snprintf(buf, buf_size, "%s", e.what_without_backtrace());
    return 1;
  } catch (const c10::Error &e) {
    std::snprintf(buf, buf_size, "%s", e.what_without_backtrace());
    return 2;
  } catch (const std::exception &e) {
    std::snprintf(buf, buf_size, "%s", e.what());
    return 3;
  } catch (...) {
    return 4;
  }
}

} // extern "C"
