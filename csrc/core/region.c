/* region.c — tagged regions: the process-wide table of their names, and the region each thread
 * allocates in. Owns: tag ids (1 .. CP_REGION_MAX) and the thread's current one. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "base/fork.h"
#include "core/cp.h"

/* Note [Regions]
 * A region is a name a program gives to some of its allocations ("kv_cache", "weights"): every
 * allocation made by a thread while it is inside the region (cp_region_enter) is served from
 * memory of that region only, so that the region's physical memory can later be given back
 * and mapped again at the same addresses (pause.c). A pool keeps a region apart the way it
 * keeps streams apart: by stream state, one per (stream, region) (stream.c), so its blocks,
 * page-mapped segments and stitched ranges are never shared with another region or with
 * untagged memory. The names are process-wide (ids are the same in every pool and on every
 * device) and never forgotten: a program names a handful. Which region a thread is in is the
 * thread's own, as torch's current stream is. */

static _Thread_local uint32_t cp_region_tls; /* the calling thread's region, 0: none */

static pthread_mutex_t cp_region_lock = PTHREAD_MUTEX_INITIALIZER;
static char *cp_region_names[CP_REGION_MAX + 1]; /* [0] unused */
static uint32_t cp_region_count;

int cp_region_id(const char *name, uint32_t *out_id) {
  if (name == NULL || out_id == NULL) return cp_set_error(CP_ERR_INVALID, "cp_region_id: NULL argument");
  const size_t len = strlen(name);
  if (len == 0 || len > CP_REGION_NAME_MAX) {
    return cp_set_error(CP_ERR_INVALID, "a region's name has 1 to %d characters, not %zu", CP_REGION_NAME_MAX, len);
  }
  for (size_t i = 0; i < len; i++) {
    const unsigned char c = (unsigned char)name[i];
    if (c < 0x20 || c == 0x7f) return cp_set_error(CP_ERR_INVALID, "a region's name has no control characters");
  }
  cp_fork_register_outer(&cp_region_lock);
  pthread_mutex_lock(&cp_region_lock);
  int rc = CP_OK;
  uint32_t id = 0;
  for (uint32_t i = 1; i <= cp_region_count && id == 0; i++) {
    if (strcmp(cp_region_names[i], name) == 0) id = i;
  }
  if (id == 0 && cp_region_count == CP_REGION_MAX) {
    rc = cp_set_error(CP_ERR_INVALID, "region \"%s\": a process names at most %d regions", name, CP_REGION_MAX);
  } else if (id == 0) {
    char *copy = malloc(len + 1);
    if (copy == NULL) {
      rc = cp_set_error(CP_ERR_HOST_OOM, "cp_region_id: no host memory");
    } else {
      memcpy(copy, name, len + 1);
      id = ++cp_region_count;
      cp_region_names[id] = copy;
    }
  }
  pthread_mutex_unlock(&cp_region_lock);
  if (rc == CP_OK) *out_id = id;
  return rc;
}

const char *cp_region_name(uint32_t id) {
  pthread_mutex_lock(&cp_region_lock);
  const char *name = id >= 1 && id <= cp_region_count ? cp_region_names[id] : NULL;
  pthread_mutex_unlock(&cp_region_lock);
  return name; /* names are never freed: the pointer stays good */
}

uint32_t cp_region_enter(uint32_t id) {
  const uint32_t previous = cp_region_tls;
  cp_region_tls = id;
  return previous;
}

uint32_t cp_region_of_thread(void) { return cp_region_tls; }
