/* standin_share.c — the stand-in's memory shared between processes: the driver's IPC handles of
 * cuMemAlloc memory, handles exported as POSIX file descriptors and imported, and the handles to
 * one physical allocation counted across processes (Note [Memory shared between processes] and
 * Note [Handles to one physical allocation] in standin_internal.h). */
#define _GNU_SOURCE /* memfd_create */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "standin/standin_internal.h"

/* ------------------------------------------------------------------------------------------
 * Handles to one physical allocation (Note [Handles to one physical allocation])
 * ---------------------------------------------------------------------------------------- */

static int sti_pid_alive(uint32_t pid) { return kill((pid_t)pid, 0) == 0 || errno == EPERM; }

static sti_tail_t *sti_tail_mmap(int fd, size_t size) {
  void *p = mmap(NULL, sizeof(sti_tail_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)size);
  return p == MAP_FAILED ? NULL : p;
}

/* The tail of a memfd whose memory's bytes are the first `size`; NULL when it has none. */
static sti_tail_t *sti_tail_map(int fd, size_t size) {
  sti_tail_t *t = sti_tail_mmap(fd, size);
  if (t == NULL || t->magic == STI_TAIL_MAGIC) return t;
  munmap(t, sizeof(sti_tail_t));
  return NULL;
}

/* One handle more (`delta` 1) or less (-1) of this process to the memory. Only this process
 * writes its slot, under sti.lock; a free slot, or one of an ended process, is taken with a
 * compare-and-swap. 0, or -1 when every slot is taken by a live process. */
static int sti_tail_count(sti_tail_t *t, int delta) {
  const uint64_t me = (uint64_t)(uint32_t)getpid() << 32;
  for (size_t i = 0; i < STI_TAIL_SLOTS; i++) {
    const uint64_t v = atomic_load(&t->slots[i]);
    if ((v & ~(uint64_t)0xffffffffu) != me || v == me) continue;
    const uint64_t n = (v & 0xffffffffu) + (uint64_t)(int64_t)delta;
    atomic_store(&t->slots[i], n == 0 ? 0 : me | n);
    return 0;
  }
  if (delta < 0) return 0;
  for (size_t i = 0; i < STI_TAIL_SLOTS; i++) {
    uint64_t v = atomic_load(&t->slots[i]);
    if ((v == 0 || !sti_pid_alive((uint32_t)(v >> 32))) && atomic_compare_exchange_strong(&t->slots[i], &v, me | 1))
      return 0;
  }
  return -1;
}

/* Whether a handle of a live process holds the memory. */
static int sti_tail_held(const sti_tail_t *t) {
  for (size_t i = 0; i < STI_TAIL_SLOTS; i++) {
    const uint64_t v = atomic_load(&t->slots[i]);
    if ((v & 0xffffffffu) != 0 && sti_pid_alive((uint32_t)(v >> 32))) return 1;
  }
  return 0;
}

void sti_share_sweep(void) {
  for (size_t i = 0; i < sti.lingers_count;) {
    const sti_linger_t *l = &sti.lingers[i];
    if (sti_tail_held(l->tail)) {
      i++;
      continue;
    }
    sti.devices[l->device].used -= l->size;
    munmap(l->tail, sizeof(sti_tail_t));
    sti.lingers[i] = sti.lingers[--sti.lingers_count];
  }
}

int sti_share_drop(sti_handle_t *h) {
  sti_tail_t *t = h->tail;
  h->tail = NULL;
  if (t == NULL) return 0;
  sti_tail_count(t, -1);
  if (!h->imported && sti_tail_held(t) &&
      sti_grow((void **)&sti.lingers, &sti.lingers_cap, sti.lingers_count, sizeof *sti.lingers) == 0) {
    sti.lingers[sti.lingers_count++] = (sti_linger_t){h->device, h->size, t};
    return 1;
  }
  munmap(t, sizeof(sti_tail_t));
  sti_share_sweep();
  return 0;
}

void sti_share_clear(void) {
  for (size_t i = 0; i < sti.handles_count; i++) {
    sti_handle_t *h = &sti.handles[i];
    if (h->tail == NULL) continue;
    sti_tail_count(h->tail, -1); /* this process's handles go, as at its exit */
    munmap(h->tail, sizeof(sti_tail_t));
    h->tail = NULL;
  }
  for (size_t i = 0; i < sti.lingers_count; i++) munmap(sti.lingers[i].tail, sizeof(sti_tail_t));
  free(sti.lingers);
  sti.lingers = NULL;
  sti.lingers_count = sti.lingers_cap = 0;
}

/* ------------------------------------------------------------------------------------------
 * Memory shared between processes (Note [Memory shared between processes])
 * ---------------------------------------------------------------------------------------- */

#define STI_IPC_MAGIC 0x31636970534f5043ull /* "CPOSpic1" */

/* The handle's bytes: what another process needs to take the memfd. */
typedef struct sti_ipc_wire_s {
  uint64_t magic;
  int32_t pid;
  int32_t fd;
  uint64_t size;
} sti_ipc_wire_t;
_Static_assert(sizeof(sti_ipc_wire_t) <= CU_IPC_HANDLE_SIZE, "the wire form fits a CUipcMemHandle");

/* Move `size` bytes at `backing` into a memfd at the same host address; *fd = its descriptor + 1.
 * Only the pages written so far are copied (the rest reads as zero either way). `tail`: room
 * for one (sti_tail_t) after the bytes. 0, or -1. */
static int sti_share_backing(unsigned char *backing, size_t size, int tail, int *fd) {
  if (*fd > 0) return 0;
  const int m = memfd_create("cudapool-standin", MFD_CLOEXEC);
  if (m < 0) return -1;
  if (ftruncate(m, (off_t)(size + (tail ? sizeof(sti_tail_t) : 0))) != 0) {
    close(m);
    return -1;
  }
  static const unsigned char zero[STI_HOST_PAGE_BYTES];
  for (size_t off = 0; off < size; off += STI_HOST_PAGE_BYTES) {
    const size_t n = size - off < STI_HOST_PAGE_BYTES ? size - off : STI_HOST_PAGE_BYTES;
    if (memcmp(backing + off, zero, n) != 0 && pwrite(m, backing + off, n, (off_t)off) != (ssize_t)n) {
      close(m);
      return -1;
    }
  }
  if (mmap(backing, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, m, 0) == MAP_FAILED) {
    close(m);
    return -1;
  }
  *fd = m + 1;
  return 0;
}

/* Descriptor `fd` of process `pid` (pidfd_getfd), or -1. */
static int sti_take_fd(int pid, int fd) {
#if defined(SYS_pidfd_open) && defined(SYS_pidfd_getfd)
  const int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
  if (pidfd < 0) return -1;
  const int got = (int)syscall(SYS_pidfd_getfd, pidfd, fd, 0);
  close(pidfd);
  return got;
#else
  (void)pid, (void)fd;
  errno = ENOSYS;
  return -1;
#endif
}

/* The reference: `ptr` is the base of a cuMemAlloc allocation of this process. */
CUresult cuIpcGetMemHandle(CUipcMemHandle *out, CUdeviceptr ptr) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuIpcGetMemHandle);
  sti_alloc_t *a = r == CUDA_SUCCESS ? sti_alloc_at(ptr, 1) : NULL;
  if (r == CUDA_SUCCESS && (out == NULL || a == NULL || a->addr != ptr || a->opened)) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS && sti_share_backing(a->backing, a->size, 0, &a->fd) != 0) r = CUDA_ERROR_OUT_OF_MEMORY;
  if (r == CUDA_SUCCESS) {
    memset(out, 0, sizeof *out);
    const sti_ipc_wire_t w = {STI_IPC_MAGIC, (int32_t)getpid(), a->fd - 1, a->size};
    memcpy(out->reserved, &w, sizeof w);
  }
  return sti_leave(&c, r);
}

/* The reference: memory of another process, mapped in the current context at a fresh address;
 * a handle of this process itself is refused (CUDA_ERROR_INVALID_CONTEXT). */
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *out, CUipcMemHandle handle, unsigned int flags) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuIpcOpenMemHandle);
  sti_ipc_wire_t w;
  memcpy(&w, handle.reserved, sizeof w);
  int device = 0;
  if (r == CUDA_SUCCESS && (out == NULL || (flags & ~(unsigned)CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) != 0 ||
                            w.magic != STI_IPC_MAGIC || w.size == 0))
    r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS && w.pid == (int32_t)getpid()) r = CUDA_ERROR_INVALID_CONTEXT;
  if (r == CUDA_SUCCESS) r = sti_current_device(&device);
  if (r == CUDA_SUCCESS && STI_ROOM(sti.allocs, sti.allocs_count, sti.allocs_cap, sti_alloc_t) != 0)
    r = CUDA_ERROR_OUT_OF_MEMORY;
  int fd = -1;
  if (r == CUDA_SUCCESS && (fd = sti_take_fd(w.pid, w.fd)) < 0) r = CUDA_ERROR_INVALID_HANDLE;
  unsigned char *backing = NULL;
  if (r == CUDA_SUCCESS) {
    void *p = mmap(NULL, w.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
      r = CUDA_ERROR_OUT_OF_MEMORY;
    else
      backing = p;
  }
  const CUdeviceptr addr = r == CUDA_SUCCESS ? sti_va_take(w.size, STI_ALLOC_ALIGN) : 0;
  if (r == CUDA_SUCCESS && addr == 0) r = CUDA_ERROR_OUT_OF_MEMORY;
  if (r == CUDA_SUCCESS) {
    sti.allocs[sti.allocs_count++] = (sti_alloc_t){addr, w.size, device, 1, backing, fd + 1, 1};
    *out = addr;
  } else {
    if (backing != NULL) munmap(backing, w.size);
    if (fd >= 0) close(fd);
  }
  return sti_leave(&c, r);
}

CUresult cuIpcCloseMemHandle(CUdeviceptr ptr) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuIpcCloseMemHandle);
  sti_alloc_t *a = r == CUDA_SUCCESS ? sti_alloc_at(ptr, 1) : NULL;
  if (r == CUDA_SUCCESS && (a == NULL || a->addr != ptr || !a->opened)) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) {
    sti_drain_device(a->device);
    sti_backing_free(a->backing, a->size, a->fd);
    a->backing = NULL;
    a->fd = 0;
    a->live = 0;
  }
  return sti_leave(&c, r);
}

/* The reference: a POSIX file descriptor (the caller's to close) for memory created with that
 * handle type requested. */
CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle handle, int type,
                                      unsigned long long flags) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuMemExportToShareableHandle);
  sti_handle_t *h = r == CUDA_SUCCESS ? sti_handle_of(handle) : NULL;
  if (r == CUDA_SUCCESS && (out == NULL || h == NULL || !h->holds || flags != 0)) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS && (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || !h->exportable))
    r = CUDA_ERROR_NOT_SUPPORTED;
  if (r == CUDA_SUCCESS && sti_share_backing(h->backing, h->size, 1, &h->fd) != 0) r = CUDA_ERROR_OUT_OF_MEMORY;
  if (r == CUDA_SUCCESS && h->tail == NULL) { /* the first export: the creator's handle counted */
    sti_tail_t *t = sti_tail_mmap(h->fd - 1, h->size);
    if (t != NULL) {
      t->origin_pid = (int32_t)getpid();
      t->origin_device = h->device;
      t->magic = STI_TAIL_MAGIC;
    }
    if (t == NULL || sti_tail_count(t, 1) != 0) {
      if (t != NULL) munmap(t, sizeof(sti_tail_t));
      r = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
      h->tail = t;
    }
  }
  int fd = -1;
  if (r == CUDA_SUCCESS && (fd = fcntl(h->fd - 1, F_DUPFD_CLOEXEC, 0)) < 0) r = CUDA_ERROR_OUT_OF_MEMORY;
  if (r == CUDA_SUCCESS) *(int *)out = fd;
  return sti_leave(&c, r);
}

/* The reference: a new handle to the memory behind a POSIX file descriptor (passed by value in
 * the pointer); the caller keeps its descriptor. No memory is created: the handle names the
 * exporter's, which lives until its last handle is released (Note [Handles to one physical
 * allocation], with what this stand-in assumes where the reference is silent). */
CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *out, void *os_handle, int type) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuMemImportFromShareableHandle);
  const int given = (int)(intptr_t)os_handle;
  int device = 0;
  struct stat st;
  if (r == CUDA_SUCCESS && (out == NULL || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
    r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS && (fstat(given, &st) != 0 || st.st_size <= (off_t)sizeof(sti_tail_t)))
    r = CUDA_ERROR_INVALID_HANDLE;
  const size_t size = r == CUDA_SUCCESS ? (size_t)st.st_size - sizeof(sti_tail_t) : 0;
  sti_tail_t *t = r == CUDA_SUCCESS ? sti_tail_map(given, size) : NULL;
  if (r == CUDA_SUCCESS && (t == NULL || !sti_tail_held(t))) r = CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS && t->origin_pid == (int32_t)getpid() && sti_device_ok(t->origin_device))
    device = t->origin_device;
  else if (r == CUDA_SUCCESS)
    r = sti_current_device(&device);
  if (r == CUDA_SUCCESS && size % sti.devices[device].granularity != 0) r = CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS) r = sti_handle_room();
  const int fd = r == CUDA_SUCCESS ? fcntl(given, F_DUPFD_CLOEXEC, 0) : -1;
  void *p = fd >= 0 ? mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  if (r == CUDA_SUCCESS && (p == MAP_FAILED || sti_tail_count(t, 1) != 0)) r = CUDA_ERROR_OUT_OF_MEMORY;
  if (r == CUDA_SUCCESS) {
    *out = sti_handle_push((sti_handle_t){.size = size,
                                          .device = device,
                                          .holds = 1,
                                          .imported = 1,
                                          .backing = p,
                                          .exportable = 1,
                                          .fd = fd + 1,
                                          .tail = t});
  } else {
    if (p != MAP_FAILED) munmap(p, size);
    if (fd >= 0) close(fd);
    if (t != NULL) munmap(t, sizeof(sti_tail_t));
  }
  return sti_leave(&c, r);
}
