// fakecuda_reducer.cpp — what DistributedDataParallel's C++ reducer asks of a CUDA device that the
// fake GPU answers (fakecuda.h): the timer of its runtime statistics.
//
// Note [The reducer's timer]
// DDP's reducer times the forward, the backward and its communication during its first ten
// iterations and every sampled one after (Reducer::should_collect_runtime_stats), with a timer
// made by c10d::TimerRegistry for the device type of its parameters. The CUDA timer records CUDA
// events, which need the driver: on the fake GPU the first forward of a DDP model would fail. The
// registry lets a creator of higher priority replace one (c10::Registry::Register), but keeps no
// way to read or restore the one it replaced, so the replacement stays for the process: it is made
// at the fake GPU's first install, in the process that traces a script (ab --simulate's child),
// where the reducer's timings have no use. The replacement times on the host, as the reducer's CPU
// timer does: the statistics it logs are host times, and nothing else reads them.
#include <torch/csrc/distributed/c10d/reducer_timer.hpp>

#include <memory>
#include <mutex>
#include <optional>

#include "fakecuda/fakecuda.h"

namespace cudapool_fakecuda {
namespace {

struct HostTimer final : c10d::Timer {
  explicit HostTimer(c10::Device) {}
  std::optional<int64_t> measureDifference(Event start, Event end) override {
    std::optional<int64_t> from = getTimestamp(start), to = getTimestamp(end);
    if (!from || !to || *to < *from) return std::nullopt;
    return *to - *from;
  }
};

} // namespace

void install_reducer_timer() {
  static std::once_flag once;
  std::call_once(once, [] {
    c10d::TimerRegistry()->Register(
        c10::kCUDA, [](c10::Device d) -> std::unique_ptr<c10d::Timer> { return std::make_unique<HostTimer>(d); },
        c10::REGISTRY_PREFERRED);
  });
}

} // namespace cudapool_fakecuda
