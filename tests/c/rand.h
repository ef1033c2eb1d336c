/* rand.h — what the randomised C tests share: a seeded generator (xorshift64*, a state per
 * thread) and a monotonic clock in seconds. */
#ifndef CP_TEST_RAND_H
#define CP_TEST_RAND_H

#include <stdint.h>
#include <time.h>

static inline uint64_t rng_next(uint64_t *s) { /* the state must not be 0 */
  *s ^= *s >> 12;
  *s ^= *s << 25;
  *s ^= *s >> 27;
  return *s * 0x2545F4914F6CDD1Dull;
}

static inline uint64_t rng_below(uint64_t *s, uint64_t n) { return rng_next(s) % n; }

static inline double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#endif /* CP_TEST_RAND_H */
