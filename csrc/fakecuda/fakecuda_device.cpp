// fakecuda_device.cpp — the fake GPU's device (fakecuda.h; Note [Fake CUDA in C++] in
// fakecuda_kernels.cpp): the allocator that records each allocation and free, the device guard
// that stands for CUDA's, and what torch's CUDA hooks answer while it is installed (whether a
// device has a context; in a process of its own, init and pinned host memory), given to torch by
// fakecuda_vtable.cpp.
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>

#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "fakecuda/fakecuda.h"

namespace cudapool_fakecuda {
namespace {

// ---- what the engine records, under one lock ---------------------------------------------

struct Record {
  std::mutex mu;
  std::vector<cp_trace_event_t> events; // the trace's records, as the replay reads them
  int64_t next_id = 1;
  int64_t live = 0, peak = 0;
  bool tracing = false;
  uint64_t next_addr = 0x100000000000ull; // never dereferenced; never reused
  // Streams under a CUDA graph capture, and the trace stream of the pool each allocates from
  // (Note [CUDA graphs on the fake GPU] in cudapool/fakegpu/graphs.py).
  std::map<c10::StreamId, int64_t> capturing;
  // The record whose allocation calls `watcher` once it is recorded (where an out-of-memory
  // error of the replay was: cudapool.ab.sim_child --where-event); -1: none.
  int64_t watch = -1;
  std::function<void()> watcher;
};
Record rec;

int ndevices = 1;
thread_local c10::DeviceIndex t_device = 0;
thread_local c10::StreamId t_stream = 0;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Appends one record (rec.mu held), now. An allocation is on the thread's current stream; its free
// names the same stream, whichever stream is current where it is freed (the trace's rule: a block
// belongs to the stream it was allocated on, lab/trace.py).
void push_locked(uint8_t action, int64_t id, int64_t size, int64_t device, c10::StreamId stream) {
  cp_trace_event_t e{};
  e.action = action;
  e.device = static_cast<int32_t>(device);
  e.id = static_cast<uint64_t>(id);
  e.size = static_cast<uint64_t>(size);
  e.stream = static_cast<uint64_t>(stream);
  e.time_ns = now_ns();
  rec.events.push_back(e);
}

struct Block { // a DataPtr's context: what its free records
  int64_t id, size, device;
  c10::StreamId stream;
};

void record_free(void *ctx) {
  auto *b = static_cast<Block *>(ctx);
  {
    std::lock_guard<std::mutex> lock(rec.mu);
    if (rec.tracing) {
      push_locked(CP_TRACE_FREE, b->id, b->size, b->device, b->stream);
      rec.live -= b->size;
    }
  }
  delete b;
}

struct Allocation {
  int64_t id;
  uint64_t addr;
  c10::StreamId stream; // the trace's: the thread's stream, or the pool its capture allocates from
};

// The trace's stream of what the thread allocates now (rec.mu held): its current stream's, or
// the pool of a capture on that stream.
c10::StreamId trace_stream_locked() {
  auto pool = rec.capturing.find(t_stream);
  return pool == rec.capturing.end() ? t_stream : static_cast<c10::StreamId>(pool->second);
}

// Records an allocation of n bytes (n > 0) on the thread's current stream.
Allocation record_alloc(int64_t n, int64_t device) {
  std::function<void()> call;
  Allocation a{};
  {
    std::lock_guard<std::mutex> lock(rec.mu);
    a = Allocation{rec.next_id++, rec.next_addr, trace_stream_locked()};
    rec.next_addr += (static_cast<uint64_t>(n) + 1023u) & ~uint64_t{511}; // 512-aligned, a gap between blocks
    if (rec.tracing) {
      push_locked(CP_TRACE_ALLOC, a.id, n, device, a.stream);
      rec.live += n;
      if (rec.live > rec.peak) rec.peak = rec.live;
      if (rec.watch >= 0 && static_cast<int64_t>(rec.events.size()) - 1 == rec.watch) {
        rec.watch = -1;
        call = std::move(rec.watcher);
      }
    }
  }
  if (call) call(); // outside the lock: it may allocate
  return a;
}

struct RecordingAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override { return on(n, t_device); }
  c10::DataPtr on(size_t n, c10::DeviceIndex device) const {
    c10::Device where(c10::kCUDA, device);
    if (n == 0) return c10::DataPtr(nullptr, where);
    Allocation a = record_alloc(static_cast<int64_t>(n), device);
    return c10::DataPtr(reinterpret_cast<void *>(a.addr), new Block{a.id, static_cast<int64_t>(n), device, a.stream},
                        &record_free, where);
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void *, const void *, std::size_t) const override {} // no values to copy
};
RecordingAllocator allocator;

// ---- the device guard --------------------------------------------------------------------

struct FakeGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return c10::kCUDA; }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old(c10::kCUDA, t_device);
    t_device = index_of(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(c10::kCUDA, t_device); }
  void setDevice(c10::Device d) const override { t_device = index_of(d); }
  void uncheckedSetDevice(c10::Device d) const noexcept override { t_device = index_of(d); }
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::kCUDA, index_of(d)), t_stream);
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::kCUDA, index_of(d)), 0);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override { return getDefaultStream(d); }
  c10::Stream getNewStream(c10::Device d, int) const override { return getDefaultStream(d); }
  c10::Stream exchangeStream(c10::Stream s) const override {
    c10::Stream old = getStream(s.device());
    t_stream = s.id();
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override { return static_cast<c10::DeviceIndex>(ndevices); }
  void record(void **, const c10::Stream &, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void *, const c10::Stream &) const override {}
  bool queryEvent(void *) const override { return true; }
  void destroyEvent(void *, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream &) const override { return true; }
  void synchronizeStream(const c10::Stream &) const override {}
  void synchronizeEvent(void *) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr &, const c10::Stream &) const override {}
};
FakeGuard guard;
const c10::impl::DeviceGuardImplInterface *torch_guard = nullptr;

// ---- the CUDA hooks' answers (fakecuda_vtable.cpp) ----------------------------------------

bool has_context(const at::CUDAHooksInterface *, c10::DeviceIndex i) { return i >= 0 && i < ndevices; }
void no_init(const at::CUDAHooksInterface *) {}

// "Pinned" host memory of the fake GPU: plain host memory, remembered so that the hooks can say a
// pointer into it is pinned (DDP's reducer checks what it asked for).
std::mutex pinned_mu;
std::map<uintptr_t, size_t> pinned; // start -> bytes

void pinned_free(void *p) {
  {
    std::lock_guard<std::mutex> lock(pinned_mu);
    pinned.erase(reinterpret_cast<uintptr_t>(p));
  }
  c10::free_cpu(p);
}

struct PinnedHostAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void *p = n == 0 ? nullptr : c10::alloc_cpu(n);
    if (p != nullptr) {
      std::lock_guard<std::mutex> lock(pinned_mu);
      pinned[reinterpret_cast<uintptr_t>(p)] = n;
    }
    return c10::DataPtr(p, p, p == nullptr ? nullptr : &pinned_free, c10::Device(c10::kCPU));
  }
  c10::DeleterFnPtr raw_deleter() const override { return &pinned_free; }
  void copy_data(void *dest, const void *src, std::size_t count) const override { std::memcpy(dest, src, count); }
};
PinnedHostAllocator pinned_allocator;

c10::Allocator *host_allocator(const at::CUDAHooksInterface *) { return &pinned_allocator; }

bool is_pinned(const at::CUDAHooksInterface *, const void *data) {
  const auto at = reinterpret_cast<uintptr_t>(data);
  std::lock_guard<std::mutex> lock(pinned_mu);
  auto it = pinned.upper_bound(at);
  if (it == pinned.begin()) return false;
  --it;
  return at < it->first + it->second;
}

const ProcessAnswers process_answers{&no_init, &host_allocator, &is_pinned};

} // namespace

c10::DeviceIndex current_device() { return t_device; }
c10::StreamId current_stream() { return t_stream; }
int device_count() { return ndevices; }
void set_current_device(c10::DeviceIndex device) { t_device = device; }
void set_current_stream(c10::StreamId stream) { t_stream = stream; }
c10::DeviceIndex index_of(c10::Device d) { return d.index() < 0 ? t_device : d.index(); }
c10::DataPtr allocate(size_t n, c10::DeviceIndex device) { return allocator.on(n, device); }
c10::Allocator *recording_allocator() { return &allocator; }

void watch_record(int64_t index, std::function<void()> watcher) {
  std::lock_guard<std::mutex> lock(rec.mu);
  rec.watch = watcher ? index : -1;
  rec.watcher = std::move(watcher);
}

void capture_to_pool(c10::StreamId stream, int64_t pool_stream) {
  std::lock_guard<std::mutex> lock(rec.mu);
  if (pool_stream == 0)
    rec.capturing.erase(stream);
  else
    rec.capturing[stream] = pool_stream;
}

int64_t record_scratch(int64_t n, int64_t device) { return record_alloc(n, device).id; }

void record_scratch_free(int64_t id, int64_t n, int64_t device) {
  std::lock_guard<std::mutex> lock(rec.mu);
  if (rec.tracing) {
    push_locked(CP_TRACE_FREE, id, n, device, trace_stream_locked()); // a kernel's scratch: freed where it was made
    rec.live -= n;
  }
}

std::string install_device(int devices, bool whole_process) {
  std::string why = patch_hooks(&has_context, whole_process ? &process_answers : nullptr);
  if (!why.empty()) return why;
  ndevices = devices;
  t_device = 0;
  t_stream = 0;
  install_reducer_timer();
  torch_guard = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  c10::impl::DeviceGuardImplRegistrar(c10::DeviceType::CUDA, &guard);
  std::lock_guard<std::mutex> lock(rec.mu);
  rec.events.clear();
  rec.capturing.clear();
  rec.watch = -1;
  rec.watcher = nullptr;
  rec.live = rec.peak = 0;
  rec.tracing = true;
  return "";
}

void uninstall_device() {
  {
    std::lock_guard<std::mutex> lock(rec.mu);
    rec.tracing = false;
  }
  unpatch_hooks();
  if (torch_guard != nullptr) c10::impl::DeviceGuardImplRegistrar(c10::DeviceType::CUDA, torch_guard);
  torch_guard = nullptr;
}

size_t copy_records(size_t start, const std::function<cp_trace_event_t *(size_t n)> &room) {
  std::lock_guard<std::mutex> lock(rec.mu);
  if (start >= rec.events.size()) return 0;
  size_t n = rec.events.size() - start;
  std::memcpy(room(n), rec.events.data() + start, n * sizeof(cp_trace_event_t));
  return n;
}

RecordCounts record_counts() {
  std::lock_guard<std::mutex> lock(rec.mu);
  return {rec.events.size(), rec.live, rec.peak};
}

} // namespace cudapool_fakecuda
