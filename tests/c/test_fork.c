/* test_fork.c — fork() while other threads are inside the pool.
 * Owns: the promise of Note [Locks across fork]: a child forked while another thread holds a
 * pool lock or a device lock starts with every lock free and every structure whole, and can
 * allocate at once. Each child runs under a deadline; a child that hangs fails the test
 * instead of hanging it. */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "backend/sim.h"
#include "base/fork.h"
#include "check.h"
#include "core/cp.h"
#include "fixture.h"

#define CAPACITY          (256 * MiB)
#define CHILD_DEADLINE_MS 60000 /* a guard against a hang: a child ends in milliseconds */
#define HOLD_MS           300u  /* how long the other thread keeps the lock */

enum { S1 = 1, S2 = 2, S3 = 3 };

/* Child exit codes. */
enum { CHILD_OK = 0, CHILD_ALLOC_FAILED = 10, CHILD_CHECK_FAILED = 11, CHILD_STATE_WRONG = 12 };

static void sleep_ms(unsigned ms) {
  struct timespec ts = {(time_t)(ms / 1000u), (long)(ms % 1000u) * 1000000L};
  while (nanosleep(&ts, &ts) != 0) {}
}

static long now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (long)ts.tv_sec * 1000L + ts.tv_nsec / 1000000L;
}

/* Wait for `pid` at most CHILD_DEADLINE_MS. Returns its exit code, or -1 when it had to be
 * killed (a deadlock) or died of a signal. */
static int wait_child(pid_t pid) {
  const long deadline = now_ms() + CHILD_DEADLINE_MS;
  int status = 0;
  for (;;) {
    pid_t got = waitpid(pid, &status, WNOHANG);
    if (got == pid) break;
    if (got < 0) return -1;
    if (now_ms() > deadline) {
      fprintf(stderr, "child %d still running after %d ms: deadlocked; killing it\n", (int)pid, CHILD_DEADLINE_MS);
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    sleep_ms(5);
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  fprintf(stderr, "child %d died of signal %d\n", (int)pid, WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  return -1;
}

/* What a child does: use the pool at once, then leave without running exit handlers. */
static void child_use_pool(cp_pool_t *pool, size_t expect_pending_blocks) {
  alarm(CHILD_DEADLINE_MS / 1000 + 1); /* a second guard: the parent kills it anyway */
  cp_pool_info_t info;
  cp_pool_info(pool, &info);
  if (expect_pending_blocks != (size_t)-1 && info.pending_blocks != expect_pending_blocks) _exit(CHILD_STATE_WRONG);
  void *a = NULL, *b = NULL;
  if (cp_alloc(pool, 3000, S1, &a) != CP_OK || cp_alloc(pool, 12 * MiB, S3, &b) != CP_OK) _exit(CHILD_ALLOC_FAILED);
  memset(a, 0x5a, 3000); /* the child's copy of the simulated device is writable */
  if (cp_free(pool, a) != CP_OK || cp_free(pool, b) != CP_OK) _exit(CHILD_ALLOC_FAILED);
  if (cp_empty_cache(pool) != CP_OK) _exit(CHILD_ALLOC_FAILED);
  if (cp_pool_check(pool, stderr) != 0) _exit(CHILD_CHECK_FAILED);
  _exit(CHILD_OK);
}

/* ------------------------------------------------------------------------------------------
 * A thread frees a block recorded on another stream: the event is recorded with the pool lock
 * (and the device lock) held, and the device makes that call last HOLD_MS.
 * ---------------------------------------------------------------------------------------- */

typedef struct holder_s {
  cp_pool_t *pool;
  void *ptr;
  int rc;
} holder_t;

static void *free_recorded_block(void *arg) {
  holder_t *h = arg;
  h->rc = cp_free(h->pool, h->ptr);
  return NULL;
}

TEST(fork_while_another_thread_holds_the_pool_lock) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, CAPACITY, NULL) == 0);
  cp_pool_t *pool = fx.pool;
  cp_sim_t *sim = fx.sim;

  holder_t h = {pool, NULL, -1};
  REQUIRE(cp_alloc(pool, 4 * MiB, S1, &h.ptr) == CP_OK);
  REQUIRE(cp_record_stream(pool, h.ptr, S2) == CP_OK);
  cp_sim_delay_nth(sim, CP_SIM_EVENT_RECORD, 1, HOLD_MS);

  pthread_t t;
  REQUIRE(pthread_create(&t, NULL, free_recorded_block, &h) == 0);
  while (cp_sim_delays_entered(sim) == 0) sleep_ms(1);
  /* The other thread is inside cp_free now, holding the pool lock and the device lock. */
  const unsigned long forks_before = cp_fork_count();
  pid_t pid = fork();
  /* The free finished before the fork: one pending block. That the child sees it is what shows
   * that fork() waited for the free to leave the lock (no clock is read: how long it waited
   * says as much of the machine as of the wait). */
  if (pid == 0) child_use_pool(pool, 1);
  CHECK(pid > 0);
  if (pid > 0) CHECK_EQ_U(wait_child(pid), CHILD_OK);
  pthread_join(t, NULL);
  CHECK_EQ_U(h.rc, CP_OK);
  CHECK_EQ_U(cp_fork_count(), forks_before + 1);

  /* The parent goes on as before. */
  cp_sim_complete_all(sim);
  CHECK(cp_empty_cache(pool) == CP_OK);
  fx_close(&fx);
}

/* ------------------------------------------------------------------------------------------
 * A thread asks the device for its free memory (no pool lock; only the device lock).
 * ---------------------------------------------------------------------------------------- */

static void *ask_mem_info(void *arg) {
  cp_pool_info_t info;
  cp_pool_info((cp_pool_t *)arg, &info);
  return NULL;
}

TEST(fork_while_another_thread_holds_the_device_lock) {
  fixture_t fx;
  REQUIRE(fx_open_sim(&fx, CAPACITY, CP_SIM_AUTO_COMPLETE, NULL) == 0);
  cp_pool_t *pool = fx.pool;
  cp_sim_t *sim = fx.sim;
  cp_sim_delay_nth(sim, CP_SIM_MEM_INFO, 1, HOLD_MS);

  pthread_t t;
  REQUIRE(pthread_create(&t, NULL, ask_mem_info, pool) == 0);
  while (cp_sim_delays_entered(sim) == 0) sleep_ms(1);
  pid_t pid = fork();
  if (pid == 0) child_use_pool(pool, 0);
  CHECK(pid > 0);
  if (pid > 0) CHECK_EQ_U(wait_child(pid), CHILD_OK);
  pthread_join(t, NULL);
  fx_close(&fx);
}

/* ------------------------------------------------------------------------------------------
 * Many forks while several threads hammer two pools.
 * ---------------------------------------------------------------------------------------- */

#define HAMMER_THREADS  4
#define HAMMER_FORKS    60
#define HAMMER_CAPACITY (1024 * MiB) /* > HAMMER_THREADS * 8 live * 12 MiB, with rounding */

typedef struct hammer_s {
  cp_pool_t *pools[2];
  atomic_int stop;
  atomic_long ops;
  atomic_long errors;
} hammer_t;

typedef struct hammer_arg_s {
  hammer_t *hm;
  int id;
} hammer_arg_t;

static void *hammer(void *arg) {
  hammer_arg_t *a = arg;
  hammer_t *hm = a->hm;
  uint64_t x = 0x9e3779b97f4a7c15ull * (uint64_t)(a->id + 1);
  void *live[8] = {0};
  int which[8] = {0};
  while (!atomic_load(&hm->stop)) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    const int slot = (int)(x % 8);
    if (live[slot] != NULL) {
      if (x & 0x100) (void)cp_record_stream(hm->pools[which[slot]], live[slot], S2 + (cp_stream_t)(x >> 20) % 2);
      if (cp_free(hm->pools[which[slot]], live[slot]) != CP_OK) atomic_fetch_add(&hm->errors, 1);
      live[slot] = NULL;
    } else {
      const int p = (int)((x >> 9) & 1);
      const size_t size = (x & 0x200) ? (size_t)(x >> 24) % (12 * MiB) + 1 : (size_t)(x >> 24) % 65536 + 1;
      if (cp_alloc(hm->pools[p], size, S1 + (cp_stream_t)(a->id % 3), &live[slot]) == CP_OK) {
        which[slot] = p;
      } else {
        live[slot] = NULL;
      }
    }
    if ((x & 0xfff) == 0) (void)cp_empty_cache(hm->pools[x & 1]);
    atomic_fetch_add(&hm->ops, 1);
  }
  for (int i = 0; i < 8; i++) {
    if (live[i] != NULL && cp_free(hm->pools[which[i]], live[i]) != CP_OK) atomic_fetch_add(&hm->errors, 1);
  }
  return NULL;
}

TEST(forks_while_threads_allocate) {
  hammer_t hm;
  memset(&hm, 0, sizeof hm);
  fixture_t fx[2];
  for (int i = 0; i < 2; i++) {
    /* Room for every thread's live blocks at once, so that no child meets a full device. */
    REQUIRE(fx_open_sim(&fx[i], HAMMER_CAPACITY, CP_SIM_AUTO_COMPLETE, NULL) == 0);
    hm.pools[i] = fx[i].pool;
  }
  pthread_t threads[HAMMER_THREADS];
  hammer_arg_t args[HAMMER_THREADS];
  for (int i = 0; i < HAMMER_THREADS; i++) {
    args[i] = (hammer_arg_t){&hm, i};
    REQUIRE(pthread_create(&threads[i], NULL, hammer, &args[i]) == 0);
  }
  int children_ok = 0;
  for (int f = 0; f < HAMMER_FORKS; f++) {
    sleep_ms(2);
    pid_t pid = fork();
    if (pid == 0) {
      /* Both pools: whichever the threads were in at the moment of fork. */
      alarm(CHILD_DEADLINE_MS / 1000 + 1);
      void *p = NULL;
      for (int i = 0; i < 2; i++) {
        if (cp_pool_check(hm.pools[i], stderr) != 0) _exit(CHILD_CHECK_FAILED);
        if (cp_alloc(hm.pools[i], 1000, S3, &p) != CP_OK || cp_free(hm.pools[i], p) != CP_OK) _exit(CHILD_ALLOC_FAILED);
      }
      _exit(CHILD_OK);
    }
    CHECK(pid > 0);
    const int code = pid > 0 ? wait_child(pid) : -1;
    if (code == CHILD_OK) {
      children_ok++;
    } else {
      fprintf(stderr, "fork %d: the child ended with %d\n", f, code);
      break; /* one hung or failed child is enough */
    }
  }
  atomic_store(&hm.stop, 1);
  for (int i = 0; i < HAMMER_THREADS; i++) pthread_join(threads[i], NULL);
  CHECK_EQ_U(children_ok, HAMMER_FORKS);
  CHECK_EQ_U(atomic_load(&hm.errors), 0);
  printf("  %d forks during %ld pool operations by %d threads: every child allocated\n", HAMMER_FORKS,
         atomic_load(&hm.ops), HAMMER_THREADS);
  for (int i = 0; i < 2; i++) {
    CHECK(cp_empty_cache(hm.pools[i]) == CP_OK);
    fx_close(&fx[i]);
  }
}

int main(void) {
  RUN(fork_while_another_thread_holds_the_pool_lock);
  RUN(fork_while_another_thread_holds_the_device_lock);
  RUN(forks_while_threads_allocate);
  return check_summary("test_fork");
}
