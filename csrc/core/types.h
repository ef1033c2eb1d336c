/* types.h — blocks, segments and stitched runs: the data every layer of the core reads.
 * Owns no functions; the block layer (block.c) keeps the invariants below. */
#ifndef CP_TYPES_H
#define CP_TYPES_H

#include <stdbool.h>
#include <stdint.h>

#include "core/cp.h"

typedef struct cp_block_s cp_block_t;
typedef struct cp_segment_s cp_segment_t;
typedef struct cp_stream_state_s cp_stream_state_t;

/* ------------------------------------------------------------------------------------------
 * Blocks and segments (block.c)
 *
 * A segment is one backend reservation. Its blocks tile it exactly, in address order:
 *   seg->head->addr == seg->addr,  b->next->addr == b->addr + b->size,
 *   sum(b->size for b in seg) == seg->size,  no two neighbouring blocks are both FREE.
 * A block is in exactly one state:
 *   FREE     in the index of (seg->stream, seg->kind), not in the live map;
 *   LIVE     handed to a user, in the live map, not in the index;
 *   PENDING  freed by the user, waiting for `pending_events` stream events; in neither.
 * Blocks of different segments never merge, even when their addresses touch.
 *
 * A page-mapped segment (seg->paged, expand.c) is an address range of which only some whole
 * chunks are mapped; its blocks tile the whole range, and three more states cover what is not
 * (or not yet, or no longer) memory. None of them is ever in an index or the live map:
 *   UNMAPPED   no memory behind it (whole chunks); never next to another UNMAPPED block;
 *   MAPPING    unmapped chunks being mapped right now, without the lock;
 *   UNMAPPING  mapped chunks being unmapped right now, without the lock.
 * With page_stitching (stitch.c) a fourth state lends mapped bytes to a stitched range:
 *   LENT       whole pages whose memory a stitched block in use holds (at another address).
 * Memory given back waits for its stream first (drain.c, Note [Stream-ordered release]):
 *   DRAINING   whole free chunks retired for unmapping, waiting for the work queued on the
 *              segment's stream before the retirement (the stream's drain event); still
 *              mapped and reserved, in no index, never handed out until revived (FREE).
 * FREE merges only with FREE, so mapped and unmapped blocks never merge. For each such
 *   seg->mapped == sum of the sizes of its FREE, LIVE, PENDING, LENT and DRAINING blocks (UNMAPPING
 *   bytes are out of it, and out of reserved_bytes, from the moment they are carved out),
 * and at least one block is UNMAPPED or MAPPING (the last chunk is never mapped), so a FREE
 * block of a page-mapped segment is always split and such a segment is never on the list of
 * wholly free segments. reserved_bytes == sum(seg->size of plain) + sum(seg->mapped - seg->paused
 * of paged): a paused stretch keeps its blocks but has no memory behind it (pause.c).
 * ---------------------------------------------------------------------------------------- */

typedef enum cp_block_state_e {
  CP_BLOCK_FREE = 0,
  CP_BLOCK_LIVE = 1,
  CP_BLOCK_PENDING = 2,
  CP_BLOCK_UNMAPPED = 3,
  CP_BLOCK_MAPPING = 4,
  CP_BLOCK_UNMAPPING = 5,
  CP_BLOCK_LENT = 6,
  CP_BLOCK_DRAINING = 7
} cp_block_state_t;

struct cp_block_s {
  uintptr_t addr;
  size_t size;      /* bytes, a multiple of the granule */
  size_t requested; /* bytes the user asked for; 0 when FREE */
  cp_segment_t *segment;
  cp_block_t *prev;        /* lower neighbour in the segment, NULL for the head */
  cp_block_t *next;        /* higher neighbour, NULL for the tail */
  cp_block_t *left;        /* index (treap) children, FREE only; `left` doubles as the */
  cp_block_t *right;       /*   spare-list link when the node is unused */
  uint32_t priority;       /* treap heap key, derived from the address */
  uint8_t state;           /* cp_block_state_t */
  uint8_t shared;          /* LIVE: shared with another process (share.c); cleared when its use ends */
  uint8_t plan;            /* 0, or a step plan's: CP_PLAN_NODE or CP_PLAN_RANGE (plan.h) */
  uint32_t pending_events; /* PENDING: events still to complete */
  uint32_t use_count;      /* streams other than the allocation stream (record_stream) */
  uint32_t use_cap;
  cp_stream_t *uses; /* heap array of those streams, NULL when none ever recorded */
  uint64_t plan_seq; /* LIVE, made while the step plan learns: its allocation's number + 1; else 0 */
};

struct cp_segment_s {
  uintptr_t addr;
  size_t size;               /* bytes reserved from the backend (address space when paged) */
  size_t mapped;             /* paged: bytes mapped (what reserved_bytes counts); else 0 */
  size_t chunk;              /* paged: bytes mapped and unmapped at a time; else 0 */
  bool paged;                /* a page-mapped segment (expand.c) */
  cp_stream_state_t *stream; /* allocation stream: its blocks serve only this stream */
  uint8_t kind;              /* CP_KIND_SMALL or CP_KIND_LARGE */
  cp_block_t *head;          /* lowest-address block */
  cp_segment_t *prev;        /* pool's segment list */
  cp_segment_t *next;
  cp_segment_t *free_prev; /* the pool's list of wholly free segments, while this one is */
  cp_segment_t *free_next;
  bool in_free_list;
  uint64_t serial;  /* the pool's number for it, given when first linked (never reused) */
  bool drop_failed; /* scratch of cp_expand_drop_unmapped_locked */
  /* paged with page_stitching: the page mapped at each granule of the range (0: none), for
   * the first `page_slots` granules; the pool keeps these handles until it unmaps them. */
  cp_page_t *pages;
  size_t page_slots;
  /* A stitched range (stitch.c): on the pool's list of those, never on `segments`. */
  bool stitched;
  struct cp_stitch_run_s *runs; /* where its pages come from, in the range's order */
  size_t run_count;
  uint64_t last_use;   /* the pool's stitch clock when its block was last freed */
  uint64_t born;       /* the pool's stitch count when it was stitched (its age) */
  bool broken;         /* never serves: kept only until it is unmapped and given back */
  bool retired;        /* broken by a release: waits for its stream's drain event (drain.c) */
  bool trim_only;      /* retired by the trim of kept ranges alone: it may still serve its stream */
  bool release_failed; /* scratch of cp_stitch_drop_retired_locked */
  /* Paused (pause.c, Note [Paused regions]): a page-mapped segment lists the stretches of it
   * the pause unmapped (whole maximal stretches of mapped blocks, which keep their states);
   * `paused` is their bytes, still in `mapped` but not in reserved_bytes. A stitched range
   * that is paused has mapped == 0 and maps its whole size again at resume. */
  bool paused_range;
  size_t paused;
  struct cp_span_s *spans;
  size_t span_count;
  size_t span_cap;
};

/* An address range: [addr, addr + size). */
typedef struct cp_span_s {
  uintptr_t addr;
  size_t size;
} cp_span_t;

/* One run of a stitched range: `size` bytes of the page-mapped segment `seg` at `addr`,
 * mapped next in the stitched range; `lent` is the LENT block holding them while the stitched
 * block is in use (LIVE or PENDING), else NULL. */
typedef struct cp_stitch_run_s {
  cp_segment_t *seg;
  uintptr_t addr;
  size_t size;
  cp_block_t *lent;
  size_t skip; /* bytes at its start that no block of the range covers (a first run only) */
} cp_stitch_run_t;

static inline bool cp_block_is_split(const cp_block_t *b) { return b->prev != NULL || b->next != NULL; }
/* qsort's order of an array of block pointers: by address. */
static inline int cp_block_ptr_by_addr(const void *a, const void *b) {
  const cp_block_t *x = *(const cp_block_t *const *)a, *y = *(const cp_block_t *const *)b;
  return x->addr < y->addr ? -1 : x->addr > y->addr;
}
static inline bool cp_segment_is_free(const cp_segment_t *s) {
  return s->head->state == CP_BLOCK_FREE && s->head->next == NULL;
}

#if defined(__GNUC__)
#define CP_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define CP_COLD        __attribute__((cold, noinline))
#else
#define CP_UNLIKELY(x) (x)
#define CP_COLD
#endif

#endif /* CP_TYPES_H */
