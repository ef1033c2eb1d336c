/* pool.h — what pool.c lends to the files that drive a pool from above (pause.c). */
#ifndef CP_POOL_H
#define CP_POOL_H

#include "core/state.h"

/* Return to their sources the PENDING blocks whose events have completed (non-blocking). */
int cp_reclaim_completed_locked(cp_pool_t *pool);

#endif /* CP_POOL_H */
