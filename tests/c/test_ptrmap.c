/* test_ptrmap.c — unit tests of the pointer map (csrc/core/ptrmap.c).
 * Owns: insert/get/remove against a brute-force reference, key 0, colliding keys and probe
 * runs that wrap around the table, backward-shift deletion, growth, reserve. */
#include <stdint.h>
#include <string.h>

#include "base/ptrmap.h"
#include "base/status.h"
#include "check.h"

/* ------------------------------------------------------------------------------------------
 * Helpers
 * ---------------------------------------------------------------------------------------- */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static uint64_t rng_next(void) { /* xorshift64* */
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return rng_state * 0x2545F4914F6CDD1Dull;
}

static size_t rng_below(size_t n) { return (size_t)(rng_next() % n); }

/* The map's mixer, reproduced to craft keys that share a home slot. If ptrmap.c changes its
 * hash, these keys merely stop colliding: every check below still holds. */
static size_t home_hash(uintptr_t key) {
  uint64_t x = (uint64_t)key;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return (size_t)x;
}

/* A distinct non-NULL value for key number i. */
static void *value_of(size_t i) { return (void *)(uintptr_t)(0x1000 + 16 * i); }

/* Structural check: count matches the occupied slots, the load stays at most 1/2, and every
 * entry is reachable from its home slot without crossing an empty one (what get relies on
 * and backward-shift deletion must preserve). Returns the number of problems. */
static size_t map_violations(const cp_ptrmap_t *m) {
  size_t cap = m->mask + 1, used = 0, bad = 0;
  if ((cap & m->mask) != 0) bad++; /* power of two */
  for (size_t i = 0; i < cap; i++) {
    const cp_ptrmap_slot_t *s = &m->slots[i];
    if (s->value == NULL) continue;
    used++;
    for (size_t j = home_hash(s->key) & m->mask; j != i; j = (j + 1) & m->mask) {
      if (m->slots[j].value == NULL) {
        bad++;
        break;
      }
    }
    if (cp_ptrmap_get(m, s->key) != s->value) bad++;
  }
  if (used != m->count) bad++;
  if (m->count * 2 > cap) bad++;
  return bad;
}

/* `n` distinct keys whose home slot is `home` in a table of `cap` slots. */
static void colliding_keys(uintptr_t *out, size_t n, size_t cap, size_t home, uintptr_t start) {
  size_t got = 0;
  for (uintptr_t k = start; got < n; k += 512) {
    if ((home_hash(k) & (cap - 1)) == home) out[got++] = k;
  }
}

/* ------------------------------------------------------------------------------------------
 * Tests
 * ---------------------------------------------------------------------------------------- */

TEST(init_capacity_and_empty_map) {
  cp_ptrmap_t m;
  REQUIRE(cp_ptrmap_init(&m, 0) == CP_OK);
  CHECK_EQ_U(m.mask + 1, 16);
  CHECK_EQ_U(m.count, 0);
  CHECK(cp_ptrmap_get(&m, 0) == NULL); /* an empty slot's key is 0: still absent */
  CHECK(cp_ptrmap_get(&m, 512) == NULL);
  CHECK(cp_ptrmap_remove(&m, 0) == NULL);
  CHECK(cp_ptrmap_remove(&m, 12345) == NULL);
  CHECK_EQ_U(m.count, 0);
  cp_ptrmap_destroy(&m);
  CHECK(m.slots == NULL && m.mask == 0 && m.count == 0);
  cp_ptrmap_destroy(&m); /* twice is harmless */

  REQUIRE(cp_ptrmap_init(&m, 17) == CP_OK);
  CHECK_EQ_U(m.mask + 1, 32);
  cp_ptrmap_destroy(&m);
  REQUIRE(cp_ptrmap_init(&m, 1024) == CP_OK);
  CHECK_EQ_U(m.mask + 1, 1024);
  cp_ptrmap_destroy(&m);
}

TEST(key_zero_and_extremes) {
  cp_ptrmap_t m;
  REQUIRE(cp_ptrmap_init(&m, 16) == CP_OK);
  int a, b, c;
  CHECK(cp_ptrmap_insert(&m, 0, &a) == CP_OK);
  CHECK(cp_ptrmap_insert(&m, UINTPTR_MAX, &b) == CP_OK);
  CHECK(cp_ptrmap_insert(&m, 1, &c) == CP_OK);
  CHECK(cp_ptrmap_get(&m, 0) == &a);
  CHECK(cp_ptrmap_get(&m, UINTPTR_MAX) == &b);
  CHECK(cp_ptrmap_get(&m, 1) == &c);
  CHECK(cp_ptrmap_get(&m, 2) == NULL);
  CHECK_EQ_U(m.count, 3);
  CHECK_EQ_U(map_violations(&m), 0);
  CHECK(cp_ptrmap_remove(&m, 0) == &a);
  CHECK(cp_ptrmap_get(&m, 0) == NULL);
  CHECK(cp_ptrmap_remove(&m, 0) == NULL); /* already gone */
  CHECK(cp_ptrmap_get(&m, UINTPTR_MAX) == &b);
  CHECK(cp_ptrmap_get(&m, 1) == &c);
  CHECK_EQ_U(m.count, 2);
  CHECK_EQ_U(map_violations(&m), 0);
  cp_ptrmap_destroy(&m);
}

/* Many keys with one home slot: one long probe run; removing from its front, middle and end
 * must keep the rest reachable. */
TEST(colliding_keys_and_backward_shift) {
  enum { CAP = 64, N = 20 };
  uintptr_t keys[N];
  for (size_t home = 0; home < CAP; home += 21) { /* 0, 21, 42, 63: 63 makes the run wrap */
    cp_ptrmap_t m;
    REQUIRE(cp_ptrmap_init(&m, CAP) == CP_OK);
    colliding_keys(keys, N, CAP, home, 0x7f0000000000ull);
    for (size_t i = 0; i < N; i++) CHECK(cp_ptrmap_insert(&m, keys[i], value_of(i)) == CP_OK);
    CHECK_EQ_U(m.mask + 1, CAP); /* 20 keys in 64 slots: no growth */
    CHECK_EQ_U(map_violations(&m), 0);
    /* Front, end, then middle ones, checking all the others each time. */
    static const size_t order[] = {0, 19, 10, 1, 18, 9, 11, 2, 17, 3, 16, 4, 15, 5, 14, 6, 13, 7, 12, 8};
    unsigned char gone[N] = {0};
    for (size_t r = 0; r < N; r++) {
      size_t i = order[r];
      CHECK(cp_ptrmap_remove(&m, keys[i]) == value_of(i));
      gone[i] = 1;
      CHECK(cp_ptrmap_remove(&m, keys[i]) == NULL);
      for (size_t j = 0; j < N; j++) CHECK(cp_ptrmap_get(&m, keys[j]) == (gone[j] ? NULL : value_of(j)));
      CHECK_EQ_U(map_violations(&m), 0);
    }
    CHECK_EQ_U(m.count, 0);
    for (size_t i = 0; i < CAP; i++) CHECK(m.slots[i].value == NULL);
    cp_ptrmap_destroy(&m);
  }
}

/* Two interleaved runs whose homes are neighbours, one of them wrapping past the end: the
 * backward shift must move an entry only when its home is not cyclically in (hole, j]. */
TEST(interleaved_runs_wrapping) {
  enum { CAP = 64, N = 8 };
  uintptr_t a[N], b[N], c[N];
  colliding_keys(a, N, CAP, CAP - 2, 0x1000000);
  colliding_keys(b, N, CAP, CAP - 1, 0x2000000);
  colliding_keys(c, N, CAP, 1, 0x3000000);
  for (int round = 0; round < 40; round++) {
    cp_ptrmap_t m;
    REQUIRE(cp_ptrmap_init(&m, CAP) == CP_OK);
    uintptr_t all[3 * N];
    void *vals[3 * N];
    unsigned char in[3 * N] = {0};
    for (size_t i = 0; i < N; i++) {
      all[3 * i] = a[i];
      all[3 * i + 1] = b[i];
      all[3 * i + 2] = c[i];
    }
    for (size_t i = 0; i < 3 * N; i++) vals[i] = value_of(i);
    /* Insert in a random order so that the runs interleave differently each round. */
    for (size_t k = 0; k < 3 * N; k++) {
      size_t i;
      do i = rng_below(3 * N);
      while (in[i]);
      CHECK(cp_ptrmap_insert(&m, all[i], vals[i]) == CP_OK);
      in[i] = 1;
    }
    CHECK_EQ_U(map_violations(&m), 0);
    /* Remove in another random order; after each, everything still present is found. */
    for (size_t k = 0; k < 3 * N; k++) {
      size_t i;
      do i = rng_below(3 * N);
      while (!in[i]);
      CHECK(cp_ptrmap_remove(&m, all[i]) == vals[i]);
      in[i] = 0;
      for (size_t j = 0; j < 3 * N; j++) CHECK(cp_ptrmap_get(&m, all[j]) == (in[j] ? vals[j] : NULL));
      CHECK_EQ_U(map_violations(&m), 0);
    }
    cp_ptrmap_destroy(&m);
  }
}

/* The headline test: random inserts, gets and removes over a universe of keys of every
 * kind, compared with a flag array, through growth from the minimum size. */
TEST(random_against_reference) {
  enum { U = 6000, OPS = 200000 };
  uintptr_t *keys = calloc(U, sizeof *keys);
  unsigned char *in = calloc(U, 1);
  REQUIRE(keys != NULL && in != NULL);
  /* The universe: key 0, small integers, block-like addresses (multiples of 512, dense and
   * sparse), 64-bit random values, keys colliding in small tables, and the extremes. All
   * distinct (duplicates are replaced). */
  size_t n = 0;
  keys[n++] = 0;
  keys[n++] = UINTPTR_MAX;
  keys[n++] = UINTPTR_MAX - 511;
  for (size_t i = 1; i <= 200; i++) keys[n++] = i;
  for (size_t i = 0; i < 2000; i++) keys[n++] = 0x7f0000000000ull + (uintptr_t)i * 512;
  for (size_t i = 0; i < 800; i++) keys[n++] = 0x7f4000000000ull + (uintptr_t)i * 512 * 4096;
  colliding_keys(&keys[n], 100, 16, 15, 0x10000000);
  n += 100;
  colliding_keys(&keys[n], 100, 1024, 3, 0x20000000);
  n += 100;
  while (n < U) keys[n++] = (uintptr_t)rng_next();
  for (size_t i = 0; i < U; i++) {
    for (size_t j = 0; j < i; j++) {
      if (keys[j] == keys[i]) {
        keys[i] = (uintptr_t)rng_next() | 1; /* odd: cannot equal a 512-multiple */
        j = (size_t)-1;                      /* restart the scan for the new key */
      }
    }
  }

  cp_ptrmap_t m;
  REQUIRE(cp_ptrmap_init(&m, 0) == CP_OK);
  size_t count = 0, max_cap = 0, grows = 0, last_cap = m.mask + 1;
  for (int op = 0; op < OPS; op++) {
    size_t i = rng_below(U);
    /* Phases: fill towards ~4000 keys, then drain towards ~1700, twice over. */
    int fill = ((op / (OPS / 4)) % 2) == 0;
    size_t r = rng_below(100);
    if (r < (fill ? 60u : 25u)) {
      if (!in[i]) {
        CHECK(cp_ptrmap_insert(&m, keys[i], value_of(i)) == CP_OK);
        in[i] = 1;
        count++;
      }
    } else if (r < 90) {
      void *got = cp_ptrmap_remove(&m, keys[i]);
      CHECK(got == (in[i] ? value_of(i) : NULL));
      if (in[i]) count--;
      in[i] = 0;
    } else {
      CHECK(cp_ptrmap_get(&m, keys[i]) == (in[i] ? value_of(i) : NULL));
    }
    CHECK(cp_ptrmap_get(&m, keys[i]) == (in[i] ? value_of(i) : NULL));
    CHECK_EQ_U(m.count, count);
    if (m.mask + 1 != last_cap) {
      CHECK(m.mask + 1 > last_cap); /* the map never shrinks */
      grows++;
      last_cap = m.mask + 1;
    }
    if (m.mask + 1 > max_cap) max_cap = m.mask + 1;
    if (op % 4000 == 0 || (m.mask + 1 <= 64 && op % 8 == 0)) {
      size_t v = map_violations(&m);
      if (v != 0) fprintf(stderr, "op %d: %zu map violations\n", op, v);
      CHECK_EQ_U(v, 0);
      for (size_t j = 0; j < U; j++) {
        if (cp_ptrmap_get(&m, keys[j]) != (in[j] ? value_of(j) : NULL)) {
          fprintf(stderr, "op %d: key %#lx wrong\n", op, (unsigned long)keys[j]);
          CHECK(0);
          break;
        }
      }
    }
  }
  CHECK(grows >= 8); /* 16 -> at least 4096 slots */
  CHECK(max_cap >= 4096);
  CHECK_EQ_U(map_violations(&m), 0);
  /* Remove everything left; absent keys return NULL. */
  for (size_t i = 0; i < U; i++) {
    CHECK(cp_ptrmap_remove(&m, keys[i]) == (in[i] ? value_of(i) : NULL));
    in[i] = 0;
  }
  CHECK_EQ_U(m.count, 0);
  for (size_t i = 0; i <= m.mask; i++) CHECK(m.slots[i].value == NULL);
  cp_ptrmap_destroy(&m);
  free(keys);
  free(in);
}

/* Growth keeps every entry: insert many keys into the smallest map, check all of them at
 * every doubling. */
TEST(growth_keeps_entries) {
  enum { N = 5000 };
  cp_ptrmap_t m;
  REQUIRE(cp_ptrmap_init(&m, 0) == CP_OK);
  size_t cap = m.mask + 1;
  for (size_t i = 0; i < N; i++) {
    CHECK(cp_ptrmap_insert(&m, (uintptr_t)i * 512, value_of(i)) == CP_OK); /* key 0 first */
    CHECK(m.count * 2 <= m.mask + 1);
    if (m.mask + 1 != cap) {
      CHECK_EQ_U(m.mask + 1, cap * 2);
      cap = m.mask + 1;
      for (size_t j = 0; j <= i; j++) CHECK(cp_ptrmap_get(&m, (uintptr_t)j * 512) == value_of(j));
      CHECK_EQ_U(map_violations(&m), 0);
    }
  }
  CHECK_EQ_U(m.count, N);
  CHECK_EQ_U(cap, 16384); /* 5000 keys at load <= 1/2 */
  cp_ptrmap_destroy(&m);
}

/* reserve makes room now: the inserts that follow do not move the table. */
TEST(reserve_then_insert) {
  cp_ptrmap_t m;
  REQUIRE(cp_ptrmap_init(&m, 0) == CP_OK);
  for (size_t i = 0; i < 5; i++) CHECK(cp_ptrmap_insert(&m, 512 * i + 512, value_of(i)) == CP_OK);
  CHECK(cp_ptrmap_reserve(&m, 0) == CP_OK);
  CHECK_EQ_U(m.mask + 1, 16);
  CHECK(cp_ptrmap_reserve(&m, 3) == CP_OK); /* 8 <= 16 / 2: already room */
  CHECK_EQ_U(m.mask + 1, 16);
  CHECK(cp_ptrmap_reserve(&m, 1000) == CP_OK);
  CHECK_EQ_U(m.mask + 1, 2048);                                                          /* 1005 keys need 2010 slots */
  for (size_t i = 0; i < 5; i++) CHECK(cp_ptrmap_get(&m, 512 * i + 512) == value_of(i)); /* rehashed */
  cp_ptrmap_slot_t *slots = m.slots;
  for (size_t i = 5; i < 1005; i++) CHECK(cp_ptrmap_insert(&m, 512 * i + 512, value_of(i)) == CP_OK);
  CHECK(m.slots == slots); /* no growth happened */
  CHECK_EQ_U(m.mask + 1, 2048);
  CHECK_EQ_U(m.count, 1005);
  CHECK_EQ_U(map_violations(&m), 0);
  /* Past the reserved room the map grows as usual: 1024 keys fit 2048 slots, 1025 do not. */
  for (size_t i = 1005; i < 1024; i++) CHECK(cp_ptrmap_insert(&m, 512 * i + 512, value_of(i)) == CP_OK);
  CHECK_EQ_U(m.mask + 1, 2048);
  CHECK(cp_ptrmap_insert(&m, 1, value_of(9999)) == CP_OK);
  CHECK_EQ_U(m.mask + 1, 4096);
  for (size_t i = 0; i < 1024; i++) CHECK(cp_ptrmap_get(&m, 512 * i + 512) == value_of(i));
  CHECK(cp_ptrmap_get(&m, 1) == value_of(9999));
  CHECK_EQ_U(map_violations(&m), 0);

  /* reserve(1) before each insert, as the pool does: the table moves only in reserve. */
  cp_ptrmap_t p;
  REQUIRE(cp_ptrmap_init(&p, 0) == CP_OK);
  for (size_t i = 0; i < 3000; i++) {
    CHECK(cp_ptrmap_reserve(&p, 1) == CP_OK);
    slots = p.slots;
    CHECK(cp_ptrmap_insert(&p, (uintptr_t)rng_next() | 1, value_of(i)) == CP_OK);
    CHECK(p.slots == slots);
  }
  CHECK_EQ_U(map_violations(&p), 0);
  cp_ptrmap_destroy(&p);
  cp_ptrmap_destroy(&m);
}

/* A reserve that cannot be honoured must say so; here `count + extra` doubled wraps around
 * SIZE_MAX, and no table of that size exists. */
TEST(reserve_overflow_is_an_error) {
  cp_ptrmap_t m;
  REQUIRE(cp_ptrmap_init(&m, 0) == CP_OK);
  int rc = cp_ptrmap_reserve(&m, SIZE_MAX / 2 + 1); /* (count + extra) * 2 == 0 after wrapping */
  CHECK(rc != CP_OK);
  CHECK_EQ_U(m.mask + 1, 16); /* unchanged either way */
  CHECK(cp_ptrmap_insert(&m, 512, value_of(1)) == CP_OK);
  CHECK(cp_ptrmap_get(&m, 512) == value_of(1));
  cp_ptrmap_destroy(&m);
}

int main(void) {
  RUN(init_capacity_and_empty_map);
  RUN(key_zero_and_extremes);
  RUN(colliding_keys_and_backward_shift);
  RUN(interleaved_runs_wrapping);
  RUN(random_against_reference);
  RUN(growth_keeps_entries);
  RUN(reserve_then_insert);
  RUN(reserve_overflow_is_an_error);
  return check_summary("test_ptrmap");
}
