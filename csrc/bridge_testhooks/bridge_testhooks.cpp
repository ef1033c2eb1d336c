// bridge_testhooks.cpp — entry points for tests of the bridge (tests/test_torch_bridge.py) on a
// machine without a GPU: the library cudapool._torch_bridge_testhooks, linked to the bridge and
// never part of it. Owns nothing of the allocator. The
// bridge's allocate() and raw_alloc() ask torch for the current device and stream, which needs
// the CUDA runtime; these hooks take both as arguments and then run the bridge's own code
// (bridge_path.h), and call the methods that torch's Python bindings reach only through CUDA's
// lazy initialisation on torch's current allocator, which is the bridge once it is installed.
// Every hook returns 0, or 1 with the error's message in buf (2 for c10::OutOfMemoryError).
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/csrc/profiler/combined_traceback.h>

#include <array>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "bridge/bridge_path.h"
#include "bridge/bridge_state.h" // Note [torch versions]

namespace cc = c10::cuda::CUDACachingAllocator;

namespace {

std::mutex mu;
std::map<void *, c10::DataPtr> held;                                         // DataPtrs the tests allocated, by address
std::map<c10::StorageImpl *, c10::intrusive_ptr<c10::StorageImpl>> storages; // until Python holds them
std::vector<int> tracker_actions;                                            // actions the test's trace tracker saw
std::vector<std::pair<size_t, size_t>> tracker_ranges;
std::vector<std::array<uint64_t, 4>> oom_seen; // what the test's out-of-memory observer was told

template <class F>
int guarded(char *buf, size_t buf_size, F &&body) {
  if (buf_size > 0) buf[0] = '\0';
  try {
    body();
    return 0;
  } catch (const c10::OutOfMemoryError &e) {
    std::snprintf(buf, buf_size, "%s", e.what_without_backtrace());
    return 2;
  } catch (const c10::Error &e) {
    std::snprintf(buf, buf_size, "%s", e.what_without_backtrace());
  } catch (const std::exception &e) {
    std::snprintf(buf, buf_size, "%s", e.what());
  }
  return 1;
}

std::shared_ptr<c10::GatheredContext> python_stack() { return torch::CapturedTraceback::gather(true, true, false); }

} // namespace

extern "C" {

// allocate() with the device and stream given: a DataPtr held until cudapool_bridge_test_free.
__attribute__((visibility("default"))) int cudapool_bridge_test_allocate(size_t size, int device, void *stream,
                                                                         void **out_ptr, char *buf, size_t buf_size) {
  *out_ptr = nullptr;
  return guarded(buf, buf_size, [&] {
    c10::DataPtr dp = cudapool_bridge::allocate_with(size, device, stream);
    *out_ptr = dp.get();
    TORCH_CHECK(dp.get() == nullptr || dp.get_context() == cudapool_bridge::context_of(dp.get(), device),
                "the DataPtr's context is not its address with its device");
    TORCH_CHECK(dp.get() == nullptr || dp.get_deleter() == cc::get()->raw_deleter(),
                "the DataPtr's deleter is not the allocator's raw_deleter()");
    TORCH_CHECK(dp.device() == c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)),
                "the DataPtr names another device");
    if (dp.get() != nullptr) {
      std::lock_guard<std::mutex> g(mu);
      held.emplace(dp.get(), std::move(dp));
    }
  });
}

// Drop a held DataPtr: its deleter frees it, as when torch frees the tensor.
__attribute__((visibility("default"))) int cudapool_bridge_test_free(void *ptr) {
  c10::DataPtr dp;
  {
    std::lock_guard<std::mutex> g(mu);
    auto it = held.find(ptr);
    if (it == held.end()) return 1;
    dp = std::move(it->second);
    held.erase(it);
  }
  return 0; // dp goes out of scope here: the deleter runs
}

// A torch storage over allocate() with the device and stream given, as torch makes for a CUDA
// tensor: its StorageImpl's address in *out_impl, for torch.UntypedStorage._new_with_weak_ptr;
// this library holds it until cudapool_bridge_test_storage_drop, then the storage's owners do.
__attribute__((visibility("default"))) int cudapool_bridge_test_storage(size_t size, int device, void *stream,
                                                                        uint64_t *out_impl, char *buf,
                                                                        size_t buf_size) {
  *out_impl = 0;
  return guarded(buf, buf_size, [&] {
    auto impl = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), size,
                                                      cudapool_bridge::allocate_with(size, device, stream),
                                                      /*allocator=*/nullptr, /*resizable=*/false);
    *out_impl = reinterpret_cast<uint64_t>(impl.get());
    std::lock_guard<std::mutex> g(mu);
    storages.emplace(impl.get(), std::move(impl));
  });
}

__attribute__((visibility("default"))) int cudapool_bridge_test_storage_drop(uint64_t impl) {
  c10::intrusive_ptr<c10::StorageImpl> dropped;
  {
    std::lock_guard<std::mutex> g(mu);
    auto it = storages.find(reinterpret_cast<c10::StorageImpl *>(impl));
    if (it == storages.end()) return 1;
    dropped = std::move(it->second);
    storages.erase(it);
  }
  return 0;
}

// torch.compile's region `name` entered (push 1) or left (push 0) on this thread, as torch's
// record_function callback tells the allocator while history records compile contexts.
__attribute__((visibility("default"))) int cudapool_bridge_test_compile_context(int push, const char *name, char *buf,
                                                                                size_t buf_size) {
  return guarded(buf, buf_size, [&] {
    std::string md(name);
    if (push) {
      cc::get()->pushCompileContext(md);
    } else {
      cc::get()->popCompileContext();
    }
  });
}

// recordStream with a held DataPtr (the bridge's recordStream reads the pointer and the stream).
__attribute__((visibility("default"))) int cudapool_bridge_test_record_stream(void *ptr, void *stream, char *buf,
                                                                              size_t buf_size) {
  return guarded(buf, buf_size, [&] {
    std::lock_guard<std::mutex> g(mu);
    auto it = held.find(ptr);
    TORCH_CHECK(it != held.end(), "not a held pointer");
    // torch's CUDAStream for a raw stream needs the CUDA runtime (getStreamFromExternal), so this
    // calls what the bridge's recordStream calls with the DataPtr's address and the raw stream.
    cudapool_record_stream(it->second.get(), stream);
  });
}

// torch's recordHistory on the current allocator, with torch's Python-stack recorder (or none):
// when 0 NEVER, 1 STATE, 2 ALLOC, 3 ALL.
__attribute__((visibility("default"))) int cudapool_bridge_test_record_history(int enabled, int with_stacks, int when,
                                                                               size_t max_entries, int clear,
                                                                               const char *skip, char *buf,
                                                                               size_t buf_size) {
  return guarded(buf, buf_size, [&] {
    std::vector<std::string> skip_actions;
    if (skip != nullptr && *skip != '\0') skip_actions.emplace_back(skip);
    cc::get()->recordHistory(enabled != 0, with_stacks ? python_stack : nullptr, max_entries,
                             static_cast<cc::RecordContext>(when), clear != 0, skip_actions);
  });
}

// One call of torch's allocator interface on the current allocator, by name; a and b are its
// arguments (a device is `device`, a MempoolId is (a, b)); *out its answer where it has one.
__attribute__((visibility("default"))) int cudapool_bridge_test_call(const char *call, int device, uint64_t a,
                                                                     uint64_t b, uint64_t *out, char *buf,
                                                                     size_t buf_size) {
  return guarded(buf, buf_size, [&] {
    cc::CUDAAllocator *al = cc::get();
    const auto dev = static_cast<c10::DeviceIndex>(device);
    const c10::MempoolId_t id{a, b};
    const std::string name(call);
    *out = 0;
    if (name == "name") {
      *out = al->name() == "cudapool";
    } else if (name == "initialized") {
      *out = al->initialized();
    } else if (name == "init") {
      al->init(device);
    } else if (name == "cacheInfo") {
      size_t largest = a;
      al->cacheInfo(dev, &largest);
      *out = largest;
    } else if (name == "getMemoryInfo") {
      *out = al->getMemoryInfo(dev).first;
    } else if (name == "getMemoryFraction") {
      const double f = al->getMemoryFraction(dev);
      std::memcpy(out, &f, sizeof f);
    } else if (name == "setMemoryFraction") {
      double f;
      std::memcpy(&f, &a, sizeof f);
      al->setMemoryFraction(f, dev);
    } else if (name == "getBaseAllocation") {
      size_t size = 0;
      *out = reinterpret_cast<uint64_t>(al->getBaseAllocation(reinterpret_cast<void *>(a), &size));
      out[1] = size;
    } else if (name == "raw_alloc_with_stream") { // the device comes from `device`, not the runtime
      *out = reinterpret_cast<uint64_t>(cudapool_bridge::alloc_raw(a, device, reinterpret_cast<void *>(b)));
    } else if (name == "raw_delete") {
      al->raw_delete(reinterpret_cast<void *>(a));
    } else if (name == "raw_deleter") {
      al->raw_deleter()(reinterpret_cast<void *>(a));
    } else if (name == "emptyCache") {
      al->emptyCache(id);
    } else if (name == "createOrIncrefPool") {
      al->createOrIncrefPool(dev, id, nullptr);
    } else if (name == "createOrIncrefPoolOther") {
      auto other = torch::cuda::CUDAPluggableAllocator::createCustomAllocator(
          [](size_t, int, cudaStream_t) -> void * { return nullptr; }, [](void *, size_t, int, cudaStream_t) {});
      al->createOrIncrefPool(dev, id, other);
    } else if (name == "getPoolUseCount") {
      *out = static_cast<uint64_t>(al->getPoolUseCount(dev, id));
    } else if (name == "releasePool") {
      al->releasePool(dev, id);
    } else if (name == "beginAllocateToPool") { // this thread's allocations, as use_mem_pool routes them
      const auto me = std::this_thread::get_id();
      al->beginAllocateToPool(dev, id, [me](cudaStream_t) { return std::this_thread::get_id() == me; });
    } else if (name == "endAllocateToPool") {
      al->endAllocateToPool(dev, id);
    } else if (name == "setUseOnOOM") {
      al->setUseOnOOM(dev, id, a != 0);
    } else if (name == "setNoSplit") {
      al->setNoSplit(dev, id);
    } else if (name == "getExpandableSegmentSizes") {
      size_t total = 0;
      for (const auto &s : al->getExpandableSegmentSizes(dev)) total += s.total_size;
      *out = total;
    } else if (name == "enable") {
      al->enable(a != 0);
    } else if (name == "isHistoryEnabled") {
      *out = al->isHistoryEnabled();
    } else if (name == "checkPoolLiveAllocations") {
      *out = al->checkPoolLiveAllocations(dev, id, {});
    } else if (name == "getCheckpointState") {
      *out = al->getCheckpointState(dev, id) != nullptr;
    } else if (name == "shareIpcHandle") {
      (void)al->shareIpcHandle(reinterpret_cast<void *>(a));
    } else if (name == "getIpcDevPtr") {
      (void)al->getIpcDevPtr("handle");
    } else if (name == "attachAllocatorTraceTracker") {
      al->attachAllocatorTraceTracker([](const c10::CachingDeviceAllocator::TraceEntry &te) {
        std::lock_guard<std::mutex> g(mu);
        tracker_actions.push_back(static_cast<int>(te.action_));
        tracker_ranges.emplace_back(te.addr_, te.size_);
      });
    } else if (name == "attachOutOfMemoryObserver") {
      al->attachOutOfMemoryObserver([](int64_t d, size_t size, size_t total, size_t device_free) {
        std::lock_guard<std::mutex> g(mu);
        oom_seen.push_back({static_cast<uint64_t>(d), size, total, device_free});
      });
    } else if (name == "oomObserved") { // calls so far; out[1]: field a of the last one
      std::lock_guard<std::mutex> g(mu);
      *out = oom_seen.size();
      if (!oom_seen.empty()) out[1] = oom_seen.back()[a % 4];
    } else if (name == "recordAnnotation") { // as torch's record_function callback: a = 1 at the end
      al->recordAnnotation({{"name", "region" + std::to_string(b)}, {"stage", a != 0 ? "END" : "START"}});
#if CP_TORCH_CAPTURE_MARKS
    } else if (name == "markCaptureBegin") {
      al->markCaptureBegin(dev);
    } else if (name == "markCaptureEnd") {
      al->markCaptureEnd(dev);
#endif
#if CP_TORCH_CONTEXT_FOR_POINTER
    } else if (name == "getContextForPointer") {
      *out = al->getContextForPointer(reinterpret_cast<void *>(a)) != nullptr;
#endif
#if CP_TORCH_ALLOCATE_WITH_ADDRESS
    } else if (name == "allocateWithAddress") {
      (void)al->allocateWithAddress(a, reinterpret_cast<void *>(b));
#endif
    } else if (name == "trackerEvents") { // how many events of action a (TraceEntry::Action) it saw
      std::lock_guard<std::mutex> g(mu);
      for (int act : tracker_actions) *out += act == static_cast<int>(a);
    } else {
      TORCH_CHECK(false, "no such test call: ", name);
    }
  });
}

} // extern "C"
