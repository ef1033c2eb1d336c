/* sim_vmm.c — page-mapped memory of the simulated device: address ranges, pages and mappings.
 * Owns: the VMM entries of its operation table, Note [Simulated page-mapped memory] in sim.h. */
#define _GNU_SOURCE /* memfd_create, MAP_ANONYMOUS, MAP_NORESERVE, in this file only */

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "backend/sim_internal.h"

#define SIM_VMM_GRANULARITY ((size_t)2 << 20) /* the default, what current GPUs report */
#define SIM_VMM_MIN_GRANULE ((size_t)4096)
#define SIM_PAGE_FILE_NAME  "cudapool-sim-page"

/* ------------------------------------------------------------------------------------------
 * Helpers (all called with the device lock held)
 * ---------------------------------------------------------------------------------------- */

static int vmm_real(const cp_sim_t *sim) { return !(sim->flags & CP_SIM_NO_TOUCH); }

static int vmm_aligned(const cp_sim_t *sim, uintptr_t v) { return (v & (sim->vmm.granularity - 1)) == 0; }

/* The text of errno value `err` (strerror is not thread-safe). */
static const char *vmm_strerror(int err, char *buf, size_t n) {
#if defined(__GLIBC__)
  return strerror_r(err, buf, n); /* the GNU variant under _GNU_SOURCE: may return a static string */
#else
  return strerror_r(err, buf, n) == 0 ? buf : "unknown error";
#endif
}

/* A host call failed with `err`: CP_ERR_BACKEND, "sim: <what>: <syscall>: <errno text>". */
static int vmm_host_fail(const char *what, const char *syscall_name, int err) {
  char buf[128];
  return cp_set_error(CP_ERR_BACKEND, "sim: %s: %s failed: %s", what, syscall_name, vmm_strerror(err, buf, sizeof buf));
}

/* The page-mapped call hook: counts the call (cp_sim_enter_locked) and fixes the granularity. */
static int vmm_enter(cp_sim_t *sim, cp_sim_call_t kind) {
  sim->vmm.started = 1;
  return cp_sim_enter_locked(sim, kind);
}

/* CP_OK when [addr, addr + size) is non-empty, granularity-aligned and does not wrap; else
 * CP_ERR_INVALID with "sim: <what>: <reason>". */
static int vmm_check_span(const cp_sim_t *sim, const char *what, uintptr_t addr, size_t size) {
  if (size == 0 || !vmm_aligned(sim, size))
    return cp_set_error(CP_ERR_INVALID, "sim: %s: the size must be a positive multiple of the granularity (%zu bytes)",
                        what, sim->vmm.granularity);
  if (addr == 0 || !vmm_aligned(sim, addr))
    return cp_set_error(CP_ERR_INVALID, "sim: %s: the address is not a multiple of the granularity (%zu bytes)", what,
                        sim->vmm.granularity);
  if (size > UINTPTR_MAX - addr) return cp_set_error(CP_ERR_INVALID, "sim: %s: the span wraps around", what);
  return CP_OK;
}

/* What lies in [addr, end): cp_ptrmap_each over the ranges or the mappings. */
typedef struct vmm_scan_s {
  uintptr_t addr, end;
  int mark_access;  /* mappings: set `access` on every one found (the map is unchanged) */
  uintptr_t *keys;  /* mappings: where to write the addresses of those found, or NULL */
  size_t count;     /* entries overlapping the span */
  size_t bytes;     /* their sizes, summed */
  uintptr_t holder; /* ranges: the one holding the whole span, 0 when none */
  int cut;          /* mappings: one overlaps the span without lying wholly inside */
  uintptr_t cut_addr;
} vmm_scan_t;

static void vmm_scan_range(uintptr_t key, void *value, void *arg) {
  vmm_scan_t *s = arg;
  const size_t size = (size_t)(uintptr_t)value;
  if (key <= s->addr && s->end <= key + size) s->holder = key;
}

static void vmm_scan_mapping(uintptr_t key, void *value, void *arg) {
  vmm_scan_t *s = arg;
  sim_mapping_t *m = value;
  if (key >= s->end || key + m->size <= s->addr) return;
  if (key < s->addr || key + m->size > s->end) {
    s->cut = 1;
    s->cut_addr = key;
  }
  if (s->keys != NULL) s->keys[s->count] = key;
  if (s->mark_access) m->access = 1;
  s->count++;
  s->bytes += m->size;
}

/* vmm_scan_mapping on every mapping overlapping [s->addr, s->end). Mappings start at
 * multiples of the granularity and none is longer than max_mapping, so when that takes fewer
 * steps than there are mappings, the addresses where one could start are looked up one by one
 * instead of walking the whole table. */
static void vmm_scan_overlapping(const cp_sim_t *sim, vmm_scan_t *s) {
  const size_t g = sim->vmm.granularity;
  const size_t back = sim->vmm.max_mapping > g ? sim->vmm.max_mapping - g : 0;
  const size_t steps = (s->end - s->addr + back) / g;
  if (steps >= sim->vmm.mappings.count) {
    cp_ptrmap_each(&sim->vmm.mappings, vmm_scan_mapping, s);
    return;
  }
  for (uintptr_t a = s->addr >= back ? s->addr - back : 0; a < s->end; a += g) {
    sim_mapping_t *m = cp_ptrmap_get(&sim->vmm.mappings, a);
    if (m != NULL) vmm_scan_mapping(a, m, s);
  }
}

static vmm_scan_t vmm_scan(const cp_sim_t *sim, uintptr_t addr, size_t size) {
  vmm_scan_t s;
  memset(&s, 0, sizeof s);
  s.addr = addr;
  s.end = addr + size;
  vmm_scan_overlapping(sim, &s);
  return s;
}

/* The start of the reserved range holding all of [addr, addr + size), 0 when none does. The
 * range found last is looked at first: calls come in runs on one range. */
static uintptr_t vmm_holder(cp_sim_t *sim, uintptr_t addr, size_t size) {
  const uintptr_t hint = sim->vmm.last_range;
  if (hint != 0 && hint <= addr) {
    const size_t len = (size_t)(uintptr_t)cp_ptrmap_get(&sim->vmm.ranges, hint);
    if (len != 0 && addr + size <= hint + len) return hint;
  }
  vmm_scan_t s;
  memset(&s, 0, sizeof s);
  s.addr = addr;
  s.end = addr + size;
  cp_ptrmap_each(&sim->vmm.ranges, vmm_scan_range, &s);
  if (s.holder != 0) sim->vmm.last_range = s.holder;
  return s.holder;
}

/* The page's memory goes back to the device: it is released and mapped nowhere. */
static void vmm_page_free(cp_sim_t *sim, cp_page_t page) {
  sim_page_t *pg = cp_ptrmap_remove(&sim->vmm.pages, page);
  if (pg->fd >= 0) (void)close(pg->fd);
  sim->used_bytes -= pg->size;
  sim->vmm.page_bytes -= pg->size;
  free(pg);
}

/* ------------------------------------------------------------------------------------------
 * Backend entries
 * ---------------------------------------------------------------------------------------- */

static int sim_vmm_granularity(void *ctx, size_t *out_bytes) {
  cp_sim_t *sim = ctx;
  if (sim == NULL) return cp_set_error(CP_ERR_INVALID, "sim: vmm_granularity: no device");
  sim_lock(sim);
  int rc = vmm_enter(sim, CP_SIM_VMM_GRANULARITY);
  if (rc == CP_OK && out_bytes == NULL) rc = cp_set_error(CP_ERR_INVALID, "sim: vmm_granularity: out_bytes is NULL");
  if (rc == CP_OK) *out_bytes = sim->vmm.granularity;
  sim_unlock(sim);
  return rc;
}

static int sim_va_reserve(void *ctx, size_t size, uintptr_t *out_addr) {
  cp_sim_t *sim = ctx;
  if (sim == NULL) return cp_set_error(CP_ERR_INVALID, "sim: va_reserve: no device");
  char what[96];
  snprintf(what, sizeof what, "va_reserve(%zu bytes)", size);
  sim_lock(sim);
  sim->bytes[CP_SIM_VA_RESERVE] += size;
  int rc = vmm_enter(sim, CP_SIM_VA_RESERVE);
  if (rc != CP_OK) goto out;
  const size_t gran = sim->vmm.granularity;
  if (out_addr == NULL) {
    rc = cp_set_error(CP_ERR_INVALID, "sim: %s: out_addr is NULL", what);
    goto out;
  }
  if (size == 0 || !vmm_aligned(sim, size) || size > SIZE_MAX - gran) {
    rc = cp_set_error(CP_ERR_INVALID, "sim: %s: the size must be a positive multiple of the granularity (%zu bytes)",
                      what, gran);
    goto out;
  }
  if (cp_ptrmap_reserve(&sim->vmm.ranges, 1) != CP_OK) {
    rc = cp_set_error(CP_ERR_BACKEND, "sim: %s: host memory for the range table is short", what);
    goto out;
  }

  uintptr_t addr;
  if (vmm_real(sim)) {
    /* Over-reserve by one granule, then trim both ends to an aligned span of `size`. */
    void *p = mmap(NULL, size + gran, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      rc = vmm_host_fail(what, "mmap(PROT_NONE, MAP_NORESERVE)", errno);
      goto out;
    }
    const uintptr_t start = (uintptr_t)p;
    addr = (start + gran - 1) & ~(uintptr_t)(gran - 1);
    if (addr > start) (void)munmap(p, addr - start);
    if (start + gran > addr) (void)munmap((void *)(addr + size), start + gran - addr);
  } else {
    /* Fake addresses from the reservations' bump pointer, which stays 2 MiB aligned. */
    const uintptr_t align = gran > SIM_FAKE_ALIGN_BYTES ? gran : SIM_FAKE_ALIGN_BYTES;
    const uintptr_t base = (sim->next_fake_addr + align - 1) & ~(align - 1);
    if (base < sim->next_fake_addr || (uintptr_t)size > UINTPTR_MAX - base - SIM_FAKE_ALIGN_BYTES) {
      rc = cp_set_error(CP_ERR_OOM, "sim: %s: fake address space exhausted", what);
      goto out;
    }
    addr = base;
    sim->next_fake_addr = base + (((uintptr_t)size + SIM_FAKE_ALIGN_BYTES - 1) & ~(SIM_FAKE_ALIGN_BYTES - 1));
  }
  (void)cp_ptrmap_insert(&sim->vmm.ranges, addr, (void *)(uintptr_t)size); /* room made above */
  *out_addr = addr;
out:
  sim_unlock(sim);
  return rc;
}

static int sim_va_free(void *ctx, uintptr_t addr, size_t size) {
  cp_sim_t *sim = ctx;
  if (sim == NULL) return cp_set_error(CP_ERR_INVALID, "sim: va_free: no device");
  char what[96];
  snprintf(what, sizeof what, "va_free(0x%" PRIxPTR ", %zu bytes)", addr, size);
  sim_lock(sim);
  sim->bytes[CP_SIM_VA_FREE] += size;
  int rc = vmm_enter(sim, CP_SIM_VA_FREE);
  if (rc == CP_OK) rc = cp_sim_refuse_if_capturing_locked(sim, CP_SIM_VA_FREE);
  if (rc != CP_OK) goto out;
  const void *value = cp_ptrmap_get(&sim->vmm.ranges, addr);
  if (value == NULL) {
    rc = cp_set_error(CP_ERR_INVALID, "sim: %s: no range was reserved at this address", what);
    goto out;
  }
  if ((size_t)(uintptr_t)value != size) {
    rc = cp_set_error(CP_ERR_INVALID, "sim: %s: the range was reserved with %zu bytes", what, (size_t)(uintptr_t)value);
    goto out;
  }
  const vmm_scan_t s = vmm_scan(sim, addr, size);
  if (s.count != 0) {
    rc = cp_set_error(CP_ERR_INVALID, "sim: %s: the range still has %zu mapping%s (%zu bytes); unmap them first", what,
                      s.count, s.count == 1 ? "" : "s", s.bytes);
    goto out;
  }
  if (vmm_real(sim) && munmap((void *)addr, size) != 0) {
    rc = vmm_host_fail(what, "munmap", errno);
    goto out;
  }
  (void)cp_ptrmap_remove(&sim->vmm.ranges, addr);
out:
  sim_unlock(sim);
  return rc;
}

static int sim_page_create(void *ctx, size_t size, cp_page_t *out_page) {
  cp_sim_t *sim = ctx;
  if (sim == NULL) return cp_set_error(CP_ERR_INVALID, "sim: page_create: no device");
  char what[96];
  snprintf(what, sizeof what, "page_create(%zu bytes)", size);
  sim_lock(sim);
  sim->bytes[CP_SIM_PAGE_CREATE] += size;
  int rc = vmm_enter(sim, CP_SIM_PAGE_CREATE);
  if (rc != CP_OK) goto out;
  if (out_page == NULL) {
    rc = cp_set_error(CP_ERR_INVALID, "sim: %s: out_page is NULL", what);
    goto out;
  }
  if (size == 0 || !vmm_aligned(sim, size)) {
    rc = cp_set_error(CP_ERR_INVALID, "sim: %s: the size must be a positive multiple of the granularity (%zu bytes)",
                      what, sim->vmm.granularity);
    goto out;
  }
  if (size > sim->capacity_bytes - sim->used_bytes) {
    rc = cp_set_error(CP_ERR_OOM, "sim: %s: out of memory (%zu of %zu bytes used)", what, sim->used_bytes,
                      sim->capacity_bytes);
    goto out;
  }
  sim_page_t *pg = malloc(sizeof *pg);
  if (pg == NULL || cp_ptrmap_reserve(&sim->vmm.pages, 1) != CP_OK) {
    free(pg);
    rc = cp_set_error(CP_ERR_BACKEND, "sim: %s: host memory for the page table is short", what);
    goto out;
  }
  pg->size = size;
  pg->fd = -1;
  pg->released = 0;
  pg->maps = 0;
  if (vmm_real(sim)) {
    pg->fd = memfd_create(SIM_PAGE_FILE_NAME, MFD_CLOEXEC);
    if (pg->fd < 0) {
      rc = vmm_host_fail(what, "memfd_create", errno);
      free(pg);
      goto out;
    }
    if (ftruncate(pg->fd, (off_t)size) != 0) {
      rc = vmm_host_fail(what, "ftruncate of the page's memfd", errno);
      (void)close(pg->fd);
      free(pg);
      goto out;
    }
  }
  const cp_page_t page = sim->vmm.next_page_id++;
  (void)cp_ptrmap_insert(&sim->vmm.pages, page, pg); /* room made above */
  sim->used_bytes += size;
  sim->vmm.page_bytes += size;
  *out_page = page;
out:
  sim_unlock(sim);
  return rc;
}

static int sim_page_release(void *ctx, cp_page_t page) {
  cp_sim_t *sim = ctx;
  if (sim == NULL) return cp_set_error(CP_ERR_INVALID, "sim: page_release: no device");
  sim_lock(sim);
  int rc = vmm_enter(sim, CP_SIM_PAGE_RELEASE);
  if (rc != CP_OK && sim->lost) goto out;
  /* A failed release still ends the handle (Note [Simulated asynchrony] in sim.h): the driver
   * may have released it before failing, so releasing it again is a fault. */
  sim_page_t *pg = cp_ptrmap_get(&sim->vmm.pages, page);
  if (pg == NULL || pg->released) {
    if (page != 0 && page < sim->vmm.next_page_id)
      cp_sim_fault_locked(sim, "page handle released twice", "page_release", page, 0, 0);
    const int bad = cp_set_error(CP_ERR_INVALID, "sim: page_release(page %" PRIuPTR "): %s", page,
                                 pg == NULL ? "unknown page" : "the page was released already");
    if (rc == CP_OK) rc = bad;
    goto out;
  }
  sim->bytes[CP_SIM_PAGE_RELEASE] += pg->size;
  pg->released = 1;
  if (pg->maps == 0) vmm_page_free(sim, page); /* else the last unmap frees it */
out:
  sim_unlock(sim);
  return rc;
}

static int sim_page_map(void *ctx, uintptr_t addr, size_t size, cp_page_t page) {
  cp_sim_t *sim = ctx;
  if (sim == NULL) return cp_set_error(CP_ERR_INVALID, "sim: page_map: no device");
  char what[128];
  snprintf(what, sizeof what, "page_map(0x%" PRIxPTR ", %zu bytes, page %" PRIuPTR ")", addr, size, page);
  sim_lock(sim);
  sim->bytes[CP_SIM_PAGE_MAP] += size;
  int rc = vmm_enter(sim, CP_SIM_PAGE_MAP);
  if (rc != CP_OK) goto out;
  rc = vmm_check_span(sim, what, addr, size);
  if (rc != CP_OK) goto out;
  sim_page_t *pg = cp_ptrmap_get(&sim->vmm.pages, page);
  if (pg == NULL || pg->released) {
    rc = cp_set_error(CP_ERR_INVALID, "sim: %s: %s", what, pg == NULL ? "unknown page" : "the page was released");
    goto out;
  }
  if (pg->size != size) {
    rc = cp_set_error(CP_ERR_INVALID, "sim: %s: the page has %zu bytes and is mapped whole", what, pg->size);
    goto out;
  }
  if (vmm_holder(sim, addr, size) == 0) {
    rc = cp_set_error(CP_ERR_INVALID, "sim: %s: the span is not inside one reserved range", what);
    goto out;
  }
  const vmm_scan_t s = vmm_scan(sim, addr, size);
  if (s.count != 0) {
    rc = cp_set_error(CP_ERR_INVALID, "sim: %s: already mapped (%zu bytes of it, %zu mapping%s)", what, s.bytes,
                      s.count, s.count == 1 ? "" : "s");
    goto out;
  }
  sim_mapping_t *m = malloc(sizeof *m);
  if (m == NULL || cp_ptrmap_reserve(&sim->vmm.mappings, 1) != CP_OK) {
    free(m);
    rc = cp_set_error(CP_ERR_BACKEND, "sim: %s: host memory for the mapping table is short", what);
    goto out;
  }
  if (vmm_real(sim) && mmap((void *)addr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, pg->fd, 0) == MAP_FAILED) {
    rc = vmm_host_fail(what, "mmap(MAP_SHARED | MAP_FIXED) of the page's memfd", errno);
    free(m);
    goto out;
  }
  m->size = size;
  m->page = page;
  m->access = 0;
  (void)cp_ptrmap_insert(&sim->vmm.mappings, addr, m); /* room made above */
  if (++pg->maps == 2) sim->vmm.aliased_pages++;
  sim->vmm.mapped_bytes += size;
  if (size > sim->vmm.max_mapping) sim->vmm.max_mapping = size;
out:
  sim_unlock(sim);
  return rc;
}

static int sim_page_unmap(void *ctx, uintptr_t addr, size_t size) {
  cp_sim_t *sim = ctx;
  if (sim == NULL) return cp_set_error(CP_ERR_INVALID, "sim: page_unmap: no device");
  char what[96];
  snprintf(what, sizeof what, "page_unmap(0x%" PRIxPTR ", %zu bytes)", addr, size);
  sim_lock(sim);
  uintptr_t *keys = NULL;
  sim->bytes[CP_SIM_PAGE_UNMAP] += size;
  int rc = vmm_enter(sim, CP_SIM_PAGE_UNMAP);
  if (rc == CP_OK) rc = cp_sim_refuse_if_capturing_locked(sim, CP_SIM_PAGE_UNMAP);
  if (rc != CP_OK) goto out;
  rc = vmm_check_span(sim, what, addr, size);
  if (rc != CP_OK) goto out;
  if (vmm_holder(sim, addr, size) == 0) {
    rc = cp_set_error(CP_ERR_INVALID, "sim: %s: the span is not inside one reserved range", what);
    goto out;
  }
  vmm_scan_t s = vmm_scan(sim, addr, size);
  if (s.cut) {
    rc = cp_set_error(CP_ERR_INVALID, "sim: %s: it would cut the mapping at 0x%" PRIxPTR " (unmap whole mappings)",
                      what, s.cut_addr);
    goto out;
  }
  if (s.count == 0) {
    rc = cp_set_error(CP_ERR_INVALID, "sim: %s: nothing is mapped there", what);
    goto out;
  }
  keys = malloc(s.count * sizeof *keys);
  if (keys == NULL) {
    rc = cp_set_error(CP_ERR_BACKEND, "sim: %s: host memory is short", what);
    goto out;
  }
  /* A GPU would fault in the kernels still queued on these addresses (or read the pages the
   * next mapping puts here): the unmap goes ahead, as the driver's does, and is a fault. */
  (void)cp_sim_fault_if_busy_locked(sim, "unmap of memory that queued work still touches", "page_unmap", addr, size);
  /* Back to reserved: PROT_NONE anonymous memory over the span, the addresses still held. */
  if (vmm_real(sim) && mmap((void *)addr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1,
                            0) == MAP_FAILED) {
    rc = vmm_host_fail(what, "mmap(PROT_NONE, MAP_FIXED)", errno);
    goto out;
  }
  memset(&s, 0, sizeof s); /* again, writing down the addresses this time */
  s.addr = addr;
  s.end = addr + size;
  s.keys = keys;
  vmm_scan_overlapping(sim, &s);
  for (size_t i = 0; i < s.count; i++) {
    sim_mapping_t *m = cp_ptrmap_remove(&sim->vmm.mappings, keys[i]);
    sim_page_t *pg = cp_ptrmap_get(&sim->vmm.pages, m->page);
    sim->vmm.mapped_bytes -= m->size;
    if (pg->maps-- == 2) sim->vmm.aliased_pages--;
    if (pg->maps == 0 && pg->released) vmm_page_free(sim, m->page);
    free(m);
  }
out:
  sim_unlock(sim);
  free(keys);
  return rc;
}

static int sim_page_set_access(void *ctx, uintptr_t addr, size_t size) {
  cp_sim_t *sim = ctx;
  if (sim == NULL) return cp_set_error(CP_ERR_INVALID, "sim: page_set_access: no device");
  char what[96];
  snprintf(what, sizeof what, "page_set_access(0x%" PRIxPTR ", %zu bytes)", addr, size);
  sim_lock(sim);
  sim->bytes[CP_SIM_PAGE_SET_ACCESS] += size;
  int rc = vmm_enter(sim, CP_SIM_PAGE_SET_ACCESS);
  if (rc != CP_OK) goto out;
  rc = vmm_check_span(sim, what, addr, size);
  if (rc != CP_OK) goto out;
  const vmm_scan_t s = vmm_scan(sim, addr, size);
  if (s.cut || s.bytes != size) {
    rc = cp_set_error(CP_ERR_INVALID, "sim: %s: the span is not covered by whole mappings (%zu of %zu bytes mapped%s)",
                      what, s.bytes, size, s.cut ? ", one cut" : "");
    goto out;
  }
  if (vmm_real(sim) && mprotect((void *)addr, size, PROT_READ | PROT_WRITE) != 0) {
    rc = vmm_host_fail(what, "mprotect(PROT_READ | PROT_WRITE)", errno);
    goto out;
  }
  vmm_scan_t mark;
  memset(&mark, 0, sizeof mark);
  mark.addr = addr;
  mark.end = addr + size;
  mark.mark_access = 1;
  vmm_scan_overlapping(sim, &mark);
out:
  sim_unlock(sim);
  return rc;
}

/* ------------------------------------------------------------------------------------------
 * Lifetime (sim_internal.h)
 * ---------------------------------------------------------------------------------------- */

int cp_sim_vmm_init(cp_sim_t *sim) {
  sim->vmm.granularity = SIM_VMM_GRANULARITY;
  sim->vmm.next_page_id = 1;
  if (cp_ptrmap_init(&sim->vmm.ranges, SIM_MAP_MIN_SLOTS) != CP_OK ||
      cp_ptrmap_init(&sim->vmm.pages, SIM_MAP_MIN_SLOTS) != CP_OK ||
      cp_ptrmap_init(&sim->vmm.mappings, SIM_MAP_MIN_SLOTS) != CP_OK)
    return CP_ERR_HOST_OOM; /* the caller destroys what was set up */
  return CP_OK;
}

/* cp_ptrmap_each callbacks of cp_sim_vmm_destroy. */
static void vmm_unmap_range(uintptr_t key, void *value, void *arg) {
  (void)arg;
  (void)munmap((void *)key, (size_t)(uintptr_t)value); /* its mappings go with it */
}

static void vmm_free_page(uintptr_t key, void *value, void *arg) {
  (void)key;
  (void)arg;
  sim_page_t *pg = value;
  if (pg->fd >= 0) (void)close(pg->fd);
  free(pg);
}

static void vmm_free_mapping(uintptr_t key, void *value, void *arg) {
  (void)key;
  (void)arg;
  free(value);
}

void cp_sim_vmm_destroy(cp_sim_t *sim) {
  if (vmm_real(sim)) cp_ptrmap_each(&sim->vmm.ranges, vmm_unmap_range, NULL);
  cp_ptrmap_each(&sim->vmm.mappings, vmm_free_mapping, NULL);
  cp_ptrmap_each(&sim->vmm.pages, vmm_free_page, NULL);
  cp_ptrmap_destroy(&sim->vmm.ranges);
  cp_ptrmap_destroy(&sim->vmm.pages);
  cp_ptrmap_destroy(&sim->vmm.mappings);
}

void cp_sim_vmm_table(cp_sim_t *sim, cp_backend_t *out) {
  (void)sim;
  out->vmm_granularity = sim_vmm_granularity;
  out->va_reserve = sim_va_reserve;
  out->va_free = sim_va_free;
  out->page_create = sim_page_create;
  out->page_release = sim_page_release;
  out->page_map = sim_page_map;
  out->page_unmap = sim_page_unmap;
  out->page_set_access = sim_page_set_access;
}

/* ------------------------------------------------------------------------------------------
 * Test controls and what is live (sim.h)
 * ---------------------------------------------------------------------------------------- */

int cp_sim_set_vmm_granularity(cp_sim_t *sim, size_t bytes) {
  if (sim == NULL) return cp_set_error(CP_ERR_INVALID, "cp_sim_set_vmm_granularity: no device");
  const long host_page = sysconf(_SC_PAGESIZE);
  sim_lock(sim);
  int rc = CP_OK;
  if (sim->flags & CP_SIM_NO_VMM) {
    rc = cp_set_error(CP_ERR_STATE, "cp_sim_set_vmm_granularity(%zu): the device has no page-mapped memory", bytes);
  } else if (sim->vmm.started) {
    rc = cp_set_error(CP_ERR_STATE, "cp_sim_set_vmm_granularity(%zu): a page-mapped call was made already", bytes);
  } else if (bytes < SIM_VMM_MIN_GRANULE || (bytes & (bytes - 1)) != 0 ||
             (vmm_real(sim) && host_page > 0 && bytes < (size_t)host_page)) {
    rc = cp_set_error(CP_ERR_INVALID,
                      "cp_sim_set_vmm_granularity(%zu): must be a power of two of at least %zu bytes and at least "
                      "the host's page size (%ld bytes)",
                      bytes, SIM_VMM_MIN_GRANULE, host_page);
  } else {
    sim->vmm.granularity = bytes;
  }
  sim_unlock(sim);
  return rc;
}

/* One lock round per getter, like the rest of sim.c's. */
#define SIM_VMM_GETTER(name, expr)   \
  size_t name(const cp_sim_t *sim) { \
    if (sim == NULL) return 0;       \
    sim_lock(sim);                   \
    const size_t n = (expr);         \
    sim_unlock(sim);                 \
    return n;                        \
  }

SIM_VMM_GETTER(cp_sim_vmm_ranges, sim->vmm.ranges.count)
SIM_VMM_GETTER(cp_sim_vmm_pages, sim->vmm.pages.count)
SIM_VMM_GETTER(cp_sim_vmm_page_bytes, sim->vmm.page_bytes)
SIM_VMM_GETTER(cp_sim_vmm_mappings, sim->vmm.mappings.count)
SIM_VMM_GETTER(cp_sim_vmm_mapped_bytes, sim->vmm.mapped_bytes)

/* cp_ptrmap_each callback of cp_sim_vmm_resolve: the mapping holding s->addr. */
typedef struct vmm_find_s {
  uintptr_t addr;
  uintptr_t key;
  const sim_mapping_t *m;
} vmm_find_t;

static void vmm_find_mapping(uintptr_t key, void *value, void *arg) {
  vmm_find_t *f = arg;
  const sim_mapping_t *m = value;
  if (key <= f->addr && f->addr - key < m->size) {
    f->key = key;
    f->m = m;
  }
}

/* The mapping that covers `a`, or NULL: mappings start at multiples of the granularity and are
 * at most max_mapping long, so the start is at most that far below. */
static const sim_mapping_t *vmm_mapping_at(const cp_sim_t *sim, uintptr_t a, size_t *out_offset) {
  const uintptr_t g = sim->vmm.granularity;
  const uintptr_t base = a & ~(g - 1);
  for (uintptr_t back = 0; back <= sim->vmm.max_mapping && base >= back; back += g) {
    const sim_mapping_t *m = cp_ptrmap_get(&sim->vmm.mappings, base - back);
    if (m == NULL) continue;
    if (a - (base - back) >= m->size) return NULL;
    *out_offset = (size_t)(a - (base - back));
    return m;
  }
  return NULL;
}

/* sim_internal.h */
int cp_sim_vmm_accessible_locked(const cp_sim_t *sim, uintptr_t addr, size_t size) {
  if (sim->vmm.granularity == 0 || sim->vmm.mappings.count == 0) return 0;
  /* Mapping by mapping: each lookup walks back once, then the next starts where it ends. */
  for (uintptr_t a = addr; a < addr + size;) {
    size_t off = 0;
    const sim_mapping_t *m = vmm_mapping_at(sim, a, &off);
    if (m == NULL || !m->access) return 0;
    a = a - off + m->size;
  }
  return 1;
}

/* The page behind each of `n` granules from `addr` (granule-aligned) and the granule's offset
 * in it; page 0 where nothing is mapped. */
static void vmm_pages_of(const cp_sim_t *sim, uintptr_t addr, size_t n, cp_page_t *pages, size_t *offsets) {
  const size_t g = sim->vmm.granularity;
  const sim_mapping_t *m = NULL;
  size_t off = 0;
  for (size_t i = 0; i < n; i++) {
    if (m != NULL && off + g < m->size) {
      off += g; /* the same mapping goes on */
    } else {
      m = vmm_mapping_at(sim, addr + i * g, &off);
    }
    pages[i] = m != NULL ? m->page : 0;
    offsets[i] = m != NULL ? off : 0;
  }
}

#define VMM_SHARE_MAX_GRANULES 256 /* larger spans are compared by address only */

/* sim_internal.h */
int cp_sim_vmm_shares_locked(const cp_sim_t *sim, uintptr_t a, size_t a_size, uintptr_t b, size_t b_size) {
  if (sim->vmm.granularity == 0 || sim->vmm.aliased_pages == 0 || a_size == 0 || b_size == 0) return 0;
  const uintptr_t g = sim->vmm.granularity;
  const uintptr_t alo = a & ~(g - 1), blo = b & ~(g - 1);
  const size_t na = (size_t)(((a + a_size + g - 1) & ~(g - 1)) - alo) / g;
  const size_t nb = (size_t)(((b + b_size + g - 1) & ~(g - 1)) - blo) / g;
  if (na > VMM_SHARE_MAX_GRANULES || nb > VMM_SHARE_MAX_GRANULES) return 0;
  cp_page_t pa[VMM_SHARE_MAX_GRANULES], pb[VMM_SHARE_MAX_GRANULES];
  size_t oa[VMM_SHARE_MAX_GRANULES], ob[VMM_SHARE_MAX_GRANULES];
  vmm_pages_of(sim, alo, na, pa, oa);
  vmm_pages_of(sim, blo, nb, pb, ob);
  /* Granule i of a span covers the bytes [lo, hi) of its page: compare those, byte exact. */
  for (size_t i = 0; i < na; i++) {
    if (pa[i] == 0) continue;
    const uintptr_t ga = alo + i * g;
    const uintptr_t a0 = a > ga ? a : ga, a1 = a + a_size < ga + g ? a + a_size : ga + g;
    const size_t alo_off = oa[i] + (size_t)(a0 - ga), ahi_off = oa[i] + (size_t)(a1 - ga);
    for (size_t j = 0; j < nb; j++) {
      if (pb[j] != pa[i]) continue;
      const uintptr_t gb = blo + j * g;
      const uintptr_t b0 = b > gb ? b : gb, b1 = b + b_size < gb + g ? b + b_size : gb + g;
      const size_t blo_off = ob[j] + (size_t)(b0 - gb), bhi_off = ob[j] + (size_t)(b1 - gb);
      if (alo_off < bhi_off && blo_off < ahi_off) return 1;
    }
  }
  return 0;
}

int cp_sim_vmm_resolve(const cp_sim_t *sim, uintptr_t addr, cp_page_t *out_page, size_t *out_offset,
                       size_t *out_page_size) {
  if (sim == NULL) return cp_set_error(CP_ERR_INVALID, "cp_sim_vmm_resolve: no device");
  sim_lock(sim);
  vmm_find_t f = {addr, 0, NULL};
  /* As vmm_scan_overlapping: where a mapping holding addr could start, one by one, when that
   * takes fewer steps than there are mappings (one-page mappings: one step). */
  const size_t g = sim->vmm.granularity;
  const size_t back = sim->vmm.max_mapping > g ? sim->vmm.max_mapping - g : 0;
  if (g != 0 && back / g + 1 < sim->vmm.mappings.count) {
    const uintptr_t top = addr / g * g;
    for (uintptr_t a = top; f.m == NULL && a + back >= top; a -= g) {
      const sim_mapping_t *m = cp_ptrmap_get(&sim->vmm.mappings, a);
      if (m != NULL) vmm_find_mapping(a, (void *)m, &f);
      if (a < g) break;
    }
  } else {
    cp_ptrmap_each(&sim->vmm.mappings, vmm_find_mapping, &f);
  }
  int rc = CP_OK;
  if (f.m == NULL) {
    rc = cp_set_error(CP_ERR_INVALID, "cp_sim_vmm_resolve(0x%" PRIxPTR "): nothing is mapped there", addr);
  } else {
    if (out_page != NULL) *out_page = f.m->page;
    if (out_offset != NULL) *out_offset = (size_t)(addr - f.key);
    if (out_page_size != NULL) *out_page_size = f.m->size;
  }
  sim_unlock(sim);
  return rc;
}
