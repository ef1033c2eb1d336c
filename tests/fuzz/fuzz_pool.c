/* fuzz_pool.c — libFuzzer harness: input bytes become a sequence of pool operations on a
 * simulated device (allocations of every size class and absurd sizes, frees, bad frees,
 * stream switches, record_stream, event completions, empty_cache, cap and fraction changes,
 * injected device failures, allocations in regions, a region paused and resumed, checkpoints
 * and their restore), each followed by the pool's own invariant check and a shadow
 * model that knows what the caller holds. Every allocation and record_stream queues work that
 * uses the block on its stream, which completes only with the stream (Note [Simulated
 * asynchrony] in backend/sim.h); the device faults are checked after every operation.
 *
 * The shadow model asserts, after every operation:
 *   - live blocks never overlap (each live block's exact size is read from the
 *     allocated_bytes delta of its allocation, and checked against the rounding rules);
 *   - every live allocation still holds the byte pattern written into it at allocation
 *     (head, tail and spread samples), so a block handed out twice is caught by its bytes;
 *   - a block freed with recorded streams is not handed out again before the events the free
 *     recorded on those streams have completed. The harness sits between the pool and the
 *     simulated device (a pass-through backend) and mirrors each stream's recorded and
 *     completed event sequence numbers, so it knows exactly which events guard which range;
 *   - every byte is accounted for: allocated bytes and allocation counts equal what the
 *     caller holds (per size class), allocated + cached free + pending free == reserved ==
 *     what the device has handed out <= capacity, the effective cap is what was set;
 *   - a failing call explains itself (non-empty last error) and fails only for a reason:
 *     an injected device failure, a bad pointer, or memory that really is exhausted;
 *   - cp_pool_lookup knows every live allocation and its size, and nothing else;
 *   - a free, sized free or record_stream of a pointer that is not live, and a sized free
 *     with the wrong size, fail with CP_ERR_INVALID and change nothing;
 *   - a checkpoint changes nothing and holds what the caller holds; its restore frees every
 *     live block and makes the checkpoint's live again at their addresses, handed over only
 *     once other streams' work on them is done; a refused restore changes nothing;
 *   - a region paused (with a backup) and resumed keeps every live block at its address with
 *     its bytes; while paused, the pool is whole, what it gave back is out of reserved and of
 *     the device, and nothing faulted (the pause waited for the work queued on it);
 *   - a block described for another process (cp_pool_share) is reached, through the
 *     description, at its own bytes: its plain segment, or handles mapped whole side by side;
 *     it stays marked shared until freed, and a pause of its region is refused meanwhile.
 * With page-mapped segments (expandable_segments:True, the configurations of paged_configs):
 *   - every byte of every live block is mapped, and no two live blocks share a byte of
 *     physical memory, whatever addresses they are mapped at (cp_sim_vmm_resolve);
 *   - a live block's first byte stays on the page and offset it had when handed out, so its
 *     data survives the mapping and unmapping of other chunks (the bytes are checked too);
 *   - the pool's reserved bytes are the bytes the device has mapped, every page is mapped
 *     exactly once, and the device's address ranges are the pool's page-mapped segments;
 *   - injected failures name every call kind, the page-mapped ones included.
 * With page stitching (page_stitching:True, the configurations of stitch_configs):
 *   - every allocation counts in the large class; a stitched block is whole pages (a kept
 *     range may be up to 1/8 larger than the request's pages);
 *   - a page may be mapped at two addresses (its segment and a stitched range), so the checks
 *     above become: the device's ranges are the pool's page-mapped segments and its stitched
 *     ranges, the bytes mapped are the reserved bytes and the stitched ranges' bytes, the
 *     mappings are the pages and the stitched ranges' pages;
 *   - no two live blocks share a byte of physical memory still, and no live block shares one
 *     with a block freed with recorded streams whose events have not completed, whatever
 *     addresses either is mapped at (a pending stitched block's pages stay out of use, and
 *     so do a pending block's pages out of new stitched ranges).
 * At the end of the input everything is freed and given back (or, in some inputs, the pool is
 * destroyed with allocations still live and frees still pending): the device must hold
 * nothing, no reservation, no event, no page-mapped range, page or mapping, once the pool is
 * destroyed. */
#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/sim.h"
#include "core/checkpoint.h"
#include "core/cp.h"
#include "core/share.h"
#include "soak.h"

size_t fz_ops_run;
uint64_t fz_faults_run;
size_t fz_pauses_run, fz_windows_run, fz_deferred_run, fz_shares_run, fz_shared_refusals_run;
size_t fz_check_every = 1;
size_t fz_pause_every = 1;

#define MiB ((size_t)1024 * 1024)

#define NSLOTS     24
#define NSTREAMS   4 /* stream handles 0 (the default stream) .. 3 */
#define MAX_OPS    400
#define MAX_GUARDS (MAX_OPS + 8)
#define HEAD_BYTES 16 /* pattern bytes written at each end of an allocation */
#define SPREAD     8  /* and at this many places in between */
/* The call kinds the pool makes (plain segments, events, mem_info): the fault byte of an input
 * names one of them, so the committed corpus means what it did before the page-mapped kinds. */
#define FZ_POOL_CALL_KINDS (CP_SIM_MEM_INFO + 1)

/* ------------------------------------------------------------------------------------------
 * Reading the input
 * ---------------------------------------------------------------------------------------- */

typedef struct reader_s {
  const uint8_t *p;
  size_t n;
} reader_t;

static uint8_t rd_u8(reader_t *r) {
  if (r->n == 0) return 0;
  r->n--;
  return *r->p++;
}

static uint32_t rd_u16(reader_t *r) {
  uint32_t lo = rd_u8(r);
  return lo | (uint32_t)rd_u8(r) << 8;
}

static uint32_t rd_u32(reader_t *r) {
  uint32_t lo = rd_u16(r);
  return lo | rd_u16(r) << 16;
}

/* ------------------------------------------------------------------------------------------
 * The pass-through backend: forwards every call to the simulated device and mirrors the
 * stream and event sequence numbers, so that the model knows which event completions a
 * pending range waits for.
 * ---------------------------------------------------------------------------------------- */

typedef struct mirror_event_s {
  uint8_t stream;
  uint64_t seq; /* 0 = never recorded (or destroyed) */
} mirror_event_t;

typedef struct capture_s {
  uint8_t stream;
  uint64_t seq;
} capture_t;

typedef struct dev_s {
  cp_sim_t *sim;
  cp_backend_t real;
  uint64_t recorded[NSTREAMS];  /* launches queued on the stream so far (Note [Simulated asynchrony]) */
  uint64_t completed[NSTREAMS]; /* every launch up to this one has completed */
  mirror_event_t *events;       /* indexed by the device's event handle */
  size_t events_cap;
  capture_t captured[3 * NSTREAMS]; /* records made during the current operation */
  size_t ncaptured;
  int overflow; /* more records in one operation than fit above */
} dev_t;

static int op_index = -1; /* for messages only; reset at the start of every input */

#define FZ_ASSERT(cond, ...)                                                                                      \
  do {                                                                                                            \
    if (!(cond)) {                                                                                                \
      fprintf(stderr, "fuzz_pool: %s:%d: assertion failed: %s (op %d)\n  ", __FILE__, __LINE__, #cond, op_index); \
      fprintf(stderr, __VA_ARGS__);                                                                               \
      fprintf(stderr, "\n  last error: %s\n", cp_last_error());                                                   \
      abort();                                                                                                    \
    }                                                                                                             \
  } while (0)

static mirror_event_t *dev_event(dev_t *d, cp_event_t ev) {
  FZ_ASSERT(ev < ((cp_event_t)1 << 24), "event handle %" PRIuPTR " out of the expected range", ev);
  if (ev >= d->events_cap) {
    size_t cap = d->events_cap ? d->events_cap : 64;
    while (cap <= ev) cap *= 2;
    mirror_event_t *grown = realloc(d->events, cap * sizeof *grown);
    FZ_ASSERT(grown != NULL, "no host memory for the event mirror");
    memset(grown + d->events_cap, 0, (cap - d->events_cap) * sizeof *grown);
    d->events = grown;
    d->events_cap = cap;
  }
  return &d->events[ev];
}

static int dev_reserve(void *ctx, size_t size, uintptr_t *out_addr) {
  dev_t *d = ctx;
  return d->real.reserve(d->real.ctx, size, out_addr);
}

static int dev_release(void *ctx, uintptr_t addr, size_t size) {
  dev_t *d = ctx;
  int rc = d->real.release(d->real.ctx, addr, size);
  /* cudaFree waits for the whole device. */
  if (rc == CP_OK) memcpy(d->completed, d->recorded, sizeof d->completed);
  return rc;
}

static int dev_event_create(void *ctx, cp_event_t *out_event) {
  dev_t *d = ctx;
  int rc = d->real.event_create(d->real.ctx, out_event);
  if (rc == CP_OK) *dev_event(d, *out_event) = (mirror_event_t){0, 0};
  return rc;
}

static int dev_event_destroy(void *ctx, cp_event_t event) {
  dev_t *d = ctx;
  int rc = d->real.event_destroy(d->real.ctx, event);
  if (rc == CP_OK) *dev_event(d, event) = (mirror_event_t){0, 0};
  return rc;
}

static int dev_event_record(void *ctx, cp_event_t event, cp_stream_t stream) {
  dev_t *d = ctx;
  int rc = d->real.event_record(d->real.ctx, event, stream);
  if (rc != CP_OK) return rc;
  FZ_ASSERT(stream < NSTREAMS, "the pool recorded an event on stream %" PRIuPTR ", never used", stream);
  /* A marker after the stream's launches so far (seq - 1 of them); 0 stays "never recorded". */
  uint64_t seq = d->recorded[stream] + 1;
  *dev_event(d, event) = (mirror_event_t){(uint8_t)stream, seq};
  if (d->ncaptured < sizeof d->captured / sizeof d->captured[0]) {
    d->captured[d->ncaptured++] = (capture_t){(uint8_t)stream, seq};
  } else {
    d->overflow = 1;
  }
  return rc;
}

static int dev_event_query(void *ctx, cp_event_t event, int *out_done) {
  dev_t *d = ctx;
  int rc = d->real.event_query(d->real.ctx, event, out_done);
  if (rc == CP_OK) {
    const mirror_event_t *m = dev_event(d, event);
    int expect = m->seq == 0 || d->completed[m->stream] + 1 >= m->seq;
    FZ_ASSERT(*out_done == expect, "event %" PRIuPTR ": device says done=%d, mirror says %d", event, *out_done, expect);
  }
  return rc;
}

static int dev_event_synchronize(void *ctx, cp_event_t event) {
  dev_t *d = ctx;
  int rc = d->real.event_synchronize(d->real.ctx, event);
  if (rc == CP_OK) {
    const mirror_event_t *m = dev_event(d, event);
    if (m->seq != 0 && d->completed[m->stream] < m->seq - 1) d->completed[m->stream] = m->seq - 1;
  }
  return rc;
}

static int dev_mem_info(void *ctx, size_t *out_free, size_t *out_total) {
  dev_t *d = ctx;
  return d->real.mem_info(d->real.ctx, out_free, out_total);
}

/* Page-mapped entries: forwarded as they are (the shadow model reads the device's page-mapped
 * state through the sim's queries). NULL entries stay NULL (a device without them). */
static int dev_vmm_granularity(void *ctx, size_t *out_bytes) {
  dev_t *d = ctx;
  return d->real.vmm_granularity(d->real.ctx, out_bytes);
}

static int dev_va_reserve(void *ctx, size_t size, uintptr_t *out_addr) {
  dev_t *d = ctx;
  return d->real.va_reserve(d->real.ctx, size, out_addr);
}

static int dev_va_free(void *ctx, uintptr_t addr, size_t size) {
  dev_t *d = ctx;
  return d->real.va_free(d->real.ctx, addr, size);
}

static int dev_page_create(void *ctx, size_t size, cp_page_t *out_page) {
  dev_t *d = ctx;
  return d->real.page_create(d->real.ctx, size, out_page);
}

static int dev_page_release(void *ctx, cp_page_t page) {
  dev_t *d = ctx;
  return d->real.page_release(d->real.ctx, page);
}

static int dev_page_map(void *ctx, uintptr_t addr, size_t size, cp_page_t page) {
  dev_t *d = ctx;
  return d->real.page_map(d->real.ctx, addr, size, page);
}

static int dev_page_unmap(void *ctx, uintptr_t addr, size_t size) {
  dev_t *d = ctx;
  return d->real.page_unmap(d->real.ctx, addr, size);
}

static int dev_page_set_access(void *ctx, uintptr_t addr, size_t size) {
  dev_t *d = ctx;
  return d->real.page_set_access(d->real.ctx, addr, size);
}

static int dev_stream_capturing(void *ctx, cp_stream_t stream, int *out_capturing) {
  dev_t *d = ctx;
  return d->real.stream_capturing(d->real.ctx, stream, out_capturing);
}

/* A pause's backups: forwarded as they are. */
static int dev_host_alloc(void *ctx, size_t size, void **out_ptr) {
  dev_t *d = ctx;
  return d->real.host_alloc(d->real.ctx, size, out_ptr);
}

static int dev_host_free(void *ctx, void *ptr) {
  dev_t *d = ctx;
  return d->real.host_free(d->real.ctx, ptr);
}

static int dev_copy_to_host(void *ctx, void *dst, uintptr_t src, size_t size) {
  dev_t *d = ctx;
  return d->real.copy_to_host(d->real.ctx, dst, src, size);
}

static int dev_copy_to_device(void *ctx, uintptr_t dst, const void *src, size_t size) {
  dev_t *d = ctx;
  return d->real.copy_to_device(d->real.ctx, dst, src, size);
}

static void dev_backend(dev_t *d, cp_backend_t *out) {
  *out = d->real;
  out->ctx = d;
  out->reserve = dev_reserve;
  out->release = dev_release;
  out->event_create = dev_event_create;
  out->event_destroy = dev_event_destroy;
  out->event_record = dev_event_record;
  out->event_query = dev_event_query;
  out->event_synchronize = dev_event_synchronize;
  out->mem_info = dev_mem_info;
  out->stream_capturing = d->real.stream_capturing != NULL ? dev_stream_capturing : NULL;
  if (d->real.vmm_granularity != NULL) {
    out->vmm_granularity = dev_vmm_granularity;
    out->va_reserve = dev_va_reserve;
    out->va_free = dev_va_free;
    out->page_create = dev_page_create;
    out->page_release = dev_page_release;
    out->page_map = dev_page_map;
    out->page_unmap = dev_page_unmap;
    out->page_set_access = dev_page_set_access;
  }
  out->host_alloc = dev_host_alloc;
  out->host_free = dev_host_free;
  out->copy_to_host = dev_copy_to_host;
  out->copy_to_device = dev_copy_to_device;
}

static void dev_complete(dev_t *d, unsigned stream) {
  cp_sim_complete(d->sim, stream);
  d->completed[stream] = d->recorded[stream];
}

static void dev_complete_all(dev_t *d) {
  cp_sim_complete_all(d->sim);
  for (unsigned s = 0; s < NSTREAMS; s++) d->completed[s] = d->recorded[s];
}

/* ------------------------------------------------------------------------------------------
 * The shadow model
 * ---------------------------------------------------------------------------------------- */

typedef struct slot_s {
  uint8_t *ptr;   /* NULL: the slot holds nothing */
  cp_page_t page; /* page-mapped pools: the page behind its first byte, and where in it */
  size_t page_off;
  size_t requested;
  size_t rounded;    /* cp_round_size */
  size_t block;      /* the block's real size (allocated_bytes grew by this much) */
  int small;         /* served from the small pool */
  unsigned stream;   /* allocation stream */
  unsigned recorded; /* other streams recorded on it (bit per stream) */
  uint32_t seed;     /* of its byte pattern */
  uint32_t tag;      /* the region it was allocated in (0: none) */
  int shared;        /* described for another process (cp_pool_share) since its allocation */
} slot_t;

/* A run of physical memory: bytes [off, off + len) of a page of the simulated device. */
typedef struct piece_s {
  cp_page_t page;
  size_t off, len;
  int slot;
} piece_t;

/* A range freed with recorded streams: not to be handed out while any of its events runs. */
typedef struct guard_s {
  uintptr_t addr;
  size_t size;
  size_t nev;
  capture_t ev[3 * NSTREAMS];
  piece_t *pieces; /* page-mapped pools: its physical memory (heap), while it is waited for */
  size_t npieces;
} guard_t;

typedef struct model_s {
  cp_config_t cfg;
  size_t capacity;
  size_t memory_cap;      /* as set: bytes, 0 = none */
  double memory_fraction; /* as set: 0 = unset */
  int total_known;        /* the pool knows the device's total (a fraction applies) */
  unsigned stream;        /* current stream */
  uint32_t next_seed;
  slot_t slot[NSLOTS];
  guard_t guard[MAX_GUARDS];
  size_t nguards;
  uintptr_t stale[8]; /* recently freed addresses, for double frees */
  size_t nstale;
  unsigned region; /* allocations go to region_ids[region] (0: none) */
  uint32_t region_ids[3];
  int paged_cfg;    /* a page-mapped configuration (expandable_segments:True) */
  int paged;        /* the pool serves from page-mapped segments (cp_pool_info) */
  int stitch;       /* and stitches pages (page_stitching:True) */
  int unmap_failed; /* a page_unmap or va_free failure was armed (a stitched range may be kept partly mapped) */
  size_t chunk[2];  /* page-mapped: the chunk of the small [0] and large [1] pool */
  piece_t *pieces;  /* scratch of check_all: the physical pieces of every live block */
  size_t pieces_cap;
  cp_checkpoint_t *ck;    /* the last checkpoint taken (do_checkpoint), NULL: none */
  slot_t ck_slot[NSLOTS]; /* the slots when it was taken */
} model_t;

static uint8_t pattern_byte(uint32_t seed, size_t off) {
  uint64_t x = (uint64_t)seed * 0x9e3779b97f4a7c15ull ^ (uint64_t)off * 0xc2b2ae3d27d4eb4full;
  x ^= x >> 29;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 32;
  return (uint8_t)x;
}

/* Visit the sampled offsets of an allocation: both ends and SPREAD places in between. */
#define FOR_EACH_SAMPLE(len, off, body)                        \
  do {                                                         \
    size_t len_ = (len);                                       \
    for (size_t i_ = 0; i_ < 2 * HEAD_BYTES + SPREAD; i_++) {  \
      size_t off;                                              \
      if (i_ < HEAD_BYTES)                                     \
        off = i_;                                              \
      else if (i_ < 2 * HEAD_BYTES)                            \
        off = len_ - 1 - (i_ - HEAD_BYTES);                    \
      else                                                     \
        off = len_ / (SPREAD + 1) * (i_ - 2 * HEAD_BYTES + 1); \
      if (off >= len_) continue;                               \
      body;                                                    \
    }                                                          \
  } while (0)

static void fill_slot(const slot_t *s) { FOR_EACH_SAMPLE(s->requested, off, s->ptr[off] = pattern_byte(s->seed, off)); }

static void verify_slot(const slot_t *s, int index) {
  FOR_EACH_SAMPLE(s->requested, off, {
    FZ_ASSERT(s->ptr[off] == pattern_byte(s->seed, off),
              "slot %d (%p, %zu bytes): byte %zu is %#x, expected %#x: someone else wrote here", index, (void *)s->ptr,
              s->requested, off, s->ptr[off], pattern_byte(s->seed, off));
  });
}

static int guard_active(const dev_t *d, const guard_t *g) {
  for (size_t i = 0; i < g->nev; i++) {
    if (d->completed[g->ev[i].stream] + 1 < g->ev[i].seq) return 1; /* seq - 1 launches before it */
  }
  return 0;
}

static void prune_guards(model_t *m, const dev_t *d) {
  size_t w = 0;
  for (size_t i = 0; i < m->nguards; i++) {
    if (guard_active(d, &m->guard[i]))
      m->guard[w++] = m->guard[i];
    else
      free(m->guard[i].pieces);
  }
  m->nguards = w;
}

static int overlaps(uintptr_t a, size_t an, uintptr_t b, size_t bn) { return a < b + bn && b < a + an; }

/* What the pool's configuration makes of a request: the segment it would reserve (0 when
 * that overflows, as for a request whose rounding overflows). */
static size_t segment_for(const cp_config_t *cfg, size_t rounded) {
  if (rounded == 0) return 0;
  if (rounded <= cfg->small_size) return cfg->small_segment;
  if (rounded < cfg->min_large_alloc) return cfg->large_segment;
  if (rounded > SIZE_MAX - (cfg->round_large - 1)) return 0;
  return (rounded + cfg->round_large - 1) / cfg->round_large * cfg->round_large;
}

static size_t expected_cap(const model_t *m) {
  size_t cap = m->memory_cap;
  if (m->memory_fraction > 0 && m->total_known) {
    size_t f = (size_t)(m->memory_fraction * (double)m->capacity);
    if (f == 0) f = 1; /* a fraction too small for one byte still caps */
    if (cap == 0 || f < cap) cap = f;
  }
  return cap;
}

static int64_t cur(const cp_stats_t *s, cp_stat_family_t fam, int kind) { return s->family[fam][kind].current; }

static int piece_cmp(const void *a, const void *b) {
  const piece_t *x = a, *y = b;
  if (x->page != y->page) return x->page < y->page ? -1 : 1;
  return x->off < y->off ? -1 : x->off > y->off;
}

static void push_piece(piece_t **pieces, size_t *n, size_t *cap, piece_t p) {
  if (*n == *cap) {
    size_t grown_cap = *cap ? 2 * *cap : 256;
    piece_t *grown = realloc(*pieces, grown_cap * sizeof *grown);
    FZ_ASSERT(grown != NULL, "no host memory for the pieces");
    *pieces = grown;
    *cap = grown_cap;
  }
  (*pieces)[(*n)++] = p;
}

/* The physical pieces of the mapped bytes [addr, addr + len), tagged `tag`, appended. */
static void pieces_of(const dev_t *d, uintptr_t addr, size_t len, int tag, piece_t **pieces, size_t *n, size_t *cap) {
  uintptr_t a = addr, end = addr + len;
  while (a < end) {
    cp_page_t page = 0;
    size_t off = 0, psize = 0;
    FZ_ASSERT(cp_sim_vmm_resolve(d->sim, a, &page, &off, &psize) == CP_OK,
              "[%#" PRIxPTR ", +%zu) (slot %d, or freed and waited for when < 0): byte %#" PRIxPTR " is not mapped",
              addr, len, tag, a);
    size_t run = psize - off < end - a ? psize - off : end - a;
    push_piece(pieces, n, cap, (piece_t){page, off, run, tag});
    a += run;
  }
}

/* Page-mapped pools: every byte of every live block is mapped, its first byte still lies on
 * the page it lay on when it was handed out (its data was not moved, nor the memory behind it
 * replaced), and no two live blocks share a byte of physical memory, whatever addresses they
 * are mapped at; nor does one with a block freed with recorded streams still waited for. */
static void check_physical(model_t *m, const dev_t *d) {
  size_t n = 0;
  for (int i = 0; i < NSLOTS; i++) {
    const slot_t *s = &m->slot[i];
    if (s->ptr == NULL) continue;
    cp_page_t page = 0;
    size_t off = 0;
    FZ_ASSERT(cp_sim_vmm_resolve(d->sim, (uintptr_t)s->ptr, &page, &off, NULL) == CP_OK && page == s->page &&
                  off == s->page_off,
              "slot %d (%p): now on page %" PRIuPTR " at %zu, handed out on page %" PRIuPTR " at %zu", i,
              (void *)s->ptr, page, off, s->page, s->page_off);
    pieces_of(d, (uintptr_t)s->ptr, s->block, i, &m->pieces, &n, &m->pieces_cap);
  }
  /* The memory of blocks freed and still waited for: out of use (tags below 0). Such blocks
   * are disjoint from each other too (one was in use while the other was, or handed out
   * after the other's events had completed). */
  for (size_t g = 0; g < m->nguards; g++) {
    const guard_t *gd = &m->guard[g];
    for (size_t k = 0; k < gd->npieces; k++) {
      piece_t p = gd->pieces[k];
      p.slot = -1 - (int)g;
      push_piece(&m->pieces, &n, &m->pieces_cap, p);
    }
  }
  if (n > 1) qsort(m->pieces, n, sizeof m->pieces[0], piece_cmp);
  for (size_t k = 1; k < n; k++) {
    const piece_t *p = &m->pieces[k - 1], *q = &m->pieces[k];
    FZ_ASSERT(p->page != q->page || p->off + p->len <= q->off,
              "slots %d and %d share physical memory (a slot < 0 is a freed block still waited for): page %" PRIuPTR
              " [%zu, +%zu) and [%zu, +%zu)",
              p->slot, q->slot, p->page, p->off, p->len, q->off, q->len);
  }
}

/* What the device holds of page-mapped memory agrees with the pool. */
static void check_vmm(model_t *m, const dev_t *d, const cp_pool_info_t *in) {
  size_t pages = cp_sim_vmm_pages(d->sim), maps = cp_sim_vmm_mappings(d->sim);
  size_t page_bytes = cp_sim_vmm_page_bytes(d->sim), mapped = cp_sim_vmm_mapped_bytes(d->sim);
  /* Each page is mapped exactly once in its segment while the pool holds it: none created
   * and forgotten, none unmapped and not released. With stitching, each handle of a stitched
   * range is mapped once more there (a handle may span several granules: at most one mapping
   * per granule), and nowhere else. */
  size_t granularity = m->chunk[1];
  /* A stitched range the device refused to unmap or give back (dropped, or undoing a failed
   * stitch) is kept with some or none of its pages mapped; that needs such a failure. */
  size_t stitched_mapped = mapped >= page_bytes ? mapped - page_bytes : 0;
  FZ_ASSERT(!m->stitch || (in->stitched_space % granularity == 0 && stitched_mapped % granularity == 0),
            "stitched ranges of %zu bytes, %zu mapped: not whole pages", in->stitched_space, stitched_mapped);
  FZ_ASSERT(mapped >= page_bytes && stitched_mapped <= in->stitched_space &&
                (stitched_mapped == in->stitched_space || m->unmap_failed),
            "the device has %zu bytes of pages, %zu bytes mapped; stitched ranges hold %zu bytes", page_bytes, mapped,
            in->stitched_space);
  size_t stitched_pages = m->stitch ? stitched_mapped / granularity : 0;
  FZ_ASSERT(maps >= pages + (stitched_pages != 0) && maps - pages <= stitched_pages,
            "the device holds %zu pages in %zu mappings, %zu pages mapped stitched", pages, maps, stitched_pages);
  FZ_ASSERT(cp_sim_vmm_ranges(d->sim) == in->page_segments + in->stitched_ranges,
            "the device holds %zu ranges, the pool %zu segments and %zu stitched ranges", cp_sim_vmm_ranges(d->sim),
            in->page_segments, in->stitched_ranges);
  FZ_ASSERT(m->stitch || (in->stitched_ranges == 0 && in->stitches == 0), "a pool that does not stitch stitched");
  if (!m->paged) {
    FZ_ASSERT(pages == 0 && cp_sim_vmm_ranges(d->sim) == 0, "a pool of plain segments holds page-mapped memory");
    return;
  }
  FZ_ASSERT(in->page_mapped == 1, "the pool stopped serving page-mapped segments");
  FZ_ASSERT(in->reserved == page_bytes, "the pool says %zu bytes reserved, the device has %zu bytes of pages",
            in->reserved, page_bytes);
  FZ_ASSERT(cp_sim_live_reservations(d->sim) == 0, "a page-mapped pool holds %zu plain reservations",
            cp_sim_live_reservations(d->sim));
  check_physical(m, d);
}

/* Everything the model can say about the pool now. */
static void check_all(cp_pool_t *pool, model_t *m, const dev_t *d) {
  FZ_ASSERT(cp_pool_check(pool, stderr) == 0, "the pool's invariant check failed (see above)");
  size_t bytes[CP_KIND_COUNT] = {0}, count[CP_KIND_COUNT] = {0};
  for (int i = 0; i < NSLOTS; i++) {
    const slot_t *s = &m->slot[i];
    if (s->ptr == NULL) continue;
    int kind = s->small ? CP_KIND_SMALL : CP_KIND_LARGE;
    FZ_ASSERT(!m->stitch || !s->small, "a stitching pool served slot %d from the small pool", i);
    bytes[kind] += s->block;
    count[kind]++;
    verify_slot(s, i);
    size_t looked = 0;
    FZ_ASSERT(cp_pool_lookup(pool, s->ptr, &looked) == 1 && looked == s->requested,
              "lookup of live slot %d (%p, %zu bytes) gave size %zu", i, (void *)s->ptr, s->requested, looked);
    FZ_ASSERT(cp_pool_is_shared(pool, s->ptr) == s->shared, "live slot %d (%p) is%s marked shared", i, (void *)s->ptr,
              s->shared ? " not" : "");
    for (int j = i + 1; j < NSLOTS; j++) {
      const slot_t *t = &m->slot[j];
      if (t->ptr == NULL) continue;
      FZ_ASSERT(!overlaps((uintptr_t)s->ptr, s->block, (uintptr_t)t->ptr, t->block),
                "live blocks overlap: slot %d [%p, +%zu) and slot %d [%p, +%zu)", i, (void *)s->ptr, s->block, j,
                (void *)t->ptr, t->block);
    }
  }
  bytes[CP_KIND_ALL] = bytes[CP_KIND_SMALL] + bytes[CP_KIND_LARGE];
  count[CP_KIND_ALL] = count[CP_KIND_SMALL] + count[CP_KIND_LARGE];

  cp_stats_t st;
  cp_pool_stats(pool, &st);
  for (int k = 0; k < CP_KIND_COUNT; k++) {
    FZ_ASSERT(cur(&st, CP_STAT_ALLOCATED_BYTES, k) == (int64_t)bytes[k],
              "allocated_bytes.%s is %" PRId64 ", the caller holds %zu", cp_pool_kind_names[k],
              cur(&st, CP_STAT_ALLOCATED_BYTES, k), bytes[k]);
    FZ_ASSERT(cur(&st, CP_STAT_ALLOCATION, k) == (int64_t)count[k],
              "allocation.%s is %" PRId64 ", the caller holds %zu", cp_pool_kind_names[k],
              cur(&st, CP_STAT_ALLOCATION, k), count[k]);
  }

  cp_pool_info_t in;
  cp_pool_info(pool, &in);
  size_t dev_reserved = cp_sim_reserved_bytes(d->sim);
  FZ_ASSERT(in.allocated == bytes[CP_KIND_ALL], "info: allocated %zu, the caller holds %zu", in.allocated,
            bytes[CP_KIND_ALL]);
  FZ_ASSERT(in.allocated + in.cached_free + in.pending_free == in.reserved,
            "info: allocated %zu + cached %zu + pending %zu != reserved %zu", in.allocated, in.cached_free,
            in.pending_free, in.reserved);
  FZ_ASSERT(in.reserved == dev_reserved, "the pool says %zu bytes reserved, the device %zu", in.reserved, dev_reserved);
  FZ_ASSERT(in.reserved == (size_t)cur(&st, CP_STAT_RESERVED_BYTES, CP_KIND_ALL),
            "info and stats disagree on reserved");
  FZ_ASSERT(dev_reserved <= m->capacity, "device holds %zu of %zu bytes", dev_reserved, m->capacity);
  FZ_ASSERT(in.live_blocks == count[CP_KIND_ALL], "info: %zu live blocks, the caller holds %zu", in.live_blocks,
            count[CP_KIND_ALL]);
  FZ_ASSERT(in.memory_cap == expected_cap(m), "effective cap %zu, expected %zu", in.memory_cap, expected_cap(m));
  check_vmm(m, d, &in);

  /* What a GPU would have faulted on (Note [Simulated asynchrony] in backend/sim.h). */
  FZ_ASSERT(cp_sim_print_device_faults(d->sim, stderr) == 0, "device faults");
  /* The mirror agrees with the device. */
  for (unsigned s = 0; s < NSTREAMS; s++) {
    int idle = d->completed[s] >= d->recorded[s];
    FZ_ASSERT(cp_sim_stream_idle(d->sim, s) == idle, "stream %u: device idle=%d, mirror %d", s,
              cp_sim_stream_idle(d->sim, s), idle);
  }
}

/* Compare the pool's figures before and after a call that must change nothing. */
typedef struct snapshot_s {
  cp_stats_t stats;
  cp_pool_info_t info;
} snapshot_t;

static void take_snapshot(cp_pool_t *pool, snapshot_t *s) {
  memset(s, 0, sizeof *s);
  cp_pool_stats(pool, &s->stats);
  cp_pool_info(pool, &s->info);
  s->info.device_free = 0; /* the device's own figures are not the pool's */
  s->info.device_total = 0;
  s->info.streams = 0; /* a failed free may have met a stream for the first time */
}

static void expect_unchanged(cp_pool_t *pool, const snapshot_t *before, const char *what) {
  snapshot_t after;
  take_snapshot(pool, &after);
  FZ_ASSERT(memcmp(&before->stats, &after.stats, sizeof after.stats) == 0, "%s changed the statistics", what);
  FZ_ASSERT(memcmp(&before->info, &after.info, sizeof after.info) == 0, "%s changed the pool", what);
}

/* ------------------------------------------------------------------------------------------
 * Operations
 * ---------------------------------------------------------------------------------------- */

enum {
  OP_ALLOC_A,
  OP_ALLOC_B,
  OP_ALLOC_C,
  OP_ALLOC_D,
  OP_FREE_A,
  OP_FREE_B,
  OP_FREE_C,
  OP_RECORD,
  OP_STREAM,
  OP_COMPLETE,
  OP_MISC,
  OP_CAP,
  OP_FRACTION,
  OP_FAULT,
  OP_REGION,
  OP_PAUSE,
  OP_BAD_POINTER,
  OP_COUNT
};

/* Sizes of every kind the pool distinguishes, absurd ones included. */
static size_t pick_size(reader_t *r, const model_t *m) {
  const cp_config_t *c = &m->cfg;
  size_t cap = m->capacity;
  switch (rd_u8(r) % 10) {
    case 0: return 1 + rd_u32(r) % c->small_size;                                        /* small */
    case 1: return 1 + rd_u8(r);                                                         /* tiny, odd */
    case 2: return c->granule * (1 + rd_u16(r) % (c->small_size / c->granule));          /* exact */
    case 3: return c->small_size + 1 + rd_u32(r) % (c->min_large_alloc - c->small_size); /* large */
    case 4: return (size_t)(1 + rd_u8(r) % 12) * 2 * MiB;                                /* whole 2 MiB steps */
    case 5: return c->min_large_alloc + rd_u32(r) % (40 * MiB);                          /* big, maybe oversize */
    case 6: {
      const size_t edge[] = {c->granule - 1,
                             c->granule,
                             c->granule + 1,
                             c->small_size - 1,
                             c->small_size,
                             c->small_size + 1,
                             c->min_large_alloc - 1,
                             c->min_large_alloc,
                             c->min_large_alloc + 1,
                             c->large_segment,
                             c->large_segment + 1,
                             c->max_split_size - 1,
                             c->max_split_size,
                             cap / 2,
                             cap - c->granule,
                             cap,
                             cap + 1};
      return edge[rd_u8(r) % (sizeof edge / sizeof edge[0])];
    }
    case 7: {
      const size_t absurd[] = {SIZE_MAX,         SIZE_MAX - 1,       SIZE_MAX - c->granule + 2,
                               SIZE_MAX / 2 + 1, (size_t)1 << 62,    (size_t)1 << 40,
                               4 * cap,          SIZE_MAX - 40 * MiB};
      return absurd[rd_u8(r) % (sizeof absurd / sizeof absurd[0])];
    }
    case 8: return 0;
    default: return 1 + rd_u32(r) % cap; /* anything */
  }
}

/* What every operation works on. */
typedef struct ctx_s {
  cp_pool_t *pool;
  dev_t *dev;
  model_t *m;
} ctx_t;

/* A failing call leaves a message. */
static void expect_failure_explained(int rc) {
  if (rc != CP_OK) FZ_ASSERT(cp_last_error()[0] != '\0', "call failed with %s but left no message", cp_status_name(rc));
}

static void do_alloc(ctx_t *x, int si, size_t size) {
  model_t *m = x->m;
  slot_t *s = &m->slot[si];
  cp_stats_t before;
  cp_pool_stats(x->pool, &before);
  cp_pool_info_t info_before;
  cp_pool_info(x->pool, &info_before);
  uint64_t faults = cp_sim_faults_injected(x->dev->sim);
  void *p = (void *)(uintptr_t)1; /* must be overwritten on success */
  int rc = cp_alloc_in(x->pool, size, m->stream, m->region_ids[m->region], &p);
  int fired = cp_sim_faults_injected(x->dev->sim) != faults;
  expect_failure_explained(rc);
  size_t rounded = cp_round_size(&m->cfg, size);
  size_t seg = segment_for(&m->cfg, rounded);
  if (rc != CP_OK) {
    FZ_ASSERT(rc == CP_ERR_OOM || (rc == CP_ERR_INVALID && (seg == 0 || size > m->capacity)) ||
                  (fired && rc == CP_ERR_BACKEND),
              "alloc(%zu) failed with %s", size, cp_status_name(rc));
    if (rc == CP_ERR_OOM && !fired && seg != 0) {
      /* No injected failure: every cached segment was offered back and every pending free
       * waited for, so the segment this request needs really does not fit. */
      size_t dev_reserved = cp_sim_reserved_bytes(x->dev->sim);
      size_t pool_alloc = 0, pool_reserved = 0;
      cp_pool_usage(x->pool, &pool_alloc, &pool_reserved);
      size_t cap = expected_cap(m);
      int exhausted = seg > m->capacity - dev_reserved || (cap != 0 && (seg > cap || pool_reserved > cap - seg));
      if (m->paged) {
        /* Page-mapped: memory is mapped a chunk at a time, at most the request rounded up to
         * chunks (chunks mapped before the failure stay); a request larger than a segment's
         * address range less its last chunk (the range is 1 1/8 of the device, at least) fits
         * nowhere. */
        size_t chunk = m->chunk[rounded <= m->cfg.small_size ? 0 : 1];
        size_t need = rounded > SIZE_MAX - chunk ? SIZE_MAX : (rounded + chunk - 1) / chunk * chunk;
        exhausted = need > m->capacity - dev_reserved || (cap != 0 && (need > cap || pool_reserved > cap - need)) ||
                    rounded > m->capacity + m->capacity / 8 - chunk;
      }
      FZ_ASSERT(exhausted, "alloc(%zu): out of memory for a %zu-byte segment with %zu of %zu bytes reserved (cap %zu)",
                size, seg, dev_reserved, m->capacity, cap);
    }
    if (seg == 0)
      FZ_ASSERT(rc == CP_ERR_OOM || rc == CP_ERR_INVALID, "absurd alloc(%zu): %s", size, cp_status_name(rc));
    return;
  }
  if (size == 0) {
    FZ_ASSERT(p == NULL, "alloc(0) gave %p", p);
    return;
  }
  /* Segments are 512-aligned; blocks start at multiples of the granule inside them. */
  size_t align = m->cfg.granule < 512 ? m->cfg.granule : 512;
  FZ_ASSERT(p != NULL && (uintptr_t)p % align == 0, "alloc(%zu) gave %p", size, p);
  FZ_ASSERT(rounded >= size && rounded != 0 && size <= m->capacity, "alloc(%zu) served, rounded %zu", size, rounded);
  cp_stats_t after;
  cp_pool_stats(x->pool, &after);
  int64_t grew = cur(&after, CP_STAT_ALLOCATED_BYTES, CP_KIND_ALL) - cur(&before, CP_STAT_ALLOCATED_BYTES, CP_KIND_ALL);
  int small = rounded <= m->cfg.small_size && !m->stitch; /* stitching: one range serves all */
  cp_pool_info_t info_after;
  cp_pool_info(x->pool, &info_after);
  int stitched = info_after.stitches != info_before.stitches || info_after.stitch_reuses != info_before.stitch_reuses;
  FZ_ASSERT(m->stitch || !stitched, "alloc(%zu) stitched in a pool that does not stitch", size);
  FZ_ASSERT(info_after.stitches + info_after.stitch_reuses <= info_before.stitches + info_before.stitch_reuses + 1,
            "alloc(%zu) stitched twice", size);
  FZ_ASSERT(grew >= (int64_t)rounded, "alloc(%zu, rounded %zu) added only %" PRId64 " allocated bytes", size, rounded,
            grew);
  size_t block = (size_t)grew;
  size_t slack = block - rounded;
  if (stitched) {
    /* A stitched range is whole pages, never split: those the request needs, or a kept range
     * with at most 1/8 more; never for a request of one page or less. */
    size_t g = m->chunk[1], need = (rounded + g - 1) / g * g;
    FZ_ASSERT(need > g && block % g == 0 && block >= need && block <= need + need / 8,
              "stitched alloc(%zu, rounded %zu): block of %zu (pages of %zu)", size, rounded, block, g);
  } else if (m->paged) {
    /* Page-mapped segments split off any remainder of a granule or more, in both pools. */
    FZ_ASSERT(slack < m->cfg.granule, "page-mapped alloc(%zu): block of %zu for %zu rounded", size, block, rounded);
  } else if (small) {
    FZ_ASSERT(slack == 0, "small alloc(%zu): block of %zu for %zu rounded", size, block, rounded);
  } else if (rounded < m->cfg.max_split_size) {
    FZ_ASSERT(slack <= m->cfg.small_size, "alloc(%zu): block of %zu for %zu rounded: should have been split", size,
              block, rounded);
  } else {
    size_t bound =
        m->cfg.max_non_split_rounding > m->cfg.round_large ? m->cfg.max_non_split_rounding : m->cfg.round_large;
    FZ_ASSERT(slack < bound, "oversize alloc(%zu): block of %zu for %zu rounded", size, block, rounded);
  }
  /* Never on top of a live block, nor on a range still waited for. */
  for (int j = 0; j < NSLOTS; j++) {
    const slot_t *t = &m->slot[j];
    if (t->ptr == NULL) continue;
    FZ_ASSERT(!overlaps((uintptr_t)p, block, (uintptr_t)t->ptr, t->block),
              "alloc(%zu) = [%p, +%zu) overlaps live slot %d [%p, +%zu)", size, p, block, j, (void *)t->ptr, t->block);
  }
  for (size_t g = 0; g < m->nguards; g++) {
    const guard_t *gd = &m->guard[g];
    if (!guard_active(x->dev, gd)) continue;
    FZ_ASSERT(!overlaps((uintptr_t)p, block, gd->addr, gd->size),
              "alloc(%zu) on stream %u = [%p, +%zu) reuses [%#" PRIxPTR
              ", +%zu) before the events of its free completed",
              size, m->stream, p, block, gd->addr, gd->size);
  }
  /* If it grew the pool, the cap held at that moment, and nothing was reserved since. */
  size_t cap = expected_cap(m);
  if (after.num_device_alloc != before.num_device_alloc && cap != 0) {
    FZ_ASSERT((size_t)cur(&after, CP_STAT_RESERVED_BYTES, CP_KIND_ALL) <= cap, "grew past the cap of %zu bytes", cap);
  }
  cp_page_t page = 0;
  size_t page_off = 0;
  if (m->paged) {
    FZ_ASSERT(cp_sim_vmm_resolve(x->dev->sim, (uintptr_t)p, &page, &page_off, NULL) == CP_OK,
              "alloc(%zu) gave %p, which is not mapped", size, p);
  }
  *s = (slot_t){(uint8_t *)p,
                page,
                page_off,
                size,
                rounded,
                block,
                small,
                m->stream,
                0,
                m->next_seed++,
                m->region_ids[m->region],
                0};
  fill_slot(s);
  /* Memory another stream's queued work still touches is never handed out; then work on the
   * allocation's own stream uses it, queued until that stream is completed. */
  FZ_ASSERT(cp_sim_check_handoff(x->dev->sim, m->stream, (uintptr_t)p, size) == 0,
            "alloc(%zu) on stream %u = %p: another stream's queued work touches it", size, m->stream, p);
  int lrc = cp_sim_launch(x->dev->sim, m->stream, (uintptr_t)p, size);
  FZ_ASSERT(lrc == CP_OK, "launch on %p (%zu bytes), stream %u: %s", p, size, m->stream, cp_last_error());
  x->dev->recorded[m->stream]++;
}

static void remember_stale(model_t *m, uintptr_t addr) {
  m->stale[m->nstale % (sizeof m->stale / sizeof m->stale[0])] = addr;
  m->nstale++;
}

/* The freed slot `s` is guarded by the events the free just recorded (the device's captured
 * ones) until they complete; `pieces` (heap, page-mapped pools) goes with the guard. */
static void add_guard(ctx_t *x, const slot_t *s, piece_t *pieces, size_t npieces) {
  model_t *m = x->m;
  FZ_ASSERT(m->nguards < MAX_GUARDS, "guard table full");
  guard_t *g = &m->guard[m->nguards++];
  g->addr = (uintptr_t)s->ptr;
  g->size = s->block;
  g->nev = x->dev->ncaptured;
  memcpy(g->ev, x->dev->captured, g->nev * sizeof g->ev[0]);
  g->pieces = pieces;
  g->npieces = npieces;
}

/* cp_free, or cp_free_sized with the size asked for (`sized`). */
static void do_free(ctx_t *x, int si, int sized) {
  model_t *m = x->m;
  slot_t *s = &m->slot[si];
  verify_slot(s, si);
  snapshot_t before;
  take_snapshot(x->pool, &before);
  /* Page-mapped: the physical memory a free with recorded streams keeps out of use. */
  unsigned others = s->recorded & ~(1u << s->stream);
  piece_t *pieces = NULL;
  size_t npieces = 0, pieces_cap = 0;
  if (m->paged && others != 0) pieces_of(x->dev, (uintptr_t)s->ptr, s->block, si, &pieces, &npieces, &pieces_cap);
  uint64_t faults = cp_sim_faults_injected(x->dev->sim);
  x->dev->ncaptured = 0;
  x->dev->overflow = 0;
  int rc = sized ? cp_free_sized(x->pool, s->ptr, s->requested) : cp_free(x->pool, s->ptr);
  int fired = cp_sim_faults_injected(x->dev->sim) != faults;
  expect_failure_explained(rc);
  if (rc != CP_OK) {
    FZ_ASSERT(fired, "free(%p) failed with %s without a device failure", (void *)s->ptr, cp_status_name(rc));
    expect_unchanged(x->pool, &before, "a failed free");
    free(pieces);
    return;
  }
  size_t want = 0;
  for (unsigned b = 0; b < NSTREAMS; b++) want += (others >> b) & 1u;
  FZ_ASSERT(!x->dev->overflow && x->dev->ncaptured == want, "free recorded %zu events for %zu other streams",
            x->dev->ncaptured, want);
  cp_stats_t after;
  cp_pool_stats(x->pool, &after);
  int64_t dropped =
      cur(&before.stats, CP_STAT_ALLOCATED_BYTES, CP_KIND_ALL) - cur(&after, CP_STAT_ALLOCATED_BYTES, CP_KIND_ALL);
  FZ_ASSERT(dropped == (int64_t)s->block, "free of a %zu-byte block took %" PRId64 " allocated bytes", s->block,
            dropped);
  if (want > 0) {
    add_guard(x, s, pieces, npieces);
    pieces = NULL;
  }
  free(pieces);
  remember_stale(m, (uintptr_t)s->ptr);
  memset(s, 0, sizeof *s);
}

static int is_live_address(const model_t *m, uintptr_t a) {
  for (int i = 0; i < NSLOTS; i++) {
    if ((uintptr_t)m->slot[i].ptr == a && m->slot[i].ptr != NULL) return 1;
  }
  return 0;
}

/* A free of a live allocation with the wrong size: refused, and the block stays allocated. */
static void do_wrong_size_free(ctx_t *x, int si, uint32_t delta) {
  const slot_t *s = &x->m->slot[si];
  if (s->ptr == NULL) return;
  size_t wrong = delta % 2 ? s->requested + 1 + delta % 4096 : delta % s->requested; /* != requested */
  snapshot_t before;
  take_snapshot(x->pool, &before);
  cp_clear_error();
  int rc = cp_free_sized(x->pool, s->ptr, wrong);
  FZ_ASSERT(rc == CP_ERR_INVALID, "free_sized(%p, %zu) of a %zu-byte allocation gave %s", (void *)s->ptr, wrong,
            s->requested, cp_status_name(rc));
  expect_failure_explained(rc);
  expect_unchanged(x->pool, &before, "a free with the wrong size");
}

/* A free, sized free or record_stream of something that is not a live allocation. */
static void do_bad_pointer(ctx_t *x, reader_t *r) {
  model_t *m = x->m;
  uint8_t how = rd_u8(r);
  uint8_t which = rd_u8(r);
  uintptr_t a = 0;
  if (how % 5 == 4) {
    do_wrong_size_free(x, which % NSLOTS, rd_u32(r));
    return;
  }
  switch (how % 5) {
    case 0: { /* inside a live block */
      const slot_t *s = &m->slot[which % NSLOTS];
      if (s->ptr == NULL || s->block < 2) return;
      a = (uintptr_t)s->ptr + 1 + rd_u32(r) % (s->block - 1);
      break;
    }
    case 1: /* freed before: a double free, unless the address was handed out again */
      if (m->nstale == 0) return;
      a = m->stale[which % (m->nstale < 8 ? m->nstale : 8)];
      break;
    case 2: a = (uintptr_t)4096 * (1 + which); break;
    default: a = ~(uintptr_t)0 - 511 - which; break;
  }
  if (is_live_address(m, a)) return;
  snapshot_t before;
  take_snapshot(x->pool, &before);
  cp_clear_error();
  size_t looked = 12345;
  FZ_ASSERT(cp_pool_lookup(x->pool, (void *)a, &looked) == 0 && looked == 12345, "lookup of %#" PRIxPTR " (not live)",
            a);
  int rc;
  const char *what;
  switch ((how / 5) % 3) {
    case 0:
      what = "free";
      rc = cp_free(x->pool, (void *)a);
      break;
    case 1:
      what = "free_sized";
      rc = cp_free_sized(x->pool, (void *)a, rd_u32(r));
      break;
    default:
      what = "record_stream";
      rc = cp_record_stream(x->pool, (void *)a, which % NSTREAMS);
      break;
  }
  FZ_ASSERT(rc == CP_ERR_INVALID, "%s of %#" PRIxPTR " (not live) gave %s", what, a, cp_status_name(rc));
  expect_failure_explained(rc);
  expect_unchanged(x->pool, &before, "a bad pointer");
}

static void do_record(ctx_t *x, int si, unsigned stream) {
  slot_t *s = &x->m->slot[si];
  int rc = cp_record_stream(x->pool, s->ptr, stream);
  FZ_ASSERT(rc == CP_OK, "record_stream(%p, %u) gave %s", (void *)s->ptr, stream, cp_status_name(rc));
  /* Work on that stream uses the block: queued until the stream is completed. */
  rc = cp_sim_launch(x->dev->sim, stream, (uintptr_t)s->ptr, 1);
  FZ_ASSERT(rc == CP_OK, "launch on %p, stream %u: %s", (void *)s->ptr, stream, cp_last_error());
  x->dev->recorded[stream]++;
  if (stream != s->stream) s->recorded |= 1u << stream;
}

static void do_empty_cache(ctx_t *x) {
  uint64_t faults = cp_sim_faults_injected(x->dev->sim);
  size_t reserved_before = cp_sim_reserved_bytes(x->dev->sim);
  int rc = cp_empty_cache(x->pool);
  int fired = cp_sim_faults_injected(x->dev->sim) != faults;
  expect_failure_explained(rc);
  FZ_ASSERT(rc == CP_OK || fired, "empty_cache failed with %s without a device failure", cp_status_name(rc));
  FZ_ASSERT(cp_sim_reserved_bytes(x->dev->sim) <= reserved_before, "empty_cache reserved memory");
  /* Page-mapped pools wait for nothing (Note [Stream-ordered release]): what queued work may
   * still use stays, and goes with a later call. With every stream idle, all of it goes now. */
  int idle = 1;
  for (unsigned s = 0; s < NSTREAMS; s++) idle &= x->dev->completed[s] >= x->dev->recorded[s];
  if (!fired && (idle || !x->m->paged)) {
    /* Every pending free was waited for. */
    cp_pool_info_t in;
    cp_pool_info(x->pool, &in);
    FZ_ASSERT(in.pending_free == 0 && in.pending_blocks == 0, "empty_cache left %zu bytes pending", in.pending_free);
    prune_guards(x->m, x->dev);
    FZ_ASSERT(x->m->nguards == 0, "empty_cache returned with %zu freed ranges still waited for", x->m->nguards);
    if (in.live_blocks == 0) {
      FZ_ASSERT(in.reserved == 0 && cp_sim_reserved_bytes(x->dev->sim) == 0 && cp_sim_vmm_ranges(x->dev->sim) == 0,
                "empty_cache with nothing allocated kept %zu bytes reserved, %zu page-mapped ranges", in.reserved,
                cp_sim_vmm_ranges(x->dev->sim));
    }
  }
}

static void do_cap(ctx_t *x, reader_t *r) {
  model_t *m = x->m;
  const size_t caps[] = {0, 8 * MiB, 20 * MiB, 30 * MiB, 48 * MiB, m->capacity, 2 * m->capacity, 1, 0};
  const size_t ncaps = sizeof caps / sizeof caps[0];
  uint8_t k = rd_u8(r) % (ncaps + 2);
  size_t cap = k < ncaps ? caps[k] : 1 + (size_t)rd_u16(r) * 1000; /* anything, also odd */
  int rc = cp_pool_set_memory_cap(x->pool, cap);
  FZ_ASSERT(rc == CP_OK, "set_memory_cap(%zu) gave %s", cap, cp_status_name(rc));
  m->memory_cap = cap;
}

static void do_fraction(ctx_t *x, reader_t *r) {
  model_t *m = x->m;
  const double fr[] = {0.0, 0.1, 0.25, 0.5, 0.75, 0.99, 1.0, 1.5, -0.25, NAN, 1e-9, 0.0};
  double f = fr[rd_u8(r) % (sizeof fr / sizeof fr[0])];
  int valid = f >= 0.0 && f <= 1.0;
  snapshot_t before;
  take_snapshot(x->pool, &before);
  cp_clear_error();
  uint64_t faults = cp_sim_faults_injected(x->dev->sim);
  int rc = cp_pool_set_memory_fraction(x->pool, f);
  int fired = cp_sim_faults_injected(x->dev->sim) != faults;
  expect_failure_explained(rc);
  if (!valid) {
    FZ_ASSERT(rc == CP_ERR_INVALID, "set_memory_fraction(%g) gave %s", f, cp_status_name(rc));
    expect_unchanged(x->pool, &before, "an invalid memory fraction");
    return;
  }
  /* It asks the device for its total first; the only failure is a positive fraction while
   * the total has never been known. */
  if (!fired) m->total_known = 1;
  if (f > 0 && !m->total_known) {
    FZ_ASSERT(rc == CP_ERR_BACKEND, "set_memory_fraction(%g) with the device total unknown gave %s", f,
              cp_status_name(rc));
    expect_unchanged(x->pool, &before, "a memory fraction that cannot apply");
    return;
  }
  FZ_ASSERT(rc == CP_OK, "set_memory_fraction(%g) gave %s", f, cp_status_name(rc));
  m->memory_fraction = f;
}

static void do_fault(ctx_t *x, reader_t *r) {
  uint8_t k = rd_u8(r);
  uint8_t n = rd_u8(r);
  /* Page-mapped configurations name every call kind, the page-mapped ones included. */
  unsigned kinds = x->m->paged_cfg ? CP_SIM_CALL_COUNT : FZ_POOL_CALL_KINDS;
  cp_sim_call_t kind = (cp_sim_call_t)(k % kinds);
  if (kind == CP_SIM_VA_FREE || kind == CP_SIM_PAGE_UNMAP) x->m->unmap_failed = 1;
  int status = (k / kinds) % 2 ? CP_ERR_OOM : CP_ERR_BACKEND;
  cp_sim_fail_nth(x->dev->sim, kind, 1 + n % 4, status);
}

/* A checkpoint (Note [Checkpoints] in core/checkpoint.c): it changes nothing, and holds what
 * the caller holds; pools that stitch are refused. */
static void do_checkpoint(ctx_t *x) {
  model_t *m = x->m;
  cp_checkpoint_destroy(m->ck);
  m->ck = NULL;
  snapshot_t before;
  take_snapshot(x->pool, &before);
  const int rc = cp_pool_checkpoint(x->pool, &m->ck);
  expect_failure_explained(rc);
  if (m->cfg.page_stitching) {
    FZ_ASSERT(rc == CP_ERR_INVALID && m->ck == NULL, "checkpoint of a stitching pool: %s", cp_status_name(rc));
    return;
  }
  FZ_ASSERT(rc == CP_OK, "checkpoint failed: %s", cp_status_name(rc));
  expect_unchanged(x->pool, &before, "a checkpoint");
  memcpy(m->ck_slot, m->slot, sizeof m->slot);
  size_t live = 0;
  for (int i = 0; i < NSLOTS; i++) live += m->slot[i].ptr != NULL;
  FZ_ASSERT(cp_checkpoint_live_count(m->ck) == live, "checkpoint of %zu live blocks holds %zu", live,
            cp_checkpoint_live_count(m->ck));
}

/* Restore the last checkpoint: every live block is freed, the checkpoint's are live again at
 * their addresses, with their sizes (check_all then sees the accounting and the overlaps). A
 * refusal changes nothing; an injected failure half-way says what was done. */
static void do_restore(ctx_t *x) {
  model_t *m = x->m;
  if (m->ck == NULL) return;
  for (int i = 0; i < NSLOTS; i++)
    if (m->slot[i].ptr != NULL) verify_slot(&m->slot[i], i);
  snapshot_t before;
  take_snapshot(x->pool, &before);
  const uint64_t faults = cp_sim_faults_injected(x->dev->sim);
  cp_restore_t r;
  const int rc = cp_pool_restore(x->pool, m->ck, &r);
  const int fired = cp_sim_faults_injected(x->dev->sim) != faults;
  expect_failure_explained(rc);
  FZ_ASSERT(rc == CP_OK || rc == CP_ERR_STATE || fired, "restore failed with %s, no failure injected",
            cp_status_name(rc));
  if (rc == CP_ERR_STATE) {
    FZ_ASSERT(r.freed_count == 0 && r.made_live_count == 0, "a refused restore freed %zu blocks", r.freed_count);
    expect_unchanged(x->pool, &before, "a refused restore");
  }
  for (size_t k = 0; k < r.freed_count; k++) {
    int found = 0;
    for (int i = 0; i < NSLOTS && !found; i++) {
      if ((void *)m->slot[i].ptr != r.freed[k]) continue;
      remember_stale(m, (uintptr_t)m->slot[i].ptr);
      memset(&m->slot[i], 0, sizeof m->slot[i]);
      found = 1;
    }
    FZ_ASSERT(found, "restore freed %p, which the caller does not hold", r.freed[k]);
  }
  if (rc == CP_OK) {
    for (int i = 0; i < NSLOTS; i++) FZ_ASSERT(m->slot[i].ptr == NULL, "restore left slot %d live", i);
  } else if (r.freed_count != 0) {
    dev_complete_all(x->dev); /* frees it left pending: nothing of theirs is in use any more */
  }
  for (size_t k = 0; k < r.made_live_count; k++) {
    int found = 0;
    for (int i = 0; i < NSLOTS && !found; i++) {
      slot_t *c = &m->ck_slot[i];
      if (c->ptr == NULL || (void *)c->ptr != r.made_live[k]) continue;
      FZ_ASSERT(m->slot[i].ptr == NULL && r.made_live_sizes[k] == c->requested, "restore made %p live twice",
                r.made_live[k]);
      m->slot[i] = *c;
      m->slot[i].recorded = 0;
      m->slot[i].shared = 0; /* a new allocation at the same address */
      m->slot[i].seed = m->next_seed++;
      if (m->paged)
        FZ_ASSERT(
            cp_sim_vmm_resolve(x->dev->sim, (uintptr_t)c->ptr, &m->slot[i].page, &m->slot[i].page_off, NULL) == CP_OK,
            "restored %p is not mapped", (void *)c->ptr);
      fill_slot(&m->slot[i]);
      FZ_ASSERT(cp_sim_check_handoff(x->dev->sim, c->stream, (uintptr_t)c->ptr, c->requested) == 0,
                "restored %p on stream %u: another stream's queued work touches it", (void *)c->ptr, c->stream);
      found = 1;
    }
    FZ_ASSERT(found, "restore made %p live, which the checkpoint did not hold", r.made_live[k]);
  }
  if (rc == CP_OK)
    FZ_ASSERT(r.made_live_count == cp_checkpoint_live_count(m->ck), "restore made %zu of %zu blocks live",
              r.made_live_count, cp_checkpoint_live_count(m->ck));
  cp_restore_release(&r);
}

static void do_capture_window(ctx_t *x, reader_t *r);
static void do_share(ctx_t *x, reader_t *r);

static void do_misc(ctx_t *x, reader_t *r) {
  const uint8_t which = rd_u8(r);
  if (which >= 246) { /* the rarest: a capture window */
    do_capture_window(x, r);
    return;
  }
  if (which >= 240) { /* a block described for another process */
    do_share(x, r);
    return;
  }
  switch (which % 10) {
    case 0: dev_complete_all(x->dev); break;
    case 1: do_empty_cache(x); break;
    case 2: cp_pool_reset_peak_stats(x->pool); break;
    case 3: cp_pool_reset_accumulated_stats(x->pool); break;
    case 4: {
      char buf[256];
      int n = cp_pool_oom_report(x->pool, 123456789, buf, sizeof buf);
      FZ_ASSERT(n > 0 && buf[0] != '\0', "empty OOM report");
      break;
    }
    case 5: { /* size 0 and NULL: no-ops */
      snapshot_t before;
      take_snapshot(x->pool, &before);
      void *p = &before;
      FZ_ASSERT(cp_alloc(x->pool, 0, x->m->stream, &p) == CP_OK && p == NULL, "alloc(0)");
      FZ_ASSERT(cp_free(x->pool, NULL) == CP_OK, "free(NULL)");
      expect_unchanged(x->pool, &before, "alloc(0) / free(NULL)");
      break;
    }
    case 6: {
      cp_config_t c;
      cp_pool_config(x->pool, &c);
      FZ_ASSERT(c.memory_cap == x->m->memory_cap && c.memory_fraction == x->m->memory_fraction &&
                    c.granule == x->m->cfg.granule && c.max_split_size == x->m->cfg.max_split_size,
                "cp_pool_config does not give back what was set");
      break;
    }
    case 7: do_checkpoint(x); break;
    case 8: do_restore(x); break;
    default: { /* disarm every injected failure */
      for (int k = 0; k < CP_SIM_CALL_COUNT; k++) cp_sim_fail_nth(x->dev->sim, (cp_sim_call_t)k, 0, CP_OK);
      break;
    }
  }
}

/* A capture window (Note [Capture in the pool], capture.c), as torch opens one around a CUDA
 * graph's capture: the current stream captures on the device (every event call and every
 * release would then be a device fault), the pool's window is open (once or nested twice),
 * and inside it up to three blocks are allocated and freed on the stream, a live block used
 * on other streams is freed (its free waits for the window to close: no event recorded, its
 * bytes still allocated), and empty_cache gives nothing back. Once the last window closes the
 * waiting free records its events and is guarded as any other. Injected failures are
 * disarmed first: a window's calls are not the ones under test here. */
static size_t allocated_now(cp_pool_t *pool) {
  cp_stats_t st;
  cp_pool_stats(pool, &st);
  return (size_t)cur(&st, CP_STAT_ALLOCATED_BYTES, CP_KIND_ALL);
}

static void do_capture_window(ctx_t *x, reader_t *r) {
  model_t *m = x->m;
  const uint8_t b = rd_u8(r);
  const int nested = 1 + (b & 1);
  for (int k = 0; k < CP_SIM_CALL_COUNT; k++) cp_sim_fail_nth(x->dev->sim, (cp_sim_call_t)k, 0, CP_OK);
  const uint64_t violations = cp_sim_capture_violations(x->dev->sim);
  FZ_ASSERT(cp_sim_set_capturing(x->dev->sim, m->stream, 1) == CP_OK, "capture on");
  for (int k = 0; k < nested; k++) FZ_ASSERT(cp_pool_capture_begin(x->pool) == CP_OK, "capture_begin");
  fz_windows_run++;
  unsigned windows = 0;
  size_t deferred = 0;
  cp_pool_capture_state(x->pool, &windows, &deferred);
  FZ_ASSERT(windows == (unsigned)nested && deferred == 0, "%u windows, %zu deferred frees", windows, deferred);

  /* A live block of another stream's use, freed inside: it waits for the window. */
  int wait_slot = -1;
  unsigned others = 0;
  for (int i = 0; i < NSLOTS && (b & 2); i++) {
    const slot_t *s = &m->slot[(i + b / 4) % NSLOTS];
    if (s->ptr != NULL && (s->recorded & ~(1u << s->stream)) != 0) {
      wait_slot = (i + b / 4) % NSLOTS;
      others = s->recorded & ~(1u << s->stream);
      break;
    }
  }
  piece_t *pieces = NULL;
  size_t npieces = 0, pieces_cap = 0;
  const size_t allocated_before = allocated_now(x->pool);
  if (wait_slot >= 0) {
    slot_t *s = &m->slot[wait_slot];
    verify_slot(s, wait_slot);
    if (m->paged) pieces_of(x->dev, (uintptr_t)s->ptr, s->block, wait_slot, &pieces, &npieces, &pieces_cap);
    x->dev->ncaptured = 0;
    FZ_ASSERT(cp_free(x->pool, s->ptr) == CP_OK, "a free inside a capture window: %s", cp_last_error());
    cp_pool_capture_state(x->pool, &windows, &deferred);
    FZ_ASSERT(x->dev->ncaptured == 0 && deferred == 1, "the free in the window recorded %zu events, %zu deferred",
              x->dev->ncaptured, deferred);
    FZ_ASSERT(allocated_now(x->pool) == allocated_before,
              "the free waiting for the window gave its bytes back already");
    fz_deferred_run++;
  }

  /* The graph's own allocations: made and freed on the capturing stream. */
  uint8_t *temp[3] = {NULL, NULL, NULL};
  size_t temp_size[3] = {0, 0, 0};
  const int ntemp = (b >> 2) % 4;
  for (int k = 0; k < ntemp; k++) {
    const size_t size = 1 + pick_size(r, m) % (8 * MiB);
    void *p = NULL;
    const int rc = cp_alloc(x->pool, size, m->stream, &p);
    expect_failure_explained(rc);
    FZ_ASSERT(rc == CP_OK || rc == CP_ERR_OOM, "alloc(%zu) in a capture window: %s", size, cp_status_name(rc));
    if (rc != CP_OK) continue;
    for (int j = 0; j < NSLOTS; j++) {
      const slot_t *t = &m->slot[j];
      FZ_ASSERT(t->ptr == NULL || !overlaps((uintptr_t)p, size, (uintptr_t)t->ptr, t->block),
                "alloc(%zu) in a capture window = [%p, +%zu) overlaps live slot %d", size, p, size, j);
    }
    for (int j = 0; j < k; j++)
      FZ_ASSERT(temp[j] == NULL || !overlaps((uintptr_t)p, size, (uintptr_t)temp[j], temp_size[j]),
                "two allocations of one capture window overlap");
    FZ_ASSERT(cp_sim_launch(x->dev->sim, m->stream, (uintptr_t)p, size) == CP_OK, "launch in a window");
    x->dev->recorded[m->stream]++;
    temp[k] = p;
    temp_size[k] = size;
    FOR_EACH_SAMPLE(size, off, temp[k][off] = (uint8_t)(off * 131u + (unsigned)k));
  }
  const size_t reserved = cp_sim_reserved_bytes(x->dev->sim);
  FZ_ASSERT(cp_empty_cache(x->pool) == CP_OK, "empty_cache in a capture window: %s", cp_last_error());
  FZ_ASSERT(cp_sim_reserved_bytes(x->dev->sim) == reserved, "empty_cache gave memory back during a capture");
  for (int k = 0; k < ntemp; k++) {
    if (temp[k] == NULL) continue;
    FOR_EACH_SAMPLE(temp_size[k], off, {
      FZ_ASSERT(temp[k][off] == (uint8_t)(off * 131u + (unsigned)k),
                "an allocation of a capture window was overwritten at byte %zu", off);
    });
    FZ_ASSERT(cp_free(x->pool, temp[k]) == CP_OK, "free in a capture window: %s", cp_last_error());
  }

  /* The capture ends on the device first, then the pool's window, as torch closes them. */
  FZ_ASSERT(cp_sim_set_capturing(x->dev->sim, m->stream, 0) == CP_OK, "capture off");
  x->dev->ncaptured = 0;
  x->dev->overflow = 0;
  for (int k = 0; k < nested; k++) FZ_ASSERT(cp_pool_capture_end(x->pool) == CP_OK, "capture_end");
  FZ_ASSERT(cp_pool_capture_end(x->pool) == CP_ERR_STATE, "a window closed that was not open");
  cp_clear_error();
  if (cp_sim_capture_violations(x->dev->sim) != violations) (void)cp_sim_print_device_faults(x->dev->sim, stderr);
  FZ_ASSERT(cp_sim_capture_violations(x->dev->sim) == violations,
            "the pool made a call the driver refuses during a capture");
  cp_pool_capture_state(x->pool, &windows, &deferred);
  FZ_ASSERT(windows == 0, "%u windows open after closing them", windows);
  if (wait_slot < 0) return;
  /* The last window closed: the waiting free recorded an event on each other stream. */
  slot_t *s = &m->slot[wait_slot];
  size_t want = 0;
  for (unsigned k = 0; k < NSTREAMS; k++) want += (others >> k) & 1u;
  FZ_ASSERT(deferred == 0 && !x->dev->overflow && x->dev->ncaptured == want,
            "closing the window: %zu frees still deferred, %zu events for %zu other streams", deferred,
            x->dev->ncaptured, want);
  add_guard(x, s, pieces, npieces);
  remember_stale(m, (uintptr_t)s->ptr);
  memset(s, 0, sizeof *s);
}

static int contains_text(const char *haystack, const char *needle) { return strstr(haystack, needle) != NULL; }

/* Pause a region (or every one) with a backup, look at the pool while it is paused, resume it:
 * every live block is where it was, with its bytes (check_all after the operation), on pages
 * the resume mapped. An armed failure may refuse the pause (nothing changes) or a resume (it
 * stays paused, and the next resume maps it). */
/* Describe a slot's block for another process (cp_pool_share, Note [Sharing a block] in
 * share.c), or a pointer that is no live block. The description must reach exactly the
 * block's bytes: a plain segment holding it whole, or, page-mapped, handles each mapped whole
 * (the first byte of each span is the first of a page, the last is on that page too), side by
 * side, the block at `offset` bytes in. Sharing changes nothing the pool counts; the block is
 * then marked shared until it is freed (check_all compares the mark with the model), and a
 * pause of its region is refused meanwhile (do_pause). */
static void do_share(ctx_t *x, reader_t *r) {
  model_t *m = x->m;
  const int si = rd_u8(r) % NSLOTS;
  slot_t *s = &m->slot[si];
  snapshot_t before;
  take_snapshot(x->pool, &before);
  cp_share_t sh;
  const uint64_t faults = cp_sim_faults_injected(x->dev->sim);
  const int rc = cp_pool_share(x->pool, s->ptr != NULL ? (void *)s->ptr : (void *)(uintptr_t)0x5000, &sh);
  FZ_ASSERT(cp_sim_faults_injected(x->dev->sim) == faults, "sharing made a device call");
  expect_failure_explained(rc);
  expect_unchanged(x->pool, &before, "a share");
  if (s->ptr == NULL) {
    FZ_ASSERT(rc == CP_ERR_INVALID && sh.spans == NULL && sh.span_count == 0, "share of no live block: %s",
              cp_status_name(rc));
    cp_clear_error();
    return;
  }
  FZ_ASSERT(rc == CP_OK || rc == CP_ERR_HOST_OOM, "share of slot %d (%p): %s", si, (void *)s->ptr, cp_status_name(rc));
  if (rc != CP_OK) return;
  const uintptr_t a = (uintptr_t)s->ptr;
  FZ_ASSERT(sh.block_bytes == s->requested && sh.offset + s->requested <= sh.size,
            "share of slot %d: %zu bytes at offset %zu of %zu (asked %zu)", si, sh.block_bytes, sh.offset, sh.size,
            s->requested);
  if (!sh.paged) {
    FZ_ASSERT(!m->paged && sh.span_count == 0 && sh.base + sh.offset == a,
              "share of slot %d: a plain segment at %#" PRIxPTR " + %zu is not the block %p", si, sh.base, sh.offset,
              (void *)s->ptr);
  } else {
    FZ_ASSERT(m->paged && sh.span_count > 0 && sh.spans[0].addr == sh.base, "share of slot %d: %zu spans", si,
              sh.span_count);
    uintptr_t at = sh.base;
    for (size_t k = 0; k < sh.span_count; k++) {
      const cp_share_span_t *sp = &sh.spans[k];
      cp_page_t first = 0, last = 0;
      size_t off = 1, last_off = 0, psize = 0;
      FZ_ASSERT(sp->addr == at && sp->size > 0, "share of slot %d: span %zu is not beside the one before", si, k);
      FZ_ASSERT(cp_sim_vmm_resolve(x->dev->sim, sp->addr, &first, &off, &psize) == CP_OK && off == 0 &&
                    psize == sp->size &&
                    cp_sim_vmm_resolve(x->dev->sim, sp->addr + sp->size - 1, &last, &last_off, NULL) == CP_OK &&
                    last == first,
                "share of slot %d: span %zu (%#" PRIxPTR ", %zu bytes) is not one handle mapped whole", si, k, sp->addr,
                sp->size);
      at += sp->size;
    }
    FZ_ASSERT(at == sh.base + sh.size, "share of slot %d: the spans add up to %zu bytes, not %zu", si,
              (size_t)(at - sh.base), sh.size);
    /* The block's first byte, reached through the description, is the slot's. */
    cp_page_t page = 0;
    size_t page_off = 0;
    size_t left = sh.offset, k = 0;
    while (left >= sh.spans[k].size) left -= sh.spans[k++].size;
    const uintptr_t through = sh.spans[k].addr + left;
    FZ_ASSERT(cp_sim_vmm_resolve(x->dev->sim, through, &page, &page_off, NULL) == CP_OK && page == s->page &&
                  page_off == s->page_off,
              "share of slot %d: offset %zu reaches another byte than the block's first", si, sh.offset);
  }
  cp_share_release(&sh);
  FZ_ASSERT(sh.spans == NULL && sh.span_count == 0, "cp_share_release left spans");
  s->shared = 1;
  fz_shares_run++;
}

/* Whether pausing `tag` (0: every region) must be refused: a block of it is shared. */
static int pause_meets_shared(const model_t *m, uint32_t tag) {
  for (int i = 0; i < NSLOTS; i++) {
    const slot_t *s = &m->slot[i];
    if (s->ptr != NULL && s->shared && s->tag != 0 && (tag == 0 || s->tag == tag)) return 1;
  }
  return 0;
}

/* Pause operations of the current input so far (fz_pause_every thins them the same way
 * whether the input runs alone or among others). */
static size_t pause_ops;

static void do_pause(ctx_t *x, reader_t *r) {
  model_t *m = x->m;
  const uint8_t b = rd_u8(r);
  if (fz_pause_every > 1 && pause_ops++ % fz_pause_every != 0) return;
  const uint32_t tag = m->region_ids[b % 3];
  const unsigned flags = CP_PAUSE_BACKUP | ((b & 4) ? CP_PAUSE_KEEP_FREE : 0u);
  const uint64_t faults = cp_sim_faults_injected(x->dev->sim);
  int rc = cp_pool_pause(x->pool, tag, flags);
  const int fired = cp_sim_faults_injected(x->dev->sim) != faults;
  expect_failure_explained(rc);
  if (!m->paged) {
    FZ_ASSERT(rc == CP_ERR_STATE, "pause of a pool without page-mapped memory: %s", cp_status_name(rc));
    return;
  }
  if (pause_meets_shared(m, tag)) {
    FZ_ASSERT(rc == CP_ERR_STATE && contains_text(cp_last_error(), "shared with another process"),
              "pause of a region holding a shared block: %s (%s)", cp_status_name(rc), cp_last_error());
    cp_clear_error();
    fz_shared_refusals_run++;
    return;
  }
  FZ_ASSERT(rc == CP_OK || fired, "pause failed with %s, no failure injected", cp_status_name(rc));
  fz_pauses_run++;
  FZ_ASSERT(cp_pool_check(x->pool, stderr) == 0, "the pool's invariant check failed while paused (see above)");
  cp_pool_info_t in;
  cp_pool_info(x->pool, &in);
  FZ_ASSERT(in.allocated + in.cached_free + in.pending_free == in.reserved + in.paused_bytes,
            "paused: allocated %zu + cached %zu + pending %zu != reserved %zu + paused %zu", in.allocated,
            in.cached_free, in.pending_free, in.reserved, in.paused_bytes);
  FZ_ASSERT(in.reserved == cp_sim_reserved_bytes(x->dev->sim),
            "paused: the pool says %zu bytes reserved, the device %zu", in.reserved,
            cp_sim_reserved_bytes(x->dev->sim));
  FZ_ASSERT(cp_sim_print_device_faults(x->dev->sim, stderr) == 0, "device faults while pausing");
  for (int tries = 0;; tries++) {
    cp_clear_error();
    const uint64_t before = cp_sim_faults_injected(x->dev->sim);
    rc = cp_pool_resume(x->pool, tag);
    if (rc == CP_OK) break;
    expect_failure_explained(rc);
    FZ_ASSERT(tries < 4, "resume keeps failing: %s", cp_status_name(rc));
    if (rc == CP_ERR_OOM && cp_sim_faults_injected(x->dev->sim) == before) {
      /* A cap below what the pool held already (it only stops growth): the region does not
       * fit under it again. Lifted for the resume, then set again. */
      FZ_ASSERT(expected_cap(m) != 0 && contains_text(cp_last_error(), "memory cap"),
                "resume ran out of memory without a cap: %s", cp_last_error());
      const uint64_t lifting = cp_sim_faults_injected(x->dev->sim);
      FZ_ASSERT(cp_pool_set_memory_cap(x->pool, 0) == CP_OK && cp_pool_set_memory_fraction(x->pool, 0) == CP_OK,
                "lifting the cap");
      /* Setting a fraction asks the device for its total (do_fraction): from now on a
       * fraction applies, the configuration's one when it is set again below. */
      if (cp_sim_faults_injected(x->dev->sim) == lifting) m->total_known = 1;
      for (int again = 0;; again++) { /* an armed failure may still fire */
        const uint64_t armed = cp_sim_faults_injected(x->dev->sim);
        rc = cp_pool_resume(x->pool, tag);
        if (rc == CP_OK) break;
        FZ_ASSERT(again < 4 && cp_sim_faults_injected(x->dev->sim) != armed, "resume with no cap: %s: %s",
                  cp_status_name(rc), cp_last_error());
      }
      FZ_ASSERT(cp_pool_set_memory_cap(x->pool, m->memory_cap) == CP_OK, "cap again");
      if (m->memory_fraction > 0)
        FZ_ASSERT(cp_pool_set_memory_fraction(x->pool, m->memory_fraction) == CP_OK, "fraction");
      break;
    }
  }
  cp_pool_info(x->pool, &in);
  FZ_ASSERT(in.paused_bytes == 0 && in.backup_bytes == 0, "resumed: %zu bytes paused, %zu backed up", in.paused_bytes,
            in.backup_bytes);
  for (int i = 0; i < NSLOTS; i++) { /* where each live block's first byte is now */
    slot_t *s = &m->slot[i];
    if (s->ptr == NULL) continue;
    FZ_ASSERT(cp_sim_vmm_resolve(x->dev->sim, (uintptr_t)s->ptr, &s->page, &s->page_off, NULL) == CP_OK,
              "resumed: slot %d (%p) is not mapped", i, (void *)s->ptr);
  }
}

/* ------------------------------------------------------------------------------------------
 * One input
 * ---------------------------------------------------------------------------------------- */

/* Configurations the first byte picks from: each one reaches a different policy. */
static const char *const configs[] = {
    "",
    "max_split_size_mb:32",
    "release_before_grow:True",
    "roundup_power2_divisions:4",
    "roundup_power2_divisions:[1:1,2:2,8:4,>:8]",
    "garbage_collection_threshold:0.5",
    "max_split_size_mb:24,max_non_split_rounding_mb:1,garbage_collection_threshold:0.8",
    "granule_bytes:1024,small_size_mb:0.5,small_segment_mb:1,large_segment_mb:8,min_large_alloc_mb:4,round_large_mb:1",
    "memory_cap_mb:48",
    "memory_fraction:0.75,release_before_grow:True",
    "max_split_size_mb:21,max_non_split_rounding_mb:0,roundup_power2_divisions:2",
    "granule_bytes:256,garbage_collection_threshold:0.3,max_split_size_mb:40",
};

/* Page-mapped configurations, picked instead when the top three bits of the second byte are
 * all set (a pattern the committed inputs of the configurations above do not use). Small
 * chunks, so that the 64-96 MiB device holds many of them and growth, unmapping and giving
 * ranges back happen often. The first byte picks one (b0 % 8), the device's granularity
 * (b0 / 8 % 4) and, rarely, a device that cannot serve them (b0 / 32 % 8: 6, the granularity
 * query fails at creation; 7, a device without page-mapped memory): plain segments then. */
static const char *const paged_configs[] = {
    "expandable_segments:True",
    "expandable_segments:True,small_size_mb:0.25,small_segment_mb:0.5,min_large_alloc_mb:2,large_segment_mb:4",
    "expandable_segments:True,min_large_alloc_mb:2,large_segment_mb:3,max_split_size_mb:8",
    "expandable_segments:True,min_large_alloc_mb:4,large_segment_mb:6,roundup_power2_divisions:4,"
    "garbage_collection_threshold:0.5",
    "expandable_segments:True,min_large_alloc_mb:4,large_segment_mb:4,memory_cap_mb:40",
    "expandable_segments:True,min_large_alloc_mb:3,large_segment_mb:3,memory_fraction:0.6,release_before_grow:True",
    "expandable_segments:True,granule_bytes:1024,small_size_mb:0.5,small_segment_mb:1,large_segment_mb:2,"
    "min_large_alloc_mb:2,round_large_mb:1",
    "expandable_segments:True,small_size_mb:0.125,small_segment_mb:0.25,min_large_alloc_mb:1,large_segment_mb:1.5,"
    "max_split_size_mb:24,max_non_split_rounding_mb:1",
};
#define NPAGED (sizeof paged_configs / sizeof paged_configs[0])
static const size_t paged_granularity[] = {4096, 64 * 1024, 512 * 1024, 2 * MiB};

/* Stitching configurations (page_stitching:True), picked instead of those above when the
 * third byte is STITCH_MARK too (no committed input of the configurations above has it); the
 * operations then start at the fourth byte. The first byte picks one, the granularity and the
 * rare device without page-mapped memory as for paged_configs; the granularities are small,
 * so that a 64-96 MiB device holds many pages and large requests stitch often. One learns the
 * step plan (plan_steps:True): random operations rarely repeat a step, but learning runs beside
 * every operation and fault. */
static const char *const stitch_configs[] = {
    "expandable_segments:True,page_stitching:True",
    "expandable_segments:True,page_stitching:True,min_large_alloc_mb:2,large_segment_mb:4",
    "expandable_segments:True,page_stitching:True,memory_cap_mb:40,memory_fraction:0.7",
    "expandable_segments:True,page_stitching:True,release_before_grow:True,min_large_alloc_mb:2,plan_steps:True",
    "expandable_segments:True,page_stitching:True,roundup_power2_divisions:4,garbage_collection_threshold:0.5",
    "expandable_segments:True,page_stitching:True,min_large_alloc_mb:2,large_segment_mb:4,max_split_size_mb:8",
    "expandable_segments:True,page_stitching:True,granule_bytes:1024,small_size_mb:0.5,round_large_mb:1",
    "expandable_segments:True,page_stitching:True,max_split_size_mb:24,roundup_power2_divisions:[1:1,2:2,8:4,>:8]",
};
#define NSTITCH (sizeof stitch_configs / sizeof stitch_configs[0])
static const size_t stitch_granularity[] = {128 * 1024, 256 * 1024, 512 * 1024, 1 * MiB};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  reader_t r = {data, size};
  op_index = -1;
  pause_ops = 0;
  cp_clear_error();
  uint8_t b0 = rd_u8(&r);
  uint8_t b1 = rd_u8(&r);

  model_t *m = calloc(1, sizeof *m);
  FZ_ASSERT(m != NULL, "no host memory for the model");
  cp_config_default(&m->cfg);
  m->paged_cfg = (b1 >> 5) == 7;
  int stitch_cfg = m->paged_cfg && r.n > 0 && r.p[0] == STITCH_MARK;
  if (stitch_cfg) (void)rd_u8(&r);
  const char *conf = stitch_cfg     ? stitch_configs[b0 % NSTITCH]
                     : m->paged_cfg ? paged_configs[b0 % NPAGED]
                                    : configs[b0 % (sizeof configs / sizeof configs[0])];
  size_t granularity = stitch_cfg ? stitch_granularity[b0 / NSTITCH % 4] : paged_granularity[b0 / NPAGED % 4];
  int no_vmm = m->paged_cfg && b0 / (4 * NPAGED) % 8 == 7;
  int gran_fails = m->paged_cfg && b0 / (4 * NPAGED) % 8 == 6;
  FZ_ASSERT(cp_config_parse(&m->cfg, conf) == CP_OK, "config '%s' refused", conf);
  /* The second byte: capacity, how the input ends, whether mem_info fails at creation. */
  m->capacity = (64 + 16 * (size_t)(b1 % 3)) * MiB;
  int abrupt_end = (b1 >> 2) & 1;
  int no_total = ((b1 >> 3) & 3) == 3;
  m->memory_cap = m->cfg.memory_cap;
  m->memory_fraction = m->cfg.memory_fraction;
  m->next_seed = 1;
  FZ_ASSERT(cp_region_id("fuzz_a", &m->region_ids[1]) == CP_OK && cp_region_id("fuzz_b", &m->region_ids[2]) == CP_OK,
            "region names");

  dev_t dev;
  memset(&dev, 0, sizeof dev);
  FZ_ASSERT(cp_sim_create(m->capacity, no_vmm ? CP_SIM_NO_VMM : 0, &dev.sim) == CP_OK, "cp_sim_create");
  if (m->paged_cfg && !no_vmm) {
    FZ_ASSERT(cp_sim_set_vmm_granularity(dev.sim, granularity) == CP_OK, "granularity %zu", granularity);
    if (gran_fails) cp_sim_fail_nth(dev.sim, CP_SIM_VMM_GRANULARITY, 1, CP_ERR_BACKEND);
  }
  cp_sim_backend(dev.sim, &dev.real);
  cp_backend_t backend;
  dev_backend(&dev, &backend);
  cp_pool_t *pool = NULL;
  if (no_total) cp_sim_fail_nth(dev.sim, CP_SIM_MEM_INFO, 1, CP_ERR_BACKEND);
  FZ_ASSERT(cp_pool_create(&m->cfg, &backend, &pool) == CP_OK, "cp_pool_create");
  m->total_known = !no_total;
  FZ_ASSERT(cp_sim_faults_injected(dev.sim) == (uint64_t)no_total + (uint64_t)gran_fails, "failures at creation");
  {
    cp_pool_info_t in;
    cp_pool_info(pool, &in);
    m->paged = in.page_mapped;
    FZ_ASSERT(m->paged == (m->paged_cfg && !no_vmm && !gran_fails), "page_mapped is %d", m->paged);
    m->stitch = m->paged && m->cfg.page_stitching;
    for (int k = 0; k < 2; k++) {
      size_t base = k == 0 ? m->cfg.small_segment : m->cfg.large_segment;
      /* With stitching every mapping is one page. */
      m->chunk[k] = m->stitch ? granularity : (base + granularity - 1) / granularity * granularity;
    }
  }
  ctx_t x = {pool, &dev, m};

  for (op_index = 0; op_index < MAX_OPS && r.n > 0; op_index++) {
    cp_clear_error();
    uint8_t op = rd_u8(&r) % OP_COUNT;
    switch (op) {
      case OP_ALLOC_A:
      case OP_ALLOC_B:
      case OP_ALLOC_C:
      case OP_ALLOC_D: {
        int si = rd_u8(&r) % NSLOTS;
        if (m->slot[si].ptr != NULL)
          do_free(&x, si, 0); /* make room in the slot first */
        else
          do_alloc(&x, si, pick_size(&r, m));
        break;
      }
      case OP_FREE_A:
      case OP_FREE_B:
      case OP_FREE_C: {
        uint8_t sb = rd_u8(&r);
        int si = sb % NSLOTS;
        if (m->slot[si].ptr != NULL) do_free(&x, si, sb >= 128);
        break;
      }
      case OP_RECORD: {
        int si = rd_u8(&r) % NSLOTS;
        uint8_t sb = rd_u8(&r);
        if (m->slot[si].ptr == NULL) break;
        if (sb & 0x80) { /* used on every stream */
          for (unsigned st = 0; st < NSTREAMS; st++) do_record(&x, si, st);
        } else {
          do_record(&x, si, sb % NSTREAMS);
        }
        break;
      }
      case OP_STREAM: m->stream = rd_u8(&r) % NSTREAMS; break;
      case OP_COMPLETE: dev_complete(&dev, rd_u8(&r) % NSTREAMS); break;
      case OP_MISC: do_misc(&x, &r); break;
      case OP_CAP: do_cap(&x, &r); break;
      case OP_FRACTION: do_fraction(&x, &r); break;
      case OP_FAULT: do_fault(&x, &r); break;
      case OP_REGION: m->region = rd_u8(&r) % 3; break;
      case OP_PAUSE: do_pause(&x, &r); break;
      default: do_bad_pointer(&x, &r); break;
    }
    prune_guards(m, &dev);
    if (fz_check_every <= 1 || (size_t)op_index % fz_check_every == fz_check_every - 1) check_all(pool, m, &dev);
    fz_ops_run++;
  }

  if (fz_check_every > 1) check_all(pool, m, &dev); /* the input's last operations */
  op_index = -2;
  for (int k = 0; k < CP_SIM_CALL_COUNT; k++) cp_sim_fail_nth(dev.sim, (cp_sim_call_t)k, 0, CP_OK);
  if (abrupt_end) {
    /* Destroy with allocations live and frees pending: the pool still gives every segment
     * and every event back. */
    cp_pool_destroy(pool);
    pool = NULL;
  }
  /* Else give everything back, with no failure armed: every call must now succeed. */
  for (int i = 0; i < NSLOTS && pool != NULL; i++) {
    if (m->slot[i].ptr == NULL) continue;
    cp_clear_error();
    do_free(&x, i, i % 2);
    FZ_ASSERT(m->slot[i].ptr == NULL, "final free of slot %d failed", i);
  }
  if (pool != NULL) {
    dev_complete_all(&dev);
    prune_guards(m, &dev);
    FZ_ASSERT(cp_empty_cache(pool) == CP_OK, "final empty_cache");
    check_all(pool, m, &dev);
    cp_pool_info_t in;
    cp_pool_info(pool, &in);
    FZ_ASSERT(in.reserved == 0 && in.allocated == 0 && in.cached_free == 0 && in.pending_free == 0 &&
                  in.segments == 0 && in.page_segments == 0 && in.stitched_ranges == 0 && in.stitched_space == 0,
              "after freeing everything: %zu reserved in %zu segments (%zu cached, %zu pending)", in.reserved,
              in.segments, in.cached_free, in.pending_free);
    cp_pool_destroy(pool);
  }
  FZ_ASSERT(cp_sim_reserved_bytes(dev.sim) == 0 && cp_sim_live_reservations(dev.sim) == 0,
            "the device still holds %zu bytes in %zu reservations", cp_sim_reserved_bytes(dev.sim),
            cp_sim_live_reservations(dev.sim));
  FZ_ASSERT(cp_sim_live_events(dev.sim) == 0, "the device still holds %zu events", cp_sim_live_events(dev.sim));
  FZ_ASSERT(cp_sim_vmm_ranges(dev.sim) == 0 && cp_sim_vmm_pages(dev.sim) == 0 && cp_sim_vmm_mappings(dev.sim) == 0,
            "the device still holds %zu page-mapped ranges, %zu pages, %zu mappings", cp_sim_vmm_ranges(dev.sim),
            cp_sim_vmm_pages(dev.sim), cp_sim_vmm_mappings(dev.sim));
  fz_faults_run += cp_sim_faults_injected(dev.sim);
  cp_sim_destroy(dev.sim);
  for (size_t g = 0; g < m->nguards; g++) free(m->guard[g].pieces);
  free(dev.events);
  free(m->pieces);
  cp_checkpoint_destroy(m->ck);
  free(m);
  return 0;
}
