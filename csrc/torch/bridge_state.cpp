// bridge_state.cpp — the bridge's record of torch's state (bridge_state.h): the contexts torch's
// history recorder makes, the out-of-memory observers, the trace trackers, and the failure of an
// allocation as torch expects it.
#include "torch/bridge_state.h"

#include <algorithm>
#include <cstdio>
#include <exception>

extern "C" {
#include "torch/devices.h"
}

namespace cudapool_bridge {

std::atomic<bool> recording{false};

History &history() {
  static History *h = new History(); // never destroyed: deleters may run at exit
  return *h;
}

namespace {

thread_local std::shared_ptr<c10::GatheredContext> pending; // the context of this thread's allocation

// Gather one context with torch's recorder; keep it for the trace when `when` says so.
uint64_t gather(bool for_free) {
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
  if (!for_free) pending = ctx;
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

uint64_t gather_alloc() { return gather(false); }
uint64_t gather_free() { return gather(true); }

std::shared_ptr<c10::GatheredContext> traced_context(uint64_t id) {
  if ((id & kContextBit) == 0) return nullptr; // none, or one of cudapool's own Python stacks
  History &h = history();
  // Ids are increasing: a binary search over the queue.
  auto it = std::lower_bound(h.traced.begin(), h.traced.end(), id,
                             [](const auto &entry, uint64_t key) { return entry.first < key; });
  return it != h.traced.end() && it->first == id ? it->second : nullptr;
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

[[noreturn]] void fail(int status, size_t size, int device) {
  char buf[4096];
  cpd_alloc_error_message(status, size, device, buf, sizeof buf);
  pending.reset();
  if (status != CP_ERR_OOM) TORCH_CHECK(false, buf);
  // torch's observers get (device, bytes asked for after rounding, the memory allowed, the
  // device's free memory), with no lock held: they may take the GIL.
  std::vector<cc::OutOfMemoryObserver> oom;
  {
    Observers &o = observers();
    std::lock_guard<std::mutex> g(o.mu);
    oom = o.oom;
  }
  if (!oom.empty()) {
    cp_oom_info_t info{};
    cp_pool_t *pool = cpd_pool_if_created(device);
    if (pool != nullptr) cp_pool_last_oom(pool, &info);
    const size_t allowed = info.memory_cap != 0 ? info.memory_cap : info.device_total;
    for (const auto &obs : oom) obs(device, info.rounded != 0 ? info.rounded : size, allowed, info.device_free);
  }
  TORCH_CHECK_WITH(OutOfMemoryError, false, buf);
}

} // namespace cudapool_bridge
