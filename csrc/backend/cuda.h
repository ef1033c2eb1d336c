/* cuda.h — the CUDA backend: device memory, page-mapped memory and events through the CUDA driver API.
 * libcuda is loaded with dlopen at run time: this builds and imports on a machine without one. */
#ifndef CP_CUDA_H
#define CP_CUDA_H

#include <stddef.h>

#include "base/backend.h"

/* Every function below returns CP_OK or a status with the thread's last error set
 * (cp_last_error), naming the driver call that failed and the driver's error name.
 * All of them are thread-safe. */

/* Load the driver: dlopen libcuda (libcuda.so.1, or the library the environment variable
 * CUDAPOOL_CUDA_DRIVER names: Note [Which libcuda] in cuda.c), resolve every driver function
 * it needs through cuGetProcAddress, then cuInit(0). Idempotent: the first call does the
 * work, later ones return its outcome, a failure included (CP_ERR_BACKEND, "cudapool: no CUDA
 * driver: ..." or "cudapool: cuInit failed: ..."), with the same message every time. Every
 * other function below calls it first. */
int cp_cuda_load(void);

/* The driver's CUDA version, 1000 * major + 10 * minor (12040 for 12.4). */
int cp_cuda_driver_version(int *out);

/* CUDA devices visible to this process (CUDA_VISIBLE_DEVICES applies). */
int cp_cuda_device_count(int *out);

/* The device's name, NUL-terminated and truncated to fit `n` bytes (n > 0); `buf` is left
 * untouched on failure. */
int cp_cuda_device_name(int device, char *buf, size_t n);

/* Fill `out` with the operation table of device `device` (0 <= device < count, and below
 * CP_MAX_DEVICES; CP_ERR_INVALID otherwise). The device's primary context is retained on
 * the first call and kept until cp_cuda_shutdown; the table stays valid until then. Every
 * operation makes that context current for its duration and restores the calling thread's
 * previous context before returning, so it may be called from any thread with any (or no)
 * current context. Streams are CUstream / cudaStream_t values; 0 is the legacy default
 * stream. Events are created with timing disabled. An event is gone once event_destroy
 * returns, whatever it returns, and a page once page_release has handed it to the driver: a
 * second call of either is refused with CP_ERR_INVALID, no driver call made. With several
 * devices, page-mapped memory is made accessible to each device that can reach this one
 * (cuDeviceCanAccessPeer). */
int cp_cuda_backend(int device, cp_backend_t *out);

/* Whether device `device` gets the page-mapped entries of the operation table (Note
 * [Page-mapped memory] in base/backend.h): *out_supported is 1 when the driver provides every
 * VMM call and the device reports CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, else
 * 0 (the pool then uses plain segments). `why` gets one line saying which and why (NUL-terminated,
 * truncated to `why_size` bytes; why may be NULL when why_size is 0). Both are untouched on
 * failure: no driver (the load's message), a device that does not exist (CP_ERR_INVALID), or
 * the driver failing the query. The table of cp_cuda_backend follows the same answer. */
int cp_cuda_vmm_support(int device, int *out_supported, char *why, size_t why_size);

/* Release the primary contexts retained by cp_cuda_backend; operations of tables filled
 * before then fail with CP_ERR_STATE until cp_cuda_backend is called again for that device.
 * Safe at process exit, when the driver may already be shutting down, and when it was never
 * loaded (then it does nothing). The library stays loaded. Must not race with operations. */
void cp_cuda_shutdown(void);

#endif /* CP_CUDA_H */
