/* plan_types.h — the step plan's state in the pool (plan.c serves it, plan_learn.c learns it),
 * Note [Learning the step]: what the pool's struct, the checker and the reports read. */
#ifndef CP_PLAN_TYPES_H
#define CP_PLAN_TYPES_H

#include <stdint.h>

#include "core/types.h"

/* Note [Learning the step]
 * With plan_steps (on a stitching pool), the pool watches the sequence of its allocations
 * (rounded size and stream, untagged and outside captures) and their frees, and looks for the
 * period of a training loop's step (plan_learn.c):
 *  - Learning. A rolling hash of each allocation's key and the K - 1 before it names the latest
 *    earlier allocation with the same K keys; the distance P is a candidate period. It holds
 *    while every new key equals the key P before it, and is accepted once two whole periods
 *    agree and the watched bytes in use are the same at both ends (a step leaves memory as it
 *    found it; a layer of a forward pass repeats too, but leaves its saved activations behind).
 *    A candidate is only proposed where the bytes in use were the same a period back.
 *  - Planning (without the lock). The earlier period is the step. An allocation of it is
 *    planned when it was freed less than one period after it was made (in the order of
 *    allocations and frees; the longer of the two periods' lifetimes), on the step's busiest
 *    stream: it lives from its allocation to its free on a circle of one period, possibly across
 *    the step's end. The others stay the pool's (their positions still count). Position 0 is
 *    turned to the allocation where the planned bytes in use across it are fewest (the loop's
 *    step boundary), and each planned entry gets the list of entries due free before it. At
 *    most the 4,096 largest are planned (placement is quadratic); the rest stay the pool's.
 *  - Adoption (plan.c), at the next allocation at position 0 whose key matches. The planned
 *    allocations are placed largest first, each at the best fitting gap among those whose time
 *    overlaps its own (greedy by size), in bins of the step's stream's free memory as it lies:
 *    first its free blocks (a plan they hold whole needs no device call), else the free ends of
 *    handles in part use, which stitching cannot take, with the rest in one overflow range the
 *    pool's ladder stitches from the wholly free handles. The layout that needs no new memory
 *    and has the smaller overflow wins; the plan never makes the pool grow (when every layout
 *    would, it waits for the next steps' starts, three times, then learns again). The pieces
 *    used are carved out of the pool: LIVE blocks of the plan (plan == CP_PLAN_RANGE), out of
 *    the live map and the allocation stats, reserved as any block.
 *  - Serving. An allocation whose key is the one planned at the current position is the
 *    entry's own block node at its bin + offset: LIVE, in the live map, counted as allocated,
 *    no index touched (O(1)). Before it, the entries due free by this position are checked:
 *    one still in use (freed late, or waiting for another stream's events) means its bytes may
 *    overlap, and the plan is lost. A key off the plan: when it is the next position's, this
 *    one is skipped (nothing of it is in use); else it is an extra allocation, the pool's,
 *    and the position stays (a few per step; more lose the plan).
 *  - Lost. Every allocation is the pool's until one matches position 0 while no planned block
 *    that position 0 does not expect is in use; serving resumes there. A step served whole
 *    resets the count; three losses (or a step's worth of allocations lost, three times) drop
 *    the plan.
 *  - Dropped (misses, the out-of-memory ladder, empty_cache): nothing more is served; the bins
 *    go back to the pool when the last planned block is freed, and learning starts again
 *    (after misses of a plan that never served a whole step, only for longer periods).
 * Stream order: planned addresses are reused only by the step's own stream (in stream
 * order); a planned block used on another stream (record_stream) waits for its events like
 * any block and keeps its place in use until then. Invariants (check.c):
 *   live, live_bytes == count and bytes of planned nodes LIVE or PENDING;  live_nonwrap <= live;
 *   planned nodes in use never overlap;  bins != NULL  <=>  state is SERVING, LOST, DYING or ADOPTING;
 *   each bin is LIVE, plan == CP_PLAN_RANGE, out of the live map; range_bytes == their bytes. */

enum { CP_PLAN_NODE = 1, CP_PLAN_RANGE = 2 }; /* cp_block_t.plan */
enum { CP_PLAN_FAMILIES = 5 };                /* the allocation statistics (plan.c) */

typedef enum cp_plan_state_e {
  CP_PLAN_OFF = 0,      /* plan_steps off, or the pool does not stitch pages */
  CP_PLAN_LEARNING = 1, /* watching for a period */
  CP_PLAN_PLANNING = 2, /* a thread computes the plan without the lock */
  CP_PLAN_ARMED = 3,    /* a plan waits for position 0 */
  CP_PLAN_SERVING = 4,
  CP_PLAN_LOST = 5,
  CP_PLAN_DYING = 6,   /* dropped: the bins go back when the last planned block is freed */
  CP_PLAN_ADOPTING = 7 /* bins carved, the overflow being taken from the ladder (the lock may drop) */
} cp_plan_state_t;

/* One allocation of the step. `node` is the block handed out for it (state FREE while the
 * entry is not in use). */
typedef struct cp_plan_entry_s {
  size_t size;        /* rounded bytes: the key, with the stream */
  cp_stream_t stream; /* the allocation stream */
  size_t offset;      /* in its bin, when planned */
  uint32_t due_first; /* due[due_first .. due_first + due_count): entries freed before it */
  uint32_t due_count;
  uint32_t bin;    /* planned: the bin its node lies in */
  uint8_t planned; /* 0: the pool serves it (another stream, or it lives longer than a step) */
  uint8_t wraps;   /* planned and in use across position 0 */
  cp_block_t node;
} cp_plan_entry_t;

struct cp_plan_learn_s; /* plan.c */
struct cp_plan_arc_s;   /* plan.c */

typedef struct cp_plan_s {
  uint8_t state; /* cp_plan_state_t */
  struct cp_plan_learn_s *learn;
  /* The plan: entries in step order from position 0, the due lists. */
  cp_plan_entry_t *entries;
  uint32_t count;
  uint32_t *due;
  uint32_t pos;               /* the position of the next allocation */
  uint32_t extra;             /* allocations off the plan at the current step */
  struct cp_plan_arc_s *arcs; /* the planned entries' lifetimes, placed at adoption */
  uint32_t arc_count;
  uint64_t period; /* the step's length in watched allocations and frees */
  /* Adoption with an overflow from the ladder (cp_plan_adopt_finish_locked): its bytes and
   * stream, and the allocation figures before it was taken. */
  size_t overflow_bytes;
  cp_stream_t overflow_stream;
  cp_stat_t saved[CP_PLAN_FAMILIES][CP_KIND_COUNT];
  cp_stat_t saved_oversize;
  uint32_t adopt_tries; /* positions 0 at which the plan found no room */
  /* Held while serving, lost or dying: the bins (blocks of the pool's free memory, each LIVE
   * with plan == CP_PLAN_RANGE) the planned nodes lie in, and their bytes. */
  cp_block_t **bins;
  uint32_t bin_count;
  size_t range_bytes;
  size_t live;       /* planned nodes in use (LIVE or PENDING) */
  size_t live_bytes; /* their bytes: the rest of range_bytes is the plan's idle memory */
  size_t live_nonwrap;
  uint32_t losses;      /* losses since the last step served whole */
  uint64_t whole_steps; /* steps served whole since the plan was adopted */
  uint32_t min_period;  /* learning looks for longer periods than this */
  uint64_t seq;         /* allocations watched so far (learning and armed) */
  uint64_t armed_at;    /* ARMED: the ordinal that is position 0, modulo count */
  /* Figures (cp_pool_info). */
  uint64_t plans;        /* plans adopted */
  uint64_t served;       /* allocations served by a plan */
  uint64_t missed;       /* allocations the pool served while a plan was held */
  uint64_t drops;        /* plans dropped */
  uint64_t plan_ns;      /* time spent computing plans */
  uint64_t last_planned; /* entries planned in the last plan */
  uint32_t last_count;   /* allocations of the last plan's step */
} cp_plan_t;

/* The plan's memory no planned block uses now (cached: cp_pool_info, out-of-memory reports). */
static inline size_t cp_plan_idle_bytes(const cp_plan_t *pl) {
  return pl->bins != NULL ? pl->range_bytes - pl->live_bytes : 0;
}

/* The state's name, for errors and the checker. */
static inline const char *cp_plan_state_name(int state) {
  switch (state) {
    case CP_PLAN_OFF: return "off";
    case CP_PLAN_LEARNING: return "learning";
    case CP_PLAN_PLANNING: return "planning";
    case CP_PLAN_ARMED: return "armed";
    case CP_PLAN_SERVING: return "serving";
    case CP_PLAN_LOST: return "lost";
    case CP_PLAN_DYING: return "dropped";
    case CP_PLAN_ADOPTING: return "adopting";
    default: return "?";
  }
}

#endif /* CP_PLAN_TYPES_H */
