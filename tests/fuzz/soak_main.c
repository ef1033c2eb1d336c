/* soak_main.c — the soak: the pool harness (fuzz_pool.c, every check it makes after every
 * operation) driven by inputs generated from a seed, for a number of operations, over the
 * three policies in turn: the built-in allocator's rules (plain segments), expandable segments
 * (page-mapped), and page stitching (the default policy's mechanism). Input k is made from
 * (seed, k) alone, so any one of them can be made again by itself.
 *
 *   soak_pool [--ops N] [--seed S] [--from K] [--inputs N] [--bytes N] [--check-every N]
 *             [--pause-every N] [--save PATH] [--quiet]
 *
 * --ops: stop once this many operations have run (default 10,000,000); --inputs: or after this
 * many inputs; --from: start at input K; --bytes: the bytes of each input after its header
 * (default 1,600: the harness runs at most 400 operations an input); --check-every: the
 * harness's whole check after every N operations and at each input's end (default 16; the
 * byte patterns are checked at every free whatever N); --pause-every: only every Nth pause
 * operation of each input pauses, with its backup copy (default 16: the copies would take most
 * of the time); --save PATH: write input --from to PATH and run it (build/asan/fuzz_pool_replay
 * PATH runs it again under the sanitizers). Address-space randomisation is turned off (the
 * process executes itself again once), so that a seed repeats exactly. A failing check aborts
 * with the harness's message, after which two commands are printed: the same inputs up to the
 * failing one again, and the failing one alone. Prints a progress line every 10 s and, at the
 * end, the operations, inputs, device failures injected, seconds and operations per second. */
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/personality.h>
#include <time.h>
#include <unistd.h>

#include "soak.h"

#define DEFAULT_OPS         10000000ull
#define DEFAULT_BYTES       1600
#define MAX_BYTES           65536
#define POLICIES            3
#define DEFAULT_CHECK_EVERY 16
#define DEFAULT_PAUSE_EVERY 16

static const char *const policy_names[POLICIES] = {"built-in rules", "expandable segments", "page stitching"};

/* The failure line, made before each input so that the abort handler only writes it. */
static char failure_line[1024];

static void on_abort(int sig) {
  (void)sig;
  ssize_t n = write(STDERR_FILENO, failure_line, strlen(failure_line));
  (void)n;
  signal(SIGABRT, SIG_DFL);
}

static uint64_t splitmix64(uint64_t *state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* Input k of `seed`: the header picks policy k % 3 (fuzz_pool.c reads its second byte's top
 * bits as "page-mapped" and a third byte STITCH_MARK as "stitching"), the rest is random. */
static size_t make_input(uint64_t seed, uint64_t k, size_t body, uint8_t *out) {
  uint64_t state = seed ^ (k * 0xd1342543de82ef95ull);
  size_t n = 0;
  for (size_t i = 0; i < body + 3; i += 8) {
    uint64_t v = splitmix64(&state);
    for (int b = 0; b < 8 && i + (size_t)b < body + 3; b++) out[i + (size_t)b] = (uint8_t)(v >> (8 * b));
  }
  const int policy = (int)(k % POLICIES);
  if (policy == 0) {
    if ((out[1] >> 5) == 7) out[1] &= 0xdf; /* plain segments */
    n = body + 2;
    memmove(out + 2, out + 3, body);
  } else {
    out[1] |= 0xe0; /* page-mapped */
    if (policy == 2)
      out[2] = STITCH_MARK;
    else if (out[2] == STITCH_MARK)
      out[2] ^= 1;
    n = body + 3;
  }
  return n;
}

static int parse_u64(const char *text, uint64_t *out) {
  char *end = NULL;
  errno = 0;
  unsigned long long v = strtoull(text, &end, 0);
  if (errno != 0 || end == text || *end != '\0' || text[0] == '-') return -1;
  *out = (uint64_t)v;
  return 0;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int usage(const char *why) {
  fprintf(stderr,
          "soak_pool: %s\nusage: soak_pool [--ops N] [--seed S] [--from K] [--inputs N] [--bytes N] "
          "[--check-every N] [--pause-every N] [--save PATH] [--quiet]\n",
          why);
  return 2;
}

/* The simulator's device addresses are host addresses (its memory is the host's), and where a
 * block lands depends on their alignment: with the address space randomised, one seed's run
 * differs from one process to the next. The soak runs without randomisation, executing itself
 * again once with it turned off, so that a seed repeats exactly. 1: it is off. */
static int without_randomisation(char **argv) {
  const int now = personality(0xffffffff);
  if (now == -1) return 0;
  if (now & ADDR_NO_RANDOMIZE) return 1;
  if (personality((unsigned long)now | ADDR_NO_RANDOMIZE) == -1) return 0;
  execv("/proc/self/exe", argv);
  (void)personality((unsigned long)now); /* not executed again: go on as it was */
  return 0;
}

int main(int argc, char **argv) {
  uint64_t ops = DEFAULT_OPS, seed = 0, from = 0, inputs = UINT64_MAX, body = DEFAULT_BYTES;
  uint64_t check_every = DEFAULT_CHECK_EVERY, pause_every = DEFAULT_PAUSE_EVERY;
  int have_seed = 0, quiet = 0;
  const char *save = NULL;
  for (int i = 1; i < argc; i++) {
    uint64_t *into = NULL;
    if (strcmp(argv[i], "--quiet") == 0) {
      quiet = 1;
      continue;
    }
    if (i + 1 >= argc) return usage("an option lacks its value");
    if (strcmp(argv[i], "--ops") == 0)
      into = &ops;
    else if (strcmp(argv[i], "--seed") == 0)
      into = &seed, have_seed = 1;
    else if (strcmp(argv[i], "--from") == 0)
      into = &from;
    else if (strcmp(argv[i], "--inputs") == 0)
      into = &inputs;
    else if (strcmp(argv[i], "--bytes") == 0)
      into = &body;
    else if (strcmp(argv[i], "--check-every") == 0)
      into = &check_every;
    else if (strcmp(argv[i], "--pause-every") == 0)
      into = &pause_every;
    else if (strcmp(argv[i], "--save") == 0) {
      save = argv[++i];
      continue;
    } else {
      return usage("unknown option");
    }
    if (parse_u64(argv[++i], into) != 0) return usage("a value is not a non-negative integer");
  }
  if (body < 1 || body > MAX_BYTES) return usage("--bytes must be 1 to 65536");
  if (check_every < 1 || check_every > 400) return usage("--check-every must be 1 to 400");
  if (pause_every < 1) return usage("--pause-every must be at least 1");
  fz_check_every = (size_t)check_every;
  fz_pause_every = (size_t)pause_every;
  if (!have_seed) seed = (uint64_t)time(NULL);
  if (save != NULL) inputs = 1;

  const int fixed = without_randomisation(argv);
  uint8_t *buf = malloc(MAX_BYTES + 8);
  if (buf == NULL) return usage("no host memory");
  signal(SIGABRT, on_abort);
  printf("soak_pool: seed %" PRIu64 ", up to %" PRIu64 " operations from input %" PRIu64 ", %" PRIu64
         " bytes an input, the whole check every %" PRIu64 " operations and at each input's end, every %" PRIu64
         " pause operation pausing, policies in turn: %s, %s, %s%s\n",
         seed, ops, from, body, check_every, pause_every, policy_names[0], policy_names[1], policy_names[2],
         fixed ? "" : " (address-space randomisation could not be turned off: a seed may not repeat exactly)");
  fflush(stdout);

  /* The options a failing input's commands repeat: those that change what runs. */
  char same[160], same_input[96];
  snprintf(same_input, sizeof same_input, " --bytes %" PRIu64 " --pause-every %" PRIu64, body, pause_every);
  snprintf(same, sizeof same, "%s --check-every %" PRIu64, same_input, check_every);
  size_t per_policy[POLICIES] = {0};
  uint64_t done = 0;
  const double start = now_s();
  double shown = start;
  for (uint64_t k = from; done < inputs && fz_ops_run < ops; k++, done++) {
    const size_t n = make_input(seed, k, (size_t)body, buf);
    if (save != NULL) {
      FILE *f = fopen(save, "wb");
      if (f == NULL || fwrite(buf, 1, n, f) != n || fclose(f) != 0) return usage("cannot write --save's file");
      printf("soak_pool: input %" PRIu64 " of seed %" PRIu64 " written to %s\n", k, seed, save);
    }
    snprintf(failure_line, sizeof failure_line,
             "\nsoak_pool: FAILED at input %" PRIu64 " of seed %" PRIu64
             " (%s).\n  again, exactly (the same inputs "
             "before it): soak_pool --seed %" PRIu64 " --from %" PRIu64 " --inputs %" PRIu64
             "%s\n  alone (its "
             "operations, other addresses): soak_pool --seed %" PRIu64 " --from %" PRIu64
             " --inputs 1%s --check-every 1"
             " (add --save input.bin to keep it)\n",
             k, seed, policy_names[k % POLICIES], seed, from, k - from + 1, same, seed, k, same_input);
    const size_t before = fz_ops_run;
    LLVMFuzzerTestOneInput(buf, n);
    per_policy[k % POLICIES] += fz_ops_run - before;
    const double t = now_s();
    if (!quiet && t - shown >= 10.0) {
      shown = t;
      printf("soak_pool: %zu operations, %" PRIu64 " inputs, %" PRIu64
             " device failures injected, %.0f s, "
             "%.0f operations/s\n",
             fz_ops_run, done + 1, fz_faults_run, t - start, (double)fz_ops_run / (t - start));
      fflush(stdout);
    }
  }
  const double seconds = now_s() - start;
  printf("soak_pool: PASSED seed %" PRIu64 ": %zu operations (%zu %s, %zu %s, %zu %s) in %" PRIu64 " inputs, %" PRIu64
         " device failures injected and survived, %zu pauses with backups, %zu capture windows (%zu frees waiting in "
         "them), %zu blocks shared (%zu pauses refused for them), 0 check failures, %.1f s, %.0f operations/s\n",
         seed, fz_ops_run, per_policy[0], policy_names[0], per_policy[1], policy_names[1], per_policy[2],
         policy_names[2], done, fz_faults_run, fz_pauses_run, fz_windows_run, fz_deferred_run, fz_shares_run,
         fz_shared_refusals_run, seconds, seconds > 0 ? (double)fz_ops_run / seconds : 0.0);
  free(buf);
  return 0;
}
