/* standin_copy.c — the stand-in's page-locked host memory (cuMemAllocHost, cuMemFreeHost) and
 * synchronous copies between host and device memory (cuMemcpyDtoH, cuMemcpyHtoD). */
#include <stdlib.h>
#include <string.h>

#include "standin/standin_internal.h"

/* The reference: cuMemAllocHost allocates page-locked host memory the device can reach, freed
 * only by cuMemFreeHost; both are potentially unsafe during a capture. cuMemcpyDtoH/HtoD need
 * a current context, copy `size` bytes and return when they are done. The memory on the device
 * side must be the device's: cuMemAlloc memory, or mappings the current device has access to
 * (else CUDA_ERROR_INVALID_VALUE). These copies are issued on the legacy stream, which
 * non-blocking streams do not wait for: a copy of bytes that incomplete work still touches
 * reads or overwrites what that work uses, a fault here (CPSTANDIN_FAULT_IN_USE), made all the
 * same. */

CUresult cuMemAllocHost_v2(void **out, size_t size) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuMemAllocHost);
  int device = 0;
  if (r == CUDA_SUCCESS && (out == NULL || size == 0)) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) r = sti_current_device(&device);
  if (r == CUDA_SUCCESS) {
    void *p = malloc(size);
    if (p == NULL) {
      r = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
      *out = p;
      sti.host_allocs++;
    }
  }
  return sti_leave(&c, r);
}

CUresult cuMemFreeHost(void *ptr) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuMemFreeHost);
  int device = 0;
  if (r == CUDA_SUCCESS && ptr == NULL) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) r = sti_current_device(&device);
  if (r == CUDA_SUCCESS) {
    free(ptr);
    sti.host_allocs--;
  }
  return sti_leave(&c, r);
}

/* Copy between host memory and [dev, dev + size) of device memory; `to_device` says which way. */
static CUresult sti_copy(sti_fn_t fn, CUdeviceptr dev, void *host, size_t size, int to_device) {
  sti_call_t c;
  CUresult r = sti_enter(&c, fn);
  int device = 0;
  if (r == CUDA_SUCCESS && (host == NULL || size == 0)) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) r = sti_current_device(&device);
  if (r == CUDA_SUCCESS && !sti_mem_writable(device, dev, size)) r = CUDA_ERROR_INVALID_VALUE;
  uint32_t stream = 0;
  if (r == CUDA_SUCCESS && sti_in_use(dev, size, &stream)) {
    sti_fault(CPSTANDIN_FAULT_IN_USE, "%s of 0x%llx (%zu bytes) while work queued on stream %u still touches it",
              to_device ? "cuMemcpyHtoD" : "cuMemcpyDtoH", dev, size, stream);
  }
  for (size_t off = 0; r == CUDA_SUCCESS && off < size;) {
    size_t len = 0;
    unsigned char *bytes = sti_mem_bytes(dev + off, &len);
    if (len > size - off) len = size - off;
    if (len == 0) break;
    unsigned char *h = (unsigned char *)host + off;
    if (bytes == NULL) { /* no host memory behind it: reads as zeros */
      if (!to_device) memset(h, 0, len);
    } else if (to_device) {
      memcpy(bytes, h, len);
    } else {
      memcpy(h, bytes, len);
    }
    off += len;
  }
  return sti_leave(&c, r);
}

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t size) {
  return sti_copy(STI_FN_cuMemcpyDtoH, src, dst, size, 0);
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t size) {
  return sti_copy(STI_FN_cuMemcpyHtoD, dst, (void *)(uintptr_t)src, size, 1);
}
