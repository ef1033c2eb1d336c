/* check.h — the tiny test harness of the C tests.
 * CHECK(cond) records a failure and goes on; REQUIRE(cond) records it and returns from the
 * test function. TEST(name) defines a test; RUN(name) runs it; check_summary() prints the
 * closing line "N passed, N failed" and gives the exit code. */
#ifndef CP_TEST_CHECK_H
#define CP_TEST_CHECK_H

#include <stdio.h>
#include <stdlib.h>

static int check_failures_ = 0; /* failed CHECKs in the current test */
static int check_tests_passed_ = 0;
static int check_tests_failed_ = 0;

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      check_failures_++;                                                       \
    }                                                                          \
  } while (0)

#define REQUIRE(cond)                                                            \
  do {                                                                           \
    if (!(cond)) {                                                               \
      fprintf(stderr, "%s:%d: REQUIRE failed: %s\n", __FILE__, __LINE__, #cond); \
      check_failures_++;                                                         \
      return;                                                                    \
    }                                                                            \
  } while (0)

#define CHECK_EQ_U(a, b)                                                                                     \
  do {                                                                                                       \
    unsigned long long a_ = (unsigned long long)(a), b_ = (unsigned long long)(b);                           \
    if (a_ != b_) {                                                                                          \
      fprintf(stderr, "%s:%d: CHECK failed: %s == %s (%llu != %llu)\n", __FILE__, __LINE__, #a, #b, a_, b_); \
      check_failures_++;                                                                                     \
    }                                                                                                        \
  } while (0)

#define TEST(name) static void test_##name(void)

#define RUN(name)                             \
  do {                                        \
    check_failures_ = 0;                      \
    test_##name();                            \
    if (check_failures_ == 0) {               \
      check_tests_passed_++;                  \
    } else {                                  \
      check_tests_failed_++;                  \
      fprintf(stderr, "FAILED: %s\n", #name); \
    }                                         \
  } while (0)

static inline int check_summary(const char *suite) {
  printf("%s: %d passed, %d failed\n", suite, check_tests_passed_, check_tests_failed_);
  return check_tests_failed_ == 0 && check_tests_passed_ > 0 ? 0 : 1;
}

#endif
