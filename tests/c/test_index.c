/* test_index.c — unit tests of the free-block index (csrc/core/index.c).
 * Owns: the treap's contract (order by (size, address), best fit, largest, contains, each,
 * count and bytes) checked against a brute-force reference, and cp_index_check catching
 * corrupted trees. Blocks are built by hand; no pool is involved. */
#include <stdint.h>
#include <string.h>

#include "check.h"
#include "core/index.h"

#define KiB       ((size_t)1 << 10)
#define MiB       ((size_t)1 << 20)
#define BASE_ADDR ((uintptr_t)0x7f0000000000ull)

/* ------------------------------------------------------------------------------------------
 * Helpers
 * ---------------------------------------------------------------------------------------- */

static uint64_t rng_state = 0x243F6A8885A308D3ull;

static uint64_t rng_next(void) { /* xorshift64* */
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return rng_state * 0x2545F4914F6CDD1Dull;
}

static size_t rng_below(size_t n) { return (size_t)(rng_next() % n); }

/* A FREE block node of `size` bytes at `addr`, not in any tree. */
static void block_init(cp_block_t *b, uintptr_t addr, size_t size) {
  memset(b, 0, sizeof *b);
  b->addr = addr;
  b->size = size;
  b->state = CP_BLOCK_FREE;
}

static void index_init(cp_index_t *ix) { memset(ix, 0, sizeof *ix); }

/* (size, addr) order, the index's own. */
static int key_less(const cp_block_t *a, const cp_block_t *b) {
  return a->size < b->size || (a->size == b->size && a->addr < b->addr);
}

/* cp_index_each collector. */
typedef struct collect_s {
  cp_block_t **items;
  size_t len;
  size_t cap;
} collect_t;

static void collect_fn(cp_block_t *b, void *arg) {
  collect_t *c = arg;
  if (c->len < c->cap) c->items[c->len] = b;
  c->len++;
}

/* Brute-force reference: which of `nodes` are in the tree. */
typedef struct ref_s {
  cp_block_t *nodes;
  unsigned char *in;
  size_t n;
  size_t count;
  size_t bytes;
} ref_t;

static cp_block_t *ref_lower_bound(const ref_t *r, size_t size) {
  cp_block_t *best = NULL;
  for (size_t i = 0; i < r->n; i++) {
    cp_block_t *b = &r->nodes[i];
    if (r->in[i] && b->size >= size && (best == NULL || key_less(b, best))) best = b;
  }
  return best;
}

static cp_block_t *ref_largest(const ref_t *r) {
  cp_block_t *best = NULL;
  for (size_t i = 0; i < r->n; i++) {
    cp_block_t *b = &r->nodes[i];
    if (r->in[i] && (best == NULL || key_less(best, b))) best = b;
  }
  return best;
}

/* Every node the reference holds, visited by each in strictly increasing order, and no
 * other; every node is found by contains exactly when it is in. */
static int same_contents(const cp_index_t *ix, const ref_t *r) {
  collect_t c = {calloc(r->n + 1, sizeof(cp_block_t *)), 0, r->n + 1};
  if (c.items == NULL) return 0;
  cp_index_each(ix, collect_fn, &c);
  int ok = c.len == r->count;
  for (size_t i = 0; ok && i < c.len; i++) {
    size_t k = (size_t)(c.items[i] - r->nodes);
    ok = k < r->n && r->in[k];
    if (ok && i > 0) ok = key_less(c.items[i - 1], c.items[i]);
  }
  for (size_t i = 0; ok && i < r->n; i++) ok = cp_index_contains(ix, &r->nodes[i]) == (r->in[i] != 0);
  free(c.items);
  return ok;
}

/* Height of the tree (for a sanity bound on the shape). */
static size_t tree_height(const cp_block_t *t) {
  if (t == NULL) return 0;
  size_t l = tree_height(t->left), r = tree_height(t->right);
  return 1 + (l > r ? l : r);
}

/* Same shape and same nodes (compared by address and size). */
static int same_shape(const cp_block_t *a, const cp_block_t *b) {
  if (a == NULL || b == NULL) return a == b;
  return a->addr == b->addr && a->size == b->size && same_shape(a->left, b->left) && same_shape(a->right, b->right);
}

/* Sizes from a few classes so that equal sizes are common. */
static size_t random_size(void) {
  static const size_t classes[] = {512, 1024, 1536, 4 * KiB, 64 * KiB, 1 * MiB, 2 * MiB, 20 * MiB};
  size_t r = rng_below(100);
  if (r < 85) return classes[rng_below(sizeof classes / sizeof classes[0])];
  return (1 + rng_below(64 * 1024)) * 512; /* anything up to 32 MiB, granule multiple */
}

/* A lookup size: exact classes, one byte either side of them, 0, and huge. */
static size_t random_query(void) {
  size_t r = rng_below(100);
  if (r < 2) return 0;
  if (r < 4) return SIZE_MAX;
  size_t s = random_size();
  if (r < 40) return s;
  if (r < 70) return s + 1;
  return s - 1;
}

/* ------------------------------------------------------------------------------------------
 * Tests
 * ---------------------------------------------------------------------------------------- */

TEST(empty_index) {
  cp_index_t ix;
  index_init(&ix);
  CHECK(cp_index_lower_bound(&ix, 0) == NULL);
  CHECK(cp_index_lower_bound(&ix, 512) == NULL);
  CHECK(cp_index_largest(&ix) == NULL);
  cp_block_t b;
  block_init(&b, BASE_ADDR, 512);
  CHECK(!cp_index_contains(&ix, &b));
  collect_t c = {NULL, 0, 0};
  cp_index_each(&ix, collect_fn, &c);
  CHECK_EQ_U(c.len, 0);
  CHECK_EQ_U(cp_index_check(&ix, stderr), 0);
}

TEST(single_node) {
  cp_index_t ix;
  index_init(&ix);
  cp_block_t b;
  block_init(&b, BASE_ADDR + 512, 4096);
  cp_index_insert(&ix, &b);
  CHECK_EQ_U(ix.count, 1);
  CHECK_EQ_U(ix.bytes, 4096);
  CHECK(ix.root == &b);
  CHECK(b.left == NULL && b.right == NULL);
  CHECK(cp_index_contains(&ix, &b));
  CHECK(cp_index_lower_bound(&ix, 0) == &b);
  CHECK(cp_index_lower_bound(&ix, 1) == &b);
  CHECK(cp_index_lower_bound(&ix, 4096) == &b);
  CHECK(cp_index_lower_bound(&ix, 4097) == NULL);
  CHECK(cp_index_largest(&ix) == &b);
  CHECK_EQ_U(cp_index_check(&ix, stderr), 0);
  cp_index_remove(&ix, &b);
  CHECK_EQ_U(ix.count, 0);
  CHECK_EQ_U(ix.bytes, 0);
  CHECK(ix.root == NULL);
  CHECK(b.left == NULL && b.right == NULL);
  CHECK(!cp_index_contains(&ix, &b));
  CHECK_EQ_U(cp_index_check(&ix, stderr), 0);
}

/* Among equal sizes the lowest address wins; a larger size is taken only when no equal one
 * is there; largest is the highest (size, addr). */
TEST(ties_prefer_lowest_address) {
  enum { N = 64 };
  cp_block_t nodes[N];
  cp_index_t ix;
  index_init(&ix);
  /* Sizes 1024 at odd slots and 2048 at even slots, inserted from the highest address down
   * and then shuffled in the middle so that insertion order is not address order. */
  for (int i = 0; i < N; i++) block_init(&nodes[i], BASE_ADDR + (uintptr_t)i * 4096, (i % 2) ? 1024 : 2048);
  for (int i = N - 1; i >= 0; i -= 2) cp_index_insert(&ix, &nodes[i]);
  for (int i = 0; i < N; i += 2) cp_index_insert(&ix, &nodes[i]);
  CHECK_EQ_U(ix.count, N);
  CHECK_EQ_U(ix.bytes, (N / 2) * (1024 + 2048));
  CHECK_EQ_U(cp_index_check(&ix, stderr), 0);
  CHECK(cp_index_lower_bound(&ix, 1) == &nodes[1]);
  CHECK(cp_index_lower_bound(&ix, 1024) == &nodes[1]);
  CHECK(cp_index_lower_bound(&ix, 1025) == &nodes[0]);
  CHECK(cp_index_lower_bound(&ix, 2048) == &nodes[0]);
  CHECK(cp_index_lower_bound(&ix, 2049) == NULL);
  CHECK(cp_index_largest(&ix) == &nodes[N - 2]);

  /* Remove the lowest 1024s one by one: the next-lowest address takes over. */
  for (int i = 1; i < N; i += 2) {
    CHECK(cp_index_lower_bound(&ix, 1000) == &nodes[i]);
    cp_index_remove(&ix, &nodes[i]);
    CHECK_EQ_U(cp_index_check(&ix, stderr), 0);
  }
  /* No 1024 left: the smallest block that fits is the lowest 2048. */
  CHECK(cp_index_lower_bound(&ix, 1000) == &nodes[0]);
  for (int i = N - 2; i >= 0; i -= 2) {
    CHECK(cp_index_largest(&ix) == &nodes[i]);
    cp_index_remove(&ix, &nodes[i]);
    CHECK_EQ_U(cp_index_check(&ix, stderr), 0);
  }
  CHECK(ix.root == NULL);
  CHECK_EQ_U(ix.count, 0);
  CHECK_EQ_U(ix.bytes, 0);
}

/* The headline test: many random operations, every answer compared with a linear scan. */
TEST(random_against_reference) {
  enum { N = 1500, OPS = 20000 };
  cp_block_t *nodes = calloc(N, sizeof *nodes);
  unsigned char *in = calloc(N, 1);
  REQUIRE(nodes != NULL && in != NULL);
  /* Distinct, 512-aligned addresses, spread so that neighbours are not adjacent. */
  for (size_t i = 0; i < N; i++) block_init(&nodes[i], BASE_ADDR + (uintptr_t)(i * 7 + 3) * 512 * 64, random_size());
  ref_t ref = {nodes, in, N, 0, 0};
  cp_index_t ix;
  index_init(&ix);
  size_t max_height = 0, checks = 0;

  for (int op = 0; op < OPS; op++) {
    size_t i = rng_below(N);
    cp_block_t *b = &nodes[i];
    size_t r = rng_below(100);
    /* Insert more often than remove while small, the other way round when large, so the
     * tree goes up and down through all sizes several times. */
    int phase_grow = ((op / 2500) % 2) == 0;
    int want_insert = phase_grow ? r < 65 : r < 35;
    if (want_insert && !in[i]) {
      b->size = random_size(); /* a block may come back with a new size, as after a merge */
      cp_index_insert(&ix, b);
      in[i] = 1;
      ref.count++;
      ref.bytes += b->size;
    } else if (!want_insert && in[i]) {
      cp_index_remove(&ix, b);
      CHECK(b->left == NULL && b->right == NULL);
      in[i] = 0;
      ref.count--;
      ref.bytes -= b->size;
    } else if (in[i] && rng_below(4) == 0) {
      /* Remove, resize, reinsert (what a merge with a neighbour does). */
      cp_index_remove(&ix, b);
      ref.bytes -= b->size;
      b->size += 512 * (1 + rng_below(8));
      ref.bytes += b->size;
      cp_index_insert(&ix, b);
    }
    CHECK_EQ_U(ix.count, ref.count);
    CHECK_EQ_U(ix.bytes, ref.bytes);

    for (int q = 0; q < 3; q++) {
      size_t want = random_query();
      cp_block_t *got = cp_index_lower_bound(&ix, want);
      cp_block_t *exp = ref_lower_bound(&ref, want);
      if (got != exp) {
        fprintf(stderr, "op %d: lower_bound(%zu) gave %p (size %zu), expected %p (size %zu)\n", op, want, (void *)got,
                got ? got->size : 0, (void *)exp, exp ? exp->size : 0);
        CHECK(got == exp);
      }
    }
    CHECK(cp_index_largest(&ix) == ref_largest(&ref));
    CHECK(cp_index_contains(&ix, b) == (in[i] != 0));

    if (op % 7 == 0) {
      size_t v = cp_index_check(&ix, stderr);
      checks++;
      if (v != 0) {
        fprintf(stderr, "op %d: cp_index_check found %zu violations\n", op, v);
        CHECK_EQ_U(v, 0);
        break;
      }
    }
    if (op % 500 == 0) {
      CHECK(same_contents(&ix, &ref));
      size_t h = tree_height(ix.root);
      if (h > max_height) max_height = h;
    }
  }
  CHECK(same_contents(&ix, &ref));
  CHECK_EQ_U(cp_index_check(&ix, stderr), 0);
  /* A treap of <= 1500 nodes with hashed priorities stays far below a list. */
  CHECK(max_height < 64);
  CHECK(checks > 0);

  /* Drain, in a random order. */
  for (size_t k = 0; k < N; k++) {
    size_t i = (k * 613 + 11) % N; /* 613 is prime to 1500: a permutation */
    if (in[i]) {
      cp_index_remove(&ix, &nodes[i]);
      in[i] = 0;
      ref.count--;
      ref.bytes -= nodes[i].size;
    }
  }
  CHECK(ix.root == NULL);
  CHECK_EQ_U(ix.count, 0);
  CHECK_EQ_U(ix.bytes, 0);
  CHECK_EQ_U(cp_index_check(&ix, stderr), 0);
  free(nodes);
  free(in);
}

/* Priorities come from the address: the same set of blocks gives the same tree whatever
 * the order of insertion (when no two priorities are equal). */
TEST(shape_depends_only_on_contents) {
  enum { N = 400 };
  cp_block_t *a = calloc(N, sizeof *a), *b = calloc(N, sizeof *b);
  REQUIRE(a != NULL && b != NULL);
  for (size_t i = 0; i < N; i++) {
    size_t size = random_size();
    block_init(&a[i], BASE_ADDR + (uintptr_t)i * 1024, size);
    block_init(&b[i], BASE_ADDR + (uintptr_t)i * 1024, size);
  }
  cp_index_t ia, ib;
  index_init(&ia);
  index_init(&ib);
  for (size_t i = 0; i < N; i++) cp_index_insert(&ia, &a[i]);
  for (size_t k = 0; k < N; k++) cp_index_insert(&ib, &b[(k * 37 + 5) % N]); /* 37 prime to 400 */
  int distinct = 1;
  for (size_t i = 0; i < N && distinct; i++)
    for (size_t j = i + 1; j < N; j++)
      if (a[i].priority == a[j].priority) distinct = 0;
  CHECK_EQ_U(cp_index_check(&ia, stderr), 0);
  CHECK_EQ_U(cp_index_check(&ib, stderr), 0);
  if (distinct) CHECK(same_shape(ia.root, ib.root));
  /* Remove half from each in different orders: still the same shape. */
  for (size_t i = 0; i < N; i += 2) cp_index_remove(&ia, &a[i]);
  for (size_t i = N; i >= 2; i -= 2) cp_index_remove(&ib, &b[i - 2]);
  CHECK_EQ_U(cp_index_check(&ia, stderr), 0);
  CHECK_EQ_U(cp_index_check(&ib, stderr), 0);
  if (distinct) CHECK(same_shape(ia.root, ib.root));
  CHECK_EQ_U(ia.count, N / 2);
  CHECK_EQ_U(ia.bytes, ib.bytes);
  free(a);
  free(b);
}

/* Build a tree of `n` nodes with distinct sizes 512 * (i + 1) at increasing addresses. */
static void build_distinct(cp_index_t *ix, cp_block_t *nodes, size_t n) {
  index_init(ix);
  for (size_t i = 0; i < n; i++) {
    block_init(&nodes[i], BASE_ADDR + (uintptr_t)i * 8192, 512 * (i + 1));
    cp_index_insert(ix, &nodes[i]);
  }
}

/* A node that has at least one child, not the root. */
static cp_block_t *inner_node(cp_block_t *nodes, size_t n, const cp_index_t *ix) {
  for (size_t i = 0; i < n; i++) {
    if (&nodes[i] != ix->root && (nodes[i].left != NULL || nodes[i].right != NULL)) return &nodes[i];
  }
  return NULL;
}

TEST(check_detects_corruption) {
  enum { N = 200 };
  cp_block_t nodes[N];
  cp_index_t ix;
  build_distinct(&ix, nodes, N);
  REQUIRE(cp_index_check(&ix, stderr) == 0);
  FILE *sink = tmpfile(); /* descriptions go here, not into the test log */
  REQUIRE(sink != NULL);

  /* 1. Swap the sizes of the smallest and the largest node: count and bytes still agree,
   * only the order is broken. */
  cp_block_t *lo = cp_index_lower_bound(&ix, 0), *hi = cp_index_largest(&ix);
  REQUIRE(lo != NULL && hi != NULL && lo != hi);
  size_t t = lo->size;
  lo->size = hi->size;
  hi->size = t;
  CHECK(cp_index_check(&ix, sink) > 0);
  CHECK(cp_index_check(&ix, NULL) > 0); /* also without a stream to write to */
  hi->size = lo->size;
  lo->size = t;
  CHECK_EQ_U(cp_index_check(&ix, stderr), 0);

  /* 2. Swap the sizes of two neighbours in order (the subtlest order break). */
  cp_block_t *a = cp_index_lower_bound(&ix, 512 * 50), *b = cp_index_lower_bound(&ix, 512 * 51);
  REQUIRE(a != NULL && b != NULL && a != b);
  t = a->size;
  a->size = b->size;
  b->size = t;
  CHECK(cp_index_check(&ix, sink) > 0);
  b->size = a->size;
  a->size = t;
  CHECK_EQ_U(cp_index_check(&ix, stderr), 0);

  /* 3. Equal sizes are legal while the addresses are in order, and broken when they are
   * not. */
  size_t old_b = b->size;
  b->size = a->size; /* a precedes b in the tree and has the lower address */
  ix.bytes -= old_b - a->size;
  CHECK_EQ_U(cp_index_check(&ix, stderr), 0);
  uintptr_t ta = a->addr;
  a->addr = b->addr;
  b->addr = ta; /* a now sorts after b, yet sits before it */
  CHECK(cp_index_check(&ix, sink) > 0);
  b->addr = a->addr;
  a->addr = ta;
  b->size = old_b;
  ix.bytes += old_b - a->size;
  CHECK_EQ_U(cp_index_check(&ix, stderr), 0);

  /* 4. Heap order: a child's priority above its parent's. */
  cp_block_t *p = inner_node(nodes, N, &ix);
  REQUIRE(p != NULL);
  cp_block_t *child = p->left != NULL ? p->left : p->right;
  uint32_t pc = child->priority;
  child->priority = p->priority == UINT32_MAX ? UINT32_MAX : p->priority + 1;
  if (child->priority > p->priority) CHECK(cp_index_check(&ix, sink) > 0);
  child->priority = pc;
  CHECK_EQ_U(cp_index_check(&ix, stderr), 0);

  /* 5. count and bytes that disagree with the nodes. */
  ix.count++;
  CHECK(cp_index_check(&ix, sink) > 0);
  ix.count--;
  ix.bytes -= 512;
  CHECK(cp_index_check(&ix, sink) > 0);
  ix.bytes += 512;
  CHECK_EQ_U(cp_index_check(&ix, stderr), 0);

  /* 6. A node that is not FREE. */
  nodes[N / 3].state = CP_BLOCK_LIVE;
  CHECK(cp_index_check(&ix, sink) > 0);
  nodes[N / 3].state = CP_BLOCK_PENDING;
  CHECK(cp_index_check(&ix, sink) > 0);
  nodes[N / 3].state = CP_BLOCK_FREE;
  CHECK_EQ_U(cp_index_check(&ix, stderr), 0);

  /* 7. A node dropped from the tree behind the index's back (a subtree lost). */
  cp_block_t *q = inner_node(nodes, N, &ix);
  REQUIRE(q != NULL);
  cp_block_t **side = q->left != NULL ? &q->left : &q->right;
  cp_block_t *lost = *side;
  *side = NULL;
  CHECK(cp_index_check(&ix, sink) > 0);
  *side = lost;
  CHECK_EQ_U(cp_index_check(&ix, stderr), 0);

  /* The descriptions were written. */
  CHECK(ftell(sink) > 0);
  fclose(sink);
}

/* each visits in (size, addr) order and the callback sees every node exactly once. */
static void sum_fn(cp_block_t *b, void *arg) { *(size_t *)arg += b->size; }

TEST(each_order_and_totals) {
  enum { N = 300 };
  cp_block_t nodes[N];
  cp_index_t ix;
  index_init(&ix);
  size_t bytes = 0;
  for (size_t i = 0; i < N; i++) {
    block_init(&nodes[i], BASE_ADDR + (uintptr_t)(N - i) * 512, (1 + i % 5) * 512);
    cp_index_insert(&ix, &nodes[i]);
    bytes += nodes[i].size;
  }
  CHECK_EQ_U(ix.count, N);
  CHECK_EQ_U(ix.bytes, bytes);
  size_t sum = 0;
  cp_index_each(&ix, sum_fn, &sum);
  CHECK_EQ_U(sum, bytes);
  cp_block_t *items[N];
  collect_t c = {items, 0, N};
  cp_index_each(&ix, collect_fn, &c);
  CHECK_EQ_U(c.len, N);
  int sorted = 1;
  for (size_t i = 1; i < c.len && i < N; i++) sorted = sorted && key_less(items[i - 1], items[i]);
  CHECK(sorted);
  CHECK(items[0]->size == 512 && items[N - 1]->size == 5 * 512);
  CHECK_EQ_U(cp_index_check(&ix, stderr), 0);
}

/* Adjacent sizes and addresses near the top of the address space, and size classes one
 * granule apart: lower_bound never skips the exact fit. */
TEST(lower_bound_exact_fits) {
  enum { N = 256 };
  cp_block_t nodes[N];
  cp_index_t ix;
  index_init(&ix);
  uintptr_t top = UINTPTR_MAX - (UINTPTR_MAX % 512) - (uintptr_t)N * 512 * 4;
  for (size_t i = 0; i < N; i++) {
    block_init(&nodes[i], top + (uintptr_t)i * 512 * 2, 512 * (1 + (i * 97) % N)); /* a permutation */
    cp_index_insert(&ix, &nodes[i]);
  }
  CHECK_EQ_U(cp_index_check(&ix, stderr), 0);
  for (size_t s = 1; s <= N; s++) {
    cp_block_t *b = cp_index_lower_bound(&ix, 512 * s);
    CHECK(b != NULL && b->size == 512 * s);
    b = cp_index_lower_bound(&ix, 512 * s - 511);
    CHECK(b != NULL && b->size == 512 * s);
  }
  CHECK(cp_index_lower_bound(&ix, 512 * N + 1) == NULL);
  CHECK(cp_index_largest(&ix)->size == 512 * N);
}

int main(void) {
  RUN(empty_index);
  RUN(single_node);
  RUN(ties_prefer_lowest_address);
  RUN(random_against_reference);
  RUN(shape_depends_only_on_contents);
  RUN(check_detects_corruption);
  RUN(each_order_and_totals);
  RUN(lower_bound_exact_fits);
  return check_summary("test_index");
}
