// bridge.cpp — the library cudapool._torch_bridge: cudapool as torch's own CUDA allocator, a
// subclass of c10::cuda::CUDACachingAllocator::CUDAAllocator over the device table
// (Note [The bridge] below). Built by setup.py against the installed torch (its headers,
// libc10, libc10_cuda, libtorch_cuda and the CUDA runtime torch uses), linked to cudapool._C
// for the pools; enable() installs it with cudapool_bridge_install once
// cudapool_bridge_torch_version() is the running torch's version. An adapter only: each method
// converts torch's types and calls the C layer; the state here is what torch's types demand
// (observers, trace trackers, the contexts of torch's history).
//
// Note [The bridge]
// torch's CUDAPluggableAllocator forwards a few of the calls torch makes to its allocator and
// refuses the rest; this class answers all of them from cudapool's pools: torch's C++ entry
// points (_cuda_memoryStats, the resets, _cuda_memorySnapshot, recordHistory, the OOM
// observers, cacheInfo for cuDNN's benchmark mode, MemPool, trace trackers for NCCL's
// registration hook, raw_alloc for workspaces) reach the pool with no Python in between. A call
// cudapool cannot honour raises an error that names it (c10::Error: a RuntimeError in Python).
// Statistics are those of each device's shared pool, as cudapool.memory_stats() reports them;
// private pools (CUDA graphs, MemPool) are counted apart (reserved_bytes_by_private_pools where
// torch has it). torch-version differences are handled here, with torch's version macros.
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/headeronly/version.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "bridge/bridge_path.h"
#include "bridge/bridge_state.h"

extern "C" {
#include "devices/devices.h"
#include "devices/ipc.h"
}
#include "core/snapshot.h"
#include "devices/graphs.h"

#ifndef CUDAPOOL_TORCH_VERSION
#error "CUDAPOOL_TORCH_VERSION (the version of torch this is built against) must be defined"
#endif

namespace cc = c10::cuda::CUDACachingAllocator;

namespace cudapool_bridge {

namespace {

// The message of a failed call, naming it ("cudapool: <call>: ..."), thrown as c10::Error.
[[noreturn]] void refuse(const char *call, const std::string &why) {
  TORCH_CHECK(false, "cudapool: ", call, ": ", why);
}

[[noreturn]] void fail_call(const char *call) { refuse(call, cp_last_error()); }

cp_pool_t *pool_or_throw(int device, const char *call) {
  cp_pool_t *pool = nullptr;
  if (cpd_pool(device, &pool) != CP_OK) fail_call(call);
  return pool;
}

// The first byte of torch's IPC handles: 2 up to torch 2.12, 3 from 2.13 (Note [Handles for torch]).
constexpr int kIpcVersion = CP_TORCH_AT_LEAST(2, 13) ? 3 : 2;

// torch's AllocatorState for cudapool: a checkpoint of the private pool (device, id).
struct Checkpoint final : cc::AllocatorState {
  Checkpoint(int d, c10::MempoolId_t i, cp_checkpoint_t *c) : device(d), id(i), ck(c) {}
  ~Checkpoint() override { cp_checkpoint_destroy(ck); }
  Checkpoint(const Checkpoint &) = delete;
  Checkpoint &operator=(const Checkpoint &) = delete;
  int device;
  c10::MempoolId_t id;
  cp_checkpoint_t *ck;
};

void fill_stat(c10::CachingAllocator::Stat &to, const cp_stat_t &from) {
  to.current = from.current;
  to.peak = from.peak;
  to.allocated = from.allocated;
  to.freed = from.freed;
}

void fill_array(c10::CachingAllocator::StatArray &to, const cp_stats_t &s, int family) {
  for (int k = 0; k < CP_KIND_COUNT; k++) fill_stat(to[static_cast<size_t>(k)], s.family[family][k]);
}

cda::DeviceStats device_stats(const cp_stats_t &s) {
  cda::DeviceStats out;
  fill_array(out.allocation, s, CP_STAT_ALLOCATION);
  fill_array(out.segment, s, CP_STAT_SEGMENT);
  fill_array(out.active, s, CP_STAT_ACTIVE);
  fill_array(out.inactive_split, s, CP_STAT_INACTIVE_SPLIT);
  fill_array(out.allocated_bytes, s, CP_STAT_ALLOCATED_BYTES);
  fill_array(out.reserved_bytes, s, CP_STAT_RESERVED_BYTES);
  fill_array(out.active_bytes, s, CP_STAT_ACTIVE_BYTES);
  fill_array(out.inactive_split_bytes, s, CP_STAT_INACTIVE_SPLIT_BYTES);
  fill_array(out.requested_bytes, s, CP_STAT_REQUESTED_BYTES);
  fill_stat(out.oversize_allocations, s.oversize_allocations);
  fill_stat(out.oversize_segments, s.oversize_segments);
  out.num_alloc_retries = s.num_alloc_retries;
  out.num_ooms = s.num_ooms;
  out.num_sync_all_streams = s.num_sync_all_streams;
  out.num_device_alloc = s.num_device_alloc;
  out.num_device_free = s.num_device_free;
  out.max_split_size = s.max_split_size;
  return out;
}

// ---- snapshots ----------------------------------------------------------------------------------

struct SnapshotBuilder {
  std::vector<cda::SegmentInfo> segments;
  std::unordered_map<void *, std::shared_ptr<c10::GatheredContext>> *live = nullptr;
  bool block_frames = false;

  // One pool's segments, cut as torch shows them (Note [Torch's segments] in core/snapshot.h).
  int add_pool(cp_pool_t *pool, int device, c10::MempoolId_t owner) {
    cp_snapshot_t snap;
    if (cp_pool_snapshot(pool, &snap) != CP_OK) return CP_ERR_HOST_OOM;
    try {
      for (size_t i = 0; i < snap.segment_count; i++) {
        cp_snapshot_run_t run;
        for (size_t pos = 0; cp_snapshot_next_run(&snap, &snap.segments[i], &pos, &run);) {
          add_segment(snap, snap.segments[i], run, device, owner);
        }
      }
    } catch (...) {
      cp_snapshot_free(&snap);
      throw;
    }
    cp_snapshot_free(&snap);
    return CP_OK;
  }

  void add_segment(const cp_snapshot_t &snap, const cp_snapshot_segment_t &seg, const cp_snapshot_run_t &run,
                   int device, c10::MempoolId_t owner) {
    segments.emplace_back();
    cda::SegmentInfo &out = segments.back();
    out.device = static_cast<c10::DeviceIndex>(device);
    out.address = run.addr;
    out.stream = reinterpret_cast<void *>(seg.stream);
    out.is_large = seg.kind == CP_KIND_LARGE;
    out.is_expandable = seg.page_mapped != 0;
    out.owner_private_pool_id = owner;
    out.total_size = run.total_size;
    out.requested_size = run.requested_size;
    out.allocated_size = run.allocated_size;
    out.active_size = run.active_size;
    for (size_t b = 0; b < run.block_count; b++) {
      const cp_snapshot_block_t &blk = snap.blocks[run.first_block + b];
      const int state = cp_snapshot_torch_state(blk.state);
      cda::BlockInfo info;
      info.size = blk.size;
      info.requested_size = blk.requested;
      info.allocated = state == CP_TORCH_ALLOCATED;
      info.active = state != CP_TORCH_INACTIVE;
      if (info.allocated && block_frames && live != nullptr) {
        auto it = live->find(reinterpret_cast<void *>(blk.addr));
        if (it != live->end()) info.context_when_allocated = it->second;
      }
      out.blocks.push_back(std::move(info));
    }
  }
};

int snapshot_private(void *arg, int device, unsigned long long id0, unsigned long long id1, cp_pool_t *pool) {
  auto *want = static_cast<std::pair<SnapshotBuilder *, c10::MempoolId_t> *>(arg);
  const c10::MempoolId_t id{id0, id1};
  if (want->second != c10::MempoolId_t{0, 0} && want->second != id) return CP_OK;
  return want->first->add_pool(pool, device, id);
}

#if CP_TORCH_PRIVATE_POOL_STATS
struct PrivateStats {
  int device;
  std::vector<std::pair<c10::MempoolId_t, cp_stats_t>> pools;
};

int private_stats(void *arg, int device, unsigned long long id0, unsigned long long id1, cp_pool_t *pool) {
  auto *want = static_cast<PrivateStats *>(arg);
  if (device != want->device) return CP_OK;
  cp_stats_t s;
  cp_pool_stats(pool, &s);
  want->pools.emplace_back(c10::MempoolId_t{id0, id1}, s);
  return CP_OK;
}
#endif

int largest_private_block(void *arg, int device, unsigned long long id0, unsigned long long id1, cp_pool_t *pool) {
  (void)id0, (void)id1;
  auto *want = static_cast<std::pair<int, size_t> *>(arg);
  if (device != want->first) return CP_OK;
  cp_pool_info_t info;
  cp_pool_info(pool, &info);
  want->second = std::max(want->second, info.largest_free_block);
  return CP_OK;
}

class CudapoolAllocator final : public cc::CUDAAllocator {
 public:
  // ---- at::Allocator ----
  c10::DataPtr allocate(size_t size) override {
    const c10::DeviceIndex device = c10::cuda::current_device();
    return allocate_on(size, device, c10::cuda::getCurrentCUDAStream(device).stream());
  }
  // The deleter of the bridge's DataPtrs, as torch's own allocator answers (cudagraph trees and
  // torch._C._has_Standard_Deleter compare a storage's deleter with it).
  c10::DeleterFnPtr raw_deleter() const override { return &delete_context; }
  void copy_data(void *dest, const void *src, std::size_t count) const final {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  // ---- c10::DeviceAllocator ----
  bool initialized() override { return initialized_.load(std::memory_order_acquire); }
  void emptyCache(c10::MempoolId_t mempool_id) override {
    if (mempool_id == c10::MempoolId_t{0, 0}) {
      cudapool_empty_cache();
    } else if (cpd_graph_empty(mempool_id.first, mempool_id.second) != CP_OK) {
      fail_call("emptyCache");
    }
  }
  void recordStream(const c10::DataPtr &ptr, c10::cuda::CUDAStream stream) override {
    cudapool_record_stream(ptr.get(), stream.stream());
  }
  cda::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    cp_stats_t s{};
    cp_pool_t *pool = cpd_pool_if_created(device);
    if (pool != nullptr) {
      cp_pool_stats(pool, &s);
    } else {
      cp_config_t cfg;
      cpd_config(&cfg);
      s.max_split_size = cfg.max_split_size == SIZE_MAX ? -1 : static_cast<int64_t>(cfg.max_split_size);
    }
    cda::DeviceStats out = device_stats(s);
#if CP_TORCH_PRIVATE_POOL_STATS
    PrivateStats priv{device, {}};
    (void)cpd_graph_visit(private_stats, &priv);
    for (const auto &p : priv.pools) {
      fill_array(out.reserved_bytes_by_private_pools[p.first], p.second, CP_STAT_RESERVED_BYTES);
    }
#endif
    return out;
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    cp_pool_t *pool = cpd_pool_if_created(device);
    if (pool != nullptr) cp_pool_reset_accumulated_stats(pool);
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    cp_pool_t *pool = cpd_pool_if_created(device);
    if (pool != nullptr) cp_pool_reset_peak_stats(pool);
  }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    cp_pool_info_t info;
    cp_pool_info(pool_or_throw(device, "getMemoryInfo"), &info);
    if (info.device_total != 0) return {info.device_free, info.device_total};
    return cc::CUDAAllocator::getMemoryInfo(device);
  }

  // ---- c10::cuda::CUDACachingAllocator::CUDAAllocator ----
  void *raw_alloc(size_t nbytes) override {
    const c10::DeviceIndex device = c10::cuda::current_device();
    return alloc_raw(nbytes, device, c10::cuda::getCurrentCUDAStream(device).stream());
  }
  void *raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    return alloc_raw(nbytes, c10::cuda::current_device(), stream);
  }
  void raw_delete(void *ptr) override {
    // An address no pool handed out is refused, as torch's own allocator refuses it (the
    // DataPtr deleter, which must not throw, reports one instead); the device found is the
    // free's, so the pools are searched once.
    const int owner = ptr != nullptr ? cpd_device_of(ptr) : -1;
    if (ptr != nullptr && owner < 0) refuse("raw_delete", "invalid device pointer");
    free_noted(ptr, owner);
  }
  void init(int device_count) override {
    (void)device_count; // pools are made on each device's first allocation
    initialized_.store(true, std::memory_order_release);
  }
  double getMemoryFraction(c10::DeviceIndex device) override { return cpd_memory_fraction(device); }
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    if (cpd_set_memory_fraction(fraction, device) != CP_OK) fail_call("setMemoryFraction");
  }
  std::vector<cc::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex device) override {
    std::vector<cc::StreamSegmentSize> sizes;
    cp_pool_t *pool = cpd_pool_if_created(device);
    cp_snapshot_t snap;
    if (pool == nullptr) return sizes;
    if (cp_pool_snapshot(pool, &snap) != CP_OK) fail_call("getExpandableSegmentSizes");
    for (size_t i = 0; i < snap.segment_count; i++) {
      const cp_snapshot_segment_t &seg = snap.segments[i];
      if (seg.page_mapped) {
        sizes.emplace_back(reinterpret_cast<cudaStream_t>(seg.stream), seg.kind == CP_KIND_SMALL, seg.mapped);
      }
    }
    cp_snapshot_free(&snap);
    return sizes;
  }
  void enable(bool value) override {
    if (!value) refuse("enable(False)", "cudapool's pool cannot be switched off once it is torch's allocator");
  }
  bool isEnabled() const override { return true; }
  void cacheInfo(c10::DeviceIndex device, size_t *largestBlock) override {
    // As torch's: the largest free block cached for the device (its private pools included),
    // starting from the device's free memory when the caller passes 0.
    cp_pool_info_t info;
    cp_pool_info(pool_or_throw(device, "cacheInfo"), &info);
    if (*largestBlock == 0) *largestBlock = info.device_free;
    std::pair<int, size_t> priv{device, info.largest_free_block};
    (void)cpd_graph_visit(largest_private_block, &priv);
    *largestBlock = std::max(*largestBlock, priv.second);
  }
  void *getBaseAllocation(void *ptr, size_t *size) override { return cudapool_base_alloc(ptr, size); }

  cc::SnapshotInfo snapshot(c10::MempoolId_t mempool_id, bool include_traces) override {
    cc::SnapshotInfo out;
    History &h = history();
    std::lock_guard<std::mutex> g(h.mu); // contexts stay while they are copied
    SnapshotBuilder builder;
    builder.live = &h.live;
    builder.block_frames = h.when != cc::RecordContext::NEVER;
    int devices = 0;
    for (int d = 0; d < CP_MAX_DEVICES; d++) {
      cp_pool_t *pool = cpd_pool_if_created(d);
      if (pool == nullptr) continue;
      devices = d + 1;
      if (mempool_id == c10::MempoolId_t{0, 0} && builder.add_pool(pool, d, {0, 0}) != CP_OK) fail_call("snapshot");
    }
    std::pair<SnapshotBuilder *, c10::MempoolId_t> want{&builder, mempool_id};
    if (cpd_graph_visit(snapshot_private, &want) != CP_OK) fail_call("snapshot");
    out.segments = std::move(builder.segments);
    out.device_traces.resize(static_cast<size_t>(devices));
    if (include_traces) {
      for (int d = 0; d < devices; d++) add_trace(out.device_traces[static_cast<size_t>(d)], d, h);
      out.external_annotations = annotations();
    }
    fill_config(out.config_metadata);
    return out;
  }

  void beginAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                           std::function<bool(cudaStream_t)> filter) override {
    cudapool_begin_allocate_to_pool(device, mempool_id, std::move(filter)); // throws on failure
  }
  void endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override {
    cudapool_end_allocate_to_pool(device, mempool_id);
  }
  void releasePool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override {
    cudapool_release_pool(device, mempool_id); // never throws: torch calls it from destructors
  }
  int getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override {
    return static_cast<int>(cpd_graph_use_count(device, mempool_id.first, mempool_id.second));
  }
  void createOrIncrefPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                          std::shared_ptr<cc::CUDAAllocator> allocator) override {
    if (allocator != nullptr && allocator.get() != this) {
      refuse("createOrIncrefPool",
             "a torch.cuda.MemPool with an allocator of its own cannot be used while cudapool is torch's allocator "
             "(its memory would come from that allocator, behind cudapool's back); create it without allocator=");
    }
    if (cpd_graph_incref(device, mempool_id.first, mempool_id.second) != CP_OK) fail_call("createOrIncrefPool");
  }
  void setUseOnOOM(c10::DeviceIndex device, c10::MempoolId_t mempool_id, bool use_on_oom) override {
    (void)device, (void)mempool_id;
    if (use_on_oom) {
      refuse("setUseOnOOM",
             "a MemPool's memory is not lent to other allocations at out of memory under cudapool "
             "(torch.cuda.MemPool(use_on_oom=True) is not supported)");
    }
  }
  void setNoSplit(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override {
    (void)device, (void)mempool_id;
    refuse("setNoSplit", "MemPools whose blocks are never split are not supported by cudapool");
  }
  // Cudagraph trees (Note [Checkpoints] in core/checkpoint.c): the state is cudapool's checkpoint of
  // the private pool; a restore hands back DataPtrs that free through raw_deleter(), as torch's
  // own do, so that torch can move them into the storages that are live again.
  bool checkPoolLiveAllocations(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                                const std::unordered_set<void *> &expected_live_allocations) override {
    void **ptrs = nullptr;
    size_t n = 0;
    if (cpd_graph_live_blocks(device, mempool_id.first, mempool_id.second, &ptrs, &n) != CP_OK)
      fail_call("checkPoolLiveAllocations");
    bool same = n == expected_live_allocations.size();
    for (size_t i = 0; i < n && same; i++) same = expected_live_allocations.count(ptrs[i]) != 0;
    std::free(ptrs);
    return same;
  }
  std::shared_ptr<cc::AllocatorState> getCheckpointState(c10::DeviceIndex device, c10::MempoolId_t id) override {
    cp_checkpoint_t *ck = nullptr;
    if (cpd_graph_checkpoint(device, id.first, id.second, &ck) != CP_OK) fail_call("getCheckpointState");
    return std::make_shared<Checkpoint>(device, id, ck);
  }
  cc::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device,
                                             std::shared_ptr<cc::AllocatorState> pps) override {
    auto *ck = dynamic_cast<Checkpoint *>(pps.get());
    if (ck == nullptr) refuse("setCheckpointPoolState", "the state was not made by cudapool's getCheckpointState");
    if (ck->device != device) {
      refuse("setCheckpointPoolState",
             "the state is of device " + std::to_string(ck->device) + ", not of device " + std::to_string(device));
    }
    cp_restore_t r;
    const int rc = cpd_graph_restore(device, ck->id.first, ck->id.second, ck->ck, &r);
    cc::CheckpointDelta delta;
    if (C10_UNLIKELY(recording.load(std::memory_order_relaxed))) {
      for (size_t i = 0; i < r.freed_count; i++) note_free(r.freed[i]);
    }
    if (rc != CP_OK) {
      const std::string why = cp_last_error();
      cp_restore_release(&r);
      refuse("setCheckpointPoolState", why);
    }
    delta.ptrs_freed.assign(r.freed, r.freed + r.freed_count);
    delta.dataptrs_allocd.reserve(r.made_live_count);
    const c10::Device where(c10::DeviceType::CUDA, device);
    for (size_t i = 0; i < r.made_live_count; i++) {
      void *p = r.made_live[i];
      delta.dataptrs_allocd.emplace_back(p, context_of(p, device), &delete_context, where);
    }
    cp_restore_release(&r);
    return delta;
  }
  // CUDA IPC (Note [Handles for torch] in devices/ipc.c): torch's own format for plain segments,
  // cudapool's for page-mapped memory; each handle is opened once per process, as torch does
  // (the driver refuses a second cuIpcOpenMemHandle of one handle).
  cc::ShareableHandle shareIpcHandle(void *ptr) override {
    std::string buf(CPD_IPC_HANDLE_MAX, '\0');
    size_t len = 0, offset = 0;
    if (cpd_ipc_share(ptr, kIpcVersion, buf.data(), buf.size(), &len, &offset) != CP_OK) fail_call("shareIpcHandle");
    buf.resize(len);
    return cc::ShareableHandle{static_cast<ptrdiff_t>(offset), std::move(buf)};
  }
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    std::lock_guard<std::mutex> g(ipc_mu);
    auto it = ipc_opened.find(handle);
    if (it != ipc_opened.end()) {
      if (auto open = it->second.lock()) return open;
      ipc_opened.erase(it);
    }
    // The device torch's receiver made current (its guard of the sender's device); a handle of a
    // type cudapool does not open is refused before the CUDA runtime is asked.
    const bool ours = cpd_ipc_handle_is_ours(handle.data(), handle.size()) != 0;
    const int device = ours ? static_cast<int>(c10::cuda::current_device()) : 0;
    void *base = nullptr, *token = nullptr;
    if (cpd_ipc_open(handle.data(), handle.size(), device, &base, &token) != CP_OK) fail_call("getIpcDevPtr");
    std::shared_ptr<void> open(base, [token](void *) {
      if (cpd_ipc_close(token) != CP_OK)
        std::fprintf(stderr, "cudapool: closing a shared tensor: %s\n", cp_last_error());
    });
    ipc_opened[handle] = open;
    return open;
  }

  bool isHistoryEnabled() override { return cpd_history_entries() > 0; }
  void recordHistory(bool enabled, cc::CreateContextFn context_recorder, size_t alloc_trace_max_entries,
                     cc::RecordContext when, bool clearHistory, const std::vector<std::string> &skip_actions) override {
    History &h = history();
    // torch's default is "unbounded": the ring is made up front, so a very large request keeps
    // the default ring instead (as cudapool.record_history's torch form does).
    size_t entries = alloc_trace_max_entries;
    if (entries == 0 || entries > kMaxEntries) entries = kDefaultEntries;
    if (!enabled || clearHistory) clear_annotations(); // as torch drops its record_function annotations
    if (!enabled) {
      cpd_set_context_fns(nullptr, nullptr);
      recording.store(false, std::memory_order_relaxed);
      (void)cpd_set_history(0);
      std::lock_guard<std::mutex> g(h.mu);
      h.recorder = nullptr;
      h.when = cc::RecordContext::NEVER;
      h.max_entries = 0;
      h.traced.clear();
      h.live.clear();
      h.skip.clear();
      return;
    }
    if (clearHistory || cpd_history_entries() != entries) {
      (void)cpd_set_history(0); // a new ring: what was recorded goes
      if (cpd_set_history(entries) != CP_OK) fail_call("recordHistory");
    }
    const bool contexts = context_recorder != nullptr && when != cc::RecordContext::NEVER;
    {
      std::lock_guard<std::mutex> g(h.mu);
      h.recorder = context_recorder;
      h.when = contexts ? when : cc::RecordContext::NEVER;
      h.max_entries = entries;
      h.skip = skip_actions;
      if (!contexts) h.live.clear();
    }
    recording.store(contexts, std::memory_order_relaxed);
    cpd_set_context_fns(contexts ? gather_alloc : nullptr,
                        contexts && when == cc::RecordContext::ALL ? gather_free : nullptr);
  }
  void attachOutOfMemoryObserver(cc::OutOfMemoryObserver observer) override {
    Observers &o = observers();
    std::lock_guard<std::mutex> g(o.mu);
    o.oom.push_back(std::move(observer));
  }
#if CP_TORCH_OOM_REJECTION
  // cudapool never refuses an allocation up front (it has no out-of-memory pre-emption
  // policy): the observers are kept, and never called.
  void attachOomRejectionObserver(cc::OomRejectionObserver observer) override {
    Observers &o = observers();
    std::lock_guard<std::mutex> g(o.mu);
    o.rejection.push_back(std::move(observer));
  }
#endif
  void attachAllocatorTraceTracker(cc::AllocatorTraceTracker tracker) override {
    Observers &o = observers();
    {
      std::lock_guard<std::mutex> g(o.mu);
      o.trackers.push_back(std::move(tracker));
    }
    cpd_set_segment_observer(segment_event);
  }

  // ---- labels on the history (Note [Labels] in bridge_state.h) ----
  void recordAnnotation(const std::vector<std::pair<std::string, std::string>> &md) override { record_annotation(md); }
  void pushCompileContext(std::string &md) override { push_compile_context(md); }
  void popCompileContext() override { pop_compile_context(); }
  void setUserMetadata(const std::string &metadata) override { set_user_metadata(metadata); }
  std::string getUserMetadata() override { return user_metadata(); }
#if CP_TORCH_ANNOTATE_MEMORY
  bool supportsUserMetadata() override { return true; }
  void annotateMemory(const void *ptr, const std::string &metadata) override { annotate(ptr, metadata); }
#endif
#if CP_TORCH_CONTEXT_FOR_POINTER
  // The stack recorded for the live allocation whose base is `ptr` (history with contexts).
  std::shared_ptr<c10::GatheredContext> getContextForPointer(const void *ptr) override {
    History &h = history();
    std::lock_guard<std::mutex> g(h.mu);
    auto it = h.live.find(const_cast<void *>(ptr));
    return it != h.live.end() ? it->second : nullptr;
  }
#endif
#if CP_TORCH_CAPTURE_MARKS
  void markCaptureBegin(c10::DeviceIndex device) override { mark_capture(device, +1); }
  void markCaptureEnd(c10::DeviceIndex device) override { mark_capture(device, -1); }
#endif
#if CP_TORCH_ALLOCATE_WITH_ADDRESS
  c10::DataPtr allocateWithAddress(size_t size, void *addr) override {
    (void)size;
    char where[32];
    std::snprintf(where, sizeof where, "%p", addr);
    refuse("allocateWithAddress", std::string("cudapool places every allocation itself: it cannot serve one at an "
                                              "address the caller chooses (") +
                                      where + "); only torch's native caching allocator does");
  }
#endif

  // Peer access for plain segments; page-mapped memory is mapped for its own device only, so
  // copies between devices go through cudaMemcpyPeerAsync (memcpyAsync), which needs none.
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    c10::cuda::CUDAGuard guard(dev);
    const cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError(); // clear it
    } else {
      C10_CUDA_CHECK(err);
    }
  }
  cudaError_t memcpyAsync(void *dst, int dstDevice, const void *src, int srcDevice, size_t count, cudaStream_t stream,
                          bool p2p_enabled) override {
    (void)p2p_enabled;
    if (dstDevice == srcDevice) return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
  }
  std::string name() override { return "cudapool"; }

 private:
  static constexpr size_t kDefaultEntries = 100000;
  static constexpr size_t kMaxEntries = 10000000;
  std::atomic<bool> initialized_{false};
  std::mutex ipc_mu;
  std::unordered_map<std::string, std::weak_ptr<void>> ipc_opened; // handles opened here

  // The history of device d as torch's trace entries, oldest first (Note [History contexts]).
  static void add_trace(std::vector<cda::TraceEntry> &trace, int d, const History &h) {
    cp_pool_t *pool = cpd_pool_if_created(d);
    size_t capacity = 0;
    cp_pool_history_read(pool, nullptr, 0, nullptr, &capacity);
    if (capacity == 0) return;
    std::vector<cp_history_entry_t> records(capacity);
    const size_t n = cp_pool_history_read(pool, records.data(), records.size(), nullptr, nullptr);
    trace.reserve(n);
    for (size_t i = 0; i < n; i++) {
      const cp_history_entry_t &r = records[i];
      const char *name = cp_history_action_names[r.action];
      if (std::find(h.skip.begin(), h.skip.end(), name) != h.skip.end()) continue;
      std::shared_ptr<c10::GatheredContext> ctx;
      if (h.when == cc::RecordContext::ALL ||
          (h.when == cc::RecordContext::ALLOC && r.action != CP_HIST_FREE_REQUESTED))
        ctx = traced_context(r.context);
      trace.emplace_back(trace_action(static_cast<int>(r.action)), static_cast<c10::DeviceIndex>(d), r.addr, r.size,
                         reinterpret_cast<void *>(r.stream), c10::MempoolId_t{0, 0}, 0, std::move(ctx));
      trace.back().time_.t_ = static_cast<time_t>(r.time_ns / 1000); // microseconds, as torch's
      Label label;
      const bool labelled = label_of(r.tag, &label);
      trace.back().compile_context_ = labelled && !label.compile.empty() ? label.compile : "N/A"; // torch's "none"
      if (labelled) trace.back().user_metadata_ = std::move(label.text);
    }
  }

  static void fill_config(cc::AllocatorConfigInfo &info) {
    cp_config_t cfg;
    cpd_config(&cfg);
    char text[1024];
    cp_config_format(&cfg, text, sizeof text);
    info.last_allocator_settings = text;
    info.garbage_collection_threshold = cfg.garbage_collection_threshold;
    info.max_split_size = cfg.max_split_size;
    info.expandable_segments = cfg.expandable_segments != 0 || cfg.page_stitching != 0;
    info.release_lock_on_malloc = false;
    info.pinned_num_register_threads = 0;
    info.pinned_use_host_register = false;
    info.roundup_power2_divisions.assign(cfg.roundup_power2_divisions,
                                         cfg.roundup_power2_divisions + CP_ROUNDUP_INTERVALS);
  }
};

std::shared_ptr<CudapoolAllocator> &installed() {
  static auto *p = new std::shared_ptr<CudapoolAllocator>(); // never destroyed: torch holds its pointer
  return *p;
}

} // namespace

c10::DataPtr allocate_with(size_t size, int device, void *stream) { return allocate_on(size, device, stream); }

} // namespace cudapool_bridge

extern "C" {

// The torch version whose headers and libraries this library was built against.
__attribute__((visibility("default"))) const char *cudapool_bridge_torch_version(void) {
  return CUDAPOOL_TORCH_VERSION;
}

// Make cudapool torch's CUDA allocator (torch's own swap: refused once the current allocator is
// initialised). 0 on success; else 1 and the reason in buf.
__attribute__((visibility("default"))) int cudapool_bridge_install(char *buf, size_t buf_size) {
  using cudapool_bridge::installed;
  try {
    if (installed() == nullptr) installed() = std::make_shared<cudapool_bridge::CudapoolAllocator>();
    if (cc::get() != installed().get()) torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(installed());
    // torch's swap sets the allocator that CUDA tensors and torch.cuda reach; the device-generic
    // registry (c10::GetAllocator(kCUDA): torch.accelerator's memory functions, storages made
    // for a device) would still name torch's own one. It names the bridge too.
    c10::SetAllocator(c10::DeviceType::CUDA, installed().get(), std::numeric_limits<uint8_t>::max());
    return 0;
  } catch (const c10::Error &e) {
    std::snprintf(buf, buf_size, "%s", e.what_without_backtrace());
  } catch (const std::exception &e) {
    std::snprintf(buf, buf_size, "%s", e.what());
  }
  return 1;
}

// 1 when torch's current CUDA allocator is this library's.
__attribute__((visibility("default"))) int cudapool_bridge_is_current(void) {
  return cudapool_bridge::installed() != nullptr && cc::get() == cudapool_bridge::installed().get();
}

} // extern "C"
