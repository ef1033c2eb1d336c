/* plan_learn.c — learning a loop's step from its allocations and laying out its plan, Note
 * [Learning the step] (plan_types.h): the log and its K-gram map, the candidate period, the
 * lifetimes, position 0, the due lists, and the placement of the planned allocations.
 * Owns: the log (pl->learn); everything but the placement runs without the pool lock. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/plan_learn.h"

/* Tuning, may be modified: */
#define CP_PLAN_K          8u    /* keys hashed into the K-gram that proposes a period */
#define CP_PLAN_CHAIN      64u   /* earlier K-gram matches tried for a period long enough */
#define CP_PLAN_MAX_PLACED 4096u /* allocations a plan places: the largest of its step */
/* Do not modify: the log holds two periods and the warm-up before them. */
#define CP_PLAN_LOG_CAP        (3u * CP_PLAN_MAX_PERIOD + CP_PLAN_K)
#define CP_PLAN_MAP_BITS       18u /* the K-gram map at most: it starts small and doubles with the log */
#define CP_PLAN_MAP_FIRST_BITS 12u
_Static_assert((1u << CP_PLAN_MAP_BITS) >= 2u * CP_PLAN_LOG_CAP, "the K-gram map must stay at most half full");

#define CP_PLAN_NOT_FREED UINT64_MAX
#define CP_PLAN_ROLL      0x9e3779b97f4a7c15ull /* the rolling hash's base (odd) */

/* CP_PLAN_ROLL to the K-th power (mod 2^64): the weight of the key that leaves the window. */
static const uint64_t cp_plan_roll_out = 0x9e3779b97f4a7c15ull * 0x9e3779b97f4a7c15ull * 0x9e3779b97f4a7c15ull *
                                         0x9e3779b97f4a7c15ull * 0x9e3779b97f4a7c15ull * 0x9e3779b97f4a7c15ull *
                                         0x9e3779b97f4a7c15ull * 0x9e3779b97f4a7c15ull;
_Static_assert(CP_PLAN_K == 8, "cp_plan_roll_out is CP_PLAN_ROLL to the power CP_PLAN_K");

typedef struct cp_plan_slot_s {
  uint32_t tag; /* the hash's high half, never 0; 0: an empty slot */
  uint32_t rec; /* the record + 1 */
} cp_plan_slot_t;

struct cp_plan_learn_s {
  cp_plan_rec_t *rec; /* rec[i] is allocation number base + i */
  uint32_t n, cap;
  uint64_t base;
  uint64_t clock;      /* the next time */
  uint64_t live;       /* bytes of the watched allocations in use */
  cp_plan_slot_t *map; /* K-gram hash -> record + 1, open addressing, at most half full */
  uint32_t map_bits;   /* 1 << map_bits slots */
  uint64_t roll;       /* the rolling hash of the last K keys */
  uint32_t cand;       /* the candidate period, or 0 */
  uint32_t run;        /* allocations since it was proposed whose key equals the one cand before */
};

uint64_t cp_plan_now_ns(void) {
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
void cp_plan_learn_reset(cp_plan_t *pl) {
  struct cp_plan_learn_s *lr = pl->learn;
  if (lr == NULL) return;
  lr->n = 0;
  lr->base = pl->seq;
  lr->live = 0;
  lr->cand = lr->run = 0;
  lr->roll = 0;
  if (lr->map != NULL) memset(lr->map, 0, sizeof *lr->map << lr->map_bits);
}

void cp_plan_learn_free(cp_plan_t *pl) {
  if (pl->learn == NULL) return;
  free(pl->learn->rec);
  free(pl->learn->map);
  free(pl->learn);
  pl->learn = NULL;
}

/* Room for one more record; false when there is no host memory (learning then waits). */
/* Name record i (whose kgram is set) in the map: the record before it with the same K-gram,
 * + 1 (0: none). One slot holds the hash's high half as a tag and the record. */
static uint32_t cp_plan_map_put(struct cp_plan_learn_s *lr, uint64_t h, uint32_t i) {
  const uint32_t mask = (1u << lr->map_bits) - 1, tag = (uint32_t)(h >> 32) | 1u;
  for (uint32_t slot = (uint32_t)h & mask;; slot = (slot + 1) & mask) {
    cp_plan_slot_t *e = &lr->map[slot];
    if (e->tag == 0) {
      *e = (cp_plan_slot_t){tag, i + 1};
      return 0;
    }
    if (e->tag == tag) {
      const uint32_t prev = e->rec;
      e->rec = i + 1;
      return prev;
    }
  }
}

/* The map twice as large, the log's K-grams named again (the latest of each wins). */
static bool cp_plan_map_grow(struct cp_plan_learn_s *lr) {
  cp_plan_slot_t *grown = calloc((size_t)1 << (lr->map_bits + 1), sizeof *grown);
  if (grown == NULL) return false;
  free(lr->map);
  lr->map = grown;
  lr->map_bits++;
  for (uint32_t i = CP_PLAN_K - 1; i < lr->n; i++) cp_plan_map_put(lr, lr->rec[i].kgram, i);
  return true;
}

bool cp_plan_learn_room(cp_plan_t *pl) {
  struct cp_plan_learn_s *lr = pl->learn;
  if (lr == NULL) {
    lr = calloc(1, sizeof *lr);
    if (lr == NULL) return false;
    lr->map_bits = CP_PLAN_MAP_FIRST_BITS;
    lr->map = calloc((size_t)1 << lr->map_bits, sizeof *lr->map);
    if (lr->map == NULL) {
      free(lr);
      return false;
    }
    pl->learn = lr;
    lr->base = pl->seq;
  }
  if (lr->n == CP_PLAN_LOG_CAP) cp_plan_learn_reset(pl); /* no period of at most MAX_PERIOD so far */
  if (lr->n == lr->cap) {
    uint32_t cap = lr->cap ? lr->cap * 2 : 1024;
    if (cap > CP_PLAN_LOG_CAP) cap = CP_PLAN_LOG_CAP;
    cp_plan_rec_t *grown = realloc(lr->rec, (size_t)cap * sizeof *grown);
    if (grown == NULL) return false;
    lr->rec = grown;
    lr->cap = cap;
  }
  if (2u * (lr->n + 1) > (1u << lr->map_bits) && !cp_plan_map_grow(lr)) return false;
  return true;
}

static inline bool cp_plan_same_key(const cp_plan_rec_t *a, const cp_plan_rec_t *b) {
  return a->size == b->size && a->stream == b->stream;
}

/* Log allocation `rounded` on `stream` as record n; returns the period found (three periods
 * alike, the same bytes in use at their boundaries), or 0. */
uint32_t cp_plan_learn_alloc(cp_plan_t *pl, size_t rounded, cp_stream_t stream) {
  struct cp_plan_learn_s *lr = pl->learn;
  const uint32_t i = lr->n++;
  cp_plan_rec_t *r = &lr->rec[i];
  r->size = rounded;
  r->stream = stream;
  r->t_alloc = lr->clock++;
  r->t_free = CP_PLAN_NOT_FREED;
  lr->live += rounded;
  r->live = lr->live;
  /* The rolling hash of the last K keys: this one in, the one K back out. */
  lr->roll = lr->roll * CP_PLAN_ROLL + cp_plan_key(rounded, stream);
  if (i >= CP_PLAN_K)
    lr->roll -= cp_plan_roll_out * cp_plan_key(lr->rec[i - CP_PLAN_K].size, lr->rec[i - CP_PLAN_K].stream);
  r->kgram = i + 1 >= CP_PLAN_K ? cp_plan_mix(lr->roll) : 0;
  r->prev = i + 1 >= CP_PLAN_K ? cp_plan_map_put(lr, r->kgram, i) : 0;
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

bool cp_plan_learn_window(const cp_plan_t *pl, uint32_t p, cp_plan_work_t *w, uint64_t *out_first) {
  const struct cp_plan_learn_s *lr = pl->learn;
  const uint32_t first = lr->n - 2 * p;
  w->count = p;
  w->rec = malloc((size_t)2 * p * sizeof *w->rec);
  if (w->rec == NULL) return false;
  memcpy(w->rec, lr->rec + first, (size_t)2 * p * sizeof *w->rec);
  *out_first = lr->base + first;
  return true;
}

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
bool cp_plan_place(const cp_plan_arc_t *arcs, uint32_t n, uint64_t period, cp_plan_entry_t *entries,
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
int cp_plan_compute(cp_plan_work_t *w) {
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
  /* Placement is quadratic in the arcs: past CP_PLAN_MAX_PLACED, the smallest stay the pool's
   * (their positions still count; their due lists are still checked). */
  for (uint32_t k = CP_PLAN_MAX_PLACED; k < n; k++) {
    w->entries[arcs[k].entry].planned = 0;
    w->entries[arcs[k].entry].wraps = 0;
  }
  if (n > CP_PLAN_MAX_PLACED) n = CP_PLAN_MAX_PLACED;
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
