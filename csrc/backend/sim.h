/* sim.h — the simulated device: host memory with a capacity, deterministic streams and
 * events, page-mapped memory, fault injection and a counter per call. The whole pool runs on
 * it without a GPU. */
#ifndef CP_SIM_H
#define CP_SIM_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "base/backend.h"

typedef struct cp_sim_s cp_sim_t;

/* Backend calls, counted and individually fault-injectable. New kinds go at the end, so that
 * the index of every kind stays what it was. */
#define CP_SIM_CALLS(X)                     \
  X(RESERVE, "reserve")                     \
  X(RELEASE, "release")                     \
  X(EVENT_CREATE, "event_create")           \
  X(EVENT_DESTROY, "event_destroy")         \
  X(EVENT_RECORD, "event_record")           \
  X(EVENT_QUERY, "event_query")             \
  X(EVENT_SYNCHRONIZE, "event_synchronize") \
  X(MEM_INFO, "mem_info")                   \
  X(VMM_GRANULARITY, "vmm_granularity")     \
  X(VA_RESERVE, "va_reserve")               \
  X(VA_FREE, "va_free")                     \
  X(PAGE_CREATE, "page_create")             \
  X(PAGE_RELEASE, "page_release")           \
  X(PAGE_MAP, "page_map")                   \
  X(PAGE_UNMAP, "page_unmap")               \
  X(PAGE_SET_ACCESS, "page_set_access")     \
  X(STREAM_CAPTURING, "stream_capturing")   \
  X(HOST_ALLOC, "host_alloc")               \
  X(HOST_FREE, "host_free")                 \
  X(COPY_TO_HOST, "copy_to_host")           \
  X(COPY_TO_DEVICE, "copy_to_device")

typedef enum cp_sim_call_e {
#define CP_X(id, name) CP_SIM_##id,
  CP_SIM_CALLS(CP_X)
#undef CP_X
      CP_SIM_CALL_COUNT
} cp_sim_call_t;

enum {
  /* Launches, and so events, complete as soon as they are submitted (a device that is always
   * idle): cp_sim_set_lag(sim, 0). */
  CP_SIM_AUTO_COMPLETE = 1u << 0,
  /* Do not back reservations (nor page-mapped memory) with host memory: hand out distinct,
   * 512-aligned addresses that must never be dereferenced. For replaying traces far larger
   * than this machine. */
  CP_SIM_NO_TOUCH = 1u << 1,
  /* A device without page-mapped memory: cp_sim_backend leaves the entries from
   * vmm_granularity to page_set_access NULL. */
  CP_SIM_NO_VMM = 1u << 2
};

/* Note [Simulated page-mapped memory]
 * The entries of Note [Page-mapped memory] (base/backend.h) behave as the driver's do, with
 * host memory (Linux) in place of device memory:
 *  - a page is a memfd of its size: real memory, shared by every address it is mapped at, so
 *    bytes written through one mapping read back through any other;
 *  - va_reserve is a PROT_NONE anonymous host mapping (MAP_NORESERVE) aligned to the
 *    granularity; page_map maps the page's file over part of it, still PROT_NONE, and
 *    page_set_access makes that read-write: touching a mapping before faults, as on a GPU;
 *    page_unmap puts PROT_NONE anonymous memory back (the addresses stay reserved), va_free
 *    unmaps the range;
 *  - a page counts against the capacity (used_bytes, mem_info) from page_create until it is
 *    both released and unmapped everywhere, as a reservation does; address ranges do not;
 *  - misuse is CP_ERR_INVALID with the device unchanged: a size or address that is not a
 *    multiple of the granularity; page_map outside one reserved range, over a mapped address,
 *    of an unknown or released page or with a size other than the page's; page_unmap of a
 *    range that cuts a mapping, lies outside one reserved range or has nothing mapped;
 *    page_set_access of a range not tiled exactly by whole mappings; va_free of anything but
 *    a whole reserved range, or of one with mappings left; page_release of an unknown or
 *    released page. A host call that fails (memfd_create, mmap, mprotect) is CP_ERR_BACKEND
 *    naming it and errno's text;
 *  - with CP_SIM_NO_TOUCH there is no host memory at all: ranges are fake addresses from the
 *    same bump pointer as reservations, pages and mappings are bookkeeping only. */

/* Note [Simulated asynchrony]
 * A GPU runs behind its host: a launch returns at once and its kernel runs later, in the
 * order of its stream. The simulated device keeps that gap. Each stream has a queue of
 * launches (cp_sim_launch: work that reads and writes [ptr, ptr + bytes)), numbered as they
 * are submitted. A launch completes when the test says so (cp_sim_complete,
 * cp_sim_complete_all), when its stream runs more than `lag` launches behind (cp_sim_set_lag;
 * 0, as with CP_SIM_AUTO_COMPLETE, is a device that is always idle), or when a call that
 * waits for the device drains it, as the driver's do:
 *  - release (cudaFree of a plain segment) waits for every stream of the device;
 *  - event_synchronize waits for the event's stream up to the event;
 * An event recorded on a stream completes when the work queued on it before the record has:
 * at once on an idle stream.
 * A device fault is what would corrupt memory or kill the process on a GPU; each is counted
 * and kept (cp_sim_device_faults), and every test, checker and fuzzer fails on one:
 *  - page_unmap of addresses that incomplete work touches (the driver reference calls
 *    cuMemUnmap synchronous only "for most use cases"; PyTorch waits for the stream first);
 *  - a launch on memory that is not the device's: not reserved, or not mapped with access;
 *  - handing memory to an allocation on one stream while work of another stream that touches
 *    it (at that address, or through a page mapped there too) is not known to be done
 *    (cp_sim_check_handoff, called by the test harnesses after each allocation);
 *  - a call the driver refuses while a stream captures (Note [Simulated capture]);
 *  - a handle used after it was destroyed or released: an event after event_destroy, a page
 *    after page_release. A destroy or release that fails (an injected failure) still ends
 *    the handle, as the driver may have freed it before failing: using it again is a fault.
 * Calls the driver reference calls synchronous (page_unmap, page_set_access) are counted as
 * waiting for the device in the cost model, but are not trusted to wait here: memory that
 * queued work still touches must not be unmapped, whatever the driver does on the day. */

/* One device fault: what happened, in which call, where and on which stream (of the work
 * involved, or the one named by the call). */
typedef struct cp_sim_device_fault_s {
  const char *what; /* a static string, e.g. "unmap of memory queued work still touches" */
  const char *call; /* the call kind's name, or "launch", "handoff" */
  uintptr_t addr;
  size_t size;
  cp_stream_t stream;
} cp_sim_device_fault_t;

/* A simulated device of `capacity` bytes. */
int cp_sim_create(size_t capacity, unsigned flags, cp_sim_t **out_sim);

/* Frees everything still reserved, every event, and every range, page and mapping (host
 * mappings unmapped, files closed); returns nothing. */
void cp_sim_destroy(cp_sim_t *sim);

/* Fill `out` with the operation table of this device (device ordinal 0). */
void cp_sim_backend(cp_sim_t *sim, cp_backend_t *out);

/* The page-mapped granularity: 2 MiB unless set here, before any page-mapped call, to a power
 * of two of at least 4096 bytes and at least the host's page size (CP_ERR_INVALID otherwise).
 * CP_ERR_STATE once a page-mapped call was made, or on a device made with CP_SIM_NO_VMM. */
int cp_sim_set_vmm_granularity(cp_sim_t *sim, size_t bytes);

/* Work on `stream` that reads and writes [ptr, ptr + bytes) (bytes > 0), queued behind what
 * was submitted to the stream before (Note [Simulated asynchrony]). Memory that is not the
 * device's (reserved, or page-mapped with access) is a device fault, and CP_ERR_INVALID; a
 * lost device is CP_ERR_BACKEND; host memory for the queue short, CP_ERR_HOST_OOM. */
int cp_sim_launch(cp_sim_t *sim, cp_stream_t stream, uintptr_t ptr, size_t bytes);
/* cp_sim_launch for a caller that vouches for the memory (a replay's pool handed it out and
 * has not freed it yet): queued without looking it up, so that a replay stays fast. */
int cp_sim_queue(cp_sim_t *sim, cp_stream_t stream, uintptr_t ptr, size_t bytes);
/* How many items a stream may run behind the host before its oldest completes on its own:
 * 0 completes everything at once, UINT64_MAX (the default without CP_SIM_AUTO_COMPLETE)
 * only when told or drained. Affects later submissions. */
void cp_sim_set_lag(cp_sim_t *sim, uint64_t items);
/* After an allocation of [ptr, ptr + bytes) for `stream`: a device fault (and 1) for each
 * incomplete launch of another stream that touches that memory; 0 when there is none. */
size_t cp_sim_check_handoff(cp_sim_t *sim, cp_stream_t stream, uintptr_t ptr, size_t bytes);
/* Launches not yet complete, on every stream. A launch that covers an earlier one of its
 * stream at the same address (as many bytes or more) stands for both: it completes after it. */
size_t cp_sim_queued_launches(const cp_sim_t *sim);
/* Device faults so far; the first SIM_FAULT_LOG (64) are kept: fault `i` into *out
 * (CP_ERR_INVALID past those). A harness may add its own (`what` a static string), e.g. a
 * launch on memory the pool has not handed out. Clearing forgets them all. */
uint64_t cp_sim_device_faults(const cp_sim_t *sim);
int cp_sim_device_fault(const cp_sim_t *sim, size_t i, cp_sim_device_fault_t *out);
void cp_sim_note_fault(cp_sim_t *sim, const char *what, uintptr_t addr, size_t size, cp_stream_t stream);
void cp_sim_clear_device_faults(cp_sim_t *sim);
/* Write every kept fault, one per line, to `out`; returns the count. */
uint64_t cp_sim_print_device_faults(const cp_sim_t *sim, FILE *out);

/* All work submitted to `stream` so far finishes: every event recorded on it completes. */
void cp_sim_complete(cp_sim_t *sim, cp_stream_t stream);
void cp_sim_complete_all(cp_sim_t *sim);
void cp_sim_set_auto_complete(cp_sim_t *sim, int on);
/* 1 when every event recorded on `stream` so far has completed (or none was recorded). */
int cp_sim_stream_idle(cp_sim_t *sim, cp_stream_t stream);

/* Make the n-th next call of `kind` fail with `status` (CP_ERR_OOM or CP_ERR_BACKEND):
 * n = 1 fails the very next one. n = 0 disarms. One armed failure per kind. */
void cp_sim_fail_nth(cp_sim_t *sim, cp_sim_call_t kind, uint64_t n, int status);

/* Make the n-th next call of `kind` sleep `ms` milliseconds with the device lock held (and
 * whatever lock its caller holds: the pool's, for event calls). n = 0 disarms. For tests of
 * what happens while a lock is held, e.g. fork(). */
void cp_sim_delay_nth(cp_sim_t *sim, cp_sim_call_t kind, uint64_t n, unsigned ms);
/* How many delays have started so far; safe to poll while one is under way. */
uint64_t cp_sim_delays_entered(const cp_sim_t *sim);

/* Lose the device (lost = 1): from now on every call fails with CP_ERR_BACKEND, as the
 * driver's calls do once it has shut down at process exit. Host memory is still freed by
 * cp_sim_destroy. lost = 0 brings it back. */
void cp_sim_set_lost(cp_sim_t *sim, int lost);

/* Make `stream` invalid, as a destroyed stream is: from now on every event_record on it fails
 * with CP_ERR_BACKEND and the driver's words "invalid resource handle". Events recorded on it
 * before stay as they are (they complete when told to). CP_ERR_HOST_OOM when host memory for
 * the stream's state is short. */
int cp_sim_invalidate_stream(cp_sim_t *sim, cp_stream_t stream);

/* Note [Simulated capture]
 * cp_sim_set_capturing(sim, stream, 1) puts `stream` into capture, as cuStreamBeginCapture
 * does in the global mode, and 0 ends it; stream_capturing answers from it. While any stream
 * of the device is capturing, event_record, event_query, event_synchronize and release fail
 * with CP_ERR_BACKEND ("operation not permitted when stream is capturing") and are counted in
 * cp_sim_capture_violations, as the driver refuses them then and invalidates the capture; a
 * reserve succeeds (the CUDA backend makes it in relaxed capture mode). page_unmap and
 * va_free are refused as well: memory is never given back during a capture (the captured
 * graph, and work queued before it, may still use it). Each refusal is a device fault too. CP_ERR_HOST_OOM when
 * host memory for the stream's state is short. */
int cp_sim_set_capturing(cp_sim_t *sim, cp_stream_t stream, int on);
uint64_t cp_sim_capture_violations(const cp_sim_t *sim);

/* Note [Simulated copies]
 * host_alloc and host_free are the backup's pinned host memory (malloc here: cuMemAllocHost
 * is host memory too), counted until freed (cp_sim_host_allocations); a host_free that fails
 * still frees, as a release does. copy_to_host and copy_to_device copy [addr, addr + size) of
 * device memory: memory that is not the device's (not reserved, or not mapped with access) is
 * a device fault and CP_ERR_INVALID, as a launch there is; work not yet complete that touches
 * those bytes is a device fault as well (the copy is not ordered after other streams: it
 * would read or overwrite what that work is still using), and the copy is made all the same,
 * as on a GPU. With CP_SIM_NO_TOUCH no byte moves. */
/* host_alloc blocks not freed yet, and their bytes in *out_bytes (unless NULL). */
size_t cp_sim_host_allocations(const cp_sim_t *sim, size_t *out_bytes);

/* Calls of `kind` made so far (failed ones included), and the failures injected. */
uint64_t cp_sim_calls(const cp_sim_t *sim, cp_sim_call_t kind);
/* Bytes named by the calls of `kind` made so far, failed ones included: the size asked for
 * (reserve, release, va_reserve, va_free, page_create, page_map, page_unmap,
 * page_set_access) or the page's size (page_release, of a known page); 0 for other kinds. */
uint64_t cp_sim_call_bytes(const cp_sim_t *sim, cp_sim_call_t kind);
uint64_t cp_sim_faults_injected(const cp_sim_t *sim);
void cp_sim_reset_counters(cp_sim_t *sim);
const char *cp_sim_call_name(cp_sim_call_t kind);

/* What is live on the device now. reserved_bytes is the device memory in use: reservations
 * and page-mapped pages alike (what mem_info subtracts from the capacity). */
size_t cp_sim_reserved_bytes(const cp_sim_t *sim);
size_t cp_sim_live_reservations(const cp_sim_t *sim);
size_t cp_sim_live_events(const cp_sim_t *sim);
size_t cp_sim_capacity(const cp_sim_t *sim);
/* Page-mapped memory: address ranges reserved; pages not gone yet (released ones still mapped
 * included) and their bytes; mappings and their bytes. */
size_t cp_sim_vmm_ranges(const cp_sim_t *sim);
size_t cp_sim_vmm_pages(const cp_sim_t *sim);
size_t cp_sim_vmm_page_bytes(const cp_sim_t *sim);
size_t cp_sim_vmm_mappings(const cp_sim_t *sim);
size_t cp_sim_vmm_mapped_bytes(const cp_sim_t *sim);
/* The physical byte behind device address `addr`: the page mapped there, the offset of the
 * byte in it and the page's size (so the mapping goes on for page_size - offset bytes).
 * CP_ERR_INVALID when nothing is mapped at `addr` (any out argument may be NULL). Two
 * addresses share a byte of memory exactly when they resolve to the same (page, offset). */
int cp_sim_vmm_resolve(const cp_sim_t *sim, uintptr_t addr, cp_page_t *out_page, size_t *out_offset,
                       size_t *out_page_size);

#endif /* CP_SIM_H */
