/* backend.h — the device contract the pool is written against.
 * Owns: the operation table every backend (cuda, sim) implements; nothing else. */
#ifndef CP_BACKEND_H
#define CP_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "base/status.h"

/* Opaque handles. A stream is whatever the device calls a stream (cudaStream_t for CUDA,
 * any integer for sim); 0 is the device's default stream. An event is owned by the backend. */
typedef uintptr_t cp_stream_t;
typedef uintptr_t cp_event_t;
/* A physical allocation of page-mapped memory (CUmemGenericAllocationHandle for CUDA). */
typedef uintptr_t cp_page_t;

/* Device ordinals run from 0 to CP_MAX_DEVICES - 1 in every layer (backends, device table). */
#define CP_MAX_DEVICES 64

/* The contract, stated once for every entry:
 *  - 0 (CP_OK) is success; results come back through out-parameters, which are untouched
 *    on failure.
 *  - CP_ERR_OOM means "the device has no memory for this"; any other failure is
 *    CP_ERR_BACKEND, and the backend has set the thread's last error (cp_set_error) with
 *    the call that failed and the device's own error name.
 *  - reserve, release, event_synchronize and mem_info are called without the pool lock
 *    (they may block or take long). event_create, event_record and event_query are called
 *    under the pool lock: they must not wait for device work.
 *  - The page-mapped entries (vmm_granularity to page_set_access) are all NULL or all set;
 *    every one is called without the pool lock (they may block or take long).
 *  - `ctx` is the backend's own state; entries are thread-safe with respect to it. */

/* Note [Page-mapped memory]
 * Besides plain segments (reserve/release: an address and its memory in one call), a device
 * with virtual memory management (the CUDA VMM API: cuMemAddressReserve, cuMemCreate, cuMemMap)
 * separates the two: an address range is reserved without memory; physical pages are created
 * without an address; a page is mapped at an address inside a reserved range, and the device
 * may touch it only once read-write access is set there. One page may be mapped at several
 * addresses at once (all of them see the same bytes), and a range can grow by mapping more
 * pages behind it, which is what later page-mapped pools are built on. A page's memory goes
 * back to the device when it is released AND unmapped everywhere, in either order.
 *
 * Every size, offset and address below is a multiple of the device's granularity
 * (vmm_granularity; 2 MiB on current GPUs). A page is always mapped whole (offset 0, size
 * equal to the page's), and an unmap covers whole mappings, never part of one. The entries
 * are NULL on a device without VMM support; the pool then uses plain segments. */
typedef struct cp_backend_s {
  const char *name; /* "sim", "cuda" */
  void *ctx;
  int device; /* device ordinal this instance serves */

  /* Device memory. `size` > 0; the returned address is aligned to at least 512 bytes. */
  int (*reserve)(void *ctx, size_t size, uintptr_t *out_addr);
  int (*release)(void *ctx, uintptr_t addr, size_t size);

  /* Events: created once, pooled by the core, recorded many times. */
  int (*event_create)(void *ctx, cp_event_t *out_event);
  /* The event is gone when event_destroy returns, whether or not the device call succeeded (a
   * failure is reported, not kept for a retry): never destroy or use it again. */
  int (*event_destroy)(void *ctx, cp_event_t event);
  int (*event_record)(void *ctx, cp_event_t event, cp_stream_t stream);
  int (*event_query)(void *ctx, cp_event_t event, int *out_done); /* never blocks */
  int (*event_synchronize)(void *ctx, cp_event_t event);          /* blocks until done */

  /* Free and total device memory in bytes. */
  int (*mem_info)(void *ctx, size_t *out_free, size_t *out_total);

  /* Page-mapped memory, Note [Page-mapped memory]; NULL without VMM support. */
  /* The granularity in bytes, a power of two (cuMemGetAllocationGranularity, MINIMUM, for
   * pinned memory on this device). */
  int (*vmm_granularity)(void *ctx, size_t *out_bytes);
  /* An address range of `size` bytes, granularity-aligned, with no memory behind it
   * (cuMemAddressReserve). va_free gives back a whole range exactly as reserved; a range that
   * still has mappings is refused (CP_ERR_INVALID) by the simulated device (cuMemAddressFree). */
  int (*va_reserve)(void *ctx, size_t size, uintptr_t *out_addr);
  int (*va_free)(void *ctx, uintptr_t addr, size_t size);
  /* Physical memory of `size` bytes (cuMemCreate); CP_ERR_OOM when the device has none.
   * page_release drops the handle (cuMemRelease): the memory stays while the page is mapped
   * anywhere and goes with its last unmap. */
  int (*page_create)(void *ctx, size_t size, cp_page_t *out_page);
  int (*page_release)(void *ctx, cp_page_t page);
  /* Map the whole page (offset 0; `size` is the page's size) at `addr` inside a reserved
   * range, on addresses not mapped yet (cuMemMap). page_unmap unmaps [addr, addr + size),
   * which must cover whole mappings and never cut one (cuMemUnmap). */
  int (*page_map)(void *ctx, uintptr_t addr, size_t size, cp_page_t page);
  int (*page_unmap)(void *ctx, uintptr_t addr, size_t size);
  /* Read-write access for this device to mapped [addr, addr + size) (cuMemSetAccess); a
   * mapping must not be touched before. */
  int (*page_set_access)(void *ctx, uintptr_t addr, size_t size);

  /* Note [Stream capture]
   * Whether `stream` is being captured into a graph right now (cuStreamIsCapturing): 1 in
   * *out_capturing when it is. NULL on a device without graphs: nothing is ever captured.
   * While a capture is under way the pool makes no event call (record, query, synchronize)
   * and gives no memory back: the driver refuses them, and the capture is lost. A reserve
   * made then must not join the capture (the CUDA backend makes it in relaxed capture
   * mode). Called under the pool lock: it must not wait for device work. */
  int (*stream_capturing)(void *ctx, cp_stream_t stream, int *out_capturing);
  /* The handle to remember for a use of `stream` declared now (record_stream): a handle that
   * means "the default stream of the current device" is made to name the current device's
   * even when the stream's work is recorded later from another one; every other handle comes
   * back as it is. NULL: handles are kept as they are. Called under the pool lock. */
  int (*stream_resolve)(void *ctx, cp_stream_t stream, cp_stream_t *out_stream);

  /* Note [Copies for a backup]
   * What a paused region's backup needs (core/pause.c): pinned host memory (cuMemAllocHost,
   * cuMemFreeHost) and copies between it and device memory (cuMemcpyDtoH, cuMemcpyHtoD). A
   * copy returns once the bytes have arrived. It is not ordered after work queued on other
   * streams (torch's streams do not wait for the legacy stream): the caller has waited for
   * every stream that uses the memory before it copies. The device memory must be mapped with
   * access. All four are NULL, or all set; called without the pool lock. */
  int (*host_alloc)(void *ctx, size_t size, void **out_ptr);
  int (*host_free)(void *ctx, void *ptr);
  int (*copy_to_host)(void *ctx, void *dst, uintptr_t src, size_t size);
  int (*copy_to_device)(void *ctx, uintptr_t dst, const void *src, size_t size);
  /* Note [Sharing between processes]
   * Memory another process maps too (CUDA IPC). A plain segment is shared whole through the
   * driver's IPC handle: ipc_export gives the CP_IPC_HANDLE_BYTES bytes of the handle of the
   * segment reserve() returned at `addr` (cuIpcGetMemHandle); another process maps it at an
   * address of its own with ipc_open (cuIpcOpenMemHandle) and unmaps it with ipc_close. Page-
   * mapped memory is shared a physical allocation at a time: page_export gives a POSIX file
   * descriptor (the caller's to close) for the allocation mapped at `addr`, the start of one
   * mapping (cuMemRetainAllocationHandle, cuMemExportToShareableHandle); page_import makes a
   * handle of this process from one (cuMemImportFromShareableHandle; the caller keeps the
   * descriptor), which is mapped, given access and released as page_create's are. Memory lives
   * while any process maps it or holds a handle. The IPC entries are NULL, or all set; the page
   * entries are set only on a device whose pages are created exportable
   * (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED). All without the pool lock. */
  int (*ipc_export)(void *ctx, uintptr_t addr, void *out_handle);
  int (*ipc_open)(void *ctx, const void *handle, uintptr_t *out_addr);
  int (*ipc_close)(void *ctx, uintptr_t addr);
  int (*page_export)(void *ctx, uintptr_t addr, int *out_fd);
  int (*page_import)(void *ctx, int fd, cp_page_t *out_page);
} cp_backend_t;

#define CP_IPC_HANDLE_BYTES 64 /* a CUDA IPC memory handle (cudaIpcMemHandle_t) */

#endif /* CP_BACKEND_H */
