/* plan_learn.h — learning the step and laying out its plan (plan_learn.c), Note [Learning the
 * step] in plan_types.h: the log of watched allocations, the period, lifetimes and offsets. */
#ifndef CP_PLAN_LEARN_H
#define CP_PLAN_LEARN_H

#include "core/state.h"

#define CP_PLAN_MAX_PERIOD 32768u /* allocations per step, at most (may be modified) */

/* One watched allocation. Times count the allocations and frees the learning watched. */
typedef struct cp_plan_rec_s {
  size_t size;
  cp_stream_t stream;
  uint64_t t_alloc;
  uint64_t t_free; /* CP_PLAN_NOT_FREED while in use */
  uint64_t live;   /* watched bytes in use right after it was made */
  uint64_t kgram;  /* the hash of its K-gram (its key and the K - 1 before), 0 before the K-th */
  uint32_t prev;   /* the record before it with the same K-gram, + 1 (0: none) */
} cp_plan_rec_t;

/* A step to plan: `count` allocations, time in [0, period), each with its start and length. */
typedef struct cp_plan_work_s {
  uint32_t count;
  uint64_t period;    /* the step's length in watched allocations and frees */
  cp_plan_rec_t *rec; /* the two periods' records, copied: [0, 2 * count) */
  /* Out: */
  cp_plan_entry_t *entries;
  uint32_t *due;
  struct cp_plan_arc_s *arcs; /* one per planned entry, largest first */
  uint32_t origin;            /* the record (in the first period) that is position 0 */
  uint32_t planned;
} cp_plan_work_t;

typedef struct cp_plan_arc_s {
  uint64_t start, len; /* in step time from position 0; start + len may pass the period */
  size_t size;
  uint32_t entry;
} cp_plan_arc_t;

uint64_t cp_plan_now_ns(void);
/* The log, started afresh at allocation number pl->seq; its host memory given back. */
void cp_plan_learn_reset(cp_plan_t *pl);
void cp_plan_learn_free(cp_plan_t *pl);
/* Room for one more record; false without host memory (learning then waits). */
bool cp_plan_learn_room(cp_plan_t *pl);
/* Log an allocation; the period found (two periods alike, ending here), or 0. */
uint32_t cp_plan_learn_alloc(cp_plan_t *pl, size_t rounded, cp_stream_t stream);
/* A block the learning watched (b->plan_seq != 0) is freed by its user. */
void cp_plan_watch_free_locked(cp_pool_t *pool, cp_block_t *b);
/* The last two periods of `p` allocations of the log, copied into w->rec (count set), and
 * the number of the first; false without host memory. */
bool cp_plan_learn_window(const cp_plan_t *pl, uint32_t p, cp_plan_work_t *w, uint64_t *out_first);
/* The plan of w->rec's first period (no lock needed): entries from position 0, due lists,
 * arcs. CP_OK, or CP_ERR_HOST_OOM. */
int cp_plan_compute(cp_plan_work_t *w);
/* Greedy by size into bins (Note [Learning the step]); see plan_learn.c. */
bool cp_plan_place(const struct cp_plan_arc_s *arcs, uint32_t n, uint64_t period, cp_plan_entry_t *entries,
                   const size_t *bin_size, size_t *bin_top, uint32_t bins);

#endif /* CP_PLAN_LEARN_H */
