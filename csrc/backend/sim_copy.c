/* sim_copy.c — the simulated device's copies between host and device memory, and the host
 * memory they use (Note [Simulated copies] in sim.h). Owns: the host_alloc blocks. */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "backend/sim_internal.h"

/* Every host_alloc block starts with its size, so that host_free can count it. */
typedef struct sim_host_s {
  size_t size;
  max_align_t align; /* what follows is aligned as malloc's is */
} sim_host_t;

static int sim_host_alloc(void *ctx, size_t size, void **out_ptr) {
  cp_sim_t *sim = ctx;
  if (sim == NULL || out_ptr == NULL) return cp_set_error(CP_ERR_INVALID, "sim: host_alloc: NULL argument");
  sim_lock(sim);
  int rc = cp_sim_enter_locked(sim, CP_SIM_HOST_ALLOC);
  sim->bytes[CP_SIM_HOST_ALLOC] += size;
  sim_host_t *h = NULL;
  if (rc == CP_OK && (size == 0 || size > SIZE_MAX - sizeof *h)) {
    rc = cp_set_error(CP_ERR_INVALID, "sim: host_alloc(%zu bytes): bad size", size);
  }
  if (rc == CP_OK && (h = malloc(sizeof *h + size)) == NULL) {
    rc = cp_set_error(CP_ERR_HOST_OOM, "sim: host_alloc(%zu bytes): host memory is short", size);
  }
  if (rc == CP_OK) {
    h->size = size;
    sim->host_allocs++;
    sim->host_bytes += size;
    *out_ptr = &h->align;
  }
  sim_unlock(sim);
  return rc;
}

static int sim_host_free(void *ctx, void *ptr) {
  cp_sim_t *sim = ctx;
  if (sim == NULL || ptr == NULL) return cp_set_error(CP_ERR_INVALID, "sim: host_free: NULL argument");
  sim_host_t *h = (sim_host_t *)((char *)ptr - offsetof(sim_host_t, align));
  sim_lock(sim);
  const int rc = cp_sim_enter_locked(sim, CP_SIM_HOST_FREE); /* freed whatever it says */
  sim->bytes[CP_SIM_HOST_FREE] += h->size;
  sim->host_allocs--;
  sim->host_bytes -= h->size;
  sim_unlock(sim);
  free(h);
  return rc;
}

/* The checks of a copy of device memory [addr, addr + size), under the lock. */
static int sim_copy_check_locked(cp_sim_t *sim, cp_sim_call_t kind, const char *name, uintptr_t addr, size_t size) {
  int rc = cp_sim_enter_locked(sim, kind);
  sim->bytes[kind] += size;
  if (rc != CP_OK) return rc;
  if (size == 0 || size > UINTPTR_MAX - addr) {
    return cp_set_error(CP_ERR_INVALID, "sim: %s(0x%" PRIxPTR ", %zu bytes): bad range", name, addr, size);
  }
  if (!cp_sim_reserved_locked(sim, addr, size) && !cp_sim_vmm_accessible_locked(sim, addr, size)) {
    cp_sim_fault_locked(sim, "copy of memory that is not the device's (not reserved, or not mapped with access)", name,
                        addr, size, 0);
    return cp_set_error(CP_ERR_INVALID, "sim: %s(0x%" PRIxPTR ", %zu bytes): device fault", name, addr, size);
  }
  (void)cp_sim_fault_if_busy_locked(sim, "copy of memory that queued work still touches", name, addr, size);
  return CP_OK;
}

static int sim_copy_to_host(void *ctx, void *dst, uintptr_t src, size_t size) {
  cp_sim_t *sim = ctx;
  if (sim == NULL || dst == NULL) return cp_set_error(CP_ERR_INVALID, "sim: copy_to_host: NULL argument");
  sim_lock(sim);
  const int rc = sim_copy_check_locked(sim, CP_SIM_COPY_TO_HOST, "copy_to_host", src, size);
  if (rc == CP_OK && !(sim->flags & CP_SIM_NO_TOUCH)) memcpy(dst, (const void *)src, size);
  sim_unlock(sim);
  return rc;
}

static int sim_copy_to_device(void *ctx, uintptr_t dst, const void *src, size_t size) {
  cp_sim_t *sim = ctx;
  if (sim == NULL || src == NULL) return cp_set_error(CP_ERR_INVALID, "sim: copy_to_device: NULL argument");
  sim_lock(sim);
  const int rc = sim_copy_check_locked(sim, CP_SIM_COPY_TO_DEVICE, "copy_to_device", dst, size);
  if (rc == CP_OK && !(sim->flags & CP_SIM_NO_TOUCH)) memcpy((void *)dst, src, size);
  sim_unlock(sim);
  return rc;
}

size_t cp_sim_host_allocations(const cp_sim_t *sim, size_t *out_bytes) {
  if (sim == NULL) return 0;
  sim_lock(sim);
  const size_t n = sim->host_allocs;
  if (out_bytes != NULL) *out_bytes = sim->host_bytes;
  sim_unlock(sim);
  return n;
}

void cp_sim_copy_table(cp_sim_t *sim, cp_backend_t *out) {
  (void)sim;
  out->host_alloc = sim_host_alloc;
  out->host_free = sim_host_free;
  out->copy_to_host = sim_copy_to_host;
  out->copy_to_device = sim_copy_to_device;
}
