/* test_cuda_standin_driver.c — the stand-in for libcuda (csrc/standin/) on its own, called as a
 * driver: each documented contract it enforces, its asynchrony, captures, faults and injection. */
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "standin/standin.h"

#define MiB  ((size_t)1 << 20)
#define GRAN (2 * MiB)

/* The driver's codes, as the driver API reference numbers them. */
enum {
  OK = 0,
  INVALID_VALUE = 1,
  OUT_OF_MEMORY = 2,
  NOT_INITIALIZED = 3,
  INVALID_DEVICE = 101,
  INVALID_CONTEXT = 201,
  INVALID_HANDLE = 400,
  NOT_READY = 600,
  ILLEGAL_ADDRESS = 700,
  CONTEXT_IS_DESTROYED = 709,
  NOT_SUPPORTED = 801,
  CAPTURE_UNSUPPORTED = 900,
  CAPTURE_INVALIDATED = 901,
  CAPTURE_IMPLICIT = 906,
  CAPTURED_EVENT = 907,
  UNKNOWN = 999
};

/* CUmemAllocationProp and CUmemAccessDesc as the reference lays them out. */
typedef struct prop_s {
  int type, handle_types, location_type, location_id;
  void *win32;
  unsigned char compression, rdma;
  unsigned short usage;
  unsigned char reserved[4];
} prop_t;
typedef struct access_s {
  int location_type, location_id, flags;
} access_t;

static cpstandin_api_t sa;
static int have_standin;

static prop_t pinned(int device) { return (prop_t){1, 0, 1, device, NULL, 0, 0, 0, {0}}; }
static access_t rw(int device) { return (access_t){1, device, 3}; }

static void print_faults(void) {
  char text[256];
  for (size_t i = 0; i < sa.faults() && sa.fault_text(i, text, sizeof text) == 0; i++)
    fprintf(stderr, "  stand-in fault %zu: %s\n", i, text);
}

/* A reset stand-in of `devices` devices of 64 MiB, device 0's context retained and current. */
static void fresh(int devices) {
  sa.reset();
  CHECK(sa.set_devices(devices, 64 * MiB) == 0);
  void *ctx = NULL;
  CHECK(sa.cuDevicePrimaryCtxRetain(&ctx, 0) == OK);
  CHECK(sa.cuCtxSetCurrent(ctx) == OK);
}

static void finish(void) {
  sa.complete_all();
  if (sa.faults() != 0) print_faults();
  CHECK_EQ_U(sa.faults(), 0);
  sa.reset();
}

static void *stream_of(int device, unsigned flags) {
  void *prev = NULL, *ctx = NULL, *s = NULL;
  CHECK(sa.cuCtxGetCurrent(&prev) == OK);
  CHECK(sa.cuDevicePrimaryCtxRetain(&ctx, device) == OK); /* kept: released by the reset */
  CHECK(sa.cuCtxSetCurrent(ctx) == OK);
  CHECK(sa.cuStreamCreate(&s, flags) == OK);
  CHECK(sa.cuCtxSetCurrent(prev) == OK);
  return s;
}

/* A range of `granules` granules with one page of device `device` mapped at its start, read-write
 * for that device. */
static unsigned long long page_at(int device, size_t granules, unsigned long long *out_range) {
  const prop_t p = pinned(device);
  const access_t a = rw(device);
  unsigned long long h = 0;
  CHECK(sa.cuMemAddressReserve(out_range, granules * GRAN, 0, 0, 0) == OK);
  CHECK(sa.cuMemCreate(&h, GRAN, &p, 0) == OK);
  CHECK(sa.cuMemMap(*out_range, GRAN, 0, h, 0) == OK);
  CHECK(sa.cuMemSetAccess(*out_range, GRAN, &a, 1) == OK);
  return h;
}

/* ---- Loading and initialisation ----------------------------------------------------------------- */

TEST(standin_loaded) {
  char why[512] = "";
  if (cpstandin_open(&sa, 1, why, sizeof why) != 0) {
    printf("not the stand-in (%s): the tests below are skipped\n", why);
    return;
  }
  CHECK(sa.version() == CPSTANDIN_VERSION);
  have_standin = 1;
}

TEST(nothing_before_cuinit) {
  if (!have_standin) return;
  int n = -1;
  CHECK(sa.cuDeviceGetCount(&n) == NOT_INITIALIZED && n == -1);
  void *fn = NULL, *ctx = NULL;
  int status = -1;
  CHECK(sa.cuGetProcAddress("cuInit", &fn, 12000, 0, &status) == OK && fn != NULL && status == 0);
  CHECK(sa.cuDevicePrimaryCtxRetain(&ctx, 0) == NOT_INITIALIZED);
  const char *name = NULL;
  CHECK(sa.cuGetErrorName(OUT_OF_MEMORY, &name) == OK && strcmp(name, "CUDA_ERROR_OUT_OF_MEMORY") == 0);
  CHECK(sa.cuGetErrorName(123456, &name) == INVALID_VALUE && name == NULL);
  CHECK(sa.cuInit(1) == INVALID_VALUE); /* flags must be 0 */
  CHECK(sa.cuInit(0) == OK);
  CHECK(sa.cuDeviceGetCount(&n) == OK && n >= 1);
}

TEST(proc_address) {
  if (!have_standin) return;
  void *fn = NULL;
  int status = -1;
  CHECK(sa.cuGetProcAddress("cuMemCreate", &fn, 12000, 0, &status) == OK && fn != NULL && status == 0);
  CHECK(sa.cuGetProcAddress("cuMemCreate", &fn, 10000, 0, &status) == OK && fn == NULL && status == 2);
  CHECK(sa.cuGetProcAddress("cuNoSuchFunction", &fn, 12000, 0, &status) == OK && fn == NULL && status == 1);
  CHECK(sa.cuGetProcAddress("cuInit", &fn, 99000, 0, &status) == INVALID_VALUE); /* newer than the driver */
  CHECK(sa.cuGetProcAddress(NULL, &fn, 12000, 0, &status) == INVALID_VALUE);
}

/* ---- Contexts and plain memory ------------------------------------------------------------------- */

TEST(contexts) {
  if (!have_standin) return;
  sa.reset();
  CHECK(sa.set_devices(2, 64 * MiB) == 0);
  unsigned long long p = 0;
  CHECK(sa.cuMemAlloc(&p, MiB) == INVALID_CONTEXT); /* none current */
  void *ctx = NULL, *cur = NULL;
  CHECK(sa.cuDevicePrimaryCtxRelease(0) == INVALID_CONTEXT); /* not retained */
  CHECK(sa.cuDevicePrimaryCtxRetain(&ctx, 2) == INVALID_DEVICE);
  CHECK(sa.cuDevicePrimaryCtxRetain(&ctx, 1) == OK);
  CHECK(sa.set_devices(3, 64 * MiB) == 401); /* not while a context is retained */
  CHECK(sa.cuCtxSetCurrent((void *)0x1234) == INVALID_CONTEXT);
  CHECK(sa.cuCtxSetCurrent(ctx) == OK);
  CHECK(sa.cuCtxGetCurrent(&cur) == OK && cur == ctx);
  CHECK(sa.cuMemAlloc(&p, MiB) == OK && p % 512 == 0);
  CHECK_EQ_U(sa.used(1), MiB);
  void *s = NULL, *got = NULL;
  CHECK(sa.cuStreamCreate(&s, 0) == OK);
  CHECK(sa.cuStreamGetCtx(s, &got) == OK && got == ctx);
  /* The last release resets the context: its memory and streams go, and it is unusable. */
  CHECK(sa.cuDevicePrimaryCtxRelease(1) == OK);
  CHECK_EQ_U(sa.used(1), 0);
  CHECK(sa.cuMemAlloc(&p, MiB) == CONTEXT_IS_DESTROYED);
  CHECK(sa.cuStreamGetCtx(s, &got) == INVALID_HANDLE);
  CHECK(sa.cuCtxSetCurrent(NULL) == OK);
  CHECK(sa.cuStreamGetCtx(NULL, &got) == INVALID_CONTEXT);
  finish();
}

TEST(plain_memory) {
  if (!have_standin) return;
  fresh(1);
  unsigned long long a = 0, b = 0;
  size_t fb = 0, tb = 0;
  CHECK(sa.cuMemAlloc(&a, 0) == INVALID_VALUE);
  CHECK(sa.cuMemAlloc(&a, 40 * MiB) == OK);
  CHECK(sa.cuMemAlloc(&b, 30 * MiB) == OUT_OF_MEMORY);
  CHECK(sa.cuMemGetInfo(&fb, &tb) == OK && tb == 64 * MiB && fb == 24 * MiB);
  CHECK(sa.cuMemFree(a + 512) == INVALID_VALUE); /* not what cuMemAlloc returned */
  CHECK(sa.cuMemFree(a) == OK);
  CHECK(sa.cuMemFree(a) == INVALID_VALUE);
  CHECK(sa.cuMemAlloc(&b, 30 * MiB) == OK && b != a); /* addresses are not reused */
  /* cuMemFree waits for the work that uses the memory. */
  void *s = stream_of(0, 0);
  CHECK(sa.launch((uintptr_t)s, b, MiB) == 0);
  CHECK_EQ_U(sa.pending((uintptr_t)s), 1);
  CHECK(sa.cuMemFree(b) == OK);
  CHECK_EQ_U(sa.pending((uintptr_t)s), 0);
  CHECK_EQ_U(sa.used(0), 0);
  finish();
}

/* ---- Virtual memory management ---------------------------------------------------------------- */

TEST(vmm_contracts) {
  if (!have_standin) return;
  fresh(2);
  const prop_t p0 = pinned(0);
  prop_t bad = pinned(0);
  size_t g = 0;
  CHECK(sa.cuMemGetAllocationGranularity(&g, &p0, 0) == OK && g == GRAN);
  bad.type = 2;
  CHECK(sa.cuMemGetAllocationGranularity(&g, &bad, 0) == INVALID_VALUE);
  bad = pinned(5);
  CHECK(sa.cuMemGetAllocationGranularity(&g, &bad, 0) == INVALID_DEVICE);
  unsigned long long r = 0, r2 = 0, h = 0, h2 = 0, big = 0;
  CHECK(sa.cuMemAddressReserve(&r, 4 * GRAN, 0, 0, 0) == OK && r % GRAN == 0);
  CHECK(sa.cuMemAddressReserve(&r2, 1000, 0, 0, 0) == INVALID_VALUE); /* not a host page multiple */
  CHECK(sa.cuMemAddressReserve(&r2, GRAN, 3, 0, 0) == INVALID_VALUE); /* alignment not a power of two */
  CHECK(sa.cuMemCreate(&h, GRAN + 4096, &p0, 0) == INVALID_VALUE);    /* not a granularity multiple */
  CHECK(sa.cuMemCreate(&big, 64 * MiB + GRAN, &p0, 0) == OUT_OF_MEMORY);
  CHECK(sa.cuMemCreate(&h, 2 * GRAN, &p0, 0) == OK);
  CHECK(sa.cuMemCreate(&h2, GRAN, &p0, 0) == OK);
  /* cuMemMap: offset 0, the whole handle, aligned, inside a reservation, not mapped yet. */
  CHECK(sa.cuMemMap(r, 2 * GRAN, GRAN, h, 0) == INVALID_VALUE);
  CHECK(sa.cuMemMap(r, GRAN, 0, h, 0) == INVALID_VALUE);
  CHECK(sa.cuMemMap(r + 4096, 2 * GRAN, 0, h, 0) == INVALID_VALUE);
  CHECK(sa.cuMemMap(r + 3 * GRAN, 2 * GRAN, 0, h, 0) == INVALID_VALUE); /* runs past the range */
  CHECK(sa.cuMemMap(0x100000000ull, 2 * GRAN, 0, h, 0) == INVALID_VALUE);
  CHECK(sa.cuMemMap(r, 2 * GRAN, 0, h, 1) == INVALID_VALUE);
  CHECK(sa.cuMemMap(r, 2 * GRAN, 0, h, 0) == OK);
  CHECK(sa.cuMemMap(r + GRAN, GRAN, 0, h2, 0) == INVALID_VALUE); /* mapped already */
  CHECK(sa.cuMemMap(r + 2 * GRAN, GRAN, 0, h2, 0) == OK);
  /* cuMemSetAccess: over fully mapped whole mappings, known devices and protections. */
  const access_t a0 = rw(0), a9 = rw(9), aw = {1, 0, 2}, two[2] = {rw(0), {1, 1, 1}};
  CHECK(sa.cuMemSetAccess(r, 4 * GRAN, &a0, 1) == INVALID_VALUE); /* the last granule is not mapped */
  CHECK(sa.cuMemSetAccess(r, GRAN, &a0, 1) == INVALID_VALUE);     /* cuts the first mapping */
  CHECK(sa.cuMemSetAccess(r, 3 * GRAN, &a9, 1) == INVALID_DEVICE);
  CHECK(sa.cuMemSetAccess(r, 3 * GRAN, &aw, 1) == INVALID_VALUE);
  CHECK(sa.cuMemSetAccess(r, 3 * GRAN, &a0, 0) == INVALID_VALUE);
  CHECK(sa.access(r, 0) == 0); /* mappings start with no access */
  CHECK(sa.cuMemSetAccess(r, 3 * GRAN, two, 2) == OK);
  CHECK(sa.access(r, 0) == 3 && sa.access(r + 2 * GRAN, 1) == 1);
  CHECK(sa.cuMemSetAccess(r, 2 * GRAN, &(access_t){1, 1, 0}, 1) == OK); /* revoked on the first */
  CHECK(sa.access(r, 1) == 0 && sa.access(r + 2 * GRAN, 1) == 1);
  /* A peer that cannot reach the owner gets no access. */
  CHECK(sa.set_peer(1, 0, 0) == 0);
  CHECK(sa.cuMemSetAccess(r, 2 * GRAN, &two[1], 1) == INVALID_DEVICE);
  /* cuMemUnmap: whole mappings only; cuMemAddressFree: exactly as reserved, nothing mapped. */
  CHECK(sa.cuMemUnmap(r, GRAN) == INVALID_VALUE);
  CHECK(sa.cuMemUnmap(r + GRAN, 2 * GRAN) == INVALID_VALUE);
  CHECK(sa.cuMemAddressFree(r, 4 * GRAN) == INVALID_VALUE);
  /* cuMemRelease: the memory stays while mapped and goes with the last unmap. */
  CHECK(sa.cuMemRelease(h) == OK);
  CHECK(sa.cuMemMap(r + 3 * GRAN, 2 * GRAN, 0, h, 0) == INVALID_VALUE); /* the handle is gone */
  CHECK_EQ_U(sa.used(0), 3 * GRAN);
  CHECK(sa.cuMemUnmap(r, 3 * GRAN) == OK); /* two mappings in one call */
  CHECK_EQ_U(sa.used(0), GRAN);            /* h2 is not released yet */
  CHECK(sa.cuMemRelease(h2) == OK);
  CHECK_EQ_U(sa.used(0), 0);
  CHECK(sa.cuMemAddressFree(r, 2 * GRAN) == INVALID_VALUE);
  CHECK(sa.cuMemAddressFree(r, 4 * GRAN) == OK);
  CHECK(sa.cuMemAddressFree(r, 4 * GRAN) == INVALID_VALUE);
  CHECK_EQ_U(sa.faults(), 0);
  CHECK(sa.cuMemRelease(h) == INVALID_VALUE); /* undefined by the reference: a misuse here */
  CHECK(sa.faults() == 1 && sa.fault_kind(0) == CPSTANDIN_FAULT_MISUSE);
  sa.reset();
  /* One page at two addresses: both see the same bytes. */
  fresh(1);
  const access_t a = rw(0);
  const prop_t p = pinned(0);
  CHECK(sa.cuMemAddressReserve(&r, 4 * GRAN, 0, 0, 0) == OK && sa.cuMemCreate(&h, GRAN, &p, 0) == OK);
  CHECK(sa.cuMemMap(r, GRAN, 0, h, 0) == OK && sa.cuMemMap(r + 2 * GRAN, GRAN, 0, h, 0) == OK);
  CHECK(sa.cuMemSetAccess(r, GRAN, &a, 1) == OK);
  void *s = stream_of(0, 0);
  CHECK(sa.launch((uintptr_t)s, r + 100, 1) == 0);
  CHECK(sa.launch((uintptr_t)s, r + 2 * GRAN, 1) == ILLEGAL_ADDRESS); /* no access there yet */
  sa.reset();
  fresh(1);
  CHECK(sa.cuMemAddressReserve(&r, 4 * GRAN, 0, 0, 0) == OK && sa.cuMemCreate(&h, GRAN, &p, 0) == OK);
  CHECK(sa.cuMemMap(r, GRAN, 0, h, 0) == OK && sa.cuMemMap(r + 2 * GRAN, GRAN, 0, h, 0) == OK);
  CHECK(sa.cuMemSetAccess(r, GRAN, &a, 1) == OK && sa.cuMemSetAccess(r + 2 * GRAN, GRAN, &a, 1) == OK);
  s = stream_of(0, 0);
  unsigned char byte = 0;
  CHECK(sa.launch((uintptr_t)s, r + 100, 1) == 0);
  CHECK(sa.peek(r + 2 * GRAN + 100, &byte) == 0 && byte != 0);
  CHECK(sa.cuMemRelease(h) == OK && sa.complete((uintptr_t)s) == 0);
  CHECK(sa.cuMemUnmap(r, GRAN) == OK && sa.cuMemUnmap(r + 2 * GRAN, GRAN) == OK);
  CHECK(sa.cuMemAddressFree(r, 4 * GRAN) == OK);
  CHECK_EQ_U(sa.live(CPSTANDIN_LIVE_HANDLES), 0);
  finish();
}

/* ---- Handles to one physical allocation (Note [Handles to one physical allocation]) ------------ */

static prop_t exportable(int device) {
  prop_t p = pinned(device);
  p.handle_types = 1; /* CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR */
  return p;
}

static size_t free_now(void) {
  size_t free_bytes = 0, total = 0;
  CHECK(sa.cuMemGetInfo(&free_bytes, &total) == OK && total == 64 * MiB);
  return free_bytes;
}

/* An import creates no memory: it succeeds on a full device, and the memory stays on the device
 * until its last handle, the creator's or an importer's, is released and unmapped. */
TEST(an_import_charges_nothing_and_holds_the_memory) {
  if (!have_standin) return;
  fresh(2);
  const prop_t p0 = exportable(0);
  unsigned long long h = 0, rest = 0, in1 = 0, in2 = 0, in3 = 0, more = 0, r = 0;
  int fd = -1;
  CHECK(sa.cuMemCreate(&h, 60 * MiB, &p0, 0) == OK);
  CHECK(sa.cuMemCreate(&rest, 4 * MiB, &p0, 0) == OK);
  CHECK_EQ_U(free_now(), 0); /* the device is full */
  CHECK(sa.cuMemExportToShareableHandle(&fd, h, 1, 0) == OK && fd >= 0);
  CHECK(sa.cuMemImportFromShareableHandle(&in1, (void *)(intptr_t)fd, 1) == OK);
  CHECK_EQ_U(sa.used(0), 64 * MiB);
  cpstandin_handle_info_t info;
  CHECK(sa.handle_info(in1, &info) == 0 && info.size == 60 * MiB && info.device == 0);
  /* Both handles name the same bytes. */
  const access_t a = rw(0);
  CHECK(sa.cuMemAddressReserve(&r, 128 * MiB, 0, 0, 0) == OK);
  CHECK(sa.cuMemMap(r, 60 * MiB, 0, h, 0) == OK && sa.cuMemMap(r + 64 * MiB, 60 * MiB, 0, in1, 0) == OK);
  CHECK(sa.cuMemSetAccess(r, 60 * MiB, &a, 1) == OK && sa.cuMemSetAccess(r + 64 * MiB, 60 * MiB, &a, 1) == OK);
  void *s = stream_of(0, 0);
  unsigned char byte = 0;
  CHECK(sa.launch((uintptr_t)s, r + 5 * MiB, 1) == 0 && sa.complete((uintptr_t)s) == 0);
  CHECK(sa.peek(r + 69 * MiB, &byte) == 0 && byte != 0);
  CHECK(sa.cuMemUnmap(r, 60 * MiB) == OK && sa.cuMemUnmap(r + 64 * MiB, 60 * MiB) == OK);
  /* The creator's release leaves the memory where the import holds it. */
  CHECK(sa.cuMemRelease(h) == OK);
  CHECK_EQ_U(sa.used(0), 64 * MiB);
  CHECK_EQ_U(free_now(), 0);
  CHECK(sa.cuMemCreate(&more, 2 * MiB, &p0, 0) == OUT_OF_MEMORY);
  CHECK(sa.cuMemImportFromShareableHandle(&in2, (void *)(intptr_t)fd, 1) == OK); /* still held */
  CHECK(sa.cuMemRelease(in1) == OK);
  CHECK_EQ_U(free_now(), 0);
  CHECK(sa.cuMemRelease(in2) == OK); /* the last handle */
  CHECK_EQ_U(sa.used(0), 4 * MiB);
  CHECK_EQ_U(free_now(), 60 * MiB);
  /* The descriptor alone keeps nothing (this stand-in's assumption). */
  CHECK(sa.cuMemImportFromShareableHandle(&in3, (void *)(intptr_t)fd, 1) == INVALID_HANDLE);
  close(fd);
  /* An import in the creating process is on the creator's device, whatever is current. */
  const prop_t p1 = exportable(1);
  CHECK(sa.cuMemCreate(&h, 2 * MiB, &p1, 0) == OK && sa.cuMemExportToShareableHandle(&fd, h, 1, 0) == OK);
  CHECK(sa.cuMemImportFromShareableHandle(&in3, (void *)(intptr_t)fd, 1) == OK);
  CHECK(sa.handle_info(in3, &info) == 0 && info.device == 1);
  CHECK(sa.cuMemRelease(h) == OK && sa.cuMemRelease(in3) == OK);
  CHECK_EQ_U(sa.used(1), 0);
  close(fd);
  /* What is not a descriptor of shared device memory is refused. */
  const int null_fd = open("/dev/null", O_RDWR | O_CLOEXEC);
  CHECK(null_fd >= 0 && sa.cuMemImportFromShareableHandle(&in3, (void *)(intptr_t)null_fd, 1) == INVALID_HANDLE);
  CHECK(sa.cuMemImportFromShareableHandle(&in3, (void *)(intptr_t)-1, 1) == INVALID_HANDLE);
  if (null_fd >= 0) close(null_fd);
  CHECK(sa.cuMemRelease(rest) == OK && sa.cuMemAddressFree(r, 128 * MiB) == OK);
  CHECK_EQ_U(sa.used(0), 0);
  finish();
}

/* A child process imports 8 MiB this process created and exported, then this process releases
 * its own handle: the child's handle holds the memory until the child releases it
 * (`child_releases`) or ends. */
static void share_with_a_child(int child_releases) {
  const prop_t p0 = exportable(0);
  unsigned long long h = 0;
  int fd = -1, up[2], down[2];
  CHECK(sa.cuMemCreate(&h, 8 * MiB, &p0, 0) == OK && sa.cuMemExportToShareableHandle(&fd, h, 1, 0) == OK);
  REQUIRE(pipe(up) == 0 && pipe(down) == 0);
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) { /* imports, says so, waits for a word; releases and says so; waits; ends */
    unsigned long long in = 0;
    char c = sa.cuMemImportFromShareableHandle(&in, (void *)(intptr_t)fd, 1) == OK ? 'y' : 'n';
    if (write(up[1], &c, 1) != 1 || read(down[0], &c, 1) != 1) _exit(3);
    if (child_releases && (sa.cuMemRelease(in) != OK || write(up[1], "r", 1) != 1 || read(down[0], &c, 1) != 1))
      _exit(4);
    _exit(0);
  }
  char c = 0;
  CHECK(read(up[0], &c, 1) == 1 && c == 'y');
  CHECK(sa.cuMemRelease(h) == OK);
  CHECK_EQ_U(sa.used(0), 8 * MiB); /* the child's handle holds it */
  CHECK_EQ_U(free_now(), 56 * MiB);
  CHECK(write(down[1], "g", 1) == 1);
  if (child_releases) {
    CHECK(read(up[0], &c, 1) == 1 && c == 'r');
    CHECK_EQ_U(free_now(), 64 * MiB); /* the child lives on, its handle released */
    CHECK(write(down[1], "g", 1) == 1);
  }
  int status = 0;
  CHECK(waitpid(child, &status, 0) == child && WIFEXITED(status) && WEXITSTATUS(status) == 0);
  CHECK_EQ_U(sa.used(0), 0); /* an ended process holds nothing */
  close(fd);
  for (int i = 0; i < 2; i++) close(up[i]), close(down[i]);
}

TEST(a_handle_of_another_process_holds_the_memory) {
  if (!have_standin) return;
  fresh(1);
  share_with_a_child(1);
  share_with_a_child(0);
  finish();
}

/* ---- Streams and events: what completes when ---------------------------------------------------- */

TEST(streams_and_events) {
  if (!have_standin) return;
  fresh(2);
  void *s = stream_of(0, 0), *nb = stream_of(0, 1), *s1 = stream_of(1, 0);
  void *ev = NULL, *ev1 = NULL;
  unsigned long long m = 0;
  CHECK(sa.cuMemAlloc(&m, 4 * MiB) == OK);
  CHECK(sa.cuEventCreate(&ev, 8) == INVALID_VALUE);
  CHECK(sa.cuEventCreate(&ev, 4) == INVALID_VALUE); /* interprocess without disabled timing */
  CHECK(sa.cuEventCreate(&ev, 2) == OK);
  CHECK(sa.cuEventQuery(ev) == OK);                  /* never recorded */
  CHECK(sa.cuEventRecord(ev, s1) == INVALID_HANDLE); /* a stream of another context */
  CHECK(sa.cuEventRecord(ev, (void *)0x570999999ull) == INVALID_HANDLE);
  CHECK(sa.cuEventRecord(ev, s) == OK && sa.cuEventQuery(ev) == OK); /* idle: done at once */
  CHECK(sa.launch((uintptr_t)s, m, MiB) == 0);
  CHECK(sa.cuEventRecord(ev, s) == OK);
  CHECK(sa.cuEventQuery(ev) == NOT_READY);
  CHECK(sa.launch((uintptr_t)s, m, MiB) == 0); /* after the event */
  CHECK(sa.cuEventSynchronize(ev) == OK);      /* drains up to the event only */
  CHECK(sa.cuEventQuery(ev) == OK);
  CHECK_EQ_U(sa.pending((uintptr_t)s), 1);
  CHECK(sa.complete((uintptr_t)s) == 0);
  /* The legacy stream waits for the blocking streams, not for the non-blocking ones. */
  CHECK(sa.launch((uintptr_t)s, m, MiB) == 0);
  CHECK(sa.launch((uintptr_t)nb, m, MiB) == 0);
  CHECK(sa.cuEventRecord(ev, NULL) == OK);
  CHECK(sa.cuEventQuery(ev) == NOT_READY);
  CHECK(sa.complete((uintptr_t)s) == 0);
  CHECK(sa.cuEventQuery(ev) == OK);
  CHECK_EQ_U(sa.pending((uintptr_t)nb), 1);
  /* ... and a blocking stream waits for the legacy stream. */
  CHECK(sa.launch(0, m, MiB) == 0);
  CHECK(sa.cuEventRecord(ev, s) == OK);
  CHECK(sa.cuEventQuery(ev) == NOT_READY);
  CHECK(sa.cuEventSynchronize(ev) == OK); /* completes the legacy stream's launch first */
  CHECK_EQ_U(sa.pending(0), 0);
  /* Destroyed handles are refused. */
  CHECK(sa.cuEventCreate(&ev1, 0) == OK && sa.cuEventDestroy(ev1) == OK);
  CHECK(sa.cuEventDestroy(ev1) == INVALID_HANDLE && sa.cuEventQuery(ev1) == INVALID_HANDLE);
  CHECK(sa.cuStreamDestroy(NULL) == INVALID_HANDLE);
  CHECK(sa.cuStreamDestroy(nb) == OK && sa.cuStreamDestroy(nb) == INVALID_HANDLE);
  CHECK(sa.cuEventRecord(ev, nb) == INVALID_HANDLE);
  CHECK(sa.cuEventDestroy(ev) == OK);
  CHECK(sa.cuCtxSynchronize() == OK);
  CHECK_EQ_U(sa.live(CPSTANDIN_LIVE_EVENTS), 0);
  finish();
}

/* ---- Stream capture ------------------------------------------------------------------------------ */

static void *unsafe_call_thread(void *arg) {
  int *mode = arg;
  unsigned long long p = 0;
  void *ctx = NULL;
  CHECK(sa.cuDevicePrimaryCtxRetain(&ctx, 0) == OK && sa.cuCtxSetCurrent(ctx) == OK);
  const int previous = *mode;
  CHECK(sa.cuThreadExchangeStreamCaptureMode(mode) == OK && *mode == 0);
  const int r = sa.cuMemAlloc(&p, MiB);
  *mode = r == OK ? 0 : r;
  if (r == OK) CHECK(sa.cuMemFree(p) == OK);
  int back = 0;
  CHECK(sa.cuThreadExchangeStreamCaptureMode(&back) == OK && back == previous);
  return NULL;
}

static int call_from_thread(int mode) {
  pthread_t t;
  if (pthread_create(&t, NULL, unsafe_call_thread, &mode) != 0) return -1;
  pthread_join(t, NULL);
  return mode;
}

TEST(capture_rules) {
  if (!have_standin) return;
  fresh(1);
  void *s = stream_of(0, 0), *nb = stream_of(0, 1), *ev = NULL;
  unsigned long long m = 0;
  int st = -1, mode = 7;
  CHECK(sa.cuThreadExchangeStreamCaptureMode(&mode) == INVALID_VALUE);
  CHECK(sa.cuMemAlloc(&m, 4 * MiB) == OK && sa.cuEventCreate(&ev, 2) == OK);
  CHECK(sa.begin_capture(0, 0) == CAPTURE_UNSUPPORTED); /* the legacy stream cannot capture */
  CHECK(sa.begin_capture((uintptr_t)s, CPSTANDIN_CAPTURE_GLOBAL) == 0);
  CHECK(sa.begin_capture((uintptr_t)s, CPSTANDIN_CAPTURE_GLOBAL) == 401);
  CHECK(sa.cuStreamIsCapturing(s, &st) == OK && st == 1);
  CHECK(sa.cuStreamIsCapturing(nb, &st) == OK && st == 0);
  CHECK(sa.cuStreamIsCapturing(NULL, &st) == CAPTURE_IMPLICIT);
  CHECK(sa.cuStreamIsCapturing((void *)2, &st) == OK && st == 0); /* the per-thread stream */
  /* Work on the capturing stream joins the capture; nothing runs. */
  CHECK(sa.launch((uintptr_t)s, m, MiB) == 0 && sa.pending((uintptr_t)s) == 0);
  CHECK(sa.cuEventRecord(ev, s) == OK);
  /* Other threads: relaxed and thread-local may allocate, global may not. */
  CHECK(call_from_thread(2) == 0);
  CHECK(call_from_thread(1) == 0);
  CHECK_EQ_U(sa.faults(), 0);
  CHECK(sa.capture_status((uintptr_t)s) == 1);
  CHECK(call_from_thread(0) == CAPTURE_UNSUPPORTED);
  CHECK(sa.capture_status((uintptr_t)s) == 2 && sa.faults() == 1 && sa.fault_kind(0) == CPSTANDIN_FAULT_CAPTURE);
  CHECK(sa.launch((uintptr_t)s, m, MiB) == CAPTURE_INVALIDATED);
  CHECK(sa.end_capture((uintptr_t)s) == CAPTURE_INVALIDATED);
  CHECK(sa.end_capture((uintptr_t)s) == 401);
  /* An event last recorded in a capture cannot be waited on, even relaxed. */
  mode = 2;
  CHECK(sa.cuThreadExchangeStreamCaptureMode(&mode) == OK);
  CHECK(sa.cuEventQuery(ev) == CAPTURED_EVENT);
  CHECK(sa.cuEventSynchronize(ev) == CAPTURED_EVENT);
  CHECK(sa.cuThreadExchangeStreamCaptureMode(&mode) == OK && mode == 2);
  CHECK(sa.cuEventRecord(ev, s) == OK && sa.cuEventQuery(ev) == OK); /* recorded anew */
  /* The capturing thread itself, in the global mode; the legacy stream breaks a capture. */
  CHECK(sa.begin_capture((uintptr_t)s, CPSTANDIN_CAPTURE_GLOBAL) == 0);
  CHECK(sa.cuEventQuery(ev) == CAPTURE_UNSUPPORTED);
  CHECK(sa.end_capture((uintptr_t)s) == CAPTURE_INVALIDATED);
  CHECK(sa.begin_capture((uintptr_t)s, CPSTANDIN_CAPTURE_RELAXED) == 0);
  CHECK(sa.cuEventQuery(ev) == OK); /* a relaxed capture prohibits nothing */
  CHECK(sa.cuEventRecord(ev, NULL) == CAPTURE_IMPLICIT);
  CHECK(sa.end_capture((uintptr_t)s) == CAPTURE_INVALIDATED);
  CHECK_EQ_U(sa.faults(), 5);
  sa.reset();
}

/* ---- Device faults, injection, counters ------------------------------------------------------- */

TEST(device_faults_are_sticky) {
  if (!have_standin) return;
  fresh(2);
  unsigned long long r = 0, m = 0;
  const unsigned long long h = page_at(0, 1, &r);
  void *s = stream_of(0, 0), *s1 = stream_of(1, 0);
  CHECK(sa.launch((uintptr_t)s1, r, 4096) == ILLEGAL_ADDRESS); /* device 1 has no access */
  CHECK(sa.faults() == 1 && sa.fault_kind(0) == CPSTANDIN_FAULT_ILLEGAL_ADDRESS && sa.sticky() == ILLEGAL_ADDRESS);
  CHECK(sa.cuMemAlloc(&m, MiB) == ILLEGAL_ADDRESS);
  CHECK(sa.cuMemUnmap(r, GRAN) == ILLEGAL_ADDRESS);
  const char *name = NULL;
  CHECK(sa.cuGetErrorName(ILLEGAL_ADDRESS, &name) == OK); /* naming still works */
  sa.reset();
  fresh(1);
  (void)page_at(0, 1, &r);
  s = stream_of(0, 0);
  CHECK(sa.launch((uintptr_t)s, r + GRAN - 8, 16) == ILLEGAL_ADDRESS); /* runs past the mapping */
  sa.reset();
  fresh(1);
  const unsigned long long h2 = page_at(0, 1, &r);
  s = stream_of(0, 0);
  CHECK(sa.launch((uintptr_t)s, r, 64) == 0);
  CHECK(sa.cuMemUnmap(r, GRAN) == OK); /* the launch has not completed */
  CHECK(sa.faults() == 1 && sa.fault_kind(0) == CPSTANDIN_FAULT_IN_USE);
  CHECK(sa.cuMemRelease(h2) == ILLEGAL_ADDRESS);
  sa.set_sticky(0);
  CHECK(sa.cuMemRelease(h2) == OK);
  (void)h;
  sa.reset();
}

TEST(injection_and_counters) {
  if (!have_standin) return;
  fresh(1);
  unsigned long long a = 0, b = 0, c = 0;
  CHECK(sa.fail_nth("cuMemAlloc", 2, OUT_OF_MEMORY) == 0);
  CHECK(sa.fail_nth("cuNoSuch", 1, UNKNOWN) == INVALID_VALUE);
  CHECK(sa.fail_nth("cuMemAlloc", 0, UNKNOWN) == INVALID_VALUE);
  CHECK(sa.cuMemAlloc(&a, MiB) == OK);
  CHECK(sa.cuMemAlloc(&b, MiB) == OUT_OF_MEMORY && sa.used(0) == MiB); /* did nothing */
  CHECK(sa.cuMemAlloc(&b, MiB) == OK);
  CHECK_EQ_U(sa.calls("cuMemAlloc"), 3);
  CHECK(sa.fail_nth_after("cuMemAlloc", 1, UNKNOWN) == 0);
  CHECK(sa.cuMemAlloc(&c, MiB) == UNKNOWN && sa.used(0) == 3 * MiB); /* did its work */
  CHECK(sa.cuMemFree(a) == OK && sa.cuMemFree(b) == OK && sa.cuMemFree(c) == OK);
  sa.set_sticky(UNKNOWN);
  CHECK(sa.cuMemAlloc(&a, MiB) == UNKNOWN);
  sa.set_sticky(0);
  CHECK(sa.cuMemAlloc(&a, MiB) == OK && sa.cuMemFree(a) == OK);
  CHECK_EQ_U(sa.calls("cuMemFree"), 4);
  finish();
  CHECK_EQ_U(sa.calls("cuMemAlloc"), 0); /* the reset clears the counts */
}

/* ---- Threads (TSan runs this) ------------------------------------------------------------------ */

#define THREADS 6
#define ROUNDS  200

static void *driver_thread(void *arg) {
  const int device = (int)(intptr_t)arg % 2;
  void *ctx = NULL, *s = NULL, *ev = NULL;
  int bad = 0;
  bad += sa.cuDevicePrimaryCtxRetain(&ctx, device) != OK;
  bad += sa.cuCtxSetCurrent(ctx) != OK;
  bad += sa.cuStreamCreate(&s, (unsigned)(intptr_t)arg % 3 == 0) != OK;
  bad += sa.cuEventCreate(&ev, 2) != OK;
  const prop_t p = pinned(device);
  const access_t a = rw(device);
  for (int i = 0; i < ROUNDS && bad == 0; i++) {
    unsigned long long m = 0, r = 0, h = 0;
    if (i % 2 == 0) {
      bad += sa.cuMemAlloc(&m, MiB) != OK;
      bad += sa.launch((uintptr_t)s, m, MiB) != 0;
      bad += sa.cuEventRecord(ev, s) != OK;
      const int q = sa.cuEventQuery(ev);
      bad += q != OK && q != NOT_READY;
      if (i % 4 == 0) bad += sa.complete((uintptr_t)s) != 0;
      bad += sa.cuMemFree(m) != OK;
    } else {
      bad += sa.cuMemAddressReserve(&r, 2 * GRAN, 0, 0, 0) != OK;
      bad += sa.cuMemCreate(&h, GRAN, &p, 0) != OK;
      bad += sa.cuMemMap(r, GRAN, 0, h, 0) != OK || sa.cuMemSetAccess(r, GRAN, &a, 1) != OK;
      bad += sa.cuMemRelease(h) != OK;
      bad += sa.launch((uintptr_t)s, r, GRAN) != 0;
      bad += sa.cuEventRecord(ev, s) != OK || sa.cuEventSynchronize(ev) != OK;
      bad += sa.cuMemUnmap(r, GRAN) != OK || sa.cuMemAddressFree(r, 2 * GRAN) != OK;
    }
  }
  bad += sa.cuEventDestroy(ev) != OK || sa.cuStreamDestroy(s) != OK;
  bad += sa.cuDevicePrimaryCtxRelease(device) != OK;
  return (void *)(intptr_t)bad;
}

TEST(threads) {
  if (!have_standin) return;
  sa.reset();
  CHECK(sa.set_devices(2, 512 * MiB) == 0);
  void *ctx = NULL;
  CHECK(sa.cuDevicePrimaryCtxRetain(&ctx, 0) == OK && sa.cuDevicePrimaryCtxRetain(&ctx, 1) == OK);
  pthread_t t[THREADS];
  for (intptr_t i = 0; i < THREADS; i++) REQUIRE(pthread_create(&t[i], NULL, driver_thread, (void *)i) == 0);
  for (int i = 0; i < THREADS; i++) {
    void *bad = NULL;
    pthread_join(t[i], &bad);
    CHECK(bad == NULL);
  }
  CHECK_EQ_U(sa.used(0) + sa.used(1), 0);
  CHECK_EQ_U(sa.live(CPSTANDIN_LIVE_MAPPINGS) + sa.live(CPSTANDIN_LIVE_RESERVATIONS), 0);
  finish();
}

int main(void) {
  RUN(standin_loaded);
  RUN(nothing_before_cuinit);
  RUN(proc_address);
  RUN(contexts);
  RUN(plain_memory);
  RUN(vmm_contracts);
  RUN(an_import_charges_nothing_and_holds_the_memory);
  RUN(a_handle_of_another_process_holds_the_memory);
  RUN(streams_and_events);
  RUN(capture_rules);
  RUN(device_faults_are_sticky);
  RUN(injection_and_counters);
  RUN(threads);
  return check_summary("test_cuda_standin_driver");
}
