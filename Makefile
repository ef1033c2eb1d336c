# Makefile — C builds and the test entry points of cudapool.
# Every output lands under build/. `make test` is the project's test command.

CC ?= gcc
ifeq ($(origin CC),default)
CC := gcc
endif
PYTHON ?= python3

CFLAGS_BASE := -std=c11 -D_POSIX_C_SOURCE=200809L -Wall -Wextra -Werror -Wshadow \
               -Wstrict-prototypes -Wmissing-prototypes -pedantic -pthread -Icsrc
CFLAGS ?=
LDFLAGS ?=
LDLIBS ?=

ASAN_CFLAGS    := -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=all \
                  -fno-omit-frame-pointer -DCP_CHECK_EVERY_OP
TSAN_CFLAGS    := -O1 -g -fsanitize=thread
RELEASE_CFLAGS := -O2
BENCH_CFLAGS   := -O2 -DNDEBUG

ASAN_ENV := ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
            UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
TSAN_ENV := TSAN_OPTIONS=halt_on_error=1
TSAN_ARGS ?= --threads 8

# Sources. The CUDA backend builds everywhere: it loads libcuda with dlopen at run time.
# Layers (docs/design.md, "Repository layout"): base <- core, backend <- devices <- python. The C tests link the
# first four; the CPython binding (csrc/python) is built by setup.py only.
BASE_SRC  := $(sort $(wildcard csrc/base/*.c))
CORE_SRC  := $(sort $(wildcard csrc/core/*.c))
SIM_SRC   := $(sort $(wildcard csrc/backend/sim*.c))
CUDA_SRC  := $(sort $(wildcard csrc/backend/cuda*.c))
DEVICES_SRC := $(sort $(wildcard csrc/devices/*.c))
LIB_SRC   := $(BASE_SRC) $(CORE_SRC) $(SIM_SRC) $(CUDA_SRC) $(DEVICES_SRC)
# Libraries every C build links, whatever LDLIBS says (dlopen for the CUDA backend).
LIB_LDLIBS := -ldl

# Any header change rebuilds everything that could include it.
HEADERS := $(sort $(wildcard csrc/*.h csrc/*/*.h csrc/*/*/*.h tests/c/*.h benchmarks/*.h))

TEST_SRC   := $(sort $(wildcard tests/c/test_*.c))
TEST_NAMES := $(patsubst tests/c/%.c,%,$(TEST_SRC))

ASAN_TESTS    := $(addprefix build/asan/,$(TEST_NAMES))
RELEASE_TESTS := $(addprefix build/release/,$(TEST_NAMES))

# Object files per flavour: build/<flavour>/obj/<path>.o
lib_objs = $(patsubst %.c,build/$(1)/obj/%.o,$(LIB_SRC))

.PHONY: all test test-c-lane test-c test-tsan test-release test-py test-properties deps-py lab bench-micro clean fuzz-corpus fuzz-smoke fuzz-explore soak \
        lint lint-layers lint-docs lint-format lint-types format

all: $(ASAN_TESTS)

# Two lanes, one per core: the C lane (ASan+UBSan, TSan, release, then the soak), each step after
# the previous one passed, with its output kept in build/test-c-lane.log and shown when the lanes
# end; beside it the Python tests. TEST_LANES=1 runs the C lane, then the Python tests, in one.
TEST_LANES ?= 2
ifeq ($(TEST_LANES),1)
test:
	$(MAKE) test-c-lane
	$(MAKE) test-py
else
test:
	@mkdir -p build
	@echo "make test: the C lane (build/test-c-lane.log, shown at the end) beside the Python tests"
	@$(MAKE) --no-print-directory test-c-lane >build/test-c-lane.log 2>&1 & lane=$$!; \
	start=$$(date +%s); \
	$(MAKE) --no-print-directory test-py; py=$$?; \
	echo "make test: the Python tests ended after $$(( $$(date +%s) - start )) s (exit $$py); waiting for the C lane"; \
	wait $$lane; c=$$?; \
	echo "==== the C lane (build/test-c-lane.log), ended after $$(( $$(date +%s) - start )) s (exit $$c)"; \
	cat build/test-c-lane.log; \
	[ $$c -eq 0 ] || echo "make test: the C lane FAILED (build/test-c-lane.log)" >&2; \
	[ $$py -eq 0 ] || echo "make test: the Python tests FAILED" >&2; \
	[ $$c -eq 0 ] && [ $$py -eq 0 ]
endif

# The C tests, then the soak, one after another.
test-c-lane:
	$(MAKE) test-c
	$(MAKE) test-tsan
	$(MAKE) test-release
	$(MAKE) soak

# ---- AddressSanitizer + UndefinedBehaviorSanitizer, invariant check after every op -------
build/asan/obj/%.o: %.c $(HEADERS) Makefile
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_BASE) $(ASAN_CFLAGS) $(CFLAGS) -c $< -o $@

$(ASAN_TESTS): build/asan/%: build/asan/obj/tests/c/%.o $(call lib_objs,asan)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_BASE) $(ASAN_CFLAGS) $(CFLAGS) $(LDFLAGS) $^ -o $@ $(LDLIBS) $(LIB_LDLIBS)

ifeq ($(T),)
test-c: $(ASAN_TESTS)
	@test -n "$(TEST_NAMES)" || { echo "test-c: no tests/c/test_*.c found" >&2; exit 1; }
	@for t in $(ASAN_TESTS); do \
	  echo "== $$t"; \
	  $(ASAN_ENV) ./$$t || { echo "test-c: $$t FAILED" >&2; exit 1; }; \
	done
	@$(MAKE) --no-print-directory test-c-standin
	@$(MAKE) --no-print-directory fuzz-corpus
else
# make test-c T=NAME: build/asan/NAME alone, against the stand-in when test-c-standin runs it
# (docs/testing.md, "Running one test").
test-c:
	@test -f tests/c/$(T).c || { echo "test-c: no tests/c/$(T).c (T names a test: T=test_pool)" >&2; exit 1; }
	@$(MAKE) --no-print-directory build/asan/$(T) $(if $(filter $(T),$(STANDIN_TESTS)),build/asan/libcudapool-standin.so)
	@echo "== build/asan/$(T)"
	@$(ASAN_ENV) $(if $(filter $(T),$(STANDIN_TESTS)),$(call standin_driver,asan)) ./build/asan/$(T)
endif

# ---- ThreadSanitizer: the threaded stress test ----------------------------------------------
build/tsan/obj/%.o: %.c $(HEADERS) Makefile
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_BASE) $(TSAN_CFLAGS) $(CFLAGS) -c $< -o $@

# The threaded tests: the stress test, fork() while other threads are inside the pool, the
# device table with the entry points torch calls, and regions paused and resumed by threads.
TSAN_TESTS := build/tsan/test_stress build/tsan/test_fork build/tsan/test_devices build/tsan/test_pause build/tsan/test_plan

$(TSAN_TESTS): build/tsan/%: build/tsan/obj/tests/c/%.o $(call lib_objs,tsan)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_BASE) $(TSAN_CFLAGS) $(CFLAGS) $(LDFLAGS) $^ -o $@ $(LDLIBS) $(LIB_LDLIBS)

tests/c/test_stress.c benchmarks/bench_micro.c:
	@echo "$@ is missing" >&2; exit 1

test-tsan: $(TSAN_TESTS)
	@echo "== build/tsan/test_stress $(TSAN_ARGS)"
	$(TSAN_ENV) ./build/tsan/test_stress $(TSAN_ARGS)
	@echo "== build/tsan/test_fork"
	@# A forked child inherits ThreadSanitizer's records of the parent's other threads, which do
	@# not exist in it; without this it reports them as leaked when the child exits.
	$(TSAN_ENV):report_thread_leaks=0 ./build/tsan/test_fork
	@echo "== build/tsan/test_devices"
	$(TSAN_ENV) ./build/tsan/test_devices
	@echo "== build/tsan/test_pause"
	$(TSAN_ENV) ./build/tsan/test_pause
	@echo "== build/tsan/test_plan"
	$(TSAN_ENV) ./build/tsan/test_plan
	@$(MAKE) --no-print-directory test-tsan-standin

# ---- The CUDA backend against a stand-in for libcuda ------------------------------------------
# build/<flavour>/libcudapool-standin.so (csrc/standin/, Note [The stand-in] in standin/standin.h):
# a driver backed by host memory, built from the driver API reference, that the CUDA backend
# loads when CUDAPOOL_CUDA_DRIVER names it. test-c-standin runs the backend's tests against it
# under ASan+UBSan (and test_cuda_nodriver once more, with a library that does not exist);
# test-tsan-standin runs them under TSan. Part of test-c and test-tsan.
STANDIN_SRC := $(sort $(wildcard csrc/standin/*.c))
STANDIN_TESTS := test_cuda_nodriver $(patsubst tests/c/%.c,%,$(sort $(wildcard tests/c/test_cuda_standin*.c)))
STANDIN_CFLAGS_asan := $(ASAN_CFLAGS)
STANDIN_CFLAGS_tsan := $(TSAN_CFLAGS)
STANDIN_CFLAGS_release := $(RELEASE_CFLAGS)
STANDIN_TSAN_TESTS := $(addprefix build/tsan/,$(STANDIN_TESTS))
standin_driver = CUDAPOOL_CUDA_DRIVER=$(abspath build/$(1)/libcudapool-standin.so)
.PHONY: test-c-standin test-tsan-standin

build/%/libcudapool-standin.so: $(STANDIN_SRC) $(HEADERS) Makefile
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_BASE) $(STANDIN_CFLAGS_$*) $(CFLAGS) -fPIC -fvisibility=hidden -shared $(LDFLAGS) $(STANDIN_SRC) -o $@

$(STANDIN_TSAN_TESTS): build/tsan/%: build/tsan/obj/tests/c/%.o $(call lib_objs,tsan)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_BASE) $(TSAN_CFLAGS) $(CFLAGS) $(LDFLAGS) $^ -o $@ $(LDLIBS) $(LIB_LDLIBS)

test-c-standin: build/asan/libcudapool-standin.so $(addprefix build/asan/,$(STANDIN_TESTS))
	@for t in $(STANDIN_TESTS); do \
	  echo "== build/asan/$$t against build/asan/libcudapool-standin.so"; \
	  $(ASAN_ENV) $(call standin_driver,asan) ./build/asan/$$t || { echo "test-c-standin: $$t FAILED" >&2; exit 1; }; \
	done
	@echo "== build/asan/test_cuda_nodriver with CUDAPOOL_CUDA_DRIVER naming no library"
	@$(ASAN_ENV) CUDAPOOL_CUDA_DRIVER=$(abspath build)/no-such-libcuda.so ./build/asan/test_cuda_nodriver || \
	  { echo "test-c-standin: test_cuda_nodriver (no library) FAILED" >&2; exit 1; }

test-tsan-standin: build/tsan/libcudapool-standin.so $(STANDIN_TSAN_TESTS)
	@for t in $(STANDIN_TESTS); do \
	  echo "== build/tsan/$$t against build/tsan/libcudapool-standin.so"; \
	  $(TSAN_ENV) $(call standin_driver,tsan) ./build/tsan/$$t || { echo "test-tsan-standin: $$t FAILED" >&2; exit 1; }; \
	done

# ---- Release: optimised, no sanitizer, no per-op check --------------------------------------
build/release/obj/%.o: %.c $(HEADERS) Makefile
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_BASE) $(RELEASE_CFLAGS) $(CFLAGS) -c $< -o $@

$(RELEASE_TESTS): build/release/%: build/release/obj/tests/c/%.o $(call lib_objs,release)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_BASE) $(RELEASE_CFLAGS) $(CFLAGS) $(LDFLAGS) $^ -o $@ $(LDLIBS) $(LIB_LDLIBS)

test-release: $(RELEASE_TESTS)
	@test -n "$(TEST_NAMES)" || { echo "test-release: no tests/c/test_*.c found" >&2; exit 1; }
	@for t in $(RELEASE_TESTS); do \
	  echo "== $$t"; \
	  ./$$t || { echo "test-release: $$t FAILED" >&2; exit 1; }; \
	done

# ---- Micro-benchmark -------------------------------------------------------------------------
build/bench/obj/%.o: %.c $(HEADERS) Makefile
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_BASE) $(BENCH_CFLAGS) $(CFLAGS) -c $< -o $@

build/bench_micro: build/bench/obj/benchmarks/bench_micro.o $(call lib_objs,bench)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_BASE) $(BENCH_CFLAGS) $(CFLAGS) $(LDFLAGS) $^ -o $@ $(LDLIBS) $(LIB_LDLIBS)

# The bridge's allocation and free (benchmarks/bench_bridge.cpp): C++ against torch's c10 headers
# and libc10, so only where torch is installed (run_bench_micro.py skips the row otherwise).
CXX_BENCH ?= g++
build/bench_bridge: benchmarks/bench_bridge.cpp $(call lib_objs,bench) $(HEADERS) Makefile
	@mkdir -p $(@D)
	@torch_dir=$$($(PYTHON) -c 'import os, torch; print(os.path.dirname(torch.__file__))') || \
	  { echo "build/bench_bridge needs torch (its c10 headers and libc10)" >&2; exit 1; }; \
	echo "$(CXX_BENCH) -std=c++20 $(BENCH_CFLAGS) ... -isystem $$torch_dir/include -lc10 -o $@"; \
	$(CXX_BENCH) -std=c++20 -Wall -Wextra -Werror $(BENCH_CFLAGS) -pthread -Icsrc -isystem $$torch_dir/include \
	  benchmarks/bench_bridge.cpp $(call lib_objs,bench) -L$$torch_dir/lib -lc10 -Wl,-rpath,$$torch_dir/lib \
	  -o $@ $(LIB_LDLIBS)

bench-micro:
	$(MAKE) build/bench_micro && $(PYTHON) benchmarks/run_bench_micro.py

# ---- Fuzzing ----------------------------------------------------------------------------------
# tests/fuzz/fuzz_<name>.c are libFuzzer harnesses (pool: operations on a simulated device
# against a shadow model; config: the configuration parser), with a committed corpus each in
# tests/fuzz/corpus/<name>/.
#   fuzz-corpus: the harnesses linked with replay_main.c (no libFuzzer, any compiler) under
#                ASan+UBSan with the per-op invariant check; every committed input runs once.
#                Part of test-c.
#   fuzz-smoke:  the harnesses built with FUZZ_CC -fsanitize=fuzzer (objects in build/fuzz/):
#                the committed corpus replayed, then FUZZ_RUNS_<name> executions per harness
#                from seed 1, address-space randomisation off, from a copy of it under
#                build/fuzz/<name>/: as much work on a slow machine as on a fast one; fails on any crash, leak or
#                timeout. Part of .ci/run.
#   fuzz-explore: the same, FUZZ_SECONDS per harness, unseeded: a search for new inputs.
FUZZ_CC ?= clang
FUZZ_SECONDS ?= 30
# About 30 s each on the 2-core machine (pool 165 executions/s, config 20 000/s).
FUZZ_RUNS_pool ?= 5000
FUZZ_RUNS_config ?= 600000
FUZZ_NAMES := pool config
FUZZ_LIB_SRC := $(BASE_SRC) $(CORE_SRC) $(SIM_SRC)
FUZZ_CFLAGS := -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
FUZZ_REPLAYS := $(patsubst %,build/asan/fuzz_%_replay,$(FUZZ_NAMES))
FUZZERS := $(patsubst %,build/fuzz/fuzz_%,$(FUZZ_NAMES))

$(FUZZ_REPLAYS): build/asan/fuzz_%_replay: build/asan/obj/tests/fuzz/fuzz_%.o build/asan/obj/tests/fuzz/replay_main.o \
                 $(patsubst %.c,build/asan/obj/%.o,$(FUZZ_LIB_SRC))
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_BASE) $(ASAN_CFLAGS) $(CFLAGS) $(LDFLAGS) $^ -o $@ $(LDLIBS) $(LIB_LDLIBS)

fuzz-corpus: $(FUZZ_REPLAYS)
	@for n in $(FUZZ_NAMES); do \
	  echo "== build/asan/fuzz_$${n}_replay tests/fuzz/corpus/$$n"; \
	  $(ASAN_ENV) ./build/asan/fuzz_$${n}_replay tests/fuzz/corpus/$$n || { echo "fuzz-corpus: $$n FAILED" >&2; exit 1; }; \
	done

# CFLAGS is left out on purpose: it is meant for CC, which need not be clang.
build/fuzz/obj/%.o: %.c $(HEADERS) Makefile
	@mkdir -p $(@D)
	$(FUZZ_CC) $(CFLAGS_BASE) $(FUZZ_CFLAGS) -fsanitize=fuzzer-no-link -c $< -o $@

$(FUZZERS): build/fuzz/fuzz_%: build/fuzz/obj/tests/fuzz/fuzz_%.o $(patsubst %.c,build/fuzz/obj/%.o,$(FUZZ_LIB_SRC))
	@mkdir -p $(@D)
	$(FUZZ_CC) $(CFLAGS_BASE) $(FUZZ_CFLAGS) -fsanitize=fuzzer $^ -o $@ $(LIB_LDLIBS)

# ---- The soak: fuzz_pool's checks over generated inputs (tests/fuzz/soak_main.c) ---------------
# SOAK_OPS operations at -O2 without sanitizers over the three policies, then SOAK_ASAN_OPS of
# the same inputs' kind under ASan+UBSan; one seed for both (printed; SOAK_SEED=S for others).
SOAK_OPS ?= 10000000
SOAK_ASAN_OPS ?= 1000000
SOAK_SEED ?= 1
SOAK_SRC := tests/fuzz/fuzz_pool.c tests/fuzz/soak_main.c $(FUZZ_LIB_SRC)

build/release/soak_pool: $(patsubst %.c,build/release/obj/%.o,$(SOAK_SRC))
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_BASE) $(RELEASE_CFLAGS) $(CFLAGS) $(LDFLAGS) $^ -o $@ $(LDLIBS) $(LIB_LDLIBS)

build/asan/soak_pool: $(patsubst %.c,build/asan/obj/%.o,$(SOAK_SRC))
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_BASE) $(ASAN_CFLAGS) $(CFLAGS) $(LDFLAGS) $^ -o $@ $(LDLIBS) $(LIB_LDLIBS)

soak: build/release/soak_pool build/asan/soak_pool
	./build/release/soak_pool --ops $(SOAK_OPS) --seed $(SOAK_SEED)
	$(ASAN_ENV) ./build/asan/soak_pool --ops $(SOAK_ASAN_OPS) --seed $(SOAK_SEED)

fuzz-smoke: $(FUZZERS)
	@sh tests/fuzz/smoke.sh build/fuzz/fuzz_pool tests/fuzz/corpus/pool build/fuzz/pool runs:$(FUZZ_RUNS_pool) \
	  $(wildcard tests/fuzz/pool.dict) && \
	sh tests/fuzz/smoke.sh build/fuzz/fuzz_config tests/fuzz/corpus/config build/fuzz/config runs:$(FUZZ_RUNS_config) \
	  $(wildcard tests/fuzz/config.dict)

fuzz-explore: $(FUZZERS)
	@for n in $(FUZZ_NAMES); do \
	  dict=; if [ -f tests/fuzz/$$n.dict ]; then dict=tests/fuzz/$$n.dict; fi; \
	  sh tests/fuzz/smoke.sh build/fuzz/fuzz_$$n tests/fuzz/corpus/$$n build/fuzz/$$n seconds:$(FUZZ_SECONDS) $$dict || exit 1; \
	done

# ---- Python package ---------------------------------------------------------------------------
# The torch tests need a CUDA build of torch (it imports and swaps allocators without a GPU).
# TORCH_SPEC is installed when no torch with CUDA support is importable; TORCH_SPEC= skips it.
TORCH_SPEC ?= torch==2.14.1
# CUDAPOOL_WERROR=1: warnings are errors in our own builds (never in users' pip installs).
PIP := PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1 CUDAPOOL_WERROR=1 $(PYTHON) -m pip

# Python dependencies of the torch tests and the lab (a CUDA build of torch when none is there).
# CUDAPOOL_DEPS_DONE=1: the caller installed them already in this run (.ci/run): nothing to do.
ifneq ($(CUDAPOOL_DEPS_DONE),)
deps-py:
	@echo "deps-py: installed already in this run (CUDAPOOL_DEPS_DONE=$(CUDAPOOL_DEPS_DONE))"
else
deps-py:
	@if [ -n "$(TORCH_SPEC)" ] && ! $(PYTHON) -c 'import torch, sys; sys.exit(not hasattr(torch._C, "_cuda_customAllocator"))' 2>/dev/null; then \
	  echo "installing $(TORCH_SPEC) (a CUDA build, for the torch integration tests and the workloads)"; \
	  $(PIP) install -q '$(TORCH_SPEC)'; \
	fi
	@# With torch importable, build without isolation so that cudapool._torch_oom (out of memory
	@# as torch.OutOfMemoryError) is built against it; an isolated build cannot see torch.
	@if $(PYTHON) -c 'import torch, setuptools, wheel' >/dev/null 2>&1; then \
	  echo "$(PIP) install -q --no-build-isolation -e '.[test,bench,lint]'"; \
	  $(PIP) install -q --no-build-isolation -e '.[test,bench,lint]'; \
	else \
	  echo "$(PIP) install -q -e '.[test,bench,lint]'"; \
	  $(PIP) install -q -e '.[test,bench,lint]'; \
	fi
endif

# The lab report: capture every workload, replay it under builtin and cudapool, print the
# table, write build/replay-all.json and build/replay-gpt.png. LAB_SCALE=medium for bigger runs.
LAB_SCALE ?= small
lab: deps-py
	$(PYTHON) benchmarks/replay_all.py --scale $(LAB_SCALE)

test-py: deps-py
	$(PYTHON) -m pytest -q -rs tests

# The property tests drawn afresh, unseeded, with CUDAPOOL_HYPOTHESIS_SCALE (default 10) times
# their examples (tests/hyp.py): a search for new failures, not part of `make test`, whose draws
# are seeded so that a run repeats exactly.
PROPERTY_TESTS := tests/test_bad_input_properties.py tests/test_sim_state_machine.py \
                  tests/test_torch_bridge.py::test_generated_bad_calls_leave_the_bridge_whole
test-properties: deps-py
	CUDAPOOL_HYPOTHESIS=long $(PYTHON) -m pytest -q -rs $(PROPERTY_TESTS)

# ---- Lint ----------------------------------------------------------------------------------
# lint-layers: no #include, core call or import against the layers (scripts/check_layers.py);
# lint-docs:   every link and every `make`/`python -m cudapool` command of README.md and docs/
#              exists (scripts/check_docs.py), and docs/configuration.md's table of keys is the
#              one CP_CONFIG_KEYS gives;
# lint-format: clang-format (.clang-format) on every C/C++ file, ruff format and ruff check on
#              the Python; `make format` rewrites both in place;
# lint-types:  mypy on the package, and stubtest: the stubs of the extension modules (_C.pyi,
#              _testhooks.pyi, _torch_fakecuda.pyi) against the built modules.
# The tools come with `pip install -e '.[lint]'` (ruff, mypy) and Debian's clang-format.
CLANG_FORMAT ?= clang-format
C_FORMAT_FILES = $(sort $(wildcard csrc/*/*.c csrc/*/*.h csrc/*/*.cpp csrc/*/*/*.c csrc/*/*/*.h \
                   tests/c/*.c tests/c/*.h tests/fuzz/*.c benchmarks/*.c benchmarks/*.cpp))
PY_LINT_DIRS := python tests benchmarks scripts setup.py

lint: lint-layers lint-docs lint-format lint-types

lint-layers:
	$(PYTHON) scripts/check_layers.py

lint-docs:
	$(PYTHON) scripts/check_docs.py
	$(PYTHON) scripts/config_doc.py --check

lint-format: deps-py
	$(CLANG_FORMAT) --dry-run --Werror $(C_FORMAT_FILES)
	$(PYTHON) -m ruff format --check $(PY_LINT_DIRS)
	$(PYTHON) -m ruff check $(PY_LINT_DIRS)

# cudapool._torch_fakecuda is built only against a CUDA build of torch: checked where it was built.
STUBTEST_MODULES ?= cudapool._C cudapool._testhooks \
  $(shell $(PYTHON) -c 'import cudapool._torch_fakecuda' >/dev/null 2>&1 && echo cudapool._torch_fakecuda)

lint-types: deps-py
	$(PYTHON) -m mypy
	$(PYTHON) -m mypy.stubtest --allowlist tests/stubtest-allowlist.txt $(STUBTEST_MODULES)

format:
	$(CLANG_FORMAT) -i $(C_FORMAT_FILES)
	$(PYTHON) -m ruff format $(PY_LINT_DIRS)

clean:
	rm -rf build python/cudapool/*.so python/cudapool/__pycache__ python/*.egg-info .pytest_cache .hypothesis

# Keep intermediate objects (pattern-rule chains would otherwise delete them).
.SECONDARY:
