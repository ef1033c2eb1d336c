/* ipc.h — sharing cudapool's memory with other processes (ipc.c), Note [Handles for torch]. */
#ifndef CPD_IPC_H
#define CPD_IPC_H

#include <stddef.h>

#include "core/cp.h"

/* The bytes of a handle are at most this long (a page-mapped block of many handles is
 * refused past it). */
#define CPD_IPC_HANDLE_MAX 65536

/* The handle of the live allocation at `ptr` (of any device's pool, private pools included)
 * in `buf` (*out_len bytes), and ptr's offset from the memory the handle maps (*out_offset).
 * `version` is the first byte torch writes for its own handles (Note [Handles for torch]). */
int cpd_ipc_share(void *ptr, int version, char *buf, size_t cap, size_t *out_len, size_t *out_offset);

/* 1 when `handle` is of a format cudapool opens (either of Note [Handles for torch]), else 0:
 * cpd_ipc_open refuses it (torch's expandable segments, for one) before any device is used. */
int cpd_ipc_handle_is_ours(const char *handle, size_t len);

/* Map a handle of another process on `device`: *out_ptr is where the memory the handle names
 * starts here (add the sharer's offset), *out_token what cpd_ipc_close takes to unmap it. */
int cpd_ipc_open(const char *handle, size_t len, int device, void **out_ptr, void **out_token);
int cpd_ipc_close(void *token);

#endif /* CPD_IPC_H */
