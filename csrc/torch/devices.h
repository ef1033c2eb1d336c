/* devices.h — the process-wide pools, one per device, and the entry points torch calls.
 * Owns: which backend serves a device, the shared configuration, lazy pool creation. */
#ifndef CP_DEVICES_H
#define CP_DEVICES_H

#include <stddef.h>
#include <stdint.h>

#include "core/cp.h"

/* The configuration every pool created from now on gets. CP_ERR_STATE once a pool exists
 * (a pool's size classes cannot change under live blocks). */
int cpd_configure(const cp_config_t *cfg);
void cpd_config(cp_config_t *out_cfg);

/* Serve devices from simulated devices of `capacity` bytes each instead of the CUDA driver
 * (`count` devices). For tests and for exploring without a GPU. CP_ERR_STATE once a pool
 * exists. */
int cpd_use_sim(size_t capacity, int count, unsigned sim_flags);
int cpd_using_sim(void);
/* The simulated device behind `device` (sim mode only), NULL otherwise. */
struct cp_sim_s *cpd_sim(int device);

/* The pool of `device`, created on first use. */
int cpd_pool(int device, cp_pool_t **out_pool);
/* The pool of `device` when it exists, else NULL (never creates one). */
cp_pool_t *cpd_pool_if_created(int device);
int cpd_device_count(int *out_count);

/* Destroy every pool and backend: all memory goes back to the device. Later calls create
 * fresh pools. Used at interpreter exit and by tests. */
void cpd_shutdown(void);

/* The interpreter is exiting: from now on the entry points count their failures instead of
 * printing them (Note [Failures at exit]). cpd_failures_at_exit: how many were counted. */
void cpd_set_exiting(void);
unsigned long cpd_failures_at_exit(void);

/* Cap `device`'s pool at `fraction` of its total memory (creating the pool). A fraction
 * outside [0, 1] (or NaN) is CP_ERR_INVALID and creates nothing. */
int cpd_set_memory_fraction(double fraction, int device);

/* The entry points torch's CUDAPluggableAllocator calls (exported, C ABI). cudapool_alloc
 * itself is in entry.cpp: it throws on failure. */
int cpd_alloc(size_t size, int device, void *stream, void **out_ptr);
void cudapool_free(void *ptr, size_t size, int device, void *stream);
void cudapool_record_stream(void *ptr, void *stream);
void cudapool_empty_cache(void);
void cudapool_set_memory_fraction(double fraction, int device);
void cudapool_init(int device);

/* Text for a failed cpd_alloc: "CUDA out of memory. Tried to allocate ..." for CP_ERR_OOM,
 * "cudapool: ..." otherwise. */
int cpd_alloc_error_message(int status, size_t size, int device, char *buf, size_t buf_size);

#endif /* CP_DEVICES_H */
