/* pool.h — what pool.c lends to the files that drive a pool from above (pause.c, checkpoint.c). */
#ifndef CP_POOL_H
#define CP_POOL_H

#include "core/state.h"

/* Return to their sources the PENDING blocks whose events have completed (non-blocking). */
int cp_reclaim_completed_locked(cp_pool_t *pool);
/* Wait (lock dropped meanwhile) for every pending free, and return those blocks. */
int cp_synchronize_pending_locked(cp_pool_t *pool);
/* Free the LIVE block `b` as cp_free does (`who` names the caller in errors); on failure it
 * stays allocated. */
int cp_free_block_locked(cp_pool_t *pool, cp_block_t *b, const char *who);
/* Free the blocks whose free waited for the end of a capture, when none is under way. */
void cp_capture_flush_locked(cp_pool_t *pool);

#endif /* CP_POOL_H */
