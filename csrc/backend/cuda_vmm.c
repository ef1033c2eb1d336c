/* cuda_vmm.c — page-mapped memory on CUDA: the VMM entries of the operation table through
 * cuMemAddressReserve, cuMemCreate, cuMemMap and friends, and whether a device supports them. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "backend/cuda_internal.h"

/* Note [VMM support]
 * A device gets the page-mapped entries when the driver provides every CUDA_VMM_FUNCTIONS entry
 * (the loader resolves them as optional, so an old driver still serves plain segments) and the
 * device reports CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED. Otherwise the entries
 * stay NULL and the pool uses cuMemAlloc segments; cp_cuda_vmm_support says which and why.
 * Memory is always pinned device memory on the device itself, without export handles: the
 * allocation properties are the same for the granularity query and for cuMemCreate. Every
 * call runs in the device's primary context (Note [Context scope] in cuda.c): one that
 * acquires (va_reserve, page_create, page_map) gives it back when the previous context cannot
 * be restored; those that give back (va_free, page_release, page_unmap) report their own
 * outcome. */

static CUmemAllocationProp vmm_prop(const cuda_device_t *d) {
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop); /* win32HandleMetaData NULL, allocFlags zero */
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = d->dev;
  return prop;
}

/* ------------------------------------------------------------------------------------------
 * Backend entries (the operation table)
 * ---------------------------------------------------------------------------------------- */

static int cuda_vmm_granularity(void *ctx, size_t *out_bytes) {
  cuda_device_t *d = ctx;
  if (out_bytes == NULL) return cp_set_error(CP_ERR_INVALID, "cudapool: cuda vmm_granularity: out_bytes is NULL");
  cuda_scope_t scope;
  int rc = cp_cuda_enter(d, "cuMemGetAllocationGranularity", &scope);
  if (rc != CP_OK) return rc;
  const CUmemAllocationProp prop = vmm_prop(d);
  size_t bytes = 0;
  const CUresult r = cp_cuda_fn.cuMemGetAllocationGranularity(&bytes, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (r != CUDA_SUCCESS)
    rc = cp_cuda_fail(CP_ERR_BACKEND, r, "cuMemGetAllocationGranularity(pinned, device %d, MINIMUM)", d->ordinal);
  else if (bytes == 0 || (bytes & (bytes - 1)) != 0)
    rc = cp_set_error(CP_ERR_BACKEND,
                      "cudapool: cuMemGetAllocationGranularity(pinned, device %d, MINIMUM) gave %zu bytes, "
                      "not a power of two",
                      d->ordinal, bytes);
  rc = cp_cuda_leave(d, "cuMemGetAllocationGranularity", &scope, rc);
  if (rc == CP_OK) *out_bytes = bytes;
  return rc;
}

static int cuda_va_reserve(void *ctx, size_t size, uintptr_t *out_addr) {
  cuda_device_t *d = ctx;
  if (out_addr == NULL || size == 0)
    return cp_set_error(CP_ERR_INVALID, "cudapool: cuda va_reserve(%zu bytes): %s", size,
                        size == 0 ? "size must be > 0" : "out_addr is NULL");
  cuda_scope_t scope;
  int rc = cp_cuda_enter(d, "cuMemAddressReserve", &scope);
  if (rc != CP_OK) return rc;
  CUdeviceptr ptr = 0;
  int mode;
  const int relaxed = cp_cuda_relax(&mode);                               /* never join a capture under way */
  const CUresult r = cp_cuda_fn.cuMemAddressReserve(&ptr, size, 0, 0, 0); /* aligned to the granularity */
  cp_cuda_unrelax(relaxed, &mode);
  if (r != CUDA_SUCCESS)
    rc = cp_cuda_fail(r == CUDA_ERROR_OUT_OF_MEMORY ? CP_ERR_OOM : CP_ERR_BACKEND, r,
                      "cuMemAddressReserve(%zu bytes) on device %d", size, d->ordinal);
  const int acquired = rc == CP_OK;
  rc = cp_cuda_leave(d, "cuMemAddressReserve", &scope, rc);
  if (acquired && rc != CP_OK) (void)cp_cuda_fn.cuMemAddressFree(ptr, size);
  if (rc == CP_OK) *out_addr = (uintptr_t)ptr;
  return rc;
}

static int cuda_va_free(void *ctx, uintptr_t addr, size_t size) {
  cuda_device_t *d = ctx;
  cuda_scope_t scope;
  int rc = cp_cuda_enter(d, "cuMemAddressFree", &scope);
  if (rc != CP_OK) return rc;
  const CUresult r = cp_cuda_fn.cuMemAddressFree((CUdeviceptr)addr, size);
  if (r != CUDA_SUCCESS)
    rc = cp_cuda_fail(CP_ERR_BACKEND, r, "cuMemAddressFree(0x%" PRIxPTR ", %zu bytes) on device %d", addr, size,
                      d->ordinal);
  (void)cp_cuda_leave(d, "cuMemAddressFree", &scope, CP_ERR_BACKEND); /* Note [Context scope] */
  return rc;
}

static int cuda_page_create(void *ctx, size_t size, cp_page_t *out_page) {
  cuda_device_t *d = ctx;
  if (out_page == NULL || size == 0)
    return cp_set_error(CP_ERR_INVALID, "cudapool: cuda page_create(%zu bytes): %s", size,
                        size == 0 ? "size must be > 0" : "out_page is NULL");
  cuda_scope_t scope;
  int rc = cp_cuda_enter(d, "cuMemCreate", &scope);
  if (rc != CP_OK) return rc;
  const CUmemAllocationProp prop = vmm_prop(d);
  CUmemGenericAllocationHandle handle = 0;
  int mode;
  const int relaxed = cp_cuda_relax(&mode); /* never join a capture under way */
  const CUresult r = cp_cuda_fn.cuMemCreate(&handle, size, &prop, 0);
  cp_cuda_unrelax(relaxed, &mode);
  if (r != CUDA_SUCCESS)
    rc = cp_cuda_fail(r == CUDA_ERROR_OUT_OF_MEMORY ? CP_ERR_OOM : CP_ERR_BACKEND, r,
                      "cuMemCreate(%zu bytes, pinned, device %d)", size, d->ordinal);
  const int acquired = rc == CP_OK;
  rc = cp_cuda_leave(d, "cuMemCreate", &scope, rc);
  if (acquired && rc != CP_OK) (void)cp_cuda_fn.cuMemRelease(handle);
  if (rc == CP_OK) *out_page = (cp_page_t)handle;
  return rc;
}

static int cuda_page_release(void *ctx, cp_page_t page) {
  cuda_device_t *d = ctx;
  cuda_scope_t scope;
  int rc = cp_cuda_enter(d, "cuMemRelease", &scope);
  if (rc != CP_OK) return rc;
  const CUresult r = cp_cuda_fn.cuMemRelease((CUmemGenericAllocationHandle)page);
  if (r != CUDA_SUCCESS)
    rc = cp_cuda_fail(CP_ERR_BACKEND, r, "cuMemRelease(page 0x%" PRIxPTR ") on device %d", page, d->ordinal);
  (void)cp_cuda_leave(d, "cuMemRelease", &scope, CP_ERR_BACKEND); /* Note [Context scope] */
  return rc;
}

static int cuda_page_map(void *ctx, uintptr_t addr, size_t size, cp_page_t page) {
  cuda_device_t *d = ctx;
  cuda_scope_t scope;
  int rc = cp_cuda_enter(d, "cuMemMap", &scope);
  if (rc != CP_OK) return rc;
  int mode;
  const int relaxed = cp_cuda_relax(&mode); /* never join a capture under way */
  const CUresult r = cp_cuda_fn.cuMemMap((CUdeviceptr)addr, size, 0, (CUmemGenericAllocationHandle)page, 0);
  cp_cuda_unrelax(relaxed, &mode);
  if (r != CUDA_SUCCESS)
    rc = cp_cuda_fail(CP_ERR_BACKEND, r,
                      "cuMemMap(0x%" PRIxPTR ", %zu bytes, offset 0, page 0x%" PRIxPTR ") on device %d", addr, size,
                      page, d->ordinal);
  const int acquired = rc == CP_OK;
  rc = cp_cuda_leave(d, "cuMemMap", &scope, rc);
  if (acquired && rc != CP_OK) (void)cp_cuda_fn.cuMemUnmap((CUdeviceptr)addr, size);
  return rc;
}

static int cuda_page_unmap(void *ctx, uintptr_t addr, size_t size) {
  cuda_device_t *d = ctx;
  cuda_scope_t scope;
  int rc = cp_cuda_enter(d, "cuMemUnmap", &scope);
  if (rc != CP_OK) return rc;
  const CUresult r = cp_cuda_fn.cuMemUnmap((CUdeviceptr)addr, size);
  if (r != CUDA_SUCCESS)
    rc = cp_cuda_fail(CP_ERR_BACKEND, r, "cuMemUnmap(0x%" PRIxPTR ", %zu bytes) on device %d", addr, size, d->ordinal);
  (void)cp_cuda_leave(d, "cuMemUnmap", &scope, CP_ERR_BACKEND); /* Note [Context scope] */
  return rc;
}

static int cuda_page_set_access(void *ctx, uintptr_t addr, size_t size) {
  cuda_device_t *d = ctx;
  cuda_scope_t scope;
  int rc = cp_cuda_enter(d, "cuMemSetAccess", &scope);
  if (rc != CP_OK) return rc;
  CUmemAccessDesc desc;
  memset(&desc, 0, sizeof desc);
  desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  desc.location.id = d->dev;
  desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  int mode;
  const int relaxed = cp_cuda_relax(&mode); /* never join a capture under way */
  const CUresult r = cp_cuda_fn.cuMemSetAccess((CUdeviceptr)addr, size, &desc, 1);
  cp_cuda_unrelax(relaxed, &mode);
  if (r != CUDA_SUCCESS)
    rc = cp_cuda_fail(CP_ERR_BACKEND, r, "cuMemSetAccess(0x%" PRIxPTR ", %zu bytes, read-write for device %d)", addr,
                      size, d->ordinal);
  return cp_cuda_leave(d, "cuMemSetAccess", &scope, rc);
}

/* ------------------------------------------------------------------------------------------
 * Support (cuda_internal.h, cuda.h)
 * ---------------------------------------------------------------------------------------- */

int cp_cuda_vmm_probe(int ordinal, CUdevice dev, char *why, size_t why_bytes, CUresult *out_r) {
  if (cp_cuda_vmm_missing[0] != '\0') {
    snprintf(why, why_bytes, "the CUDA driver lacks page-mapped memory: %s", cp_cuda_vmm_missing);
    return 0;
  }
  int value = 0;
  const CUresult r =
      cp_cuda_fn.cuDeviceGetAttribute(&value, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev);
  if (r != CUDA_SUCCESS) {
    *out_r = r;
    char text[CUDA_WHY_BYTES];
    snprintf(why, why_bytes,
             "cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device %d) failed: %s",
             ordinal, cp_cuda_why(r, text, sizeof text));
    return -1;
  }
  if (value == 0) {
    snprintf(why, why_bytes,
             "CUDA device %d does not support virtual memory management "
             "(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0)",
             ordinal);
    return 0;
  }
  snprintf(why, why_bytes, "CUDA device %d supports virtual memory management and the driver has every call", ordinal);
  return 1;
}

int cp_cuda_vmm_support(int device, int *out_supported, char *why, size_t why_size) {
  if (out_supported == NULL) return cp_set_error(CP_ERR_INVALID, "cp_cuda_vmm_support: out_supported is NULL");
  if (why == NULL && why_size != 0) return cp_set_error(CP_ERR_INVALID, "cp_cuda_vmm_support: why is NULL");
  int rc = cp_cuda_load();
  if (rc != CP_OK) return rc;
  int count = 0;
  CUresult r = cp_cuda_fn.cuDeviceGetCount(&count);
  if (r != CUDA_SUCCESS) return cp_cuda_fail(CP_ERR_BACKEND, r, "cuDeviceGetCount");
  if (device < 0 || device >= count)
    return cp_set_error(CP_ERR_INVALID, "cudapool: CUDA device %d does not exist (%d CUDA device%s visible)", device,
                        count, count == 1 ? "" : "s");
  CUdevice dev = 0;
  r = cp_cuda_fn.cuDeviceGet(&dev, device);
  if (r != CUDA_SUCCESS) return cp_cuda_fail(CP_ERR_BACKEND, r, "cuDeviceGet(%d)", device);
  char text[CUDA_MESSAGE_BYTES];
  const int supported = cp_cuda_vmm_probe(device, dev, text, sizeof text, &r);
  if (supported < 0) return cp_set_error(CP_ERR_BACKEND, "cudapool: %s", text);
  *out_supported = supported;
  if (why_size != 0) snprintf(why, why_size, "%s", text);
  return CP_OK;
}

void cp_cuda_vmm_table(cp_backend_t *out) {
  out->vmm_granularity = cuda_vmm_granularity;
  out->va_reserve = cuda_va_reserve;
  out->va_free = cuda_va_free;
  out->page_create = cuda_page_create;
  out->page_release = cuda_page_release;
  out->page_map = cuda_page_map;
  out->page_unmap = cuda_page_unmap;
  out->page_set_access = cuda_page_set_access;
}
