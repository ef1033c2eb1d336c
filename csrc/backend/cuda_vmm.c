/* cuda_vmm.c — the CUDA devices: the queries of cuda.h, what each device supports, and page-mapped memory
 * (the VMM entries of the operation table through cuMemAddressReserve, cuMemCreate, cuMemMap and friends). */
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "backend/cuda_internal.h"
#include "base/fork.h"
#include "base/ptrmap.h"

/* Note [VMM support]
 * A device gets the page-mapped entries when the driver provides every CUDA_VMM_FUNCTIONS entry
 * (the loader resolves them as optional, so an old driver still serves plain segments) and the
 * device reports CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED. Otherwise the entries
 * stay NULL and the pool uses cuMemAlloc segments; cp_cuda_vmm_support says which and why.
 * Memory is always pinned device memory on the device itself, without export handles, marked
 * GPUDirect RDMA capable when the device reports
 * CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED (asked once per device, as
 * torch's expandable segments do, so that memory handed to a NIC works): the allocation
 * properties are the same for the granularity query and for cuMemCreate. Every call runs in
 * the device's primary context (Note [Context scope] in cuda_call.c): one that acquires
 * (va_reserve, page_create, page_map) gives it back when the previous context cannot be
 * restored; those that give back (va_free, page_release, page_unmap) report their own
 * outcome. Every call that changes the address space runs in the relaxed capture mode (Note
 * [Capture and contexts] in cuda.c). Out of memory from cuMemMap (page tables) and
 * cuMemSetAccess is CP_ERR_OOM, as from cuMemCreate: the pool's out-of-memory ladder may free
 * cached memory and try again.
 *
 * Note [Page handles]
 * The driver API reference leaves cuMemRelease of a handle that is no longer valid undefined,
 * and after a failed cuMemRelease the handle may be released already. So page_release hands a
 * handle to the driver at most once: the handles page_create made are kept in vmm_pages, and
 * page_release takes the handle out before calling cuMemRelease, whatever it answers. A
 * second page_release of it (a caller's retry) is refused with CP_ERR_INVALID and no driver
 * call. */

static pthread_mutex_t vmm_pages_lock = PTHREAD_MUTEX_INITIALIZER;
static cp_ptrmap_t vmm_pages; /* live handle -> its device slot */
static int vmm_pages_ready;
static cp_fork_lock_t vmm_pages_fork_node;

void cp_cuda_vmm_register_for_fork(void) {
  cp_fork_register(&vmm_pages_fork_node, &vmm_pages_lock, CP_FORK_LEVEL_BACKEND);
}

/* Remember `handle` as live: CP_OK or CP_ERR_HOST_OOM. */
static int vmm_page_keep(cuda_device_t *d, CUmemGenericAllocationHandle handle) {
  int rc = CP_OK;
  pthread_mutex_lock(&vmm_pages_lock);
  if (!vmm_pages_ready) {
    rc = cp_ptrmap_init(&vmm_pages, 64);
    vmm_pages_ready = rc == CP_OK;
  }
  /* A driver hands a value out again only once it was released; a value still here was lost
   * with its device (a driver reset), and the new handle takes its place. */
  if (rc == CP_OK) (void)cp_ptrmap_remove(&vmm_pages, (uintptr_t)handle);
  if (rc == CP_OK) rc = cp_ptrmap_insert(&vmm_pages, (uintptr_t)handle, d);
  pthread_mutex_unlock(&vmm_pages_lock);
  return rc;
}

/* Forget `handle`: 1 when it was live. */
static int vmm_page_forget(cp_page_t handle) {
  pthread_mutex_lock(&vmm_pages_lock);
  const int live = vmm_pages_ready && cp_ptrmap_remove(&vmm_pages, handle) != NULL;
  pthread_mutex_unlock(&vmm_pages_lock);
  return live;
}

static CUmemAllocationProp vmm_prop(cuda_device_t *d) {
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop); /* win32HandleMetaData NULL, allocFlags zero */
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = atomic_load_explicit(&d->posix_fd, memory_order_relaxed)
                                  ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                                  : CU_MEM_HANDLE_TYPE_NONE;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = d->dev;
  prop.allocFlags.gpuDirectRDMACapable = d->rdma ? 1 : 0;
  return prop;
}

/* Note [Peers]
 * A mapping is usable only from the devices cuMemSetAccess granted. Memory of one device is
 * reached from others in a process with several (a peer copy, NCCL), so, as torch's
 * expandable segments do, every cuMemSetAccess grants read-write access to the device itself
 * and to each other device that can reach it: cuDeviceCanAccessPeer(&can, peer, device) == 1,
 * asked once per device when its slot goes live. Without cuDeviceCanAccessPeer, or when a
 * query fails, there are no peers. */
/* Note [Sharing pages]
 * A page can be exported to another process only when it was created with the POSIX file
 * descriptor handle type requested, which is asked at cuMemCreate and cannot be added later; so
 * every page is created exportable on a device that reports
 * CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED and whose driver has the
 * export and import calls (as torch's expandable segments do when they may be shared). Where
 * the driver still refuses such a page (CUDA_ERROR_NOT_PERMITTED or _NOT_SUPPORTED: some
 * containers and virtualised GPUs), the page is created without it, and so is every later one
 * of the device: its memory then cannot be shared, and saying so is page_export's. */
void cp_cuda_vmm_probe_device(cuda_device_t *d, int count) {
  d->rdma = 0;
  atomic_store_explicit(&d->posix_fd, 0, memory_order_relaxed);
  d->peer_count = 0;
  int value = 0;
  if (cp_cuda_vmm_missing[0] == '\0' &&
      cp_cuda_fn.cuDeviceGetAttribute(&value, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, d->dev) ==
          CUDA_SUCCESS)
    d->rdma = value != 0;
  value = 0;
  if (cp_cuda_vmm_missing[0] == '\0' && cp_cuda_fn.cuMemRetainAllocationHandle != NULL &&
      cp_cuda_fn.cuMemExportToShareableHandle != NULL && cp_cuda_fn.cuMemImportFromShareableHandle != NULL &&
      cp_cuda_fn.cuDeviceGetAttribute(&value, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                                      d->dev) == CUDA_SUCCESS)
    atomic_store_explicit(&d->posix_fd, value != 0, memory_order_relaxed);
  if (cp_cuda_fn.cuDeviceCanAccessPeer == NULL) return;
  for (int i = 0; i < count && i < CP_MAX_DEVICES; i++) {
    CUdevice peer = 0;
    int can = 0;
    if (i == d->ordinal || cp_cuda_fn.cuDeviceGet(&peer, i) != CUDA_SUCCESS) continue;
    if (cp_cuda_fn.cuDeviceCanAccessPeer(&can, peer, d->dev) == CUDA_SUCCESS && can == 1)
      d->peers[d->peer_count++] = peer;
  }
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
  cuda_call_t c;
  int rc = cp_cuda_begin(d, "cuMemAddressReserve", &c);
  if (rc != CP_OK) return rc;
  CUdeviceptr ptr = 0;
  /* aligned to the granularity */
  rc = cp_cuda_result(&c, cp_cuda_fn.cuMemAddressReserve(&ptr, size, 0, 0, 0), CP_ERR_OOM,
                      "cuMemAddressReserve(%zu bytes) on device %d", size, d->ordinal);
  const int acquired = rc == CP_OK;
  rc = cp_cuda_leave(d, "cuMemAddressReserve", &c.scope, rc);
  if (acquired && rc != CP_OK) (void)cp_cuda_fn.cuMemAddressFree(ptr, size);
  if (rc == CP_OK) *out_addr = (uintptr_t)ptr;
  return rc;
}

static int cuda_va_free(void *ctx, uintptr_t addr, size_t size) {
  cuda_device_t *d = ctx;
  cuda_call_t c;
  int rc = cp_cuda_begin(d, "cuMemAddressFree", &c);
  if (rc != CP_OK) return rc;
  rc = cp_cuda_result(&c, cp_cuda_fn.cuMemAddressFree((CUdeviceptr)addr, size), CP_ERR_BACKEND,
                      "cuMemAddressFree(0x%" PRIxPTR ", %zu bytes) on device %d", addr, size, d->ordinal);
  (void)cp_cuda_leave(d, "cuMemAddressFree", &c.scope, CP_ERR_BACKEND); /* Note [Context scope] */
  return rc;
}

static int cuda_page_create(void *ctx, size_t size, cp_page_t *out_page) {
  cuda_device_t *d = ctx;
  if (out_page == NULL || size == 0)
    return cp_set_error(CP_ERR_INVALID, "cudapool: cuda page_create(%zu bytes): %s", size,
                        size == 0 ? "size must be > 0" : "out_page is NULL");
  cuda_call_t c;
  int rc = cp_cuda_begin(d, "cuMemCreate", &c);
  if (rc != CP_OK) return rc;
  CUmemAllocationProp prop = vmm_prop(d);
  CUmemGenericAllocationHandle handle = 0;
  CUresult r = cp_cuda_fn.cuMemCreate(&handle, size, &prop, 0);
  if ((r == CUDA_ERROR_NOT_PERMITTED || r == CUDA_ERROR_NOT_SUPPORTED) &&
      prop.requestedHandleTypes != CU_MEM_HANDLE_TYPE_NONE) { /* Note [Sharing pages] */
    atomic_store_explicit(&d->posix_fd, 0, memory_order_relaxed);
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
    r = cp_cuda_fn.cuMemCreate(&handle, size, &prop, 0);
  }
  rc = cp_cuda_result(&c, r, CP_ERR_OOM, "cuMemCreate(%zu bytes, pinned, device %d)", size, d->ordinal);
  const int acquired = rc == CP_OK;
  rc = cp_cuda_leave(d, "cuMemCreate", &c.scope, rc);
  if (rc == CP_OK && vmm_page_keep(d, handle) != CP_OK)
    rc = cp_set_error(CP_ERR_HOST_OOM, "cudapool: cuda page_create: no host memory to keep the page's handle");
  if (acquired && rc != CP_OK) (void)cp_cuda_fn.cuMemRelease(handle); /* once: it was never handed out */
  if (rc == CP_OK) *out_page = (cp_page_t)handle;
  return rc;
}

/* Note [Page handles]: the handle is handed to cuMemRelease at most once. */
static int cuda_page_release(void *ctx, cp_page_t page) {
  cuda_device_t *d = ctx;
  cuda_call_t c;
  int rc = cp_cuda_begin(d, "cuMemRelease", &c);
  if (rc != CP_OK) return rc; /* no driver call was made: the handle is still live */
  if (!vmm_page_forget(page)) {
    rc = cp_set_error(CP_ERR_INVALID,
                      "cudapool: cuda page_release(page 0x%" PRIxPTR
                      ") on device %d: not a live page (released already, or a failed release, which is not retried)",
                      page, d->ordinal);
    cp_cuda_unrelax(c.relaxed, &c.mode); /* no driver call: the mode back */
    return cp_cuda_leave(d, "cuMemRelease", &c.scope, rc);
  }
  rc = cp_cuda_result(&c, cp_cuda_fn.cuMemRelease((CUmemGenericAllocationHandle)page), CP_ERR_BACKEND,
                      "cuMemRelease(page 0x%" PRIxPTR ") on device %d", page, d->ordinal);
  (void)cp_cuda_leave(d, "cuMemRelease", &c.scope, CP_ERR_BACKEND); /* Note [Context scope] */
  return rc;
}

static int cuda_page_map(void *ctx, uintptr_t addr, size_t size, cp_page_t page) {
  cuda_device_t *d = ctx;
  cuda_call_t c;
  int rc = cp_cuda_begin(d, "cuMemMap", &c);
  if (rc != CP_OK) return rc;
  rc = cp_cuda_result(&c, cp_cuda_fn.cuMemMap((CUdeviceptr)addr, size, 0, (CUmemGenericAllocationHandle)page, 0),
                      CP_ERR_OOM, "cuMemMap(0x%" PRIxPTR ", %zu bytes, offset 0, page 0x%" PRIxPTR ") on device %d",
                      addr, size, page, d->ordinal);
  const int acquired = rc == CP_OK;
  rc = cp_cuda_leave(d, "cuMemMap", &c.scope, rc);
  if (acquired && rc != CP_OK) (void)cp_cuda_fn.cuMemUnmap((CUdeviceptr)addr, size);
  return rc;
}

static int cuda_page_unmap(void *ctx, uintptr_t addr, size_t size) {
  cuda_device_t *d = ctx;
  cuda_call_t c;
  int rc = cp_cuda_begin(d, "cuMemUnmap", &c);
  if (rc != CP_OK) return rc;
  rc = cp_cuda_result(&c, cp_cuda_fn.cuMemUnmap((CUdeviceptr)addr, size), CP_ERR_BACKEND,
                      "cuMemUnmap(0x%" PRIxPTR ", %zu bytes) on device %d", addr, size, d->ordinal);
  (void)cp_cuda_leave(d, "cuMemUnmap", &c.scope, CP_ERR_BACKEND); /* Note [Context scope] */
  return rc;
}

static int cuda_page_set_access(void *ctx, uintptr_t addr, size_t size) {
  cuda_device_t *d = ctx;
  cuda_call_t c;
  int rc = cp_cuda_begin(d, "cuMemSetAccess", &c);
  if (rc != CP_OK) return rc;
  /* The device itself, then its peers (Note [Peers]). */
  CUmemAccessDesc desc[1 + CP_MAX_DEVICES];
  memset(desc, 0, sizeof desc);
  const size_t count = 1 + (size_t)d->peer_count;
  for (size_t i = 0; i < count; i++) {
    desc[i].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc[i].location.id = i == 0 ? d->dev : d->peers[i - 1];
    desc[i].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  rc = cp_cuda_result(&c, cp_cuda_fn.cuMemSetAccess((CUdeviceptr)addr, size, desc, count), CP_ERR_OOM,
                      "cuMemSetAccess(0x%" PRIxPTR ", %zu bytes, read-write for device %d and %d peer%s)", addr, size,
                      d->ordinal, d->peer_count, d->peer_count == 1 ? "" : "s");
  return cp_cuda_leave(d, "cuMemSetAccess", &c.scope, rc);
}

/* ------------------------------------------------------------------------------------------
 * Queries (cuda.h)
 * ---------------------------------------------------------------------------------------- */

int cp_cuda_driver_version(int *out) {
  if (out == NULL) return cp_set_error(CP_ERR_INVALID, "cp_cuda_driver_version: out is NULL");
  int rc = cp_cuda_load();
  if (rc != CP_OK) return rc;
  int version = 0;
  const CUresult r = cp_cuda_fn.cuDriverGetVersion(&version);
  if (r != CUDA_SUCCESS) return cp_cuda_fail(CP_ERR_BACKEND, r, "cuDriverGetVersion");
  *out = version;
  return CP_OK;
}

/* cuda_internal.h */
int cp_cuda_check_ordinal(int device) {
  int count = 0;
  const CUresult r = cp_cuda_fn.cuDeviceGetCount(&count);
  if (r != CUDA_SUCCESS) return cp_cuda_fail(CP_ERR_BACKEND, r, "cuDeviceGetCount");
  if (device < 0 || device >= count)
    return cp_set_error(CP_ERR_INVALID, "cudapool: CUDA device %d does not exist (%d CUDA device%s visible)", device,
                        count, count == 1 ? "" : "s");
  return CP_OK;
}

int cp_cuda_device_count(int *out) {
  if (out == NULL) return cp_set_error(CP_ERR_INVALID, "cp_cuda_device_count: out is NULL");
  int rc = cp_cuda_load();
  if (rc != CP_OK) return rc;
  int count = 0;
  const CUresult r = cp_cuda_fn.cuDeviceGetCount(&count);
  if (r != CUDA_SUCCESS) return cp_cuda_fail(CP_ERR_BACKEND, r, "cuDeviceGetCount");
  *out = count;
  return CP_OK;
}

int cp_cuda_device_name(int device, char *buf, size_t n) {
  if (buf == NULL || n == 0)
    return cp_set_error(CP_ERR_INVALID, "cp_cuda_device_name: %s", buf == NULL ? "buf is NULL" : "n must be > 0");
  int rc = cp_cuda_load();
  if (rc == CP_OK) rc = cp_cuda_check_ordinal(device);
  if (rc != CP_OK) return rc;
  CUdevice dev = 0;
  CUresult r = cp_cuda_fn.cuDeviceGet(&dev, device);
  if (r != CUDA_SUCCESS) return cp_cuda_fail(CP_ERR_BACKEND, r, "cuDeviceGet(%d)", device);
  char name[CUDA_NAME_BYTES];
  r = cp_cuda_fn.cuDeviceGetName(name, (int)sizeof name, dev);
  if (r != CUDA_SUCCESS) return cp_cuda_fail(CP_ERR_BACKEND, r, "cuDeviceGetName(device %d)", device);
  name[sizeof name - 1] = '\0';
  snprintf(buf, n, "%s", name);
  return CP_OK;
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
  if (rc == CP_OK) rc = cp_cuda_check_ordinal(device);
  if (rc != CP_OK) return rc;
  CUdevice dev = 0;
  CUresult r = cp_cuda_fn.cuDeviceGet(&dev, device);
  if (r != CUDA_SUCCESS) return cp_cuda_fail(CP_ERR_BACKEND, r, "cuDeviceGet(%d)", device);
  char text[CUDA_MESSAGE_BYTES];
  const int supported = cp_cuda_vmm_probe(device, dev, text, sizeof text, &r);
  if (supported < 0) return cp_set_error(CP_ERR_BACKEND, "cudapool: %s", text);
  *out_supported = supported;
  if (why_size != 0) snprintf(why, why_size, "%s", text);
  return CP_OK;
}

/* The allocation mapped at `addr` as a POSIX file descriptor (Note [Sharing pages]). */
static int cuda_page_export(void *ctx, uintptr_t addr, int *out_fd) {
  cuda_device_t *d = ctx;
  if (out_fd == NULL) return cp_set_error(CP_ERR_INVALID, "cudapool: cuda page_export: out_fd is NULL");
  cuda_scope_t scope;
  int rc = cp_cuda_enter(d, "cuMemExportToShareableHandle", &scope);
  if (rc != CP_OK) return rc;
  CUmemGenericAllocationHandle handle = 0;
  CUresult r = cp_cuda_fn.cuMemRetainAllocationHandle(&handle, (void *)addr);
  if (r != CUDA_SUCCESS) {
    rc = cp_cuda_fail(CP_ERR_BACKEND, r, "cuMemRetainAllocationHandle(0x%" PRIxPTR ") on device %d", addr, d->ordinal);
  } else {
    int fd = -1;
    r = cp_cuda_fn.cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (r != CUDA_SUCCESS)
      rc = cp_cuda_fail(CP_ERR_BACKEND, r, "cuMemExportToShareableHandle(POSIX file descriptor) on device %d",
                        d->ordinal);
    else
      *out_fd = fd;
    (void)cp_cuda_fn.cuMemRelease(handle); /* the retained reference; the mapping keeps the memory */
  }
  return cp_cuda_leave(d, "cuMemExportToShareableHandle", &scope, rc);
}

static int cuda_page_import(void *ctx, int fd, cp_page_t *out_page) {
  cuda_device_t *d = ctx;
  if (out_page == NULL || fd < 0) return cp_set_error(CP_ERR_INVALID, "cudapool: cuda page_import(fd %d)", fd);
  cuda_call_t c;
  int rc = cp_cuda_begin(d, "cuMemImportFromShareableHandle", &c);
  if (rc != CP_OK) return rc;
  CUmemGenericAllocationHandle handle = 0;
  rc = cp_cuda_result(&c,
                      cp_cuda_fn.cuMemImportFromShareableHandle(&handle, (void *)(intptr_t)fd,
                                                                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                      CP_ERR_OOM, "cuMemImportFromShareableHandle(fd %d) on device %d", fd, d->ordinal);
  const int acquired = rc == CP_OK;
  rc = cp_cuda_leave(d, "cuMemImportFromShareableHandle", &c.scope, rc);
  if (rc == CP_OK && vmm_page_keep(d, handle) != CP_OK)
    rc = cp_set_error(CP_ERR_HOST_OOM, "cudapool: cuda page_import: no host memory to keep the page's handle");
  if (acquired && rc != CP_OK) (void)cp_cuda_fn.cuMemRelease(handle);
  if (rc == CP_OK) *out_page = (cp_page_t)handle;
  return rc;
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
  cuda_device_t *d = out->ctx;
  if (atomic_load_explicit(&d->posix_fd, memory_order_relaxed)) {
    out->page_export = cuda_page_export;
    out->page_import = cuda_page_import;
  }
}
