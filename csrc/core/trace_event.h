/* trace_event.h — one event of an allocation trace: the record the replay reads (replay.c),
 * the pool's event log keeps (oom.c), the fake GPU of `ab --simulate` writes (csrc/fakecuda)
 * and cudapool.lab._events packs and unpacks in Python (40 bytes, little-endian on disk).
 * Only the record, so that a library built against torch can include it without the rest of
 * cp.h; plain C that C++ includes as it is. */
#ifndef CP_TRACE_EVENT_H
#define CP_TRACE_EVENT_H

#include <stdint.h>

/* RELEASE: the recorded program gave cached memory back there (torch's empty_cache, or its
 * out-of-memory retry: a snapshot's segment_free/segment_unmap); id, size and stream are 0.
 * The replay calls cp_empty_cache at it. */
enum { CP_TRACE_ALLOC = 0, CP_TRACE_FREE = 1, CP_TRACE_RELEASE = 3 };

typedef struct cp_trace_event_s {
  uint8_t action; /* CP_TRACE_ALLOC, CP_TRACE_FREE or CP_TRACE_RELEASE */
  uint8_t pad[3];
  int32_t device;
  uint64_t id;   /* names one allocation from alloc to free */
  uint64_t size; /* requested bytes */
  uint64_t stream;
  int64_t time_ns; /* -1 when unknown */
} cp_trace_event_t;

#endif
