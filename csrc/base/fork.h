/* fork.h — every lock of the process that fork() must not copy while held.
 * Owns: the lock registry and the fork handlers (fork.c). Pure C11 + pthreads. */
#ifndef CP_FORK_H
#define CP_FORK_H

#include <pthread.h>

/* Note [Locks across fork]
 * fork() copies only the calling thread. A mutex another thread held at that moment stays
 * held forever in the child, and the child's next allocation would hang. So before fork()
 * the forking thread takes every lock cudapool has, in the one global order below, and
 * releases them on both sides afterwards: the child starts with every structure consistent
 * and every lock free.
 *
 * The order (outermost first) is the order the code itself nests locks in:
 *   1. outer locks (the device table), registered once and never removed;
 *   2. the registry's own lock;
 *   3. pool locks;
 *   4. backend locks (a pool calls its backend with its lock held).
 * Registering or unregistering a pool or backend takes the registry lock, so it may happen
 * with an outer lock held but never with a pool or backend lock held. */

typedef enum cp_fork_level_e {
  CP_FORK_LEVEL_POOL = 0,
  CP_FORK_LEVEL_BACKEND = 1,
  CP_FORK_LEVEL_COUNT = 2
} cp_fork_level_t;

/* One registered lock; lives inside the structure the lock guards. */
typedef struct cp_fork_lock_s {
  pthread_mutex_t *mutex;
  cp_fork_level_t level;
  struct cp_fork_lock_s *prev;
  struct cp_fork_lock_s *next;
} cp_fork_lock_t;

/* Hold `mutex` across fork() as a lock of `level`. `node` is the caller's storage and must
 * stay put until cp_fork_unregister. */
void cp_fork_register(cp_fork_lock_t *node, pthread_mutex_t *mutex, cp_fork_level_t level);
void cp_fork_unregister(cp_fork_lock_t *node);

/* An outer lock with static storage duration, taken before all others; never removed. At most
 * CP_FORK_MAX_OUTER of them; registering the same mutex twice is a no-op. */
#define CP_FORK_MAX_OUTER 8
void cp_fork_register_outer(pthread_mutex_t *mutex);

/* How many fork() calls the handlers saw in this process (for tests). */
unsigned long cp_fork_count(void);

#endif /* CP_FORK_H */
