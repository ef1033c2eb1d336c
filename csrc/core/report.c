/* report.c — the out-of-memory report: where the memory is, in words a user can act on.
 * Owns: cp_pool_oom_report and the one byte formatter of the C library. */
#include <stdio.h>

#include "core/cp_internal.h"

/* "1.50 GiB"-style text for a byte count. */
static const char *cp_fmt_bytes(char *buf, size_t n, size_t bytes) {
  static const char *const units[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = (double)bytes;
  int u = 0;
  while (v >= 1024.0 && u < 6) {
    v /= 1024.0;
    u++;
  }
  if (u == 0)
    snprintf(buf, n, "%zu bytes", bytes);
  else
    snprintf(buf, n, "%.2f %s", v, units[u]);
  return buf;
}

static const char *cp_plural(size_t n) { return n == 1 ? "" : "s"; }

int cp_pool_oom_report(cp_pool_t *pool, size_t size, char *buf, size_t buf_size) {
  cp_pool_info_t in;
  cp_pool_info(pool, &in);
  char req[32], tot[32], dfree[32], res[32], alloc[32], cached[32], largest[32], pend[32], cap[32];
  double frag = in.cached_free ? 1.0 - (double)in.largest_free_block / (double)in.cached_free : 0.0;
  int n = snprintf(buf, buf_size,
                   "Tried to allocate %s (%zu bytes). Device %d (%s) has a total capacity of %s of which %s is free. "
                   "cudapool holds %s reserved in %zu segment%s: %s allocated to %zu live block%s, %s cached but free "
                   "in %zu block%s (largest free block %s, fragmentation %.1f%%), %s waiting for stream events "
                   "in %zu block%s. Memory cap: %s.",
                   cp_fmt_bytes(req, sizeof req, size), size, pool->backend.device, pool->backend.name,
                   in.device_total ? cp_fmt_bytes(tot, sizeof tot, in.device_total) : "unknown",
                   in.device_total ? cp_fmt_bytes(dfree, sizeof dfree, in.device_free) : "unknown",
                   cp_fmt_bytes(res, sizeof res, in.reserved), in.segments, cp_plural(in.segments),
                   cp_fmt_bytes(alloc, sizeof alloc, in.allocated), in.live_blocks, cp_plural(in.live_blocks),
                   cp_fmt_bytes(cached, sizeof cached, in.cached_free), in.free_blocks, cp_plural(in.free_blocks),
                   cp_fmt_bytes(largest, sizeof largest, in.largest_free_block), 100.0 * frag,
                   cp_fmt_bytes(pend, sizeof pend, in.pending_free), in.pending_blocks, cp_plural(in.pending_blocks),
                   in.memory_cap ? cp_fmt_bytes(cap, sizeof cap, in.memory_cap) : "none");
  if (n >= 0 && (size_t)n < buf_size && in.cached_free >= size && in.largest_free_block < size) {
    n += snprintf(buf + n, buf_size - (size_t)n,
                  " The free memory is fragmented: enough bytes are cached, but no free block is large "
                  "enough; setting max_split_size_mb can keep large blocks whole.");
  }
  return n;
}
