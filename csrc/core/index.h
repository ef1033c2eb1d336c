/* index.h — the free-block index (index.c). */
#ifndef CP_INDEX_H
#define CP_INDEX_H

#include <stdio.h>

#include "core/types.h"

/* ------------------------------------------------------------------------------------------
 * Free-block index (index.c): a treap of FREE blocks ordered by (size, addr), one per
 * (stream, kind). Priorities come from the address, so shapes are deterministic.
 * Expected O(log n) insert, remove and lower-bound.
 * ---------------------------------------------------------------------------------------- */

typedef struct cp_index_s {
  cp_block_t *root;
  size_t count; /* nodes in the tree */
  size_t bytes; /* sum of their sizes */
} cp_index_t;

void cp_index_insert(cp_index_t *ix, cp_block_t *b);
void cp_index_remove(cp_index_t *ix, cp_block_t *b);
/* The smallest block with size >= `size` (lowest address among equals), or NULL. When
 * `out_link` is not NULL it receives the link that points at the block, for
 * cp_index_remove_at (valid until the tree next changes). */
cp_block_t *cp_index_lower_bound(const cp_index_t *ix, size_t size);
cp_block_t *cp_index_lower_bound_link(cp_index_t *ix, size_t size, cp_block_t ***out_link);
void cp_index_remove_at(cp_index_t *ix, cp_block_t **link);
cp_block_t *cp_index_largest(const cp_index_t *ix);
/* The node right after `b` in (size, addr) order, or NULL. */
cp_block_t *cp_index_next(const cp_index_t *ix, const cp_block_t *b);
bool cp_index_contains(const cp_index_t *ix, const cp_block_t *b);
/* Count tree-shape violations (order, heap, count, bytes); describe them on `out`. */
size_t cp_index_check(const cp_index_t *ix, FILE *out);
/* Call fn on every node, in order. */
void cp_index_each(const cp_index_t *ix, void (*fn)(cp_block_t *b, void *arg), void *arg);

#endif /* CP_INDEX_H */
