/* test_faults.c — one realistic sequence of pool operations on the simulated device, rerun
 * with a single backend failure injected at every call of every kind it makes. After each
 * step the pool must be whole, a failing call must say why, the statistics must match what
 * the caller really holds, and at the end nothing may be left on the device. The sweep runs
 * twice: over plain segments, and over page-mapped ones (expandable_segments:True), where the
 * same sequence grows, unmaps and gives back ranges, so that every page-mapped call kind
 * fails once at each of its calls. A third pass runs a sequence of its own on a stitching
 * pool (page_stitching:True): checkerboards of holes stitched into large blocks, a kept range
 * reused, a pending stitched block, the OOM retry and empty_cache dropping idle ranges, so
 * that the calls of stitched ranges (va_reserve, page_map, page_set_access, page_unmap,
 * va_free) fail at each of their calls too.
 * The device runs behind the host (Note [Simulated asynchrony] in backend/sim.h): a stream
 * recorded on a block runs work on it (queued until OP_COMPLETE, or until the pool waits for
 * it), so the free's events are pending. The page-mapped and stitching sequences run once
 * more with work queued on every allocation's own stream as well: what empty_cache retires
 * is then still in use (Note [Stream-ordered release] in core/drain.c), stays mapped, is put
 * back into service by a later allocation of its stream or unmapped once the OOM retry waited
 * for its stream's drain event. Every run must end without a device fault. */
#include <inttypes.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/sim.h"
#include "check.h"
#include "core/cp.h"

#define KiB ((size_t)1024)
#define MiB ((size_t)1024 * 1024)

#define CAPACITY (64 * MiB)
#define NSLOTS   16

enum { S1 = 1, S2 = 2, S3 = 3 };

typedef enum op_e {
  OP_ALLOC,       /* slot := alloc(size, stream) */
  OP_FREE,        /* free(slot) */
  OP_RECORD,      /* record_stream(slot, stream) */
  OP_COMPLETE,    /* cp_sim_complete(stream) */
  OP_EMPTY_CACHE, /* cp_empty_cache */
  OP_SET_CAP      /* cp_pool_set_memory_cap(size; SIZE_MAX: what is reserved now) */
} op_t;

typedef struct step_s {
  op_t op;
  int slot;
  size_t size;
  cp_stream_t stream;
} step_t;

/* The sequence. Large requests are multiples of 2 MiB so that a large block is always split
 * exactly (every remainder is 0 or at least 2 MiB): a live block is then exactly its rounded
 * request, which lets the test predict allocated_bytes from what it holds. */
static const step_t steps[] = {
    {OP_ALLOC, 0, 1000, S1},       /*  0: small segment on S1 */
    {OP_ALLOC, 1, 200 * KiB, S1},  /*  1: same segment */
    {OP_ALLOC, 2, 4 * MiB, S1},    /*  2: 20 MiB segment on S1 */
    {OP_ALLOC, 3, 3000, S2},       /*  3: small segment on S2 */
    {OP_ALLOC, 4, 12 * MiB, S2},   /*  4: a 12 MiB segment of its own */
    {OP_ALLOC, 5, 6 * MiB, S3},    /*  5: 20 MiB segment on S3; 56 MiB reserved */
    {OP_RECORD, 2, 0, S2},         /*  6 */
    {OP_RECORD, 2, 0, S3},         /*  7 */
    {OP_FREE, 2, 0, 0},            /*  8: two events; the block stays pending */
    {OP_FREE, 1, 0, 0},            /*  9: plain free */
    {OP_ALLOC, 6, 2 * MiB, S1},    /* 10: from the free rest of S1's large segment */
    {OP_COMPLETE, 0, 0, S2},       /* 11: one of the two events completes */
    {OP_ALLOC, 7, 512, S1},        /* 12: polls: S2's event done, S3's not */
    {OP_FREE, 7, 0, 0},            /* 13 */
    {OP_RECORD, 4, 0, S1},         /* 14 */
    {OP_FREE, 4, 0, 0},            /* 15: 12 MiB pending on S1's event */
    {OP_FREE, 5, 0, 0},            /* 16: S3's segment is wholly free, cached */
    {OP_ALLOC, 8, 16 * MiB, S2},   /* 17: no room: retry syncs and releases cached segments */
    {OP_FREE, 0, 0, 0},            /* 18 */
    {OP_ALLOC, 13, 4 * MiB, S1},   /* 19: where slot 2 was: its events are waited for */
    {OP_EMPTY_CACHE, 0, 0, 0},     /* 20 */
    {OP_SET_CAP, 0, 40 * MiB, 0},  /* 21 */
    {OP_ALLOC, 9, 8 * MiB, S3},    /* 22: OOM: the cap */
    {OP_SET_CAP, 0, 0, 0},         /* 23 */
    {OP_ALLOC, 9, 8 * MiB, S3},    /* 24 */
    {OP_RECORD, 8, 0, S3},         /* 25 */
    {OP_FREE, 8, 0, 0},            /* 26: pending on S3 */
    {OP_ALLOC, 10, 40 * MiB, S1},  /* 27: OOM: the device, after the retry */
    {OP_COMPLETE, 0, 0, S3},       /* 28 */
    {OP_ALLOC, 11, 700 * KiB, S3}, /* 29 */
    {OP_FREE, 3, 0, 0},            /* 30 */
    {OP_ALLOC, 12, 10 * MiB, S2},  /* 31 */
    {OP_RECORD, 12, 0, S1},        /* 32 */
    {OP_RECORD, 12, 0, S3},        /* 33 */
    {OP_FREE, 12, 0, 0},           /* 34: pending on two streams until the end */
    {OP_FREE, 6, 0, 0},            /* 35 */
    {OP_EMPTY_CACHE, 0, 0, 0},     /* 36: plain: waits for the pending block; page-mapped: for nothing */
};
#define NSTEPS_PLAIN ((int)(sizeof steps / sizeof *steps))

/* The stitching sequence (default granularity, 2 MiB: every request below is whole pages,
 * so a stitched block is exactly its rounded request too). */
static const step_t stitch_steps[] = {
    {OP_ALLOC, 0, 4 * MiB, S1},   /*  0: S1's range, one page at a time */
    {OP_ALLOC, 1, 4 * MiB, S1},   /*  1 */
    {OP_ALLOC, 2, 4 * MiB, S1},   /*  2 */
    {OP_ALLOC, 3, 4 * MiB, S1},   /*  3 */
    {OP_ALLOC, 4, 4 * MiB, S1},   /*  4 */
    {OP_ALLOC, 5, 4 * MiB, S1},   /*  5: 24 MiB mapped */
    {OP_FREE, 0, 0, 0},           /*  6 */
    {OP_FREE, 2, 0, 0},           /*  7 */
    {OP_FREE, 4, 0, 0},           /*  8: three 4 MiB holes */
    {OP_ALLOC, 6, 12 * MiB, S1},  /*  9: stitched from the three holes */
    {OP_ALLOC, 7, 1000, S1},      /* 10: small, same range: the holes are lent, it grows */
    {OP_RECORD, 6, 0, S2},        /* 11 */
    {OP_FREE, 6, 0, 0},           /* 12: the stitched block is pending on S2 */
    {OP_ALLOC, 8, 4 * MiB, S1},   /* 13: not from the pending block's pages: it grows */
    {OP_COMPLETE, 0, 0, S2},      /* 14 */
    {OP_ALLOC, 9, 12 * MiB, S1},  /* 15: the kept range, reused */
    {OP_FREE, 9, 0, 0},           /* 16: kept again */
    {OP_ALLOC, 10, 4 * MiB, S3},  /* 17: S3's range */
    {OP_ALLOC, 11, 4 * MiB, S3},  /* 18 */
    {OP_ALLOC, 12, 4 * MiB, S3},  /* 19 */
    {OP_ALLOC, 13, 4 * MiB, S3},  /* 20 */
    {OP_FREE, 10, 0, 0},          /* 21 */
    {OP_FREE, 12, 0, 0},          /* 22 */
    {OP_ALLOC, 14, 8 * MiB, S3},  /* 23: stitched from S3's holes */
    {OP_FREE, 14, 0, 0},          /* 24: kept */
    {OP_SET_CAP, 0, SIZE_MAX, 0}, /* 25: at what is reserved now */
    {OP_ALLOC, 14, 10 * MiB, S3}, /* 26: served once the retry dropped the idle ranges */
    {OP_SET_CAP, 0, 0, 0},        /* 27 */
    {OP_FREE, 14, 0, 0},          /* 28 */
    {OP_FREE, 1, 0, 0},           /* 29 */
    {OP_FREE, 3, 0, 0},           /* 30 */
    {OP_ALLOC, 15, 16 * MiB, S1}, /* 31: from S1's free pages (whole or stitched) */
    {OP_FREE, 15, 0, 0},          /* 32 */
    {OP_EMPTY_CACHE, 0, 0, 0},    /* 33: idle ranges and free pages retired; unmapped now where their stream is idle */
    {OP_ALLOC, 15, 6 * MiB, S3},  /* 34: busy: from what S3 retired, back in service */
    {OP_FREE, 13, 0, 0},          /* 35 */
    {OP_EMPTY_CACHE, 0, 0, 0},    /* 36 */
};
#define NSTEPS_STITCH ((int)(sizeof stitch_steps / sizeof *stitch_steps))
#define NSTEPS_MAX    (NSTEPS_PLAIN > NSTEPS_STITCH ? NSTEPS_PLAIN : NSTEPS_STITCH)

static int g_paged;  /* this pass runs on page-mapped segments */
static int g_stitch; /* and stitches (the stitching sequence) */
static int g_busy;   /* and every allocation's stream runs work on it */

static const char *pass_name(void) {
  if (g_stitch) return g_busy ? "stitching, busy" : "stitching";
  if (g_paged) return g_busy ? "page-mapped, busy" : "page-mapped";
  return "plain";
}

/* Steps that fail without any injected failure: they run out of memory. */
static int step_fails_by_design(int i) { return !g_stitch && (i == 22 || i == 27); }

/* Page-mapped: the chunk a request's pool maps at a time (the default granularity, 2 MiB,
 * divides both). */
static size_t chunk_for(const cp_config_t *cfg, size_t rounded) {
  return rounded <= cfg->small_size ? cfg->small_segment : cfg->large_segment;
}

/* Which sweep point a run belongs to (all zero: the run without faults). */
typedef struct sweep_point_s {
  cp_sim_call_t kind;
  uint64_t nth; /* 0 = no fault */
  int status;
} sweep_point_t;

typedef struct run_result_s {
  uint64_t calls[CP_SIM_CALL_COUNT];
  uint64_t faults;
  int step_rc[NSTEPS_MAX];
  uint64_t step_syncs[NSTEPS_MAX]; /* event_synchronize calls each step made */
  size_t stitches, stitch_reuses;  /* at the end */
} run_result_t;

typedef struct slot_s {
  void *ptr;
  size_t rounded;
  /* After a free with recorded streams: the range stays the other streams' until each of
   * them has completed (mask of S1..S3); 0 = not guarded. */
  unsigned recorded; /* streams recorded on the live block (mask of S1..S3) */
  uintptr_t guard_addr;
  size_t guard_size;
  unsigned guard_streams;
} slot_t;

#define STREAM_BIT(s) (1u << (unsigned)(s))

static const sweep_point_t *cur_point;
static int cur_step;

#define FCHECK(cond)                                                                                               \
  do {                                                                                                             \
    if (!(cond)) {                                                                                                 \
      fprintf(stderr, "%s:%d: CHECK failed: %s [%s, fault: %s #%" PRIu64 " -> %s, step %d]\n", __FILE__, __LINE__, \
              #cond, pass_name(), cur_point->nth ? cp_sim_call_name(cur_point->kind) : "none", cur_point->nth,     \
              cp_status_name(cur_point->status), cur_step);                                                        \
      check_failures_++;                                                                                           \
    }                                                                                                              \
  } while (0)

/* Segment size the default configuration reserves for a request. */
static size_t segment_for(const cp_config_t *cfg, size_t rounded) {
  if (rounded <= cfg->small_size) return cfg->small_segment;
  if (rounded < cfg->min_large_alloc) return cfg->large_segment;
  return (rounded + cfg->round_large - 1) / cfg->round_large * cfg->round_large;
}

/* The pool is whole and its statistics agree with what the caller holds. */
static void check_pool(cp_pool_t *pool, const slot_t *slots) {
  FCHECK(cp_pool_check(pool, stderr) == 0);
  size_t held_bytes = 0, held = 0;
  for (int i = 0; i < NSLOTS; i++) {
    if (slots[i].ptr != NULL) {
      held_bytes += slots[i].rounded;
      held++;
    }
  }
  cp_stats_t s;
  cp_pool_stats(pool, &s);
  FCHECK(s.family[CP_STAT_ALLOCATED_BYTES][CP_KIND_ALL].current == (int64_t)held_bytes);
  FCHECK(s.family[CP_STAT_ALLOCATION][CP_KIND_ALL].current == (int64_t)held);
  /* Stitching: one range per stream serves every size, all in the large class (unless the
   * granularity query failed at creation: plain segments then). */
  if (g_stitch && !(cur_point->nth == 1 && cur_point->kind == CP_SIM_VMM_GRANULARITY)) {
    FCHECK(s.family[CP_STAT_ALLOCATION][CP_KIND_SMALL].current == 0);
    FCHECK(s.family[CP_STAT_RESERVED_BYTES][CP_KIND_SMALL].current == 0);
  }
}

/* A failing call explains itself. */
static void check_failure_reported(int rc) {
  FCHECK(rc != CP_OK);
  FCHECK(cp_last_error()[0] != '\0');
}

/* Run the whole sequence once on a fresh device and pool with the failure of `pt` armed. */
static void run_sequence(const sweep_point_t *pt, run_result_t *res) {
  cur_point = pt;
  cur_step = -1;
  memset(res, 0, sizeof *res);
  cp_sim_t *sim = NULL;
  cp_backend_t backend;
  cp_pool_t *pool = NULL;
  cp_config_t cfg;
  cp_config_default(&cfg);
  const char *conf = g_stitch ? "expandable_segments:True,page_stitching:True" : "expandable_segments:True";
  if (g_paged && cp_config_parse(&cfg, conf) != CP_OK) {
    FCHECK(!"cp_config_parse");
    return;
  }
  if (cp_sim_create(CAPACITY, 0, &sim) != CP_OK) {
    FCHECK(!"cp_sim_create");
    return;
  }
  cp_sim_backend(sim, &backend);
  if (pt->nth != 0) cp_sim_fail_nth(sim, pt->kind, pt->nth, pt->status);
  int rc = cp_pool_create(&cfg, &backend, &pool);
  FCHECK(rc == CP_OK); /* a failed mem_info leaves the device total unknown, nothing more */
  if (rc != CP_OK) {
    cp_sim_destroy(sim);
    return;
  }

  /* Page-mapped segments serve the pool (not when the granularity query failed at creation:
   * plain segments then). */
  cp_pool_info_t created;
  cp_pool_info(pool, &created);
  const int page_mapped = created.page_mapped;
  slot_t slots[NSLOTS];
  memset(slots, 0, sizeof slots);
  size_t cap = 0;
  const step_t *seq = g_stitch ? stitch_steps : steps;
  const int nsteps = g_stitch ? NSTEPS_STITCH : NSTEPS_PLAIN;
  for (int i = 0; i < nsteps; i++) {
    const step_t *st = &seq[i];
    cur_step = i;
    uint64_t faults_before = cp_sim_faults_injected(sim);
    const uint64_t syncs_before = cp_sim_calls(sim, CP_SIM_EVENT_SYNCHRONIZE);
    cp_clear_error();
    rc = CP_OK;
    int ran = 1;
    slot_t *sl = &slots[st->slot];
    switch (st->op) {
      case OP_ALLOC: {
        if (sl->ptr != NULL) {
          /* A request that fails by design (steps 22 and 27) may succeed in a run an injected
           * failure sent another way: e.g. memory still used by queued work stays mapped, and
           * serves it without growing past the cap. The caller keeps what it got. */
          FCHECK(pt->nth != 0);
          ran = 0;
          break;
        }
        void *p = NULL;
        rc = cp_alloc(pool, st->size, st->stream, &p);
        if (rc == CP_OK) {
          FCHECK(p != NULL);
          sl->ptr = p;
          sl->rounded = cp_round_size(&cfg, st->size);
          sl->recorded = 0;
          /* Busy: its stream's work on it, queued until the stream completes. */
          if (g_busy) FCHECK(cp_sim_launch(sim, st->stream, (uintptr_t)p, sl->rounded) == CP_OK);
        }
        break;
      }
      case OP_FREE:
        if (sl->ptr == NULL) { /* its allocation failed: nothing to free */
          ran = 0;
          break;
        }
        rc = cp_free(pool, sl->ptr);
        if (rc == CP_OK) { /* else the caller still holds it */
          sl->guard_addr = (uintptr_t)sl->ptr;
          sl->guard_size = sl->rounded;
          sl->guard_streams = sl->recorded;
          sl->ptr = NULL;
        }
        break;
      case OP_RECORD:
        if (sl->ptr == NULL) {
          ran = 0;
          break;
        }
        rc = cp_record_stream(pool, sl->ptr, st->stream);
        if (rc == CP_OK) {
          sl->recorded |= STREAM_BIT(st->stream);
          /* The stream's work on the block, queued until the stream completes: the free's
           * event waits for it (an event on an idle stream is done at once). */
          FCHECK(cp_sim_launch(sim, st->stream, (uintptr_t)sl->ptr, sl->rounded) == CP_OK);
        }
        break;
      case OP_COMPLETE:
        cp_sim_complete(sim, st->stream);
        for (int j = 0; j < NSLOTS; j++) slots[j].guard_streams &= ~STREAM_BIT(st->stream);
        break;
      case OP_EMPTY_CACHE: rc = cp_empty_cache(pool); break;
      case OP_SET_CAP:
        cap = st->size;
        if (cap == SIZE_MAX) {
          size_t pool_alloc = 0;
          cp_pool_usage(pool, &pool_alloc, &cap);
        }
        rc = cp_pool_set_memory_cap(pool, cap);
        break;
    }
    int fired = cp_sim_faults_injected(sim) != faults_before;
    res->step_syncs[i] = cp_sim_calls(sim, CP_SIM_EVENT_SYNCHRONIZE) - syncs_before;
    /* No device fault, whatever failed: nothing unmapped under queued work, no event used
     * after its destroy, no page released twice (Note [Simulated asynchrony]). */
    if (cp_sim_device_faults(sim) != 0) {
      cp_sim_print_device_faults(sim, stderr);
      FCHECK(!"device fault");
      cp_sim_clear_device_faults(sim);
    }
    /* Page-mapped: empty_cache waits for nothing (Note [Stream-ordered release]). */
    if (page_mapped && st->op == OP_EMPTY_CACHE) FCHECK(res->step_syncs[i] == 0);
    /* Plain: it waits for the pending frees, as the built-in allocator does. */
    if (!page_mapped && st->op == OP_EMPTY_CACHE && rc == CP_OK) {
      cp_pool_info_t in;
      cp_pool_info(pool, &in);
      FCHECK(in.pending_blocks == 0);
    }
    /* A freed block's address is guarded while a stream that used it is still busy. The
     * pool's waits (plain empty_cache, the OOM retry) finish streams on the simulated
     * device; a wait that failed leaves its stream busy. */
    for (cp_stream_t s = S1; s <= S3; s++) {
      if (!cp_sim_stream_idle(sim, s)) continue;
      for (int j = 0; j < NSLOTS; j++) slots[j].guard_streams &= ~STREAM_BIT(s);
    }
    /* The work on a recorded block is queued before its free records the block's events;
     * with no pending block left, every such event completed, and the work before it, even
     * where its stream still has later work queued (the OOM retry synchronizes a stream up
     * to an event only). fuzz_pool checks this event by event. */
    if (g_paged) {
      cp_pool_info_t in;
      cp_pool_info(pool, &in);
      if (in.pending_blocks == 0) {
        for (int j = 0; j < NSLOTS; j++) slots[j].guard_streams = 0;
      }
    }
    /* Stream ordering: no address is handed out while streams that used it before its free
     * may still run (the device checks it too, through every address a page is mapped at). */
    if (st->op == OP_ALLOC && rc == CP_OK && ran) {
      FCHECK(cp_sim_check_handoff(sim, st->stream, (uintptr_t)sl->ptr, sl->rounded) == 0);
      for (int j = 0; j < NSLOTS; j++) {
        const slot_t *g = &slots[j];
        if (g->guard_streams == 0) continue;
        int overlap =
            (uintptr_t)sl->ptr < g->guard_addr + g->guard_size && g->guard_addr < (uintptr_t)sl->ptr + sl->rounded;
        if (!overlap) continue;
        FCHECK(!"reused before the recorded streams completed");
      }
    }
    res->step_rc[i] = ran ? rc : -1;
    if (rc != CP_OK) {
      check_failure_reported(rc);
      if (st->op == OP_ALLOC) {
        /* OOM only when memory really is exhausted: no room on the device or under the cap
         * for the segment this request needs (every cached segment was offered back first),
         * or the device itself said OOM (an injected OOM on reserve). */
        size_t rounded = cp_round_size(&cfg, st->size);
        size_t seg = segment_for(&cfg, rounded);
        if (g_paged) { /* at most the request in whole chunks (stitching: pages) is mapped for it */
          size_t chunk = g_stitch ? 2 * MiB : chunk_for(&cfg, rounded);
          seg = (rounded + chunk - 1) / chunk * chunk;
        }
        size_t pool_alloc = 0, pool_reserved = 0;
        cp_pool_usage(pool, &pool_alloc, &pool_reserved);
        int exhausted = seg > CAPACITY - cp_sim_reserved_bytes(sim) || (cap != 0 && pool_reserved + seg > cap);
        int injected_oom = fired && pt->status == CP_ERR_OOM; /* reserve, va_reserve, page_create */
        if (rc == CP_ERR_OOM)
          FCHECK(exhausted || injected_oom);
        else
          FCHECK(rc == CP_ERR_BACKEND && fired);
      } else {
        /* Other calls fail only when the device failed them. */
        FCHECK(fired);
        FCHECK(rc == CP_ERR_BACKEND);
      }
      if (pt->nth == 0) FCHECK(step_fails_by_design(i));
    } else if (pt->nth == 0) {
      FCHECK(!step_fails_by_design(i));
    }
    check_pool(pool, slots);
  }

  /* The pool keeps serving. */
  cur_step = nsteps;
  {
    void *p = NULL;
    uint64_t faults_before = cp_sim_faults_injected(sim);
    rc = cp_alloc(pool, 4096, S2, &p);
    if (rc != CP_OK && cp_sim_faults_injected(sim) != faults_before) {
      check_failure_reported(rc); /* the armed call was this one: once more */
      rc = cp_alloc(pool, 4096, S2, &p);
    }
    if (rc != CP_OK) fprintf(stderr, "serving after the sequence: %s\n", cp_last_error());
    FCHECK(rc == CP_OK && p != NULL);
    if (rc == CP_OK) FCHECK(cp_sim_check_handoff(sim, S2, (uintptr_t)p, 4096) == 0);
    if (rc == CP_OK) FCHECK(cp_free(pool, p) == CP_OK);
    check_pool(pool, slots);
  }

  /* Give everything back. A call the device fails once must work when repeated. */
  cur_step = nsteps + 1;
  for (int i = 0; i < NSLOTS; i++) {
    if (slots[i].ptr == NULL) continue;
    cp_clear_error();
    rc = cp_free(pool, slots[i].ptr);
    if (rc != CP_OK) {
      check_failure_reported(rc);
      rc = cp_free(pool, slots[i].ptr);
    }
    FCHECK(rc == CP_OK);
    if (rc == CP_OK) slots[i].ptr = NULL;
    check_pool(pool, slots);
  }
  cp_sim_complete_all(sim);
  for (int j = 0; j < NSLOTS; j++) slots[j].guard_streams = 0;
  cp_clear_error();
  rc = cp_empty_cache(pool);
  if (rc != CP_OK) {
    check_failure_reported(rc);
    rc = cp_empty_cache(pool);
  }
  FCHECK(rc == CP_OK);
  check_pool(pool, slots);
  {
    size_t pool_alloc = 1, pool_reserved = 1;
    cp_pool_usage(pool, &pool_alloc, &pool_reserved);
    FCHECK(pool_alloc == 0);
    FCHECK(pool_reserved == 0);
    cp_pool_info_t in;
    cp_pool_info(pool, &in);
    FCHECK(in.segments == 0 && in.live_blocks == 0 && in.pending_blocks == 0);
    FCHECK(in.page_segments == 0);
    FCHECK(in.stitched_ranges == 0 && in.stitched_space == 0);
    res->stitches = in.stitches;
    res->stitch_reuses = in.stitch_reuses;
    FCHECK(in.page_mapped == (g_paged && !(pt->nth != 0 && pt->kind == CP_SIM_VMM_GRANULARITY)));
  }

  /* Destroy: nothing may stay on the device but what the device itself refused to free. */
  cur_step = nsteps + 2;
  uint64_t faults_before = cp_sim_faults_injected(sim);
  cp_pool_destroy(pool);
  uint64_t refused = cp_sim_faults_injected(sim) - faults_before;
  FCHECK(cp_sim_reserved_bytes(sim) == 0);
  FCHECK(cp_sim_live_reservations(sim) == 0);
  FCHECK(cp_sim_vmm_ranges(sim) == 0);
  FCHECK(cp_sim_vmm_pages(sim) == 0);
  FCHECK(cp_sim_vmm_mappings(sim) == 0);
  /* Only event_destroy reaches the device in destroy here (the cache is already empty). A
   * destroy that fails still ends the event (the driver may have freed it before failing):
   * the pool does not try it again, and no event is left. */
  if (refused != 0) FCHECK(pt->kind == CP_SIM_EVENT_DESTROY);
  FCHECK(cp_sim_live_events(sim) == 0);

  if (cp_sim_device_faults(sim) != 0) {
    cp_sim_print_device_faults(sim, stderr);
    FCHECK(!"device fault");
  }

  for (int k = 0; k < CP_SIM_CALL_COUNT; k++) res->calls[k] = cp_sim_calls(sim, (cp_sim_call_t)k);
  res->faults = cp_sim_faults_injected(sim);
  cp_sim_destroy(sim);
}

TEST(sequence_without_faults) {
  sweep_point_t none = {CP_SIM_RESERVE, 0, CP_OK};
  run_result_t res;
  run_sequence(&none, &res);
  CHECK_EQ_U(res.faults, 0);
  if (g_stitch) {
    for (int i = 0; i < NSTEPS_STITCH; i++) CHECK(res.step_rc[i] == CP_OK);
    /* Stitched ranges are made, reused, dropped and remade. */
    printf("test_faults: %s: %zu ranges stitched, %zu reuses\n", pass_name(), res.stitches, res.stitch_reuses);
    CHECK(res.stitches >= 2);
    CHECK(res.stitch_reuses >= 1);
  } else {
    CHECK(res.step_rc[17] == CP_OK); /* served after the retry */
    CHECK(res.step_rc[22] == CP_ERR_OOM);
    CHECK(res.step_rc[27] == CP_ERR_OOM);
  }
  /* The sequence reaches every path the sweep is meant to cover. */
  if (g_stitch) {
    CHECK_EQ_U(res.calls[CP_SIM_RESERVE], 0);
    CHECK(res.calls[CP_SIM_VA_RESERVE] >= 5); /* two streams' ranges, three stitched ones */
    CHECK(res.calls[CP_SIM_VA_FREE] >= 5);
    CHECK(res.calls[CP_SIM_PAGE_CREATE] >= 10);
    CHECK(res.calls[CP_SIM_PAGE_RELEASE] >= 10);
    CHECK(res.calls[CP_SIM_PAGE_MAP] >= 20);
    CHECK(res.calls[CP_SIM_PAGE_UNMAP] >= 5);
    CHECK(res.calls[CP_SIM_PAGE_SET_ACCESS] >= 10);
  } else if (g_paged) {
    /* Page-mapped: no plain reservation, and every page-mapped call kind. */
    CHECK_EQ_U(res.calls[CP_SIM_RESERVE], 0);
    CHECK(res.calls[CP_SIM_VMM_GRANULARITY] >= 1);
    CHECK(res.calls[CP_SIM_VA_RESERVE] >= 5);
    CHECK(res.calls[CP_SIM_VA_FREE] >= 3);
    CHECK(res.calls[CP_SIM_PAGE_CREATE] >= 5);
    CHECK(res.calls[CP_SIM_PAGE_RELEASE] >= 5);
    CHECK(res.calls[CP_SIM_PAGE_MAP] >= 5);
    CHECK(res.calls[CP_SIM_PAGE_UNMAP] >= 3);
    CHECK(res.calls[CP_SIM_PAGE_SET_ACCESS] >= 5);
  } else {
    CHECK(res.calls[CP_SIM_RESERVE] >= 8);
    CHECK(res.calls[CP_SIM_RELEASE] >= 4);
  }
  CHECK(res.calls[CP_SIM_EVENT_CREATE] >= 2);
  CHECK(res.calls[CP_SIM_EVENT_RECORD] >= 5);
  CHECK(res.calls[CP_SIM_EVENT_QUERY] >= 1);
  /* Who waits (Note [Stream-ordered release] in core/drain.c): the OOM retry synchronizes
   * the pending frees and, page-mapped, the drain events of what it retires (those streams
   * only); a plain empty_cache synchronizes the pending frees, a page-mapped one waits for
   * nothing. */
  if (g_stitch) {
    CHECK(res.step_syncs[26] >= 1); /* nothing pending: the drain events of S1's and S3's ranges */
    CHECK_EQ_U(res.step_syncs[33], 0);
    CHECK_EQ_U(res.step_syncs[36], 0);
  } else {
    CHECK(res.step_syncs[17] >= 2); /* slot 2's event on S3, slot 4's on S1 */
    CHECK(res.step_syncs[27] >= 1); /* slot 8's on S3 */
    if (!g_paged) CHECK_EQ_U(res.step_syncs[17], 2);
    if (!g_paged) CHECK_EQ_U(res.step_syncs[27], 1);
    CHECK_EQ_U(res.step_syncs[20], 0);               /* plain: nothing is pending then */
    CHECK_EQ_U(res.step_syncs[36], g_paged ? 0 : 2); /* plain: slot 12's events on S1 and S3 */
  }
  CHECK(res.calls[CP_SIM_EVENT_DESTROY] >= 2);
  CHECK(res.calls[CP_SIM_MEM_INFO] >= 2);
  for (int k = 0; k < CP_SIM_CALL_COUNT; k++) {
    printf("test_faults: %s: %-18s %" PRIu64 " calls\n", pass_name(), cp_sim_call_name((cp_sim_call_t)k), res.calls[k]);
  }
}

TEST(one_fault_at_every_call) {
  sweep_point_t none = {CP_SIM_RESERVE, 0, CP_OK};
  run_result_t base;
  run_sequence(&none, &base);
  REQUIRE(check_failures_ == 0);
  uint64_t points = 0, injected = 0;
  for (int k = 0; k < CP_SIM_CALL_COUNT; k++) {
    const int statuses[2] = {CP_ERR_BACKEND, CP_ERR_OOM};
    /* Only the calls that take memory or address space can mean "no memory". */
    int nstatus = k == CP_SIM_RESERVE || k == CP_SIM_VA_RESERVE || k == CP_SIM_PAGE_CREATE ? 2 : 1;
    for (int s = 0; s < nstatus; s++) {
      for (uint64_t n = 1; n <= base.calls[k]; n++) {
        sweep_point_t pt = {(cp_sim_call_t)k, n, statuses[s]};
        run_result_t res;
        run_sequence(&pt, &res);
        cur_point = &pt;
        cur_step = -1;
        /* Until the armed call the run is the fault-free one, so the failure always fires. */
        FCHECK(res.faults == 1);
        points++;
        injected += res.faults;
      }
    }
  }
  printf("test_faults: %s: %" PRIu64 " faults injected over %" PRIu64 " sweep points\n", pass_name(), injected, points);
  CHECK(points > 0);
  CHECK_EQ_U(injected, points);
}

int main(void) {
  RUN(sequence_without_faults);
  RUN(one_fault_at_every_call);
  g_paged = 1;
  RUN(sequence_without_faults);
  RUN(one_fault_at_every_call);
  g_stitch = 1;
  RUN(sequence_without_faults);
  RUN(one_fault_at_every_call);
  g_busy = 1;
  g_stitch = 0;
  RUN(sequence_without_faults);
  RUN(one_fault_at_every_call);
  g_stitch = 1;
  RUN(sequence_without_faults);
  RUN(one_fault_at_every_call);
  return check_summary("test_faults");
}
