/* test_vmm.c — tests of the simulated device's page-mapped memory (csrc/backend/sim_vmm.c).
 * Owns: shared mappings, capacity, misuse, NO_TOUCH, NO_VMM, faults, lost device, clean destroy. */
#include <dirent.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend/sim.h"
#include "check.h"
#include "fixture.h"

#define G (2 * MiB) /* the default granularity */

/* Everything the device counts, to prove a failed call changed nothing. */
typedef struct snap_s {
  size_t ranges, pages, page_bytes, mappings, mapped_bytes, used, reservations;
} snap_t;

static snap_t snap(const cp_sim_t *sim) {
  snap_t s = {cp_sim_vmm_ranges(sim),       cp_sim_vmm_pages(sim),        cp_sim_vmm_page_bytes(sim),
              cp_sim_vmm_mappings(sim),     cp_sim_vmm_mapped_bytes(sim), cp_sim_reserved_bytes(sim),
              cp_sim_live_reservations(sim)};
  return s;
}

static int snap_eq(snap_t a, snap_t b) { return memcmp(&a, &b, sizeof a) == 0; }

/* Files this process has open (its /proc/self/fd entries). */
static int open_fds(void) {
  DIR *dir = opendir("/proc/self/fd");
  if (dir == NULL) return -1;
  int n = 0;
  for (struct dirent *e = readdir(dir); e != NULL; e = readdir(dir)) n += e->d_name[0] != '.';
  closedir(dir);
  return n - 1; /* the directory's own descriptor */
}

/* Host mappings of page files still in this process (/proc/self/maps lines naming them). */
static int page_file_mappings(void) {
  FILE *f = fopen("/proc/self/maps", "r");
  if (f == NULL) return -1;
  char line[512];
  int n = 0;
  while (fgets(line, sizeof line, f) != NULL) n += contains(line, "cudapool-sim-page");
  fclose(f);
  return n;
}

/* ---- The table, the granularity ------------------------------------------------------------- */

TEST(table_and_granularity) {
  cp_backend_t be;
  cp_sim_t *sim = make_sim(64 * MiB, 0, &be);
  REQUIRE(sim != NULL);
  CHECK(be.vmm_granularity && be.va_reserve && be.va_free && be.page_create && be.page_release && be.page_map &&
        be.page_unmap && be.page_set_access);
  CHECK(strcmp(cp_sim_call_name(CP_SIM_VMM_GRANULARITY), "vmm_granularity") == 0);
  CHECK(strcmp(cp_sim_call_name(CP_SIM_PAGE_SET_ACCESS), "page_set_access") == 0);
  CHECK(CP_SIM_MEM_INFO == 7 && CP_SIM_VMM_GRANULARITY == 8); /* the old kinds keep their index */

  /* Settable before the first page-mapped call only. */
  CHECK(cp_sim_set_vmm_granularity(sim, 3000) == CP_ERR_INVALID);
  CHECK(contains(cp_last_error(), "power of two"));
  CHECK(cp_sim_set_vmm_granularity(sim, 2048) == CP_ERR_INVALID);
  CHECK(cp_sim_set_vmm_granularity(sim, 6 * KiB) == CP_ERR_INVALID);
  CHECK(cp_sim_set_vmm_granularity(sim, 0) == CP_ERR_INVALID);
  CHECK(cp_sim_set_vmm_granularity(NULL, 4096) == CP_ERR_INVALID);
  size_t g = 0;
  CHECK(be.vmm_granularity(be.ctx, &g) == CP_OK);
  CHECK_EQ_U(g, 2 * MiB);
  CHECK_EQ_U(cp_sim_calls(sim, CP_SIM_VMM_GRANULARITY), 1);
  CHECK(be.vmm_granularity(be.ctx, NULL) == CP_ERR_INVALID);
  CHECK(cp_sim_set_vmm_granularity(sim, 4 * MiB) == CP_ERR_STATE);
  CHECK(contains(cp_last_error(), "already"));
  cp_sim_destroy(sim);

  /* 64 KiB (at least the host's page size on every Linux): real mappings at that grain. */
  sim = make_sim(64 * MiB, 0, &be);
  REQUIRE(sim != NULL);
  CHECK(cp_sim_set_vmm_granularity(sim, 64 * KiB) == CP_OK);
  CHECK(be.vmm_granularity(be.ctx, &g) == CP_OK);
  CHECK_EQ_U(g, 64 * KiB);
  uintptr_t r = 0;
  cp_page_t p = 0;
  REQUIRE(be.va_reserve(be.ctx, 4 * g, &r) == CP_OK);
  CHECK(r % g == 0);
  REQUIRE(be.page_create(be.ctx, g, &p) == CP_OK);
  CHECK(be.page_map(be.ctx, r + g, g, p) == CP_OK);
  CHECK(be.page_set_access(be.ctx, r + g, g) == CP_OK);
  memset((void *)(r + g), 0x5a, g);
  CHECK(((unsigned char *)r)[g + g - 1] == 0x5a);
  CHECK(be.page_unmap(be.ctx, r + g, g) == CP_OK);
  CHECK(be.page_release(be.ctx, p) == CP_OK);
  CHECK(be.va_free(be.ctx, r, 4 * g) == CP_OK);
  CHECK_EQ_U(cp_sim_reserved_bytes(sim), 0);
  cp_sim_destroy(sim);
}

TEST(no_vmm_leaves_the_entries_null) {
  cp_backend_t be;
  cp_sim_t *sim = make_sim(64 * MiB, CP_SIM_NO_VMM, &be);
  REQUIRE(sim != NULL);
  CHECK(be.reserve != NULL && be.mem_info != NULL);
  CHECK(!be.vmm_granularity && !be.va_reserve && !be.va_free && !be.page_create && !be.page_release && !be.page_map &&
        !be.page_unmap && !be.page_set_access);
  CHECK(cp_sim_set_vmm_granularity(sim, 4096) == CP_ERR_STATE);
  CHECK(contains(cp_last_error(), "no page-mapped memory"));
  cp_sim_destroy(sim);
}

/* ---- One page, two addresses ------------------------------------------------------------------ */

TEST(one_page_mapped_twice_shares_its_bytes) {
  cp_backend_t be;
  cp_sim_t *sim = make_sim(64 * MiB, 0, &be);
  REQUIRE(sim != NULL);
  uintptr_t a = 0, b = 0;
  REQUIRE(be.va_reserve(be.ctx, 4 * G, &a) == CP_OK);
  REQUIRE(be.va_reserve(be.ctx, 2 * G, &b) == CP_OK);
  CHECK(a % G == 0 && b % G == 0);
  CHECK(a + 4 * G <= b || b + 2 * G <= a);
  CHECK_EQ_U(cp_sim_vmm_ranges(sim), 2);
  CHECK_EQ_U(cp_sim_reserved_bytes(sim), 0); /* address ranges are no memory */

  cp_page_t p = 0, q = 0;
  REQUIRE(be.page_create(be.ctx, G, &p) == CP_OK);
  REQUIRE(be.page_create(be.ctx, G, &q) == CP_OK);
  CHECK(p != 0 && q != 0 && p != q);
  CHECK_EQ_U(cp_sim_reserved_bytes(sim), 2 * G);
  size_t free_b = 0, total_b = 0;
  CHECK(be.mem_info(be.ctx, &free_b, &total_b) == CP_OK);
  CHECK_EQ_U(free_b, 64 * MiB - 2 * G);

  /* p at a + G and at b + G; q at a (so a's range holds two pages side by side). */
  REQUIRE(be.page_map(be.ctx, a + G, G, p) == CP_OK);
  REQUIRE(be.page_map(be.ctx, b + G, G, p) == CP_OK);
  REQUIRE(be.page_map(be.ctx, a, G, q) == CP_OK);
  CHECK_EQ_U(cp_sim_vmm_mappings(sim), 3);
  CHECK_EQ_U(cp_sim_vmm_mapped_bytes(sim), 3 * G);
  CHECK_EQ_U(cp_sim_reserved_bytes(sim), 2 * G);          /* mapping takes no memory */
  REQUIRE(be.page_set_access(be.ctx, a, 2 * G) == CP_OK); /* two mappings at once */
  REQUIRE(be.page_set_access(be.ctx, b + G, G) == CP_OK);

  unsigned char *via_a = (unsigned char *)(a + G);
  unsigned char *via_b = (unsigned char *)(b + G);
  for (size_t i = 0; i < G; i += 4096) via_a[i] = (unsigned char)(i / 4096 + 1);
  via_a[G - 1] = 0xee;
  int same = 1;
  for (size_t i = 0; i < G; i += 4096) same &= via_b[i] == (unsigned char)(i / 4096 + 1);
  CHECK(same);
  CHECK(via_b[G - 1] == 0xee);
  via_b[17] = 0x42; /* and back the other way */
  CHECK(via_a[17] == 0x42);
  memset((void *)a, 0x11, G); /* q is its own memory */
  CHECK(via_b[0] == 1);
  /* cp_sim_vmm_resolve names the shared byte: both addresses give (p, 17). */
  cp_page_t rp = 0;
  size_t roff = 0, rsize = 0;
  CHECK(cp_sim_vmm_resolve(sim, a + G + 17, &rp, &roff, &rsize) == CP_OK);
  CHECK(rp == p && roff == 17 && rsize == G);
  CHECK(cp_sim_vmm_resolve(sim, b + G + 17, &rp, &roff, NULL) == CP_OK);
  CHECK(rp == p && roff == 17);
  CHECK(cp_sim_vmm_resolve(sim, a + G - 1, &rp, &roff, NULL) == CP_OK);
  CHECK(rp == q && roff == G - 1);
  CHECK(cp_sim_vmm_resolve(sim, b, &rp, &roff, NULL) == CP_ERR_INVALID); /* reserved, not mapped */
  CHECK(cp_sim_vmm_resolve(sim, a + 2 * G, NULL, NULL, NULL) == CP_ERR_INVALID);

  /* Unmap p at a + G: its bytes live on through b + G. */
  CHECK(be.page_unmap(be.ctx, a + G, G) == CP_OK);
  CHECK_EQ_U(cp_sim_vmm_mappings(sim), 2);
  CHECK(via_b[G - 1] == 0xee && via_b[17] == 0x42);
  /* Map it back elsewhere in a's range: the same bytes again. */
  REQUIRE(be.page_map(be.ctx, a + 3 * G, G, p) == CP_OK);
  REQUIRE(be.page_set_access(be.ctx, a + 3 * G, G) == CP_OK);
  CHECK(((unsigned char *)(a + 3 * G))[G - 1] == 0xee);

  CHECK(be.page_unmap(be.ctx, a, 4 * G) == CP_OK); /* both of a's mappings, and the hole */
  CHECK(be.page_unmap(be.ctx, b, 2 * G) == CP_OK);
  CHECK(be.page_release(be.ctx, p) == CP_OK);
  CHECK(be.page_release(be.ctx, q) == CP_OK);
  CHECK(be.va_free(be.ctx, a, 4 * G) == CP_OK);
  CHECK(be.va_free(be.ctx, b, 2 * G) == CP_OK);
  CHECK(snap_eq(snap(sim), (snap_t){0, 0, 0, 0, 0, 0, 0}));
  cp_sim_destroy(sim);
}

/* ---- Touching a mapping without access faults, as on a GPU ---------------------------------- */

static void on_segv(int sig) {
  (void)sig;
  _exit(77);
}

/* In a child: write one byte at `addr`. 77: it faulted; 0: it did not. */
static int child_touch(uintptr_t addr) {
  fflush(NULL);
  const pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_segv;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, NULL);
    sigaction(SIGBUS, &sa, NULL);
    *(volatile unsigned char *)addr = 1;
    _exit(0);
  }
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

TEST(access_is_needed_to_touch) {
  cp_backend_t be;
  cp_sim_t *sim = make_sim(64 * MiB, 0, &be);
  REQUIRE(sim != NULL);
  uintptr_t r = 0;
  cp_page_t p = 0;
  REQUIRE(be.va_reserve(be.ctx, 2 * G, &r) == CP_OK);
  REQUIRE(be.page_create(be.ctx, G, &p) == CP_OK);
  CHECK(child_touch(r) == 77); /* reserved, nothing mapped */
  REQUIRE(be.page_map(be.ctx, r, G, p) == CP_OK);
  CHECK(child_touch(r) == 77); /* mapped, no access yet */
  REQUIRE(be.page_set_access(be.ctx, r, G) == CP_OK);
  CHECK(child_touch(r) == 0);
  CHECK(child_touch(r + G) == 77); /* the rest of the range */
  REQUIRE(be.page_unmap(be.ctx, r, G) == CP_OK);
  CHECK(child_touch(r) == 77); /* unmapped: reserved again */
  cp_sim_destroy(sim);         /* page and range still live: destroy frees them */
}

/* ---- Capacity ------------------------------------------------------------------------------------ */

TEST(pages_count_against_the_capacity) {
  cp_backend_t be;
  cp_sim_t *sim = make_sim(4 * G, 0, &be);
  REQUIRE(sim != NULL);
  cp_page_t p[4] = {0, 0, 0, 0};
  uintptr_t seg = 0;
  REQUIRE(be.reserve(be.ctx, G, &seg) == CP_OK); /* a plain segment shares the capacity */
  for (int i = 0; i < 3; i++) REQUIRE(be.page_create(be.ctx, G, &p[i]) == CP_OK);
  cp_page_t none = 99;
  CHECK(be.page_create(be.ctx, G, &none) == CP_ERR_OOM);
  CHECK(contains(cp_last_error(), "sim: page_create(2097152 bytes): out of memory"));
  CHECK(none == 99);
  uintptr_t u = 7;
  CHECK(be.reserve(be.ctx, 512, &u) == CP_ERR_OOM);
  CHECK(u == 7);
  size_t free_b = 1, total_b = 0;
  CHECK(be.mem_info(be.ctx, &free_b, &total_b) == CP_OK);
  CHECK_EQ_U(free_b, 0);
  CHECK_EQ_U(cp_sim_vmm_page_bytes(sim), 3 * G);

  /* Released and never mapped: the bytes come back at once. */
  CHECK(be.page_release(be.ctx, p[0]) == CP_OK);
  CHECK_EQ_U(cp_sim_reserved_bytes(sim), 3 * G);
  CHECK_EQ_U(cp_sim_vmm_pages(sim), 2);
  REQUIRE(be.page_create(be.ctx, G, &p[3]) == CP_OK);

  /* Released while mapped: kept until the last unmap, in either order. */
  uintptr_t r = 0;
  REQUIRE(be.va_reserve(be.ctx, 4 * G, &r) == CP_OK);
  REQUIRE(be.page_map(be.ctx, r, G, p[1]) == CP_OK);
  REQUIRE(be.page_map(be.ctx, r + G, G, p[1]) == CP_OK);
  REQUIRE(be.page_set_access(be.ctx, r, 2 * G) == CP_OK);
  ((unsigned char *)r)[5] = 0x77;
  CHECK(be.page_release(be.ctx, p[1]) == CP_OK);
  CHECK_EQ_U(cp_sim_reserved_bytes(sim), 4 * G);
  CHECK_EQ_U(cp_sim_vmm_pages(sim), 3);
  CHECK(((unsigned char *)(r + G))[5] == 0x77);                     /* still there */
  CHECK(be.page_map(be.ctx, r + 2 * G, G, p[1]) == CP_ERR_INVALID); /* released: no new mapping */
  CHECK(contains(cp_last_error(), "the page was released"));
  CHECK_EQ_U(cp_sim_device_faults(sim), 0);
  CHECK(be.page_release(be.ctx, p[1]) == CP_ERR_INVALID);
  CHECK(contains(cp_last_error(), "released already"));
  CHECK_EQ_U(cp_sim_device_faults(sim), 1); /* a page released twice */
  CHECK(be.page_unmap(be.ctx, r, G) == CP_OK);
  CHECK_EQ_U(cp_sim_reserved_bytes(sim), 4 * G); /* one mapping left */
  CHECK(be.page_unmap(be.ctx, r + G, G) == CP_OK);
  CHECK_EQ_U(cp_sim_reserved_bytes(sim), 3 * G); /* gone with the last unmap */
  CHECK_EQ_U(cp_sim_vmm_pages(sim), 2);
  CHECK(be.page_release(be.ctx, p[1]) == CP_ERR_INVALID); /* and its handle with it */
  CHECK(contains(cp_last_error(), "unknown page"));
  CHECK_EQ_U(cp_sim_device_faults(sim), 2); /* released twice still: the handle was handed out */
  cp_sim_device_fault_t f;
  CHECK(cp_sim_device_fault(sim, 1, &f) == CP_OK);
  CHECK(strcmp(f.call, "page_release") == 0 && f.addr == p[1] && contains(f.what, "released twice"));

  CHECK(be.page_create(be.ctx, 2 * G, &none) == CP_ERR_OOM);
  CHECK(be.release(be.ctx, seg, G) == CP_OK);
  CHECK(be.page_create(be.ctx, 2 * G, &none) == CP_OK);
  CHECK_EQ_U(cp_sim_reserved_bytes(sim), 4 * G);
  cp_sim_destroy(sim);
}

/* ---- Misuse: CP_ERR_INVALID, a message, nothing changed --------------------------------------- */

#define EXPECT_INVALID(call, words)                                                           \
  do {                                                                                        \
    const snap_t before_ = snap(sim);                                                         \
    cp_clear_error();                                                                         \
    const int rc_ = (call);                                                                   \
    CHECK(rc_ == CP_ERR_INVALID);                                                             \
    CHECK(strncmp(cp_last_error(), "sim: ", 5) == 0 && contains(cp_last_error(), (words)));   \
    if (!contains(cp_last_error(), (words))) fprintf(stderr, "  got: %s\n", cp_last_error()); \
    CHECK(snap_eq(before_, snap(sim)));                                                       \
  } while (0)

TEST(misuse_is_refused_and_changes_nothing) {
  cp_backend_t be;
  cp_sim_t *sim = make_sim(64 * MiB, 0, &be);
  REQUIRE(sim != NULL);
  uintptr_t r = 0, s = 0, u = 0;
  cp_page_t p = 0, big = 0, loose = 0, gone = 0;
  REQUIRE(be.va_reserve(be.ctx, 4 * G, &r) == CP_OK);
  REQUIRE(be.va_reserve(be.ctx, 2 * G, &s) == CP_OK);
  REQUIRE(be.page_create(be.ctx, G, &p) == CP_OK);
  REQUIRE(be.page_create(be.ctx, 2 * G, &big) == CP_OK);
  REQUIRE(be.page_create(be.ctx, G, &loose) == CP_OK);
  REQUIRE(be.page_create(be.ctx, G, &gone) == CP_OK);
  REQUIRE(be.page_release(be.ctx, gone) == CP_OK);
  REQUIRE(be.page_map(be.ctx, r + 2 * G, 2 * G, big) == CP_OK); /* r: [hole][hole][big  big] */
  REQUIRE(be.page_map(be.ctx, s, G, p) == CP_OK);

  EXPECT_INVALID(be.va_reserve(be.ctx, 0, &u), "positive multiple of the granularity");
  EXPECT_INVALID(be.va_reserve(be.ctx, G + 4096, &u), "positive multiple of the granularity");
  EXPECT_INVALID(be.va_reserve(be.ctx, G, NULL), "out_addr is NULL");
  EXPECT_INVALID(be.va_free(be.ctx, r + G, G), "no range was reserved at this address");
  EXPECT_INVALID(be.va_free(be.ctx, r, 2 * G), "reserved with 8388608 bytes");
  EXPECT_INVALID(be.va_free(be.ctx, r, 4 * G), "still has 1 mapping");

  EXPECT_INVALID(be.page_create(be.ctx, 0, &u), "positive multiple of the granularity");
  EXPECT_INVALID(be.page_create(be.ctx, 3 * MiB, &u), "positive multiple of the granularity");
  EXPECT_INVALID(be.page_create(be.ctx, G, NULL), "out_page is NULL");
  EXPECT_INVALID(be.page_release(be.ctx, 12345), "unknown page");
  CHECK_EQ_U(cp_sim_device_faults(sim), 0); /* never handed out: misuse, no fault */
  EXPECT_INVALID(be.page_release(be.ctx, gone), "unknown page");
  CHECK_EQ_U(cp_sim_device_faults(sim), 1); /* released twice: a device fault */
  cp_sim_clear_device_faults(sim);

  EXPECT_INVALID(be.page_map(be.ctx, r, G, 12345), "unknown page");
  EXPECT_INVALID(be.page_map(be.ctx, r, G, gone), "unknown page");
  EXPECT_INVALID(be.page_map(be.ctx, r, 2 * G, loose), "the page has 2097152 bytes and is mapped whole");
  EXPECT_INVALID(be.page_map(be.ctx, r + 4096, G, loose), "address is not a multiple of the granularity");
  EXPECT_INVALID(be.page_map(be.ctx, r, G + 4096, loose), "positive multiple of the granularity");
  EXPECT_INVALID(be.page_map(be.ctx, 0, G, loose), "address is not a multiple");
  EXPECT_INVALID(be.page_map(be.ctx, r + 2 * G, G, loose), "already mapped");
  EXPECT_INVALID(be.page_map(be.ctx, r + 3 * G, G, loose), "already mapped"); /* the middle of one */
  EXPECT_INVALID(be.page_map(be.ctx, s, G, loose), "already mapped");
  EXPECT_INVALID(be.page_map(be.ctx, r + 3 * G, 2 * G, big), "not inside one reserved range"); /* past r's end */
  EXPECT_INVALID(be.page_map(be.ctx, (uintptr_t)64 * GiB, G, loose), "not inside one reserved range");
  EXPECT_INVALID(be.page_map(be.ctx, UINTPTR_MAX - G + 1, 2 * G, big), "wraps around");

  EXPECT_INVALID(be.page_unmap(be.ctx, r + 2 * G, G), "would cut the mapping");
  EXPECT_INVALID(be.page_unmap(be.ctx, r + 3 * G, G), "would cut the mapping");
  EXPECT_INVALID(be.page_unmap(be.ctx, r, G), "nothing is mapped there");
  EXPECT_INVALID(be.page_unmap(be.ctx, r + 2 * G, 4 * G), "not inside one reserved range");
  EXPECT_INVALID(be.page_unmap(be.ctx, r + 2 * G, 4096), "positive multiple of the granularity");

  EXPECT_INVALID(be.page_set_access(be.ctx, r, G), "not covered by whole mappings");
  EXPECT_INVALID(be.page_set_access(be.ctx, r + G, 2 * G), "not covered by whole mappings");
  EXPECT_INVALID(be.page_set_access(be.ctx, r + 3 * G, G), "one cut");
  EXPECT_INVALID(be.page_set_access(be.ctx, r + 2 * G, 4096), "positive multiple");

  /* After all that, everything still works. */
  CHECK(be.page_set_access(be.ctx, r + 2 * G, 2 * G) == CP_OK);
  CHECK(be.page_map(be.ctx, r, G, loose) == CP_OK);
  CHECK(be.page_unmap(be.ctx, r, 4 * G) == CP_OK);
  CHECK(be.page_unmap(be.ctx, s, G) == CP_OK);
  CHECK(be.va_free(be.ctx, r, 4 * G) == CP_OK);
  CHECK(be.va_free(be.ctx, s, 2 * G) == CP_OK);
  CHECK_EQ_U(cp_sim_vmm_ranges(sim), 0);
  CHECK_EQ_U(cp_sim_vmm_mappings(sim), 0);
  CHECK_EQ_U(cp_sim_vmm_pages(sim), 3);
  CHECK_EQ_U(cp_sim_device_faults(sim), 0); /* misuse of every other kind is no device fault */
  cp_sim_destroy(sim);
}

/* ---- NO_TOUCH: addresses and bookkeeping only ------------------------------------------------- */

TEST(no_touch_has_no_host_memory) {
  cp_backend_t be;
  cp_sim_t *sim = make_sim((size_t)1 << 40, CP_SIM_NO_TOUCH, &be); /* 1 TiB, far beyond this host */
  REQUIRE(sim != NULL);
  const int fds = open_fds();
  uintptr_t r = 0, s = 0, seg = 0;
  cp_page_t p = 0, q = 0;
  REQUIRE(be.va_reserve(be.ctx, 512 * GiB, &r) == CP_OK);
  REQUIRE(be.reserve(be.ctx, 1000, &seg) == CP_OK);
  REQUIRE(be.va_reserve(be.ctx, G, &s) == CP_OK);
  CHECK(r % G == 0 && s % G == 0);
  CHECK(seg >= r + 512 * GiB && s >= seg + G); /* one bump pointer, nothing overlaps */
  REQUIRE(be.page_create(be.ctx, 256 * GiB, &p) == CP_OK);
  REQUIRE(be.page_create(be.ctx, 256 * GiB, &q) == CP_OK);
  CHECK(open_fds() == fds); /* no memfd behind them */
  CHECK(be.page_create(be.ctx, 512 * GiB, &p) == CP_ERR_OOM);
  CHECK(be.page_map(be.ctx, r, 256 * GiB, p) == CP_OK);
  CHECK(be.page_map(be.ctx, r + 256 * GiB, 256 * GiB, p) == CP_OK);
  CHECK(be.page_set_access(be.ctx, r, 512 * GiB) == CP_OK);
  CHECK_EQ_U(cp_sim_vmm_mapped_bytes(sim), 512 * GiB);
  CHECK(be.page_map(be.ctx, r + G, 256 * GiB, q) == CP_ERR_INVALID); /* the same rules */
  CHECK(be.page_release(be.ctx, p) == CP_OK);
  CHECK(be.page_unmap(be.ctx, r, 256 * GiB) == CP_OK);
  CHECK_EQ_U(cp_sim_reserved_bytes(sim), 512 * GiB + 1000);
  CHECK(be.page_unmap(be.ctx, r + 256 * GiB, 256 * GiB) == CP_OK);
  CHECK_EQ_U(cp_sim_reserved_bytes(sim), 256 * GiB + 1000);
  CHECK(be.va_free(be.ctx, r, 512 * GiB) == CP_OK);
  CHECK(be.page_map(be.ctx, s, G, q) == CP_ERR_INVALID); /* size other than the page's */
  cp_sim_destroy(sim);                                   /* q, s and seg still live */

  /* A granularity above the 2 MiB step of the bump pointer aligns to itself. */
  sim = make_sim((size_t)1 << 40, CP_SIM_NO_TOUCH, &be);
  REQUIRE(sim != NULL);
  REQUIRE(cp_sim_set_vmm_granularity(sim, 32 * MiB) == CP_OK);
  REQUIRE(be.reserve(be.ctx, 1000, &seg) == CP_OK);
  REQUIRE(be.va_reserve(be.ctx, 32 * MiB, &r) == CP_OK);
  CHECK(r % (32 * MiB) == 0 && r > seg);
  REQUIRE(be.reserve(be.ctx, 1000, &seg) == CP_OK);
  CHECK(seg >= r + 32 * MiB);
  cp_sim_destroy(sim);
}

/* ---- Faults, delays and a lost device, for every page-mapped kind ----------------------------- */

/* A range r of 4 granules with page `mapped` at r + 2G (access set), an empty range `spare`,
 * and a page `loose` mapped nowhere: every call below succeeds on it once. */
typedef struct vmm_setup_s {
  uintptr_t r, spare;
  cp_page_t mapped, loose;
} vmm_setup_t;

static int setup(cp_backend_t *be, vmm_setup_t *fx) {
  return be->va_reserve(be->ctx, 4 * G, &fx->r) != CP_OK || be->va_reserve(be->ctx, G, &fx->spare) != CP_OK ||
                 be->page_create(be->ctx, G, &fx->mapped) != CP_OK ||
                 be->page_create(be->ctx, G, &fx->loose) != CP_OK ||
                 be->page_map(be->ctx, fx->r + 2 * G, G, fx->mapped) != CP_OK ||
                 be->page_set_access(be->ctx, fx->r + 2 * G, G) != CP_OK
             ? -1
             : 0;
}

/* One call of `kind`; its out-parameter (if any) goes to *out. */
static int vmm_call(cp_backend_t *be, cp_sim_call_t kind, const vmm_setup_t *fx, uintptr_t *out) {
  size_t g = 0;
  int rc;
  switch (kind) {
    case CP_SIM_VMM_GRANULARITY:
      rc = be->vmm_granularity(be->ctx, &g);
      if (rc == CP_OK) *out = g;
      return rc;
    case CP_SIM_VA_RESERVE: return be->va_reserve(be->ctx, G, out);
    case CP_SIM_VA_FREE: return be->va_free(be->ctx, fx->spare, G);
    case CP_SIM_PAGE_CREATE: return be->page_create(be->ctx, G, out);
    case CP_SIM_PAGE_RELEASE: return be->page_release(be->ctx, fx->loose);
    case CP_SIM_PAGE_MAP: return be->page_map(be->ctx, fx->r, G, fx->loose);
    case CP_SIM_PAGE_UNMAP: return be->page_unmap(be->ctx, fx->r + 2 * G, G);
    case CP_SIM_PAGE_SET_ACCESS: return be->page_set_access(be->ctx, fx->r + 2 * G, G);
    default: return -1;
  }
}

TEST(faults_and_lost_device_every_vmm_kind) {
  int kinds = 0;
  for (int k = CP_SIM_VMM_GRANULARITY; k <= CP_SIM_PAGE_SET_ACCESS; k++) {
    const cp_sim_call_t kind = (cp_sim_call_t)k;
    const int want = (k % 2) ? CP_ERR_OOM : CP_ERR_BACKEND;
    for (int lost = 0; lost < 2; lost++) {
      cp_backend_t be;
      cp_sim_t *sim = make_sim(64 * MiB, 0, &be);
      REQUIRE(sim != NULL);
      vmm_setup_t fx;
      REQUIRE(setup(&be, &fx) == 0);
      cp_sim_reset_counters(sim);
      const snap_t before = snap(sim);
      if (lost)
        cp_sim_set_lost(sim, 1);
      else
        cp_sim_fail_nth(sim, kind, 1, want);
      uintptr_t out = 0xabc;
      const int rc = vmm_call(&be, kind, &fx, &out);
      CHECK(rc == (lost ? CP_ERR_BACKEND : want));
      CHECK(out == 0xabc);
      CHECK(contains(cp_last_error(), cp_sim_call_name(kind)));
      CHECK(contains(cp_last_error(), lost ? "device lost" : "sim: injected failure in "));
      CHECK_EQ_U(cp_sim_calls(sim, kind), 1);
      CHECK_EQ_U(cp_sim_faults_injected(sim), lost ? 0 : 1);
      CHECK_EQ_U(cp_sim_device_faults(sim), 0);
      if (rc == CP_OK) fprintf(stderr, "  kind %s did not fail\n", cp_sim_call_name(kind));
      if (kind == CP_SIM_PAGE_RELEASE && !lost) {
        /* A failed release still ends the handle (the driver may have released the page
         * before failing): `loose`, mapped nowhere, is gone with its bytes, and releasing it
         * again is a device fault. */
        snap_t after = before;
        after.pages--;
        after.page_bytes -= G;
        after.used -= G;
        CHECK(snap_eq(after, snap(sim)));
        CHECK(vmm_call(&be, kind, &fx, &out) == CP_ERR_INVALID);
        CHECK_EQ_U(cp_sim_device_faults(sim), 1);
        CHECK(snap_eq(after, snap(sim)));
        cp_sim_destroy(sim);
        continue;
      }
      CHECK(snap_eq(before, snap(sim))); /* a lost device ends no handle */

      /* Back to normal: the same call succeeds and changes what it should. */
      cp_sim_set_lost(sim, 0);
      CHECK(vmm_call(&be, kind, &fx, &out) == CP_OK);
      CHECK_EQ_U(cp_sim_calls(sim, kind), 2);
      CHECK_EQ_U(cp_sim_device_faults(sim), 0);
      if (kind == CP_SIM_PAGE_UNMAP) CHECK_EQ_U(cp_sim_vmm_mappings(sim), 0);
      if (kind == CP_SIM_PAGE_MAP) CHECK_EQ_U(cp_sim_vmm_mappings(sim), 2);
      if (kind == CP_SIM_VA_FREE) CHECK_EQ_U(cp_sim_vmm_ranges(sim), 1);
      if (kind == CP_SIM_PAGE_RELEASE) CHECK_EQ_U(cp_sim_vmm_pages(sim), 1);
      if (kind == CP_SIM_PAGE_CREATE) CHECK_EQ_U(cp_sim_vmm_pages(sim), 3);
      cp_sim_destroy(sim);
    }
    kinds++;
  }
  CHECK(kinds == 8);
}

/* ---- Queued work on page-mapped memory (Note [Simulated asynchrony]) -------------------------- */

TEST(queued_work_on_page_mapped_memory) {
  cp_backend_t be;
  cp_sim_t *sim = make_sim(64 * MiB, 0, &be);
  REQUIRE(sim != NULL);
  uintptr_t r = 0, s = 0;
  cp_page_t p = 0, q = 0;
  REQUIRE(be.va_reserve(be.ctx, 4 * G, &r) == CP_OK);
  REQUIRE(be.va_reserve(be.ctx, G, &s) == CP_OK);
  REQUIRE(be.page_create(be.ctx, G, &p) == CP_OK);
  REQUIRE(be.page_create(be.ctx, G, &q) == CP_OK);
  REQUIRE(be.page_map(be.ctx, r, G, p) == CP_OK);
  REQUIRE(be.page_set_access(be.ctx, r, G) == CP_OK);
  REQUIRE(be.page_map(be.ctx, r + G, G, q) == CP_OK); /* no access yet */

  /* A launch needs memory mapped with access; anything else is a device fault. */
  CHECK(cp_sim_launch(sim, 1, r, G) == CP_OK);
  CHECK(cp_sim_launch(sim, 1, r + G, 4096) == CP_ERR_INVALID);        /* mapped, no access */
  CHECK(cp_sim_launch(sim, 1, r + 2 * G, 4096) == CP_ERR_INVALID);    /* reserved, nothing mapped */
  CHECK(cp_sim_launch(sim, 1, r + G - 4096, 8192) == CP_ERR_INVALID); /* half of it without access */
  CHECK_EQ_U(cp_sim_device_faults(sim), 3);
  cp_sim_device_fault_t f;
  CHECK(cp_sim_device_fault(sim, 0, &f) == CP_OK);
  CHECK(strcmp(f.call, "launch") == 0 && f.addr == r + G && f.size == 4096 && f.stream == 1);
  CHECK_EQ_U(cp_sim_queued_launches(sim), 1);
  cp_sim_clear_device_faults(sim);
  REQUIRE(be.page_set_access(be.ctx, r + G, G) == CP_OK);
  CHECK(cp_sim_launch(sim, 1, r + G - 4096, 8192) == CP_OK); /* across two mappings */
  CHECK_EQ_U(cp_sim_queued_launches(sim), 2);
  CHECK_EQ_U(cp_sim_device_faults(sim), 0);

  /* Unmapping memory queued work touches goes ahead, as the driver's does, and is a fault
   * naming the work. */
  CHECK(be.page_unmap(be.ctx, r + G, G) == CP_OK);
  CHECK_EQ_U(cp_sim_vmm_mappings(sim), 1);
  CHECK_EQ_U(cp_sim_device_faults(sim), 1);
  CHECK(cp_sim_device_fault(sim, 0, &f) == CP_OK);
  CHECK(strcmp(f.call, "page_unmap") == 0 && f.addr == r + G - 4096 && f.size == 8192 && f.stream == 1);
  CHECK(contains(f.what, "queued work"));
  CHECK(cp_sim_launch(sim, 2, r + G, 4096) == CP_ERR_INVALID); /* unmapped: no longer the device's */
  CHECK_EQ_U(cp_sim_device_faults(sim), 2);
  cp_sim_clear_device_faults(sim);
  cp_sim_complete(sim, 1);
  CHECK_EQ_U(cp_sim_queued_launches(sim), 0);

  /* One page at two addresses: handing out the other address while work touches the page is
   * a fault (byte exact), on any stream but the work's own. */
  REQUIRE(be.page_map(be.ctx, s, G, p) == CP_OK);
  REQUIRE(be.page_set_access(be.ctx, s, G) == CP_OK);
  CHECK(cp_sim_launch(sim, 1, r + 4096, 4096) == CP_OK);
  CHECK_EQ_U(cp_sim_check_handoff(sim, 2, s, 4096), 0);
  CHECK_EQ_U(cp_sim_check_handoff(sim, 2, s + 8192, 4096), 0);
  CHECK_EQ_U(cp_sim_check_handoff(sim, 1, s, G), 0);
  CHECK_EQ_U(cp_sim_device_faults(sim), 0);
  CHECK_EQ_U(cp_sim_check_handoff(sim, 2, s + 8191, 1), 1);
  CHECK(cp_sim_device_fault(sim, 0, &f) == CP_OK);
  CHECK(strcmp(f.call, "handoff") == 0 && f.addr == r + 4096 && f.stream == 1);
  CHECK_EQ_U(cp_sim_check_handoff(sim, 2, r, G), 1); /* and at its own address */
  cp_sim_clear_device_faults(sim);
  /* Unmapping the other address leaves the work's mapping alone: no fault. */
  CHECK(be.page_unmap(be.ctx, s, G) == CP_OK);
  CHECK_EQ_U(cp_sim_device_faults(sim), 0);
  CHECK_EQ_U(cp_sim_check_handoff(sim, 2, s, G), 0); /* nothing mapped there now */
  /* Once the work is done, unmapping its memory is fine. */
  cp_event_t e = 0;
  REQUIRE(be.event_create(be.ctx, &e) == CP_OK);
  CHECK(be.event_record(be.ctx, e, 1) == CP_OK);
  CHECK(be.event_synchronize(be.ctx, e) == CP_OK);
  CHECK(be.page_unmap(be.ctx, r, G) == CP_OK);
  CHECK_EQ_U(cp_sim_device_faults(sim), 0);
  CHECK(be.event_destroy(be.ctx, e) == CP_OK);
  CHECK(be.page_release(be.ctx, p) == CP_OK);
  CHECK(be.page_release(be.ctx, q) == CP_OK);
  CHECK(be.va_free(be.ctx, r, 4 * G) == CP_OK);
  CHECK(be.va_free(be.ctx, s, G) == CP_OK);
  CHECK(snap_eq(snap(sim), (snap_t){0, 0, 0, 0, 0, 0, 0}));
  CHECK_EQ_U(cp_sim_device_faults(sim), 0);
  cp_sim_destroy(sim);
}

TEST(capture_refuses_unmap_and_va_free) {
  cp_backend_t be;
  cp_sim_t *sim = make_sim(64 * MiB, 0, &be);
  REQUIRE(sim != NULL);
  vmm_setup_t fx;
  REQUIRE(setup(&be, &fx) == 0);
  CHECK(cp_sim_set_capturing(sim, 5, 1) == CP_OK);
  /* Memory is never given back during a capture: refused, a fault each, nothing changed. */
  const snap_t before = snap(sim);
  CHECK(be.page_unmap(be.ctx, fx.r + 2 * G, G) == CP_ERR_BACKEND);
  CHECK(contains(cp_last_error(), "page_unmap: operation not permitted when stream is capturing"));
  CHECK(be.va_free(be.ctx, fx.spare, G) == CP_ERR_BACKEND);
  CHECK(contains(cp_last_error(), "va_free: operation not permitted when stream is capturing"));
  CHECK(snap_eq(before, snap(sim)));
  CHECK_EQ_U(cp_sim_capture_violations(sim), 2);
  CHECK_EQ_U(cp_sim_device_faults(sim), 2);
  cp_sim_device_fault_t f;
  CHECK(cp_sim_device_fault(sim, 0, &f) == CP_OK);
  CHECK(strcmp(f.call, "page_unmap") == 0);
  CHECK(cp_sim_device_fault(sim, 1, &f) == CP_OK);
  CHECK(strcmp(f.call, "va_free") == 0);
  /* Making memory is not refused, nor is releasing a page (its bytes go with the last unmap). */
  uintptr_t r2 = 0;
  cp_page_t p2 = 0;
  CHECK(be.va_reserve(be.ctx, G, &r2) == CP_OK);
  CHECK(be.page_create(be.ctx, G, &p2) == CP_OK);
  CHECK(be.page_map(be.ctx, r2, G, p2) == CP_OK);
  CHECK(be.page_set_access(be.ctx, r2, G) == CP_OK);
  CHECK(be.page_release(be.ctx, fx.loose) == CP_OK);
  CHECK_EQ_U(cp_sim_capture_violations(sim), 2);
  CHECK_EQ_U(cp_sim_device_faults(sim), 2);
  CHECK(cp_sim_set_capturing(sim, 5, 0) == CP_OK);
  CHECK(be.page_unmap(be.ctx, fx.r + 2 * G, G) == CP_OK);
  CHECK(be.va_free(be.ctx, fx.spare, G) == CP_OK);
  CHECK(be.page_unmap(be.ctx, r2, G) == CP_OK);
  CHECK(be.va_free(be.ctx, r2, G) == CP_OK);
  CHECK_EQ_U(cp_sim_capture_violations(sim), 2);
  CHECK_EQ_U(cp_sim_device_faults(sim), 2);
  cp_sim_destroy(sim); /* fx.mapped, p2 and fx.r still live */
}

TEST(delay_every_vmm_kind) {
  cp_backend_t be;
  cp_sim_t *sim = make_sim(64 * MiB, 0, &be);
  REQUIRE(sim != NULL);
  for (int k = CP_SIM_VMM_GRANULARITY; k <= CP_SIM_PAGE_SET_ACCESS; k++) {
    vmm_setup_t fx;
    REQUIRE(setup(&be, &fx) == 0);
    const uint64_t entered = cp_sim_delays_entered(sim);
    cp_sim_delay_nth(sim, (cp_sim_call_t)k, 1, 1);
    uintptr_t out = 0;
    CHECK(vmm_call(&be, (cp_sim_call_t)k, &fx, &out) == CP_OK);
    CHECK_EQ_U(cp_sim_delays_entered(sim), entered + 1);
  }
  cp_sim_destroy(sim); /* eight fixtures' worth of ranges, pages and mappings */
}

/* ---- Destroy frees everything ------------------------------------------------------------------ */

TEST(destroy_with_live_ranges_pages_and_mappings) {
  const int fds = open_fds();
  const int maps = page_file_mappings();
  CHECK(fds > 0 && maps == 0);
  cp_backend_t be;
  cp_sim_t *sim = make_sim(64 * MiB, 0, &be);
  REQUIRE(sim != NULL);
  vmm_setup_t fx;
  REQUIRE(setup(&be, &fx) == 0);
  cp_page_t held = 0;
  REQUIRE(be.page_create(be.ctx, G, &held) == CP_OK);
  REQUIRE(be.page_map(be.ctx, fx.r, G, held) == CP_OK);
  REQUIRE(be.page_map(be.ctx, fx.spare, G, held) == CP_OK);
  REQUIRE(be.page_release(be.ctx, held) == CP_OK); /* released, still mapped twice */
  CHECK(open_fds() == fds + 3);
  CHECK(page_file_mappings() == 3);
  cp_sim_destroy(sim);
  CHECK(open_fds() == fds);
  CHECK(page_file_mappings() == 0);
}

int main(void) {
  RUN(table_and_granularity);
  RUN(no_vmm_leaves_the_entries_null);
  RUN(one_page_mapped_twice_shares_its_bytes);
  RUN(access_is_needed_to_touch);
  RUN(pages_count_against_the_capacity);
  RUN(misuse_is_refused_and_changes_nothing);
  RUN(no_touch_has_no_host_memory);
  RUN(faults_and_lost_device_every_vmm_kind);
  RUN(queued_work_on_page_mapped_memory);
  RUN(capture_refuses_unmap_and_va_free);
  RUN(delay_every_vmm_kind);
  RUN(destroy_with_live_ranges_pages_and_mappings);
  return check_summary("test_vmm");
}
