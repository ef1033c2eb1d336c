/* check.h — the tiny test harness of the C tests.
 * CHECK(cond) records a failure and goes on; REQUIRE(cond) records it and returns from the
 * test function. TEST(name) defines a test; RUN(name) runs it; check_summary() prints the
 * closing line "N passed, N failed" and gives the exit code.
 * CP_TEST_CASE=TEXT in the environment runs only the cases whose name contains TEXT, naming
 * each as it runs; check_summary() fails when none did (docs/testing.md, "Running one test"). */
#ifndef CP_TEST_CHECK_H
#define CP_TEST_CHECK_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int check_failures_ = 0; /* failed CHECKs in the current test */
static int check_tests_passed_ = 0;
static int check_tests_failed_ = 0;
static int check_tests_unselected_ = 0; /* runs left out by CP_TEST_CASE */

/* CP_TEST_CASE, or NULL when it is unset or empty. */
static inline const char *check_case_filter(void) {
  const char *f = getenv("CP_TEST_CASE");
  return f != NULL && f[0] != '\0' ? f : NULL;
}

/* Whether RUN runs the case `name` (CP_TEST_CASE). */
static inline int check_case_selected(const char *name) {
  const char *f = check_case_filter();
  if (f == NULL) return 1;
  if (strstr(name, f) == NULL) {
    check_tests_unselected_++;
    return 0;
  }
  printf("case %s\n", name);
  fflush(stdout);
  return 1;
}

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
    if (!check_case_selected(#name)) break;   \
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
  const char *f = check_case_filter();
  if (f != NULL && check_tests_passed_ + check_tests_failed_ == 0) {
    printf("%s: no case matches CP_TEST_CASE=%s (%d left out)\n", suite, f, check_tests_unselected_);
    return 1;
  }
  if (f != NULL) printf("%s: CP_TEST_CASE=%s left out %d runs\n", suite, f, check_tests_unselected_);
  printf("%s: %d passed, %d failed\n", suite, check_tests_passed_, check_tests_failed_);
  return check_tests_failed_ == 0 && check_tests_passed_ > 0 ? 0 : 1;
}

#endif
