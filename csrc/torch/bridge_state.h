// bridge_state.h — what the bridge (bridge.cpp) keeps of torch's: the contexts of torch's history,
// the out-of-memory observers and the trace trackers (bridge_state.cpp). Internal to the
// library cudapool._torch_bridge.
#ifndef CP_BRIDGE_STATE_H
#define CP_BRIDGE_STATE_H

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/headeronly/version.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "torch/bridge_path.h"

#define CP_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace cudapool_bridge {

namespace cc = c10::cuda::CUDACachingAllocator;
namespace cda = c10::CachingDeviceAllocator;

// ---- torch's history: the contexts its recorder makes (Note [History contexts]) -------------
//
// Note [History contexts]
// torch's recordHistory hands over a recorder (CreateContextFn: the Python and C++ stack of
// the caller, as torch's CapturedTraceback) and says when to use it (RecordContext). The pool's
// history ring keeps an opaque 64-bit context per record; here each context torch's recorder
// makes gets an id (high bit set, so cudapool's own Python stacks, small ids, never match), kept
// in a queue as long as the newest records could name it (the rings hold at most
// max_entries records per device pool, and every call makes at least one). A live block's
// context (RecordContext STATE and up) is kept by address from its allocation to its free.
// snapshot() hands both back to torch, which turns them into frames.
constexpr uint64_t kContextBit = 1ull << 63;

struct History {
  std::mutex mu;
  cc::CreateContextFn recorder = nullptr;
  cc::RecordContext when = cc::RecordContext::NEVER;
  size_t max_entries = 0;
  std::vector<std::string> skip;
  uint64_t next_id = kContextBit;
  std::deque<std::pair<uint64_t, std::shared_ptr<c10::GatheredContext>>> traced; // by id, oldest first
  std::unordered_map<void *, std::shared_ptr<c10::GatheredContext>> live;        // live blocks' contexts
};

// The one History of the process (never destroyed: deleters may run at exit).
History &history();
// The context functions given to the device table (cpd_set_context_fns): gather one context
// with torch's recorder for an allocation or a free; its id (0: none kept for the trace).
uint64_t gather_alloc();
uint64_t gather_free();
// The context of trace id `id` (history().mu held), or null.
std::shared_ptr<c10::GatheredContext> traced_context(uint64_t id);

struct Observers {
  std::mutex mu;
  std::vector<cc::OutOfMemoryObserver> oom;
#if CP_TORCH_AT_LEAST(2, 14)
  std::vector<cc::OomRejectionObserver> rejection;
#endif
  std::vector<cc::AllocatorTraceTracker> trackers;
};

Observers &observers();

// torch's trace action for a cp_history_action_t.
cda::TraceEntry::Action trace_action(int action);
// The segment observer (Note [Segment observer] in core/cp.h): each event to torch's trace
// trackers, under the pool's lock, as torch's own allocator calls them under its device lock.
void segment_event(void *ctx, int action, uintptr_t addr, size_t size, cp_stream_t stream);

} // namespace cudapool_bridge

#endif // CP_BRIDGE_STATE_H
