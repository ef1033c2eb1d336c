/* test_sim.c — unit tests of the simulated device (csrc/backend/sim.c).
 * Owns: capacity, alignment, release checks, NO_TOUCH, events, fault injection, threads. */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "backend/sim.h"
#include "check.h"
#include "fixture.h"

TEST(create_and_backend_table) {
  cp_backend_t be;
  cp_sim_t *sim = make_sim(64 * MiB, 0, &be);
  REQUIRE(sim != NULL);
  CHECK(strcmp(be.name, "sim") == 0);
  CHECK(be.ctx == sim);
  CHECK(be.device == 0);
  CHECK(be.reserve && be.release && be.event_create && be.event_destroy && be.event_record && be.event_query &&
        be.event_synchronize && be.mem_info);
  CHECK_EQ_U(cp_sim_capacity(sim), 64 * MiB);
  CHECK_EQ_U(cp_sim_reserved_bytes(sim), 0);
  CHECK_EQ_U(cp_sim_live_reservations(sim), 0);
  CHECK_EQ_U(cp_sim_live_events(sim), 0);
  CHECK(strcmp(cp_sim_call_name(CP_SIM_RESERVE), "reserve") == 0);
  CHECK(strcmp(cp_sim_call_name(CP_SIM_MEM_INFO), "mem_info") == 0);
  CHECK(strcmp(cp_sim_call_name(CP_SIM_EVENT_SYNCHRONIZE), "event_synchronize") == 0);
  cp_sim_destroy(sim);

  CHECK(cp_sim_create(MiB, 1u << 7, &sim) == CP_ERR_INVALID); /* unknown flag */
  CHECK(cp_sim_create(MiB, 0, NULL) == CP_ERR_INVALID);
}

TEST(capacity_and_oom) {
  cp_backend_t be;
  cp_sim_t *sim = make_sim(10 * MiB, 0, &be);
  REQUIRE(sim != NULL);
  uintptr_t a = 0, b = 0, c = 0;
  CHECK(be.reserve(be.ctx, 6 * MiB, &a) == CP_OK);
  CHECK(be.reserve(be.ctx, 4 * MiB, &b) == CP_OK); /* exactly full */
  CHECK_EQ_U(cp_sim_reserved_bytes(sim), 10 * MiB);

  size_t free_b = 1, total_b = 1;
  CHECK(be.mem_info(be.ctx, &free_b, &total_b) == CP_OK);
  CHECK_EQ_U(free_b, 0);
  CHECK_EQ_U(total_b, 10 * MiB);

  c = 12345;
  CHECK(be.reserve(be.ctx, 1, &c) == CP_ERR_OOM);
  CHECK_EQ_U(c, 12345); /* out-parameter untouched on failure */
  CHECK(contains(cp_last_error(), "reserve"));
  CHECK(contains(cp_last_error(), "1 bytes"));
  CHECK(contains(cp_last_error(), "10485760 of 10485760"));
  CHECK_EQ_U(cp_sim_live_reservations(sim), 2);

  CHECK(be.release(be.ctx, a, 6 * MiB) == CP_OK);
  CHECK(be.mem_info(be.ctx, &free_b, &total_b) == CP_OK);
  CHECK_EQ_U(free_b, 6 * MiB);
  CHECK(be.reserve(be.ctx, 6 * MiB + 1, &c) == CP_ERR_OOM);
  CHECK(be.reserve(be.ctx, 6 * MiB, &c) == CP_OK);
  CHECK(be.release(be.ctx, b, 4 * MiB) == CP_OK);
  CHECK(be.release(be.ctx, c, 6 * MiB) == CP_OK);
  CHECK_EQ_U(cp_sim_reserved_bytes(sim), 0);
  CHECK_EQ_U(cp_sim_live_reservations(sim), 0);

  CHECK(be.reserve(be.ctx, 0, &c) == CP_ERR_INVALID);
  CHECK(be.reserve(be.ctx, SIZE_MAX, &c) == CP_ERR_OOM); /* no overflow in the check */
  cp_sim_destroy(sim);
}

TEST(alignment_distinct_and_real_memory) {
  cp_backend_t be;
  cp_sim_t *sim = make_sim(64 * MiB, 0, &be);
  REQUIRE(sim != NULL);
  enum { N = 64 };
  uintptr_t addr[N];
  size_t size[N];
  for (int i = 0; i < N; i++) {
    size[i] = (size_t)(i * 37 + 1) * 13; /* odd sizes */
    REQUIRE(be.reserve(be.ctx, size[i], &addr[i]) == CP_OK);
    CHECK(addr[i] != 0);
    CHECK_EQ_U(addr[i] % 512, 0);
    memset((void *)addr[i], i, size[i]); /* every byte is real (ASan would object otherwise) */
  }
  for (int i = 0; i < N; i++)
    for (int j = i + 1; j < N; j++) {
      /* distinct and non-overlapping */
      CHECK(addr[i] + size[i] <= addr[j] || addr[j] + size[j] <= addr[i]);
    }
  for (int i = 0; i < N; i++) {
    const unsigned char *p = (const unsigned char *)addr[i];
    CHECK(p[0] == (unsigned char)i && p[size[i] - 1] == (unsigned char)i);
  }
  /* Release half; the rest is freed by destroy (LeakSanitizer checks it). */
  for (int i = 0; i < N; i += 2) CHECK(be.release(be.ctx, addr[i], size[i]) == CP_OK);
  CHECK_EQ_U(cp_sim_live_reservations(sim), N / 2);
  cp_sim_destroy(sim);
}

TEST(release_validation) {
  cp_backend_t be;
  cp_sim_t *sim = make_sim(16 * MiB, 0, &be);
  REQUIRE(sim != NULL);
  uintptr_t a = 0;
  REQUIRE(be.reserve(be.ctx, 4096, &a) == CP_OK);

  CHECK(be.release(be.ctx, a + 512, 4096) == CP_ERR_INVALID);
  CHECK(contains(cp_last_error(), "unknown address"));
  CHECK(be.release(be.ctx, 0, 4096) == CP_ERR_INVALID);
  CHECK(be.release(be.ctx, a, 4095) == CP_ERR_INVALID);
  CHECK(contains(cp_last_error(), "4096"));
  CHECK(be.release(be.ctx, a, 8192) == CP_ERR_INVALID);
  /* nothing changed */
  CHECK_EQ_U(cp_sim_reserved_bytes(sim), 4096);
  CHECK_EQ_U(cp_sim_live_reservations(sim), 1);

  CHECK(be.release(be.ctx, a, 4096) == CP_OK);
  CHECK(be.release(be.ctx, a, 4096) == CP_ERR_INVALID); /* double release */
  CHECK_EQ_U(cp_sim_reserved_bytes(sim), 0);
  cp_sim_destroy(sim);
}

TEST(no_touch_mode) {
  cp_backend_t be;
  const size_t capacity = (size_t)1 << 40; /* 1 TiB: far more than this machine */
  cp_sim_t *sim = make_sim(capacity, CP_SIM_NO_TOUCH, &be);
  REQUIRE(sim != NULL);
  enum { N = 20000 };
  static uintptr_t addr[N];
  static size_t size[N];
  size_t total = 0;
  for (int i = 0; i < N; i++) {
    size[i] = (size_t)(i % 7 + 1) * 3 * MiB + (size_t)i * 512; /* 3..21 MiB: ~230 GiB in all */
    REQUIRE(be.reserve(be.ctx, size[i], &addr[i]) == CP_OK);
    total += size[i];
    CHECK_EQ_U(addr[i] % (2 * MiB), 0);
    if (i > 0) CHECK(addr[i] >= addr[i - 1] + size[i - 1]); /* bump: increasing, no overlap */
  }
  CHECK_EQ_U(cp_sim_reserved_bytes(sim), total);
  CHECK_EQ_U(cp_sim_live_reservations(sim), N);
  size_t free_b = 0, total_b = 0;
  CHECK(be.mem_info(be.ctx, &free_b, &total_b) == CP_OK);
  CHECK_EQ_U(free_b, capacity - total);
  CHECK(be.reserve(be.ctx, capacity - total + 1, &addr[0]) == CP_ERR_OOM);

  /* Release all in a scattered order (exercises table deletion), then reserve again:
   * addresses are never reused. */
  for (int i = 0; i < N; i += 3) CHECK(be.release(be.ctx, addr[i], size[i]) == CP_OK);
  for (int i = 1; i < N; i += 3) CHECK(be.release(be.ctx, addr[i], size[i]) == CP_OK);
  for (int i = 2; i < N; i += 3) CHECK(be.release(be.ctx, addr[i], size[i]) == CP_OK);
  CHECK_EQ_U(cp_sim_reserved_bytes(sim), 0);
  CHECK_EQ_U(cp_sim_live_reservations(sim), 0);
  uintptr_t again = 0;
  CHECK(be.reserve(be.ctx, MiB, &again) == CP_OK);
  CHECK(again >= addr[N - 1] + size[N - 1]);
  CHECK_EQ_U(again % 512, 0);
  cp_sim_destroy(sim); /* a fake address must not be freed: ASan would catch it */
}

TEST(reservation_churn) {
  /* 100k reserve/release pairs with a moving live set: the table stays consistent. */
  cp_backend_t be;
  cp_sim_t *sim = make_sim((size_t)1 << 40, CP_SIM_NO_TOUCH, &be);
  REQUIRE(sim != NULL);
  enum { LIVE = 1000, ROUNDS = 100000 };
  static uintptr_t addr[LIVE];
  static size_t size[LIVE];
  for (int i = 0; i < LIVE; i++) {
    size[i] = (size_t)(i + 1) * 512;
    REQUIRE(be.reserve(be.ctx, size[i], &addr[i]) == CP_OK);
  }
  uint64_t x = 88172645463325252ull;
  for (int r = 0; r < ROUNDS; r++) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    const int i = (int)(x % LIVE);
    REQUIRE(be.release(be.ctx, addr[i], size[i]) == CP_OK);
    size[i] = (size_t)(x % 4096 + 1) * 512;
    REQUIRE(be.reserve(be.ctx, size[i], &addr[i]) == CP_OK);
  }
  CHECK_EQ_U(cp_sim_live_reservations(sim), LIVE);
  for (int i = 0; i < LIVE; i++) CHECK(be.release(be.ctx, addr[i], size[i]) == CP_OK);
  CHECK_EQ_U(cp_sim_reserved_bytes(sim), 0);
  cp_sim_destroy(sim);
}

static int query(const cp_backend_t *be, cp_event_t ev) {
  int done = -1;
  if (be->event_query(be->ctx, ev, &done) != CP_OK) return -1;
  return done;
}

TEST(events) {
  cp_backend_t be;
  cp_sim_t *sim = make_sim(MiB, 0, &be);
  REQUIRE(sim != NULL);
  uintptr_t a = 0; /* the memory the launches below work on */
  REQUIRE(be.reserve(be.ctx, 4096, &a) == CP_OK);
  cp_event_t e1 = 0, e2 = 0, e3 = 0;
  REQUIRE(be.event_create(be.ctx, &e1) == CP_OK);
  REQUIRE(be.event_create(be.ctx, &e2) == CP_OK);
  REQUIRE(be.event_create(be.ctx, &e3) == CP_OK);
  CHECK(e1 != 0 && e2 != 0 && e1 != e2 && e2 != e3);
  CHECK_EQ_U(cp_sim_live_events(sim), 3);

  CHECK(query(&be, e1) == 1); /* never recorded: done */

  /* An event is a marker after the stream's last launch: on an idle stream, done at once. */
  const cp_stream_t s0 = 0, s7 = 7;
  CHECK(be.event_record(be.ctx, e1, s0) == CP_OK);
  CHECK(query(&be, e1) == 1);
  CHECK(cp_sim_stream_idle(sim, s0));
  CHECK(cp_sim_launch(sim, s0, a, 4096) == CP_OK);
  CHECK(query(&be, e1) == 1); /* work queued after the record is not waited for */
  CHECK(!cp_sim_stream_idle(sim, s0));
  CHECK(cp_sim_launch(sim, s7, a, 4096) == CP_OK);
  CHECK_EQ_U(cp_sim_queued_launches(sim), 2);
  CHECK(be.event_record(be.ctx, e1, s0) == CP_OK);
  CHECK(be.event_record(be.ctx, e2, s7) == CP_OK);
  CHECK(query(&be, e1) == 0);
  CHECK(query(&be, e2) == 0);

  cp_sim_complete(sim, s7); /* another stream: e1 stays pending */
  CHECK(query(&be, e1) == 0);
  CHECK(query(&be, e2) == 1);
  CHECK(cp_sim_stream_idle(sim, s7));
  CHECK_EQ_U(cp_sim_queued_launches(sim), 1);
  cp_sim_complete(sim, 12345); /* unknown stream: no effect, no crash */
  CHECK(query(&be, e1) == 0);

  cp_sim_complete(sim, s0);
  CHECK(query(&be, e1) == 1);
  CHECK_EQ_U(cp_sim_queued_launches(sim), 0);

  /* Re-record resets to the new position. */
  CHECK(cp_sim_launch(sim, s0, a, 4096) == CP_OK);
  CHECK(be.event_record(be.ctx, e1, s0) == CP_OK);
  CHECK(query(&be, e1) == 0);
  CHECK(cp_sim_launch(sim, s7, a, 4096) == CP_OK);
  CHECK(be.event_record(be.ctx, e1, s7) == CP_OK); /* moved to another stream */
  cp_sim_complete(sim, s0);
  CHECK(query(&be, e1) == 0);
  cp_sim_complete(sim, s7);
  CHECK(query(&be, e1) == 1);

  /* Complete covers everything submitted so far, nothing submitted later. */
  CHECK(cp_sim_launch(sim, s0, a, 4096) == CP_OK);
  CHECK(be.event_record(be.ctx, e1, s0) == CP_OK);
  cp_sim_complete(sim, s0);
  CHECK(cp_sim_launch(sim, s0, a, 4096) == CP_OK);
  CHECK(be.event_record(be.ctx, e2, s0) == CP_OK);
  CHECK(query(&be, e1) == 1);
  CHECK(query(&be, e2) == 0);

  /* complete_all */
  CHECK(cp_sim_launch(sim, 99, a, 4096) == CP_OK);
  CHECK(be.event_record(be.ctx, e3, 99) == CP_OK);
  CHECK(query(&be, e3) == 0);
  cp_sim_complete_all(sim);
  CHECK(query(&be, e2) == 1);
  CHECK(query(&be, e3) == 1);
  CHECK_EQ_U(cp_sim_queued_launches(sim), 0);

  /* synchronize completes up to the event only: the launch after it stays queued */
  CHECK(cp_sim_launch(sim, s7, a, 4096) == CP_OK);
  CHECK(be.event_record(be.ctx, e1, s7) == CP_OK);
  CHECK(cp_sim_launch(sim, s7, a, 4096) == CP_OK);
  CHECK(be.event_record(be.ctx, e2, s7) == CP_OK);
  CHECK(be.event_synchronize(be.ctx, e1) == CP_OK);
  CHECK(query(&be, e1) == 1);
  CHECK(query(&be, e2) == 0);
  CHECK_EQ_U(cp_sim_queued_launches(sim), 1);
  CHECK(be.event_synchronize(be.ctx, e2) == CP_OK);
  CHECK(query(&be, e2) == 1);
  CHECK_EQ_U(cp_sim_queued_launches(sim), 0);
  CHECK(be.event_synchronize(be.ctx, e1) == CP_OK); /* already done: fine */
  CHECK_EQ_U(cp_sim_calls(sim, CP_SIM_EVENT_SYNCHRONIZE), 3);
  CHECK_EQ_U(cp_sim_device_faults(sim), 0);

  /* destroy; a handle used after its destroy is refused and is a device fault, one never
   * handed out is refused only */
  CHECK(be.event_destroy(be.ctx, e3) == CP_OK);
  CHECK(be.event_destroy(be.ctx, e3) == CP_ERR_INVALID);
  CHECK(contains(cp_last_error(), "the event was destroyed"));
  CHECK_EQ_U(cp_sim_device_faults(sim), 1);
  cp_sim_device_fault_t f;
  CHECK(cp_sim_device_fault(sim, 0, &f) == CP_OK);
  CHECK(strcmp(f.call, "event_destroy") == 0 && f.addr == e3 && contains(f.what, "destroyed"));
  CHECK(be.event_destroy(be.ctx, 0) == CP_ERR_INVALID);
  CHECK(contains(cp_last_error(), "unknown event"));
  CHECK(be.event_destroy(be.ctx, e3 + 1000) == CP_ERR_INVALID);
  CHECK(contains(cp_last_error(), "unknown event"));
  CHECK_EQ_U(cp_sim_device_faults(sim), 1);
  int done = 7;
  CHECK(be.event_query(be.ctx, e3, &done) == CP_ERR_INVALID);
  CHECK(done == 7);
  CHECK(be.event_record(be.ctx, e3, s0) == CP_ERR_INVALID);
  CHECK(be.event_synchronize(be.ctx, e3) == CP_ERR_INVALID);
  CHECK_EQ_U(cp_sim_device_faults(sim), 4);
  CHECK(cp_sim_device_fault(sim, 3, &f) == CP_OK);
  CHECK(strcmp(f.call, "event_synchronize") == 0 && f.addr == e3);
  cp_event_t e4 = 0;
  CHECK(be.event_create(be.ctx, &e4) == CP_OK);
  CHECK(e4 != e3); /* handles are not reused */
  CHECK_EQ_U(cp_sim_live_events(sim), 3);

  /* e1, e2, e4 and a still live: destroy frees them */
  cp_sim_destroy(sim);
}

TEST(auto_complete) {
  cp_backend_t be;
  cp_sim_t *sim = make_sim(MiB, CP_SIM_AUTO_COMPLETE, &be);
  REQUIRE(sim != NULL);
  uintptr_t a = 0;
  REQUIRE(be.reserve(be.ctx, 4096, &a) == CP_OK);
  cp_event_t e = 0, f = 0;
  REQUIRE(be.event_create(be.ctx, &e) == CP_OK);
  REQUIRE(be.event_create(be.ctx, &f) == CP_OK);
  CHECK(cp_sim_launch(sim, 3, a, 4096) == CP_OK); /* runs at once */
  CHECK_EQ_U(cp_sim_queued_launches(sim), 0);
  CHECK(be.event_record(be.ctx, e, 3) == CP_OK);
  CHECK(query(&be, e) == 1);

  cp_sim_set_auto_complete(sim, 0);
  CHECK(cp_sim_launch(sim, 3, a, 4096) == CP_OK);
  CHECK(be.event_record(be.ctx, e, 3) == CP_OK);
  CHECK(query(&be, e) == 0);
  cp_sim_set_auto_complete(sim, 1); /* only later submissions are affected */
  CHECK(query(&be, e) == 0);
  CHECK_EQ_U(cp_sim_queued_launches(sim), 1);
  CHECK(be.event_record(be.ctx, f, 4) == CP_OK); /* an idle stream */
  CHECK(query(&be, f) == 1);
  CHECK(be.event_record(be.ctx, f, 3) == CP_OK); /* behind the queued launch: a record runs nothing */
  CHECK(query(&be, f) == 0);
  CHECK(cp_sim_launch(sim, 3, a, 4096) == CP_OK); /* stream 3 runs it, and in order all before it */
  CHECK(query(&be, f) == 1);
  CHECK(query(&be, e) == 1);
  CHECK_EQ_U(cp_sim_queued_launches(sim), 0);
  cp_sim_destroy(sim);
}

/* Make one call of `kind` on a prepared device; returns its status. */
static int call_kind(cp_backend_t *be, cp_sim_call_t kind, uintptr_t addr, size_t size, cp_event_t ev, uintptr_t *out_u,
                     int *out_i) {
  size_t f = 0, t = 0;
  switch (kind) {
    case CP_SIM_RESERVE: return be->reserve(be->ctx, size, out_u);
    case CP_SIM_RELEASE: return be->release(be->ctx, addr, size);
    case CP_SIM_EVENT_CREATE: return be->event_create(be->ctx, out_u);
    case CP_SIM_EVENT_DESTROY: return be->event_destroy(be->ctx, ev);
    case CP_SIM_EVENT_RECORD: return be->event_record(be->ctx, ev, 5);
    case CP_SIM_EVENT_QUERY: return be->event_query(be->ctx, ev, out_i);
    case CP_SIM_EVENT_SYNCHRONIZE: return be->event_synchronize(be->ctx, ev);
    case CP_SIM_MEM_INFO: return be->mem_info(be->ctx, &f, &t);
    default: return -1;
  }
}

/* The kinds of plain segments and events; the page-mapped ones have their sweep in test_vmm.c. */
TEST(fault_injection_every_kind) {
  for (int k = 0; k <= CP_SIM_MEM_INFO; k++) {
    const cp_sim_call_t kind = (cp_sim_call_t)k;
    cp_backend_t be;
    cp_sim_t *sim = make_sim(64 * MiB, 0, &be);
    REQUIRE(sim != NULL);
    /* Fixtures: four reservations of 4096 bytes and four events, each recorded on stream 5
     * behind a launch on its reservation, all completed. For synchronize, e[2] is pending
     * instead (recorded behind one more launch), so that a completion would show. */
    uintptr_t a[4];
    cp_event_t e[4];
    for (int i = 0; i < 4; i++) {
      REQUIRE(be.reserve(be.ctx, 4096, &a[i]) == CP_OK);
      REQUIRE(be.event_create(be.ctx, &e[i]) == CP_OK);
      REQUIRE(cp_sim_launch(sim, 5, a[i], 4096) == CP_OK);
      REQUIRE(be.event_record(be.ctx, e[i], 5) == CP_OK);
    }
    cp_sim_complete(sim, 5);
    if (kind == CP_SIM_EVENT_SYNCHRONIZE) {
      REQUIRE(cp_sim_launch(sim, 5, a[0], 4096) == CP_OK);
      REQUIRE(be.event_record(be.ctx, e[2], 5) == CP_OK);
    }
    const int done_before = query(&be, e[2]);
    CHECK(done_before == (kind == CP_SIM_EVENT_SYNCHRONIZE ? 0 : 1));
    cp_sim_reset_counters(sim);

    const int want = (k % 2) ? CP_ERR_OOM : CP_ERR_BACKEND;
    cp_sim_fail_nth(sim, kind, 3, want);

    /* Calls 1 and 2 succeed; call i works on a[i] / e[i]. */
    for (int i = 0; i < 2; i++) {
      uintptr_t u = 0;
      int d = 0;
      CHECK(call_kind(&be, kind, a[i], 4096, e[i], &u, &d) == CP_OK);
    }
    const size_t bytes = cp_sim_reserved_bytes(sim);
    const size_t nres = cp_sim_live_reservations(sim);
    const size_t nev = cp_sim_live_events(sim);

    /* Call 3 fails and leaves its out-parameters alone. It changes nothing, but for a failed
     * destroy: that still ends the event (the driver may have freed it before failing). */
    const int ends = kind == CP_SIM_EVENT_DESTROY;
    uintptr_t u = 0xabc;
    int d = 42;
    const int rc = call_kind(&be, kind, a[2], 4096, e[2], &u, &d);
    CHECK(rc == want);
    if (rc != want) fprintf(stderr, "  kind %s: rc %d\n", cp_sim_call_name(kind), rc);
    CHECK(u == 0xabc && d == 42);
    CHECK(contains(cp_last_error(), "sim: injected failure in "));
    CHECK(contains(cp_last_error(), cp_sim_call_name(kind)));
    CHECK(contains(cp_last_error(), "(call #3)"));
    CHECK_EQ_U(cp_sim_calls(sim, kind), 3);
    CHECK_EQ_U(cp_sim_faults_injected(sim), 1);
    CHECK_EQ_U(cp_sim_device_faults(sim), 0); /* an injected failure is no device fault */
    CHECK_EQ_U(cp_sim_reserved_bytes(sim), bytes);
    CHECK_EQ_U(cp_sim_live_reservations(sim), nres);
    CHECK_EQ_U(cp_sim_live_events(sim), nev - (size_t)ends);
    if (ends) {
      /* Using the ended handle again, even to destroy it, is a device fault. */
      CHECK(query(&be, e[2]) == -1);
      CHECK(contains(cp_last_error(), "the event was destroyed"));
      CHECK_EQ_U(cp_sim_device_faults(sim), 1);
      CHECK(call_kind(&be, kind, a[2], 4096, e[2], &u, &d) == CP_ERR_INVALID);
      CHECK_EQ_U(cp_sim_device_faults(sim), 2);
      CHECK_EQ_U(cp_sim_live_events(sim), nev - 1);
      cp_sim_clear_device_faults(sim);
    } else {
      CHECK(query(&be, e[2]) == done_before);
      /* The fault fired once: the same call now succeeds. */
      CHECK(call_kind(&be, kind, a[2], 4096, e[2], &u, &d) == CP_OK);
    }
    CHECK_EQ_U(cp_sim_faults_injected(sim), 1);

    /* n = 0 disarms. */
    cp_sim_fail_nth(sim, kind, 1, want);
    cp_sim_fail_nth(sim, kind, 0, want);
    CHECK(call_kind(&be, kind, a[3], 4096, e[3], &u, &d) == CP_OK);
    CHECK_EQ_U(cp_sim_faults_injected(sim), 1);
    CHECK_EQ_U(cp_sim_device_faults(sim), 0);
    cp_sim_destroy(sim);
  }
}

TEST(fault_injection_details) {
  cp_backend_t be;
  cp_sim_t *sim = make_sim(64 * MiB, 0, &be);
  REQUIRE(sim != NULL);

  /* n-th call counts from arming; calls are counted across failures. */
  uintptr_t a[3] = {0, 0, 0};
  cp_sim_fail_nth(sim, CP_SIM_RESERVE, 3, CP_ERR_OOM);
  CHECK(be.reserve(be.ctx, 512, &a[0]) == CP_OK);
  CHECK(be.reserve(be.ctx, 512, &a[1]) == CP_OK);
  CHECK(be.reserve(be.ctx, 512, &a[2]) == CP_ERR_OOM);
  CHECK(contains(cp_last_error(), "sim: injected failure in reserve (call #3)"));
  CHECK_EQ_U(a[2], 0);
  CHECK_EQ_U(cp_sim_live_reservations(sim), 2);
  CHECK_EQ_U(cp_sim_calls(sim, CP_SIM_RESERVE), 3);

  /* Any status other than OOM is reported as CP_ERR_BACKEND. */
  cp_sim_fail_nth(sim, CP_SIM_RELEASE, 1, CP_ERR_INVALID);
  CHECK(be.release(be.ctx, a[0], 512) == CP_ERR_BACKEND);
  CHECK_EQ_U(cp_sim_live_reservations(sim), 2); /* failed release released nothing */
  CHECK(be.release(be.ctx, a[0], 512) == CP_OK);

  /* A failed event_record leaves the event where it was: behind a completed launch, while
   * a record that went through would now wait for the launch queued since. */
  cp_event_t e = 0;
  CHECK(be.event_create(be.ctx, &e) == CP_OK);
  CHECK(cp_sim_launch(sim, 1, a[1], 512) == CP_OK);
  CHECK(be.event_record(be.ctx, e, 1) == CP_OK);
  CHECK(query(&be, e) == 0);
  cp_sim_complete(sim, 1);
  CHECK(query(&be, e) == 1);
  CHECK(cp_sim_launch(sim, 1, a[1], 512) == CP_OK);
  cp_sim_fail_nth(sim, CP_SIM_EVENT_RECORD, 1, CP_ERR_BACKEND);
  CHECK(be.event_record(be.ctx, e, 1) == CP_ERR_BACKEND);
  CHECK(query(&be, e) == 1); /* still the old, completed position */

  /* A failed synchronize completes nothing. */
  CHECK(be.event_record(be.ctx, e, 1) == CP_OK);
  CHECK(query(&be, e) == 0);
  cp_sim_fail_nth(sim, CP_SIM_EVENT_SYNCHRONIZE, 1, CP_ERR_BACKEND);
  CHECK(be.event_synchronize(be.ctx, e) == CP_ERR_BACKEND);
  CHECK(query(&be, e) == 0);
  CHECK_EQ_U(cp_sim_queued_launches(sim), 1);

  /* A lost device fails every call but ends no handle: the event is still there after. */
  cp_sim_set_lost(sim, 1);
  CHECK(be.event_destroy(be.ctx, e) == CP_ERR_BACKEND);
  CHECK(contains(cp_last_error(), "device lost"));
  CHECK(be.event_synchronize(be.ctx, e) == CP_ERR_BACKEND);
  CHECK(cp_sim_launch(sim, 1, a[1], 512) == CP_ERR_BACKEND);
  CHECK_EQ_U(cp_sim_live_events(sim), 1);
  cp_sim_set_lost(sim, 0);
  CHECK(query(&be, e) == 0); /* nothing ran meanwhile */
  CHECK_EQ_U(cp_sim_queued_launches(sim), 1);
  CHECK(be.event_synchronize(be.ctx, e) == CP_OK);
  CHECK(query(&be, e) == 1);
  CHECK(be.event_destroy(be.ctx, e) == CP_OK);
  CHECK_EQ_U(cp_sim_live_events(sim), 0);
  CHECK_EQ_U(cp_sim_device_faults(sim), 0);

  /* reset_counters zeroes counts but keeps armed faults. */
  cp_sim_fail_nth(sim, CP_SIM_MEM_INFO, 2, CP_ERR_BACKEND);
  size_t f = 0, t = 0;
  CHECK(be.mem_info(be.ctx, &f, &t) == CP_OK);
  cp_sim_reset_counters(sim);
  CHECK_EQ_U(cp_sim_calls(sim, CP_SIM_RESERVE), 0);
  CHECK_EQ_U(cp_sim_calls(sim, CP_SIM_MEM_INFO), 0);
  CHECK_EQ_U(cp_sim_faults_injected(sim), 0);
  CHECK(be.mem_info(be.ctx, &f, &t) == CP_ERR_BACKEND);
  CHECK_EQ_U(cp_sim_calls(sim, CP_SIM_MEM_INFO), 1);
  CHECK_EQ_U(cp_sim_faults_injected(sim), 1);

  /* Invalid calls are counted too. */
  CHECK(be.reserve(be.ctx, 0, &a[0]) == CP_ERR_INVALID);
  CHECK_EQ_U(cp_sim_calls(sim, CP_SIM_RESERVE), 1);
  cp_sim_destroy(sim);
}

/* ---- queued work and device faults (sim_work.c) ------------------------------------------- */

TEST(launches_lag_and_drains) {
  cp_backend_t be;
  cp_sim_t *sim = make_sim(MiB, 0, &be);
  REQUIRE(sim != NULL);
  uintptr_t a = 0, b = 0;
  REQUIRE(be.reserve(be.ctx, 4096, &a) == CP_OK);
  REQUIRE(be.reserve(be.ctx, 4096, &b) == CP_OK);
  cp_event_t e[4];
  for (int i = 0; i < 4; i++) REQUIRE(be.event_create(be.ctx, &e[i]) == CP_OK);

  /* A part of a reservation is the device's too; bytes 0 is refused without a fault. */
  CHECK(cp_sim_launch(sim, 1, a + 1024, 1024) == CP_OK);
  CHECK(cp_sim_launch(sim, 1, a, 0) == CP_ERR_INVALID);
  CHECK(cp_sim_launch(NULL, 1, a, 1) == CP_ERR_INVALID);
  CHECK_EQ_U(cp_sim_device_faults(sim), 0);
  CHECK_EQ_U(cp_sim_queued_launches(sim), 1);
  cp_sim_complete(sim, 1);

  /* Lag 2: a stream runs at most two launches behind; the third completes the first. */
  cp_sim_set_lag(sim, 2);
  for (int i = 0; i < 3; i++) {
    CHECK(cp_sim_launch(sim, 1, a, 4096) == CP_OK);
    CHECK(be.event_record(be.ctx, e[i], 1) == CP_OK);
  }
  CHECK(query(&be, e[0]) == 1);
  CHECK(query(&be, e[1]) == 0);
  CHECK(query(&be, e[2]) == 0);
  CHECK_EQ_U(cp_sim_queued_launches(sim), 1);     /* the last launch at `a` stands for the one before */
  CHECK(cp_sim_launch(sim, 2, b, 4096) == CP_OK); /* another stream keeps its own count */
  CHECK(query(&be, e[1]) == 0);
  CHECK(cp_sim_launch(sim, 1, a, 4096) == CP_OK);
  CHECK(query(&be, e[1]) == 1);
  CHECK(query(&be, e[2]) == 0);
  CHECK_EQ_U(cp_sim_queued_launches(sim), 2); /* stream 1's last at `a`, stream 2's at `b` */
  cp_sim_set_lag(sim, UINT64_MAX);

  /* release is cudaFree: it waits for every stream of the device. */
  CHECK(be.event_record(be.ctx, e[3], 2) == CP_OK);
  CHECK(query(&be, e[3]) == 0);
  CHECK(be.release(be.ctx, b, 4096) == CP_OK);
  CHECK_EQ_U(cp_sim_queued_launches(sim), 0);
  CHECK(query(&be, e[2]) == 1);
  CHECK(query(&be, e[3]) == 1);
  CHECK(cp_sim_stream_idle(sim, 1) && cp_sim_stream_idle(sim, 2));
  /* A failed release waits for nothing. */
  CHECK(cp_sim_launch(sim, 1, a, 4096) == CP_OK);
  cp_sim_fail_nth(sim, CP_SIM_RELEASE, 1, CP_ERR_BACKEND);
  CHECK(be.release(be.ctx, a, 4096) == CP_ERR_BACKEND);
  CHECK_EQ_U(cp_sim_queued_launches(sim), 1);
  CHECK_EQ_U(cp_sim_device_faults(sim), 0);
  cp_sim_destroy(sim); /* queued work, a reservation and events still live: destroy frees them */
}

TEST(device_faults_of_launches_and_handoffs) {
  cp_backend_t be;
  cp_sim_t *sim = make_sim(MiB, 0, &be);
  REQUIRE(sim != NULL);
  uintptr_t a = 0, b = 0;
  REQUIRE(be.reserve(be.ctx, 4096, &a) == CP_OK);
  REQUIRE(be.reserve(be.ctx, 8192, &b) == CP_OK);

  /* A launch on memory that is not the device's: refused, and a fault with its details. */
  CHECK(cp_sim_launch(sim, 3, a + 4096 - 8, 16) == CP_ERR_INVALID); /* runs past the reservation */
  CHECK(contains(cp_last_error(), "device fault"));
  CHECK_EQ_U(cp_sim_device_faults(sim), 1);
  cp_sim_device_fault_t f;
  memset(&f, 0, sizeof f);
  CHECK(cp_sim_device_fault(sim, 0, &f) == CP_OK);
  CHECK(strcmp(f.call, "launch") == 0);
  CHECK(f.addr == a + 4096 - 8 && f.size == 16 && f.stream == 3);
  CHECK(contains(f.what, "not the device's"));
  CHECK(cp_sim_device_fault(sim, 1, &f) == CP_ERR_INVALID);
  CHECK(be.release(be.ctx, a, 4096) == CP_OK);
  CHECK(cp_sim_launch(sim, 3, a, 4096) == CP_ERR_INVALID); /* released: no longer the device's */
  CHECK_EQ_U(cp_sim_device_faults(sim), 2);
  CHECK(cp_sim_launch(sim, 3, UINTPTR_MAX - 4, 16) == CP_ERR_INVALID); /* wraps */
  CHECK_EQ_U(cp_sim_device_faults(sim), 3);
  CHECK_EQ_U(cp_sim_queued_launches(sim), 0);
  FILE *out = tmpfile();
  REQUIRE(out != NULL);
  CHECK_EQ_U(cp_sim_print_device_faults(sim, out), 3);
  CHECK(ftell(out) > 0);
  fclose(out);
  cp_sim_clear_device_faults(sim);
  CHECK_EQ_U(cp_sim_device_faults(sim), 0);
  CHECK_EQ_U(cp_sim_print_device_faults(sim, NULL), 0);

  /* Handing memory to another stream while a launch that touches it is queued is a fault;
   * to the launch's own stream it is not (stream order), nor once the launch completed. */
  CHECK(cp_sim_launch(sim, 1, b + 4096, 1024) == CP_OK);
  CHECK_EQ_U(cp_sim_check_handoff(sim, 1, b, 8192), 0);
  CHECK_EQ_U(cp_sim_check_handoff(sim, 2, b, 4096), 0);               /* bytes it does not touch */
  CHECK_EQ_U(cp_sim_check_handoff(sim, 2, b + 4096 + 1024, 1024), 0); /* just past them */
  CHECK_EQ_U(cp_sim_device_faults(sim), 0);
  CHECK_EQ_U(cp_sim_check_handoff(sim, 2, b + 4096 + 1000, 100), 1);
  CHECK_EQ_U(cp_sim_device_faults(sim), 1);
  CHECK(cp_sim_device_fault(sim, 0, &f) == CP_OK);
  CHECK(strcmp(f.call, "handoff") == 0);
  CHECK(f.addr == b + 4096 && f.size == 1024 && f.stream == 1); /* the work's, not the call's */
  CHECK(cp_sim_launch(sim, 1, b + 4096, 1024) == CP_OK);        /* covers the first: still one fault */
  CHECK_EQ_U(cp_sim_check_handoff(sim, 2, b, 8192), 1);
  CHECK(cp_sim_launch(sim, 1, b + 4096, 512) == CP_OK); /* a smaller one there: a launch of its own */
  CHECK_EQ_U(cp_sim_check_handoff(sim, 2, b, 8192), 2);
  CHECK_EQ_U(cp_sim_device_faults(sim), 4);
  cp_sim_complete(sim, 1);
  CHECK_EQ_U(cp_sim_check_handoff(sim, 2, b, 8192), 0);
  CHECK_EQ_U(cp_sim_device_faults(sim), 4);
  cp_sim_clear_device_faults(sim);

  /* The first 64 faults are kept in detail; the count goes on. */
  for (int i = 0; i < 70; i++) cp_sim_note_fault(sim, i == 0 ? NULL : "a harness fault", (uintptr_t)i, 1, 9);
  CHECK_EQ_U(cp_sim_device_faults(sim), 70);
  CHECK(cp_sim_device_fault(sim, 0, &f) == CP_OK);
  CHECK(strcmp(f.call, "harness") == 0 && f.what != NULL && f.stream == 9);
  CHECK(cp_sim_device_fault(sim, 63, &f) == CP_OK);
  CHECK(f.addr == 63 && strcmp(f.what, "a harness fault") == 0);
  CHECK(cp_sim_device_fault(sim, 64, &f) == CP_ERR_INVALID);
  CHECK(cp_sim_device_fault(sim, 0, NULL) == CP_ERR_INVALID);
  out = tmpfile();
  REQUIRE(out != NULL);
  CHECK_EQ_U(cp_sim_print_device_faults(sim, out), 70);
  rewind(out);
  char line[256];
  int lines = 0, more = 0;
  while (fgets(line, sizeof line, out) != NULL) {
    lines++;
    more += contains(line, "... and 6 more");
  }
  fclose(out);
  CHECK_EQ_U(lines, 65);
  CHECK_EQ_U(more, 1);
  cp_sim_clear_device_faults(sim);
  CHECK(cp_sim_device_fault(sim, 0, &f) == CP_ERR_INVALID);
  cp_sim_destroy(sim);
}

TEST(capture_refuses_what_the_driver_refuses) {
  cp_backend_t be;
  cp_sim_t *sim = make_sim(MiB, 0, &be);
  REQUIRE(sim != NULL);
  uintptr_t a = 0, b = 0;
  cp_event_t e = 0;
  REQUIRE(be.reserve(be.ctx, 4096, &a) == CP_OK);
  REQUIRE(be.event_create(be.ctx, &e) == CP_OK);
  CHECK(cp_sim_launch(sim, 1, a, 4096) == CP_OK);
  CHECK(be.event_record(be.ctx, e, 1) == CP_OK);

  CHECK(cp_sim_set_capturing(sim, 3, 1) == CP_OK);
  CHECK(cp_sim_set_capturing(sim, 3, 1) == CP_OK); /* twice: still one capturing stream */
  int capturing = 0;
  CHECK(be.stream_capturing(be.ctx, 3, &capturing) == CP_OK && capturing == 1);
  CHECK(be.stream_capturing(be.ctx, 1, &capturing) == CP_OK && capturing == 0);
  int done = 7;
  /* Refused on any stream of the device, each a device fault and a capture violation. */
  CHECK(be.event_record(be.ctx, e, 1) == CP_ERR_BACKEND);
  CHECK(contains(cp_last_error(), "operation not permitted when stream is capturing"));
  CHECK(be.event_query(be.ctx, e, &done) == CP_ERR_BACKEND);
  CHECK(done == 7);
  CHECK(be.event_synchronize(be.ctx, e) == CP_ERR_BACKEND);
  CHECK(be.release(be.ctx, a, 4096) == CP_ERR_BACKEND);
  CHECK_EQ_U(cp_sim_capture_violations(sim), 4);
  CHECK_EQ_U(cp_sim_device_faults(sim), 4);
  cp_sim_device_fault_t f;
  CHECK(cp_sim_device_fault(sim, 3, &f) == CP_OK);
  CHECK(strcmp(f.call, "release") == 0 && contains(f.what, "captures"));
  /* Nothing ran: the refused synchronize and release waited for nothing. */
  CHECK_EQ_U(cp_sim_queued_launches(sim), 1);
  CHECK_EQ_U(cp_sim_live_reservations(sim), 1);
  /* A reserve goes through (relaxed capture mode), as does a launch. */
  CHECK(be.reserve(be.ctx, 4096, &b) == CP_OK);
  CHECK(cp_sim_launch(sim, 3, b, 4096) == CP_OK);
  CHECK_EQ_U(cp_sim_device_faults(sim), 4);

  CHECK(cp_sim_set_capturing(sim, 3, 0) == CP_OK);
  CHECK(be.stream_capturing(be.ctx, 3, &capturing) == CP_OK && capturing == 0);
  CHECK(be.event_query(be.ctx, e, &done) == CP_OK && done == 0);
  CHECK(be.event_synchronize(be.ctx, e) == CP_OK);
  CHECK(be.release(be.ctx, a, 4096) == CP_OK);
  CHECK(be.release(be.ctx, b, 4096) == CP_OK);
  CHECK_EQ_U(cp_sim_queued_launches(sim), 0);
  CHECK_EQ_U(cp_sim_capture_violations(sim), 4);
  CHECK_EQ_U(cp_sim_device_faults(sim), 4);
  cp_sim_destroy(sim);
}

/* ---- threads ---------------------------------------------------------------------------- */

enum { THREADS = 4, THREAD_ROUNDS = 2000, THREAD_LIVE = 8 };

typedef struct worker_s {
  cp_backend_t be;
  int id;
  int errors;
} worker_t;

static void *worker(void *arg) {
  worker_t *w = arg;
  uintptr_t addr[THREAD_LIVE] = {0};
  size_t size[THREAD_LIVE] = {0};
  cp_event_t ev = 0;
  if (w->be.event_create(w->be.ctx, &ev) != CP_OK) w->errors++;
  for (int r = 0; r < THREAD_ROUNDS; r++) {
    const int i = r % THREAD_LIVE;
    if (addr[i] != 0) {
      if (w->be.release(w->be.ctx, addr[i], size[i]) != CP_OK) w->errors++;
      addr[i] = 0;
    }
    size[i] = (size_t)((r * 7 + w->id) % 64 + 1) * 512;
    if (w->be.reserve(w->be.ctx, size[i], &addr[i]) != CP_OK)
      w->errors++;
    else
      ((unsigned char *)addr[i])[size[i] - 1] = (unsigned char)r; /* real, private bytes */
    /* Work on it, queued until another thread's release (or complete_all) drains the device. */
    if (addr[i] != 0 && cp_sim_launch(w->be.ctx, (cp_stream_t)(w->id + 1), addr[i], size[i]) != CP_OK) w->errors++;
    if (w->be.event_record(w->be.ctx, ev, (cp_stream_t)(w->id + 1)) != CP_OK) w->errors++;
    int done = 0;
    if (w->be.event_query(w->be.ctx, ev, &done) != CP_OK) w->errors++;
  }
  for (int i = 0; i < THREAD_LIVE; i++)
    if (addr[i] != 0 && w->be.release(w->be.ctx, addr[i], size[i]) != CP_OK) w->errors++;
  if (w->be.event_destroy(w->be.ctx, ev) != CP_OK) w->errors++;
  return NULL;
}

TEST(threads) {
  cp_backend_t be;
  cp_sim_t *sim = make_sim(256 * MiB, 0, &be);
  REQUIRE(sim != NULL);
  pthread_t th[THREADS];
  worker_t w[THREADS];
  for (int i = 0; i < THREADS; i++) {
    w[i].be = be;
    w[i].id = i;
    w[i].errors = 0;
    REQUIRE(pthread_create(&th[i], NULL, worker, &w[i]) == 0);
  }
  for (int i = 0; i < THREADS; i++) {
    /* Completing from the test thread meanwhile races with the workers' records. */
    cp_sim_complete_all(sim);
    (void)cp_sim_reserved_bytes(sim);
  }
  for (int i = 0; i < THREADS; i++) {
    pthread_join(th[i], NULL);
    CHECK_EQ_U(w[i].errors, 0);
  }
  CHECK_EQ_U(cp_sim_reserved_bytes(sim), 0);
  CHECK_EQ_U(cp_sim_live_reservations(sim), 0);
  CHECK_EQ_U(cp_sim_live_events(sim), 0);
  CHECK_EQ_U(cp_sim_calls(sim, CP_SIM_RESERVE), THREADS * THREAD_ROUNDS);
  CHECK_EQ_U(cp_sim_calls(sim, CP_SIM_RELEASE), THREADS * THREAD_ROUNDS);
  CHECK_EQ_U(cp_sim_calls(sim, CP_SIM_EVENT_RECORD), THREADS * THREAD_ROUNDS);
  CHECK_EQ_U(cp_sim_queued_launches(sim), 0); /* the last release drained the device */
  CHECK_EQ_U(cp_sim_device_faults(sim), 0);
  cp_sim_destroy(sim);
}

int main(void) {
  RUN(create_and_backend_table);
  RUN(capacity_and_oom);
  RUN(alignment_distinct_and_real_memory);
  RUN(release_validation);
  RUN(no_touch_mode);
  RUN(reservation_churn);
  RUN(events);
  RUN(auto_complete);
  RUN(fault_injection_every_kind);
  RUN(fault_injection_details);
  RUN(launches_lag_and_drains);
  RUN(device_faults_of_launches_and_handoffs);
  RUN(capture_refuses_what_the_driver_refuses);
  RUN(threads);
  return check_summary("test_sim");
}
