# The two commands that matter: `make demo` (the main job) and `make test`.
# Both build the environment on first use (scripts/setup_env.sh).
PROFILE ?= cpu
PY := .venv/bin/python
# This checkout's code first, whatever checkout the shared venv's .pth files point at (CI runs in
# another clone on the same machine, sharing the venv).
STANDIN := $(if $(filter cpu,$(PROFILE)),:$(CURDIR)/pdd_sglang/dev/cpu_standin,)
export PYTHONPATH := $(CURDIR)$(STANDIN)
# The debug patches (patches/debug/) are the test suite's: the cpu profile applies them, the gpu
# (serving) profile does not (scripts/setup_env.sh; PDD_DEBUG_PATCHES=0|1 overrides).
DEBUG_PATCHES := $(if $(filter 1,$(or $(PDD_DEBUG_PATCHES),$(if $(filter cpu,$(PROFILE)),1,0))),--with-debug,)
PYTEST_ARGS ?=
DEMO_ARGS ?=

.PHONY: setup demo test test-fast lock patches-check clean

setup:
	@scripts/setup_env.sh $(PROFILE)

demo: setup
	$(PY) scripts/demo.py $(DEMO_ARGS)

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# Pure-logic tests only: no SGLang servers.
test-fast: setup
	$(PY) -m pytest -m "not integration" $(PYTEST_ARGS)

patches-check: setup
	$(PY) scripts/apply_patches.py --check $(DEBUG_PATCHES)

# Re-resolve requirements/$(PROFILE).lock from requirements/$(PROFILE).in (needs the index).
lock:
	scripts/lock_$(PROFILE).sh

clean:
	rm -rf out .pytest_cache
