/* sizes.h — the size policy, in one place: how a request is rounded, which pool (small or
 * large) serves it, how large a new segment is, when a free block fits and when it is split.
 * Owns: every rule that turns a byte count into a block or segment size. Defaults equal the
 * built-in allocator's (cp_config_default); every constant is a configuration key. */
#ifndef CP_SIZES_H
#define CP_SIZES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/cp.h"

#define CP_MIB_SHIFT 20u
#define CP_MIB       ((size_t)1 << CP_MIB_SHIFT)

static inline bool cp_is_pow2(size_t x) { return x != 0 && (x & (x - 1)) == 0; }

/* floor(log2(x)) for x > 0, without builtins. */
static inline unsigned cp_floor_log2(size_t x) {
  unsigned r = 0;
  while (x >>= 1) r++;
  return r;
}

/* The rounding rule of the built-in allocator (cp_round_size is its exported name):
 *   - 0 stays 0; below one granule: one granule.
 *   - With d = the divisions of the size's interval (interval = ceil(log2(size / 1 MiB)),
 *     clamped to [0, CP_ROUNDUP_INTERVALS - 1]): when d > 1 and size > granule * d, the range
 *     [2^k, 2^(k+1)) holding the size is cut into d equal steps and the size goes up to the
 *     next step (a power of two stays as it is). Since 2^k >= granule * d there, a step is a
 *     multiple of the granule.
 *   - Otherwise: up to the next multiple of the granule.
 * A size whose rounded value would not fit in size_t gives 0: callers treat 0 for a nonzero
 * request as "too large". `cfg` must be valid (cp_config_validate). */
static inline size_t cp_size_round(const cp_config_t *cfg, size_t size) {
  if (size == 0) return 0;
  const size_t g = cfg->granule;
  if (g == 0 || !cp_is_pow2(g)) return 0; /* invalid configuration: refuse rather than divide by 0 */
  if (size < g) return g;

  unsigned idx = 0;
  if (size > CP_MIB) {
    /* ceil(log2(size)) - 20: size - 1 has floor(log2) = ceil(log2(size)) - 1 for size > 1. */
    idx = cp_floor_log2(size - 1) + 1 - CP_MIB_SHIFT;
    if (idx > CP_ROUNDUP_INTERVALS - 1) idx = CP_ROUNDUP_INTERVALS - 1;
  }
  size_t d = cfg->roundup_power2_divisions[idx];
  /* size > g * d, without overflowing g * d (if it overflows, it exceeds any size). */
  if (d > 1 && d <= SIZE_MAX / g && size > g * d) {
    if (cp_is_pow2(size)) return size;
    size_t floor2 = (size_t)1 << cp_floor_log2(size);
    size_t step = floor2 >> cp_floor_log2(d);
    if (step == 0) { /* unreachable for a valid config (floor2 >= g * d); as PyTorch does */
      return floor2 > SIZE_MAX / 2 ? 0 : floor2 * 2;
    }
    if (size > SIZE_MAX - (step - 1)) return 0;
    return (size + step - 1) & ~(step - 1);
  }
  if (size > SIZE_MAX - (g - 1)) return 0;
  return (size + g - 1) & ~(g - 1);
}

/* The pool a rounded request is served from. */
static inline int cp_size_kind(const cp_config_t *cfg, size_t size) {
  return size <= cfg->small_size ? CP_KIND_SMALL : CP_KIND_LARGE;
}

/* Bytes to reserve for a new segment serving a rounded request; 0 when it overflows. Small
 * requests share small_segment; large ones below min_large_alloc share large_segment; from
 * there on a segment serves one request, rounded up to round_large. */
static inline size_t cp_size_segment(const cp_config_t *cfg, size_t size) {
  if (size <= cfg->small_size) return cfg->small_segment;
  if (size < cfg->min_large_alloc) return cfg->large_segment;
  size_t r = cfg->round_large;
  if (size > SIZE_MAX - (r - 1)) return 0;
  return (size + r - 1) / r * r;
}

/* The built-in allocator's two oversize rules for reusing a free block of `block_size` for a
 * request of `size` (block_size >= size): a request below max_split_size never takes an
 * oversize block, and an oversize request takes a block at most max_non_split_rounding
 * larger than itself. */
static inline bool cp_size_fits(const cp_config_t *cfg, size_t size, size_t block_size) {
  if (size < cfg->max_split_size && block_size >= cfg->max_split_size) return false;
  if (size >= cfg->max_split_size && block_size - size >= cfg->max_non_split_rounding) return false;
  return true;
}

/* Split rule: the small pool keeps any remainder of at least one granule; the large pool
 * keeps a remainder only above small_size, and never splits for requests of max_split_size
 * or more (those blocks stay whole so that big holes are not nibbled away). */
static inline bool cp_size_should_split(const cp_config_t *cfg, int kind, size_t size, size_t remaining) {
  if (kind == CP_KIND_SMALL) return remaining >= cfg->granule;
  return size < cfg->max_split_size && remaining > cfg->small_size;
}

#endif /* CP_SIZES_H */
