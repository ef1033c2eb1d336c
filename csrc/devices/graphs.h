/* graphs.h — private pools for CUDA graphs and torch's MemPool ids: one pool per (device,
 * MempoolId), the allocate-to-pool windows that route allocations into them, and their
 * release. The C side of torch's graph-pool hooks (graph_hooks.cpp takes the std::function). */
#ifndef CP_GRAPHS_H
#define CP_GRAPHS_H

#include <stddef.h>

#include "core/checkpoint.h"
#include "core/cp.h"
#include "core/share.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A window's filter: 1 when an allocation on `stream` goes to the window's pool. The device
 * table owns `ctx` from cpd_graph_begin on and gives it to `free_ctx` when the window closes
 * (or at once, when cpd_graph_begin fails). */
typedef int (*cpd_filter_fn)(void *ctx, void *stream);
typedef void (*cpd_filter_free_fn)(void *ctx);

/* Note [Graph pools]
 * torch calls begin-allocate-to-pool(device, id, filter) before a graph capture (and around
 * use_mem_pool, and cudagraph trees' warm-up), end-allocate-to-pool(device, id) after it, and
 * release-pool(device, id) when the graph (or pool) is reset or destroyed; every begin is
 * paired with one release. cudapool keeps one private pool (a cp_pool_t of its own, plain
 * segments) per (device, id), created by its first begin:
 *  - while a window is open, an allocation on the device whose stream the window's filter
 *    accepts is served by the window's pool (the first accepting window wins); all others by
 *    the device's shared pool. A private pool's blocks serve only its own allocations;
 *  - while any window is open on a device, its shared pool and every private pool of it has a
 *    capture window open (Note [Capture in the pool]): no event call, no memory back;
 *  - a free goes to whichever pool holds the pointer; so do record_stream and base_alloc;
 *  - a pool whose begins were all released (uses == 0), with no window open and no live
 *    allocation left, is emptied and destroyed: at the release, or at the free of its last
 *    allocation, or when the device's last window closes, or at empty_cache; the output
 *    tensors of a graph keep its pool alive until they are freed.
 * Two windows on one (device, id) at once are refused (CP_ERR_STATE), as torch refuses them. */
int cpd_graph_begin(int device, unsigned long long id0, unsigned long long id1, cpd_filter_fn filter, void *ctx,
                    cpd_filter_free_fn free_ctx);
int cpd_graph_end(int device, unsigned long long id0, unsigned long long id1);
int cpd_graph_release(int device, unsigned long long id0, unsigned long long id1);

/* torch's MemPool (createOrIncrefPool, getPoolUseCount): one more use of the private pool of
 * (device, id), made when there is none yet (no window is opened; releasePool ends the use);
 * and the uses it has (0 when there is no such pool). */
int cpd_graph_incref(int device, unsigned long long id0, unsigned long long id1);
unsigned cpd_graph_use_count(int device, unsigned long long id0, unsigned long long id1);
/* torch's emptyCache(mempool_id): give back the free memory of the private pools of that id on
 * every device (and destroy those released and empty). */
int cpd_graph_empty(unsigned long long id0, unsigned long long id1);
/* Call fn for every private pool under the graph lock (oldest first), stopping at the first
 * status that is not CP_OK, which is returned. fn may read the pool (stats, snapshot, info),
 * not allocate, free or call back into this file. */
typedef int (*cpd_graph_visit_fn)(void *arg, int device, unsigned long long id0, unsigned long long id1,
                                  cp_pool_t *pool);
int cpd_graph_visit(cpd_graph_visit_fn fn, void *arg);

/* 1 when a window may be open on `device` (a cheap look, before cpd_graph_alloc). */
#ifndef __cplusplus
#include <stdatomic.h>
extern atomic_int cpd_open[CP_MAX_DEVICES];
static inline int cpd_graph_window_open(int device) {
  return device >= 0 && device < CP_MAX_DEVICES && atomic_load_explicit(&cpd_open[device], memory_order_relaxed) != 0;
}
#endif

/* Routing (the entry points in abi.c). cpd_graph_alloc: *out_routed = 1 when a window took the
 * allocation (its status is returned), else 0 and CP_OK. */
int cpd_graph_alloc(size_t size, int device, void *stream, void **out_ptr, int *out_routed);
/* 1 when some private pool exists (cheap: frees look further only then). */
int cpd_graph_pools_exist(void);
/* A free, record_stream or base_of of a pointer that a private pool holds: *out_handled = 1
 * and the status; else 0 and CP_OK. cpd_graph_free looks at `device`'s pools only; `size`
 * NULL frees whatever size the block has (the bridge's frees, which know no size), else the
 * size must be the block's. */
int cpd_graph_free(void *ptr, const size_t *size, int device, int *out_handled);
int cpd_graph_record_stream(void *ptr, void *stream, int *out_handled);
/* cp_pool_share on the private pool holding `ptr` (*out_handled = 1, with its device and
 * backend); cpd_graph_is_shared: whether `ptr` is a shared block of one. */
int cpd_graph_share(void *ptr, cp_share_t *out, int *out_device, cp_backend_t *out_backend, int *out_handled);
int cpd_graph_is_shared(const void *ptr);
/* The device of the private pool holding `ptr` as a live allocation: 1 and *out_device, or 0. */
int cpd_graph_device_of(const void *ptr, int *out_device);
/* CP_PTR_* over every private pool (the first that is not CP_PTR_FOREIGN). */
int cpd_graph_base_of(const void *ptr, void **out_base, size_t *out_size);
/* Release whatever released pools can go now (empty_cache); returns the first failure. */
int cpd_graph_collect(void);

/* One private pool, for reports and tests. */
typedef struct cpd_graph_info_s {
  int device;
  unsigned long long id0, id1;
  unsigned uses;      /* begins not released yet */
  int window_open;    /* a window routes into it now */
  size_t allocated;   /* bytes in live blocks */
  size_t reserved;    /* bytes reserved from the device */
  size_t allocations; /* live blocks */
  uint32_t tag;       /* its region (Note [Graph regions]); 0: none */
  size_t paused;      /* bytes a pause gave back */
} cpd_graph_info_t;
/* Fill up to `max` entries (oldest pool first); returns how many pools there are. */
size_t cpd_graph_pools(cpd_graph_info_t *out, size_t max);
/* The private pool of (device, id), NULL when none (for tests; valid until it is destroyed). */
cp_pool_t *cpd_graph_pool(int device, unsigned long long id0, unsigned long long id1);

/* Checkpoints of a private pool (Note [Checkpoints] in core/checkpoint.c), for CUDA graph trees:
 * CP_ERR_INVALID when (device, id) has no pool. Each runs on the pool without the graph lock
 * (a restore may wait for frees), the pool held meanwhile. */
int cpd_graph_checkpoint(int device, unsigned long long id0, unsigned long long id1, cp_checkpoint_t **out_ck);
int cpd_graph_restore(int device, unsigned long long id0, unsigned long long id1, const cp_checkpoint_t *ck,
                      cp_restore_t *out);
int cpd_graph_live_blocks(int device, unsigned long long id0, unsigned long long id1, void ***out_ptrs,
                          size_t *out_count);

/* Note [Graph regions]
 * A graph captured while its thread is in a region (cudapool.region / graph_region) gets a
 * private pool of that region: page-mapped (expandable segments, no stitching: nothing it
 * maps moves), its allocations tagged. cpd_graph_pause and cpd_graph_resume pause and resume
 * the private pools of region `tag` (0: every region) on `device`, every mapped byte of them
 * (CP_PAUSE_KEEP_FREE): a replay uses the addresses of blocks freed during its capture too.
 * The pools are held (not destroyed) while they are paused or resumed without the graph lock. */
int cpd_graph_pause(int device, uint32_t tag, int backup);
int cpd_graph_resume(int device, uint32_t tag);

#ifdef __cplusplus
}
#endif

#ifdef __cplusplus
#include <functional>
#include <utility>
struct CUstream_st;
/* torch's three hooks (graph_hooks.cpp), exported under these names with torch's C++ types. */
extern "C" void cudapool_begin_allocate_to_pool(int device, std::pair<unsigned long long, unsigned long long> id,
                                                std::function<bool(CUstream_st *)> filter);
extern "C" void cudapool_end_allocate_to_pool(int device, std::pair<unsigned long long, unsigned long long> id);
extern "C" void cudapool_release_pool(int device, std::pair<unsigned long long, unsigned long long> id) noexcept;
#endif
/* For tests (graph_hooks.cpp): call hook `which` (0 begin, 1 end, 2 release) as torch does, the
 * begin with a std::function over `filter(stream, arg)`. 0, or 1 when it threw (message in buf). */
#ifdef __cplusplus
extern "C" {
#endif
int cudapool_call_graph_hook(int which, int device, unsigned long long id0, unsigned long long id1,
                             int (*filter)(void *stream, void *arg), void *arg, char *buf, size_t buf_size);
#ifdef __cplusplus
}
#endif

#endif /* CP_GRAPHS_H */
