/* ptrmap.c — the one hash table (ptrmap.h): uintptr_t keys to non-NULL values.
 * Owns: open addressing with linear probing and backward-shift deletion (no tombstones). */
#include "base/ptrmap.h"

#include <stdbool.h>
#include <stdlib.h>

#include "base/status.h"

static inline size_t cp_ptrmap_hash(uintptr_t key) {
  /* Block addresses are multiples of 512, so their low bits say nothing: mix every bit. */
  uint64_t x = (uint64_t)key;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return (size_t)x;
}

int cp_ptrmap_init(cp_ptrmap_t *m, size_t initial_capacity) {
  size_t cap = 16;
  while (cap < initial_capacity) cap <<= 1;
  m->slots = calloc(cap, sizeof *m->slots);
  if (m->slots == NULL) {
    return cp_set_error(CP_ERR_HOST_OOM, "ptrmap: no host memory for %zu slots", cap);
  }
  m->mask = cap - 1;
  m->count = 0;
  return CP_OK;
}

void cp_ptrmap_destroy(cp_ptrmap_t *m) {
  free(m->slots);
  m->slots = NULL;
  m->mask = 0;
  m->count = 0;
}

void *cp_ptrmap_get(const cp_ptrmap_t *m, uintptr_t key) {
  size_t i = cp_ptrmap_hash(key) & m->mask;
  for (;;) {
    const cp_ptrmap_slot_t *s = &m->slots[i];
    if (s->value == NULL) return NULL;
    if (s->key == key) return s->value;
    i = (i + 1) & m->mask;
  }
}

/* Place a key known to be absent into a table with room. */
static void cp_ptrmap_place(cp_ptrmap_slot_t *slots, size_t mask, uintptr_t key, void *value) {
  size_t i = cp_ptrmap_hash(key) & mask;
  while (slots[i].value != NULL) i = (i + 1) & mask;
  slots[i].key = key;
  slots[i].value = value;
}

static int cp_ptrmap_resize(cp_ptrmap_t *m, size_t new_cap) {
  cp_ptrmap_slot_t *slots = calloc(new_cap, sizeof *slots);
  if (slots == NULL) {
    return cp_set_error(CP_ERR_HOST_OOM, "ptrmap: no host memory to grow to %zu slots", new_cap);
  }
  for (size_t i = 0; i <= m->mask; i++) {
    if (m->slots[i].value != NULL) cp_ptrmap_place(slots, new_cap - 1, m->slots[i].key, m->slots[i].value);
  }
  free(m->slots);
  m->slots = slots;
  m->mask = new_cap - 1;
  return CP_OK;
}

int cp_ptrmap_reserve(cp_ptrmap_t *m, size_t extra) {
  const size_t max_cap = (SIZE_MAX / 2 + 1) / sizeof(cp_ptrmap_slot_t); /* a power of two */
  if (extra > max_cap / 2 - m->count) {
    return cp_set_error(CP_ERR_HOST_OOM, "ptrmap: room for %zu more keys is beyond any host memory", extra);
  }
  size_t cap = m->mask + 1;
  size_t need = m->count + extra;
  if (need * 2 <= cap) return CP_OK;
  while (need * 2 > cap) cap <<= 1;
  return cp_ptrmap_resize(m, cap);
}

int cp_ptrmap_insert(cp_ptrmap_t *m, uintptr_t key, void *value) {
  if ((m->count + 1) * 2 > m->mask + 1) {
    int rc = cp_ptrmap_resize(m, (m->mask + 1) * 2);
    if (rc != CP_OK) return rc;
  }
  cp_ptrmap_place(m->slots, m->mask, key, value);
  m->count++;
  return CP_OK;
}

void *cp_ptrmap_remove(cp_ptrmap_t *m, uintptr_t key) {
  size_t i = cp_ptrmap_hash(key) & m->mask;
  for (;;) {
    if (m->slots[i].value == NULL) return NULL;
    if (m->slots[i].key == key) break;
    i = (i + 1) & m->mask;
  }
  void *value = m->slots[i].value;
  /* Backward shift: pull later entries of the probe run into the hole when their home
   * slot does not lie cyclically in (hole, j]. */
  size_t hole = i;
  size_t j = i;
  for (;;) {
    j = (j + 1) & m->mask;
    if (m->slots[j].value == NULL) break;
    size_t home = cp_ptrmap_hash(m->slots[j].key) & m->mask;
    bool home_in_range = (hole <= j) ? (home > hole && home <= j) : (home > hole || home <= j);
    if (!home_in_range) {
      m->slots[hole] = m->slots[j];
      hole = j;
    }
  }
  m->slots[hole].value = NULL;
  m->slots[hole].key = 0;
  m->count--;
  return value;
}

void cp_ptrmap_each(const cp_ptrmap_t *m, void (*fn)(uintptr_t key, void *value, void *arg), void *arg) {
  if (m->slots == NULL) return;
  for (size_t i = 0; i <= m->mask; i++) {
    if (m->slots[i].value != NULL) fn(m->slots[i].key, m->slots[i].value, arg);
  }
}
