// fakecuda_device.cpp — the fake GPU's device (fakecuda.h; Note [Fake CUDA in C++] in
// fakecuda_kernels.cpp): the allocator that records each allocation and free, the device guard
// that stands for CUDA's, and the answer to autograd's question whether a device has a context.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <mutex>
#include <utility>

#include "fakecuda/fakecuda.h"

namespace cudapool_fakecuda {
namespace {

constexpr int64_t kAlloc = 0; // cudapool.lab._events.ALLOC
constexpr int64_t kFree = 1;  // cudapool.lab._events.FREE

// ---- what the engine records, under one lock ---------------------------------------------

struct Record {
  std::mutex mu;
  std::vector<Event> events;
  int64_t next_id = 1;
  int64_t live = 0, peak = 0;
  bool tracing = false;
  uint64_t next_addr = 0x100000000000ull; // never dereferenced; never reused
};
Record rec;

int ndevices = 1;
thread_local c10::DeviceIndex t_device = 0;
thread_local c10::StreamId t_stream = 0;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Block { // a DataPtr's context: what its free records
  int64_t id, size, device;
};

void record_free(void *ctx) {
  auto *b = static_cast<Block *>(ctx);
  {
    std::lock_guard<std::mutex> lock(rec.mu);
    if (rec.tracing) {
      rec.events.push_back({kFree, b->id, b->size, t_stream, b->device, now_ns()});
      rec.live -= b->size;
    }
  }
  delete b;
}

// Records an allocation of n bytes (n > 0) and returns its id and address.
std::pair<int64_t, uint64_t> record_alloc(int64_t n, int64_t device) {
  std::lock_guard<std::mutex> lock(rec.mu);
  int64_t id = rec.next_id++;
  uint64_t addr = rec.next_addr;
  rec.next_addr += ((uint64_t)n + 1023u) & ~(uint64_t)511u; // 512-aligned, a gap between blocks
  if (rec.tracing) {
    rec.events.push_back({kAlloc, id, n, t_stream, device, now_ns()});
    rec.live += n;
    if (rec.live > rec.peak) rec.peak = rec.live;
  }
  return {id, addr};
}

struct RecordingAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override { return on(n, t_device); }
  c10::DataPtr on(size_t n, c10::DeviceIndex device) const {
    c10::Device where(c10::kCUDA, device);
    if (n == 0) return c10::DataPtr(nullptr, where);
    auto [id, addr] = record_alloc((int64_t)n, device);
    return c10::DataPtr(reinterpret_cast<void *>(addr), new Block{id, (int64_t)n, device}, &record_free, where);
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
  c10::DeviceIndex deviceCount() const noexcept override { return (c10::DeviceIndex)ndevices; }
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

// ---- the CUDA hooks' primary-context question --------------------------------------------

bool has_context(const at::CUDAHooksInterface *, c10::DeviceIndex i) { return i >= 0 && i < ndevices; }
void **context_slot = nullptr;
void *torch_context = nullptr;

bool write_slot(void **slot, void *value) {
  long page = sysconf(_SC_PAGESIZE);
  uintptr_t start = (uintptr_t)slot & ~(uintptr_t)(page - 1);
  size_t span = ((uintptr_t)slot + sizeof(void *) > start + (uintptr_t)page) ? 2 * (size_t)page : (size_t)page;
  if (mprotect((void *)start, span, PROT_READ | PROT_WRITE) != 0) return false;
  *slot = value;
  mprotect((void *)start, span, PROT_READ);
  return true;
}

// The slot of CUDAHooksInterface::hasPrimaryContext in the hooks object's virtual table (a
// pointer to a virtual member function holds its byte offset plus one: the Itanium C++ ABI).
void **find_context_slot() {
  const at::CUDAHooksInterface &hooks = at::detail::getCUDAHooks();
  auto member = &at::CUDAHooksInterface::hasPrimaryContext;
  struct {
    ptrdiff_t ptr, adj;
  } rep;
  static_assert(sizeof(member) == sizeof(rep), "a pointer to member function of the Itanium C++ ABI");
  std::memcpy(&rep, &member, sizeof rep);
  if (!(rep.ptr & 1) || rep.adj != 0) return nullptr;
  void **vtable = *reinterpret_cast<void **const *>(&hooks);
  return reinterpret_cast<void **>(reinterpret_cast<char *>(vtable) + (rep.ptr - 1));
}

} // namespace

c10::DeviceIndex current_device() { return t_device; }
c10::StreamId current_stream() { return t_stream; }
c10::DeviceIndex index_of(c10::Device d) { return d.index() < 0 ? t_device : d.index(); }
c10::DataPtr allocate(size_t n, c10::DeviceIndex device) { return allocator.on(n, device); }
c10::Allocator *recording_allocator() { return &allocator; }

int64_t record_scratch(int64_t n, int64_t device) { return record_alloc(n, device).first; }

void record_scratch_free(int64_t id, int64_t n, int64_t device) {
  std::lock_guard<std::mutex> lock(rec.mu);
  if (rec.tracing) {
    rec.events.push_back({kFree, id, n, t_stream, device, now_ns()});
    rec.live -= n;
  }
}

std::string install_device(int devices) {
  void **slot = find_context_slot();
  if (slot == nullptr) return "torch's CUDA hooks are not laid out as this build expects";
  ndevices = devices;
  auto &cuda_guard = c10::impl::device_guard_impl_registry[static_cast<size_t>(c10::DeviceType::CUDA)];
  torch_guard = cuda_guard.load();
  void *torch_answer = *slot;
  if (!write_slot(slot, reinterpret_cast<void *>(&has_context)))
    return "cannot patch torch's CUDA hooks (mprotect failed)";
  context_slot = slot;
  torch_context = torch_answer;
  cuda_guard.store(&guard);
  std::lock_guard<std::mutex> lock(rec.mu);
  rec.events.clear();
  rec.live = rec.peak = 0;
  rec.tracing = true;
  return "";
}

void uninstall_device() {
  {
    std::lock_guard<std::mutex> lock(rec.mu);
    rec.tracing = false;
  }
  if (context_slot != nullptr) write_slot(context_slot, torch_context);
  context_slot = nullptr;
  c10::impl::device_guard_impl_registry[static_cast<size_t>(c10::DeviceType::CUDA)].store(torch_guard);
}

std::vector<Event> events_from(size_t start) {
  std::lock_guard<std::mutex> lock(rec.mu);
  if (start >= rec.events.size()) return {};
  return std::vector<Event>(rec.events.begin() + (ptrdiff_t)start, rec.events.end());
}

RecordCounts record_counts() {
  std::lock_guard<std::mutex> lock(rec.mu);
  return {rec.events.size(), rec.live, rec.peak};
}

} // namespace cudapool_fakecuda
