/* test_cuda_nodriver.c — tests of the CUDA backend (csrc/backend/cuda*.c) that run anywhere.
 * Owns: clean failure without a driver; with a driver (a GPU, or the stand-in that
 * CUDAPOOL_CUDA_DRIVER names: make test-c-standin), round trips on device 0. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda.h"
#include "check.h"

#define MiB          ((size_t)1 << 20)
#define LOAD_THREADS 8

static int contains(const char *haystack, const char *needle) { return strstr(haystack, needle) != NULL; }

/* The library the backend loads (Note [Which libcuda] in csrc/backend/cuda.c). */
static const char *driver_named(void) {
  const char *named = getenv("CUDAPOOL_CUDA_DRIVER");
  return named != NULL && named[0] != '\0' ? named : NULL;
}

/* The outcome of the first cp_cuda_load, taken by main before any test runs. */
static int load_rc;
static char load_message[4096];

static int have_gpu(void) {
  int count = 0;
  return load_rc == CP_OK && cp_cuda_device_count(&count) == CP_OK && count > 0;
}

/* ---- Every machine -------------------------------------------------------------------------- */

TEST(load_is_remembered) {
  for (int i = 0; i < 3; i++) {
    cp_clear_error();
    CHECK(cp_cuda_load() == load_rc);
    if (load_rc != CP_OK) CHECK(strcmp(cp_last_error(), load_message) == 0);
  }
}

typedef struct load_result_s {
  int rc;
  char message[4096];
} load_result_t;

static void *load_thread(void *arg) {
  load_result_t *res = arg;
  cp_clear_error();
  res->rc = cp_cuda_load();
  snprintf(res->message, sizeof res->message, "%s", res->rc == CP_OK ? "" : cp_last_error());
  return NULL;
}

TEST(load_from_many_threads) {
  static load_result_t results[LOAD_THREADS];
  pthread_t threads[LOAD_THREADS];
  for (int i = 0; i < LOAD_THREADS; i++) REQUIRE(pthread_create(&threads[i], NULL, load_thread, &results[i]) == 0);
  for (int i = 0; i < LOAD_THREADS; i++) pthread_join(threads[i], NULL);
  for (int i = 0; i < LOAD_THREADS; i++) {
    CHECK(results[i].rc == load_rc);
    if (load_rc != CP_OK) CHECK(strcmp(results[i].message, load_message) == 0);
  }
}

TEST(argument_checks) {
  char name[64];
  CHECK(cp_cuda_driver_version(NULL) == CP_ERR_INVALID);
  CHECK(cp_cuda_device_count(NULL) == CP_ERR_INVALID);
  CHECK(cp_cuda_device_name(0, NULL, sizeof name) == CP_ERR_INVALID);
  CHECK(cp_cuda_device_name(0, name, 0) == CP_ERR_INVALID);
  CHECK(cp_cuda_backend(0, NULL) == CP_ERR_INVALID);
  CHECK(contains(cp_last_error(), "out is NULL"));
  char why[16];
  CHECK(cp_cuda_vmm_support(0, NULL, why, sizeof why) == CP_ERR_INVALID);
  CHECK(contains(cp_last_error(), "out_supported is NULL"));
  int supported = 0;
  CHECK(cp_cuda_vmm_support(0, &supported, NULL, sizeof why) == CP_ERR_INVALID);
}

/* ---- No driver (or no device): everything fails cleanly -------------------------------------- */

TEST(no_driver_fails_cleanly) {
  if (load_rc == CP_OK) return; /* a driver is here: covered by the GPU tests */
  CHECK(load_rc == CP_ERR_BACKEND);
  CHECK(strncmp(load_message, "cudapool: ", 10) == 0);
  CHECK(contains(load_message, "no CUDA driver") || contains(load_message, "cuInit"));
  /* A library named by CUDAPOOL_CUDA_DRIVER that cannot be loaded is named, with no fallback. */
  if (driver_named() != NULL && contains(load_message, "no CUDA driver")) {
    CHECK(contains(load_message, "CUDAPOOL_CUDA_DRIVER="));
    CHECK(contains(load_message, driver_named()));
  }

  int value = -7;
  CHECK(cp_cuda_device_count(&value) == CP_ERR_BACKEND);
  CHECK(value == -7); /* out-parameters untouched on failure */
  CHECK(strcmp(cp_last_error(), load_message) == 0);
  CHECK(cp_cuda_driver_version(&value) == CP_ERR_BACKEND);
  CHECK(value == -7);

  char name[32] = "untouched";
  CHECK(cp_cuda_device_name(0, name, sizeof name) == CP_ERR_BACKEND);
  CHECK(strcmp(name, "untouched") == 0);

  cp_backend_t be;
  memset(&be, 0xab, sizeof be);
  const unsigned char *bytes = (const unsigned char *)&be;
  CHECK(cp_cuda_backend(0, &be) == CP_ERR_BACKEND);
  CHECK(strcmp(cp_last_error(), load_message) == 0);
  int untouched = 1;
  for (size_t i = 0; i < sizeof be; i++) untouched &= bytes[i] == 0xab;
  CHECK(untouched);
  CHECK(cp_cuda_backend(-1, &be) == CP_ERR_BACKEND); /* the driver is checked first */

  /* The page-mapped query says "no CUDA driver" too, and leaves its outputs alone. */
  int supported = -7;
  char why[64] = "untouched";
  cp_clear_error();
  CHECK(cp_cuda_vmm_support(0, &supported, why, sizeof why) == CP_ERR_BACKEND);
  CHECK(strcmp(cp_last_error(), load_message) == 0);
  CHECK(contains(cp_last_error(), "no CUDA driver") || contains(cp_last_error(), "cuInit"));
  CHECK(supported == -7);
  CHECK(strcmp(why, "untouched") == 0);
  CHECK(cp_cuda_vmm_support(0, &supported, NULL, 0) == CP_ERR_BACKEND);
}

TEST(shutdown_without_driver) {
  cp_cuda_shutdown();
  cp_cuda_shutdown();
  CHECK(cp_cuda_load() == load_rc); /* shutdown does not forget the load outcome */
}

/* ---- A driver and a GPU: a real round trip on device 0 --------------------------------------- */

/* The thread's current context, read straight from the driver, to prove operations leave it
 * as they found it. cuCtxGetCurrent has kept its name and signature since CUDA 4.0. */
typedef int (*ctx_get_current_fn)(void **out_ctx);

static ctx_get_current_fn ctx_get_current(void) {
  void *lib = dlopen(driver_named() != NULL ? driver_named() : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL && driver_named() == NULL) lib = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) return NULL;
  void *sym = dlsym(lib, "cuCtxGetCurrent");
  ctx_get_current_fn fn = NULL;
  if (sym != NULL) memcpy(&fn, &sym, sizeof fn);
  return fn; /* the library stays loaded, as cudapool keeps it */
}

static char no_ctx; /* its address is a value no driver returns, for a failed query */

static void *current_ctx(ctx_get_current_fn get) {
  void *ctx = NULL;
  if (get == NULL || get(&ctx) != 0) return &no_ctx;
  return ctx;
}

TEST(gpu_queries) {
  if (!have_gpu()) return;
  int count = 0, version = 0;
  REQUIRE(cp_cuda_device_count(&count) == CP_OK);
  CHECK(count > 0);
  REQUIRE(cp_cuda_driver_version(&version) == CP_OK);
  CHECK(version >= 11030);
  char name[256] = "";
  CHECK(cp_cuda_device_name(0, name, sizeof name) == CP_OK);
  CHECK(name[0] != '\0');
  char tiny[4] = "xyz";
  CHECK(cp_cuda_device_name(0, tiny, sizeof tiny) == CP_OK);
  CHECK(strlen(tiny) <= 3);
  printf("device 0: %s, driver %d, %d device(s)\n", name, version, count);

  cp_backend_t be;
  CHECK(cp_cuda_backend(count, &be) == CP_ERR_INVALID);
  CHECK(contains(cp_last_error(), "does not exist"));
  CHECK(cp_cuda_backend(-1, &be) == CP_ERR_INVALID);
  CHECK(cp_cuda_device_name(count, name, sizeof name) == CP_ERR_INVALID);
}

TEST(gpu_round_trip) {
  if (!have_gpu()) return;
  const ctx_get_current_fn get = ctx_get_current();
  CHECK(get != NULL);
  void *const before = current_ctx(get);
  CHECK(before != &no_ctx);

  cp_backend_t be, again;
  REQUIRE(cp_cuda_backend(0, &be) == CP_OK);
  REQUIRE(cp_cuda_backend(0, &again) == CP_OK);
  CHECK(strcmp(be.name, "cuda") == 0);
  CHECK(be.device == 0);
  CHECK(be.ctx != NULL && be.ctx == again.ctx); /* one retained context per device */
  CHECK(be.reserve && be.release && be.event_create && be.event_destroy && be.event_record && be.event_query &&
        be.event_synchronize && be.mem_info);

  size_t free_b = 0, total_b = 0;
  REQUIRE(be.mem_info(be.ctx, &free_b, &total_b) == CP_OK);
  CHECK(total_b > 0);
  CHECK(free_b <= total_b);

  uintptr_t addr = 0;
  REQUIRE(be.reserve(be.ctx, 2 * MiB, &addr) == CP_OK);
  CHECK(addr != 0);
  CHECK(addr % 512 == 0);

  cp_event_t ev = 0;
  REQUIRE(be.event_create(be.ctx, &ev) == CP_OK);
  CHECK(ev != 0);
  int done = -1;
  CHECK(be.event_query(be.ctx, ev, &done) == CP_OK);
  CHECK(done == 1); /* never recorded */
  CHECK(be.event_record(be.ctx, ev, 0) == CP_OK);
  CHECK(be.event_synchronize(be.ctx, ev) == CP_OK);
  done = -1;
  CHECK(be.event_query(be.ctx, ev, &done) == CP_OK);
  CHECK(done == 1);
  CHECK(be.event_destroy(be.ctx, ev) == CP_OK);
  CHECK(be.release(be.ctx, addr, 2 * MiB) == CP_OK);

  /* Larger than the device: OOM, named as such. */
  uintptr_t huge = 7;
  CHECK(be.reserve(be.ctx, total_b + 1024 * MiB, &huge) == CP_ERR_OOM);
  CHECK(contains(cp_last_error(), "cuMemAlloc("));
  CHECK(contains(cp_last_error(), "CUDA_ERROR_OUT_OF_MEMORY"));
  CHECK(huge == 7);
  CHECK(be.reserve(be.ctx, 0, &huge) == CP_ERR_INVALID);

  /* A bad handle is the driver's to reject, with its error name. */
  CHECK(be.release(be.ctx, (uintptr_t)0x1000, 512) == CP_ERR_BACKEND);
  CHECK(contains(cp_last_error(), "cuMemFree(0x1000"));
  CHECK(contains(cp_last_error(), "CUDA_ERROR_"));

  CHECK(current_ctx(get) == before); /* the thread's context is left as it was */

  /* After shutdown the table refuses; a new cp_cuda_backend brings the device back. */
  cp_cuda_shutdown();
  CHECK(be.mem_info(be.ctx, &free_b, &total_b) == CP_ERR_STATE);
  REQUIRE(cp_cuda_backend(0, &be) == CP_OK);
  CHECK(be.mem_info(be.ctx, &free_b, &total_b) == CP_OK);
  cp_cuda_shutdown();
  CHECK(current_ctx(get) == before);
}

/* Page-mapped memory on device 0: the entries follow cp_cuda_vmm_support; where the device
 * has them, one page mapped at two addresses of a reserved range, and the driver's errors. */
TEST(gpu_vmm) {
  if (!have_gpu()) return;
  const ctx_get_current_fn get = ctx_get_current();
  void *const before = current_ctx(get);
  int supported = -1;
  char why[512] = "";
  REQUIRE(cp_cuda_vmm_support(0, &supported, why, sizeof why) == CP_OK);
  CHECK(supported == 0 || supported == 1);
  CHECK(why[0] != '\0');
  printf("device 0 page-mapped memory: %d (%s)\n", supported, why);
  int count = 0;
  REQUIRE(cp_cuda_device_count(&count) == CP_OK);
  CHECK(cp_cuda_vmm_support(count, &supported, why, sizeof why) == CP_ERR_INVALID);

  cp_backend_t be;
  REQUIRE(cp_cuda_backend(0, &be) == CP_OK);
  const int all = be.vmm_granularity && be.va_reserve && be.va_free && be.page_create && be.page_release &&
                  be.page_map && be.page_unmap && be.page_set_access;
  const int none = !be.vmm_granularity && !be.va_reserve && !be.va_free && !be.page_create && !be.page_release &&
                   !be.page_map && !be.page_unmap && !be.page_set_access;
  CHECK(supported ? all : none);
  if (!all) {
    cp_cuda_shutdown();
    return;
  }

  size_t g = 0;
  REQUIRE(be.vmm_granularity(be.ctx, &g) == CP_OK);
  CHECK(g >= 4096 && (g & (g - 1)) == 0);
  printf("device 0 granularity: %zu bytes\n", g);
  uintptr_t r = 0;
  cp_page_t p = 0;
  REQUIRE(be.va_reserve(be.ctx, 4 * g, &r) == CP_OK);
  CHECK(r != 0 && r % g == 0);
  REQUIRE(be.page_create(be.ctx, g, &p) == CP_OK);
  CHECK(be.page_map(be.ctx, r, g, p) == CP_OK);
  CHECK(be.page_map(be.ctx, r + 2 * g, g, p) == CP_OK); /* one page, two addresses */
  CHECK(be.page_set_access(be.ctx, r, g) == CP_OK);
  CHECK(be.page_set_access(be.ctx, r + 2 * g, g) == CP_OK);
  CHECK(be.page_release(be.ctx, p) == CP_OK); /* still mapped: the memory stays */
  CHECK(be.page_unmap(be.ctx, r, g) == CP_OK);
  CHECK(be.page_unmap(be.ctx, r + 2 * g, g) == CP_OK);

  /* The driver's refusals, named. */
  size_t free_b = 0, total_b = 0;
  REQUIRE(be.mem_info(be.ctx, &free_b, &total_b) == CP_OK);
  cp_page_t huge = 7;
  CHECK(be.page_create(be.ctx, (total_b / g + 1024) * g, &huge) == CP_ERR_OOM);
  CHECK(contains(cp_last_error(), "cuMemCreate("));
  CHECK(contains(cp_last_error(), "CUDA_ERROR_OUT_OF_MEMORY"));
  CHECK(huge == 7);
  CHECK(be.page_create(be.ctx, 0, &huge) == CP_ERR_INVALID);
  CHECK(be.va_free(be.ctx, r, 4 * g) == CP_OK);
  CHECK(be.va_free(be.ctx, r, 4 * g) == CP_ERR_BACKEND);
  CHECK(contains(cp_last_error(), "cuMemAddressFree(0x"));
  CHECK(contains(cp_last_error(), "CUDA_ERROR_"));

  CHECK(current_ctx(get) == before);
  cp_cuda_shutdown();
  CHECK(be.vmm_granularity(be.ctx, &g) == CP_ERR_STATE);
}

int main(void) {
  load_rc = cp_cuda_load();
  snprintf(load_message, sizeof load_message, "%s", load_rc == CP_OK ? "" : cp_last_error());
  printf("cp_cuda_load: %s%s%s\n", cp_status_name(load_rc), load_rc == CP_OK ? "" : ": ", load_message);

  RUN(load_is_remembered);
  RUN(load_from_many_threads);
  RUN(argument_checks);
  RUN(no_driver_fails_cleanly);
  RUN(shutdown_without_driver);
  RUN(gpu_queries);
  RUN(gpu_round_trip);
  RUN(gpu_vmm);
  return check_summary("test_cuda_nodriver");
}
