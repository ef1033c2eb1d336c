/* config.c — the allocator configuration: defaults, the CUDAPOOL_CONF / PYTORCH_CUDA_ALLOC_CONF
 * parser, validation and formatting. The rules the sizes feed are in core/sizes.h. */
#include <float.h>
#include <limits.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/cp.h"
#include "core/sizes.h"

/* ==========================================================================================
 * Notes on the syntax and the choices made here
 *
 *   text   := entry { ',' entry }           (NULL, "" or only whitespace: no-op)
 *   entry  := key ':' value                 (whitespace around key and value is ignored)
 *
 * Commas inside [...] belong to the value (roundup_power2_divisions), not to the outer list.
 * An empty entry (",," or a trailing ',') is an error, as is a key given twice.
 *
 * Numbers are plain decimals: DIGITS [ '.' DIGITS ]. No sign, no "inf"/"nan", no hex, no
 * exponent — except for the two fraction keys (garbage_collection_threshold, memory_fraction),
 * which also take an exponent (DIGITS [ '.' DIGITS ] [ e [+-] DIGITS ]) so that every double
 * that cp_config_format writes reads back exactly.
 *
 * Sizes in MiB (the *_mb keys) are converted to bytes exactly, with integer arithmetic: a
 * decimal is accepted when value * 2^20 is a whole number (0.5 -> 524288; 0.1 is refused) and
 * fits in size_t. granule_bytes takes bytes and follows the same rule with a scale of 1.
 *
 * max_split_size_mb also accepts "unlimited" (SIZE_MAX, the default); cp_config_format
 * writes that word for an unlimited configuration.
 *
 * garbage_collection_threshold and memory_fraction refuse 0 (as PyTorch refuses a zero
 * threshold); their "off" value 0 is therefore not written by cp_config_format, which omits
 * the key instead. Everything else is always written. So parse(format(cfg)) applied to the
 * defaults gives back cfg, and applied to any configuration whose threshold and fraction are
 * both off it gives back cfg too.
 *
 * roundup_power2_divisions (interval i covers sizes up to 2^i MiB; interval 0 everything up to
 * 1 MiB; the last one everything above 2^(CP_ROUNDUP_INTERVALS-2) MiB):
 *   N                      every interval gets N (0 or a power of two; 0 and 1 mean "off").
 *   [K1:N1,K2:N2,...,>:M]  Ki are sizes in MiB, powers of two from 1 to
 *                          2^(CP_ROUNDUP_INTERVALS-1), strictly increasing; Ki maps to
 *                          interval log2(Ki). An entry Ki:Ni covers every interval above the
 *                          previous key up to and including its own ("256:1" = sizes up to
 *                          256 MiB not claimed by an earlier entry; the first entry reaches
 *                          down to interval 0). ">:M", which must come last, covers every
 *                          interval above the last key. Without ">", the intervals above the
 *                          last key take the last entry's value. "[>:M]" alone equals "M".
 *   Either form replaces all CP_ROUNDUP_INTERVALS values, so the result never depends on what
 *   was configured before.
 * ========================================================================================== */

#define MIB_SHIFT   CP_MIB_SHIFT
#define MIB         CP_MIB
#define CONF_PREFIX "CUDAPOOL_CONF: "

/* The largest division count accepted (a power of two that fits in `unsigned`). */
#define MAX_DIVISIONS (1u << 31)

/* ------------------------------------------------------------------------------------------
 * Small helpers
 * ---------------------------------------------------------------------------------------- */

/* A piece of the input text: not NUL-terminated. */
typedef struct span_s {
  const char *p;
  size_t n;
} span_t;

static int is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }
static int is_digit(char c) { return c >= '0' && c <= '9'; }

static span_t span_trim(span_t s) {
  while (s.n > 0 && is_space(s.p[0])) {
    s.p++;
    s.n--;
  }
  while (s.n > 0 && is_space(s.p[s.n - 1])) s.n--;
  return s;
}

static int span_eq(span_t s, const char *lit) {
  size_t n = strlen(lit);
  return s.n == n && memcmp(s.p, lit, n) == 0;
}

/* Printing a span in an error message: "%.*s", SPAN_ARG(s). Very long input is cut short by
 * the error buffer itself. */
#define SPAN_ARG(s) (int)((s).n > INT_MAX ? INT_MAX : (s).n), (s).p

/* Write `bytes` as an exact decimal number of MiB ("20", "0.5", "0.00048828125"). Any byte
 * count has an exact decimal expansion in MiB with at most 20 fractional digits. `out` must
 * hold at least 48 characters. */
static void format_mib(size_t bytes, char *out, size_t out_size) {
  size_t whole = bytes >> MIB_SHIFT;
  uint32_t rem = (uint32_t)(bytes & (MIB - 1));
  int n = snprintf(out, out_size, "%zu", whole);
  if (n < 0 || (size_t)n >= out_size) return;
  size_t pos = (size_t)n;
  if (rem != 0 && pos + 1 < out_size) out[pos++] = '.';
  /* Long multiplication of the fraction rem / 2^20 by 10, one digit at a time. rem * 10 stays
   * below 10 * 2^20, so nothing overflows; the loop ends after at most 20 digits. */
  while (rem != 0 && pos + 1 < out_size) {
    rem *= 10u;
    out[pos++] = (char)('0' + (rem >> MIB_SHIFT));
    rem &= (uint32_t)(MIB - 1);
  }
  out[pos] = '\0';
}

/* ------------------------------------------------------------------------------------------
 * Number parsing
 * ---------------------------------------------------------------------------------------- */

typedef enum num_status_e {
  NUM_OK = 0,
  NUM_SYNTAX,   /* not a plain decimal number */
  NUM_NEGATIVE, /* a leading '-' */
  NUM_OVERFLOW, /* too large for the destination */
  NUM_FRACTION  /* not a whole number of bytes */
} num_status_t;

/* Parse an unsigned decimal DIGITS [ '.' DIGITS ] and scale it by 2^shift (shift <= 20),
 * exactly: the result must be a whole number that fits in size_t. */
static num_status_t parse_scaled(span_t s, unsigned shift, size_t *out) {
  if (s.n > 0 && s.p[0] == '-') return NUM_NEGATIVE;
  size_t i = 0;
  size_t int_begin = 0;
  while (i < s.n && is_digit(s.p[i])) i++;
  size_t int_end = i;
  size_t frac_begin = i, frac_end = i;
  if (i < s.n && s.p[i] == '.') {
    frac_begin = ++i;
    while (i < s.n && is_digit(s.p[i])) i++;
    frac_end = i;
    if (frac_end == frac_begin) return NUM_SYNTAX; /* "5." */
  }
  if (int_end == int_begin || i != s.n) return NUM_SYNTAX; /* ".5", "", trailing garbage */

  /* Whole part: must not exceed SIZE_MAX >> shift. */
  size_t whole = 0;
  const size_t whole_max = SIZE_MAX >> shift;
  for (size_t k = int_begin; k < int_end; k++) {
    size_t d = (size_t)(s.p[k] - '0');
    if (whole > (whole_max - d) / 10) return NUM_OVERFLOW;
    whole = whole * 10 + d;
  }

  /* Fraction F / 10^k (trailing zeros dropped, so F is not a multiple of 10). Scaled by 2^shift
   * it is F * 2^shift / (2^k * 5^k). For k > shift that needs F divisible by both 2 and 5,
   * which it is not, so the byte count cannot be whole. For k <= shift (<= 20) the result is
   * (F / 5^k) * 2^(shift - k), whole exactly when 5^k divides F. F can have 20 digits, which
   * may not fit in 64 bits, so divide by 5^k digit by digit (long division): the remainder
   * stays below 5^20 < 2^47, and the quotient below 2^k <= 2^20. */
  while (frac_end > frac_begin && s.p[frac_end - 1] == '0') frac_end--;
  size_t k = frac_end - frac_begin;
  size_t frac_bytes = 0;
  if (k > 0) {
    if (k > shift) return NUM_FRACTION;
    uint64_t pow5 = 1;
    for (size_t j = 0; j < k; j++) pow5 *= 5u;
    uint64_t quot = 0, rem = 0;
    for (size_t j = frac_begin; j < frac_end; j++) {
      uint64_t cur = rem * 10u + (uint64_t)(s.p[j] - '0');
      quot = quot * 10u + cur / pow5;
      rem = cur % pow5;
    }
    if (rem != 0) return NUM_FRACTION;
    frac_bytes = (size_t)quot << (shift - k); /* < 2^shift */
  }
  /* whole <= SIZE_MAX >> shift and frac_bytes < 2^shift: the sum cannot overflow. */
  *out = (whole << shift) + frac_bytes;
  return NUM_OK;
}

/* Parse plain unsigned digits, at most `max`. */
static num_status_t parse_uint(span_t s, uint64_t max, uint64_t *out) {
  if (s.n > 0 && s.p[0] == '-') return NUM_NEGATIVE;
  if (s.n == 0) return NUM_SYNTAX;
  uint64_t v = 0;
  for (size_t i = 0; i < s.n; i++) {
    if (!is_digit(s.p[i])) return NUM_SYNTAX;
    uint64_t d = (uint64_t)(s.p[i] - '0');
    if (v > (max - d) / 10) return NUM_OVERFLOW;
    v = v * 10 + d;
  }
  *out = v;
  return NUM_OK;
}

/* Parse DIGITS [ '.' DIGITS ] [ (e|E) [+-] DIGITS ] as a double (strtod, "C" locale). The
 * syntax is checked first, so strtod never sees "inf", "nan", hex or a sign. */
static num_status_t parse_double(span_t s, double *out) {
  if (s.n > 0 && s.p[0] == '-') return NUM_NEGATIVE;
  size_t i = 0, start;
  start = i;
  while (i < s.n && is_digit(s.p[i])) i++;
  if (i == start) return NUM_SYNTAX;
  if (i < s.n && s.p[i] == '.') {
    start = ++i;
    while (i < s.n && is_digit(s.p[i])) i++;
    if (i == start) return NUM_SYNTAX;
  }
  if (i < s.n && (s.p[i] == 'e' || s.p[i] == 'E')) {
    i++;
    if (i < s.n && (s.p[i] == '+' || s.p[i] == '-')) i++;
    start = i;
    while (i < s.n && is_digit(s.p[i])) i++;
    if (i == start) return NUM_SYNTAX;
  }
  if (i != s.n) return NUM_SYNTAX;
  char buf[128];
  if (s.n >= sizeof buf) return NUM_SYNTAX; /* no sensible fraction needs this many digits */
  memcpy(buf, s.p, s.n);
  buf[s.n] = '\0';
  *out = strtod(buf, NULL); /* overflow gives HUGE_VAL, which the range checks refuse */
  return NUM_OK;
}

/* ------------------------------------------------------------------------------------------
 * Keys
 * ---------------------------------------------------------------------------------------- */

typedef enum key_id_e {
#define CP_X(id, name, kind, field, def, doc) KEY_##id,
  CP_CONFIG_KEYS(CP_X)
#undef CP_X
      KEY_COUNT
} key_id_t;

typedef enum key_kind_e {
  KIND_BYTES,
  KIND_MIB,
  KIND_MIB_GRANULAR,
  KIND_MIB_OR_UNLIMITED,
  KIND_DIVISIONS,
  KIND_FRACTION_OPEN,
  KIND_FRACTION,
  KIND_BOOL
} key_kind_t;

/* What parsing, validation and formatting need of a row: its kind and where its field is. */
typedef struct key_desc_s {
  const char *name;
  const char *field_name; /* the field, as validation messages name it */
  key_kind_t kind;
  size_t offset; /* of the field in cp_config_t */
} key_desc_t;

static const key_desc_t keys[KEY_COUNT] = {
#define CP_X(id, name, kind, field, def, doc) {name, #field, KIND_##kind, offsetof(cp_config_t, field)},
    CP_CONFIG_KEYS(CP_X)
#undef CP_X
};

const cp_config_key_t cp_config_keys[KEY_COUNT] = {
#define CP_X(id, name, kind, field, def, doc) {name, def, doc},
    CP_CONFIG_KEYS(CP_X)
#undef CP_X
};
const size_t cp_config_key_count = KEY_COUNT;

/* The field of `key` in `cfg`, typed by the caller from the key's kind. */
#define KEY_FIELD(cfg, key, type)   ((type *)(void *)((char *)(cfg) + keys[key].offset))
#define KEY_FIELD_C(cfg, key, type) ((const type *)(const void *)((const char *)(cfg) + keys[key].offset))

static int is_true(span_t v) { return span_eq(v, "True") || span_eq(v, "true") || span_eq(v, "1"); }
static int is_false(span_t v) { return span_eq(v, "False") || span_eq(v, "false") || span_eq(v, "0"); }

/* Set the "bad value" error for `key`/`value` with a reason. */
static int bad_value(key_id_t key, span_t value, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

static int bad_value(key_id_t key, span_t value, const char *fmt, ...) {
  char reason[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(reason, sizeof reason, fmt, ap);
  va_end(ap);
  return cp_set_error(CP_ERR_INVALID, CONF_PREFIX "bad value '%.*s' for %s: %s", SPAN_ARG(value), keys[key].name,
                      reason);
}

/* A size key: `shift` 20 for MiB, 0 for bytes. */
static int apply_size(key_id_t key, span_t value, unsigned shift, size_t *field) {
  size_t bytes = 0;
  const char *unit = shift == MIB_SHIFT ? "MiB" : "bytes";
  switch (parse_scaled(value, shift, &bytes)) {
    case NUM_OK: *field = bytes; return CP_OK;
    case NUM_NEGATIVE: return bad_value(key, value, "a size must not be negative");
    case NUM_OVERFLOW: return bad_value(key, value, "too large: the size in bytes overflows size_t");
    case NUM_FRACTION: return bad_value(key, value, "%.*s %s is not a whole number of bytes", SPAN_ARG(value), unit);
    case NUM_SYNTAX:
    default: return bad_value(key, value, "expected a size in %s (digits, optionally with a decimal point)", unit);
  }
}

/* A fraction key: (0, 1) when `one_allowed` is 0, else (0, 1]. */
static int apply_fraction(key_id_t key, span_t value, int one_allowed, double *field) {
  double x = 0.0;
  const char *range = one_allowed ? "a number in (0, 1]" : "a number strictly between 0 and 1";
  num_status_t st = parse_double(value, &x);
  if (st == NUM_NEGATIVE) return bad_value(key, value, "expected %s, not a negative number", range);
  if (st != NUM_OK) return bad_value(key, value, "expected %s", range);
  if (!(x > 0.0 && (one_allowed ? x <= 1.0 : x < 1.0)))
    return bad_value(key, value, "out of range: expected %s", range);
  *field = x;
  return CP_OK;
}

/* One division count: 0 or a power of two, at most MAX_DIVISIONS. */
static int parse_divisions(key_id_t key, span_t whole, span_t s, unsigned *out) {
  uint64_t v = 0;
  num_status_t st = parse_uint(s, MAX_DIVISIONS, &v);
  if (st == NUM_SYNTAX) return bad_value(key, whole, "divisions '%.*s' is not a whole number", SPAN_ARG(s));
  if (st != NUM_OK || (v != 0 && !cp_is_pow2((size_t)v)))
    return bad_value(key, whole, "divisions '%.*s' must be 0 or a power of two up to %u", SPAN_ARG(s), MAX_DIVISIONS);
  *out = (unsigned)v;
  return CP_OK;
}

/* roundup_power2_divisions: "N" or "[K:N,...,>:N]" (see the notes at the top). */
static int apply_roundup(key_id_t key, span_t value, unsigned out[CP_ROUNDUP_INTERVALS]) {
  unsigned div[CP_ROUNDUP_INTERVALS];
  if (value.p[0] != '[') {
    unsigned n = 0;
    uint64_t probe = 0;
    if (parse_uint(value, UINT64_MAX, &probe) == NUM_SYNTAX)
      return bad_value(key, value, "expected N or [SIZE_MB:N,...,>:N]");
    int rc = parse_divisions(key, value, value, &n);
    if (rc != CP_OK) return rc;
    for (int i = 0; i < CP_ROUNDUP_INTERVALS; i++) out[i] = n;
    return CP_OK;
  }
  if (value.p[value.n - 1] != ']') return bad_value(key, value, "a list must end with ']'");
  span_t inner = {value.p + 1, value.n - 2};
  if (span_trim(inner).n == 0) return bad_value(key, value, "empty list");
  const unsigned max_key_log2 = CP_ROUNDUP_INTERVALS - 1;
  int last = -1;     /* highest interval assigned so far */
  int have_rest = 0; /* ">" seen */
  unsigned last_value = 0;
  size_t pos = 0;
  while (pos <= inner.n) {
    size_t end = pos;
    while (end < inner.n && inner.p[end] != ',') end++;
    span_t item = span_trim((span_t){inner.p + pos, end - pos});
    pos = end + 1;
    if (item.n == 0) return bad_value(key, value, "empty entry in the list");
    if (have_rest) return bad_value(key, value, "'>' must be the last entry");
    const char *colon = memchr(item.p, ':', item.n);
    if (colon == NULL) return bad_value(key, value, "entry '%.*s' is not SIZE_MB:N", SPAN_ARG(item));
    span_t k = span_trim((span_t){item.p, (size_t)(colon - item.p)});
    span_t v = span_trim((span_t){colon + 1, item.n - (size_t)(colon - item.p) - 1});
    if (k.n == 0 || v.n == 0) return bad_value(key, value, "entry '%.*s' is not SIZE_MB:N", SPAN_ARG(item));
    /* The key: '>' (everything above the last key) or a size in MiB -> interval `idx`. */
    int idx = CP_ROUNDUP_INTERVALS - 1;
    int rest = span_eq(k, ">");
    if (!rest) {
      uint64_t mb = 0;
      num_status_t st = parse_uint(k, UINT64_MAX, &mb);
      if (st != NUM_OK || mb > ((uint64_t)1 << max_key_log2) || !cp_is_pow2((size_t)mb))
        return bad_value(key, value, "size '%.*s' must be a power of two from 1 to %llu (MiB) or '>'", SPAN_ARG(k),
                         (unsigned long long)1 << max_key_log2);
      idx = (int)cp_floor_log2((size_t)mb);
      if (idx <= last)
        return bad_value(key, value, "sizes must be in increasing order ('%.*s' comes too late)", SPAN_ARG(k));
    }
    unsigned n = 0;
    int rc = parse_divisions(key, value, v, &n);
    if (rc != CP_OK) return rc;
    for (int i = last + 1; i <= idx; i++) div[i] = n;
    if (rest) {
      last = CP_ROUNDUP_INTERVALS - 1;
      have_rest = 1;
      continue;
    }
    last = idx;
    last_value = n;
  }
  /* Without ">", the last entry's value reaches to the top. */
  for (int i = last + 1; i < CP_ROUNDUP_INTERVALS; i++) div[i] = last_value;
  memcpy(out, div, sizeof div);
  return CP_OK;
}

static int apply_key(cp_config_t *cfg, key_id_t key, span_t value) {
  switch (keys[key].kind) {
    case KIND_BYTES: return apply_size(key, value, 0, KEY_FIELD(cfg, key, size_t));
    case KIND_MIB_OR_UNLIMITED:
      if (span_eq(value, "unlimited")) {
        *KEY_FIELD(cfg, key, size_t) = SIZE_MAX;
        return CP_OK;
      }
      return apply_size(key, value, MIB_SHIFT, KEY_FIELD(cfg, key, size_t));
    case KIND_MIB:
    case KIND_MIB_GRANULAR: return apply_size(key, value, MIB_SHIFT, KEY_FIELD(cfg, key, size_t));
    case KIND_DIVISIONS: return apply_roundup(key, value, KEY_FIELD(cfg, key, unsigned));
    case KIND_FRACTION_OPEN: return apply_fraction(key, value, 0, KEY_FIELD(cfg, key, double));
    case KIND_FRACTION: return apply_fraction(key, value, 1, KEY_FIELD(cfg, key, double));
    case KIND_BOOL:
      if (is_true(value) || is_false(value)) {
        *KEY_FIELD(cfg, key, int) = is_true(value);
        return CP_OK;
      }
      return bad_value(key, value, "expected True or False");
    default: break;
  }
  return cp_set_error(CP_ERR_INVALID, CONF_PREFIX "internal error: key %d", (int)key);
}

static int unknown_key(span_t key) {
  char known[512];
  size_t len = 0;
  known[0] = '\0';
  for (int i = 0; i < KEY_COUNT; i++) {
    int n = snprintf(known + len, sizeof known - len, "%s%s", i ? ", " : "", keys[i].name);
    if (n < 0 || (size_t)n >= sizeof known - len) break;
    len += (size_t)n;
  }
  return cp_set_error(CP_ERR_INVALID, CONF_PREFIX "unknown key '%.*s' (known: %s)", SPAN_ARG(key), known);
}

/* ------------------------------------------------------------------------------------------
 * Public entry points
 * ---------------------------------------------------------------------------------------- */

void cp_config_default(cp_config_t *cfg) {
  if (cfg == NULL) return;
  memset(cfg, 0, sizeof *cfg); /* also zeroes the padding, so configs compare with memcmp */
  cfg->granule = 512;
  cfg->small_size = 1 * MIB;
  cfg->small_segment = 2 * MIB;
  cfg->large_segment = 20 * MIB;
  cfg->min_large_alloc = 10 * MIB;
  cfg->round_large = 2 * MIB;
  cfg->max_split_size = SIZE_MAX;
  cfg->max_non_split_rounding = 20 * MIB;
  for (int i = 0; i < CP_ROUNDUP_INTERVALS; i++) cfg->roundup_power2_divisions[i] = 0;
  cfg->garbage_collection_threshold = 0.0;
  cfg->memory_cap = 0;
  cfg->memory_fraction = 0.0;
  cfg->stitch_partial = 1;
}

int cp_config_from_env(cp_config_t *cfg) {
  if (cfg == NULL) return cp_set_error(CP_ERR_INVALID, "cp_config_from_env: cfg is NULL");
  cp_config_default(cfg);
  return cp_config_parse(cfg, getenv("CUDAPOOL_CONF"));
}

int cp_config_parse(cp_config_t *cfg, const char *text) {
  if (cfg == NULL) return cp_set_error(CP_ERR_INVALID, "cp_config_parse: cfg is NULL");
  if (text == NULL) return CP_OK;

  /* Everything is applied to a copy; *cfg changes only once the whole result is valid. */
  cp_config_t work = *cfg;
  unsigned seen = 0;
  size_t len = strlen(text);
  if (span_trim((span_t){text, len}).n == 0) return CP_OK;

  size_t pos = 0;
  while (pos <= len) {
    /* The entry runs to the next ',' outside brackets (or to the end). */
    size_t end = pos;
    int depth = 0;
    while (end < len && !(text[end] == ',' && depth == 0)) {
      if (text[end] == '[')
        depth++;
      else if (text[end] == ']' && depth > 0)
        depth--;
      end++;
    }
    span_t entry = span_trim((span_t){text + pos, end - pos});
    pos = end + 1;
    if (entry.n == 0) return cp_set_error(CP_ERR_INVALID, CONF_PREFIX "empty entry in '%s' (stray ',')", text);

    const char *colon = memchr(entry.p, ':', entry.n);
    if (colon == NULL)
      return cp_set_error(CP_ERR_INVALID, CONF_PREFIX "entry '%.*s' is not key:value", SPAN_ARG(entry));
    span_t key = span_trim((span_t){entry.p, (size_t)(colon - entry.p)});
    span_t value = span_trim((span_t){colon + 1, entry.n - (size_t)(colon - entry.p) - 1});
    if (key.n == 0) return cp_set_error(CP_ERR_INVALID, CONF_PREFIX "entry '%.*s' has no key", SPAN_ARG(entry));

    int id = -1;
    for (int i = 0; i < KEY_COUNT; i++) {
      if (span_eq(key, keys[i].name)) {
        id = i;
        break;
      }
    }
    if (id < 0) return unknown_key(key);
    if (seen & (1u << id)) return cp_set_error(CP_ERR_INVALID, CONF_PREFIX "duplicate key '%s'", keys[id].name);
    seen |= 1u << id;
    if (value.n == 0) return cp_set_error(CP_ERR_INVALID, CONF_PREFIX "empty value for %s", keys[id].name);

    int rc = apply_key(&work, (key_id_t)id, value);
    if (rc != CP_OK) return rc;
  }

  if (cp_config_validate(&work) != CP_OK) {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", cp_last_error());
    return cp_set_error(CP_ERR_INVALID, CONF_PREFIX "%s", msg);
  }
  *cfg = work;
  return CP_OK;
}

int cp_config_validate(const cp_config_t *cfg) {
  if (cfg == NULL) return cp_set_error(CP_ERR_INVALID, "cp_config_validate: cfg is NULL");
  char a[48], b[48];

  if (!cp_is_pow2(cfg->granule) || cfg->granule < 256)
    return cp_set_error(CP_ERR_INVALID, "invalid config: granule (%zu bytes) must be a power of two >= 256",
                        cfg->granule);

  for (int k = 0; k < KEY_COUNT; k++) {
    if (keys[k].kind != KIND_MIB_GRANULAR) continue;
    size_t value = *KEY_FIELD_C(cfg, k, size_t);
    if (value == 0 || value % cfg->granule != 0)
      return cp_set_error(CP_ERR_INVALID,
                          "invalid config: %s (%zu bytes) must be a positive multiple of granule (%zu bytes)",
                          keys[k].field_name, value, cfg->granule);
  }

  if (cfg->small_size > cfg->small_segment) {
    format_mib(cfg->small_size, a, sizeof a);
    format_mib(cfg->small_segment, b, sizeof b);
    return cp_set_error(CP_ERR_INVALID, "invalid config: small_size (%s MiB) must not exceed small_segment (%s MiB)", a,
                        b);
  }
  if (cfg->small_size >= cfg->min_large_alloc) {
    format_mib(cfg->small_size, a, sizeof a);
    format_mib(cfg->min_large_alloc, b, sizeof b);
    return cp_set_error(CP_ERR_INVALID,
                        "invalid config: small_size (%s MiB) must be smaller than min_large_alloc (%s MiB)", a, b);
  }
  if (cfg->min_large_alloc > cfg->large_segment) {
    format_mib(cfg->min_large_alloc, a, sizeof a);
    format_mib(cfg->large_segment, b, sizeof b);
    return cp_set_error(CP_ERR_INVALID,
                        "invalid config: min_large_alloc (%s MiB) must not exceed large_segment (%s MiB)", a, b);
  }
  if (cfg->max_split_size != SIZE_MAX && cfg->max_split_size <= cfg->large_segment) {
    format_mib(cfg->max_split_size, a, sizeof a);
    format_mib(cfg->large_segment, b, sizeof b);
    return cp_set_error(CP_ERR_INVALID,
                        "invalid config: max_split_size (%s MiB) must be larger than large_segment (%s MiB)", a, b);
  }
  for (int k = 0; k < KEY_COUNT; k++) {
    if (keys[k].kind == KIND_DIVISIONS) {
      const unsigned *div = KEY_FIELD_C(cfg, k, unsigned);
      for (int i = 0; i < CP_ROUNDUP_INTERVALS; i++) {
        if (div[i] != 0 && !cp_is_pow2(div[i]))
          return cp_set_error(CP_ERR_INVALID, "invalid config: %s[%d] (%u) must be 0 or a power of two",
                              keys[k].field_name, i, div[i]);
      }
    } else if (keys[k].kind == KIND_FRACTION_OPEN || keys[k].kind == KIND_FRACTION) {
      const double x = *KEY_FIELD_C(cfg, k, double);
      const int open = keys[k].kind == KIND_FRACTION_OPEN;
      if (!(x == 0.0 || (x > 0.0 && (open ? x < 1.0 : x <= 1.0))))
        return cp_set_error(CP_ERR_INVALID, "invalid config: %s (%g) must be %s", keys[k].field_name, x,
                            open ? "0 (off) or strictly between 0 and 1" : "0 (unset) or in (0, 1]");
    }
  }
  return CP_OK;
}

/* snprintf-style appender: keeps counting once the buffer is full. */
typedef struct out_s {
  char *buf;
  size_t size;
  size_t len; /* what would have been written */
} out_t;

static void out_printf(out_t *o, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

static void out_printf(out_t *o, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  char *dst = NULL;
  size_t room = 0;
  if (o->buf != NULL && o->len < o->size) {
    dst = o->buf + o->len;
    room = o->size - o->len;
  }
  int n = vsnprintf(dst, room, fmt, ap);
  va_end(ap);
  if (n > 0) o->len += (size_t)n;
}

/* Shortest "%.*g" text that strtod reads back as exactly `x`. */
static void format_double(double x, char *buf, size_t size) {
  for (int prec = 1; prec <= DBL_DECIMAL_DIG; prec++) {
    snprintf(buf, size, "%.*g", prec, x);
    if (strtod(buf, NULL) == x) return;
  }
  snprintf(buf, size, "%.*g", DBL_DECIMAL_DIG, x);
}

/* roundup_power2_divisions: one number when all intervals agree; else an entry at each
 * interval where the value changes, then ">" for the rest (which parses back to the same
 * array). */
static void format_divisions(out_t *o, const unsigned *d) {
  int uniform = 1;
  for (int i = 1; i < CP_ROUNDUP_INTERVALS; i++) uniform &= d[i] == d[0];
  if (uniform) {
    out_printf(o, "%u", d[0]);
    return;
  }
  out_printf(o, "[");
  for (int i = 0; i + 1 < CP_ROUNDUP_INTERVALS; i++) {
    if (d[i] != d[i + 1]) out_printf(o, "%llu:%u,", 1ull << i, d[i]);
  }
  out_printf(o, ">:%u]", d[CP_ROUNDUP_INTERVALS - 1]);
}

int cp_config_format(const cp_config_t *cfg, char *buf, size_t buf_size) {
  out_t o = {buf, buf_size, 0};
  if (buf != NULL && buf_size > 0) buf[0] = '\0';
  if (cfg == NULL) return 0;
  char num[64];
  const char *sep = "";
  for (int k = 0; k < KEY_COUNT; k++) {
    const key_kind_t kind = keys[k].kind;
    /* 0 means off/unset for the fractions and is not a valid value: omit them then. */
    if (k == KEY_EXPANDABLE_SEGMENTS && !cfg->expandable_segments) continue; /* written when True only */
    if (k == KEY_PAGE_STITCHING && !cfg->page_stitching) continue;
    if (k == KEY_STITCH_PARTIAL_HANDLES && cfg->stitch_partial) continue; /* written when False only */
    if (k == KEY_PLAN_STEPS && !cfg->plan_steps) continue;
    if ((kind == KIND_FRACTION_OPEN || kind == KIND_FRACTION) && *KEY_FIELD_C(cfg, k, double) == 0.0) continue;
    out_printf(&o, "%s%s:", sep, keys[k].name);
    sep = ",";
    switch (kind) {
      case KIND_BYTES: out_printf(&o, "%zu", *KEY_FIELD_C(cfg, k, size_t)); break;
      case KIND_MIB_OR_UNLIMITED:
        if (*KEY_FIELD_C(cfg, k, size_t) == SIZE_MAX) {
          out_printf(&o, "unlimited");
          break;
        }
        /* fall through */
      case KIND_MIB:
      case KIND_MIB_GRANULAR:
        format_mib(*KEY_FIELD_C(cfg, k, size_t), num, sizeof num);
        out_printf(&o, "%s", num);
        break;
      case KIND_DIVISIONS: format_divisions(&o, KEY_FIELD_C(cfg, k, unsigned)); break;
      case KIND_FRACTION_OPEN:
      case KIND_FRACTION:
        format_double(*KEY_FIELD_C(cfg, k, double), num, sizeof num);
        out_printf(&o, "%s", num);
        break;
      case KIND_BOOL: out_printf(&o, "%s", *KEY_FIELD_C(cfg, k, int) ? "True" : "False"); break;
      default: break;
    }
  }
  return o.len > INT_MAX ? INT_MAX : (int)o.len;
}
