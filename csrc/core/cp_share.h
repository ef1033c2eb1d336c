/* cp_share.h — the public API of checkpoints (checkpoint.c), for CUDA graph trees, and of
 * sharing memory with other processes (share.c); included by cp.h. */
#ifndef CP_SHARE_H
#define CP_SHARE_H

#include <stddef.h>
#include <stdint.h>

typedef struct cp_pool_s cp_pool_t;

/* ------------------------------------------------------------------------------------------
 * Checkpoints (checkpoint.c)
 * ---------------------------------------------------------------------------------------- */

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

/* ------------------------------------------------------------------------------------------
 * Sharing with other processes (share.c)
 * ---------------------------------------------------------------------------------------- */

/* What another process maps to reach the live block at `ptr` (Note [Sharing a block] in
 * share.c): a plain segment whole (its base and size), or the mappings of page-mapped memory
 * over the block, each one physical allocation (`spans`, contiguous, address order). `offset`
 * is ptr's from `base`. The block is marked shared until it is freed: a pause of its region is
 * refused meanwhile. cp_share_release frees `spans`. */
typedef struct cp_share_span_s {
  uintptr_t addr;
  size_t size;
} cp_share_span_t;
typedef struct cp_share_s {
  int paged;
  uintptr_t base;
  size_t size;
  size_t offset;
  size_t block_bytes; /* bytes asked for */
  cp_share_span_t *spans;
  size_t span_count;
} cp_share_t;
int cp_pool_share(cp_pool_t *pool, void *ptr, cp_share_t *out);
/* Whether `ptr` is a live block of the pool marked shared (0 for NULL arguments). */
int cp_pool_is_shared(cp_pool_t *pool, const void *ptr);
void cp_share_release(cp_share_t *s);

#endif /* CP_SHARE_H */
