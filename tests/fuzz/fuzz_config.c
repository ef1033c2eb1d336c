/* fuzz_config.c — libFuzzer harness for the configuration parser. The input, cut at its first
 * NUL, is parsed on top of the defaults and on top of a configuration that differs from the
 * defaults in every key. Either way:
 *   - on failure the configuration is bitwise unchanged and the last error says why;
 *   - on success the result validates, cp_config_format writes it out in a form that parses
 *     back (on the defaults) to the very same configuration and formats to the same text,
 *     the formatted length does not depend on the buffer, a short buffer gets a prefix, and
 *     cp_round_size under it is monotonic, never below the request, a multiple of the
 *     granule, idempotent, and reports overflow (0) only at the top of the size range. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/cp.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define FZ_ASSERT(cond, ...)                                                                      \
  do {                                                                                            \
    if (!(cond)) {                                                                                \
      fprintf(stderr, "fuzz_config: %s:%d: assertion failed: %s\n  ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                                               \
      fprintf(stderr, "\n  last error: %s\n", cp_last_error());                                   \
      abort();                                                                                    \
    }                                                                                             \
  } while (0)

/* Field by field (the struct has padding, which assignment need not copy). */
static int config_equal(const cp_config_t *a, const cp_config_t *b) {
  return a->granule == b->granule && a->small_size == b->small_size && a->small_segment == b->small_segment &&
         a->large_segment == b->large_segment && a->min_large_alloc == b->min_large_alloc &&
         a->round_large == b->round_large && a->max_split_size == b->max_split_size &&
         a->max_non_split_rounding == b->max_non_split_rounding &&
         memcmp(a->roundup_power2_divisions, b->roundup_power2_divisions, sizeof a->roundup_power2_divisions) == 0 &&
         memcmp(&a->garbage_collection_threshold, &b->garbage_collection_threshold, sizeof(double)) == 0 &&
         a->release_before_grow == b->release_before_grow && a->memory_cap == b->memory_cap &&
         memcmp(&a->memory_fraction, &b->memory_fraction, sizeof(double)) == 0;
}

/* A heap copy of cp_config_format's output. */
static char *format_alloc(const cp_config_t *cfg) {
  int n = cp_config_format(cfg, NULL, 0);
  FZ_ASSERT(n > 0, "cp_config_format gave %d", n);
  char *buf = malloc((size_t)n + 1);
  FZ_ASSERT(buf != NULL, "no host memory");
  int n2 = cp_config_format(cfg, buf, (size_t)n + 1);
  FZ_ASSERT(n2 == n && strlen(buf) == (size_t)n, "format length %d, then %d (strlen %zu)", n, n2, strlen(buf));
  /* A short buffer gets a NUL-terminated prefix and the same answer. */
  char small[17];
  int n3 = cp_config_format(cfg, small, sizeof small);
  FZ_ASSERT(n3 == n, "format into 17 bytes answered %d, not %d", n3, n);
  FZ_ASSERT(strlen(small) == (n < 16 ? (size_t)n : 16) && strncmp(small, buf, strlen(small)) == 0,
            "format into 17 bytes: '%s' is not a prefix of '%s'", small, buf);
  return buf;
}

static uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

static int cmp_size(const void *a, const void *b) {
  size_t x = *(const size_t *)a, y = *(const size_t *)b;
  return x < y ? -1 : x > y;
}

/* cp_round_size is a sound rounding rule under `cfg`. */
static void check_rounding(const cp_config_t *cfg, uint64_t seed) {
  const size_t g = cfg->granule;
  const size_t M = (size_t)1 << 20;
  size_t sizes[64];
  size_t n = 0;
  const size_t fixed[] = {1,
                          g - 1,
                          g,
                          g + 1,
                          3 * g + 7,
                          M - 1,
                          M,
                          M + 1,
                          3 * M + 1,
                          cfg->small_size,
                          cfg->small_size + 1,
                          cfg->min_large_alloc - 1,
                          cfg->min_large_alloc,
                          (size_t)1 << 30,
                          ((size_t)1 << 30) + 1,
                          ((size_t)1 << 34) + 12345,
                          ((size_t)1 << 40) + 3,
                          SIZE_MAX / 4,
                          SIZE_MAX / 2,
                          SIZE_MAX / 2 + 1,
                          SIZE_MAX / 2 + 2,
                          SIZE_MAX - 3 * g,
                          SIZE_MAX - g,
                          SIZE_MAX - g + 1,
                          SIZE_MAX - 1,
                          SIZE_MAX};
  for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++) sizes[n++] = fixed[i];
  /* A few more, from the input: at every scale. */
  while (n < sizeof sizes / sizeof sizes[0]) {
    seed = mix64(seed + 0x9e3779b97f4a7c15ull);
    size_t s = (size_t)seed >> (seed % 64);
    sizes[n++] = s == 0 ? 1 : s;
  }
  qsort(sizes, n, sizeof sizes[0], cmp_size);
  FZ_ASSERT(cp_round_size(cfg, 0) == 0, "round(0) = %zu", cp_round_size(cfg, 0));
  size_t prev_in = 0, prev_out = 0;
  int overflowed = 0;
  for (size_t i = 0; i < n; i++) {
    size_t s = sizes[i];
    size_t r = cp_round_size(cfg, s);
    if (r == 0) { /* too large to round: so is everything above */
      overflowed = 1;
      FZ_ASSERT(s > SIZE_MAX / 2, "round(%zu) overflowed", s);
      continue;
    }
    FZ_ASSERT(!overflowed, "round(%zu) = %zu after a smaller size overflowed", s, r);
    FZ_ASSERT(r >= s, "round(%zu) = %zu is below the request", s, r);
    FZ_ASSERT(r % g == 0, "round(%zu) = %zu is not a multiple of the granule %zu", s, r, g);
    FZ_ASSERT(prev_in == 0 || r >= prev_out, "round(%zu) = %zu but round(%zu) = %zu", prev_in, prev_out, s, r);
    FZ_ASSERT(cp_round_size(cfg, r) == r, "round(%zu) = %zu, which rounds again to %zu", s, r, cp_round_size(cfg, r));
    /* Never more than doubles (plus one granule for sizes below one). */
    FZ_ASSERT(r - s <= s + g, "round(%zu) = %zu rounds up too far", s, r);
    prev_in = s;
    prev_out = r;
  }
}

/* Parse `text` on top of `base`; check whatever happens. */
static void parse_on(const cp_config_t *base, const char *text, uint64_t seed) {
  cp_config_t cfg = *base;
  unsigned char before[sizeof cfg];
  memcpy(before, &cfg, sizeof cfg);
  cp_clear_error();
  int rc = cp_config_parse(&cfg, text);
  if (rc != CP_OK) {
    FZ_ASSERT(rc == CP_ERR_INVALID, "parse failed with %s", cp_status_name(rc));
    FZ_ASSERT(memcmp(before, &cfg, sizeof cfg) == 0, "a failed parse changed the configuration");
    FZ_ASSERT(cp_last_error()[0] != '\0', "a failed parse left no message");
    return;
  }
  FZ_ASSERT(cp_config_validate(&cfg) == CP_OK, "parse accepted an invalid configuration");

  /* Round trip through the text form. */
  char *text1 = format_alloc(&cfg);
  cp_config_t again;
  cp_config_default(&again);
  cp_clear_error();
  rc = cp_config_parse(&again, text1);
  FZ_ASSERT(rc == CP_OK, "the formatted configuration '%s' does not parse", text1);
  FZ_ASSERT(config_equal(&cfg, &again), "'%s' parses to a different configuration", text1);
  char *text2 = format_alloc(&again);
  FZ_ASSERT(strcmp(text1, text2) == 0, "formatting is not stable: '%s' then '%s'", text1, text2);
  free(text1);
  free(text2);

  check_rounding(&cfg, seed);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char *text = malloc(size + 1);
  if (text == NULL) return 0;
  if (size > 0) memcpy(text, data, size);
  text[size] = '\0';
  uint64_t seed = 0x243f6a8885a308d3ull;
  for (size_t i = 0; i < size; i++) seed = mix64(seed ^ data[i]);

  cp_config_t defaults;
  cp_config_default(&defaults);
  check_rounding(&defaults, seed);
  parse_on(&defaults, text, seed);

  /* A configuration that differs from the defaults in every key. */
  cp_config_t base;
  cp_config_default(&base);
  const char *base_text =
      "granule_bytes:1024,small_size_mb:0.5,small_segment_mb:4,large_segment_mb:32,min_large_alloc_mb:8,"
      "round_large_mb:4,max_split_size_mb:64,max_non_split_rounding_mb:8,"
      "roundup_power2_divisions:[1:2,64:4,>:8],garbage_collection_threshold:0.25,release_before_grow:True,"
      "memory_cap_mb:4096,memory_fraction:0.5";
  FZ_ASSERT(cp_config_parse(&base, base_text) == CP_OK, "the base configuration is refused");
  parse_on(&base, text, seed);

  free(text);
  return 0;
}
