/* standin_mem.c — the stand-in's device memory: cuMemAlloc/cuMemFree, the virtual memory calls
 * (address ranges, physical handles, mappings, access), what a launch may touch, and the bytes behind. */
#define _GNU_SOURCE /* MAP_ANONYMOUS, MAP_NORESERVE, memfd_create */
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "standin/standin_internal.h"

#define STI_VA_LIMIT 0x300000000000ull /* device addresses run from sti.next_va's start to here */
#define STI_VA_ALIGN ((CUdeviceptr)2 << 20)

/* Host memory behind `size` device bytes, zero-filled and reserved lazily; NULL when none. */
static unsigned char *sti_backing_new(size_t size) {
  void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  return p == MAP_FAILED ? NULL : p;
}

/* `fd`: the memfd + 1 behind shared bytes (Note [Memory shared between processes]), or 0. */
void sti_backing_free(unsigned char *p, size_t size, int fd) {
  if (p != NULL) munmap(p, size);
  if (fd > 0) close(fd - 1);
}

/* A fresh device address range: never handed out before (so a stale address is never valid
 * again), with an unused gap after it. 0 when the address space is spent. */
CUdeviceptr sti_va_take(size_t size, size_t alignment) {
  if (alignment < STI_VA_ALIGN) alignment = STI_VA_ALIGN;
  const CUdeviceptr start = (sti.next_va + alignment - 1) & ~(CUdeviceptr)(alignment - 1);
  if (size > STI_VA_LIMIT || start > STI_VA_LIMIT - size - STI_VA_ALIGN) return 0;
  sti.next_va = start + size + STI_VA_ALIGN;
  return start;
}

static int sti_fits(const sti_device_t *d, size_t size) { return size <= d->capacity && d->used <= d->capacity - size; }

static int sti_charge(int device, size_t size) {
  sti_device_t *d = &sti.devices[device];
  if (!sti_fits(d, size)) sti_share_sweep();
  if (!sti_fits(d, size)) return -1;
  d->used += size;
  return 0;
}

sti_alloc_t *sti_alloc_at(CUdeviceptr ptr, size_t bytes) {
  for (size_t i = 0; i < sti.allocs_count; i++) {
    sti_alloc_t *a = &sti.allocs[i];
    if (a->live && ptr >= a->addr && ptr - a->addr < a->size && bytes <= a->size - (ptr - a->addr)) return a;
  }
  return NULL;
}

static sti_mapping_t *sti_mapping_at(CUdeviceptr ptr) {
  for (size_t i = 0; i < sti.mappings_count; i++) {
    sti_mapping_t *m = &sti.mappings[i];
    if (m->live && ptr >= m->addr && ptr - m->addr < m->size) return m;
  }
  return NULL;
}

static sti_mapping_t *sti_mapping_starting(CUdeviceptr ptr) {
  for (size_t i = 0; i < sti.mappings_count; i++)
    if (sti.mappings[i].live && sti.mappings[i].addr == ptr) return &sti.mappings[i];
  return NULL;
}

/* Whether [ptr, ptr + size) is exactly a run of whole mappings, none cut and no hole: what
 * cuMemUnmap and cuMemSetAccess take. */
static int sti_whole_mappings(CUdeviceptr ptr, size_t size) {
  if (size == 0 || ptr > ~(CUdeviceptr)0 - size) return 0;
  const CUdeviceptr end = ptr + size;
  for (CUdeviceptr cur = ptr; cur < end;) {
    const sti_mapping_t *m = sti_mapping_starting(cur);
    if (m == NULL || m->size > end - cur) return 0;
    cur += m->size;
  }
  return 1;
}

sti_handle_t *sti_handle_of(CUmemGenericAllocationHandle h) {
  if (h <= STI_TAG_HANDLE || h - STI_TAG_HANDLE > sti.handles_count) return NULL;
  return &sti.handles[h - STI_TAG_HANDLE - 1];
}

/* The handle's bytes go once it is released and mapped nowhere; memory it created leaves the
 * device then too, unless handles elsewhere hold it (Note [Handles to one physical allocation]). */
static void sti_handle_settle(sti_handle_t *h) {
  if (!h->holds || !h->released || h->maps != 0) return;
  sti_backing_free(h->backing, h->size, h->fd);
  h->backing = NULL;
  h->fd = 0;
  h->holds = 0;
  if (!sti_share_drop(h) && !h->imported) sti.devices[h->device].used -= h->size;
}

/* The byte behind device address `ptr`, NULL when nothing is mapped or allocated there. */
static unsigned char *sti_byte_at(CUdeviceptr ptr) {
  const sti_alloc_t *a = sti_alloc_at(ptr, 1);
  if (a != NULL) return a->backing != NULL ? a->backing + (ptr - a->addr) : NULL;
  const sti_mapping_t *m = sti_mapping_at(ptr);
  if (m == NULL) return NULL;
  const sti_handle_t *h = &sti.handles[m->handle - 1];
  return h->backing != NULL ? h->backing + (ptr - m->addr) : NULL;
}

int sti_mem_writable(int device, CUdeviceptr ptr, size_t bytes) {
  if (bytes == 0 || ptr > ~(CUdeviceptr)0 - bytes) return 0;
  const sti_alloc_t *a = sti_alloc_at(ptr, bytes);
  /* cuMemAlloc memory is reachable from its own device only (no cuCtxEnablePeerAccess here). */
  if (a != NULL) return a->device == device;
  const CUdeviceptr end = ptr + bytes;
  for (CUdeviceptr cur = ptr; cur < end;) {
    const sti_mapping_t *m = sti_mapping_at(cur);
    if (m == NULL || !(m->write & (1u << device))) return 0;
    cur = m->addr + m->size;
  }
  return 1;
}

unsigned char *sti_mem_bytes(CUdeviceptr ptr, size_t *out_len) {
  const sti_alloc_t *a = sti_alloc_at(ptr, 1);
  if (a != NULL) {
    *out_len = a->size - (ptr - a->addr);
    return a->backing != NULL ? a->backing + (ptr - a->addr) : NULL;
  }
  const sti_mapping_t *m = sti_mapping_at(ptr);
  if (m == NULL) return NULL;
  const sti_handle_t *h = &sti.handles[m->handle - 1];
  *out_len = m->size - (ptr - m->addr);
  return h->backing != NULL ? h->backing + (ptr - m->addr) : NULL;
}

void sti_mem_touch(CUdeviceptr ptr, size_t bytes, unsigned char value) {
  for (size_t off = 0; off < bytes; off += STI_HOST_PAGE_BYTES) {
    unsigned char *b = sti_byte_at(ptr + off);
    if (b != NULL) *b = value;
  }
  unsigned char *last = sti_byte_at(ptr + bytes - 1);
  if (last != NULL) *last = value;
}

void sti_mem_drop_context(int device) {
  for (size_t i = 0; i < sti.allocs_count; i++) {
    sti_alloc_t *a = &sti.allocs[i];
    if (!a->live || a->device != device) continue;
    if (!a->opened) sti.devices[device].used -= a->size;
    sti_backing_free(a->backing, a->size, a->fd);
    a->backing = NULL;
    a->fd = 0;
    a->live = 0;
  }
}

void sti_mem_clear(void) {
  for (size_t i = 0; i < sti.allocs_count; i++)
    if (sti.allocs[i].live) sti_backing_free(sti.allocs[i].backing, sti.allocs[i].size, sti.allocs[i].fd);
  sti_share_clear();
  for (size_t i = 0; i < sti.handles_count; i++)
    if (sti.handles[i].holds) sti_backing_free(sti.handles[i].backing, sti.handles[i].size, sti.handles[i].fd);
  free(sti.allocs);
  free(sti.reservations);
  free(sti.handles);
  free(sti.mappings);
  sti.allocs = NULL;
  sti.reservations = NULL;
  sti.handles = NULL;
  sti.mappings = NULL;
  sti.allocs_count = sti.allocs_cap = sti.reservations_count = sti.reservations_cap = 0;
  sti.handles_count = sti.handles_cap = sti.mappings_count = sti.mappings_cap = 0;
}

/* ------------------------------------------------------------------------------------------
 * cuMemAlloc, cuMemFree, cuMemGetInfo: memory of the current context's device
 * ---------------------------------------------------------------------------------------- */

CUresult cuMemAlloc_v2(CUdeviceptr *out, size_t size) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuMemAlloc);
  int device = 0;
  if (r == CUDA_SUCCESS && (out == NULL || size == 0)) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) r = sti_current_device(&device);
  if (r == CUDA_SUCCESS && STI_ROOM(sti.allocs, sti.allocs_count, sti.allocs_cap, sti_alloc_t) != 0)
    r = CUDA_ERROR_OUT_OF_MEMORY;
  if (r == CUDA_SUCCESS && sti_charge(device, size) != 0) r = CUDA_ERROR_OUT_OF_MEMORY;
  if (r == CUDA_SUCCESS) {
    const CUdeviceptr addr = sti_va_take(size, STI_ALLOC_ALIGN);
    unsigned char *backing = addr != 0 ? sti_backing_new(size) : NULL;
    if (backing == NULL) {
      sti.devices[device].used -= size;
      r = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
      sti.allocs[sti.allocs_count++] = (sti_alloc_t){addr, size, device, 1, backing, 0, 0};
      *out = addr;
    }
  }
  return sti_leave(&c, r);
}

/* The reference: cuMemFree synchronizes (this stand-in: all work of the memory's device
 * completes first). `ptr` must be what cuMemAlloc returned. */
CUresult cuMemFree_v2(CUdeviceptr ptr) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuMemFree);
  int device = 0;
  if (r == CUDA_SUCCESS) r = sti_current_device(&device);
  sti_alloc_t *a = NULL;
  if (r == CUDA_SUCCESS) {
    a = sti_alloc_at(ptr, 1);
    if (a == NULL || a->addr != ptr || a->opened) r = CUDA_ERROR_INVALID_VALUE;
  }
  if (r == CUDA_SUCCESS) {
    sti_drain_device(a->device);
    sti.devices[a->device].used -= a->size;
    sti_backing_free(a->backing, a->size, a->fd);
    a->backing = NULL;
    a->fd = 0;
    a->live = 0;
  }
  return sti_leave(&c, r);
}

CUresult cuMemGetInfo_v2(size_t *out_free, size_t *out_total) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuMemGetInfo);
  int device = 0;
  if (r == CUDA_SUCCESS && (out_free == NULL || out_total == NULL)) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) r = sti_current_device(&device);
  if (r == CUDA_SUCCESS) {
    sti_share_sweep();
    const sti_device_t *d = &sti.devices[device];
    *out_free = d->used < d->capacity ? d->capacity - d->used : 0;
    *out_total = d->capacity;
  }
  return sti_leave(&c, r);
}

/* ------------------------------------------------------------------------------------------
 * Virtual memory management. These calls take their device from their arguments (an
 * allocation's properties, an access descriptor), not from the current context.
 * ---------------------------------------------------------------------------------------- */

/* Pinned device memory on a device that has virtual memory management, with no export handle
 * but a POSIX file descriptor, and Windows data zero; the RDMA flag only on a device that
 * reports CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED (the reference gives no
 * error code for it; this stand-in answers CUDA_ERROR_INVALID_VALUE). */
static CUresult sti_check_prop(const CUmemAllocationProp *prop) {
  if (prop == NULL || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED) return CUDA_ERROR_INVALID_VALUE;
  if (prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE) return CUDA_ERROR_INVALID_VALUE;
  if (!sti_device_ok(prop->location.id)) return CUDA_ERROR_INVALID_DEVICE;
  const sti_device_t *d = &sti.devices[prop->location.id];
  if (!d->vmm) return CUDA_ERROR_NOT_SUPPORTED;
  if (prop->requestedHandleTypes != CU_MEM_HANDLE_TYPE_NONE &&
      prop->requestedHandleTypes != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    return CUDA_ERROR_INVALID_VALUE;
  if (prop->win32HandleMetaData != NULL) return CUDA_ERROR_INVALID_VALUE;
  if (prop->allocFlags.gpuDirectRDMACapable && !d->rdma) return CUDA_ERROR_INVALID_VALUE;
  return CUDA_SUCCESS;
}

CUresult cuMemGetAllocationGranularity(size_t *out, const CUmemAllocationProp *prop, int option) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuMemGetAllocationGranularity);
  if (r == CUDA_SUCCESS && out == NULL) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS && option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
    r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) r = sti_check_prop(prop);
  if (r == CUDA_SUCCESS) *out = sti.devices[prop->location.id].granularity;
  return sti_leave(&c, r);
}

/* The reference: size and hint multiples of the host page size, the alignment a power of two
 * or 0, flags 0; the hint may be ignored, and is. */
CUresult cuMemAddressReserve(CUdeviceptr *out, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuMemAddressReserve);
  if (r == CUDA_SUCCESS && (out == NULL || size == 0 || size % STI_HOST_PAGE_BYTES != 0 ||
                            addr % STI_HOST_PAGE_BYTES != 0 || (alignment & (alignment - 1)) != 0 || flags != 0))
    r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS &&
      STI_ROOM(sti.reservations, sti.reservations_count, sti.reservations_cap, sti_reservation_t) != 0)
    r = CUDA_ERROR_OUT_OF_MEMORY;
  if (r == CUDA_SUCCESS) {
    const CUdeviceptr start = sti_va_take(size, alignment);
    if (start == 0) {
      r = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
      sti.reservations[sti.reservations_count++] = (sti_reservation_t){start, size, 1};
      *out = start;
    }
  }
  return sti_leave(&c, r);
}

/* The reference: `ptr` and `size` exactly as reserved. And nothing may be mapped in it. */
CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuMemAddressFree);
  sti_reservation_t *res = NULL;
  for (size_t i = 0; r == CUDA_SUCCESS && i < sti.reservations_count; i++)
    if (sti.reservations[i].live && sti.reservations[i].addr == ptr) res = &sti.reservations[i];
  if (r == CUDA_SUCCESS && (res == NULL || res->size != size)) r = CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 0; r == CUDA_SUCCESS && i < sti.mappings_count; i++) {
    const sti_mapping_t *m = &sti.mappings[i];
    if (m->live && m->addr >= ptr && m->addr - ptr < size) r = CUDA_ERROR_INVALID_VALUE;
  }
  if (r == CUDA_SUCCESS) res->live = 0;
  return sti_leave(&c, r);
}

/* Room for one more handle (cuMemCreate, cuMemImportFromShareableHandle); sti_handle_push then
 * adds it and gives its number. */
CUresult sti_handle_room(void) {
  if (sti_grow((void **)&sti.handles, &sti.handles_cap, sti.handles_count, sizeof *sti.handles) != 0 ||
      sti.handles_count + 1 >= STI_TAG_SPAN)
    return CUDA_ERROR_OUT_OF_MEMORY;
  return CUDA_SUCCESS;
}

CUmemGenericAllocationHandle sti_handle_push(sti_handle_t h) {
  sti.handles[sti.handles_count++] = h;
  return STI_TAG_HANDLE + sti.handles_count;
}

/* The reference: size a multiple of the minimum granularity, flags 0. */
CUresult cuMemCreate(CUmemGenericAllocationHandle *out, size_t size, const CUmemAllocationProp *prop,
                     unsigned long long flags) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuMemCreate);
  if (r == CUDA_SUCCESS && (out == NULL || flags != 0)) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) r = sti_check_prop(prop);
  if (r == CUDA_SUCCESS && (size == 0 || size % sti.devices[prop->location.id].granularity != 0))
    r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) r = sti_handle_room();
  if (r == CUDA_SUCCESS && sti_charge(prop->location.id, size) != 0) r = CUDA_ERROR_OUT_OF_MEMORY;
  if (r == CUDA_SUCCESS) {
    unsigned char *backing = sti_backing_new(size);
    if (backing == NULL) {
      sti.devices[prop->location.id].used -= size;
      r = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
      *out = sti_handle_push(
          (sti_handle_t){.size = size,
                         .device = prop->location.id,
                         .rdma = prop->allocFlags.gpuDirectRDMACapable != 0,
                         .holds = 1,
                         .backing = backing,
                         .exportable = prop->requestedHandleTypes == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR});
    }
  }
  return sti_leave(&c, r);
}

/* The reference: the memory goes once the handle is released and every mapping of it is
 * unmapped; releasing a handle that is not valid (already released) is undefined: this
 * stand-in refuses it and records a misuse. */
CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuMemRelease);
  sti_handle_t *h = r == CUDA_SUCCESS ? sti_handle_of(handle) : NULL;
  if (r == CUDA_SUCCESS && (h == NULL || (h->released && h->retains == 0))) {
    sti_fault(CPSTANDIN_FAULT_MISUSE, "misuse: cuMemRelease(0x%llx) of a handle that is %s", handle,
              h == NULL ? "not valid" : "released already");
    r = CUDA_ERROR_INVALID_VALUE;
  }
  if (r == CUDA_SUCCESS && h->retains > 0) {
    h->retains--; /* a reference of cuMemRetainAllocationHandle */
  } else if (r == CUDA_SUCCESS) {
    h->released = 1;
    sti_handle_settle(h);
  }
  return sti_leave(&c, r);
}

/* The reference: offset 0 (for now), flags 0, address and size granularity multiples, inside
 * one reservation, on addresses not mapped yet. This stand-in also wants the whole handle
 * mapped (size equal to the handle's), as cudapool's contract says. */
CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuMemMap);
  sti_handle_t *h = r == CUDA_SUCCESS ? sti_handle_of(handle) : NULL;
  if (r == CUDA_SUCCESS && (h == NULL || h->released || offset != 0 || flags != 0 || size != h->size))
    r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS && (ptr % sti.devices[h->device].granularity != 0 || ptr > ~(CUdeviceptr)0 - size))
    r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) {
    int inside = 0;
    for (size_t i = 0; i < sti.reservations_count && !inside; i++) {
      const sti_reservation_t *res = &sti.reservations[i];
      inside = res->live && ptr >= res->addr && ptr - res->addr <= res->size && size <= res->size - (ptr - res->addr);
    }
    if (!inside) r = CUDA_ERROR_INVALID_VALUE;
  }
  for (size_t i = 0; r == CUDA_SUCCESS && i < sti.mappings_count; i++) {
    const sti_mapping_t *m = &sti.mappings[i];
    if (m->live && m->addr < ptr + size && ptr < m->addr + m->size) r = CUDA_ERROR_INVALID_VALUE; /* mapped already */
  }
  if (r == CUDA_SUCCESS && STI_ROOM(sti.mappings, sti.mappings_count, sti.mappings_cap, sti_mapping_t) != 0)
    r = CUDA_ERROR_OUT_OF_MEMORY;
  if (r == CUDA_SUCCESS) {
    const uint32_t id = (uint32_t)(handle - STI_TAG_HANDLE);
    sti.mappings[sti.mappings_count++] = (sti_mapping_t){ptr, size, id, 0, 0, 1}; /* no access yet */
    h->maps++;
  }
  return sti_leave(&c, r);
}

/* The reference: whole mappings only. Unmapping memory that incomplete work still touches is
 * a device fault here (the GPU would touch memory that is gone). */
CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuMemUnmap);
  if (r == CUDA_SUCCESS && !sti_whole_mappings(ptr, size)) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) {
    uint32_t stream = 0;
    if (sti_in_use(ptr, size, &stream))
      sti_fault(CPSTANDIN_FAULT_IN_USE,
                "device fault: cuMemUnmap(0x%llx, %zu bytes) while work queued on stream 0x%llx still touches it", ptr,
                size, (unsigned long long)sti_stream_handle(stream));
    for (CUdeviceptr cur = ptr; cur < ptr + size;) {
      sti_mapping_t *m = sti_mapping_starting(cur);
      m->live = 0;
      cur += m->size;
      sti_handle_t *h = &sti.handles[m->handle - 1];
      h->maps--;
      sti_handle_settle(h);
    }
  }
  return sti_leave(&c, r);
}

/* The reference: the range fully mapped, each descriptor a device location with a known
 * protection. A device other than the memory's owner gets access only if it can reach the
 * owner (cuDeviceCanAccessPeer), else CUDA_ERROR_INVALID_DEVICE. All or nothing. */
CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuMemSetAccess);
  if (r == CUDA_SUCCESS && (desc == NULL || count == 0)) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS && !sti_whole_mappings(ptr, size)) r = CUDA_ERROR_INVALID_VALUE;
  for (size_t k = 0; r == CUDA_SUCCESS && k < count; k++) {
    const int f = desc[k].flags;
    if (desc[k].location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
        (f != CU_MEM_ACCESS_FLAGS_PROT_NONE && f != CU_MEM_ACCESS_FLAGS_PROT_READ &&
         f != CU_MEM_ACCESS_FLAGS_PROT_READWRITE))
      r = CUDA_ERROR_INVALID_VALUE;
    else if (!sti_device_ok(desc[k].location.id))
      r = CUDA_ERROR_INVALID_DEVICE;
    for (CUdeviceptr cur = ptr; r == CUDA_SUCCESS && cur < ptr + size;) {
      const sti_mapping_t *m = sti_mapping_starting(cur);
      const int owner = sti.handles[m->handle - 1].device, who = desc[k].location.id;
      if (who != owner && !sti.peer[who][owner]) r = CUDA_ERROR_INVALID_DEVICE;
      cur += m->size;
    }
  }
  for (size_t k = 0; r == CUDA_SUCCESS && k < count; k++) {
    const uint32_t bit = 1u << desc[k].location.id;
    for (CUdeviceptr cur = ptr; cur < ptr + size;) {
      sti_mapping_t *m = sti_mapping_starting(cur);
      m->read = desc[k].flags & CU_MEM_ACCESS_FLAGS_PROT_READ ? m->read | bit : m->read & ~bit;
      m->write = desc[k].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE ? m->write | bit : m->write & ~bit;
      cur += m->size;
    }
  }
  return sti_leave(&c, r);
}

/* ------------------------------------------------------------------------------------------
 * Control API (standin.h)
 * ---------------------------------------------------------------------------------------- */

STI_EXPORT int cpstandin_handle_info(unsigned long long handle, cpstandin_handle_info_t *out) {
  sti_lock();
  const sti_handle_t *h = sti_handle_of(handle);
  if (h != NULL && out != NULL)
    *out = (cpstandin_handle_info_t){h->size, h->device, h->rdma, h->released, h->maps, h->holds};
  pthread_mutex_unlock(&sti.lock);
  return h != NULL && out != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

STI_EXPORT int cpstandin_access(unsigned long long ptr, int device) {
  sti_lock();
  int access = -1;
  const sti_alloc_t *a = sti_alloc_at(ptr, 1);
  const sti_mapping_t *m = a == NULL ? sti_mapping_at(ptr) : NULL;
  if (a != NULL) {
    access = a->device == device ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_NONE;
  } else if (m != NULL && device >= 0 && device < STI_MAX_DEVICES) {
    const uint32_t bit = 1u << device;
    access = m->write & bit  ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE
             : m->read & bit ? CU_MEM_ACCESS_FLAGS_PROT_READ
                             : CU_MEM_ACCESS_FLAGS_PROT_NONE;
  }
  pthread_mutex_unlock(&sti.lock);
  return access;
}

STI_EXPORT int cpstandin_peek(unsigned long long ptr, unsigned char *out) {
  sti_lock();
  const unsigned char *b = sti_byte_at(ptr);
  if (b != NULL && out != NULL) *out = *b;
  pthread_mutex_unlock(&sti.lock);
  return b != NULL && out != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* The reference: the handle of the memory mapped at `addr`, one more reference to release. */
CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *out, void *addr) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuMemRetainAllocationHandle);
  const sti_mapping_t *m = r == CUDA_SUCCESS ? sti_mapping_at((CUdeviceptr)(uintptr_t)addr) : NULL;
  if (r == CUDA_SUCCESS && (out == NULL || m == NULL)) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) {
    sti.handles[m->handle - 1].retains++;
    *out = STI_TAG_HANDLE + m->handle;
  }
  return sti_leave(&c, r);
}
