// graph_hooks.cpp — torch's three graph-pool hooks, with the C++ signatures torch calls them with.
// Owns: taking the std::function filter that begin-allocate-to-pool receives by value, and
// turning failures into what torch can report. The pools themselves are graphs.c's.
//
// torch's CUDAPluggableAllocator stores each hook as a plain function address cast to
//   begin:   void(int device, MempoolId_t id, std::function<bool(cudaStream_t)> filter)
//   end:     void(int device, MempoolId_t id)
//   release: void(int device, MempoolId_t id)
// with MempoolId_t = std::pair<unsigned long long, unsigned long long> and cudaStream_t a
// pointer to the opaque CUstream_st. Those are standard-library types, so these functions
// need no torch header and are part of cudapool._C (torch or not at build time); their
// addresses are handed to torch by enable() (set_begin_allocate_to_pool,
// set_end_allocate_to_pool_fn, set_release_pool). The signatures have been the same since
// the hooks appeared (torch 2.3).
#include <cstddef>
#include <cstdio>
#include <functional>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>

#include "base/status.h"
#include "devices/abi.h"
#include "devices/graphs.h"

struct CUstream_st; // the driver's opaque stream, as cuda_runtime_api.h declares it

namespace {

using Stream = CUstream_st *;
using MempoolId = std::pair<unsigned long long, unsigned long long>;
using Filter = std::function<bool(Stream)>;

// The filter is torch's: it asks the driver whether the stream is capturing into this graph.
// It must not throw into C; if it does, the allocation is not routed into the graph's pool.
int call_filter(void *ctx, void *stream) noexcept {
  try {
    return (*static_cast<Filter *>(ctx))(static_cast<Stream>(stream)) ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

void delete_filter(void *ctx) noexcept { delete static_cast<Filter *>(ctx); }

// The message of the failure just reported by graphs.c (it names the hook and the pool).
std::string failure() { return cp_last_error(); }

} // namespace

// begin and end throw on failure: torch's capture_begin / capture_end turn that into a Python
// RuntimeError. release never throws: torch calls it from a graph's destructor.
extern "C" void cudapool_begin_allocate_to_pool(int device, MempoolId id, Filter filter) {
  if (!filter) throw std::invalid_argument("cudapool: begin_allocate_to_pool: the filter is empty");
  Filter *owned = new Filter(std::move(filter));
  if (cpd_graph_begin(device, id.first, id.second, call_filter, owned, delete_filter) != CP_OK) {
    throw std::runtime_error(failure());
  }
}

extern "C" void cudapool_end_allocate_to_pool(int device, MempoolId id) {
  if (cpd_graph_end(device, id.first, id.second) != CP_OK) {
    throw std::runtime_error(failure());
  }
}

extern "C" void cudapool_release_pool(int device, MempoolId id) noexcept {
  if (cpd_graph_release(device, id.first, id.second) != CP_OK) {
    cpd_report("%s\n", cp_last_error());
  }
}

// For tests, which cannot build a std::function through ctypes: call one hook the way torch
// does, through a function pointer of torch's type. `which`: 0 begin (with a filter calling
// `filter(stream, arg)`), 1 end, 2 release. Returns 0, or 1 when the hook threw (its message
// in buf).
extern "C" int cudapool_call_graph_hook(int which, int device, unsigned long long id0, unsigned long long id1,
                                        int (*filter)(void *stream, void *arg), void *arg, char *buf, size_t buf_size) {
  using Begin = void(int, MempoolId, Filter);
  using Other = void(int, MempoolId);
  if (buf_size > 0) buf[0] = '\0';
  try {
    if (which == 0) {
      Begin *begin = cudapool_begin_allocate_to_pool;
      Filter f;
      if (filter != nullptr) f = [filter, arg](Stream s) { return filter(static_cast<void *>(s), arg) != 0; };
      begin(device, MempoolId{id0, id1}, f);
    } else {
      Other *hook = which == 1 ? cudapool_end_allocate_to_pool : cudapool_release_pool;
      hook(device, MempoolId{id0, id1});
    }
    return 0;
  } catch (const std::exception &e) {
    if (buf_size > 0) std::snprintf(buf, buf_size, "%s", e.what());
    return 1;
  }
}
