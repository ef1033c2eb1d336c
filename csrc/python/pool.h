/* pool.h — the Pool object (pool.c), shared with the methods that read a pool's snapshot and
 * history (pool_snapshot.c) and those that drive a simulated pool (pool_sim.c). */
#ifndef CPY_POOL_H
#define CPY_POOL_H

#include "python/state.h"

#include "backend/sim.h"
#include "core/cp.h"

typedef struct pool_object_s {
  PyObject_HEAD int device; /* >= 0: a handle naming that device; -1: a simulated pool */
  cp_sim_t *sim;            /* simulated pool: the device; NULL once closed */
  cp_pool_t *pool;          /* simulated pool: the pool; NULL once closed; destroyed before sim */
  size_t capacity;          /* simulated pool: the device's capacity */
  cp_replay_t *replay;      /* simulated pool: the replay under way, or NULL; destroyed before pool */
} PoolObject;

/* The pool-handle type, cudapool._C.Pool. */
extern PyType_Spec cpy_pool_spec;
/* Make cpy_pool_spec's method table; before the type is made. -1 with an exception. */
int cpy_pool_spec_prepare(void);

/* A new Pool handle naming device `device` (0 <= device < CP_MAX_DEVICES) of the
 * process-wide table. */
PyObject *cpy_pool_for_device(cpy_state *st, int device);

/* {pool block state: torch's block state, or None where torch shows no memory} (Note [Torch's
 * segments] in core/snapshot.h): the module's TORCH_BLOCK_STATES (pool_snapshot.c). */
PyObject *cpy_pool_torch_block_states(void);

/* A cudapool error for `status` (the last error's text), as the module raises them. */
PyObject *cpy_pool_raise_status(PyObject *op, int status);
/* `what` needs a simulated pool: TypeError on a device handle, ValueError once closed. */
int cpy_pool_require_sim(PoolObject *self, const char *what);

/* The pool a method of either kind acts on: *out NULL for a device without a pool (not an
 * error); -1 with ValueError once closed. */
int cpy_pool_resolve(PoolObject *self, cp_pool_t **out);
#define ANY_POOL(op, self, pool)         \
  PoolObject *self = (PoolObject *)(op); \
  cp_pool_t *pool;                       \
  if (cpy_pool_resolve(self, &pool) < 0) return NULL
#define SIM_ONLY(op, self, what)         \
  PoolObject *self = (PoolObject *)(op); \
  if (cpy_pool_require_sim(self, what) < 0) return NULL

/* The methods that read a pool's snapshot and history, of either kind (pool_snapshot.c), and
 * those that drive a simulated pool (pool_sim.c), NULL-terminated; pool.c joins them to its own
 * for the type. */
extern PyMethodDef cpy_pool_snapshot_methods[];
extern PyMethodDef cpy_pool_sim_methods[];

#endif /* CPY_POOL_H */
