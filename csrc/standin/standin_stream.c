/* standin_stream.c — the stand-in's streams, events and stream capture: queued work and when it
 * completes (Note [Asynchrony]), the capture prohibition, and the control calls that drive them. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "standin/standin_internal.h"

/* Note [Asynchrony]
 * A stream is a queue of items in submission order: launches (cpstandin_launch) and markers
 * (cuEventRecord). Every item carries a ticket from one process-wide counter. An item can
 * complete only after the items before it on its stream and, following the reference's
 * default-stream rules, after what it implicitly waits for: an item on the legacy stream waits
 * for every earlier item of the context's blocking streams (those not created with
 * CU_STREAM_NON_BLOCKING, the per-thread default stream included), and an item on a blocking
 * stream waits for every earlier item of the legacy stream. Launches complete only when told
 * (cpstandin_complete, complete_all) or when a synchronizing call drains them; a marker
 * completes by itself as soon as it can, so an event recorded on idle streams is done at once.
 * An event is complete when its marker is, or when it was never recorded. */

uintptr_t sti_stream_handle(uint32_t id) { return STI_TAG_STREAM + id; }

static sti_stream_t *sti_stream(uint32_t id) { return &sti.streams[id - 1]; }

static int sti_blocking(const sti_stream_t *s) {
  return s->kind != STI_STREAM_IS_LEGACY && !(s->flags & CU_STREAM_NON_BLOCKING);
}

static uint32_t sti_stream_new(int device, int kind, unsigned flags) {
  if (sti_grow((void **)&sti.streams, &sti.streams_cap, sti.streams_count, sizeof *sti.streams) != 0) return 0;
  if (sti.streams_count + 1 >= STI_TAG_SPAN) return 0;
  sti_stream_t *s = &sti.streams[sti.streams_count++];
  memset(s, 0, sizeof *s);
  s->device = device;
  s->kind = kind;
  s->flags = flags;
  s->live = 1;
  return (uint32_t)sti.streams_count;
}

int sti_stream_activate(int device) {
  const uint32_t legacy = sti_stream_new(device, STI_STREAM_IS_LEGACY, 0);
  const uint32_t per_thread = legacy != 0 ? sti_stream_new(device, STI_STREAM_IS_PER_THREAD, 0) : 0;
  if (per_thread == 0) return -1;
  sti.devices[device].legacy = legacy;
  sti.devices[device].per_thread = per_thread;
  return 0;
}

void sti_stream_drop_context(int device) {
  for (size_t i = 0; i < sti.streams_count; i++) {
    sti_stream_t *s = &sti.streams[i];
    if (s->device != device) continue;
    s->live = 0;
    s->capture = CU_STREAM_CAPTURE_STATUS_NONE;
    s->head = s->count = 0; /* the context's work is gone with it */
  }
  for (size_t i = 0; i < sti.events_count; i++)
    if (sti.events[i].device == device) sti.events[i].live = 0;
  sti.devices[device].legacy = sti.devices[device].per_thread = 0;
}

void sti_stream_clear(void) {
  for (size_t i = 0; i < sti.streams_count; i++) free(sti.streams[i].items);
  free(sti.streams);
  free(sti.events);
  sti.streams = NULL;
  sti.events = NULL;
  sti.streams_count = sti.streams_cap = sti.events_count = sti.events_cap = 0;
}

/* A handle as the API takes it: 0 and CU_STREAM_LEGACY name the current context's legacy
 * stream, CU_STREAM_PER_THREAD its per-thread stream (one per context here), anything else a
 * created stream that was not destroyed. */
static CUresult sti_stream_resolve(uintptr_t handle, uint32_t *out_id) {
  if (handle == 0 || handle == STI_STREAM_LEGACY || handle == STI_STREAM_PER_THREAD) {
    int device = 0;
    const CUresult r = sti_current_device(&device);
    if (r != CUDA_SUCCESS) return r;
    *out_id = handle == STI_STREAM_PER_THREAD ? sti.devices[device].per_thread : sti.devices[device].legacy;
    return CUDA_SUCCESS;
  }
  if (handle <= STI_TAG_STREAM || handle - STI_TAG_STREAM > sti.streams_count) return CUDA_ERROR_INVALID_HANDLE;
  const uint32_t id = (uint32_t)(handle - STI_TAG_STREAM);
  const sti_stream_t *s = sti_stream(id);
  if (!s->live || s->kind != STI_STREAM_USER) return CUDA_ERROR_INVALID_HANDLE;
  *out_id = id;
  return CUDA_SUCCESS;
}

static void sti_stream_name(uint32_t id, char *buf, size_t n) {
  const sti_stream_t *s = sti_stream(id);
  if (s->kind == STI_STREAM_IS_LEGACY)
    snprintf(buf, n, "the legacy stream of device %d", s->device);
  else if (s->kind == STI_STREAM_IS_PER_THREAD)
    snprintf(buf, n, "the per-thread stream of device %d", s->device);
  else
    snprintf(buf, n, "stream 0x%llx of device %d", (unsigned long long)sti_stream_handle(id), s->device);
}

static int sti_push(uint32_t id, int kind, CUdeviceptr addr, size_t bytes, uint64_t *out_ticket) {
  sti_stream_t *s = sti_stream(id);
  if (s->head + s->count == s->cap) {
    if (s->head > 0) {
      memmove(s->items, s->items + s->head, s->count * sizeof *s->items);
      s->head = 0;
    } else if (sti_grow((void **)&s->items, &s->cap, s->count, sizeof *s->items) != 0) {
      return -1;
    }
  }
  const uint64_t ticket = sti.next_ticket++;
  s->items[s->head + s->count++] = (sti_item_t){ticket, kind, addr, bytes};
  if (out_ticket != NULL) *out_ticket = ticket;
  return 0;
}

static void sti_complete_before(uint32_t id, uint64_t ticket);

/* Complete what the item of `ticket` on stream `id` implicitly waits for (Note [Asynchrony]). */
static void sti_complete_waited(uint32_t id, uint64_t ticket) {
  const sti_stream_t *s = sti_stream(id);
  const int device = s->device;
  if (s->kind == STI_STREAM_IS_LEGACY) {
    for (uint32_t o = 1; o <= sti.streams_count; o++)
      if (o != id && sti_stream(o)->device == device && sti_blocking(sti_stream(o))) sti_complete_before(o, ticket);
  } else if (sti_blocking(s) && sti.devices[device].legacy != 0) {
    sti_complete_before(sti.devices[device].legacy, ticket);
  }
}

/* Complete every item of stream `id` whose ticket is below `ticket`, in order. */
static void sti_complete_before(uint32_t id, uint64_t ticket) {
  for (;;) {
    sti_stream_t *s = sti_stream(id);
    if (s->count == 0 || s->items[s->head].ticket >= ticket) return;
    const uint64_t t = s->items[s->head].ticket;
    sti_complete_waited(id, t); /* never reaches this stream's items at or above t */
    s = sti_stream(id);
    s->head++;
    s->count--;
    if (s->count == 0) s->head = 0;
    s->done = t;
  }
}

/* Whether everything the item of `ticket` on stream `id` waits for, apart from its own
 * stream's earlier items, is complete. */
static int sti_waited_done(uint32_t id, uint64_t ticket) {
  const sti_stream_t *s = sti_stream(id);
  for (uint32_t o = 1; o <= sti.streams_count; o++) {
    const sti_stream_t *other = sti_stream(o);
    if (o == id || other->device != s->device || other->count == 0) continue;
    const int waits =
        s->kind == STI_STREAM_IS_LEGACY ? sti_blocking(other) : sti_blocking(s) && other->kind == STI_STREAM_IS_LEGACY;
    if (waits && other->items[other->head].ticket < ticket) return 0;
  }
  return 1;
}

/* Markers at the front of their queues complete as soon as what they wait for has. */
static void sti_settle(void) {
  for (int changed = 1; changed;) {
    changed = 0;
    for (uint32_t id = 1; id <= sti.streams_count; id++) {
      sti_stream_t *s = sti_stream(id);
      while (s->count > 0 && s->items[s->head].kind == STI_ITEM_MARKER &&
             sti_waited_done(id, s->items[s->head].ticket)) {
        s->done = s->items[s->head].ticket;
        s->head++;
        s->count--;
        changed = 1;
      }
      if (s->count == 0) s->head = 0;
    }
  }
}

void sti_drain_device(int device) {
  for (uint32_t id = 1; id <= sti.streams_count; id++)
    if (sti_stream(id)->device == device) sti_complete_before(id, UINT64_MAX);
  sti_settle();
}

int sti_in_use(CUdeviceptr ptr, size_t size, uint32_t *out_stream) {
  for (uint32_t id = 1; id <= sti.streams_count; id++) {
    const sti_stream_t *s = sti_stream(id);
    for (size_t k = 0; k < s->count; k++) {
      const sti_item_t *it = &s->items[s->head + k];
      if (it->kind == STI_ITEM_LAUNCH && it->addr < ptr + size && ptr < it->addr + it->bytes) {
        *out_stream = id;
        return 1;
      }
    }
  }
  return 0;
}

/* ------------------------------------------------------------------------------------------
 * Note [Capture prohibition]
 * The reference (cuThreadExchangeStreamCaptureMode): a thread in the global mode may not make
 * potentially unsafe calls while it has a capture of its own not begun in the relaxed mode, or
 * while any thread has one begun in the global mode; a thread in the thread-local mode only in
 * the first case; a thread in the relaxed mode is never prohibited. Such a call fails with
 * CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates the captures that prohibited it. The
 * legacy stream cannot be used while a blocking stream of its context captures (the reference:
 * CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, the capture invalidated), though cuStreamIsCapturing may
 * ask about it (then the capture is left alone). Each of these is recorded as a fault.
 * ---------------------------------------------------------------------------------------- */

static void sti_invalidate(uint32_t id, const char *why) {
  char name[96];
  sti_stream_name(id, name, sizeof name);
  sti_stream(id)->capture = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
  sti_fault(CPSTANDIN_FAULT_CAPTURE, "capture on %s invalidated: %s", name, why);
}

CUresult sti_capture_check(sti_fn_t fn) {
  if (sti_mode == CU_STREAM_CAPTURE_MODE_RELAXED) return CUDA_SUCCESS;
  int prohibited = 0;
  for (uint32_t id = 1; id <= sti.streams_count; id++) {
    const sti_stream_t *s = sti_stream(id);
    if (s->capture == CU_STREAM_CAPTURE_STATUS_NONE) continue;
    const int own = pthread_equal(s->capture_thread, pthread_self());
    if ((own && s->capture_mode != CU_STREAM_CAPTURE_MODE_RELAXED) ||
        (!own && s->capture_mode == CU_STREAM_CAPTURE_MODE_GLOBAL && sti_mode == CU_STREAM_CAPTURE_MODE_GLOBAL)) {
      char why[128];
      snprintf(why, sizeof why, "%s called by a thread in the %s capture mode", sti_fn_name(fn),
               sti_mode == CU_STREAM_CAPTURE_MODE_GLOBAL ? "global" : "thread-local");
      sti_invalidate(id, why);
      prohibited = 1;
    }
  }
  return prohibited ? CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED : CUDA_SUCCESS;
}

/* Whether a blocking stream of the legacy stream `id`'s context captures; `use` names a use of
 * the legacy stream, which then invalidates those captures. */
static int sti_legacy_blocked(uint32_t id, const char *use) {
  const sti_stream_t *s = sti_stream(id);
  if (s->kind != STI_STREAM_IS_LEGACY) return 0;
  int blocked = 0;
  for (uint32_t o = 1; o <= sti.streams_count; o++) {
    const sti_stream_t *other = sti_stream(o);
    if (other->device != s->device || !sti_blocking(other) || other->capture == CU_STREAM_CAPTURE_STATUS_NONE) continue;
    blocked = 1;
    if (use != NULL) sti_invalidate(o, use);
  }
  return blocked;
}

/* ------------------------------------------------------------------------------------------
 * Streams
 * ---------------------------------------------------------------------------------------- */

CUresult cuStreamCreate(CUstream *out, unsigned int flags) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuStreamCreate);
  int device = 0;
  if (r == CUDA_SUCCESS && (out == NULL || (flags & ~(unsigned)CU_STREAM_NON_BLOCKING) != 0))
    r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) r = sti_current_device(&device);
  if (r == CUDA_SUCCESS) {
    const uint32_t id = sti_stream_new(device, STI_STREAM_USER, flags);
    if (id == 0)
      r = CUDA_ERROR_OUT_OF_MEMORY;
    else
      *out = (CUstream)sti_stream_handle(id);
  }
  return sti_leave(&c, r);
}

/* The reference: work still queued completes after the call; the handle is gone at once. */
CUresult cuStreamDestroy_v2(CUstream stream) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuStreamDestroy);
  uint32_t id = 0;
  if (r == CUDA_SUCCESS && (uintptr_t)stream <= STI_STREAM_PER_THREAD) r = CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS) r = sti_stream_resolve((uintptr_t)stream, &id);
  if (r == CUDA_SUCCESS) {
    sti_stream(id)->live = 0;
    sti_stream(id)->capture = CU_STREAM_CAPTURE_STATUS_NONE;
  }
  return sti_leave(&c, r);
}

CUresult cuStreamGetCtx(CUstream stream, CUcontext *out) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuStreamGetCtx);
  uint32_t id = 0;
  if (r == CUDA_SUCCESS && out == NULL) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) r = sti_stream_resolve((uintptr_t)stream, &id);
  if (r == CUDA_SUCCESS) *out = (CUcontext)(STI_TAG_CTX + (uintptr_t)sti_stream(id)->device + 1);
  return sti_leave(&c, r);
}

/* The reference: on the legacy stream while a blocking stream of its context captures,
 * CUDA_ERROR_STREAM_CAPTURE_IMPLICIT (and *out_status unspecified: left alone here). */
CUresult cuStreamIsCapturing(CUstream stream, int *out_status) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuStreamIsCapturing);
  uint32_t id = 0;
  if (r == CUDA_SUCCESS && out_status == NULL) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) r = sti_stream_resolve((uintptr_t)stream, &id);
  if (r == CUDA_SUCCESS && sti_legacy_blocked(id, NULL)) r = CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
  if (r == CUDA_SUCCESS) *out_status = sti_stream(id)->capture;
  return sti_leave(&c, r);
}

CUresult cuThreadExchangeStreamCaptureMode(int *mode) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuThreadExchangeStreamCaptureMode);
  if (r == CUDA_SUCCESS &&
      (mode == NULL || *mode < CU_STREAM_CAPTURE_MODE_GLOBAL || *mode > CU_STREAM_CAPTURE_MODE_RELAXED))
    r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) {
    const int previous = sti_mode;
    sti_mode = *mode;
    *mode = previous;
  }
  return sti_leave(&c, r);
}

/* ------------------------------------------------------------------------------------------
 * Events
 * ---------------------------------------------------------------------------------------- */

static sti_event_t *sti_event_of(CUevent event) {
  const uintptr_t h = (uintptr_t)event;
  if (h <= STI_TAG_EVENT || h - STI_TAG_EVENT > sti.events_count) return NULL;
  sti_event_t *ev = &sti.events[h - STI_TAG_EVENT - 1];
  return ev->live ? ev : NULL;
}

static int sti_event_done(const sti_event_t *ev) {
  return !ev->recorded || ev->captured || sti_stream(ev->stream)->done >= ev->ticket;
}

/* The reference: interprocess events must disable timing; other bits are unknown flags. */
CUresult cuEventCreate(CUevent *out, unsigned int flags) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuEventCreate);
  int device = 0;
  const unsigned known = CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;
  if (r == CUDA_SUCCESS &&
      (out == NULL || (flags & ~known) != 0 || ((flags & CU_EVENT_INTERPROCESS) && !(flags & CU_EVENT_DISABLE_TIMING))))
    r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) r = sti_current_device(&device);
  if (r == CUDA_SUCCESS &&
      (sti_grow((void **)&sti.events, &sti.events_cap, sti.events_count, sizeof *sti.events) != 0 ||
       sti.events_count + 1 >= STI_TAG_SPAN))
    r = CUDA_ERROR_OUT_OF_MEMORY;
  if (r == CUDA_SUCCESS) {
    sti.events[sti.events_count++] = (sti_event_t){device, 1, 0, 0, 0, 0};
    *out = (CUevent)(STI_TAG_EVENT + sti.events_count);
  }
  return sti_leave(&c, r);
}

/* The reference: an event whose work is still queued may be destroyed; its resources go later. */
CUresult cuEventDestroy_v2(CUevent event) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuEventDestroy);
  sti_event_t *ev = r == CUDA_SUCCESS ? sti_event_of(event) : NULL;
  if (r == CUDA_SUCCESS && ev == NULL) r = CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS) ev->live = 0;
  return sti_leave(&c, r);
}

/* The reference: event and stream of the same context, else CUDA_ERROR_INVALID_HANDLE. On a
 * capturing stream the record joins the capture. */
CUresult cuEventRecord(CUevent event, CUstream stream) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuEventRecord);
  uint32_t id = 0;
  sti_event_t *ev = r == CUDA_SUCCESS ? sti_event_of(event) : NULL;
  if (r == CUDA_SUCCESS && ev == NULL) r = CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS) r = sti_stream_resolve((uintptr_t)stream, &id);
  if (r == CUDA_SUCCESS && sti_stream(id)->device != ev->device) r = CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS && sti_legacy_blocked(id, "cuEventRecord on the legacy stream"))
    r = CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
  if (r == CUDA_SUCCESS && sti_stream(id)->capture == CU_STREAM_CAPTURE_STATUS_INVALIDATED)
    r = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
  if (r == CUDA_SUCCESS && sti_stream(id)->capture == CU_STREAM_CAPTURE_STATUS_ACTIVE) {
    ev->recorded = ev->captured = 1;
    ev->stream = id;
  } else if (r == CUDA_SUCCESS) {
    uint64_t ticket = 0;
    if (sti_push(id, STI_ITEM_MARKER, 0, 0, &ticket) != 0) {
      r = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
      *ev = (sti_event_t){ev->device, 1, 1, 0, id, ticket};
      sti_settle();
    }
  }
  return sti_leave(&c, r);
}

/* Waiting on an event last recorded into a capture: CUDA_ERROR_CAPTURED_EVENT, a fault here. */
static CUresult sti_event_captured(const sti_event_t *ev, const char *call) {
  if (!ev->captured) return CUDA_SUCCESS;
  char why[96];
  snprintf(why, sizeof why, "%s of an event recorded in it", call);
  if (sti_stream(ev->stream)->capture == CU_STREAM_CAPTURE_STATUS_ACTIVE)
    sti_invalidate(ev->stream, why);
  else
    sti_fault(CPSTANDIN_FAULT_CAPTURE, "%s of an event last recorded in a capture", call);
  return CUDA_ERROR_CAPTURED_EVENT;
}

CUresult cuEventQuery(CUevent event) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuEventQuery);
  sti_event_t *ev = r == CUDA_SUCCESS ? sti_event_of(event) : NULL;
  if (r == CUDA_SUCCESS && ev == NULL) r = CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS) r = sti_event_captured(ev, "cuEventQuery");
  if (r == CUDA_SUCCESS && !sti_event_done(ev)) r = CUDA_ERROR_NOT_READY;
  return sti_leave(&c, r);
}

CUresult cuEventSynchronize(CUevent event) {
  sti_call_t c;
  CUresult r = sti_enter(&c, STI_FN_cuEventSynchronize);
  sti_event_t *ev = r == CUDA_SUCCESS ? sti_event_of(event) : NULL;
  if (r == CUDA_SUCCESS && ev == NULL) r = CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS) r = sti_event_captured(ev, "cuEventSynchronize");
  if (r == CUDA_SUCCESS && !sti_event_done(ev)) {
    sti_complete_before(ev->stream, ev->ticket + 1);
    sti_settle();
  }
  return sti_leave(&c, r);
}

/* ------------------------------------------------------------------------------------------
 * Control API (standin.h)
 * ---------------------------------------------------------------------------------------- */

STI_EXPORT int cpstandin_launch(uintptr_t stream, unsigned long long ptr, size_t bytes) {
  sti_lock();
  uint32_t id = 0;
  CUresult r = sti.sticky;
  if (r == CUDA_SUCCESS && bytes == 0) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) r = sti_stream_resolve(stream, &id);
  if (r == CUDA_SUCCESS && sti_legacy_blocked(id, "a launch on the legacy stream"))
    r = CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
  const int capture = r == CUDA_SUCCESS ? sti_stream(id)->capture : CU_STREAM_CAPTURE_STATUS_NONE;
  if (capture == CU_STREAM_CAPTURE_STATUS_INVALIDATED) r = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
  if (r == CUDA_SUCCESS && capture == CU_STREAM_CAPTURE_STATUS_NONE) {
    const int device = sti_stream(id)->device;
    if (!sti_mem_writable(device, ptr, bytes)) {
      char name[96];
      sti_stream_name(id, name, sizeof name);
      sti_fault(CPSTANDIN_FAULT_ILLEGAL_ADDRESS,
                "device fault: a launch on %s wrote [0x%llx, +%zu bytes), which device %d may not access", name, ptr,
                bytes, device);
      r = CUDA_ERROR_ILLEGAL_ADDRESS;
    } else if (sti_push(id, STI_ITEM_LAUNCH, ptr, bytes, NULL) != 0) {
      r = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
      sti_mem_touch(ptr, bytes, (unsigned char)id);
    }
  }
  pthread_mutex_unlock(&sti.lock);
  return r;
}

STI_EXPORT int cpstandin_complete(uintptr_t stream) {
  sti_lock();
  uint32_t id = 0;
  const CUresult r = sti_stream_resolve(stream, &id);
  if (r == CUDA_SUCCESS) {
    sti_complete_before(id, UINT64_MAX);
    sti_settle();
  }
  pthread_mutex_unlock(&sti.lock);
  return r;
}

STI_EXPORT void cpstandin_complete_all(void) {
  sti_lock();
  for (uint32_t id = 1; id <= sti.streams_count; id++) sti_complete_before(id, UINT64_MAX);
  sti_settle();
  pthread_mutex_unlock(&sti.lock);
}

STI_EXPORT size_t cpstandin_pending(uintptr_t stream) {
  sti_lock();
  uint32_t id = 0;
  const size_t n = sti_stream_resolve(stream, &id) == CUDA_SUCCESS ? sti_stream(id)->count : SIZE_MAX;
  pthread_mutex_unlock(&sti.lock);
  return n;
}

/* The reference (cuStreamBeginCapture): the legacy stream cannot be captured; a stream already
 * capturing cannot begin again. */
STI_EXPORT int cpstandin_begin_capture(uintptr_t stream, int mode) {
  sti_lock();
  uint32_t id = 0;
  CUresult r = sti_stream_resolve(stream, &id);
  if (r == CUDA_SUCCESS && sti_stream(id)->kind != STI_STREAM_USER) r = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  if (r == CUDA_SUCCESS && (mode < CU_STREAM_CAPTURE_MODE_GLOBAL || mode > CU_STREAM_CAPTURE_MODE_RELAXED))
    r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS && sti_stream(id)->capture != CU_STREAM_CAPTURE_STATUS_NONE) r = CUDA_ERROR_ILLEGAL_STATE;
  if (r == CUDA_SUCCESS) {
    sti_stream_t *s = sti_stream(id);
    s->capture = CU_STREAM_CAPTURE_STATUS_ACTIVE;
    s->capture_mode = mode;
    s->capture_thread = pthread_self();
  }
  pthread_mutex_unlock(&sti.lock);
  return r;
}

STI_EXPORT int cpstandin_end_capture(uintptr_t stream) {
  sti_lock();
  uint32_t id = 0;
  CUresult r = sti_stream_resolve(stream, &id);
  if (r == CUDA_SUCCESS && sti_stream(id)->capture == CU_STREAM_CAPTURE_STATUS_NONE) r = CUDA_ERROR_ILLEGAL_STATE;
  if (r == CUDA_SUCCESS) {
    if (sti_stream(id)->capture == CU_STREAM_CAPTURE_STATUS_INVALIDATED) r = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    sti_stream(id)->capture = CU_STREAM_CAPTURE_STATUS_NONE;
  }
  pthread_mutex_unlock(&sti.lock);
  return r;
}

STI_EXPORT int cpstandin_capture_status(uintptr_t stream) {
  sti_lock();
  uint32_t id = 0;
  const int status = sti_stream_resolve(stream, &id) == CUDA_SUCCESS ? sti_stream(id)->capture : -1;
  pthread_mutex_unlock(&sti.lock);
  return status;
}
