/* stats.h — the statistics' resets and the pool's figures for readers (stats.c). */
#ifndef CP_STATS_H
#define CP_STATS_H

#include "core/state.h"

void cp_stats_reset_peak(cp_stats_t *st);
void cp_stats_reset_accumulated(cp_stats_t *st);

/* cp_pool_info without asking the device (no mem_info call): device_free and device_total
 * stay 0. For the replay, whose own measuring must not add to the device calls it counts. */
void cp_pool_info_no_device(cp_pool_t *pool, cp_pool_info_t *out_info);

#endif /* CP_STATS_H */
