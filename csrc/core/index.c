/* index.c — the free-block index: a treap of FREE blocks ordered by (size, address).
 * Owns: best-fit lookup in expected O(log n); knows nothing of streams, pools or stats. */
#include "core/index.h"

/* Note [Why a treap]
 * Best fit by (size, address) is what the built-in allocator does (an ordered set), and it
 * gives results that can be compared with it block for block. A treap keeps that exact
 * order with short, iterative code and no rebalancing cases. The heap key is a hash of the
 * block's address, so the same sequence of operations always builds the same tree. */

static inline uint32_t cp_priority_of(uintptr_t addr) {
  uint64_t x = (uint64_t)addr >> 9;
  x *= 0x9E3779B97F4A7C15ull;
  return (uint32_t)(x >> 32);
}

/* Strict (size, addr) order. */
static inline bool cp_less(size_t size_a, uintptr_t addr_a, size_t size_b, uintptr_t addr_b) {
  return size_a < size_b || (size_a == size_b && addr_a < addr_b);
}

/* Is the key (size_a, addr_a) ordered before block b? */
static inline bool cp_key_less(size_t size_a, uintptr_t addr_a, const cp_block_t *b) {
  return cp_less(size_a, addr_a, b->size, b->addr);
}

/* Split `t` into nodes ordered before (size, addr) and the rest. */
static void cp_treap_split(cp_block_t *t, size_t size, uintptr_t addr, cp_block_t **lo, cp_block_t **hi) {
  while (t != NULL) {
    if (cp_less(t->size, t->addr, size, addr)) {
      *lo = t;
      lo = &t->right;
      t = t->right;
    } else {
      *hi = t;
      hi = &t->left;
      t = t->left;
    }
  }
  *lo = NULL;
  *hi = NULL;
}

/* Merge two treaps where every key of `a` is below every key of `b`. */
static cp_block_t *cp_treap_merge(cp_block_t *a, cp_block_t *b) {
  cp_block_t *root = NULL;
  cp_block_t **link = &root;
  while (a != NULL && b != NULL) {
    if (a->priority > b->priority) {
      *link = a;
      link = &a->right;
      a = a->right;
    } else {
      *link = b;
      link = &b->left;
      b = b->left;
    }
  }
  *link = (a != NULL) ? a : b;
  return root;
}

void cp_index_insert(cp_index_t *ix, cp_block_t *b) {
  b->priority = cp_priority_of(b->addr);
  cp_block_t **link = &ix->root;
  while (*link != NULL && (*link)->priority >= b->priority) {
    link = cp_key_less(b->size, b->addr, *link) ? &(*link)->left : &(*link)->right;
  }
  cp_treap_split(*link, b->size, b->addr, &b->left, &b->right);
  *link = b;
  ix->count++;
  ix->bytes += b->size;
}

cp_block_t *cp_index_next(const cp_index_t *ix, const cp_block_t *b) {
  cp_block_t *best = NULL;
  for (cp_block_t *t = ix->root; t != NULL;) {
    if (cp_key_less(b->size, b->addr, t)) {
      best = t;
      t = t->left;
    } else {
      t = t->right;
    }
  }
  return best;
}

void cp_index_remove(cp_index_t *ix, cp_block_t *b) {
  cp_block_t **link = &ix->root;
  while (*link != b) {
    /* The block is in the tree by contract; a NULL here is a corrupted pool. */
    link = cp_key_less(b->size, b->addr, *link) ? &(*link)->left : &(*link)->right;
  }
  cp_index_remove_at(ix, link);
}

cp_block_t *cp_index_lower_bound(const cp_index_t *ix, size_t size) {
  cp_block_t *best = NULL;
  cp_block_t *t = ix->root;
  while (t != NULL) {
    if (t->size >= size) {
      best = t; /* candidate; look for a smaller (or lower-address) one on the left */
      t = t->left;
    } else {
      t = t->right;
    }
  }
  return best;
}

cp_block_t *cp_index_lower_bound_link(cp_index_t *ix, size_t size, cp_block_t ***out_link) {
  cp_block_t *best = NULL;
  cp_block_t **best_link = NULL;
  cp_block_t **link = &ix->root;
  while (*link != NULL) {
    cp_block_t *t = *link;
    if (t->size >= size) {
      best = t;
      best_link = link;
      link = &t->left;
    } else {
      link = &t->right;
    }
  }
  *out_link = best_link;
  return best;
}

void cp_index_remove_at(cp_index_t *ix, cp_block_t **link) {
  cp_block_t *b = *link;
  *link = cp_treap_merge(b->left, b->right);
  b->left = NULL;
  b->right = NULL;
  ix->count--;
  ix->bytes -= b->size;
}

cp_block_t *cp_index_largest(const cp_index_t *ix) {
  cp_block_t *t = ix->root;
  while (t != NULL && t->right != NULL) t = t->right;
  return t;
}

bool cp_index_contains(const cp_index_t *ix, const cp_block_t *b) {
  const cp_block_t *t = ix->root;
  while (t != NULL && t != b) {
    t = cp_key_less(b->size, b->addr, t) ? t->left : t->right;
  }
  return t == b;
}

static void cp_index_each_rec(cp_block_t *t, void (*fn)(cp_block_t *b, void *arg), void *arg) {
  while (t != NULL) {
    cp_index_each_rec(t->left, fn, arg);
    cp_block_t *right = t->right; /* fn may not modify the tree, but be safe about reads */
    fn(t, arg);
    t = right;
  }
}

void cp_index_each(const cp_index_t *ix, void (*fn)(cp_block_t *b, void *arg), void *arg) {
  cp_index_each_rec(ix->root, fn, arg);
}

typedef struct cp_index_walk_s {
  size_t count;
  size_t bytes;
  size_t violations;
  FILE *out;
} cp_index_walk_t;

/* Check order within (lo, hi) bounds and the heap property; count nodes and bytes. */
static void cp_index_check_rec(const cp_block_t *t, const cp_block_t *lo, const cp_block_t *hi, cp_index_walk_t *w) {
  while (t != NULL) {
    w->count++;
    w->bytes += t->size;
    if (t->state != CP_BLOCK_FREE) {
      w->violations++;
      if (w->out) fprintf(w->out, "index: block %#lx in the index is not FREE\n", (unsigned long)t->addr);
    }
    if ((lo != NULL && !cp_key_less(lo->size, lo->addr, t)) || (hi != NULL && !cp_key_less(t->size, t->addr, hi))) {
      w->violations++;
      if (w->out) fprintf(w->out, "index: block %#lx out of (size, addr) order\n", (unsigned long)t->addr);
    }
    if ((t->left != NULL && t->left->priority > t->priority) ||
        (t->right != NULL && t->right->priority > t->priority)) {
      w->violations++;
      if (w->out) fprintf(w->out, "index: heap order broken at block %#lx\n", (unsigned long)t->addr);
    }
    if (w->count > ((size_t)1 << 40)) return; /* a cycle: stop walking */
    cp_index_check_rec(t->left, lo, t, w);
    lo = t;
    t = t->right;
  }
}

size_t cp_index_check(const cp_index_t *ix, FILE *out) {
  cp_index_walk_t w = {0, 0, 0, out};
  cp_index_check_rec(ix->root, NULL, NULL, &w);
  if (w.count != ix->count) {
    w.violations++;
    if (out) fprintf(out, "index: %zu nodes but count says %zu\n", w.count, ix->count);
  }
  if (w.bytes != ix->bytes) {
    w.violations++;
    if (out) fprintf(out, "index: %zu bytes but total says %zu\n", w.bytes, ix->bytes);
  }
  return w.violations;
}
