/* region.h — the names of tagged regions and the region each thread allocates in (region.c). */
#ifndef CP_REGION_H
#define CP_REGION_H

#include <stdint.h>

#include "core/cp.h"

/* The calling thread's region (0: none), read by the entry points that allocate. */
extern _Thread_local uint32_t cp_region_tls;
static inline uint32_t cp_region_current(void) { return cp_region_tls; }

#endif /* CP_REGION_H */
