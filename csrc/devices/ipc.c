/* ipc.c — sharing cudapool's memory with other processes: the handles torch's shareIpcHandle
 * returns and getIpcDevPtr opens (Note [Handles for torch]). Owns: the handle formats, the file
 * descriptors kept for receivers, and the mappings of other processes' memory. */
#define _GNU_SOURCE /* syscall numbers of pidfd_open and pidfd_getfd */
#include "devices/ipc.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include "core/share.h"
#include "devices/devices.h"
#include "devices/graphs.h"

/* Note [Handles for torch]
 * torch sends a CUDA tensor to another process as the bytes of its allocator's shareIpcHandle
 * and an offset; the receiver's allocator opens them with getIpcDevPtr. Two formats:
 *  - a plain segment: torch's own, so that a receiver on torch's allocator opens it too: a
 *    version byte (torch's: 2 up to torch 2.12, 3 from 2.13, same payload), 'c', and the 64
 *    bytes of the driver's IPC handle of the segment (cuIpcGetMemHandle); the offset is the
 *    block's in the segment;
 *  - page-mapped memory (the default policy, expandable segments, stitched blocks, regions):
 *    cudapool's, which only a receiver with cudapool enabled opens: the version byte, 'p', then
 *    a header (magic, format, the sender's pid, the number of handles, their span) and, per
 *    physical handle over the block in address order, the number of a POSIX file descriptor of
 *    the sender's and the handle's size (Note [Sharing a block] in core/share.c). The receiver
 *    takes the descriptors from the sender with pidfd_getfd (Linux 5.6; the same permission as
 *    ptrace), imports each (cuMemImportFromShareableHandle), maps them side by side at a fresh
 *    address range and grants its device access; the offset is the block's from the first.
 * The sender keeps the descriptors open while the block is shared (closed once it is freed:
 * torch frees a sent tensor only after every receiver let it go), and the receiver's mappings
 * keep the memory alive whatever the sender's pool does later.
 *
 * Note [Descriptors over a socket]
 * pidfd_getfd needs the permission ptrace needs over the sender, which a child does not have
 * over its parent under Yama's ptrace_scope 1 (the default of several distributions), and
 * which seccomp profiles of containers may deny. So the sender also answers on an abstract Unix
 * socket named after its pid ("cudapool-ipc-<pid>", started with its first page-mapped share,
 * one thread): a peer of the same user (SO_PEERCRED) asks for one descriptor number and gets
 * the descriptor (SCM_RIGHTS), only if it is one the sender keeps for a shared block. The
 * receiver tries pidfd_getfd first, then the socket; CUDAPOOL_IPC_FD=pidfd or =socket forces
 * one of them. */

#define CPD_IPC_MAGIC  0x6c6f6f7061647563ull /* "cudapool" */
#define CPD_IPC_FORMAT 1u

typedef struct cpd_ipc_header_s {
  uint64_t magic;
  uint32_t format;
  int32_t pid;
  uint32_t count;
  uint32_t pad;
  uint64_t span;
} cpd_ipc_header_t;

typedef struct cpd_ipc_entry_s {
  int32_t fd;
  uint32_t pad;
  uint64_t size;
} cpd_ipc_entry_t;

/* Descriptors kept for one shared block. */
typedef struct cpd_kept_s {
  void *ptr;
  int *fds;
  size_t count;
  struct cpd_kept_s *next;
} cpd_kept_t;

typedef struct cpd_opened_s {
  int device;
  int paged;
  uintptr_t addr;
  size_t size;
} cpd_opened_t;

static pthread_mutex_t cpd_ipc_lock = PTHREAD_MUTEX_INITIALIZER;
static cpd_kept_t *cpd_kept;

static void cpd_ipc_server_start(void);

static void cpd_kept_free(cpd_kept_t *k) {
  for (size_t i = 0; i < k->count; i++) close(k->fds[i]);
  free(k->fds);
  free(k);
}

/* Whether `ptr` is still a shared block of some pool (a pool that went is not looked at). */
static int cpd_ipc_still_shared(void *ptr) {
  cp_pool_t *pool;
  if (cpd_owner(ptr, &pool) >= 0) return cp_pool_is_shared(pool, ptr);
  return cpd_graph_pools_exist() && cpd_graph_is_shared(ptr);
}

/* Close the descriptors kept for receivers of blocks no longer shared (each cpd_ipc_share does);
 * at shutdown, all of them. */
static void cpd_ipc_sweep(int all) {
  pthread_mutex_lock(&cpd_ipc_lock);
  for (cpd_kept_t **link = &cpd_kept; *link != NULL;) {
    cpd_kept_t *k = *link;
    if (all || !cpd_ipc_still_shared(k->ptr)) {
      *link = k->next;
      cpd_kept_free(k);
    } else {
      link = &k->next;
    }
  }
  pthread_mutex_unlock(&cpd_ipc_lock);
}

static void cpd_ipc_sweep_all(void) { cpd_ipc_sweep(1); }

static const cpd_table_hooks_t cpd_ipc_hooks = {cpd_ipc_sweep_all, NULL, NULL};
static pthread_once_t cpd_ipc_once = PTHREAD_ONCE_INIT;

/* Before the first descriptor is kept: the device table's shutdown closes them all, through a
 * hook (Note [Hooks of the device table] in devices.h). */
static void cpd_ipc_first_use(void) { cpd_table_hooks_add(&cpd_ipc_hooks); }

/* cp_pool_share on the pool holding live `ptr` (any device's, private pools included), with
 * that pool's device and backend. */
static int cpd_ipc_share_block(void *ptr, cp_share_t *sh, int *out_device, cp_backend_t *out_be) {
  cp_pool_t *pool;
  const int device = cpd_owner(ptr, &pool);
  if (device >= 0) {
    *out_device = device;
    cp_pool_backend(pool, out_be);
    return cp_pool_share(pool, ptr, sh);
  }
  int handled = 0;
  if (ptr != NULL && cpd_graph_pools_exist()) {
    const int rc = cpd_graph_share(ptr, sh, out_device, out_be, &handled);
    if (handled) return rc;
  }
  return cp_set_error(CP_ERR_INVALID, "cudapool: share: %p is not a live allocation of cudapool", ptr);
}

static int cpd_ipc_put(char *buf, size_t cap, size_t *len, const void *bytes, size_t n) {
  if (n > cap - *len) return cp_set_error(CP_ERR_INVALID, "cudapool: share: the handle exceeds %zu bytes", cap);
  memcpy(buf + *len, bytes, n);
  *len += n;
  return CP_OK;
}

static int cpd_ipc_share_paged(const cp_backend_t *be, int device, const cp_share_t *sh, cpd_kept_t *kept, char *buf,
                               size_t cap, size_t *len) {
  if (be->page_export == NULL) {
    return cp_set_error(CP_ERR_INVALID,
                        "cudapool: share: page-mapped memory of device %d cannot be shared with another process: "
                        "the device does not export its memory as POSIX file descriptors "
                        "(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED); allocate tensors to share "
                        "under policy='builtin' (plain segments) instead",
                        device);
  }
  kept->fds = calloc(sh->span_count, sizeof *kept->fds);
  if (kept->fds == NULL) return cp_set_error(CP_ERR_HOST_OOM, "cudapool: share: no host memory");
  const cpd_ipc_header_t h = {CPD_IPC_MAGIC, CPD_IPC_FORMAT, (int32_t)getpid(), (uint32_t)sh->span_count, 0, sh->size};
  int rc = cpd_ipc_put(buf, cap, len, &h, sizeof h);
  for (size_t i = 0; i < sh->span_count && rc == CP_OK; i++) {
    int fd = -1;
    rc = be->page_export(be->ctx, sh->spans[i].addr, &fd);
    if (rc != CP_OK) break;
    kept->fds[kept->count++] = fd;
    const cpd_ipc_entry_t e = {fd, 0, sh->spans[i].size};
    rc = cpd_ipc_put(buf, cap, len, &e, sizeof e);
  }
  return rc;
}

int cpd_ipc_share(void *ptr, int version, char *buf, size_t cap, size_t *out_len, size_t *out_offset) {
  if (buf == NULL || out_len == NULL || out_offset == NULL || cap < 2)
    return cp_set_error(CP_ERR_INVALID, "cudapool: share: NULL argument");
  pthread_once(&cpd_ipc_once, cpd_ipc_first_use);
  cpd_ipc_sweep(0);
  int device = -1;
  cp_backend_t be;
  cp_share_t sh;
  int rc = cpd_ipc_share_block(ptr, &sh, &device, &be);
  if (rc != CP_OK) return rc;
  size_t len = 0;
  buf[len++] = (char)version;
  cpd_kept_t *kept = calloc(1, sizeof *kept);
  if (kept == NULL) rc = cp_set_error(CP_ERR_HOST_OOM, "cudapool: share: no host memory");
  if (rc == CP_OK && !sh.paged) {
    buf[len++] = 'c';
    if (be.ipc_export == NULL) {
      rc = cp_set_error(CP_ERR_INVALID,
                        "cudapool: share: the %s device cannot share memory with another process (no IPC handles)",
                        be.name);
    } else if (cap - len < CP_IPC_HANDLE_BYTES) {
      rc = cp_set_error(CP_ERR_INVALID, "cudapool: share: no room for the handle");
    } else {
      rc = be.ipc_export(be.ctx, sh.base, buf + len);
      len += CP_IPC_HANDLE_BYTES;
    }
  } else if (rc == CP_OK) {
    buf[len++] = 'p';
    rc = cpd_ipc_share_paged(&be, device, &sh, kept, buf, cap, &len);
    if (rc == CP_OK) cpd_ipc_server_start(); /* Note [Descriptors over a socket] */
  }
  if (rc == CP_OK) {
    *out_len = len;
    *out_offset = sh.offset;
    kept->ptr = ptr;
    pthread_mutex_lock(&cpd_ipc_lock);
    kept->next = cpd_kept;
    cpd_kept = kept;
    pthread_mutex_unlock(&cpd_ipc_lock);
  } else if (kept != NULL) {
    cpd_kept_free(kept);
  }
  cp_share_release(&sh);
  return rc;
}

/* The abstract socket of process `pid` (Note [Descriptors over a socket]). */
static socklen_t cpd_ipc_socket_name(int pid, struct sockaddr_un *a) {
  memset(a, 0, sizeof *a);
  a->sun_family = AF_UNIX;
  const int n = snprintf(a->sun_path + 1, sizeof a->sun_path - 1, "cudapool-ipc-%d", pid);
  return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

static int cpd_ipc_is_kept(int fd) {
  int kept = 0;
  pthread_mutex_lock(&cpd_ipc_lock);
  for (const cpd_kept_t *k = cpd_kept; k != NULL && !kept; k = k->next) {
    for (size_t i = 0; i < k->count && !kept; i++) kept = k->fds[i] == fd;
  }
  pthread_mutex_unlock(&cpd_ipc_lock);
  return kept;
}

/* One request: a descriptor number; the answer one byte (1: here it is), with the descriptor. */
static void cpd_ipc_answer(int c) {
  struct ucred cred;
  socklen_t len = sizeof cred;
  int32_t want = -1;
  if (getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.uid != geteuid()) return;
  if (recv(c, &want, sizeof want, MSG_WAITALL) != (ssize_t)sizeof want) return;
  const int ok = want >= 0 && cpd_ipc_is_kept(want);
  char byte = (char)ok;
  struct iovec iov = {&byte, 1};
  union {
    struct cmsghdr h;
    char buf[CMSG_SPACE(sizeof(int))];
  } ctl;
  memset(&ctl, 0, sizeof ctl);
  struct msghdr msg = {0};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (ok) {
    msg.msg_control = ctl.buf;
    msg.msg_controllen = sizeof ctl.buf;
    struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    const int fd = want;
    memcpy(CMSG_DATA(cm), &fd, sizeof fd);
  }
  (void)sendmsg(c, &msg, MSG_NOSIGNAL);
}

static void *cpd_ipc_serve(void *arg) {
  const int lfd = (int)(intptr_t)arg;
  for (;;) {
    const int c = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
    if (c < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      break;
    }
    cpd_ipc_answer(c);
    close(c);
  }
  close(lfd);
  return NULL;
}

static pthread_mutex_t cpd_ipc_server_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_int
    cpd_ipc_server_pid; /* the process whose socket is served; 0: none (a forked child sees its parent's) */

/* Serve this process's socket from now on (best effort: a receiver may still use pidfd_getfd). */
static void cpd_ipc_server_start(void) {
  const int pid = (int)getpid();
  if (atomic_load_explicit(&cpd_ipc_server_pid, memory_order_acquire) == pid) return;
  pthread_mutex_lock(&cpd_ipc_server_lock);
  if (atomic_load_explicit(&cpd_ipc_server_pid, memory_order_relaxed) != pid) {
    struct sockaddr_un a;
    const socklen_t alen = cpd_ipc_socket_name(pid, &a);
    const int lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    pthread_t t;
    pthread_attr_t attr;
    int started = 0;
    if (lfd >= 0 && bind(lfd, (const struct sockaddr *)&a, alen) == 0 && listen(lfd, 16) == 0 &&
        pthread_attr_init(&attr) == 0) {
      (void)pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
      started = pthread_create(&t, &attr, cpd_ipc_serve, (void *)(intptr_t)lfd) == 0;
      (void)pthread_attr_destroy(&attr);
    }
    if (started) {
      atomic_store_explicit(&cpd_ipc_server_pid, pid, memory_order_release);
    } else if (lfd >= 0) {
      close(lfd);
    }
  }
  pthread_mutex_unlock(&cpd_ipc_server_lock);
}

/* Descriptor `fd` of process `pid` through its socket, or -1 (errno set). */
static int cpd_ipc_ask_socket(int pid, int fd) {
  struct sockaddr_un a;
  const socklen_t alen = cpd_ipc_socket_name(pid, &a);
  const int c = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (c < 0) return -1;
  int got = -1;
  const int32_t want = fd;
  if (connect(c, (const struct sockaddr *)&a, alen) == 0 && send(c, &want, sizeof want, MSG_NOSIGNAL) == sizeof want) {
    char byte = 0;
    struct iovec iov = {&byte, 1};
    union {
      struct cmsghdr h;
      char buf[CMSG_SPACE(sizeof(int))];
    } ctl;
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = ctl.buf;
    msg.msg_controllen = sizeof ctl.buf;
    if (recvmsg(c, &msg, MSG_CMSG_CLOEXEC) == 1 && byte == 1) {
      const struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
      if (cm != NULL && cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS)
        memcpy(&got, CMSG_DATA(cm), sizeof got);
    } else {
      errno = EACCES; /* the sender keeps no such descriptor (the tensor was freed), or refused */
    }
  }
  const int e = errno;
  close(c);
  errno = e;
  return got;
}

/* Descriptor `fd` of process `pid` (pidfd_getfd, else its socket), or -1 with the last error set. */
static int cpd_ipc_take_fd(int pid, int fd) {
  const char *how = getenv("CUDAPOOL_IPC_FD");
  const int pidfd_ok = how == NULL || strcmp(how, "socket") != 0;
  const int socket_ok = how == NULL || strcmp(how, "pidfd") != 0;
  int got = -1;
  char tried[256] = "";
#if defined(SYS_pidfd_open) && defined(SYS_pidfd_getfd)
  if (pidfd_ok) {
    const int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
    if (pidfd >= 0) got = (int)syscall(SYS_pidfd_getfd, pidfd, fd, 0);
    snprintf(tried, sizeof tried, "%s: %s", pidfd < 0 ? "pidfd_open" : "pidfd_getfd", strerror(errno));
    if (pidfd >= 0) close(pidfd);
  }
#else
  (void)pidfd_ok;
  snprintf(tried, sizeof tried, "pidfd_getfd: not on this system");
#endif
  if (got < 0 && socket_ok) {
    got = cpd_ipc_ask_socket(pid, fd);
    if (got < 0) {
      const size_t n = strlen(tried);
      snprintf(tried + n, sizeof tried - n, "%ssocket of process %d: %s", n ? "; " : "", pid, strerror(errno));
    }
  }
  if (got < 0) {
    cp_set_error(CP_ERR_BACKEND,
                 "cudapool: open a shared tensor: taking descriptor %d of process %d failed (%s): the sender must "
                 "still hold the tensor, and this process must run as the same user (pidfd_getfd also needs the "
                 "permission ptrace needs; a container's seccomp profile may forbid it)",
                 fd, pid, tried);
  }
  return got;
}

/* Map the handles of a 'p' handle side by side at a fresh address range. */
static int cpd_ipc_open_paged(const cp_backend_t *be, const char *p, size_t len, cpd_opened_t *o) {
  cpd_ipc_header_t h;
  if (len < sizeof h) return cp_set_error(CP_ERR_INVALID, "cudapool: open a shared tensor: a truncated handle");
  memcpy(&h, p, sizeof h);
  if (h.magic != CPD_IPC_MAGIC || h.format != CPD_IPC_FORMAT || h.count == 0 ||
      len != sizeof h + (size_t)h.count * sizeof(cpd_ipc_entry_t))
    return cp_set_error(CP_ERR_INVALID, "cudapool: open a shared tensor: not a handle of this cudapool's format");
  if (be->page_import == NULL || be->va_reserve == NULL)
    return cp_set_error(CP_ERR_INVALID,
                        "cudapool: open a shared tensor of page-mapped memory: device %d cannot import memory from "
                        "POSIX file descriptors",
                        be->device);
  uintptr_t va = 0;
  int rc = be->va_reserve(be->ctx, (size_t)h.span, &va);
  size_t mapped = 0;
  for (uint32_t i = 0; i < h.count && rc == CP_OK; i++) {
    cpd_ipc_entry_t e;
    memcpy(&e, p + sizeof h + i * sizeof e, sizeof e);
    if (e.size == 0 || e.size > h.span - mapped) {
      rc = cp_set_error(CP_ERR_INVALID, "cudapool: open a shared tensor: the handle's sizes do not add up");
      break;
    }
    const int fd = cpd_ipc_take_fd(h.pid, e.fd);
    if (fd < 0) {
      rc = CP_ERR_BACKEND;
      break;
    }
    cp_page_t page = 0;
    rc = be->page_import(be->ctx, fd, &page);
    close(fd);
    if (rc != CP_OK) break;
    rc = be->page_map(be->ctx, va + mapped, (size_t)e.size, page);
    const int rel = be->page_release(be->ctx, page); /* the mapping keeps the memory */
    if (rc == CP_OK) mapped += (size_t)e.size;
    if (rc == CP_OK) rc = rel;
  }
  if (rc == CP_OK && mapped != h.span)
    rc = cp_set_error(CP_ERR_INVALID, "cudapool: open a shared tensor: the handle's sizes do not add up");
  if (rc == CP_OK) rc = be->page_set_access(be->ctx, va, mapped);
  if (rc != CP_OK) {
    char why[1024];
    snprintf(why, sizeof why, "%s", cp_last_error());
    if (mapped != 0) (void)be->page_unmap(be->ctx, va, mapped);
    if (va != 0) (void)be->va_free(be->ctx, va, (size_t)h.span);
    return cp_set_error(rc, "%s", why);
  }
  o->paged = 1;
  o->addr = va;
  o->size = (size_t)h.span;
  return CP_OK;
}

int cpd_ipc_handle_is_ours(const char *handle, size_t len) {
  return handle != NULL && len >= 2 && (handle[1] == 'c' || handle[1] == 'p');
}

int cpd_ipc_open(const char *handle, size_t len, int device, void **out_ptr, void **out_token) {
  if (handle == NULL || out_ptr == NULL || out_token == NULL || len < 2)
    return cp_set_error(CP_ERR_INVALID, "cudapool: open a shared tensor: an empty handle");
  if (!cpd_ipc_handle_is_ours(handle, len)) {
    return cp_set_error(CP_ERR_INVALID,
                        "cudapool: open a shared tensor: a handle of type '%c', which cudapool does not know (torch's "
                        "expandable segments: 'e'; open it with torch's own allocator)",
                        handle[1]);
  }
  cp_pool_t *pool = NULL;
  int rc = cpd_pool(device, &pool);
  if (rc != CP_OK) return rc;
  cp_backend_t be;
  cp_pool_backend(pool, &be);
  cpd_opened_t *o = calloc(1, sizeof *o);
  if (o == NULL) return cp_set_error(CP_ERR_HOST_OOM, "cudapool: open a shared tensor: no host memory");
  o->device = device;
  const char type = handle[1];
  if (type == 'c') {
    if (len != 2 + CP_IPC_HANDLE_BYTES) {
      rc = cp_set_error(CP_ERR_INVALID, "cudapool: open a shared tensor: a handle of %zu bytes, not %d", len,
                        2 + CP_IPC_HANDLE_BYTES);
    } else if (be.ipc_open == NULL) {
      rc = cp_set_error(CP_ERR_INVALID, "cudapool: open a shared tensor: the %s device has no IPC handles", be.name);
    } else {
      rc = be.ipc_open(be.ctx, handle + 2, &o->addr);
    }
  } else {
    rc = cpd_ipc_open_paged(&be, handle + 2, len - 2, o);
  }
  if (rc != CP_OK) {
    free(o);
    return rc;
  }
  *out_ptr = (void *)o->addr;
  *out_token = o;
  return CP_OK;
}

int cpd_ipc_close(void *token) {
  cpd_opened_t *o = token;
  if (o == NULL) return CP_OK;
  cp_pool_t *pool = cpd_pool_if_created(o->device);
  int rc = CP_OK;
  if (pool != NULL) {
    cp_backend_t be;
    cp_pool_backend(pool, &be);
    if (o->paged) {
      rc = be.page_unmap(be.ctx, o->addr, o->size);
      const int rc2 = be.va_free(be.ctx, o->addr, o->size);
      if (rc == CP_OK) rc = rc2;
    } else {
      rc = be.ipc_close(be.ctx, o->addr);
    }
  }
  free(o);
  return rc;
}
