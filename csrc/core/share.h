/* share.h — the public API of sharing (share.c): what another process maps to reach a live
 * block of the pool. */
#ifndef CP_SHARE_H
#define CP_SHARE_H

#include <stddef.h>
#include <stdint.h>

#include "core/cp.h"

/* C linkage for the C++ that calls it (the bridge, through devices/graphs.h). */
#ifdef __cplusplus
extern "C" {
#endif

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

#ifdef __cplusplus
}
#endif

#endif /* CP_SHARE_H */
