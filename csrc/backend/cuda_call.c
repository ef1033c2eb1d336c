/* cuda_call.c — one driver call of the CUDA backend: its device's context made current and put
 * back (Note [Context scope]), the thread's capture mode relaxed around it, and the message of
 * its failure. */
#include <inttypes.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>

#include "backend/cuda_internal.h"
#include "base/status.h"

/* ------------------------------------------------------------------------------------------
 * Error reporting
 * ---------------------------------------------------------------------------------------- */

/* cuda_internal.h; the bare number also while the naming functions are not resolved yet. */
const char *cp_cuda_why(CUresult result, char *buf, size_t buf_bytes) {
  const char *name = NULL;
  const char *text = NULL;
  if (cp_cuda_fn.cuGetErrorName == NULL || cp_cuda_fn.cuGetErrorName(result, &name) != CUDA_SUCCESS) name = NULL;
  if (cp_cuda_fn.cuGetErrorString == NULL || cp_cuda_fn.cuGetErrorString(result, &text) != CUDA_SUCCESS) text = NULL;
  if (name != NULL && text != NULL)
    snprintf(buf, buf_bytes, "%s (%s)", name, text);
  else if (name != NULL)
    snprintf(buf, buf_bytes, "%s", name);
  else
    snprintf(buf, buf_bytes, "CUDA error %d", (int)result);
  return buf;
}

static int cuda_vfail(int status, CUresult result, const char *fmt, va_list ap) {
  char call[CUDA_MESSAGE_BYTES];
  char why[CUDA_WHY_BYTES];
  vsnprintf(call, sizeof call, fmt, ap);
  return cp_set_error(status, "cudapool: %s failed: %s", call, cp_cuda_why(result, why, sizeof why));
}

/* cuda_internal.h */
int cp_cuda_fail(int status, CUresult result, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  const int rc = cuda_vfail(status, result, fmt, ap);
  va_end(ap);
  return rc;
}

/* ------------------------------------------------------------------------------------------
 * Note [Context scope]
 * The driver works on the calling thread's current context, and PyTorch calls free without
 * setting the device, so every operation makes its device's primary context current and puts
 * the thread's previous context (or none) back before returning; when the right context is
 * already current (the usual case), neither switch happens. Putting the previous context back
 * can only fail when the driver itself is going away. Then an operation that acquired something
 * (reserve, event_create) gives it back and fails; release and event_destroy report their own
 * outcome, since the resource is gone either way and a failure would invite a second release;
 * the rest fail.
 * ---------------------------------------------------------------------------------------- */

/* cuda_internal.h */
int cp_cuda_enter(cuda_device_t *d, const char *call, cuda_scope_t *scope) {
  scope->prev_ctx = NULL;
  scope->switched = 0;
  if (d == NULL) return cp_set_error(CP_ERR_INVALID, "cudapool: %s: no CUDA device", call);
  if (!atomic_load_explicit(&d->live, memory_order_acquire))
    return cp_set_error(CP_ERR_STATE,
                        "cudapool: %s on device %d: the CUDA backend was shut "
                        "down",
                        call, d->ordinal);
  CUcontext current = NULL;
  CUresult r = cp_cuda_fn.cuCtxGetCurrent(&current);
  if (r != CUDA_SUCCESS)
    return cp_cuda_fail(CP_ERR_BACKEND, r, "cuCtxGetCurrent (before %s on device %d)", call, d->ordinal);
  if (current == d->ctx) return CP_OK;
  r = cp_cuda_fn.cuCtxSetCurrent(d->ctx);
  if (r != CUDA_SUCCESS)
    return cp_cuda_fail(CP_ERR_BACKEND, r, "cuCtxSetCurrent(primary context of device %d) before %s", d->ordinal, call);
  scope->prev_ctx = current;
  scope->switched = 1;
  return CP_OK;
}

/* cuda_internal.h */
int cp_cuda_leave(const cuda_device_t *d, const char *call, const cuda_scope_t *scope, int rc) {
  if (!scope->switched) return rc;
  const CUresult r = cp_cuda_fn.cuCtxSetCurrent(scope->prev_ctx);
  if (r == CUDA_SUCCESS || rc != CP_OK) return rc;
  return cp_cuda_fail(CP_ERR_BACKEND, r, "cuCtxSetCurrent(previous context) after %s on device %d", call, d->ordinal);
}

/* cuda_internal.h */
int cp_cuda_begin(cuda_device_t *d, const char *call, cuda_call_t *c) {
  c->relaxed = 0;
  const int rc = cp_cuda_enter(d, call, &c->scope);
  if (rc == CP_OK) c->relaxed = cp_cuda_relax(&c->mode); /* Note [Capture and contexts] */
  return rc;
}

/* cuda_internal.h */
int cp_cuda_result(cuda_call_t *c, CUresult r, int oom_status, const char *fmt, ...) {
  cp_cuda_unrelax(c->relaxed, &c->mode);
  c->relaxed = 0;
  if (r == CUDA_SUCCESS) return CP_OK;
  va_list ap;
  va_start(ap, fmt);
  const int rc = cuda_vfail(r == CUDA_ERROR_OUT_OF_MEMORY ? oom_status : CP_ERR_BACKEND, r, fmt, ap);
  va_end(ap);
  return rc;
}
