/* cuda_ipc.c — the CUDA backend's IPC handles of plain segments (Note [Sharing between processes]
 * in base/backend.h): cuIpcGetMemHandle, cuIpcOpenMemHandle, cuIpcCloseMemHandle, each in the
 * device's primary context (Note [Context scope] in cuda_call.c). */
#include <inttypes.h>
#include <string.h>

#include "backend/cuda_internal.h"

_Static_assert(sizeof(CUipcMemHandle) == CP_IPC_HANDLE_BYTES, "a CUDA IPC handle is CP_IPC_HANDLE_BYTES bytes");

static int cuda_ipc_export(void *ctx, uintptr_t addr, void *out_handle) {
  cuda_device_t *d = ctx;
  if (out_handle == NULL) return cp_set_error(CP_ERR_INVALID, "cudapool: cuda ipc_export: out_handle is NULL");
  cuda_scope_t scope;
  int rc = cp_cuda_enter(d, "cuIpcGetMemHandle", &scope);
  if (rc != CP_OK) return rc;
  CUipcMemHandle h;
  const CUresult r = cp_cuda_fn.cuIpcGetMemHandle(&h, (CUdeviceptr)addr);
  if (r != CUDA_SUCCESS)
    rc = cp_cuda_fail(CP_ERR_BACKEND, r, "cuIpcGetMemHandle(0x%" PRIxPTR ") on device %d", addr, d->ordinal);
  else
    memcpy(out_handle, h.reserved, sizeof h.reserved);
  return cp_cuda_leave(d, "cuIpcGetMemHandle", &scope, rc);
}

static int cuda_ipc_open(void *ctx, const void *handle, uintptr_t *out_addr) {
  cuda_device_t *d = ctx;
  if (handle == NULL || out_addr == NULL) return cp_set_error(CP_ERR_INVALID, "cudapool: cuda ipc_open: NULL argument");
  cuda_call_t c;
  int rc = cp_cuda_begin(d, "cuIpcOpenMemHandle", &c);
  if (rc != CP_OK) return rc;
  CUipcMemHandle h;
  memcpy(h.reserved, handle, sizeof h.reserved);
  CUdeviceptr p = 0;
  rc = cp_cuda_result(&c, cp_cuda_fn.cuIpcOpenMemHandle(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), CP_ERR_OOM,
                      "cuIpcOpenMemHandle on device %d", d->ordinal);
  const int acquired = rc == CP_OK;
  rc = cp_cuda_leave(d, "cuIpcOpenMemHandle", &c.scope, rc);
  if (rc == CP_OK) {
    *out_addr = (uintptr_t)p;
  } else if (acquired) {
    (void)cp_cuda_fn.cuIpcCloseMemHandle(p);
  }
  return rc;
}

static int cuda_ipc_close(void *ctx, uintptr_t addr) {
  cuda_device_t *d = ctx;
  cuda_call_t c;
  int rc = cp_cuda_begin(d, "cuIpcCloseMemHandle", &c);
  if (rc != CP_OK) return rc;
  rc = cp_cuda_result(&c, cp_cuda_fn.cuIpcCloseMemHandle((CUdeviceptr)addr), CP_ERR_BACKEND,
                      "cuIpcCloseMemHandle(0x%" PRIxPTR ") on device %d", addr, d->ordinal);
  return cp_cuda_leave(d, "cuIpcCloseMemHandle", &c.scope, rc);
}

void cp_cuda_ipc_table(cp_backend_t *out) {
  if (cp_cuda_fn.cuIpcGetMemHandle == NULL || cp_cuda_fn.cuIpcOpenMemHandle == NULL ||
      cp_cuda_fn.cuIpcCloseMemHandle == NULL)
    return;
  out->ipc_export = cuda_ipc_export;
  out->ipc_open = cuda_ipc_open;
  out->ipc_close = cuda_ipc_close;
}
