/* check.h — the invariant checker (check.c). */
#ifndef CP_CHECK_H
#define CP_CHECK_H

#include <stdio.h>

#include "core/state.h"

/* The checker (check.c). */
size_t cp_check_locked(cp_pool_t *pool, FILE *out);

#ifdef CP_CHECK_EVERY_OP
void cp_check_or_abort_locked(cp_pool_t *pool, const char *where);
#define CP_DEBUG_CHECK(pool, where) cp_check_or_abort_locked((pool), (where))
#else
#define CP_DEBUG_CHECK(pool, where) ((void)0)
#endif

#endif /* CP_CHECK_H */
