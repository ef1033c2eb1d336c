/* cuda_copy.c — the CUDA backend's pinned host memory and copies between it and device memory,
 * for the backups of paused regions (Note [Copies for a backup] in base/backend.h). */
#include <inttypes.h>

#include "backend/cuda_internal.h"

/* cuMemAllocHost gives page-locked host memory the device reaches directly, so a copy runs at
 * the link's speed and needs no staging buffer. cuMemcpyDtoH and cuMemcpyHtoD return once the
 * copy is done (the driver reference: "synchronous" for pageable memory, and for pinned memory
 * on the legacy stream, which torch's streams do not wait for; the pool has waited for them
 * first). They run in the device's primary context, entered per call (Note [Context scope]). */

static int cuda_host_alloc(void *ctx, size_t size, void **out_ptr) {
  cuda_device_t *d = ctx;
  if (out_ptr == NULL || size == 0) return cp_set_error(CP_ERR_INVALID, "cudapool: cuda host_alloc(%zu bytes)", size);
  cuda_scope_t scope;
  int rc = cp_cuda_enter(d, "cuMemAllocHost", &scope);
  if (rc != CP_OK) return rc;
  void *p = NULL;
  const CUresult r = cp_cuda_fn.cuMemAllocHost(&p, size);
  if (r != CUDA_SUCCESS)
    rc = cp_cuda_fail(r == CUDA_ERROR_OUT_OF_MEMORY ? CP_ERR_HOST_OOM : CP_ERR_BACKEND, r,
                      "cuMemAllocHost(%zu bytes) for device %d", size, d->ordinal);
  rc = cp_cuda_leave(d, "cuMemAllocHost", &scope, rc);
  if (rc == CP_OK) {
    *out_ptr = p;
  } else if (r == CUDA_SUCCESS) {
    (void)cp_cuda_fn.cuMemFreeHost(p);
  }
  return rc;
}

static int cuda_host_free(void *ctx, void *ptr) {
  cuda_device_t *d = ctx;
  cuda_scope_t scope;
  int rc = cp_cuda_enter(d, "cuMemFreeHost", &scope);
  if (rc != CP_OK) return rc;
  const CUresult r = cp_cuda_fn.cuMemFreeHost(ptr);
  if (r != CUDA_SUCCESS) rc = cp_cuda_fail(CP_ERR_BACKEND, r, "cuMemFreeHost(%p) for device %d", ptr, d->ordinal);
  (void)cp_cuda_leave(d, "cuMemFreeHost", &scope, CP_ERR_BACKEND); /* Note [Context scope] */
  return rc;
}

static int cuda_copy_to_host(void *ctx, void *dst, uintptr_t src, size_t size) {
  cuda_device_t *d = ctx;
  cuda_scope_t scope;
  int rc = cp_cuda_enter(d, "cuMemcpyDtoH", &scope);
  if (rc != CP_OK) return rc;
  const CUresult r = cp_cuda_fn.cuMemcpyDtoH(dst, (CUdeviceptr)src, size);
  if (r != CUDA_SUCCESS)
    rc = cp_cuda_fail(CP_ERR_BACKEND, r, "cuMemcpyDtoH(%p, 0x%" PRIxPTR ", %zu bytes) on device %d", dst, src, size,
                      d->ordinal);
  return cp_cuda_leave(d, "cuMemcpyDtoH", &scope, rc);
}

static int cuda_copy_to_device(void *ctx, uintptr_t dst, const void *src, size_t size) {
  cuda_device_t *d = ctx;
  cuda_scope_t scope;
  int rc = cp_cuda_enter(d, "cuMemcpyHtoD", &scope);
  if (rc != CP_OK) return rc;
  const CUresult r = cp_cuda_fn.cuMemcpyHtoD((CUdeviceptr)dst, src, size);
  if (r != CUDA_SUCCESS)
    rc = cp_cuda_fail(CP_ERR_BACKEND, r, "cuMemcpyHtoD(0x%" PRIxPTR ", %p, %zu bytes) on device %d", dst, src, size,
                      d->ordinal);
  return cp_cuda_leave(d, "cuMemcpyHtoD", &scope, rc);
}

void cp_cuda_copy_table(cp_backend_t *out) {
  if (cp_cuda_fn.cuMemAllocHost == NULL || cp_cuda_fn.cuMemFreeHost == NULL || cp_cuda_fn.cuMemcpyDtoH == NULL ||
      cp_cuda_fn.cuMemcpyHtoD == NULL)
    return; /* all four, or none: a pause then refuses backup=True */
  out->host_alloc = cuda_host_alloc;
  out->host_free = cuda_host_free;
  out->copy_to_host = cuda_copy_to_host;
  out->copy_to_device = cuda_copy_to_device;
}
