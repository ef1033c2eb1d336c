/* stats.c — statistics under the built-in allocator's names.
 * Owns: the name tables and the resets; the updates are inline in cp_internal.h. */
#include <string.h>

#include "core/cp_internal.h"

const char *const cp_stat_family_names[CP_STAT_FAMILY_COUNT] = {
#define CP_X(id, name) name,
    CP_STAT_FAMILIES(CP_X)
#undef CP_X
};

const char *const cp_pool_kind_names[CP_KIND_COUNT] = {"all", "small_pool", "large_pool"};

static void cp_stat_reset_peak(cp_stat_t *s) { s->peak = s->current; }

static void cp_stat_reset_accumulated(cp_stat_t *s) {
  s->allocated = 0;
  s->freed = 0;
}

void cp_stats_reset_peak(cp_stats_t *st) {
  for (int f = 0; f < CP_STAT_FAMILY_COUNT; f++) {
    for (int k = 0; k < CP_KIND_COUNT; k++) cp_stat_reset_peak(&st->family[f][k]);
  }
  cp_stat_reset_peak(&st->oversize_allocations);
  cp_stat_reset_peak(&st->oversize_segments);
}

void cp_stats_reset_accumulated(cp_stats_t *st) {
  for (int f = 0; f < CP_STAT_FAMILY_COUNT; f++) {
    for (int k = 0; k < CP_KIND_COUNT; k++) cp_stat_reset_accumulated(&st->family[f][k]);
  }
  cp_stat_reset_accumulated(&st->oversize_allocations);
  cp_stat_reset_accumulated(&st->oversize_segments);
#define CP_X(name) st->name = 0;
  CP_STAT_COUNTERS(CP_X)
#undef CP_X
}
