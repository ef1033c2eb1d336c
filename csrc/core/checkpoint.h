/* checkpoint.h — the public API of checkpoints (checkpoint.c): a pool's segments and live
 * blocks recorded and restored, for CUDA graph trees. */
#ifndef CP_CHECKPOINT_H
#define CP_CHECKPOINT_H

#include <stddef.h>

#include "core/cp.h"

/* C linkage for the C++ that calls it (the bridge, through devices/graphs.h). */
#ifdef __cplusplus
extern "C" {
#endif

/* A checkpoint of the pool's segments and live blocks, and its restore: for CUDA graph trees
 * (Note [Checkpoints] in checkpoint.c). Stitching pools are refused (CP_ERR_INVALID); a restore
 * that cannot be honoured is CP_ERR_STATE and changes nothing. */
typedef struct cp_checkpoint_s cp_checkpoint_t;
int cp_pool_checkpoint(cp_pool_t *pool, cp_checkpoint_t **out_ck);
void cp_checkpoint_destroy(cp_checkpoint_t *ck);
/* Live blocks the checkpoint holds, and the i-th of them (address order). */
size_t cp_checkpoint_live_count(const cp_checkpoint_t *ck);
void cp_checkpoint_live(const cp_checkpoint_t *ck, size_t i, void **out_ptr, size_t *out_size);

/* What a restore did: the blocks it freed (live before) and those it made live, each an
 * array that cp_restore_release frees, after a failed restore too (one that failed half-way,
 * on host memory or a refused event record, says what it did). */
typedef struct cp_restore_s {
  void **freed;
  size_t freed_count;
  void **made_live;
  size_t *made_live_sizes; /* bytes asked for */
  size_t made_live_count;
} cp_restore_t;
int cp_pool_restore(cp_pool_t *pool, const cp_checkpoint_t *ck, cp_restore_t *out);
void cp_restore_release(cp_restore_t *r);
/* The addresses of the pool's live blocks (Note [Checkpoints]'s meaning), in address order:
 * an array the caller frees, NULL with *out_count 0 when there is none. */
int cp_pool_live_blocks(cp_pool_t *pool, void ***out_ptrs, size_t *out_count);

#ifdef __cplusplus
}
#endif

#endif /* CP_CHECKPOINT_H */
