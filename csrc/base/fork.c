/* fork.c — the lock registry and the handlers that make fork() safe.
 * Owns: taking every registered lock before fork() and releasing them after, in both
 * processes (Note [Locks across fork] in base/fork.h). */
#include "base/fork.h"

#include <stdatomic.h>
#include <stddef.h>

static pthread_once_t fork_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t fork_registry_lock = PTHREAD_MUTEX_INITIALIZER;

/* Invariants: outer[0 .. outer_count) are set and never change once published (the count is
 * stored with release after the entry); heads[level] is a doubly linked list of the
 * registered locks of that level, guarded by fork_registry_lock. */
static pthread_mutex_t *fork_outer[CP_FORK_MAX_OUTER];
static atomic_size_t fork_outer_count;
static cp_fork_lock_t *fork_heads[CP_FORK_LEVEL_COUNT];
static atomic_ulong fork_calls;
/* How many outer locks fork_prepare took: one may be registered while it waits for another. */
static size_t fork_outer_locked;

static void fork_prepare(void) {
  size_t n_outer = atomic_load_explicit(&fork_outer_count, memory_order_acquire);
  for (size_t i = 0; i < n_outer; i++) pthread_mutex_lock(fork_outer[i]);
  pthread_mutex_lock(&fork_registry_lock);
  fork_outer_locked = n_outer;
  for (int level = 0; level < CP_FORK_LEVEL_COUNT; level++) {
    for (cp_fork_lock_t *n = fork_heads[level]; n != NULL; n = n->next) pthread_mutex_lock(n->mutex);
  }
}

/* The same locks in reverse. In the child only the forking thread exists and it holds them
 * all, so unlocking is what makes them usable again. */
static void fork_release_all(void) {
  for (int level = CP_FORK_LEVEL_COUNT - 1; level >= 0; level--) {
    for (cp_fork_lock_t *n = fork_heads[level]; n != NULL; n = n->next) pthread_mutex_unlock(n->mutex);
  }
  const size_t n_outer = fork_outer_locked;
  pthread_mutex_unlock(&fork_registry_lock);
  for (size_t i = n_outer; i-- > 0;) pthread_mutex_unlock(fork_outer[i]);
}

/* Parent and child do the same: count the fork, release every lock. */
static void fork_after(void) {
  atomic_fetch_add_explicit(&fork_calls, 1, memory_order_relaxed);
  fork_release_all();
}

static void fork_install(void) { (void)pthread_atfork(fork_prepare, fork_after, fork_after); }

void cp_fork_register(cp_fork_lock_t *node, pthread_mutex_t *mutex, cp_fork_level_t level) {
  if (node == NULL || mutex == NULL || (int)level < 0 || level >= CP_FORK_LEVEL_COUNT) return;
  pthread_once(&fork_once, fork_install);
  node->mutex = mutex;
  node->level = level;
  node->prev = NULL;
  pthread_mutex_lock(&fork_registry_lock);
  node->next = fork_heads[level];
  if (node->next != NULL) node->next->prev = node;
  fork_heads[level] = node;
  pthread_mutex_unlock(&fork_registry_lock);
}

void cp_fork_unregister(cp_fork_lock_t *node) {
  if (node == NULL || node->mutex == NULL) return;
  pthread_mutex_lock(&fork_registry_lock);
  if (node->prev != NULL) {
    node->prev->next = node->next;
  } else {
    fork_heads[node->level] = node->next;
  }
  if (node->next != NULL) node->next->prev = node->prev;
  pthread_mutex_unlock(&fork_registry_lock);
  node->mutex = NULL;
  node->prev = node->next = NULL;
}

void cp_fork_register_outer(pthread_mutex_t *mutex) {
  if (mutex == NULL) return;
  pthread_once(&fork_once, fork_install);
  pthread_mutex_lock(&fork_registry_lock);
  size_t n = atomic_load_explicit(&fork_outer_count, memory_order_relaxed);
  int known = 0;
  for (size_t i = 0; i < n; i++) known |= fork_outer[i] == mutex;
  if (!known && n < CP_FORK_MAX_OUTER) {
    fork_outer[n] = mutex;
    atomic_store_explicit(&fork_outer_count, n + 1, memory_order_release);
  }
  pthread_mutex_unlock(&fork_registry_lock);
}

unsigned long cp_fork_count(void) { return atomic_load_explicit(&fork_calls, memory_order_relaxed); }
