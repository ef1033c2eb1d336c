/* test_config.c — unit tests of csrc/core/config.c.
 * Covers: defaults, every key, the bracket syntax, errors (which must leave the config
 * untouched), validation, the format/parse round trip, and cp_round_size. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "core/cp.h"

#define MiB ((size_t)1 << 20)
#define GiB ((size_t)1 << 30)

/* A valid configuration that differs from the defaults in several fields, so that a
 * half-applied parse would be visible. */
static const char *const BASE_TEXT =
    "max_split_size_mb:64,roundup_power2_divisions:[256:1,>:8],garbage_collection_threshold:0.5,"
    "memory_cap_mb:1024";

static cp_config_t base_config(void) {
  cp_config_t cfg;
  cp_config_default(&cfg);
  if (cp_config_parse(&cfg, BASE_TEXT) != CP_OK) {
    fprintf(stderr, "base_config: %s\n", cp_last_error());
    abort();
  }
  return cfg;
}

/* Parse `text` on top of a copy of `start`; it must fail with CP_ERR_INVALID, leave the copy
 * byte-for-byte unchanged, and the message must contain `want1` and (if given) `want2`. */
static int expect_fail(const cp_config_t *start, const char *text, const char *want1, const char *want2) {
  cp_config_t cfg = *start;
  cp_clear_error();
  int rc = cp_config_parse(&cfg, text);
  int ok = 1;
  if (rc != CP_ERR_INVALID) {
    fprintf(stderr, "  parse(\"%s\") returned %s, wanted CP_ERR_INVALID\n", text, cp_status_name(rc));
    ok = 0;
  }
  if (memcmp(&cfg, start, sizeof cfg) != 0) {
    fprintf(stderr, "  parse(\"%s\") changed the config on failure\n", text);
    ok = 0;
  }
  const char *msg = cp_last_error();
  if (strstr(msg, want1) == NULL || (want2 != NULL && strstr(msg, want2) == NULL)) {
    fprintf(stderr, "  parse(\"%s\") message \"%s\" lacks \"%s\"%s%s%s\n", text, msg, want1, want2 ? " / \"" : "",
            want2 ? want2 : "", want2 ? "\"" : "");
    ok = 0;
  }
  if (strncmp(msg, "CUDAPOOL_CONF: ", 15) != 0) {
    fprintf(stderr, "  parse(\"%s\") message \"%s\" lacks the CUDAPOOL_CONF prefix\n", text, msg);
    ok = 0;
  }
  return ok;
}

#define EXPECT_FAIL(start, text, w1, w2) CHECK(expect_fail((start), (text), (w1), (w2)))

/* Parse `text` onto the defaults; REQUIRE success. */
#define PARSE_OK(cfg, text)                                                              \
  do {                                                                                   \
    cp_config_default(&(cfg));                                                           \
    int rc_ = cp_config_parse(&(cfg), (text));                                           \
    if (rc_ != CP_OK) fprintf(stderr, "  parse(\"%s\"): %s\n", (text), cp_last_error()); \
    REQUIRE(rc_ == CP_OK);                                                               \
  } while (0)

/* ------------------------------------------------------------------------------------------ */

TEST(defaults) {
  cp_config_t cfg;
  memset(&cfg, 0xAB, sizeof cfg);
  cp_config_default(&cfg);
  CHECK_EQ_U(cfg.granule, 512);
  CHECK_EQ_U(cfg.small_size, 1 * MiB);
  CHECK_EQ_U(cfg.small_segment, 2 * MiB);
  CHECK_EQ_U(cfg.large_segment, 20 * MiB);
  CHECK_EQ_U(cfg.min_large_alloc, 10 * MiB);
  CHECK_EQ_U(cfg.round_large, 2 * MiB);
  CHECK_EQ_U(cfg.max_split_size, SIZE_MAX);
  CHECK_EQ_U(cfg.max_non_split_rounding, 20 * MiB);
  for (int i = 0; i < CP_ROUNDUP_INTERVALS; i++) CHECK_EQ_U(cfg.roundup_power2_divisions[i], 0);
  CHECK(cfg.garbage_collection_threshold == 0.0);
  CHECK_EQ_U(cfg.memory_cap, 0);
  CHECK(cfg.memory_fraction == 0.0);
  CHECK(cp_config_validate(&cfg) == CP_OK);

  /* Deterministic bytes: two default configs compare equal with memcmp. */
  cp_config_t other;
  memset(&other, 0x11, sizeof other);
  cp_config_default(&other);
  CHECK(memcmp(&cfg, &other, sizeof cfg) == 0);
}

TEST(noop_inputs) {
  cp_config_t cfg = base_config(), copy = cfg;
  CHECK(cp_config_parse(&cfg, NULL) == CP_OK);
  CHECK(cp_config_parse(&cfg, "") == CP_OK);
  CHECK(cp_config_parse(&cfg, "  \t \n ") == CP_OK);
  CHECK(memcmp(&cfg, &copy, sizeof cfg) == 0);
  CHECK(cp_config_parse(NULL, "max_split_size_mb:64") == CP_ERR_INVALID);
  CHECK(cp_config_validate(NULL) == CP_ERR_INVALID);
}

TEST(size_keys) {
  cp_config_t cfg;
  PARSE_OK(cfg, "max_split_size_mb:64");
  CHECK_EQ_U(cfg.max_split_size, 64 * MiB);
  PARSE_OK(cfg, "max_split_size_mb:21");
  CHECK_EQ_U(cfg.max_split_size, 21 * MiB);
  PARSE_OK(cfg, "max_split_size_mb:unlimited");
  CHECK_EQ_U(cfg.max_split_size, SIZE_MAX);
  /* A very large value: the largest whole MiB count that fits. */
  PARSE_OK(cfg, "max_split_size_mb:17592186044415");
  CHECK_EQ_U(cfg.max_split_size, (SIZE_MAX >> 20) << 20);

  PARSE_OK(cfg, "max_non_split_rounding_mb:256");
  CHECK_EQ_U(cfg.max_non_split_rounding, 256 * MiB);
  PARSE_OK(cfg, "max_non_split_rounding_mb:0");
  CHECK_EQ_U(cfg.max_non_split_rounding, 0);

  PARSE_OK(cfg, "granule_bytes:1024");
  CHECK_EQ_U(cfg.granule, 1024);
  PARSE_OK(cfg, "granule_bytes:256");
  CHECK_EQ_U(cfg.granule, 256);
  PARSE_OK(cfg, "small_size_mb:2");
  CHECK_EQ_U(cfg.small_size, 2 * MiB);
  PARSE_OK(cfg, "small_segment_mb:4");
  CHECK_EQ_U(cfg.small_segment, 4 * MiB);
  PARSE_OK(cfg, "large_segment_mb:32");
  CHECK_EQ_U(cfg.large_segment, 32 * MiB);
  PARSE_OK(cfg, "min_large_alloc_mb:16");
  CHECK_EQ_U(cfg.min_large_alloc, 16 * MiB);
  PARSE_OK(cfg, "round_large_mb:4");
  CHECK_EQ_U(cfg.round_large, 4 * MiB);
  PARSE_OK(cfg, "memory_cap_mb:40960");
  CHECK_EQ_U(cfg.memory_cap, 40 * GiB);
  PARSE_OK(cfg, "memory_cap_mb:0");
  CHECK_EQ_U(cfg.memory_cap, 0);
}

TEST(decimal_sizes) {
  cp_config_t cfg;
  PARSE_OK(cfg, "small_size_mb:0.5");
  CHECK_EQ_U(cfg.small_size, MiB / 2);
  PARSE_OK(cfg, "small_size_mb:0.25,small_segment_mb:1.5");
  CHECK_EQ_U(cfg.small_size, MiB / 4);
  CHECK_EQ_U(cfg.small_segment, MiB + MiB / 2);
  PARSE_OK(cfg, "memory_cap_mb:0.00048828125"); /* 512 bytes */
  CHECK_EQ_U(cfg.memory_cap, 512);
  PARSE_OK(cfg, "memory_cap_mb:0.00000095367431640625"); /* 1 byte: 20 decimals */
  CHECK_EQ_U(cfg.memory_cap, 1);
  PARSE_OK(cfg, "memory_cap_mb:0.00000095367431640625000000"); /* trailing zeros are fine */
  CHECK_EQ_U(cfg.memory_cap, 1);
  PARSE_OK(cfg, "memory_cap_mb:17592186044415.99999904632568359375"); /* SIZE_MAX bytes */
  CHECK_EQ_U(cfg.memory_cap, SIZE_MAX);
  PARSE_OK(cfg, "memory_cap_mb:000000000000000000000000000007.000");
  CHECK_EQ_U(cfg.memory_cap, 7 * MiB);
  PARSE_OK(cfg, "max_split_size_mb:20.5");
  CHECK_EQ_U(cfg.max_split_size, 20 * MiB + MiB / 2);
  PARSE_OK(cfg, "granule_bytes:1024.0");
  CHECK_EQ_U(cfg.granule, 1024);
}

TEST(fraction_keys) {
  cp_config_t cfg;
  PARSE_OK(cfg, "garbage_collection_threshold:0.6");
  CHECK(cfg.garbage_collection_threshold == 0.6);
  PARSE_OK(cfg, "garbage_collection_threshold:0.999");
  CHECK(cfg.garbage_collection_threshold == 0.999);
  PARSE_OK(cfg, "garbage_collection_threshold:1e-5");
  CHECK(cfg.garbage_collection_threshold == 1e-5);
  PARSE_OK(cfg, "memory_fraction:0.5");
  CHECK(cfg.memory_fraction == 0.5);
  PARSE_OK(cfg, "memory_fraction:1");
  CHECK(cfg.memory_fraction == 1.0);
  PARSE_OK(cfg, "memory_fraction:1.0");
  CHECK(cfg.memory_fraction == 1.0);
  PARSE_OK(cfg, "memory_fraction:2.5E-1");
  CHECK(cfg.memory_fraction == 0.25);
}

TEST(expandable_segments) {
  cp_config_t cfg, def;
  cp_config_default(&def);
  CHECK(def.expandable_segments == 0);
  PARSE_OK(cfg, "expandable_segments:False");
  CHECK(memcmp(&cfg, &def, sizeof cfg) == 0);
  PARSE_OK(cfg, "expandable_segments:false");
  CHECK(memcmp(&cfg, &def, sizeof cfg) == 0);
  PARSE_OK(cfg, "expandable_segments:0");
  CHECK(memcmp(&cfg, &def, sizeof cfg) == 0);
  PARSE_OK(cfg, "expandable_segments:True");
  CHECK(cfg.expandable_segments == 1);
  PARSE_OK(cfg, "expandable_segments:true");
  CHECK(cfg.expandable_segments == 1);
  PARSE_OK(cfg, "expandable_segments:1");
  CHECK(cfg.expandable_segments == 1);
  /* Written only when True: default configurations read as before. */
  char buf[512];
  cp_config_format(&def, buf, sizeof buf);
  CHECK(strstr(buf, "expandable_segments") == NULL);
  cp_config_format(&cfg, buf, sizeof buf);
  CHECK(strstr(buf, ",expandable_segments:True") != NULL);
  cp_config_t back;
  cp_config_default(&back);
  CHECK(cp_config_parse(&back, buf) == CP_OK);
  CHECK(memcmp(&back, &cfg, sizeof cfg) == 0);
  cp_config_t base = base_config();
  EXPECT_FAIL(&base, "expandable_segments:maybe", "bad value 'maybe' for expandable_segments",
              "expected True or False");
  EXPECT_FAIL(&base, "expandable_segments:False,expandable_segments:False", "duplicate key 'expandable_segments'",
              NULL);
}

static int divs_are(const cp_config_t *cfg, const unsigned want[CP_ROUNDUP_INTERVALS]) {
  int ok = 1;
  for (int i = 0; i < CP_ROUNDUP_INTERVALS; i++) {
    if (cfg->roundup_power2_divisions[i] != want[i]) {
      fprintf(stderr, "  divisions[%d] = %u, wanted %u\n", i, cfg->roundup_power2_divisions[i], want[i]);
      ok = 0;
    }
  }
  return ok;
}

TEST(roundup_single) {
  cp_config_t cfg;
  PARSE_OK(cfg, "roundup_power2_divisions:4");
  for (int i = 0; i < CP_ROUNDUP_INTERVALS; i++) CHECK_EQ_U(cfg.roundup_power2_divisions[i], 4);
  PARSE_OK(cfg, "roundup_power2_divisions:1");
  for (int i = 0; i < CP_ROUNDUP_INTERVALS; i++) CHECK_EQ_U(cfg.roundup_power2_divisions[i], 1);
  PARSE_OK(cfg, "roundup_power2_divisions:0");
  for (int i = 0; i < CP_ROUNDUP_INTERVALS; i++) CHECK_EQ_U(cfg.roundup_power2_divisions[i], 0);
  PARSE_OK(cfg, "roundup_power2_divisions:2147483648");
  CHECK_EQ_U(cfg.roundup_power2_divisions[7], 2147483648u);
}

TEST(roundup_brackets) {
  cp_config_t cfg;
  /* PyTorch's documented example: 1 division up to 256 MiB, 2 up to 512, 4 up to 1024, 8 above. */
  PARSE_OK(cfg, "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]");
  {
    const unsigned want[CP_ROUNDUP_INTERVALS] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 4, 8, 8, 8, 8, 8};
    CHECK(divs_are(&cfg, want));
  }
  /* Whitespace everywhere. */
  PARSE_OK(cfg, " roundup_power2_divisions : [ 256 : 1 ,\t512:2 , 1024 :4, > : 8 ] ");
  {
    const unsigned want[CP_ROUNDUP_INTERVALS] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 4, 8, 8, 8, 8, 8};
    CHECK(divs_are(&cfg, want));
  }
  /* Without '>', the last value reaches the top. */
  PARSE_OK(cfg, "roundup_power2_divisions:[256:1,512:2]");
  {
    const unsigned want[CP_ROUNDUP_INTERVALS] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2};
    CHECK(divs_are(&cfg, want));
  }
  /* Gaps: an entry covers everything above the previous key. */
  PARSE_OK(cfg, "roundup_power2_divisions:[1:2,64:4,>:0]");
  {
    const unsigned want[CP_ROUNDUP_INTERVALS] = {2, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    CHECK(divs_are(&cfg, want));
  }
  /* '>' alone: every interval. */
  PARSE_OK(cfg, "roundup_power2_divisions:[>:16]");
  {
    const unsigned want[CP_ROUNDUP_INTERVALS] = {16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16};
    CHECK(divs_are(&cfg, want));
  }
  /* The extremes of the key range; '>' after the last interval covers nothing. */
  PARSE_OK(cfg, "roundup_power2_divisions:[1:0,32768:2,>:4]");
  {
    const unsigned want[CP_ROUNDUP_INTERVALS] = {0, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2};
    CHECK(divs_are(&cfg, want));
  }
  /* A list fully replaces what was there before. */
  cp_config_t b = base_config();
  CHECK(cp_config_parse(&b, "roundup_power2_divisions:[2:4]") == CP_OK);
  for (int i = 0; i < CP_ROUNDUP_INTERVALS; i++) CHECK_EQ_U(b.roundup_power2_divisions[i], 4);
  /* Commas inside brackets don't split the outer list. */
  PARSE_OK(cfg, "max_split_size_mb:64, roundup_power2_divisions:[256:1,512:2,>:8], garbage_collection_threshold:0.6");
  CHECK_EQ_U(cfg.max_split_size, 64 * MiB);
  CHECK_EQ_U(cfg.roundup_power2_divisions[9], 2);
  CHECK(cfg.garbage_collection_threshold == 0.6);
}

TEST(whitespace_and_combined) {
  cp_config_t cfg;
  PARSE_OK(cfg, "  max_split_size_mb : 64 ,\tgarbage_collection_threshold:\t0.5  ,\n memory_fraction :0.75\n");
  CHECK_EQ_U(cfg.max_split_size, 64 * MiB);
  CHECK(cfg.garbage_collection_threshold == 0.5);
  CHECK(cfg.memory_fraction == 0.75);
  /* Order doesn't matter: validation looks at the final result only. */
  PARSE_OK(cfg, "max_split_size_mb:30,large_segment_mb:24");
  PARSE_OK(cfg, "large_segment_mb:24,max_split_size_mb:30");
  CHECK_EQ_U(cfg.large_segment, 24 * MiB);
  /* Parsing applies on top: keys not named keep their values. */
  cp_config_t b = base_config();
  CHECK(cp_config_parse(&b, "memory_fraction:0.5") == CP_OK);
  CHECK_EQ_U(b.max_split_size, 64 * MiB);
  CHECK(b.garbage_collection_threshold == 0.5);
  CHECK(b.memory_fraction == 0.5);
}

TEST(errors_keys_and_syntax) {
  cp_config_t base = base_config();
  /* The known keys are listed in the order of CP_CONFIG_KEYS. */
  EXPECT_FAIL(&base, "max_splt_size_mb:64", "unknown key 'max_splt_size_mb' (known: granule_bytes, ",
              "memory_fraction, expandable_segments, page_stitching, stitch_partial_handles, plan_steps)");
  EXPECT_FAIL(&base, "Max_Split_Size_MB:64", "unknown key 'Max_Split_Size_MB'", NULL);
  EXPECT_FAIL(&base, "backend:cudaMallocAsync", "unknown key 'backend'", NULL);
  /* An error after valid keys: nothing of them is applied. */
  EXPECT_FAIL(&base, "max_non_split_rounding_mb:30,roundup_power2_divisions:4,bogus:1", "unknown key 'bogus'", NULL);
  EXPECT_FAIL(&base, "max_split_size_mb", "entry 'max_split_size_mb' is not key:value", NULL);
  EXPECT_FAIL(&base, ":64", "has no key", NULL);
  EXPECT_FAIL(&base, "max_split_size_mb:", "empty value for max_split_size_mb", NULL);
  EXPECT_FAIL(&base, "max_split_size_mb:   ", "empty value for max_split_size_mb", NULL);
  EXPECT_FAIL(&base, "max_split_size_mb:64,,memory_cap_mb:1", "empty entry", NULL);
  EXPECT_FAIL(&base, "max_split_size_mb:64,", "empty entry", NULL);
  EXPECT_FAIL(&base, ",max_split_size_mb:64", "empty entry", NULL);
  EXPECT_FAIL(&base, "max_split_size_mb:64,max_split_size_mb:64", "duplicate key 'max_split_size_mb'", NULL);
  EXPECT_FAIL(&base, "memory_cap_mb:1, memory_cap_mb :2", "duplicate key 'memory_cap_mb'", NULL);

  /* A very long unknown key: the message is cut, nothing overflows. */
  static char longkey[10000];
  memset(longkey, 'k', sizeof longkey - 3);
  memcpy(longkey + sizeof longkey - 3, ":1", 3);
  EXPECT_FAIL(&base, longkey, "unknown key 'kkkk", NULL);
}

TEST(errors_numbers) {
  cp_config_t base = base_config();
  EXPECT_FAIL(&base, "max_split_size_mb:abc", "bad value 'abc' for max_split_size_mb: expected a size in MiB", NULL);
  EXPECT_FAIL(&base, "max_split_size_mb:-64", "bad value '-64' for max_split_size_mb", "negative");
  EXPECT_FAIL(&base, "max_split_size_mb:64MB", "bad value '64MB' for max_split_size_mb", "expected a size in MiB");
  EXPECT_FAIL(&base, "max_split_size_mb:64 x", "bad value '64 x'", NULL);
  EXPECT_FAIL(&base, "max_split_size_mb:6 4", "bad value '6 4'", NULL);
  EXPECT_FAIL(&base, "max_split_size_mb:0x40", "bad value '0x40'", NULL);
  EXPECT_FAIL(&base, "max_split_size_mb:+64", "bad value '+64'", NULL);
  EXPECT_FAIL(&base, "max_split_size_mb:1e3", "bad value '1e3'", NULL);
  EXPECT_FAIL(&base, "max_split_size_mb:64.", "bad value '64.'", NULL);
  EXPECT_FAIL(&base, "max_split_size_mb:.5", "bad value '.5'", NULL);
  EXPECT_FAIL(&base, "max_split_size_mb:0.5.5", "bad value '0.5.5'", NULL);
  EXPECT_FAIL(&base, "max_split_size_mb:inf", "bad value 'inf'", NULL);
  EXPECT_FAIL(&base, "max_split_size_mb:nan", "bad value 'nan'", NULL);
  EXPECT_FAIL(&base, "max_split_size_mb:17592186044416", "bad value '17592186044416' for max_split_size_mb",
              "overflows");
  EXPECT_FAIL(&base, "memory_cap_mb:99999999999999999999999999", "overflows", NULL);
  EXPECT_FAIL(&base, "memory_cap_mb:17592186044415.99999904632568359376", "not a whole number of bytes", NULL);
  EXPECT_FAIL(&base, "small_size_mb:0.1", "bad value '0.1' for small_size_mb: 0.1 MiB is not a whole number of bytes",
              NULL);
  EXPECT_FAIL(&base, "memory_cap_mb:0.000000953674316406251", "not a whole number of bytes", NULL);
  EXPECT_FAIL(&base, "granule_bytes:512.5", "bad value '512.5' for granule_bytes", "not a whole number of bytes");
  EXPECT_FAIL(&base, "granule_bytes:abc", "expected a size in bytes", NULL);

  EXPECT_FAIL(&base, "garbage_collection_threshold:0", "bad value '0' for garbage_collection_threshold",
              "strictly between 0 and 1");
  EXPECT_FAIL(&base, "garbage_collection_threshold:1", "bad value '1'", "strictly between 0 and 1");
  EXPECT_FAIL(&base, "garbage_collection_threshold:1.5", "out of range", NULL);
  EXPECT_FAIL(&base, "garbage_collection_threshold:-0.5", "bad value '-0.5'", "negative");
  EXPECT_FAIL(&base, "garbage_collection_threshold:1e999", "out of range", NULL);
  EXPECT_FAIL(&base, "garbage_collection_threshold:1e-999", "out of range", NULL);
  EXPECT_FAIL(&base, "garbage_collection_threshold:nan", "bad value 'nan'", NULL);
  EXPECT_FAIL(&base, "garbage_collection_threshold:inf", "bad value 'inf'", NULL);
  EXPECT_FAIL(&base, "garbage_collection_threshold:0.5x", "bad value '0.5x'", NULL);
  EXPECT_FAIL(&base, "garbage_collection_threshold:0.5e", "bad value '0.5e'", NULL);
  EXPECT_FAIL(&base, "garbage_collection_threshold:0x0.8p0", "bad value '0x0.8p0'", NULL);
  EXPECT_FAIL(&base, "memory_fraction:0", "bad value '0' for memory_fraction", "(0, 1]");
  EXPECT_FAIL(&base, "memory_fraction:1.0000001", "out of range", NULL);
  EXPECT_FAIL(&base, "memory_fraction:2", "out of range", NULL);
}

TEST(errors_roundup) {
  cp_config_t base = base_config();
  const char *k = "for roundup_power2_divisions";
  EXPECT_FAIL(&base, "roundup_power2_divisions:3", "bad value '3' for roundup_power2_divisions", "power of two");
  EXPECT_FAIL(&base, "roundup_power2_divisions:4294967296", "power of two", NULL);
  EXPECT_FAIL(&base, "roundup_power2_divisions:-4", "bad value '-4'", "power of two");
  EXPECT_FAIL(&base, "roundup_power2_divisions:4x", "expected N or [SIZE_MB:N,...,>:N]", NULL);
  EXPECT_FAIL(&base, "roundup_power2_divisions:1.5", "expected N or", NULL);
  EXPECT_FAIL(&base, "roundup_power2_divisions:1024:4", "expected N or", NULL);
  EXPECT_FAIL(&base, "roundup_power2_divisions:[256:3]", "bad value '[256:3]' for roundup_power2_divisions",
              "divisions '3' must be 0 or a power of two");
  EXPECT_FAIL(&base, "roundup_power2_divisions:[300:2]", "size '300' must be a power of two", k);
  EXPECT_FAIL(&base, "roundup_power2_divisions:[65536:2]", "size '65536'", "1 to 32768");
  EXPECT_FAIL(&base, "roundup_power2_divisions:[0:2]", "size '0'", NULL);
  EXPECT_FAIL(&base, "roundup_power2_divisions:[abc:2]", "size 'abc'", NULL);
  EXPECT_FAIL(&base, "roundup_power2_divisions:[512:2,256:1]", "increasing order", NULL);
  EXPECT_FAIL(&base, "roundup_power2_divisions:[256:2,256:4]", "increasing order", NULL);
  EXPECT_FAIL(&base, "roundup_power2_divisions:[>:2,256:1]", "'>' must be the last entry", NULL);
  EXPECT_FAIL(&base, "roundup_power2_divisions:[>:2,>:4]", "'>' must be the last entry", NULL);
  EXPECT_FAIL(&base, "roundup_power2_divisions:[256:1", "must end with ']'", NULL);
  EXPECT_FAIL(&base, "roundup_power2_divisions:[256:1,memory_cap_mb:1", "must end with ']'", NULL);
  EXPECT_FAIL(&base, "roundup_power2_divisions:[256:1]x", "must end with ']'", NULL);
  EXPECT_FAIL(&base, "roundup_power2_divisions:[]", "empty list", NULL);
  EXPECT_FAIL(&base, "roundup_power2_divisions:[ ]", "empty list", NULL);
  EXPECT_FAIL(&base, "roundup_power2_divisions:[256]", "entry '256' is not SIZE_MB:N", NULL);
  EXPECT_FAIL(&base, "roundup_power2_divisions:[256:]", "is not SIZE_MB:N", NULL);
  EXPECT_FAIL(&base, "roundup_power2_divisions:[:2]", "is not SIZE_MB:N", NULL);
  EXPECT_FAIL(&base, "roundup_power2_divisions:[256:1,]", "empty entry in the list", NULL);
  EXPECT_FAIL(&base, "roundup_power2_divisions:[256:1,,>:2]", "empty entry in the list", NULL);
  EXPECT_FAIL(&base, "roundup_power2_divisions:[[256:1]]", "size '[256'", NULL);
  EXPECT_FAIL(&base, "roundup_power2_divisions:[256:1],roundup_power2_divisions:4", "duplicate key", NULL);
}

TEST(errors_validation_through_parse) {
  cp_config_t base = base_config();
  cp_config_t def;
  cp_config_default(&def);
  EXPECT_FAIL(&def, "max_split_size_mb:20",
              "CUDAPOOL_CONF: invalid config: max_split_size (20 MiB) must be larger than large_segment (20 MiB)",
              NULL);
  EXPECT_FAIL(&def, "max_split_size_mb:16", "max_split_size (16 MiB) must be larger than large_segment", NULL);
  EXPECT_FAIL(&def, "max_split_size_mb:0", "max_split_size (0 MiB)", NULL);
  EXPECT_FAIL(&def, "large_segment_mb:32,max_split_size_mb:25", "max_split_size (25 MiB)", "large_segment (32 MiB)");
  EXPECT_FAIL(&base, "large_segment_mb:64", "max_split_size (64 MiB) must be larger than large_segment (64 MiB)", NULL);
  EXPECT_FAIL(&base, "granule_bytes:384", "granule (384 bytes) must be a power of two >= 256", NULL);
  EXPECT_FAIL(&base, "granule_bytes:128", "granule (128 bytes)", NULL);
  EXPECT_FAIL(&base, "granule_bytes:0", "granule (0 bytes)", NULL);
  EXPECT_FAIL(&base, "small_size_mb:0", "small_size (0 bytes) must be a positive multiple of granule", NULL);
  EXPECT_FAIL(&base, "round_large_mb:0", "round_large (0 bytes)", NULL);
  EXPECT_FAIL(&base, "granule_bytes:1024,small_size_mb:0.00048828125", "small_size (512 bytes)",
              "multiple of granule (1024 bytes)");
  EXPECT_FAIL(&base, "small_size_mb:3", "small_size (3 MiB) must not exceed small_segment (2 MiB)", NULL);
  EXPECT_FAIL(&base, "small_size_mb:2,min_large_alloc_mb:2",
              "small_size (2 MiB) must be smaller than min_large_alloc (2 MiB)", NULL);
  EXPECT_FAIL(&base, "min_large_alloc_mb:0.5", "small_size (1 MiB) must be smaller than min_large_alloc (0.5 MiB)",
              NULL);
  EXPECT_FAIL(&base, "min_large_alloc_mb:21", "min_large_alloc (21 MiB) must not exceed large_segment (20 MiB)", NULL);
}

TEST(validate_direct) {
  cp_config_t cfg;
  cp_config_default(&cfg);
  CHECK(cp_config_validate(&cfg) == CP_OK);

#define BAD(field, val, want)                                                                         \
  do {                                                                                                \
    cp_config_default(&cfg);                                                                          \
    cfg.field = (val);                                                                                \
    CHECK(cp_config_validate(&cfg) == CP_ERR_INVALID);                                                \
    CHECK(strstr(cp_last_error(), (want)) != NULL);                                                   \
    if (strstr(cp_last_error(), (want)) == NULL) fprintf(stderr, "  message: %s\n", cp_last_error()); \
  } while (0)

  BAD(granule, 511, "granule (511 bytes)");
  BAD(small_segment, 1000, "small_segment (1000 bytes) must be a positive multiple of granule");
  BAD(large_segment, 0, "large_segment (0 bytes)");
  BAD(min_large_alloc, 10 * MiB + 1, "min_large_alloc");
  BAD(max_split_size, 20 * MiB, "max_split_size (20 MiB) must be larger than large_segment (20 MiB)");
  BAD(roundup_power2_divisions[5], 3, "roundup_power2_divisions[5] (3) must be 0 or a power of two");
  BAD(garbage_collection_threshold, 1.0, "garbage_collection_threshold (1) must be 0 (off) or strictly between");
  BAD(garbage_collection_threshold, -0.25, "garbage_collection_threshold (-0.25)");
  BAD(garbage_collection_threshold, NAN, "garbage_collection_threshold (nan)");
  BAD(memory_fraction, 1.5, "memory_fraction (1.5) must be 0 (unset) or in (0, 1]");
  BAD(memory_fraction, NAN, "memory_fraction (nan)");
  BAD(max_split_size, 7 * MiB + 1, "max_split_size (7.00000095367431640625 MiB)");
#undef BAD

  /* Allowed edges. */
  cp_config_default(&cfg);
  cfg.max_split_size = 20 * MiB + 512;
  cfg.memory_fraction = 1.0;
  cfg.garbage_collection_threshold = 0.999;
  cfg.roundup_power2_divisions[3] = 1;
  cfg.roundup_power2_divisions[4] = 1u << 31;
  cfg.memory_cap = 12345;
  cfg.max_non_split_rounding = 0;
  CHECK(cp_config_validate(&cfg) == CP_OK);
}

static const char *const DEFAULT_FORMAT =
    "granule_bytes:512,small_size_mb:1,small_segment_mb:2,large_segment_mb:20,min_large_alloc_mb:10,"
    "round_large_mb:2,max_split_size_mb:unlimited,max_non_split_rounding_mb:20,roundup_power2_divisions:0,"
    "release_before_grow:False,memory_cap_mb:0";

TEST(format_defaults) {
  cp_config_t cfg;
  cp_config_default(&cfg);
  char buf[1024];
  int n = cp_config_format(&cfg, buf, sizeof buf);
  CHECK(strcmp(buf, DEFAULT_FORMAT) == 0);
  if (strcmp(buf, DEFAULT_FORMAT) != 0) fprintf(stderr, "  got: %s\n", buf);
  CHECK_EQ_U(n, strlen(DEFAULT_FORMAT));

  /* snprintf rules: the full length is returned, the text is cut and terminated. */
  char small[16];
  memset(small, 'x', sizeof small);
  CHECK_EQ_U(cp_config_format(&cfg, small, sizeof small), strlen(DEFAULT_FORMAT));
  CHECK(strlen(small) == sizeof small - 1);
  CHECK(strncmp(small, DEFAULT_FORMAT, sizeof small - 1) == 0);
  CHECK_EQ_U(cp_config_format(&cfg, NULL, 0), strlen(DEFAULT_FORMAT));
  char one[1] = {'x'};
  CHECK_EQ_U(cp_config_format(&cfg, one, 1), strlen(DEFAULT_FORMAT));
  CHECK(one[0] == '\0');
}

TEST(format_values) {
  cp_config_t cfg;
  char buf[1024];
  PARSE_OK(cfg,
           "roundup_power2_divisions:[256:1,512:2,1024:4,>:8],garbage_collection_threshold:0.6,"
           "memory_fraction:0.8,max_split_size_mb:64,small_size_mb:0.5,memory_cap_mb:0.00000095367431640625");
  cp_config_format(&cfg, buf, sizeof buf);
  const char *want =
      "granule_bytes:512,small_size_mb:0.5,small_segment_mb:2,large_segment_mb:20,min_large_alloc_mb:10,"
      "round_large_mb:2,max_split_size_mb:64,max_non_split_rounding_mb:20,"
      "roundup_power2_divisions:[256:1,512:2,1024:4,>:8],release_before_grow:False,"
      "memory_cap_mb:0.00000095367431640625,garbage_collection_threshold:0.6,memory_fraction:0.8";
  CHECK(strcmp(buf, want) == 0);
  if (strcmp(buf, want) != 0) fprintf(stderr, "  got:  %s\n  want: %s\n", buf, want);

  PARSE_OK(cfg, "roundup_power2_divisions:4");
  cp_config_format(&cfg, buf, sizeof buf);
  CHECK(strstr(buf, ",roundup_power2_divisions:4,") != NULL);
}

/* format, then parse onto `onto`; the result must equal `cfg` byte for byte. */
static int round_trips(const cp_config_t *cfg, const cp_config_t *onto) {
  char buf[2048];
  int n = cp_config_format(cfg, buf, sizeof buf);
  if (n <= 0 || (size_t)n >= sizeof buf) return 0;
  cp_config_t back = *onto;
  if (cp_config_parse(&back, buf) != CP_OK) {
    fprintf(stderr, "  round trip: parse(\"%s\"): %s\n", buf, cp_last_error());
    return 0;
  }
  if (memcmp(&back, cfg, sizeof back) != 0) {
    fprintf(stderr, "  round trip differs for \"%s\"\n", buf);
    return 0;
  }
  return 1;
}

TEST(round_trip) {
  cp_config_t def, other, cfg;
  cp_config_default(&def);
  /* A start config with every field changed (threshold and fraction off). */
  PARSE_OK(other,
           "granule_bytes:1024,small_size_mb:2,small_segment_mb:4,large_segment_mb:40,"
           "min_large_alloc_mb:20,round_large_mb:4,max_split_size_mb:100,max_non_split_rounding_mb:7,"
           "roundup_power2_divisions:[2:2,>:4],memory_cap_mb:3");

  CHECK(round_trips(&def, &def));
  CHECK(round_trips(&def, &other));
  CHECK(round_trips(&other, &def));

  const char *texts[] = {
      "max_split_size_mb:64",
      "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]",
      "roundup_power2_divisions:[1:2,64:4,>:0]",
      "roundup_power2_divisions:[1:0,32768:2]",
      "roundup_power2_divisions:[16384:0,>:2]",
      "roundup_power2_divisions:2147483648",
      "small_size_mb:0.5,small_segment_mb:1.5,memory_cap_mb:0.00048828125",
      "memory_cap_mb:17592186044415.99999904632568359375",
      "max_split_size_mb:17592186044415",
      "max_split_size_mb:20.00048828125",
      "granule_bytes:256,small_size_mb:0.000244140625",
  };
  for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
    PARSE_OK(cfg, texts[i]);
    CHECK(round_trips(&cfg, &def));
    CHECK(round_trips(&cfg, &other));
  }

  /* Fractions: shortest text that reads back exactly (onto the defaults). */
  const double fracs[] = {0.6, 0.1, 1.0 / 3.0, 0.999999999999, 1e-5, 2.2250738585072014e-308, 0.9999999999999999};
  for (size_t i = 0; i < sizeof fracs / sizeof fracs[0]; i++) {
    cp_config_default(&cfg);
    cfg.garbage_collection_threshold = fracs[i];
    cfg.memory_fraction = fracs[i];
    CHECK(cp_config_validate(&cfg) == CP_OK);
    CHECK(round_trips(&cfg, &def));
  }
  cp_config_default(&cfg);
  cfg.memory_fraction = 1.0;
  CHECK(round_trips(&cfg, &def));

  /* Bytes that are not a multiple of the granule (memory_cap) still round-trip exactly. */
  const size_t caps[] = {1, 12345, MiB - 1, MiB + 1, SIZE_MAX - 1, SIZE_MAX, (size_t)1 << 63};
  for (size_t i = 0; i < sizeof caps / sizeof caps[0]; i++) {
    cp_config_default(&cfg);
    cfg.memory_cap = caps[i];
    cfg.max_non_split_rounding = caps[i];
    CHECK(round_trips(&cfg, &def));
  }

  /* Every division pattern with two different values round-trips. */
  for (int lo = 0; lo < CP_ROUNDUP_INTERVALS; lo++) {
    for (int hi = lo; hi < CP_ROUNDUP_INTERVALS; hi++) {
      cp_config_default(&cfg);
      for (int i = lo; i <= hi; i++) cfg.roundup_power2_divisions[i] = 8;
      CHECK(round_trips(&cfg, &def));
      CHECK(round_trips(&cfg, &other));
    }
  }
}

TEST(round_size_defaults) {
  cp_config_t cfg;
  cp_config_default(&cfg);
  CHECK_EQ_U(cp_round_size(&cfg, 0), 0);
  CHECK_EQ_U(cp_round_size(&cfg, 1), 512);
  CHECK_EQ_U(cp_round_size(&cfg, 511), 512);
  CHECK_EQ_U(cp_round_size(&cfg, 512), 512);
  CHECK_EQ_U(cp_round_size(&cfg, 513), 1024);
  CHECK_EQ_U(cp_round_size(&cfg, 1000), 1024);
  CHECK_EQ_U(cp_round_size(&cfg, MiB + 1), MiB + 512);
  CHECK_EQ_U(cp_round_size(&cfg, 1200 * MiB + 1), 1200 * MiB + 512);
  /* Near SIZE_MAX. */
  CHECK_EQ_U(cp_round_size(&cfg, SIZE_MAX - 511), SIZE_MAX - 511); /* 2^64 - 512: a multiple */
  CHECK_EQ_U(cp_round_size(&cfg, SIZE_MAX - 600), SIZE_MAX - 511);
  CHECK_EQ_U(cp_round_size(&cfg, SIZE_MAX - 510), 0);
  CHECK_EQ_U(cp_round_size(&cfg, SIZE_MAX), 0);

  PARSE_OK(cfg, "granule_bytes:1024");
  CHECK_EQ_U(cp_round_size(&cfg, 1), 1024);
  CHECK_EQ_U(cp_round_size(&cfg, 513), 1024);
  CHECK_EQ_U(cp_round_size(&cfg, 1025), 2048);
  CHECK_EQ_U(cp_round_size(&cfg, SIZE_MAX - 1023), SIZE_MAX - 1023);
  CHECK_EQ_U(cp_round_size(&cfg, SIZE_MAX - 1022), 0);
}

TEST(round_size_divisions) {
  cp_config_t cfg;
  /* PyTorch's example: 4 divisions, 1200 MiB -> 1280 MiB (1024, 1280, 1536, 1792, 2048). */
  PARSE_OK(cfg, "roundup_power2_divisions:4");
  CHECK_EQ_U(cp_round_size(&cfg, 1200 * MiB), 1280 * MiB);
  CHECK_EQ_U(cp_round_size(&cfg, 1024 * MiB), 1024 * MiB);
  CHECK_EQ_U(cp_round_size(&cfg, 1024 * MiB + 1), 1280 * MiB);
  CHECK_EQ_U(cp_round_size(&cfg, 1280 * MiB), 1280 * MiB);
  CHECK_EQ_U(cp_round_size(&cfg, 1281 * MiB), 1536 * MiB);
  CHECK_EQ_U(cp_round_size(&cfg, 1537 * MiB), 1792 * MiB);
  CHECK_EQ_U(cp_round_size(&cfg, 2047 * MiB), 2048 * MiB);
  CHECK_EQ_U(cp_round_size(&cfg, 3 * MiB), 3 * MiB);
  CHECK_EQ_U(cp_round_size(&cfg, 3 * MiB + 1), 3 * MiB + 512 * 1024);
  /* Small sizes: at or below granule * d (2048) plain granule rounding. */
  CHECK_EQ_U(cp_round_size(&cfg, 1), 512);
  CHECK_EQ_U(cp_round_size(&cfg, 1500), 1536);
  CHECK_EQ_U(cp_round_size(&cfg, 2000), 2048);
  CHECK_EQ_U(cp_round_size(&cfg, 2049), 2560); /* 2048 + one step of 512 */
  CHECK_EQ_U(cp_round_size(&cfg, 4097), 5120); /* steps of 1024 in [4096, 8192) */
  CHECK_EQ_U(cp_round_size(&cfg, 4700), 5120); /* plain granule rounding would give 4608 */
  /* 64 divisions: granule * d = 32768. */
  PARSE_OK(cfg, "roundup_power2_divisions:64");
  CHECK_EQ_U(cp_round_size(&cfg, 32768), 32768);
  CHECK_EQ_U(cp_round_size(&cfg, 32767), 32768);
  CHECK_EQ_U(cp_round_size(&cfg, 20000), 20480);
  CHECK_EQ_U(cp_round_size(&cfg, 40000), 40448);                   /* steps of 512 in [32768, 65536) */
  CHECK_EQ_U(cp_round_size(&cfg, 100 * MiB + 1), 100 * MiB + MiB); /* steps of 1 MiB in [64, 128) MiB */
  /* A huge d: granule * d overflows, so plain rounding. */
  PARSE_OK(cfg, "roundup_power2_divisions:2147483648");
  CHECK_EQ_U(cp_round_size(&cfg, 1200 * MiB + 1), 1200 * MiB + 512);
  CHECK_EQ_U(cp_round_size(&cfg, ((size_t)1 << 41) + 1), ((size_t)1 << 41) + 1024); /* g*d = 2^40 */

  /* The intervals of PyTorch's bracket example. */
  PARSE_OK(cfg, "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]");
  CHECK_EQ_U(cp_round_size(&cfg, 200 * MiB + 1), 200 * MiB + 512); /* up to 256: 1 = off */
  CHECK_EQ_U(cp_round_size(&cfg, 256 * MiB + 1), 384 * MiB);       /* (256, 512]: 2 */
  CHECK_EQ_U(cp_round_size(&cfg, 300 * MiB), 384 * MiB);
  CHECK_EQ_U(cp_round_size(&cfg, 512 * MiB), 512 * MiB);
  CHECK_EQ_U(cp_round_size(&cfg, 512 * MiB + 1), 640 * MiB); /* (512, 1024]: 4 */
  CHECK_EQ_U(cp_round_size(&cfg, 600 * MiB), 640 * MiB);
  CHECK_EQ_U(cp_round_size(&cfg, 1024 * MiB), 1024 * MiB);
  CHECK_EQ_U(cp_round_size(&cfg, 1100 * MiB), 1152 * MiB); /* above 1024: 8 */
  CHECK_EQ_U(cp_round_size(&cfg, 1200 * MiB), 1280 * MiB);
  CHECK_EQ_U(cp_round_size(&cfg, 100 * GiB + 1), 104 * GiB); /* [64, 128) GiB in 8 steps */

  /* Interval boundaries: index = ceil(log2(size / 1 MiB)). */
  PARSE_OK(cfg, "roundup_power2_divisions:[1:0,2:2,>:0]");
  CHECK_EQ_U(cp_round_size(&cfg, MiB), MiB);
  CHECK_EQ_U(cp_round_size(&cfg, MiB - 1), MiB); /* interval 0: off */
  CHECK_EQ_U(cp_round_size(&cfg, MiB - 513), MiB - 512);
  CHECK_EQ_U(cp_round_size(&cfg, MiB + 1), MiB + MiB / 2); /* interval 1: 2 */
  CHECK_EQ_U(cp_round_size(&cfg, 2 * MiB - 1), 2 * MiB);
  CHECK_EQ_U(cp_round_size(&cfg, 2 * MiB + 1), 2 * MiB + 512); /* interval 2: off */
  /* The last interval takes everything above 16 GiB. */
  PARSE_OK(cfg, "roundup_power2_divisions:[16384:0,>:2]");
  CHECK_EQ_U(cp_round_size(&cfg, 16 * GiB), 16 * GiB);
  CHECK_EQ_U(cp_round_size(&cfg, 16 * GiB + 1), 24 * GiB);
  CHECK_EQ_U(cp_round_size(&cfg, 20 * GiB), 24 * GiB);
  CHECK_EQ_U(cp_round_size(&cfg, 15 * GiB + 1), 15 * GiB + 512);
  CHECK_EQ_U(cp_round_size(&cfg, ((size_t)1 << 40) + 1), ((size_t)1 << 40) + ((size_t)1 << 39));

  /* Overflow with divisions. */
  PARSE_OK(cfg, "roundup_power2_divisions:2");
  CHECK_EQ_U(cp_round_size(&cfg, (size_t)1 << 63), (size_t)1 << 63);
  CHECK_EQ_U(cp_round_size(&cfg, ((size_t)1 << 63) - 1), (size_t)1 << 63);
  CHECK_EQ_U(cp_round_size(&cfg, ((size_t)1 << 63) + 1), ((size_t)1 << 63) + ((size_t)1 << 62));
  CHECK_EQ_U(cp_round_size(&cfg, SIZE_MAX - ((size_t)1 << 62) + 1), SIZE_MAX - ((size_t)1 << 62) + 1);
  CHECK_EQ_U(cp_round_size(&cfg, SIZE_MAX - ((size_t)1 << 62) + 2), 0); /* would be 2^64 */
  CHECK_EQ_U(cp_round_size(&cfg, SIZE_MAX), 0);
  PARSE_OK(cfg, "roundup_power2_divisions:4");
  CHECK_EQ_U(cp_round_size(&cfg, ((size_t)1 << 63) + 1), ((size_t)1 << 63) + ((size_t)1 << 61));
  CHECK_EQ_U(cp_round_size(&cfg, SIZE_MAX - ((size_t)1 << 61) + 1), SIZE_MAX - ((size_t)1 << 61) + 1);
  CHECK_EQ_U(cp_round_size(&cfg, SIZE_MAX - ((size_t)1 << 61) + 2), 0);

  /* Every result is a multiple of the granule and >= the request (a sweep). */
  PARSE_OK(cfg, "roundup_power2_divisions:[1:2,4:4,64:8,>:16]");
  for (size_t s = 1; s < 300 * MiB; s = s * 3 / 2 + 7) {
    size_t r = cp_round_size(&cfg, s);
    CHECK(r >= s && r % 512 == 0);
  }
}

TEST(release_before_grow_key) {
  cp_config_t cfg;
  PARSE_OK(cfg, "release_before_grow:True");
  CHECK(cfg.release_before_grow == 1);
  PARSE_OK(cfg, "release_before_grow:0");
  CHECK(cfg.release_before_grow == 0);
  cp_config_t base;
  cp_config_default(&base);
  EXPECT_FAIL(&base, "release_before_grow:maybe", "release_before_grow", "True or False");
}

TEST(from_env) {
  cp_config_t cfg, def;
  cp_config_default(&def);
  unsetenv("CUDAPOOL_CONF");
  CHECK(cp_config_from_env(&cfg) == CP_OK);
  CHECK(memcmp(&cfg, &def, sizeof cfg) == 0);
  setenv("CUDAPOOL_CONF", "max_split_size_mb:64, garbage_collection_threshold:0.5", 1);
  CHECK(cp_config_from_env(&cfg) == CP_OK);
  CHECK_EQ_U(cfg.max_split_size, 64 * MiB);
  CHECK(cfg.garbage_collection_threshold == 0.5);
  setenv("CUDAPOOL_CONF", "max_split_size_mb:64,bogus_key:1", 1);
  CHECK(cp_config_from_env(&cfg) == CP_ERR_INVALID);
  CHECK(strstr(cp_last_error(), "bogus_key") != NULL);
  CHECK(memcmp(&cfg, &def, sizeof cfg) == 0); /* nothing half-applied */
  unsetenv("CUDAPOOL_CONF");
}

/* The table of keys (CP_CONFIG_KEYS) says each key's default in words; those words must be
 * what cp_config_default sets: giving the default's value changes nothing, and a key whose
 * default is "off" / "unset" is left out of the formatted defaults. */
TEST(key_table_defaults_are_the_defaults) {
  cp_config_t def;
  cp_config_default(&def);
  char formatted[1024];
  cp_config_format(&def, formatted, sizeof formatted);
  CHECK(cp_config_key_count >= 14);
  for (size_t i = 0; i < cp_config_key_count; i++) {
    const cp_config_key_t *k = &cp_config_keys[i];
    CHECK(k->name != NULL && k->default_text != NULL && k->doc != NULL && k->doc[0] != '\0');
    char value[64];
    size_t n = strcspn(k->default_text, " ");
    REQUIRE(n < sizeof value);
    memcpy(value, k->default_text, n);
    value[n] = '\0';
    char needle[96];
    snprintf(needle, sizeof needle, "%s:", k->name);
    if (strcmp(value, "off") == 0 || strcmp(value, "unset") == 0) {
      if (strstr(formatted, needle) != NULL) fprintf(stderr, "  %s is off by default but formatted\n", k->name);
      CHECK(strstr(formatted, needle) == NULL);
      continue;
    }
    char text[128];
    snprintf(text, sizeof text, "%s:%s", k->name, value);
    cp_config_t cfg = def;
    CHECK(cp_config_parse(&cfg, text) == CP_OK);
    if (memcmp(&cfg, &def, sizeof cfg) != 0) fprintf(stderr, "  %s: the default is not %s\n", k->name, value);
    CHECK(memcmp(&cfg, &def, sizeof cfg) == 0);
  }
}

int main(void) {
  RUN(defaults);
  RUN(key_table_defaults_are_the_defaults);
  RUN(noop_inputs);
  RUN(size_keys);
  RUN(decimal_sizes);
  RUN(fraction_keys);
  RUN(expandable_segments);
  RUN(roundup_single);
  RUN(roundup_brackets);
  RUN(whitespace_and_combined);
  RUN(errors_keys_and_syntax);
  RUN(errors_numbers);
  RUN(errors_roundup);
  RUN(errors_validation_through_parse);
  RUN(validate_direct);
  RUN(format_defaults);
  RUN(format_values);
  RUN(round_trip);
  RUN(round_size_defaults);
  RUN(round_size_divisions);
  RUN(release_before_grow_key);
  RUN(from_env);
  return check_summary("test_config");
}
