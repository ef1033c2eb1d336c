/* report.c — the out-of-memory report: where the memory is, in words a user can act on.
 * Owns: the report's text (cp_oom_format, written from an out-of-memory record only) and the one
 * byte formatter of the C library. */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>

#include "core/oom.h"

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

/* snprintf onto the end of what is written so far, keeping snprintf's return rule. */
static void cp_append(char *buf, size_t buf_size, int *n, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;
static void cp_append(char *buf, size_t buf_size, int *n, const char *fmt, ...) {
  if (*n < 0) return;
  size_t at = (size_t)*n < buf_size ? (size_t)*n : buf_size;
  va_list ap;
  va_start(ap, fmt);
  int m = vsnprintf(at < buf_size ? buf + at : NULL, at < buf_size ? buf_size - at : 0, fmt, ap);
  va_end(ap);
  *n = m < 0 ? m : *n + m;
}

static void cp_append_stream(char *buf, size_t buf_size, int *n, const cp_oom_stream_t *s, const char *label) {
  char cached[32], largest[32], pend[32];
  cp_append(buf, buf_size, n, "%s: %s free in %zu block%s (largest %s), %s waiting in %zu block%s", label,
            cp_fmt_bytes(cached, sizeof cached, s->cached_free), s->free_blocks, cp_plural(s->free_blocks),
            cp_fmt_bytes(largest, sizeof largest, s->largest_free_block),
            cp_fmt_bytes(pend, sizeof pend, s->pending_free), s->pending_blocks, cp_plural(s->pending_blocks));
}

int cp_oom_format(const cp_oom_info_t *in, char *buf, size_t buf_size) {
  if (buf_size != 0) buf[0] = '\0';
  char req[32], tot[32], dfree[32], res[32], alloc[32], cached[32], largest[32], pend[32], cap[32];
  int n = 0;
  cp_append(buf, buf_size, &n,
            "Tried to allocate %s (%zu bytes) on stream %#jx. Device %d (%s) has a total capacity of %s of which %s "
            "is free. cudapool holds %s reserved in %zu segment%s: %s allocated to %zu live block%s, %s cached but "
            "free in %zu block%s (largest free block %s, fragmentation %.1f%%), %s waiting for stream events in %zu "
            "block%s. Memory cap: %s.",
            cp_fmt_bytes(req, sizeof req, in->requested), in->requested, (uintmax_t)in->stream, in->device,
            in->backend != NULL ? in->backend : "?",
            in->device_total ? cp_fmt_bytes(tot, sizeof tot, in->device_total) : "unknown",
            in->device_total ? cp_fmt_bytes(dfree, sizeof dfree, in->device_free) : "unknown",
            cp_fmt_bytes(res, sizeof res, in->reserved), in->segments, cp_plural(in->segments),
            cp_fmt_bytes(alloc, sizeof alloc, in->allocated), in->live_blocks, cp_plural(in->live_blocks),
            cp_fmt_bytes(cached, sizeof cached, in->cached_free), in->free_blocks, cp_plural(in->free_blocks),
            cp_fmt_bytes(largest, sizeof largest, in->largest_free_block), 100.0 * in->fragmentation,
            cp_fmt_bytes(pend, sizeof pend, in->pending_free), in->pending_blocks, cp_plural(in->pending_blocks),
            in->memory_cap ? cp_fmt_bytes(cap, sizeof cap, in->memory_cap) : "none");
  if (in->paused != 0) {
    char paused[32];
    cp_append(buf, buf_size, &n,
              " Paused regions gave back %s (their blocks are counted above, with no memory behind them until "
              "resumed).",
              cp_fmt_bytes(paused, sizeof paused, in->paused));
  }
  /* Where the unused bytes are: they serve only their own stream. */
  if (in->cached_free + in->pending_free != 0) {
    cp_append(buf, buf_size, &n, " By stream:");
    const char *sep = " ";
    size_t request_largest = 0;
    for (size_t i = 0; i < in->stream_count; i++) {
      const cp_oom_stream_t *s = &in->streams[i];
      if (s->stream == in->stream) request_largest = s->largest_free_block;
      if (s->cached_free + s->pending_free == 0) continue;
      char label[64];
      snprintf(label, sizeof label, "%sstream %#jx%s", sep, (uintmax_t)s->stream,
               s->stream == in->stream ? " (this request's)" : "");
      cp_append_stream(buf, buf_size, &n, s, label);
      sep = "; ";
    }
    if (in->other_streams != 0 && in->other.cached_free + in->other.pending_free != 0) {
      char label[64];
      snprintf(label, sizeof label, "%s%zu other stream%s", sep, in->other_streams, cp_plural(in->other_streams));
      cp_append_stream(buf, buf_size, &n, &in->other, label);
    }
    cp_append(buf, buf_size, &n, ".");
    /* Facts about the shape of the free memory, when enough of it is cached. */
    if (in->rounded != 0 && in->cached_free >= in->rounded) {
      if (in->largest_free_block < in->rounded) {
        cp_append(buf, buf_size, &n,
                  " The free memory is fragmented: enough bytes are cached, but no free block is large enough.");
      } else if (request_largest < in->rounded) {
        cp_append(buf, buf_size, &n, " A free block large enough is cached, but for another stream.");
      }
    }
  }
  return n;
}

int cp_pool_oom_report(cp_pool_t *pool, size_t size, char *buf, size_t buf_size) {
  cp_oom_info_t in;
  cp_pool_oom_now(pool, size, 0, &in);
  return cp_oom_format(&in, buf, buf_size);
}
