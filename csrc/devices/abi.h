/* abi.h — the entry points torch's CUDAPluggableAllocator calls (exported, C ABI), and what
 * the binding needs of them. Owns: the signatures torch expects (DESIGN.md, "The PyTorch
 * contract"); the device table behind them is devices.h. */
#ifndef CP_ABI_H
#define CP_ABI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The interpreter is exiting: from now on the entry points count their failures instead of
 * printing them (Note [Failures at exit]). cpd_failures_at_exit: how many were counted. */
void cpd_set_exiting(void);
unsigned long cpd_failures_at_exit(void);
/* Report a failure that an entry point cannot return, on stderr (counted instead once the
 * interpreter is exiting). */
void cpd_report(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;

/* Cap `device`'s pool at `fraction` of its total memory (creating the pool), as torch's
 * set_per_process_memory_fraction does: 0 forbids growth (Note [Fraction zero] in abi.c). A
 * fraction outside [0, 1] (or NaN) is CP_ERR_INVALID and creates nothing. */
int cpd_set_memory_fraction(double fraction, int device);

/* The entry points (exported, C ABI). cudapool_alloc is in alloc.cpp: it throws on failure,
 * so only C++ can call it; cudapool_alloc_catching is the same path with the exception
 * caught, for callers that cannot catch one (tests through ctypes or the binding): it returns
 * the status of the failed allocation and, on failure, the exception's message in buf. */
void *cudapool_alloc(size_t size, int device, void *stream);
int cudapool_alloc_catching(size_t size, int device, void *stream, void **out_ptr, char *buf, size_t buf_size);
int cpd_alloc(size_t size, int device, void *stream, void **out_ptr);
void cudapool_free(void *ptr, size_t size, int device, void *stream);
/* The free of torch's allocator interface (the bridge's deleter, raw_delete), which knows
 * the pointer only: cudapool_free with any size (the block knows its own), on `device`; when
 * that device's pool does not hold it (or the device is < 0), on the device whose pool (shared
 * or private) does. A pointer no pool holds is left alone and counted, as cudapool_free does. */
void cpd_free(void *ptr, int device);
/* The device whose pool holds `ptr` as a live allocation (-1 when none does). */
int cpd_device_of(const void *ptr);
void cudapool_record_stream(void *ptr, void *stream);
void cudapool_empty_cache(void);
void cudapool_set_memory_fraction(double fraction, int device);
void cudapool_init(int device);
/* torch's base_alloc hook (set_base_alloc_fn: void *(void *ptr, size_t *size)): for a pointer
 * inside a live allocation of any device's pool, the address of the segment that holds it,
 * with the segment's size in *size, as the built-in allocator's getBaseAllocation answers; for
 * any other pointer, the pointer itself and *size = 0. */
void *cudapool_base_alloc(void *ptr, size_t *size);

/* Calls of cudapool_free and cudapool_record_stream on pointers that no pool's segment holds
 * (Note [Pointers cudapool does not own]): they do nothing, say nothing, and are counted. */
void cpd_foreign_calls(unsigned long long *out_frees, unsigned long long *out_record_streams);

/* Note [Out-of-memory type]
 * torch turns a c10::OutOfMemoryError thrown by the allocator into torch.OutOfMemoryError,
 * and its own recovery (cuDNN's search for a convolution engine with a smaller workspace)
 * catches that type only; any other std::exception becomes a RuntimeError. Throwing c10's
 * type needs torch's headers and libc10, which this library must not depend on (it builds and
 * runs without torch). So the type is thrown by a separate small library built against the
 * installed torch (oom_c10.cpp, the extension cudapool._torch_oom), which enable() registers
 * here after checking it was built for the running torch. Without it, cudapool_alloc throws
 * its own std::runtime_error subclass. The thrower must throw: if it returns, the fallback
 * is thrown. */
typedef void (*cpd_oom_thrower_t)(const char *message);

/* A function that names the calling thread's context for the history (cp_history_set_context):
 * the binding's Python-stack capture. When one is set, cpd_alloc and cudapool_free call it
 * before entering the pool (without any pool lock held) and clear the context after. NULL
 * (the default): no call. */
typedef uint64_t (*cpd_context_fn_t)(void);
void cpd_set_context_fn(cpd_context_fn_t fn);
/* The same with one function for allocations and one for frees (either NULL: none there). */
void cpd_set_context_fns(cpd_context_fn_t alloc_fn, cpd_context_fn_t free_fn);
/* Exported: install `thrower` (NULL: back to the fallback). */
void cudapool_set_oom_thrower(cpd_oom_thrower_t thrower);
cpd_oom_thrower_t cpd_oom_thrower(void);

/* Text for a failed cpd_alloc: "CUDA out of memory. Tried to allocate ..." for CP_ERR_OOM,
 * "cudapool: ..." otherwise. */
int cpd_alloc_error_message(int status, size_t size, int device, char *buf, size_t buf_size);

/* How cpd_throw_alloc_failure throws, for a caller built against torch (the bridge); every
 * field may be NULL. oom_seen: told of an out-of-memory failure after its message is made,
 * before the throw. oom: throws torch's out-of-memory type (NULL: the registered thrower, else
 * the fallback). other: throws every other failure (NULL: a std::runtime_error). */
typedef struct cpd_alloc_throw_s {
  void (*oom_seen)(size_t size, int device);
  cpd_oom_thrower_t oom;
  cpd_oom_thrower_t other;
} cpd_alloc_throw_t;

#ifdef __cplusplus
/* The one throw of a failed cpd_alloc (alloc.cpp; C linkage, as every includer sees it, but
 * only C++ can call it): its message (cpd_alloc_error_message), and the exception out of
 * memory or any other failure calls for (Note [Out-of-memory type]); `how` NULL: cudapool_alloc's. */
[[noreturn]] void cpd_throw_alloc_failure(int status, size_t size, int device, const cpd_alloc_throw_t *how);
}
#endif

#endif /* CP_ABI_H */
