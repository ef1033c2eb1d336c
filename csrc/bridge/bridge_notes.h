// bridge_notes.h — what the hot path (bridge_path.h) calls of the bridge's state: its history
// notes and its failure. Declared here, below both, so that the state (bridge_state.cpp) defines
// them with these declarations in view and the hot path calls them without the state's torch
// headers.
#ifndef CP_BRIDGE_NOTES_H
#define CP_BRIDGE_NOTES_H

#include <atomic>
#include <cstddef>

namespace cudapool_bridge {

// Set while torch's history records contexts (bridge.cpp); read on every allocation and free.
extern std::atomic<bool> recording;
void note_alloc(void *ptr) noexcept;
void note_free(void *ptr) noexcept;
// A failed allocation: cpd_throw_alloc_failure with torch's out-of-memory observers told and
// torch's types thrown (c10::OutOfMemoryError for CP_ERR_OOM, c10::Error otherwise). Defined by
// the bridge (and by the benchmark, which never fails).
[[noreturn]] void fail(int status, size_t size, int device);

} // namespace cudapool_bridge

#endif // CP_BRIDGE_NOTES_H
