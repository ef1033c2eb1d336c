// bridge_state.h — what the bridge (bridge.cpp) keeps of torch's: the contexts of torch's history,
// the labels on it (user metadata, compile contexts, annotations), the capture marks, the
// out-of-memory observers and the trace trackers (bridge_state.cpp). Internal to the library
// cudapool._torch_bridge.
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

extern "C" {
#include "core/cp.h"
#include "core/snapshot.h"
}

#define CP_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// Note [torch versions]
// The parts of torch's allocator interface the bridge uses that not every torch it builds for
// has, each guarded by the first release whose headers have it (read from the 2.11.0, 2.12.0,
// 2.13.0 and 2.14.1 wheels; scripts/check_bridge_build.py builds the bridge against a wheel).
// A pure virtual must be overridden from its first release on, or the bridge does not build
// there. set/getUserMetadata, TraceEntry's user_metadata_ and compile_context_,
// recordAnnotation, push/popCompileContext and SnapshotInfo::external_annotations are in 2.11.
#define CP_TORCH_OOM_REJECTION         CP_TORCH_AT_LEAST(2, 12) // attachOomRejectionObserver (pure)
#define CP_TORCH_CONTEXT_FOR_POINTER   CP_TORCH_AT_LEAST(2, 12) // getContextForPointer
#define CP_TORCH_PRIVATE_POOL_STATS    CP_TORCH_AT_LEAST(2, 13) // reserved_bytes_by_private_pools
#define CP_TORCH_CAPTURE_MARKS         CP_TORCH_AT_LEAST(2, 13) // markCaptureBegin / markCaptureEnd
#define CP_TORCH_ALLOCATE_WITH_ADDRESS CP_TORCH_AT_LEAST(2, 13)
#define CP_TORCH_ANNOTATE_MEMORY       CP_TORCH_AT_LEAST(2, 14) // supportsUserMetadata, annotateMemory, ANNOTATE

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
// The context of an annotation (torch keeps one when it keeps them for allocations).
uint64_t gather_annotation();

// ---- labels on the history: user metadata, compile contexts, annotations (Note [Labels]) -----
//
// Note [Labels]
// torch's trace entries carry two strings: the user metadata of the thread that made them
// (setUserMetadata, thread-local), or an annotation's text for an "annotate" entry
// (annotateMemory), and the innermost compile context of that thread (push/popCompileContext,
// "N/A" when none). The pool's records carry a 32-bit tag instead (cp_history_set_tag: the
// thread's, on every record it makes): here each (text, compile context) pair gets a tag,
// interned, and each thread sets the tag of its pair whenever either changes. A tag lives while
// a thread has it set or a record in some pool's ring names it: when the table grows, the tags
// no ring names and no thread holds are dropped (the rings are read then), so its size follows
// the rings'. Annotations of torch's record_function (recordAnnotation) are kept here, in a
// queue of at most max_entries, as torch keeps them.
struct Label {
  std::string text;    // user metadata, or the annotation
  std::string compile; // the innermost compile context; "" when none
};
// The calling thread's labels (setUserMetadata, getUserMetadata; push/popCompileContext, which
// torch's own allocator heeds only while history records).
void set_user_metadata(const std::string &text);
std::string user_metadata();
void push_compile_context(const std::string &name);
void pop_compile_context();
// annotateMemory: an ANNOTATE record for the live allocation whose base is `ptr`, in the pool
// that holds it, with a context as for an allocation; any other pointer is refused (c10::Error),
// history on or off, as torch's allocator refuses it.
void annotate(const void *ptr, const std::string &text);
// recordAnnotation: one of record_function's annotations, kept while history is on, with the
// current device (0 where the CUDA runtime cannot say, as on simulated devices).
void record_annotation(const std::vector<std::pair<std::string, std::string>> &md);
// A tag for an annotation made by the calling thread now (not held by the thread).
uint32_t annotation_tag(const std::string &text);
// The label of a tag (0: none); false for a tag not known (any more).
bool label_of(uint32_t tag, Label *out);
// record_function's annotations (recordAnnotation): kept while history is on, at most
// `max_entries`; dropped when history goes off or is cleared.
void add_annotation(cda::AnnotationEntry entry, size_t max_entries);
std::vector<cda::AnnotationEntry> annotations();
void clear_annotations();

// Note [Capture marks]
// torch's CUDAGraph says that a stream capture really began (markCaptureBegin, after
// cudaStreamBeginCapture) and ended (markCaptureEnd, after cudaStreamEndCapture), inside its
// begin/endAllocateToPool window on the same device. cudapool's pools already behave as under
// capture while any such window is open on the device (Note [Graph pools]), and the CUDA backend
// also asks the driver whether a stream is being captured (Note [Capture in the pool]): a mark
// changes nothing in the pool. The bridge counts them per device, so that an end without a
// begin, or a device out of range, is refused (c10::Error naming the call) as torch refuses it.
void mark_capture(c10::DeviceIndex device, int delta);
// The context of trace id `id` (history().mu held), or null.
std::shared_ptr<c10::GatheredContext> traced_context(uint64_t id);

struct Observers {
  std::mutex mu;
  std::vector<cc::OutOfMemoryObserver> oom;
#if CP_TORCH_OOM_REJECTION
  std::vector<cc::OomRejectionObserver> rejection;
#endif
  std::vector<cc::AllocatorTraceTracker> trackers;
};

Observers &observers();

// torch's trace action for a cp_history_action_t.
cda::TraceEntry::Action trace_action(int action);
// The segment observer (Note [Segment observer] in core/snapshot.h): each event to torch's trace
// trackers, under the pool's lock, as torch's own allocator calls them under its device lock.
void segment_event(void *ctx, int action, uintptr_t addr, size_t size, cp_stream_t stream);

// allocate() with the device and stream given instead of torch's current ones: the bridge's own
// DataPtr, its deleter this library's raw_deleter() (for callers in other libraries, whose copy
// of the inline allocate_on would name another deleter).
c10::DataPtr allocate_with(size_t size, int device, void *stream);

} // namespace cudapool_bridge

#endif // CP_BRIDGE_STATE_H
