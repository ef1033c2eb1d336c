/* cp.h — the public C API of the cudapool core.
 * Owns: configuration, statistics and pool entry points used by the bindings, tests and
 * benchmarks. Pure C11: no cuda.h, no Python.h. */
#ifndef CP_H
#define CP_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "base/backend.h"
#include "base/status.h"
#include "core/trace_event.h"

#define CP_VERSION "0.1.0"

/* ------------------------------------------------------------------------------------------
 * Configuration
 * ---------------------------------------------------------------------------------------- */

/* Power-of-two intervals for roundup_power2_divisions: index i covers sizes up to 2^i MiB
 * (index 0: everything up to 1 MiB); the last interval takes everything larger. */
#define CP_ROUNDUP_INTERVALS 16

typedef struct cp_config_s {
  /* Size classes and segments (defaults equal the built-in allocator's). */
  size_t granule;         /* 512 B: every block size is a multiple of this */
  size_t small_size;      /* 1 MiB: requests <= this use the small pool */
  size_t small_segment;   /* 2 MiB: segment size of the small pool */
  size_t large_segment;   /* 20 MiB: segment for large requests < min_large_alloc */
  size_t min_large_alloc; /* 10 MiB: from here on, one segment per request */
  size_t round_large;     /* 2 MiB: such segments are rounded up to this */
  /* Splitting. */
  size_t max_split_size;         /* SIZE_MAX = unlimited; blocks >= this are never split */
  size_t max_non_split_rounding; /* 20 MiB: an oversize request may take a block this much larger */
  unsigned roundup_power2_divisions[CP_ROUNDUP_INTERVALS]; /* 0 or 1 = plain granule rounding */
  /* Growth. */
  double garbage_collection_threshold; /* 0 = off, else in (0, 1): fraction of the cap */
  int release_before_grow;             /* 1: give back wholly free segments before reserving */
  size_t memory_cap;                   /* bytes, 0 = none */
  double memory_fraction;              /* 0 = unset, else (0, 1]: cap = fraction * device total */
  /* Page-mapped segments (Note [Expandable segments], core/expand.c). */
  int expandable_segments; /* 1: one growable segment per (stream, kind), where the device can */
  int page_stitching;      /* 1: page-mapped segments that stitch free pages (core/stitch.c) */
  int stitch_partial;      /* 1 (default): stitched ranges may open and close in handles in part use */
  int plan_steps;          /* 1: learn a repeating step and serve it from a plan (core/plan.h) */
} cp_config_t;

/* The configuration keys, one row each, in the order cp_config_format writes them:
 *   X(ID, "name", KIND, field, "default", "meaning")
 * Parsing, per-key validation and formatting (config.c), the key list the binding exposes and
 * the table of docs/configuration.md (scripts/config_doc.py) are all generated from this table; only the
 * relations between keys are checked by hand (cp_config_validate). Kinds:
 *   BYTES             a size in bytes;
 *   MIB               a size in MiB (fractional when it comes to a whole number of bytes);
 *   MIB_GRANULAR      the same, and a positive multiple of the granule;
 *   MIB_OR_UNLIMITED  MIB, or "unlimited" (SIZE_MAX);
 *   DIVISIONS         N or [SIZE_MB:N,...,>:N] (roundup_power2_divisions);
 *   FRACTION_OPEN     a number in (0, 1); 0 means off and is not written;
 *   FRACTION          a number in (0, 1]; 0 means unset and is not written;
 *   BOOL              True/False (also true/false, 1/0); expandable_segments, page_stitching and
 *                     plan_steps are written only when True, stitch_partial_handles only when False, so that
 *                     default configurations read as they always have. */
#define CP_CONFIG_KEYS(X)                                                                                              \
  X(GRANULE_BYTES, "granule_bytes", BYTES, granule, "512", "every block size is a multiple (a power of two ≥ 256)")    \
  X(SMALL_SIZE_MB, "small_size_mb", MIB_GRANULAR, small_size, "1", "largest request served from the small pool")       \
  X(SMALL_SEGMENT_MB, "small_segment_mb", MIB_GRANULAR, small_segment, "2", "segment size of the small pool")          \
  X(LARGE_SEGMENT_MB, "large_segment_mb", MIB_GRANULAR, large_segment, "20",                                           \
    "segment size for large requests below `min_large_alloc_mb`")                                                      \
  X(MIN_LARGE_ALLOC_MB, "min_large_alloc_mb", MIB_GRANULAR, min_large_alloc, "10",                                     \
    "from here on, one segment per request")                                                                           \
  X(ROUND_LARGE_MB, "round_large_mb", MIB_GRANULAR, round_large, "2", "such segments round up to this")                \
  X(MAX_SPLIT_SIZE_MB, "max_split_size_mb", MIB_OR_UNLIMITED, max_split_size, "unlimited",                             \
    "blocks this large or larger are never split (must exceed `large_segment_mb`)")                                    \
  X(MAX_NON_SPLIT_ROUNDING_MB, "max_non_split_rounding_mb", MIB, max_non_split_rounding, "20",                         \
    "how much larger than an oversize request a reused block may be")                                                  \
  X(ROUNDUP_POWER2_DIVISIONS, "roundup_power2_divisions", DIVISIONS, roundup_power2_divisions, "0 (off)",              \
    "`N`, or `[256:1,512:2,>:4]` per size interval (sizes in MiB, powers of two)")                                     \
  X(RELEASE_BEFORE_GROW, "release_before_grow", BOOL, release_before_grow, "False",                                    \
    "True: before growing past the high-water mark, give back wholly free segments (the `cudapool` policy sets it)")   \
  X(MEMORY_CAP_MB, "memory_cap_mb", MIB, memory_cap, "0 (none)", "growth stops at this many MiB")                      \
  X(GARBAGE_COLLECTION_THRESHOLD, "garbage_collection_threshold", FRACTION_OPEN, garbage_collection_threshold, "off",  \
    "in (0, 1): give back free segments before growing past this fraction of the limit")                               \
  X(MEMORY_FRACTION, "memory_fraction", FRACTION, memory_fraction, "unset",                                            \
    "in (0, 1]: cap at this fraction of the device's total")                                                           \
  X(EXPANDABLE_SEGMENTS, "expandable_segments", BOOL, expandable_segments, "False",                                    \
    "True: serve each (stream, pool) from one page-mapped segment that grows in place (falls back to plain "           \
    "segments on a device without page-mapped memory)")                                                                \
  X(PAGE_STITCHING, "page_stitching", BOOL, page_stitching, "False",                                                   \
    "True: page-mapped segments (as `expandable_segments`) mapped as growth needs it, one per stream for every size; " \
    "a request no free block fits is served from the free "                                                            \
    "pages of its stream's segments, mapped side by side into a fresh range kept for reuse (the `cudapool` policy)")   \
  X(STITCH_PARTIAL_HANDLES, "stitch_partial_handles", BOOL, stitch_partial, "True",                                    \
    "with `page_stitching`: True, a stitched range may begin in the free end of a handle partly in use and end in "    \
    "the free start of another; False: wholly free handles only")                                                      \
  X(PLAN_STEPS, "plan_steps", BOOL, plan_steps, "False",                                                               \
    "True, with `page_stitching`: learn the loop's repeating step from its allocations and serve it from a plan laid " \
    "out once in the pool's free memory, each allocation by its position in the step (the `planned` policy)")

/* One row of CP_CONFIG_KEYS, for bindings and documentation. */
typedef struct cp_config_key_s {
  const char *name;
  const char *default_text;
  const char *doc;
} cp_config_key_t;

/* The rows of CP_CONFIG_KEYS, in order; cp_config_key_count of them. */
extern const cp_config_key_t cp_config_keys[];
extern const size_t cp_config_key_count;

/* Fill `cfg` with the defaults. */
void cp_config_default(cp_config_t *cfg);

/* Apply a "key:value,key:value" string (the PYTORCH_CUDA_ALLOC_CONF syntax) on top of
 * `cfg`. On any error nothing in `cfg` changes; the last error names the key and the value.
 * The keys are the rows of CP_CONFIG_KEYS. NULL or "" is a no-op. */
int cp_config_parse(cp_config_t *cfg, const char *text);

/* Defaults, then the CUDAPOOL_CONF environment variable on top (unset or empty: defaults).
 * On error `cfg` holds the defaults and the last error names the bad key or value. */
int cp_config_from_env(cp_config_t *cfg);

/* Check a whole configuration for consistency (used by parse and by pool creation). */
int cp_config_validate(const cp_config_t *cfg);

/* Write the configuration as a parseable string. Returns the length that would have been
 * written (snprintf rules). */
int cp_config_format(const cp_config_t *cfg, char *buf, size_t buf_size);

/* Round a request the way the pool will (0 stays 0). */
size_t cp_round_size(const cp_config_t *cfg, size_t size);

/* ------------------------------------------------------------------------------------------
 * Statistics — named as the built-in allocator names them.
 * ---------------------------------------------------------------------------------------- */

#define CP_STAT_FAMILIES(X)                       \
  X(ALLOCATION, "allocation")                     \
  X(SEGMENT, "segment")                           \
  X(ACTIVE, "active")                             \
  X(INACTIVE_SPLIT, "inactive_split")             \
  X(ALLOCATED_BYTES, "allocated_bytes")           \
  X(RESERVED_BYTES, "reserved_bytes")             \
  X(ACTIVE_BYTES, "active_bytes")                 \
  X(INACTIVE_SPLIT_BYTES, "inactive_split_bytes") \
  X(REQUESTED_BYTES, "requested_bytes")

#define CP_STAT_COUNTERS(X) \
  X(num_alloc_retries)      \
  X(num_ooms)               \
  X(num_sync_all_streams)   \
  X(num_device_alloc)       \
  X(num_device_free)

typedef enum cp_stat_family_e {
#define CP_X(id, name) CP_STAT_##id,
  CP_STAT_FAMILIES(CP_X)
#undef CP_X
      CP_STAT_FAMILY_COUNT
} cp_stat_family_t;

/* Which pool a stat row counts: all, small_pool, large_pool. */
typedef enum cp_pool_kind_e { CP_KIND_ALL = 0, CP_KIND_SMALL = 1, CP_KIND_LARGE = 2, CP_KIND_COUNT = 3 } cp_pool_kind_t;

typedef struct cp_stat_s {
  int64_t current;
  int64_t peak;
  int64_t allocated; /* accumulated increases */
  int64_t freed;     /* accumulated decreases */
} cp_stat_t;

typedef struct cp_stats_s {
  cp_stat_t family[CP_STAT_FAMILY_COUNT][CP_KIND_COUNT];
  cp_stat_t oversize_allocations;
  cp_stat_t oversize_segments;
#define CP_X(name) int64_t name;
  CP_STAT_COUNTERS(CP_X)
#undef CP_X
  int64_t max_split_size; /* the configured value, -1 when unlimited (torch's convention) */
} cp_stats_t;

extern const char *const cp_stat_family_names[CP_STAT_FAMILY_COUNT];
extern const char *const cp_pool_kind_names[CP_KIND_COUNT]; /* "all", "small_pool", "large_pool" */

/* ------------------------------------------------------------------------------------------
 * The pool
 * ---------------------------------------------------------------------------------------- */

typedef struct cp_pool_s cp_pool_t;

/* Create a pool over `backend` (copied; its ctx must outlive the pool). */
int cp_pool_create(const cp_config_t *cfg, const cp_backend_t *backend, cp_pool_t **out_pool);

/* Return every segment to the backend, live blocks included, and free the pool. The caller
 * makes sure no work queued on the device still uses the pool's memory (at process exit the
 * driver has stopped it): everything is unmapped at once. */
void cp_pool_destroy(cp_pool_t *pool);

/* Allocate `size` bytes for use on `stream`. size 0 gives *out_ptr = NULL and CP_OK.
 * CP_ERR_OOM when the device (or the cap) cannot hold it; the last error then carries the
 * OOM report (see cp_pool_oom_report). */
int cp_alloc(cp_pool_t *pool, size_t size, cp_stream_t stream, void **out_ptr);
/* cp_alloc in region `tag` (Note [Regions], region.c; 0: none, as cp_alloc). In a pool
 * without page-mapped memory the tag is ignored (nothing there can be paused). A paused
 * region is CP_ERR_STATE: nothing is allocated. */
int cp_alloc_in(cp_pool_t *pool, size_t size, cp_stream_t stream, uint32_t tag, void **out_ptr);

/* Free a pointer returned by cp_alloc. NULL is a no-op. An unknown pointer (or a double
 * free) is CP_ERR_INVALID and changes nothing. When an event cannot be recorded on a stream
 * the block was used on (record_stream; e.g. a destroyed stream), CP_ERR_BACKEND and the
 * block stays allocated: nothing could tell when that stream's work ends. */
int cp_free(cp_pool_t *pool, void *ptr);

/* cp_free for callers that also know the size they asked for: when `size` is not the size
 * given to cp_alloc, CP_ERR_INVALID naming both, and the block stays allocated. A mismatch
 * means the caller's record of the pointer is not the pool's, most likely a stale pointer
 * whose address now belongs to a newer allocation; freeing that would hand memory still in
 * use to the next request, so refusing (a visible leak) is the safe side. */
int cp_free_sized(cp_pool_t *pool, void *ptr, size_t size);

/* 1 when `ptr` is a live allocation of `pool` (then *out_size, unless NULL, is the size it
 * was allocated with), else 0. Changes nothing. */
int cp_pool_lookup(cp_pool_t *pool, void *ptr, size_t *out_size);

/* Where `ptr` lies in `pool` (cp_pool_base_of's answer). */
enum {
  CP_PTR_FOREIGN = 0, /* in none of the pool's segments: not the pool's memory */
  CP_PTR_LIVE = 1,    /* inside a live allocation: its first byte or further in */
  CP_PTR_HELD = 2     /* inside a segment, but in no live allocation (freed, pending, never handed out) */
};
/* Classify `ptr` (CP_PTR_*). For CP_PTR_LIVE and CP_PTR_HELD, *out_base and *out_size (each
 * unless NULL) receive the address and size of the segment that holds it: the whole backend
 * reservation, as torch's getBaseAllocation answers. In page-mapped memory (no one driver
 * allocation: a range mostly without memory behind it) they receive the block that holds it
 * instead. NULL is CP_PTR_FOREIGN. Changes nothing;
 * a live allocation's first byte is found in O(1), any other address in O(segments). */
int cp_pool_base_of(cp_pool_t *pool, const void *ptr, void **out_base, size_t *out_size);

/* Mark `ptr` as used on `stream` too: at free, an event is recorded there and the block
 * is reused only once it completes. Recording the allocation stream is a no-op. No device
 * call is made here, so a bad stream shows only at cp_free. */
int cp_record_stream(cp_pool_t *pool, void *ptr, cp_stream_t stream);

/* Return every wholly free segment to the backend (after reclaiming completed frees). Does
 * nothing while a capture window is open (Note [Capture in the pool]). */
int cp_empty_cache(cp_pool_t *pool);

/* Open and close a capture window (Note [Capture in the pool], capture.c): while one is open,
 * the pool makes no event call and gives no memory back; frees that would record events wait
 * for the last window to close. Windows nest; closing one that is not open is CP_ERR_STATE. */
int cp_pool_capture_begin(cp_pool_t *pool);
int cp_pool_capture_end(cp_pool_t *pool);
/* Capture windows open now, and frees waiting for them to close. */
void cp_pool_capture_state(cp_pool_t *pool, unsigned *out_windows, size_t *out_deferred_frees);
/* The backend the pool was created over (a copy). */
void cp_pool_backend(cp_pool_t *pool, cp_backend_t *out_backend);

/* ------------------------------------------------------------------------------------------
 * Regions (region.c) and their pause (pause.c)
 * ---------------------------------------------------------------------------------------- */

#define CP_REGION_MAX      64  /* names a process may give */
#define CP_REGION_NAME_MAX 127 /* characters of a name */

/* The id of region `name` (1 .. CP_REGION_MAX), made on first use; the same in every pool.
 * CP_ERR_INVALID for an empty or too long name, one with control characters, or past
 * CP_REGION_MAX names. */
int cp_region_id(const char *name, uint32_t *out_id);
/* The name of region `id`, or NULL for an id never given. The text stays valid. */
const char *cp_region_name(uint32_t id);
/* Make `id` (0: none) the calling thread's region; returns the one it was in. */
uint32_t cp_region_enter(uint32_t id);
uint32_t cp_region_of_thread(void);

/* Pause region `tag` (0: every region) of the pool (Note [Paused regions], pause.c): wait for
 * the work of every stream its memory is used on (stream-ordered: those streams only), give
 * its free memory back (unless CP_PAUSE_KEEP_FREE), copy its live blocks to pinned host memory
 * with CP_PAUSE_BACKUP, then
 * unmap and release every page of its memory, live blocks included, keeping the addresses
 * reserved. Until cp_pool_resume its allocations are CP_ERR_STATE; frees work as before.
 * CP_ERR_STATE during a capture, or in a pool without page-mapped memory; CP_ERR_INVALID for
 * CP_PAUSE_BACKUP on a device without copies, or an unknown flag. A region paused already is left as it is. When the
 * wait, a backup copy or the first unmap fails, nothing is paused; a later unmap the device
 * refuses (twice) leaves that memory mapped and reserved, the rest paused, and says so. */
enum {
  CP_PAUSE_BACKUP = 1u,   /* copy the live blocks to host memory first */
  CP_PAUSE_KEEP_FREE = 2u /* free memory is paused and mapped again too (a graph's pool: its replays use it) */
};
int cp_pool_pause(cp_pool_t *pool, uint32_t tag, unsigned flags);
/* Map new memory at every address region `tag` (0: every paused region) had mapped, and copy
 * the backups back: its blocks are where they were, with their bytes when backed up (else
 * undefined). All or nothing per region: when the device refuses (CP_ERR_OOM: no memory for
 * it now), the region stays paused and keeps its backups. CP_ERR_STATE during a capture. */
int cp_pool_resume(cp_pool_t *pool, uint32_t tag);

/* One region's memory in a pool (cp_pool_regions). */
typedef struct cp_region_info_s {
  uint32_t tag;
  int paused;          /* 1 while paused */
  size_t live_bytes;   /* bytes of its live allocations (rounded) */
  size_t live_blocks;  /*   in this many blocks */
  size_t reserved;     /* bytes mapped for it now (counted in reserved_bytes) */
  size_t paused_bytes; /* bytes given back by the pause, mapped again by resume */
  size_t backup_bytes; /* bytes of host memory holding its backups */
  size_t segments;     /* page-mapped segments serving it */
  size_t streams;      /* streams it allocated on */
} cp_region_info_t;
/* The regions the pool has served, by tag, into out[0 .. cap); returns how many there are
 * (possibly more than cap). */
size_t cp_pool_regions(cp_pool_t *pool, cp_region_info_t *out, size_t cap);

/* Set the memory cap in bytes (0 = none), or as a fraction of the device's total memory
 * (0 = unset; NaN or outside [0, 1] is CP_ERR_INVALID; a fraction worth less than one byte
 * caps at one byte). Existing memory is not released: a cap below what is reserved only
 * stops growth. */
int cp_pool_set_memory_cap(cp_pool_t *pool, size_t bytes);
int cp_pool_set_memory_fraction(cp_pool_t *pool, double fraction);
/* CP_OK for a fraction cp_pool_set_memory_fraction accepts, else CP_ERR_INVALID with the
 * message it would give (for callers that must refuse before a pool exists). */
int cp_check_memory_fraction(double fraction);

/* The configuration the pool runs with. */
void cp_pool_config(cp_pool_t *pool, cp_config_t *out_cfg);

/* Snapshot of the statistics (consistent: taken under the lock). */
void cp_pool_stats(cp_pool_t *pool, cp_stats_t *out_stats);
void cp_pool_reset_peak_stats(cp_pool_t *pool);        /* peak := current */
void cp_pool_reset_accumulated_stats(cp_pool_t *pool); /* allocated, freed, counters := 0 */

/* Facts beyond the stats, for reports. */
typedef struct cp_pool_info_s {
  size_t reserved;           /* bytes held from the backend */
  size_t allocated;          /* bytes in live blocks */
  size_t cached_free;        /* bytes in free blocks (reusable) */
  size_t pending_free;       /* bytes freed but waiting for stream events */
  size_t largest_free_block; /* largest free block, any stream */
  size_t segments;
  size_t free_blocks;
  size_t live_blocks;
  size_t pending_blocks;
  size_t streams;     /* streams the pool has seen */
  size_t memory_cap;  /* effective cap in bytes, 0 = none */
  size_t device_free; /* from the backend, 0 when it cannot tell */
  size_t device_total;
  /* Page-mapped segments (expandable_segments:True): page_mapped is 1 when they serve the
   * pool, 0 when the option is off or the device has no page-mapped memory (then plain
   * segments serve it). `reserved` counts their mapped bytes only; address_space is the
   * address space they hold (mapped or not); device_map / device_unmap count the page_map
   * and page_unmap calls made (one per chunk mapped; one per range unmapped). */
  int page_mapped;
  size_t page_segments;
  size_t address_space;
  size_t device_map;
  size_t device_unmap;
  /* Stitched ranges (page_stitching): kept now (in use or not) and their address space (also
   * in address_space); ranges stitched so far; requests served by a kept range. */
  size_t stitched_ranges;
  size_t stitched_space;
  size_t stitches;
  size_t stitch_reuses;
  /* Paused regions (pause.c): bytes given back by pauses (not in `reserved`), and host bytes
   * of their backups. */
  size_t paused_bytes;
  size_t backup_bytes;
  /* The step plan (plan_steps, Note [Learning the step] in core/plan.h): its state (0 off,
   * 1 learning, 2 planning, 3 armed, 4 serving, 5 lost, 6 dropped, 7 adopting), the bytes of the free memory
   * it holds (its bins; 0 when none), the allocations of the (last) plan's step and how many of
   * them it places,
   * plans adopted and dropped, allocations the plans served and those the pool served while a
   * plan was held, and the microseconds spent computing plans. */
  size_t plan_state;
  size_t plan_bytes;
  size_t plan_step_allocs;
  size_t plan_planned;
  size_t plans;
  size_t plan_drops;
  size_t plan_served;
  size_t plan_missed;
  size_t plan_us;
} cp_pool_info_t;
void cp_pool_info(cp_pool_t *pool, cp_pool_info_t *out_info);

/* ------------------------------------------------------------------------------------------
 * Out of memory: the figures at the moment of failure (oom.c) and the report (report.c)
 * ---------------------------------------------------------------------------------------- */

/* Streams named one by one in an out-of-memory record; the rest are summed in `other`. */
#define CP_OOM_STREAMS 8

/* One stream's share of the pool's unused memory: the blocks that serve it (its allocation
 * stream's free blocks, and its PENDING blocks, which return to it). */
typedef struct cp_oom_stream_s {
  cp_stream_t stream;        /* 0 in `other` */
  size_t cached_free;        /* bytes in free blocks serving this stream */
  size_t free_blocks;        /*   in this many blocks */
  size_t largest_free_block; /*   the largest of them */
  size_t pending_free;       /* bytes freed but waiting for stream events */
  size_t pending_blocks;     /*   in this many blocks */
} cp_oom_stream_t;

/* What the pool held when an allocation failed, read under the pool lock in the failing call
 * (the device's free and total memory are asked right after, without the lock). The report
 * (cp_oom_format) is written from this record only, so the exception's text and the figures
 * a binding shows from cp_pool_last_oom cannot disagree. Invariants:
 *   reserved == allocated + cached_free + pending_free + (bytes of blocks being mapped or
 *               unmapped; 0 outside a page-mapped pool's growth)  -- in a plain pool exactly
 *   cached_free == sum over streams[0..stream_count) and other of cached_free (same for
 *               pending_free, free_blocks, pending_blocks)
 *   fragmentation == 1 - largest_free_block / cached_free  (0 when cached_free == 0) */
typedef struct cp_oom_info_s {
  uint64_t sequence; /* 1 for the pool's first failure, counting up; 0: no failure recorded */
  int64_t time_ns;   /* CLOCK_REALTIME at the failure (ns since the epoch) */
  int device;
  const char *backend; /* "sim", "cuda" (static text) */
  cp_stream_t stream;  /* the stream the request was made on */
  size_t requested;    /* bytes asked for */
  size_t rounded;      /* bytes after the pool's rounding (0: larger than any address space) */
  size_t reserved;     /* bytes held from the device */
  size_t allocated;    /* bytes in live blocks */
  size_t cached_free;  /* bytes in free blocks (reusable) */
  size_t largest_free_block;
  double fragmentation;
  size_t pending_free; /* bytes freed but waiting for stream events */
  size_t segments;
  size_t live_blocks;
  size_t free_blocks;
  size_t pending_blocks;
  size_t device_free; /* 0 and 0 when the device cannot tell */
  size_t device_total;
  size_t memory_cap; /* effective cap in bytes, 0 = none */
  size_t paused;     /* bytes paused regions gave back: their blocks are counted above, with no memory behind */
  int64_t num_ooms;  /* the num_ooms statistic, this failure included */
  /* The event log's sequence number of this failed allocation (cp_pool_event_log), or
   * UINT64_MAX when no log was kept. */
  uint64_t log_event;
  size_t stream_count; /* entries of streams[] used: most unused bytes first */
  cp_oom_stream_t streams[CP_OOM_STREAMS];
  size_t other_streams; /* streams summed in `other` */
  cp_oom_stream_t other;
} cp_oom_info_t;

/* The record of the pool's latest out-of-memory failure: 1 and *out filled, or 0 (and *out
 * zeroed) when the pool has not failed yet. */
int cp_pool_last_oom(cp_pool_t *pool, cp_oom_info_t *out);

/* The figures as they are now, for a request of `size` bytes on `stream` (sequence 0, nothing
 * recorded or counted). */
void cp_pool_oom_now(cp_pool_t *pool, size_t size, cp_stream_t stream, cp_oom_info_t *out);

/* Write the out-of-memory report of `info` into buf (snprintf rules). It begins with
 * "Tried to allocate ...". */
int cp_oom_format(const cp_oom_info_t *info, char *buf, size_t buf_size);

/* cp_oom_format of cp_pool_oom_now(pool, size, stream 0). */
int cp_pool_oom_report(cp_pool_t *pool, size_t size, char *buf, size_t buf_size);

/* Walk the whole pool and count invariant violations (0 = healthy). When `out` is not
 * NULL, each violation is described there, one per line. */
size_t cp_pool_check(cp_pool_t *pool, FILE *out);

/* Bytes allocated to live blocks and reserved from the backend, now (cheap). */
void cp_pool_usage(cp_pool_t *pool, size_t *out_allocated, size_t *out_reserved);

/* ------------------------------------------------------------------------------------------
 * Replay of allocation traces (replay.c)
 * ---------------------------------------------------------------------------------------- */

/* The trace's record, cp_trace_event_t, and its actions: core/trace_event.h. */

typedef struct cp_replay_result_s {
  uint64_t events;       /* events fed */
  uint64_t allocs;       /* allocations made */
  uint64_t frees;        /* frees made */
  uint64_t skipped;      /* other devices' events, size-0 allocations, and their frees */
  uint64_t bad_events;   /* frees of unknown ids, allocations of live ids */
  uint64_t releases;     /* RELEASE events (each an empty_cache) */
  size_t peak_allocated; /* bytes in live blocks (rounded sizes) */
  size_t peak_requested; /* bytes the trace asked for, live at once */
  size_t peak_reserved;
  size_t cached_free_at_peak;  /* at the peak of reserved: bytes cached but free */
  size_t largest_free_at_peak; /*   and the largest free block */
  uint64_t device_allocs;      /* backend reserves and releases during the replay */
  uint64_t device_frees;
  int oom;            /* 1 when an allocation failed; the replay stops there */
  uint64_t oom_event; /* its index */
  uint64_t oom_size;
  uint64_t ns; /* host time spent in cp_replay_feed */
} cp_replay_result_t;

typedef struct cp_replay_s cp_replay_t;

/* Replay the events of `device` (-1: all devices) into `pool`. */
int cp_replay_create(cp_pool_t *pool, int device, cp_replay_t **out_replay);
/* Feed the next `n` events. Returns CP_ERR_OOM at the first allocation that fails (the
 * result says where; later feeds do nothing), CP_OK otherwise. */
int cp_replay_feed(cp_replay_t *replay, const cp_trace_event_t *events, size_t n);
void cp_replay_result(const cp_replay_t *replay, cp_replay_result_t *out);
/* The highest allocated and reserved bytes since the previous call (for curves). */
void cp_replay_window(cp_replay_t *replay, size_t *out_max_allocated, size_t *out_max_reserved);
/* One block live when a replay begins (cp_replay_seed_segment). */
typedef struct cp_seed_block_s {
  uint64_t id;      /* the trace id its FREE event will name */
  size_t offset;    /* from the segment's start; a multiple of the granule */
  size_t size;      /* the block's bytes; a positive multiple of the granule */
  size_t requested; /* bytes asked for: 1..size */
} cp_seed_block_t;

/* Seed the replay with memory the traced program held before its first event (a trace that
 * begins mid-run): reserve one segment of exactly `segment_size` bytes (a positive multiple
 * of the granule) through the backend for `stream` and `kind` (CP_KIND_SMALL or
 * CP_KIND_LARGE), counted as any segment is (stats, reserved, device allocs), with the `n`
 * blocks LIVE at their offsets and every gap between them one FREE block. Each block's id is
 * registered, so a later FREE event of it frees the block. The blocks must be sorted by
 * offset, not overlap, lie inside the segment and have distinct ids that are not live in the
 * replay: otherwise CP_ERR_INVALID naming the block, and nothing changes. CP_ERR_OOM when the
 * backend (or the cap) cannot hold the segment; nothing changes then either. */
int cp_replay_seed_segment(cp_replay_t *replay, cp_stream_t stream, int kind, size_t segment_size,
                           const cp_seed_block_t *blocks, size_t n);
/* Free every allocation still live, then the replay itself (not the pool). */
void cp_replay_destroy(cp_replay_t *replay);
/* Work that uses the block [ptr, ptr + size) on `stream`, queued by the replay just before it
 * frees the block (the traced program's last use of it), e.g. a launch on a simulated device
 * that runs behind the host (Note [Simulated asynchrony] in backend/sim.h). NULL: none. */
typedef void (*cp_replay_use_fn)(void *arg, uintptr_t ptr, size_t size, cp_stream_t stream);
void cp_replay_set_use(cp_replay_t *replay, cp_replay_use_fn use, void *arg);

/* ------------------------------------------------------------------------------------------
 * The event log (oom.c): the pool's latest allocation events, in trace form, so that the
 * history that led to a failure can be replayed under other configurations.
 * ---------------------------------------------------------------------------------------- */

/* In the event log only (never in a trace): an allocation that failed (id 0). */
enum { CP_TRACE_ALLOC_FAILED = 2 };

/* Keep the latest `capacity` events (rounded up to a power of two; 0 = none, the default):
 * every successful allocation (ALLOC, id = address, size = bytes asked for, stream = the
 * request's), every free (FREE, the same id and size, the block's allocation stream) and
 * every failed allocation (CP_TRACE_ALLOC_FAILED). time_ns is -1; device is the backend's.
 * Events are numbered from 0 in the order they happen, across capacity changes; a change
 * drops the events kept so far. CP_ERR_INVALID above CP_EVENT_LOG_MAX events, CP_ERR_HOST_OOM
 * when the ring cannot be had (the old one is kept then). */
#define CP_EVENT_LOG_MAX ((size_t)1 << 30)
int cp_pool_set_event_log(cp_pool_t *pool, size_t capacity);

/* A copy of the event log and of the live blocks, taken together under the pool lock. */
typedef struct cp_event_log_s {
  cp_trace_event_t *events; /* oldest first */
  size_t n_events;
  uint64_t first;         /* the number of events[0] */
  uint64_t next;          /* the number the next event will get */
  size_t capacity;        /* the log's capacity (0: no log kept) */
  cp_trace_event_t *live; /* an ALLOC event per live block: id, size asked for, stream */
  size_t n_live;
} cp_event_log_t;

/* Fill *out (its arrays malloc'ed; cp_event_log_release frees them). CP_ERR_HOST_OOM leaves
 * *out empty. */
int cp_pool_event_log(cp_pool_t *pool, cp_event_log_t *out);
void cp_event_log_release(cp_event_log_t *log);

#endif /* CP_H */
