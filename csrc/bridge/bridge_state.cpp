// bridge_state.cpp — the bridge's record of torch's state (bridge_state.h): the contexts torch's
// history recorder makes, the labels on the history (user metadata, compile contexts,
// annotations), the capture marks, the out-of-memory observers, the trace trackers, and the
// failure of an allocation as torch expects it.
#include "bridge/bridge_state.h"

#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <ctime>
#include <exception>
#include <map>
#include <unordered_set>

extern "C" {
#include "devices/abi.h"
#include "devices/devices.h"
}
#include "bridge/bridge_notes.h"
#include "core/snapshot.h"
#include "devices/graphs.h"
#include "torch_oom/oom_c10.h"

namespace cudapool_bridge {

// The hot path's (bridge_path.h) flag and, below, what it calls (note_alloc, note_free, fail;
// declared in bridge_notes.h): defined here, where what they touch is kept. This file does not
// include the hot path: the path calls the state, never the other way.
std::atomic<bool> recording{false};

History &history() {
  static History *h = new History(); // never destroyed: deleters may run at exit
  return *h;
}

namespace {

thread_local std::shared_ptr<c10::GatheredContext> pending; // the context of this thread's allocation

enum class Gather { kAlloc, kFree, kAnnotation };

// Gather one context with torch's recorder; keep it for the trace when `when` says so.
uint64_t gather(Gather kind) {
  const bool for_free = kind == Gather::kFree;
  History &h = history();
  cc::CreateContextFn recorder;
  cc::RecordContext when;
  {
    std::lock_guard<std::mutex> g(h.mu);
    recorder = h.recorder;
    when = h.when;
  }
  if (recorder == nullptr || when == cc::RecordContext::NEVER) return 0;
  std::shared_ptr<c10::GatheredContext> ctx = recorder(); // without any lock: it may take the GIL
  if (kind == Gather::kAlloc) pending = ctx;
  if (when == cc::RecordContext::STATE || (for_free && when != cc::RecordContext::ALL)) return 0;
  std::lock_guard<std::mutex> g(h.mu);
  const uint64_t id = h.next_id++;
  h.traced.emplace_back(id, std::move(ctx));
  size_t pools = 0; // the device pools whose rings could name it
  for (int d = 0; d < CP_MAX_DEVICES; d++) pools += cpd_pool_if_created(d) != nullptr;
  const size_t keep = h.max_entries * std::max<size_t>(pools, 1) + 64;
  while (h.traced.size() > keep) h.traced.pop_front();
  return id;
}

} // namespace

uint64_t gather_alloc() { return gather(Gather::kAlloc); }
uint64_t gather_free() { return gather(Gather::kFree); }
uint64_t gather_annotation() { return gather(Gather::kAnnotation); }

std::shared_ptr<c10::GatheredContext> traced_context(uint64_t id) {
  if ((id & kContextBit) == 0) return nullptr; // none, or one of cudapool's own Python stacks
  History &h = history();
  // Ids are increasing: a binary search over the queue.
  auto it = std::lower_bound(h.traced.begin(), h.traced.end(), id,
                             [](const auto &entry, uint64_t key) { return entry.first < key; });
  return it != h.traced.end() && it->first == id ? it->second : nullptr;
}

// ---- labels (Note [Labels]) ----------------------------------------------------------------------

namespace {

struct Labels {
  std::mutex mu;
  std::map<uint32_t, Label> by_tag;
  std::map<std::pair<std::string, std::string>, uint32_t> by_label;
  std::map<uint32_t, size_t> held; // tags threads have set, and by how many threads
  uint32_t next = 1;
  size_t collect_at = 4096;
  std::deque<cda::AnnotationEntry> annotations; // recordAnnotation's, oldest first
};

Labels &labels() {
  static Labels *l = new Labels(); // never destroyed: threads may end after exit began
  return *l;
}

int collect_ring(void *arg, int device, unsigned long long id0, unsigned long long id1, cp_pool_t *pool) {
  (void)device, (void)id0, (void)id1;
  auto *named = static_cast<std::unordered_set<uint32_t> *>(arg);
  size_t capacity = 0;
  cp_pool_history_read(pool, nullptr, 0, nullptr, &capacity);
  std::vector<cp_history_entry_t> records(capacity);
  const size_t n = cp_pool_history_read(pool, records.data(), records.size(), nullptr, nullptr);
  for (size_t i = 0; i < n; i++) named->insert(records[i].tag);
  return CP_OK;
}

// Drop the tags no ring names and no thread holds (l.mu held; the pools' locks are taken after).
void collect_locked(Labels &l) {
  std::unordered_set<uint32_t> named;
  for (int d = 0; d < CP_MAX_DEVICES; d++) {
    cp_pool_t *pool = cpd_pool_if_created(d);
    if (pool != nullptr) (void)collect_ring(&named, d, 0, 0, pool);
  }
  (void)cpd_graph_visit(collect_ring, &named);
  for (auto it = l.by_tag.begin(); it != l.by_tag.end();) {
    if (named.count(it->first) == 0 && l.held.count(it->first) == 0) {
      l.by_label.erase({it->second.text, it->second.compile});
      it = l.by_tag.erase(it);
    } else {
      ++it;
    }
  }
  l.collect_at = std::max<size_t>(4096, 2 * l.by_tag.size());
}

// The tag of (text, compile); 0 for two empty strings.
uint32_t intern_locked(Labels &l, const std::string &text, const std::string &compile) {
  if (text.empty() && compile.empty()) return 0;
  auto it = l.by_label.find({text, compile});
  if (it != l.by_label.end()) return it->second;
  if (l.by_tag.size() >= l.collect_at) collect_locked(l);
  if (l.next == 0) l.next = 1; // after 2^32 tags: wrap, skipping "none"
  while (l.by_tag.count(l.next) != 0) l.next++;
  const uint32_t tag = l.next++;
  l.by_tag[tag] = Label{text, compile};
  l.by_label[{text, compile}] = tag;
  return tag;
}

// The calling thread's labels; its tag is let go when the thread ends.
struct ThreadLabels {
  std::string metadata;
  std::vector<std::string> compile;
  uint32_t tag = 0;
  ~ThreadLabels() { retag(true); }
  const std::string &innermost() const {
    static const std::string none;
    return compile.empty() ? none : compile.back();
  }
  // Hold the tag of the thread's labels now (none when `ending`), set it in the pools' records.
  void retag(bool ending = false) {
    Labels &l = labels();
    uint32_t now = 0;
    {
      std::lock_guard<std::mutex> g(l.mu);
      if (!ending) now = intern_locked(l, metadata, innermost());
      if (now != 0) l.held[now]++;
      auto it = l.held.find(tag);
      if (tag != 0 && it != l.held.end() && --it->second == 0) l.held.erase(it);
    }
    tag = now;
    cp_history_set_tag(now);
  }
};

thread_local ThreadLabels thread_labels;

} // namespace

void set_user_metadata(const std::string &text) {
  thread_labels.metadata = text;
  thread_labels.retag();
}

std::string user_metadata() { return thread_labels.metadata; }

void push_compile_context(const std::string &name) {
  if (cpd_history_entries() == 0) return;
  thread_labels.compile.push_back(name);
  thread_labels.retag();
}

void pop_compile_context() {
  if (cpd_history_entries() == 0 || thread_labels.compile.empty()) return;
  thread_labels.compile.pop_back();
  thread_labels.retag();
}

uint32_t annotation_tag(const std::string &text) {
  Labels &l = labels();
  std::lock_guard<std::mutex> g(l.mu);
  return intern_locked(l, text, thread_labels.innermost());
}

bool label_of(uint32_t tag, Label *out) {
  if (tag == 0) return false;
  Labels &l = labels();
  std::lock_guard<std::mutex> g(l.mu);
  auto it = l.by_tag.find(tag);
  if (it == l.by_tag.end()) return false;
  *out = it->second;
  return true;
}

void add_annotation(cda::AnnotationEntry entry, size_t max_entries) {
  Labels &l = labels();
  std::lock_guard<std::mutex> g(l.mu);
  l.annotations.push_back(std::move(entry));
  while (l.annotations.size() > std::max<size_t>(max_entries, 1)) l.annotations.pop_front();
}

std::vector<cda::AnnotationEntry> annotations() {
  Labels &l = labels();
  std::lock_guard<std::mutex> g(l.mu);
  return {l.annotations.begin(), l.annotations.end()};
}

void clear_annotations() {
  Labels &l = labels();
  std::lock_guard<std::mutex> g(l.mu);
  l.annotations.clear();
}

namespace {

int annotate_private(void *arg, int device, unsigned long long id0, unsigned long long id1, cp_pool_t *pool) {
  (void)device, (void)id0, (void)id1;
  auto *want = static_cast<std::pair<const void *, uint32_t> *>(arg);
  return cp_pool_history_annotate(pool, want->first, want->second) == CP_OK ? CP_ERR_STATE : CP_OK; // found: stop
}

} // namespace

void annotate(const void *ptr, const std::string &text) {
  const int device = ptr != nullptr ? cpd_device_of(ptr) : -1;
  cp_pool_t *shared = device >= 0 ? cpd_pool_if_created(device) : nullptr;
  TORCH_CHECK(device >= 0, "cudapool: annotateMemory: ", ptr, " is not a live allocation of cudapool");
  const uint64_t context = recording.load(std::memory_order_relaxed) ? gather_annotation() : 0;
  std::pair<const void *, uint32_t> want{ptr, annotation_tag(text)};
  cp_history_set_context(context);
  int rc = shared != nullptr ? cp_pool_history_annotate(shared, ptr, want.second) : CP_ERR_INVALID;
  if (rc != CP_OK) rc = cpd_graph_visit(annotate_private, &want) == CP_ERR_STATE ? CP_OK : rc; // a private pool's
  cp_history_set_context(0);
  TORCH_CHECK(rc == CP_OK, "cudapool: annotateMemory: ", ptr, " is not the base of a live allocation of cudapool");
}

void record_annotation(const std::vector<std::pair<std::string, std::string>> &md) {
  const size_t entries = cpd_history_entries();
  if (entries == 0) return;
  c10::DeviceIndex device = 0;
  if (c10::cuda::GetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    device = 0;
  }
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  cda::AnnotationEntry entry(device, 0);
  entry.time_.t_ = static_cast<time_t>(ts.tv_sec * 1000000 + ts.tv_nsec / 1000); // microseconds, as the trace's
  for (const auto &kv : md) entry.recordUserMetadata(kv.first, kv.second);
  add_annotation(std::move(entry), entries);
}

void mark_capture(c10::DeviceIndex device, int delta) {
  static std::atomic<int> marks[CP_MAX_DEVICES];
  const char *call = delta > 0 ? "markCaptureBegin" : "markCaptureEnd";
  TORCH_CHECK(device >= 0 && device < CP_MAX_DEVICES, "cudapool: ", call, ": no device ", static_cast<int>(device));
  std::atomic<int> &n = marks[device];
  int was = n.load();
  while ((delta > 0 || was > 0) && !n.compare_exchange_weak(was, was + delta)) {}
  TORCH_CHECK(delta > 0 || was > 0, "cudapool: markCaptureEnd: no capture of device ", static_cast<int>(device),
              " is under way (markCaptureBegin was not called)");
}

// ---- out of memory, and trace trackers ---------------------------------------------------------

Observers &observers() {
  static Observers *o = new Observers();
  return *o;
}

cda::TraceEntry::Action trace_action(int action) {
  switch (action) {
    case CP_HIST_ALLOC: return cda::TraceEntry::ALLOC;
    case CP_HIST_FREE_REQUESTED: return cda::TraceEntry::FREE_REQUESTED;
    case CP_HIST_FREE_COMPLETED: return cda::TraceEntry::FREE_COMPLETED;
    case CP_HIST_SEGMENT_ALLOC: return cda::TraceEntry::SEGMENT_ALLOC;
    case CP_HIST_SEGMENT_FREE: return cda::TraceEntry::SEGMENT_FREE;
    case CP_HIST_SEGMENT_MAP: return cda::TraceEntry::SEGMENT_MAP;
    case CP_HIST_SEGMENT_UNMAP: return cda::TraceEntry::SEGMENT_UNMAP;
#if CP_TORCH_ANNOTATE_MEMORY
    case CP_HIST_ANNOTATE: return cda::TraceEntry::ANNOTATE;
#endif
    default: return cda::TraceEntry::OOM;
  }
}

// The segment observer (Note [Segment observer]): each event goes to torch's trace trackers,
// under the pool's lock, as torch's own allocator calls them under its device lock.
void segment_event(void *ctx, int action, uintptr_t addr, size_t size, cp_stream_t stream) {
  const auto device = static_cast<c10::DeviceIndex>(reinterpret_cast<intptr_t>(ctx));
  Observers &o = observers();
  std::vector<cc::AllocatorTraceTracker> trackers;
  {
    std::lock_guard<std::mutex> g(o.mu);
    trackers = o.trackers;
  }
  const cda::TraceEntry te(trace_action(action), device, addr, size, reinterpret_cast<void *>(stream),
                           c10::MempoolId_t{0, 0}, 0);
  for (const auto &tracker : trackers) {
    try {
      tracker(te);
    } catch (const std::exception &e) {
      cpd_report("cudapool: a trace tracker failed: %s\n", e.what());
    }
  }
}

void note_alloc(void *ptr) noexcept {
  std::shared_ptr<c10::GatheredContext> ctx = std::move(pending);
  pending.reset();
  if (!ctx) return;
  History &h = history();
  std::lock_guard<std::mutex> g(h.mu);
  try {
    h.live[ptr] = std::move(ctx);
  } catch (...) { // no host memory for the entry: that block shows no frames
  }
}

void note_free(void *ptr) noexcept {
  History &h = history();
  std::shared_ptr<c10::GatheredContext> dropped; // released after the lock
  std::lock_guard<std::mutex> g(h.mu);
  auto it = h.live.find(ptr);
  if (it != h.live.end()) {
    dropped = std::move(it->second);
    h.live.erase(it);
  }
}

namespace {

// torch's observers get (device, bytes asked for after rounding, the memory allowed, the
// device's free memory), with no lock held: they may take the GIL.
void tell_oom_observers(size_t size, int device) {
  std::vector<cc::OutOfMemoryObserver> oom;
  {
    Observers &o = observers();
    std::lock_guard<std::mutex> g(o.mu);
    oom = o.oom;
  }
  if (oom.empty()) return;
  cp_oom_info_t info{};
  cp_pool_t *pool = cpd_pool_if_created(device);
  if (pool != nullptr) cp_pool_last_oom(pool, &info);
  const size_t allowed = info.memory_cap != 0 ? info.memory_cap : info.device_total;
  for (const auto &obs : oom) obs(device, info.rounded != 0 ? info.rounded : size, allowed, info.device_free);
}

[[noreturn]] void throw_error(const char *message) { TORCH_CHECK(false, message); }

} // namespace

[[noreturn]] void fail(int status, size_t size, int device) {
  pending.reset();
  static const cpd_alloc_throw_t how = {tell_oom_observers, cudapool_torch_oom::throw_oom, throw_error};
  cpd_throw_alloc_failure(status, size, device, &how);
}

} // namespace cudapool_bridge
