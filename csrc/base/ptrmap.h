/* ptrmap.h — the one hash table of the library: uintptr_t keys to non-NULL void* values.
 * Owns: open addressing with linear probing and backward-shift deletion, load <= 1/2. The
 * pool keeps live blocks (address -> block) and streams (handle -> state) in it; the
 * simulated device keeps its reservations, streams and events in it. Any key value is
 * allowed; an empty slot has value NULL. Not thread-safe: the owner's lock guards it. */
#ifndef CP_PTRMAP_H
#define CP_PTRMAP_H

#include <stddef.h>
#include <stdint.h>

typedef struct cp_ptrmap_slot_s {
  uintptr_t key;
  void *value;
} cp_ptrmap_slot_t;

/* Invariants: mask + 1 is a power of two >= 16 once initialised; 2 * count <= mask + 1, so
 * every probe run ends at an empty slot; every entry sits in the probe run that starts at its
 * home slot with no empty slot between the two (what backward-shift deletion keeps true). */
typedef struct cp_ptrmap_s {
  cp_ptrmap_slot_t *slots;
  size_t mask; /* capacity - 1 */
  size_t count;
} cp_ptrmap_t;

int cp_ptrmap_init(cp_ptrmap_t *m, size_t initial_capacity); /* CP_ERR_HOST_OOM on failure */
void cp_ptrmap_destroy(cp_ptrmap_t *m);
void *cp_ptrmap_get(const cp_ptrmap_t *m, uintptr_t key);
/* Insert a key that is not present. Grows as needed: CP_ERR_HOST_OOM leaves m unchanged. */
int cp_ptrmap_insert(cp_ptrmap_t *m, uintptr_t key, void *value);
/* Remove and return the value, NULL when absent. */
void *cp_ptrmap_remove(cp_ptrmap_t *m, uintptr_t key);
/* Make room for `extra` more keys now, so that the next inserts cannot fail. */
int cp_ptrmap_reserve(cp_ptrmap_t *m, size_t extra);
/* Call fn(key, value, arg) on every entry, in slot order. fn must not change the map. */
void cp_ptrmap_each(const cp_ptrmap_t *m, void (*fn)(uintptr_t key, void *value, void *arg), void *arg);

#endif /* CP_PTRMAP_H */
