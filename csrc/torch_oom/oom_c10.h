// oom_c10.h — the throw of torch's own out-of-memory type (Note [Out-of-memory type] in
// devices/abi.h), written once for the two libraries built against torch that throw it: the
// thrower of cudapool._torch_oom (oom_c10.cpp) and the bridge's allocation failure
// (bridge/bridge_state.cpp). Header only: each library compiles it against its own torch.
#ifndef CP_TORCH_OOM_C10_H
#define CP_TORCH_OOM_C10_H

#include <c10/util/Exception.h>

#include <string>

namespace cudapool_torch_oom {

// No backtrace is captured (torch shows what_without_backtrace() anyway, and an allocation
// that fails inside a search over convolution engines may fail many times): the exception's
// what() is the message itself.
[[noreturn]] inline void throw_oom(const char *message) { throw c10::OutOfMemoryError(std::string(message)); }

} // namespace cudapool_torch_oom

#endif // CP_TORCH_OOM_C10_H
