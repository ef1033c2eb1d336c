/* plan.c — the step plan, Note [Learning the step] (plan.h): learning a loop's period from its
 * allocations, placing one step in one range, serving it by position, and letting it go.
 * Owns: pool->plan and the planned block nodes. */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/block.h"
#include "core/expand.h"
#include "core/history.h"
#include "core/plan.h"
#include "core/pool.h"
#include "core/sizes.h"

/* Tuning, may be modified: */
#define CP_PLAN_K          8u     /* keys hashed into the K-gram that proposes a period */
#define CP_PLAN_MAX_PERIOD 32768u /* allocations per step, at most */
#define CP_PLAN_MAX_EXTRA  16u    /* allocations off the plan per step before it is lost */
#define CP_PLAN_MAX_LOSSES 3u     /* losses in a row that drop the plan */
#define CP_PLAN_CHAIN      64u    /* earlier K-gram matches tried for a period long enough */
/* Do not modify: the log holds the three periods a candidate is checked on. */
#define CP_PLAN_LOG_CAP  (3u * CP_PLAN_MAX_PERIOD + CP_PLAN_K) /* two periods, after a warm-up */
#define CP_PLAN_MAP_BITS 18u
_Static_assert((1u << CP_PLAN_MAP_BITS) >= 2u * CP_PLAN_LOG_CAP, "the K-gram map must stay at most half full");

#define CP_PLAN_NOT_FREED UINT64_MAX

/* One watched allocation. Times count the allocations and frees the learning watched. */
typedef struct cp_plan_rec_s {
  size_t size;
  cp_stream_t stream;
  uint64_t t_alloc;
  uint64_t t_free; /* CP_PLAN_NOT_FREED while in use */
  uint64_t live;   /* watched bytes in use right after it was made */
  uint32_t prev;   /* the record before it with the same K-gram, + 1 (0: none) */
} cp_plan_rec_t;

struct cp_plan_learn_s {
  cp_plan_rec_t *rec; /* rec[i] is allocation number base + i */
  uint32_t n, cap;
  uint64_t base;
  uint64_t clock; /* the next time */
  uint64_t live;  /* bytes of the watched allocations in use */
  uint64_t *map_hash;
  uint32_t *map_rec; /* + 1; 0: empty slot */
  uint32_t cand;     /* the candidate period, or 0 */
  uint32_t run;      /* allocations since it was proposed whose key equals the one cand before */
};

const char *cp_plan_state_name(int state) {
  switch (state) {
    case CP_PLAN_OFF: return "off";
    case CP_PLAN_LEARNING: return "learning";
    case CP_PLAN_PLANNING: return "planning";
    case CP_PLAN_ARMED: return "armed";
    case CP_PLAN_SERVING: return "serving";
    case CP_PLAN_LOST: return "lost";
    case CP_PLAN_DYING: return "dropped";
    default: return "?";
  }
}

static uint64_t cp_plan_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t cp_plan_mix(uint64_t x) { /* splitmix64's finaliser */
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

static inline uint64_t cp_plan_key(size_t size, cp_stream_t stream) {
  return cp_plan_mix((uint64_t)size * 0x9e3779b97f4a7c15ull ^ (uint64_t)stream);
}

/* ------------------------------------------------------------------------------------------
 * Learning: the log, the K-gram map, the candidate period
 * ---------------------------------------------------------------------------------------- */

/* Start the log afresh at allocation number pool->plan.seq. */
static void cp_plan_learn_reset(cp_plan_t *pl) {
  struct cp_plan_learn_s *lr = pl->learn;
  if (lr == NULL) return;
  lr->n = 0;
  lr->base = pl->seq;
  lr->live = 0;
  lr->cand = lr->run = 0;
  if (lr->map_rec != NULL) memset(lr->map_rec, 0, sizeof(uint32_t) << CP_PLAN_MAP_BITS);
}

static void cp_plan_learn_free(cp_plan_t *pl) {
  if (pl->learn == NULL) return;
  free(pl->learn->rec);
  free(pl->learn->map_hash);
  free(pl->learn->map_rec);
  free(pl->learn);
  pl->learn = NULL;
}

/* Room for one more record; false when there is no host memory (learning then waits). */
static bool cp_plan_learn_room(cp_plan_t *pl) {
  struct cp_plan_learn_s *lr = pl->learn;
  if (lr == NULL) {
    lr = calloc(1, sizeof *lr);
    if (lr == NULL) return false;
    lr->map_hash = malloc(sizeof(uint64_t) << CP_PLAN_MAP_BITS);
    lr->map_rec = calloc((size_t)1 << CP_PLAN_MAP_BITS, sizeof(uint32_t));
    if (lr->map_hash == NULL || lr->map_rec == NULL) {
      free(lr->map_hash);
      free(lr->map_rec);
      free(lr);
      return false;
    }
    pl->learn = lr;
    lr->base = pl->seq;
  }
  if (lr->n == CP_PLAN_LOG_CAP) cp_plan_learn_reset(pl); /* no period of at most MAX_PERIOD so far */
  if (lr->n == lr->cap) {
    uint32_t cap = lr->cap ? lr->cap * 2 : 4096;
    if (cap > CP_PLAN_LOG_CAP) cap = CP_PLAN_LOG_CAP;
    cp_plan_rec_t *grown = realloc(lr->rec, (size_t)cap * sizeof *grown);
    if (grown == NULL) return false;
    lr->rec = grown;
    lr->cap = cap;
  }
  return true;
}

/* Record i's K-gram: its hash, and the record before it with the same one (+ 1, or 0). */
static uint32_t cp_plan_kgram(struct cp_plan_learn_s *lr, uint32_t i) {
  uint64_t h = 0x243f6a8885a308d3ull;
  for (uint32_t k = i + 1 - CP_PLAN_K; k <= i; k++) h = cp_plan_mix(h ^ cp_plan_key(lr->rec[k].size, lr->rec[k].stream));
  const uint32_t mask = (1u << CP_PLAN_MAP_BITS) - 1;
  for (uint32_t slot = (uint32_t)h & mask;; slot = (slot + 1) & mask) {
    if (lr->map_rec[slot] == 0) {
      lr->map_hash[slot] = h;
      lr->map_rec[slot] = i + 1;
      return 0;
    }
    if (lr->map_hash[slot] == h) {
      const uint32_t prev = lr->map_rec[slot];
      lr->map_rec[slot] = i + 1;
      return prev;
    }
  }
}

static inline bool cp_plan_same_key(const cp_plan_rec_t *a, const cp_plan_rec_t *b) {
  return a->size == b->size && a->stream == b->stream;
}

/* Log allocation `rounded` on `stream` as record n; returns the period found (three periods
 * alike, the same bytes in use at their boundaries), or 0. */
static uint32_t cp_plan_learn_alloc(cp_plan_t *pl, size_t rounded, cp_stream_t stream) {
  struct cp_plan_learn_s *lr = pl->learn;
  const uint32_t i = lr->n++;
  cp_plan_rec_t *r = &lr->rec[i];
  r->size = rounded;
  r->stream = stream;
  r->t_alloc = lr->clock++;
  r->t_free = CP_PLAN_NOT_FREED;
  lr->live += rounded;
  r->live = lr->live;
  r->prev = i + 1 >= CP_PLAN_K ? cp_plan_kgram(lr, i) : 0;
  if (lr->cand != 0 && cp_plan_same_key(r, &lr->rec[i - lr->cand])) {
    lr->run++;
  } else {
    /* A new candidate: the latest earlier K-gram like this one, far enough back, where the
     * same bytes were in use (a layer of a forward pass repeats too, but leaves its saved
     * activations behind; a step does not). */
    lr->cand = lr->run = 0;
    for (uint32_t j = r->prev, tries = 0; j != 0 && tries < CP_PLAN_CHAIN; j = lr->rec[j - 1].prev, tries++) {
      const uint32_t d = i - (j - 1);
      if (d > CP_PLAN_MAX_PERIOD) break;
      if (d > pl->min_period && lr->rec[j - 1].live == r->live) {
        lr->cand = d;
        break;
      }
    }
  }
  const uint32_t p = lr->cand;
  if (p == 0 || lr->run < p || lr->rec[i - p].live != r->live) return 0;
  return p; /* two periods alike, ending here */
}

void cp_plan_watch_block_locked(cp_pool_t *pool, void *ptr, uint64_t watch) {
  cp_block_t *b = cp_ptrmap_get(&pool->live, (uintptr_t)ptr);
  if (b != NULL) b->plan_seq = watch;
}

void cp_plan_watch_free_locked(cp_pool_t *pool, cp_block_t *b) {
  const uint64_t number = b->plan_seq - 1;
  b->plan_seq = 0;
  cp_plan_t *pl = &pool->plan;
  struct cp_plan_learn_s *lr = pl->learn;
  if (pl->state != CP_PLAN_LEARNING || lr == NULL || number < lr->base || number - lr->base >= lr->n) return;
  cp_plan_rec_t *r = &lr->rec[number - lr->base];
  if (r->t_free != CP_PLAN_NOT_FREED) return;
  r->t_free = lr->clock++;
  lr->live -= r->size;
}

/* ------------------------------------------------------------------------------------------
 * Planning (without the lock): lifetimes, the step's position 0, offsets, due lists
 * ---------------------------------------------------------------------------------------- */

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

static bool cp_plan_overlap(const cp_plan_arc_t *x, const cp_plan_arc_t *y, uint64_t period) {
  /* On a circle: [x] against [y] shifted by -period, 0 and +period. */
  const int64_t xs = (int64_t)x->start, xe = (int64_t)(x->start + x->len);
  for (int k = -1; k <= 1; k++) {
    const int64_t ys = (int64_t)y->start + k * (int64_t)period, ye = ys + (int64_t)y->len;
    if (xs < ye && ys < xe) return true;
  }
  return false;
}

static int cp_plan_by_size(const void *a, const void *b) {
  const cp_plan_arc_t *x = a, *y = b;
  if (x->size != y->size) return x->size > y->size ? -1 : 1;
  if (x->len != y->len) return x->len > y->len ? -1 : 1;
  return x->entry < y->entry ? -1 : x->entry > y->entry;
}

/* A placed arc: where it lies. `placed` is kept in (bin, offset) order. */
typedef struct cp_plan_span_s {
  uint32_t bin;
  uint32_t arc;
  size_t offset, size;
} cp_plan_span_t;

static bool cp_plan_span_before(const cp_plan_span_t *x, uint32_t bin, size_t offset) {
  return x->bin < bin || (x->bin == bin && x->offset < offset);
}

/* Greedy by size into bins of the given sizes: each arc (largest first, as sorted) at the
 * smallest gap that holds it, in any bin, among the placed arcs whose time overlaps its own
 * (the placed arcs are kept in place order, so one pass finds every gap). Sets each entry's
 * bin and offset and each bin's top (its bytes in use at some time). The last bin may be
 * unbounded (SIZE_MAX): then every arc is placed. False when one fits nowhere, or no host
 * memory. */
static bool cp_plan_place(const cp_plan_arc_t *arcs, uint32_t n, uint64_t period, cp_plan_entry_t *entries,
                          const size_t *bin_size, size_t *bin_top, uint32_t bins) {
  cp_plan_span_t *placed = malloc((n > 0 ? n : 1) * sizeof *placed);
  if (placed == NULL) return false;
  for (uint32_t b = 0; b < bins; b++) bin_top[b] = 0;
  bool ok = true;
  for (uint32_t i = 0, m = 0; i < n; i++) {
    const size_t want = arcs[i].size;
    size_t best_gap = 0, best_at = 0;
    uint32_t best_bin = UINT32_MAX;
    uint32_t k = 0;
    for (uint32_t b = 0; b < bins; b++) {
      size_t at = 0;
      for (; k < m && placed[k].bin == b; k++) {
        if (!cp_plan_overlap(&arcs[i], &arcs[placed[k].arc], period)) continue;
        if (placed[k].offset > at) {
          const size_t gap = placed[k].offset - at;
          if (gap >= want && (best_bin == UINT32_MAX || gap < best_gap)) {
            best_gap = gap;
            best_at = at;
            best_bin = b;
          }
        }
        if (placed[k].offset + placed[k].size > at) at = placed[k].offset + placed[k].size;
      }
      if (bin_size[b] > at && bin_size[b] - at >= want && (best_bin == UINT32_MAX || bin_size[b] - at < best_gap)) {
        best_gap = bin_size[b] - at;
        best_at = at;
        best_bin = b;
      }
    }
    if (best_bin == UINT32_MAX) {
      ok = false;
      break;
    }
    cp_plan_entry_t *e = &entries[arcs[i].entry];
    e->bin = best_bin;
    e->offset = best_at;
    if (best_at + want > bin_top[best_bin]) bin_top[best_bin] = best_at + want;
    uint32_t lo = 0, hi = m; /* insert in place order */
    while (lo < hi) {
      const uint32_t mid = lo + (hi - lo) / 2;
      if (cp_plan_span_before(&placed[mid], best_bin, best_at))
        lo = mid + 1;
      else
        hi = mid;
    }
    memmove(&placed[lo + 1], &placed[lo], (size_t)(m - lo) * sizeof *placed);
    placed[lo] = (cp_plan_span_t){best_bin, i, best_at, want};
    m++;
  }
  free(placed);
  return ok;
}

/* The first position of `t` (sorted, n of them) at or after time `x`, n when none. */
static uint32_t cp_plan_position_at(const uint64_t *t, uint32_t n, uint64_t x) {
  uint32_t lo = 0, hi = n;
  while (lo < hi) {
    const uint32_t mid = lo + (hi - lo) / 2;
    if (t[mid] < x)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/* The plan of w->rec's first period. Returns CP_OK, or CP_ERR_HOST_OOM. */
static int cp_plan_compute(cp_plan_work_t *w) {
  const uint32_t p = w->count;
  const cp_plan_rec_t *mid = w->rec, *after = w->rec + p;
  const uint64_t t0 = mid[0].t_alloc, period = after[0].t_alloc - t0;
  w->period = period;
  uint64_t *len = malloc((size_t)p * sizeof *len);
  uint64_t *t = malloc((size_t)p * sizeof *t);
  int64_t *across = calloc((size_t)p + 1, sizeof *across);
  cp_plan_arc_t *arcs = malloc((size_t)p * sizeof *arcs);
  w->entries = calloc(p, sizeof *w->entries);
  w->due = malloc((size_t)p * sizeof *w->due);
  uint32_t *due_at = malloc((size_t)p * sizeof *due_at);
  int rc = CP_ERR_HOST_OOM;
  if (len == NULL || t == NULL || across == NULL || arcs == NULL || w->entries == NULL || w->due == NULL ||
      due_at == NULL)
    goto out;
  /* The stream with the most bytes: the step's own (a majority ends the search). */
  cp_stream_t main_stream = mid[0].stream;
  {
    size_t total = 0, best = 0;
    for (uint32_t i = 0; i < p; i++) total += mid[i].size;
    for (uint32_t i = 0; i < p && best * 2 <= total; i++) {
      size_t bytes = 0;
      for (uint32_t j = 0; j < p; j++)
        if (mid[j].stream == mid[i].stream) bytes += mid[j].size;
      if (bytes > best) {
        best = bytes;
        main_stream = mid[i].stream;
      }
    }
  }
  /* Lifetimes: the first period's, or the second's where that one is freed and longer (an
   * allocation of the first still in use is too long: a period has passed). */
  for (uint32_t i = 0; i < p; i++) {
    t[i] = mid[i].t_alloc - t0;
    uint64_t l = mid[i].t_free == CP_PLAN_NOT_FREED ? CP_PLAN_NOT_FREED : mid[i].t_free - mid[i].t_alloc;
    if (after[i].t_free != CP_PLAN_NOT_FREED && after[i].t_free - after[i].t_alloc > l)
      l = after[i].t_free - after[i].t_alloc;
    len[i] = l < period && mid[i].stream == main_stream ? l : CP_PLAN_NOT_FREED;
  }
  /* Position 0: where the planned bytes in use across it are fewest (difference array over
   * two laps of the circle, folded). */
  for (uint32_t i = 0; i < p; i++) {
    if (len[i] == CP_PLAN_NOT_FREED) continue;
    const uint64_t end = t[i] + len[i];
    const uint32_t from = i + 1;
    const uint32_t to = end <= period ? cp_plan_position_at(t, p, end) : p + cp_plan_position_at(t, p, end - period);
    for (uint32_t lap = 0; lap < 2; lap++) { /* [from, to) over positions 0..2p, folded below */
      const uint32_t a = lap == 0 ? from : 0, b = lap == 0 ? (to < p ? to : p) : (to > p ? to - p : 0);
      if (a < b) {
        across[a] += (int64_t)mid[i].size;
        across[b] -= (int64_t)mid[i].size;
      }
    }
  }
  uint32_t origin = 0;
  {
    int64_t run = 0, best = INT64_MAX;
    for (uint32_t i = 0; i < p; i++) {
      run += across[i];
      if (run < best) {
        best = run;
        origin = i;
      }
    }
  }
  w->origin = origin;
  /* Entries in step order from the origin; arcs of the planned ones. */
  const uint64_t tz = t[origin];
  uint32_t n = 0;
  for (uint32_t j = 0; j < p; j++) {
    const uint32_t i = (origin + j) % p;
    cp_plan_entry_t *e = &w->entries[j];
    e->size = mid[i].size;
    e->stream = mid[i].stream;
    t[i] = (t[i] + period - tz) % period; /* rotated in place: t[i] is now entry j's time */
    if (len[i] != CP_PLAN_NOT_FREED) {
      e->planned = 1;
      e->wraps = t[i] + len[i] > period;
      arcs[n++] = (cp_plan_arc_t){t[i], len[i], e->size, j};
    }
  }
  /* Entry times in entry order, for the due positions. */
  uint64_t *te = len; /* len is not needed any more: the arcs hold it */
  for (uint32_t j = 0; j < p; j++) te[j] = t[(origin + j) % p];
  /* Due position of each planned entry: the first planned position at or after its free
   * (wrapping to the step's start). */
  for (uint32_t k = 0; k < n; k++) {
    const uint64_t f = (arcs[k].start + arcs[k].len) % period;
    uint32_t q = cp_plan_position_at(te, p, f);
    for (uint32_t steps = 0; steps < p && (q == p || !w->entries[q].planned); steps++) q = q == p ? 0 : q + 1;
    if (q == p) q = 0;
    due_at[k] = q;
  }
  for (uint32_t k = 0; k < n; k++) w->entries[due_at[k]].due_count++;
  for (uint32_t j = 0, at = 0; j < p; j++) {
    w->entries[j].due_first = at;
    at += w->entries[j].due_count;
    w->entries[j].due_count = 0;
  }
  for (uint32_t k = 0; k < n; k++) {
    cp_plan_entry_t *e = &w->entries[due_at[k]];
    w->due[e->due_first + e->due_count++] = arcs[k].entry;
  }
  qsort(arcs, n, sizeof *arcs, cp_plan_by_size);
  w->arcs = arcs;
  arcs = NULL;
  w->planned = n;
  rc = CP_OK;
out:
  free(len);
  free(t);
  free(across);
  free(arcs);
  free(due_at);
  if (rc != CP_OK) {
    free(w->entries);
    free(w->due);
    w->entries = NULL;
    w->due = NULL;
  }
  return rc;
}

/* The learning found period `p` at its last record: plan it without the lock, then arm. */
static void cp_plan_make_locked(cp_pool_t *pool, uint32_t p) {
  cp_plan_t *pl = &pool->plan;
  struct cp_plan_learn_s *lr = pl->learn;
  cp_plan_work_t w = {.count = p};
  const uint32_t first = lr->n - 2 * p;
  w.rec = malloc((size_t)2 * p * sizeof *w.rec);
  if (w.rec == NULL) return; /* learning goes on */
  memcpy(w.rec, lr->rec + first, (size_t)2 * p * sizeof *w.rec);
  const uint64_t first_number = lr->base + first;
  pl->state = CP_PLAN_PLANNING;
  pthread_mutex_unlock(&pool->lock);
  const uint64_t t0 = cp_plan_now_ns();
  const int rc = cp_plan_compute(&w);
  const uint64_t spent = cp_plan_now_ns() - t0;
  free(w.rec);
  pthread_mutex_lock(&pool->lock);
  pl->plan_ns += spent;
  if (pl->state != CP_PLAN_PLANNING || rc != CP_OK || w.planned == 0) {
    free(w.entries);
    free(w.due);
    free(w.arcs);
    if (pl->state == CP_PLAN_PLANNING) {
      pl->state = CP_PLAN_LEARNING;
      pl->min_period = p; /* nothing to plan at this period: look for a longer one */
      cp_plan_learn_reset(pl);
    }
    return;
  }
  pl->entries = w.entries;
  pl->due = w.due;
  pl->arcs = w.arcs;
  pl->arc_count = w.planned;
  pl->period = w.period;
  pl->count = p;
  pl->adopt_tries = 0;
  pl->last_planned = w.planned;
  pl->armed_at = first_number + w.origin; /* the first period's origin: a position 0 */
  pl->state = CP_PLAN_ARMED;
}

/* ------------------------------------------------------------------------------------------
 * Serving, losing, dropping
 * ---------------------------------------------------------------------------------------- */

/* Back to learning from scratch (the plan's arrays are gone). */
/* The plan's arrays (its nodes' stream lists with them). */
static void cp_plan_free_arrays(cp_plan_t *pl) {
  for (uint32_t j = 0; pl->entries != NULL && j < pl->count; j++) free(pl->entries[j].node.uses);
}

static void cp_plan_relearn_locked(cp_plan_t *pl) {
  cp_plan_free_arrays(pl);
  free(pl->entries);
  free(pl->due);
  free(pl->arcs);
  free(pl->bins);
  pl->entries = NULL;
  pl->due = NULL;
  pl->arcs = NULL;
  pl->bins = NULL;
  pl->count = pl->arc_count = pl->bin_count = 0;
  pl->range_bytes = 0;
  pl->state = CP_PLAN_LEARNING;
  cp_plan_learn_reset(pl);
}

/* The bins back to the pool (no planned node is in use): free blocks again, merged and
 * indexed. They were never in the allocation stats. */
static void cp_plan_return_bins_locked(cp_pool_t *pool) {
  cp_plan_t *pl = &pool->plan;
  for (uint32_t i = 0; i < pl->bin_count; i++) {
    cp_block_t *b = pl->bins[i];
    b->plan = 0;
    b->requested = 0;
    b->use_count = 0;
    cp_block_return_locked(pool, b);
  }
  cp_plan_relearn_locked(pl);
}

/* Stop serving; the range goes back once nothing planned is in use. */
static void cp_plan_drop_locked(cp_pool_t *pool, uint32_t min_period) {
  cp_plan_t *pl = &pool->plan;
  pl->drops++;
  pl->min_period = min_period;
  pl->state = CP_PLAN_DYING;
  if (pl->live == 0) cp_plan_return_bins_locked(pool);
}

/* A plan dropped for misses before it ever served a whole step had the wrong period (a
 * repeating part of the step, not the step): learning then looks for longer ones. One that
 * served whole steps was right until the loop changed: any period may come next. */
static uint32_t cp_plan_wrong_period(const cp_plan_t *pl) { return pl->whole_steps == 0 ? pl->count : 0; }

static void cp_plan_lose_locked(cp_pool_t *pool) {
  cp_plan_t *pl = &pool->plan;
  pl->state = CP_PLAN_LOST;
  pl->extra = 0;
  if (++pl->losses >= CP_PLAN_MAX_LOSSES) cp_plan_drop_locked(pool, cp_plan_wrong_period(pl));
}

bool cp_plan_give_up_locked(cp_pool_t *pool) {
  cp_plan_t *pl = &pool->plan;
  if (pl->bins == NULL) return false;
  if (pl->state != CP_PLAN_DYING) cp_plan_drop_locked(pool, pl->min_period);
  return pl->bins == NULL;
}

void cp_plan_release_locked(cp_pool_t *pool, cp_block_t *node) {
  cp_plan_t *pl = &pool->plan;
  const cp_plan_entry_t *e = (const cp_plan_entry_t *)(const void *)((const char *)node - offsetof(cp_plan_entry_t, node));
  node->state = CP_BLOCK_FREE;
  pl->live--;
  if (!e->wraps) pl->live_nonwrap--;
  if (pl->state == CP_PLAN_DYING && pl->live == 0) cp_plan_return_bins_locked(pool);
}

/* The overflow bin: one block of `bytes` from the pool's ladder (stitched from free whole
 * handles where it can, grown where it must), the plan's: out of the live map and of the
 * allocation stats, peaks included. NULL when the pool cannot (the lock may have dropped). */
static cp_block_t *cp_plan_take_overflow_locked(cp_pool_t *pool, cp_stream_state_t *st, size_t bytes) {
  static const int fams[5] = {CP_STAT_ALLOCATION, CP_STAT_ALLOCATED_BYTES, CP_STAT_ACTIVE, CP_STAT_ACTIVE_BYTES,
                              CP_STAT_REQUESTED_BYTES};
  cp_stat_t saved[5][CP_KIND_COUNT];
  for (int f = 0; f < 5; f++) memcpy(saved[f], pool->stats.family[fams[f]], sizeof saved[f]);
  const cp_stat_t oversize = pool->stats.oversize_allocations;
  void *ptr = NULL;
  if (cp_reserve_metadata_locked(pool, 1) != CP_OK ||
      cp_paged_alloc_locked(pool, st, CP_KIND_LARGE, bytes, bytes, &ptr) != CP_OK) {
    cp_clear_error();
    return NULL;
  }
  cp_block_t *r = cp_ptrmap_remove(&pool->live, (uintptr_t)ptr);
  const int64_t amount[5] = {1, (int64_t)r->size, 1, (int64_t)r->size, (int64_t)r->requested};
  for (int f = 0; f < 5; f++) {
    for (int kind = 0; kind < CP_KIND_COUNT; kind++) {
      if (kind != CP_KIND_ALL && kind != r->segment->kind) continue;
      cp_stat_t *x = &pool->stats.family[fams[f]][kind];
      x->current -= amount[f];
      x->allocated -= amount[f];
      x->peak = saved[f][kind].peak > x->current ? saved[f][kind].peak : x->current;
    }
  }
  if (r->size >= pool->cfg.max_split_size) pool->stats.oversize_allocations = oversize;
  r->requested = 0;
  return r;
}

static void cp_plan_collect(cp_block_t *b, void *arg) {
  cp_block_t ***at = arg;
  *(*at)++ = b;
}

static int cp_plan_by_addr(const void *a, const void *b) {
  const cp_block_t *x = *(cp_block_t *const *)a, *y = *(cp_block_t *const *)b;
  return x->addr < y->addr ? -1 : x->addr > y->addr;
}

/* A bin: [offset, offset + size) of the free block `block`; the last one of a plan's bins is
 * the overflow (block NULL until the ladder gives it). */
typedef struct cp_plan_bin_s {
  cp_block_t *block;
  size_t offset, size;
} cp_plan_bin_t;

/* The pieces of the free block `f` that stitching cannot take: a handle is mapped whole, so
 * only the handles wholly inside `f` can be mapped again elsewhere; the free ends of handles
 * in part use (before the first edge inside `f`, after the last) stay where they are. Those
 * are the plan's bins; the whole handles between are left to the overflow's stitch. A block
 * with no whole handle is one bin. */
static uint32_t cp_plan_pieces(const cp_block_t *f, cp_plan_bin_t *out, size_t *whole_handles) {
  const cp_segment_t *seg = f->segment;
  const uintptr_t lo = f->addr, hi = f->addr + f->size;
  uintptr_t first = hi, last = hi;
  if (seg->paged && seg->chunk != 0) {
    first = cp_expand_edge_up(seg, lo);
    last = first < hi ? cp_expand_edge_down(seg, hi) : hi;
  }
  if (first >= last) { /* no whole handle inside */
    out[0] = (cp_plan_bin_t){NULL, 0, f->size};
    return 1;
  }
  *whole_handles += last - first;
  uint32_t n = 0;
  if (first > lo) out[n++] = (cp_plan_bin_t){NULL, 0, first - lo};
  if (hi > last) out[n++] = (cp_plan_bin_t){NULL, last - lo, hi - last};
  return n;
}

/* Take [offset, offset + bytes) of the FREE block `f` (out of the index; spare nodes reserved)
 * as a bin: the block returned, LIVE and the plan's; the rest of `f` below and above stays
 * FREE, indexed. */
static cp_block_t *cp_plan_carve_locked(cp_pool_t *pool, cp_block_t *f, size_t offset, size_t bytes) {
  cp_block_t *b = f;
  if (offset > 0) b = cp_block_cut_locked(pool, f, offset); /* f keeps the part below */
  if (bytes < b->size) cp_free_insert_locked(pool, cp_block_cut_locked(pool, b, bytes));
  if (b != f) cp_free_insert_locked(pool, f);
  b->state = CP_BLOCK_LIVE;
  b->requested = 0;
  b->plan_seq = 0;
  b->plan = CP_PLAN_RANGE;
  return b;
}

/* At position 0: place the planned entries in the free memory of the step's stream as it is
 * now. The free pieces stitching cannot use (cp_plan_pieces) are filled first (best fit,
 * largest entries first); the rest go in one overflow range from the pool's ladder, which
 * stitches it from the free whole handles where it can (no new memory) and grows only what
 * they lack. The pieces used are carved out of the pool as the plan's bins. False when the
 * pool cannot give the overflow (nothing changed). */
static bool cp_plan_adopt_locked(cp_pool_t *pool) {
  cp_plan_t *pl = &pool->plan;
  cp_stream_t main_stream = 0;
  for (uint32_t j = 0; j < pl->count; j++) {
    if (pl->entries[j].planned) {
      main_stream = pl->entries[j].stream;
      break;
    }
  }
  cp_stream_state_t *st = cp_streams_get_locked(&pool->streams, main_stream);
  if (st == NULL || st->paused) return false;
  cp_index_t *ix = &st->index[CP_KIND_LARGE];
  const uint32_t nfree = (uint32_t)ix->count, cap = 2 * nfree + 1;
  cp_block_t **free_blocks = malloc((nfree > 0 ? nfree : 1) * sizeof *free_blocks);
  cp_plan_bin_t *bins = malloc(cap * sizeof *bins);
  uint32_t *bin_block = malloc(cap * sizeof *bin_block); /* the free block each piece is of */
  size_t *sizes = malloc(cap * sizeof *sizes);
  size_t *tops = malloc(cap * sizeof *tops);
  uint32_t *taken = malloc(cap * sizeof *taken); /* piece -> bin number in pl->bins */
  bool ok = free_blocks != NULL && bins != NULL && bin_block != NULL && sizes != NULL && tops != NULL && taken != NULL;
  uint32_t nb = 0;
  size_t whole_handles = 0; /* free bytes in wholly free handles: what the overflow may stitch */
  if (ok) {
    cp_block_t **at = free_blocks;
    cp_index_each(ix, cp_plan_collect, &at);
    qsort(free_blocks, nfree, sizeof *free_blocks, cp_plan_by_addr);
    for (uint32_t f = 0; f < nfree; f++) {
      const uint32_t k = cp_plan_pieces(free_blocks[f], bins + nb, &whole_handles);
      for (uint32_t i = 0; i < k; i++) bin_block[nb + i] = f;
      nb += k;
    }
    for (uint32_t b = 0; b < nb; b++) sizes[b] = bins[b].size;
    sizes[nb] = SIZE_MAX; /* the overflow */
    bins[nb] = (cp_plan_bin_t){NULL, 0, 0};
    const uint64_t t0 = cp_plan_now_ns();
    ok = cp_plan_place(pl->arcs, pl->arc_count, pl->period, pl->entries, sizes, tops, nb + 1);
    pl->plan_ns += cp_plan_now_ns() - t0;
    /* The plan never makes the pool grow: an overflow the free whole handles cannot hold waits
     * for a later step's start (memory freed meanwhile may make room). */
    if (ok && tops[nb] != 0 && cp_size_round(&pool->cfg, tops[nb]) > whole_handles) ok = false;
  }
  uint32_t used = 0;
  if (ok) {
    for (uint32_t b = 0; b <= nb; b++) used += tops[b] != 0;
    pl->bins = malloc((used > 0 ? used : 1) * sizeof *pl->bins);
    ok = pl->bins != NULL && cp_reserve_metadata_locked(pool, 2 * (int)used + 2) == CP_OK;
  }
  pl->bin_count = 0;
  pl->range_bytes = 0;
  const size_t granule = pool->cfg.granule;
  /* Carve the pieces used, the higher piece of a block first (the lower one keeps `f`). */
  for (uint32_t b = nb; ok && b-- > 0;) {
    if (tops[b] == 0) continue;
    cp_block_t *f = free_blocks[bin_block[b]];
    if (b + 1 == nb || bin_block[b + 1] != bin_block[b] || tops[b + 1] == 0) cp_free_remove_locked(pool, f);
    const size_t bytes = (tops[b] + granule - 1) / granule * granule;
    cp_block_t *blk = cp_plan_carve_locked(pool, f, bins[b].offset, bytes);
    /* A lower piece of the same block still to carve: `f` (below) went back to the index. */
    if (b > 0 && bin_block[b - 1] == bin_block[b] && tops[b - 1] != 0 && blk != f) cp_free_remove_locked(pool, f);
    bins[b].block = blk;
    taken[b] = pl->bin_count;
    pl->bins[pl->bin_count++] = blk;
    pl->range_bytes += blk->size;
  }
  if (ok && tops[nb] != 0) {
    /* The ladder may let go of the lock: the plan is not in service meanwhile. */
    pl->state = CP_PLAN_PLANNING;
    cp_block_t *over = cp_plan_take_overflow_locked(pool, st, cp_size_round(&pool->cfg, tops[nb]));
    pl->state = CP_PLAN_ARMED;
    if (over == NULL) {
      ok = false;
    } else {
      over->plan = CP_PLAN_RANGE;
      over->plan_seq = 0;
      bins[nb].block = over;
      taken[nb] = pl->bin_count;
      pl->bins[pl->bin_count++] = over;
      pl->range_bytes += over->size;
    }
  }
  if (!ok) { /* the pieces taken go back as they were (merged again) */
    for (uint32_t i = 0; pl->bins != NULL && i < pl->bin_count; i++) {
      pl->bins[i]->plan = 0;
      cp_block_return_locked(pool, pl->bins[i]);
    }
    free(pl->bins);
    pl->bins = NULL;
    pl->bin_count = 0;
    pl->range_bytes = 0;
  } else {
    for (uint32_t j = 0; j < pl->count; j++) {
      cp_plan_entry_t *e = &pl->entries[j];
      free(e->node.uses);
      memset(&e->node, 0, sizeof e->node);
      if (!e->planned) continue;
      const cp_block_t *bin = bins[e->bin].block;
      e->bin = taken[e->bin];
      e->node.addr = bin->addr + e->offset;
      e->node.size = e->size;
      e->node.segment = bin->segment;
      e->node.plan = CP_PLAN_NODE;
      e->node.state = CP_BLOCK_FREE;
    }
    pl->live = pl->live_nonwrap = 0;
    pl->losses = 0;
    pl->extra = 0;
    pl->whole_steps = 0;
    pl->plans++;
    pl->state = CP_PLAN_SERVING;
  }
  free(free_blocks);
  free(bins);
  free(bin_block);
  free(sizes);
  free(tops);
  free(taken);
  return ok;
}

/* Serve position j: the due entries first (one still in use loses the plan). CP_OK, or
 * CP_PLAN_PASS for the pool. */
static int cp_plan_take_locked(cp_pool_t *pool, uint32_t j, size_t size, void **out_ptr) {
  cp_plan_t *pl = &pool->plan;
  cp_plan_entry_t *e = &pl->entries[j];
  const uint32_t *due = pl->due + e->due_first;
  for (uint32_t k = 0; k < e->due_count; k++) {
    if (pl->entries[due[k]].node.state != CP_BLOCK_FREE) {
      pl->missed++;
      cp_plan_lose_locked(pool);
      return CP_PLAN_PASS;
    }
  }
  pl->pos = j + 1 == pl->count ? 0 : j + 1;
  if (pl->pos == 0) { /* a step served whole */
    pl->losses = 0;
    pl->extra = 0;
    pl->whole_steps++;
  }
  if (!e->planned) return CP_PLAN_PASS;
  cp_block_t *b = &e->node;
  if (CP_UNLIKELY(b->state != CP_BLOCK_FREE) || cp_reserve_metadata_locked(pool, 1) != CP_OK) {
    pl->missed++;
    cp_plan_lose_locked(pool);
    return CP_PLAN_PASS;
  }
  cp_block_make_live_inline(pool, b, size);
  pl->live++;
  if (!e->wraps) pl->live_nonwrap++;
  pl->served++;
  *out_ptr = (void *)b->addr;
  return CP_OK;
}

static inline bool cp_plan_matches(const cp_plan_entry_t *e, size_t rounded, cp_stream_t stream) {
  return e->size == rounded && e->stream == stream;
}

int cp_plan_alloc_locked(cp_pool_t *pool, size_t rounded, size_t size, cp_stream_t stream, void **out_ptr,
                         uint64_t *out_watch) {
  cp_plan_t *pl = &pool->plan;
  *out_watch = 0;
  switch (pl->state) {
    case CP_PLAN_SERVING: {
      const uint32_t j = pl->pos;
      if (cp_plan_matches(&pl->entries[j], rounded, stream)) return cp_plan_take_locked(pool, j, size, out_ptr);
      const uint32_t next = j + 1 == pl->count ? 0 : j + 1;
      if (next != j && cp_plan_matches(&pl->entries[next], rounded, stream)) {
        /* Position j did not come this step: nothing of it is in use; its due entries are
         * checked with the next one's. */
        const cp_plan_entry_t *e = &pl->entries[j];
        for (uint32_t k = 0; k < e->due_count; k++) {
          if (pl->entries[pl->due[e->due_first + k]].node.state != CP_BLOCK_FREE) {
            pl->missed++;
            cp_plan_lose_locked(pool);
            return CP_PLAN_PASS;
          }
        }
        return cp_plan_take_locked(pool, next, size, out_ptr);
      }
      pl->missed++;
      if (++pl->extra > CP_PLAN_MAX_EXTRA) cp_plan_lose_locked(pool);
      return CP_PLAN_PASS;
    }
    case CP_PLAN_LOST:
      if (pl->live_nonwrap == 0 && cp_plan_matches(&pl->entries[0], rounded, stream)) {
        pl->state = CP_PLAN_SERVING;
        pl->extra = 0;
        return cp_plan_take_locked(pool, 0, size, out_ptr);
      }
      pl->missed++;
      if (++pl->extra >= pl->count) { /* a step's worth without finding its start: a loss */
        pl->extra = 0;
        if (++pl->losses >= CP_PLAN_MAX_LOSSES) cp_plan_drop_locked(pool, cp_plan_wrong_period(pl));
      }
      return CP_PLAN_PASS;
    case CP_PLAN_LEARNING: {
      if (!cp_plan_learn_room(pl)) return CP_PLAN_PASS;
      const uint64_t number = pl->seq++;
      const uint32_t p = cp_plan_learn_alloc(pl, rounded, stream);
      *out_watch = number + 1;
      if (p != 0) cp_plan_make_locked(pool, p);
      return CP_PLAN_PASS;
    }
    case CP_PLAN_ARMED: {
      const uint64_t number = pl->seq++;
      const uint32_t j = (uint32_t)((number - pl->armed_at) % pl->count);
      if (!cp_plan_matches(&pl->entries[j], rounded, stream)) {
        cp_plan_relearn_locked(pl); /* the loop changed before the plan began */
        return CP_PLAN_PASS;
      }
      if (j != 0) return CP_PLAN_PASS;
      if (!cp_plan_adopt_locked(pool)) {
        /* No room in the free memory as it is now: tried again at the next steps' starts. */
        if (++pl->adopt_tries >= CP_PLAN_MAX_LOSSES) {
          pl->min_period = pl->count;
          cp_plan_relearn_locked(pl);
        }
        return CP_PLAN_PASS;
      }
      return cp_plan_take_locked(pool, 0, size, out_ptr);
    }
    case CP_PLAN_PLANNING: pl->seq++; return CP_PLAN_PASS; /* still counted: the plan arms on numbers */
    default: return CP_PLAN_PASS; /* dropped */
  }
}

void cp_plan_init(cp_pool_t *pool) {
  memset(&pool->plan, 0, sizeof pool->plan);
  pool->plan.state = pool->cfg.plan_steps && pool->stitch ? CP_PLAN_LEARNING : CP_PLAN_OFF;
}

void cp_plan_destroy(cp_pool_t *pool) {
  cp_plan_t *pl = &pool->plan;
  cp_plan_learn_free(pl);
  cp_plan_free_arrays(pl);
  free(pl->entries);
  free(pl->due);
  free(pl->arcs);
  free(pl->bins);
  memset(pl, 0, sizeof *pl);
}
