/* test_cuda_standin_ipc.c — memory shared between two processes through cudapool's CUDA backend,
 * against the stand-in for libcuda (make test-c-standin; Note [Memory shared between processes]
 * in standin/standin_internal.h): a block of a plain segment (the driver's IPC handle), of
 * page-mapped segments and a stitched block (POSIX file descriptors taken with pidfd_getfd)
 * is written in this process, read and written back by a child process that opens the handle
 * (the handles of Note [Handles for torch] in torch/ipc.c; descriptors taken with pidfd_getfd or
 * over the sender's socket), and the sender freeing its block
 * and giving the memory back while the child still maps it leaves the child's bytes intact. A
 * pause of a region holding a shared block is refused; a device that cannot export pages says
 * so. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend/cuda.h"
#include "check.h"
#include "core/cp.h"
#include "core/share.h"
#include "devices/abi.h"
#include "devices/devices.h"
#include "devices/ipc.h"
#include "standin/standin.h"
#include "standin_open.h"

#define MiB ((size_t)1 << 20)

static cpstandin_api_t sa;
static const char *self_path;

static void print_faults(void) {
  char text[256];
  for (size_t i = 0; i < sa.faults() && sa.fault_text(i, text, sizeof text) == 0; i++)
    fprintf(stderr, "  stand-in fault %zu: %s\n", i, text);
}

static cp_backend_t backend_of(int device) {
  cp_backend_t be;
  memset(&be, 0, sizeof be);
  cp_pool_t *pool = NULL;
  if (cpd_pool(device, &pool) == CP_OK) cp_pool_backend(pool, &be);
  return be;
}

/* `n` bytes at device address `p`: every byte is seed + its offset / 4096 (mod 256). */
static int write_pattern(uintptr_t p, size_t n, unsigned seed) {
  cp_backend_t be = backend_of(0);
  unsigned char *buf = malloc(n);
  if (buf == NULL) return -1;
  for (size_t i = 0; i < n; i++) buf[i] = (unsigned char)(seed + i / 4096);
  const int rc = be.copy_to_device(be.ctx, p, buf, n);
  free(buf);
  return rc;
}

static int holds_pattern(uintptr_t p, size_t n, unsigned seed) {
  cp_backend_t be = backend_of(0);
  unsigned char *buf = malloc(n);
  if (buf == NULL || be.copy_to_host(be.ctx, buf, p, n) != CP_OK) {
    free(buf);
    return 0;
  }
  int ok = 1;
  for (size_t i = 0; i < n && ok; i++) ok = buf[i] == (unsigned char)(seed + i / 4096);
  free(buf);
  return ok;
}

static void to_hex(const char *bytes, size_t n, char *out) {
  for (size_t i = 0; i < n; i++) sprintf(out + 2 * i, "%02x", (unsigned char)bytes[i]);
  out[2 * n] = '\0';
}

static size_t from_hex(const char *hex, char *out) {
  size_t n = strlen(hex) / 2;
  for (size_t i = 0; i < n; i++) {
    unsigned v = 0;
    sscanf(hex + 2 * i, "%2x", &v);
    out[i] = (char)v;
  }
  return n;
}

/* The child: open the handle, check the sender's bytes, optionally wait for a byte on `wait_fd`
 * (the sender frees meanwhile) and check them again, write its own pattern, close. Exit 0 on
 * success, else the step that failed. */
static int child_main(int argc, char **argv) {
  if (argc != 8) return 90;
  char why[512] = "";
  if (cp_cuda_load() != CP_OK || cpstandin_open(&sa, 0, why, sizeof why) != 0) return 91;
  if (sa.set_devices(1, 512 * MiB) != 0) return 92;
  static char handle[CPD_IPC_HANDLE_MAX];
  const size_t len = from_hex(argv[2], handle);
  const size_t offset = strtoull(argv[3], NULL, 10), n = strtoull(argv[4], NULL, 10);
  const unsigned seed = (unsigned)atoi(argv[5]);
  const int ready_fd = atoi(argv[6]), wait_fd = atoi(argv[7]);
  void *base = NULL, *token = NULL;
  if (cpd_ipc_open(handle, len, 0, &base, &token) != CP_OK) {
    fprintf(stderr, "child: open: %s\n", cp_last_error());
    return 1;
  }
  const uintptr_t p = (uintptr_t)base + offset;
  if (!holds_pattern(p, n, seed)) return 2;
  if (ready_fd >= 0) {
    char c = 1;
    if (write(ready_fd, &c, 1) != 1 || read(wait_fd, &c, 1) != 1) return 3;
    if (!holds_pattern(p, n, seed)) return 4; /* the sender gave its memory back meanwhile */
  }
  if (write_pattern(p, n, seed + 100) != CP_OK) return 5;
  if (cpd_ipc_close(token) != CP_OK) return 6;
  cpd_shutdown();
  if (sa.live(CPSTANDIN_LIVE_ALLOCATIONS) != 0 || sa.live(CPSTANDIN_LIVE_MAPPINGS) != 0) return 7;
  if (sa.faults() != 0) return 8;
  cp_cuda_shutdown();
  return 0;
}

/* Run the child over `handle`; with `on_ready`, called once the child has mapped it and before
 * it reads again. Returns the child's exit status. */
static int run_child(const char *handle, size_t len, size_t offset, size_t n, unsigned seed, void (*on_ready)(void)) {
  static char hex[2 * CPD_IPC_HANDLE_MAX + 1];
  to_hex(handle, len, hex);
  int ready[2] = {-1, -1}, go[2] = {-1, -1};
  if (on_ready != NULL && (pipe(ready) != 0 || pipe(go) != 0)) return -1;
  char a_off[32], a_n[32], a_seed[16], a_ready[16], a_wait[16];
  snprintf(a_off, sizeof a_off, "%zu", offset);
  snprintf(a_n, sizeof a_n, "%zu", n);
  snprintf(a_seed, sizeof a_seed, "%u", seed);
  snprintf(a_ready, sizeof a_ready, "%d", ready[1]);
  snprintf(a_wait, sizeof a_wait, "%d", go[0]);
  const pid_t pid = fork();
  if (pid == 0) {
    execl(self_path, self_path, "child", hex, a_off, a_n, a_seed, a_ready, a_wait, (char *)NULL);
    _exit(99);
  }
  if (on_ready != NULL) {
    char c = 0;
    close(ready[1]);
    close(go[0]);
    if (read(ready[0], &c, 1) == 1) {
      on_ready();
      c = 1;
      if (write(go[1], &c, 1) != 1) fprintf(stderr, "run_child: the child is gone\n");
    }
    close(ready[0]);
    close(go[1]);
  }
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

static void setup(const char *conf) {
  cpd_shutdown();
  cp_cuda_shutdown();
  sa.reset();
  CHECK(sa.set_devices(1, 512 * MiB) == 0);
  cp_config_t cfg;
  cp_config_default(&cfg);
  CHECK(cp_config_parse(&cfg, conf) == CP_OK);
  CHECK(cpd_configure(&cfg) == CP_OK);
}

static void teardown(void) {
  cpd_shutdown();
  CHECK_EQ_U(sa.live(CPSTANDIN_LIVE_ALLOCATIONS), 0);
  CHECK_EQ_U(sa.live(CPSTANDIN_LIVE_HANDLES), 0);
  CHECK_EQ_U(sa.live(CPSTANDIN_LIVE_MAPPINGS), 0);
  if (sa.faults() != 0) print_faults();
  CHECK_EQ_U(sa.faults(), 0);
  cp_cuda_shutdown();
  cp_config_t cfg;
  cp_config_default(&cfg);
  CHECK(cpd_configure(&cfg) == CP_OK);
}

/* Share a block of `size` bytes allocated after `before` (kept live), check the child's round
 * trip. Returns the handle's type byte. */
static char share_round_trip(size_t size, size_t before) {
  void *keep = NULL, *p = NULL;
  if (before != 0) CHECK(cpd_alloc(before, 0, NULL, &keep) == CP_OK);
  if (cpd_alloc(size, 0, NULL, &p) != CP_OK || p == NULL) {
    fprintf(stderr, "alloc: %s\n", cp_last_error());
    CHECK(0);
    return 0;
  }
  CHECK(write_pattern((uintptr_t)p, size, 7) == CP_OK);
  static char handle[CPD_IPC_HANDLE_MAX];
  size_t len = 0, offset = 0;
  const int rc = cpd_ipc_share(p, 3, handle, sizeof handle, &len, &offset);
  if (rc != CP_OK) fprintf(stderr, "share: %s\n", cp_last_error());
  CHECK(rc == CP_OK);
  CHECK(handle[0] == 3);
  const int status = rc == CP_OK ? run_child(handle, len, offset, size, 7, NULL) : -1;
  if (status != 0) fprintf(stderr, "child exited with %d\n", status);
  CHECK_EQ_U(status, 0);
  CHECK(holds_pattern((uintptr_t)p, size, 107)); /* what the child wrote */
  cudapool_free(p, size, 0, NULL);
  if (keep != NULL) cudapool_free(keep, before, 0, NULL);
  return rc == CP_OK ? handle[1] : 0;
}

TEST(a_plain_segment_through_the_drivers_ipc_handle) {
  setup("");
  CHECK(share_round_trip(3 * MiB, 1 * MiB) == 'c'); /* in a 20 MiB segment, at an offset */
  teardown();
}

TEST(page_mapped_memory_through_posix_file_descriptors) {
  setup("expandable_segments:True");
  CHECK(share_round_trip(45 * MiB, 5 * MiB) == 'p'); /* over several 20 MiB handles */
  teardown();
}

/* The receiver takes the descriptors over the sender's socket (Note [Descriptors over a socket]
 * in torch/ipc.c), as where pidfd_getfd is not permitted; a descriptor the sender does not keep
 * for a shared block is not handed out. */
TEST(descriptors_over_the_senders_socket) {
  setup("expandable_segments:True");
  setenv("CUDAPOOL_IPC_FD", "socket", 1);
  CHECK(share_round_trip(25 * MiB, 0) == 'p');
  void *p = NULL;
  REQUIRE(cpd_alloc(4 * MiB, 0, NULL, &p) == CP_OK);
  CHECK(write_pattern((uintptr_t)p, 4 * MiB, 5) == CP_OK);
  static char handle[CPD_IPC_HANDLE_MAX];
  size_t len = 0, offset = 0;
  REQUIRE(cpd_ipc_share(p, 3, handle, sizeof handle, &len, &offset) == CP_OK);
  const int32_t not_kept = 0; /* the first handle's descriptor, made stdin's */
  memcpy(handle + 2 + 32, &not_kept, sizeof not_kept);
  CHECK_EQ_U(run_child(handle, len, offset, 4 * MiB, 5, NULL), 1); /* the open fails */
  unsetenv("CUDAPOOL_IPC_FD");
  cudapool_free(p, 4 * MiB, 0, NULL);
  teardown();
}

TEST(a_stitched_block_through_all_its_handles) {
  setup("expandable_segments:True,page_stitching:True");
  void *a = NULL, *b = NULL, *c = NULL;
  REQUIRE(cpd_alloc(20 * MiB, 0, NULL, &a) == CP_OK);
  REQUIRE(cpd_alloc(20 * MiB, 0, NULL, &b) == CP_OK);
  REQUIRE(cpd_alloc(20 * MiB, 0, NULL, &c) == CP_OK);
  cudapool_free(a, 20 * MiB, 0, NULL);
  cudapool_free(c, 20 * MiB, 0, NULL);
  cp_pool_info_t before;
  cp_pool_info(cpd_pool_if_created(0), &before);
  CHECK(share_round_trip(40 * MiB, 0) == 'p');
  cp_pool_info_t after;
  cp_pool_info(cpd_pool_if_created(0), &after);
  CHECK(after.stitches > before.stitches); /* the block shared was a stitched one */
  cudapool_free(b, 20 * MiB, 0, NULL);
  teardown();
}

static void *freed_block;
static size_t freed_size;

static void free_and_give_back(void) {
  cudapool_free(freed_block, freed_size, 0, NULL);
  cudapool_empty_cache();
  cudapool_empty_cache(); /* retired, then unmapped and released */
}

TEST(the_sender_frees_while_the_receiver_maps) {
  static const char *const confs[] = {"", "expandable_segments:True"};
  for (size_t k = 0; k < 2; k++) {
    setup(confs[k]);
    freed_size = 24 * MiB;
    REQUIRE(cpd_alloc(freed_size, 0, NULL, &freed_block) == CP_OK);
    CHECK(write_pattern((uintptr_t)freed_block, freed_size, 9) == CP_OK);
    static char handle[CPD_IPC_HANDLE_MAX];
    size_t len = 0, offset = 0;
    REQUIRE(cpd_ipc_share(freed_block, 2, handle, sizeof handle, &len, &offset) == CP_OK);
    CHECK_EQ_U(run_child(handle, len, offset, freed_size, 9, free_and_give_back), 0);
    cp_stats_t st;
    cp_pool_stats(cpd_pool_if_created(0), &st);
    CHECK_EQ_U(st.family[CP_STAT_RESERVED_BYTES][CP_KIND_ALL].current, 0); /* given back here */
    teardown();
  }
}

TEST(a_shared_block_and_a_paused_region_exclude_each_other) {
  setup("expandable_segments:True");
  uint32_t tag = 0;
  REQUIRE(cp_region_id("shared_weights", &tag) == CP_OK);
  const uint32_t outer = cp_region_enter(tag);
  void *w = NULL;
  REQUIRE(cpd_alloc(4 * MiB, 0, NULL, &w) == CP_OK);
  cp_region_enter(outer);
  static char handle[CPD_IPC_HANDLE_MAX];
  size_t len = 0, offset = 0;
  REQUIRE(cpd_ipc_share(w, 3, handle, sizeof handle, &len, &offset) == CP_OK);
  cp_pool_t *pool = cpd_pool_if_created(0);
  CHECK(cp_pool_pause(pool, tag, 0) == CP_ERR_STATE);
  CHECK(strstr(cp_last_error(), "shared with another process") != NULL);
  cudapool_free(w, 4 * MiB, 0, NULL); /* every receiver let it go */
  cp_region_enter(tag);
  REQUIRE(cpd_alloc(4 * MiB, 0, NULL, &w) == CP_OK);
  cp_region_enter(outer);
  CHECK(cp_pool_pause(pool, tag, 0) == CP_OK);
  /* ... and a block of a paused region is not shared: nothing is on the device behind it. */
  CHECK(cpd_ipc_share(w, 3, handle, sizeof handle, &len, &offset) == CP_ERR_STATE);
  CHECK(strstr(cp_last_error(), "is paused") != NULL);
  CHECK(!cp_pool_is_shared(pool, w));
  CHECK(cp_pool_resume(pool, tag) == CP_OK);
  CHECK(cpd_ipc_share(w, 3, handle, sizeof handle, &len, &offset) == CP_OK);
  cudapool_free(w, 4 * MiB, 0, NULL);
  teardown();
}

TEST(bad_handles_and_devices_that_cannot_export_say_so) {
  setup("expandable_segments:True");
  CHECK(sa.set_device_attr(0, CPSTANDIN_ATTR_POSIX_FD, 0) == 0); /* before the device is first used */
  void *p = NULL;
  REQUIRE(cpd_alloc(4 * MiB, 0, NULL, &p) == CP_OK);
  static char handle[CPD_IPC_HANDLE_MAX];
  size_t len = 0, offset = 0;
  CHECK(cpd_ipc_share(p, 3, handle, sizeof handle, &len, &offset) == CP_ERR_INVALID);
  CHECK(strstr(cp_last_error(), "POSIX file descriptors") != NULL);
  CHECK(cpd_ipc_share((char *)p + 64, 3, handle, sizeof handle, &len, &offset) == CP_ERR_INVALID);
  CHECK(strstr(cp_last_error(), "not a live allocation") != NULL);
  void *base = NULL, *token = NULL;
  CHECK(cpd_ipc_open("\3e-expandable", 13, 0, &base, &token) == CP_ERR_INVALID);
  CHECK(strstr(cp_last_error(), "'e'") != NULL);
  CHECK(cpd_ipc_open("\3p", 2, 0, &base, &token) == CP_ERR_INVALID);
  CHECK(cpd_ipc_open("\3c123", 5, 0, &base, &token) == CP_ERR_INVALID);
  CHECK(cpd_ipc_close(NULL) == CP_OK);
  cudapool_free(p, 4 * MiB, 0, NULL);
  teardown();
}

/* A driver that refuses exportable pages (CUDA_ERROR_NOT_PERMITTED, as in some containers):
 * the page is created without the handle type and the allocation succeeds; sharing it then
 * fails with the driver's reason. */
TEST(a_driver_that_refuses_exportable_pages_still_allocates) {
  setup("expandable_segments:True");
  CHECK(sa.fail_nth("cuMemCreate", 1, 800) == 0); /* CUDA_ERROR_NOT_PERMITTED, once */
  void *p = NULL;
  REQUIRE(cpd_alloc(4 * MiB, 0, NULL, &p) == CP_OK);
  static char handle[CPD_IPC_HANDLE_MAX];
  size_t len = 0, offset = 0;
  CHECK(cpd_ipc_share(p, 3, handle, sizeof handle, &len, &offset) != CP_OK);
  CHECK(strstr(cp_last_error(), "cuMemExportToShareableHandle") != NULL);
  cudapool_free(p, 4 * MiB, 0, NULL);
  teardown();
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "child") == 0) return child_main(argc, argv);
  self_path = "/proc/self/exe";
  static char exe[4096];
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n > 0) {
    exe[n] = '\0';
    self_path = exe;
  }
  if (!standin_open_or_skip(&sa, "test_cuda_standin_ipc")) return 0;
  RUN(a_plain_segment_through_the_drivers_ipc_handle);
  RUN(page_mapped_memory_through_posix_file_descriptors);
  RUN(descriptors_over_the_senders_socket);
  RUN(a_stitched_block_through_all_its_handles);
  RUN(the_sender_frees_while_the_receiver_maps);
  RUN(a_shared_block_and_a_paused_region_exclude_each_other);
  RUN(bad_handles_and_devices_that_cannot_export_say_so);
  RUN(a_driver_that_refuses_exportable_pages_still_allocates);
  return check_summary("test_cuda_standin_ipc");
}
