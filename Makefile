# The two commands a newcomer needs: `make demo` and `make test`. Each installs what it needs into .venv, exactly
# what a committed lock pins (hashes checked), so what passes today passes next month; `make lock` refreshes
# every lock (requirements/refresh.py says which file serves which environment).
# Supported: CPython 3.11 and 3.12 on Linux x86_64 and aarch64; PYTHON=... picks the interpreter a new .venv is made
# from. The venv installs requirements/dev.txt (PyPI alone; its torch brings CUDA's runtime wheels) or, where
# LOCAL_WHEELS (/opt/wheels) holds torch's CPU build for that interpreter and machine, requirements/dev-cpu.txt
# (the same pins with that build and no CUDA wheels): `requirements/refresh.py dev-lock` decides.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LOCKS := requirements/dev.txt requirements/dev-cpu.txt requirements/bootstrap.txt requirements/build.txt
UV := $(BIN)/python -m uv
# A wheel folder offered beside PyPI; where it holds torch's CPU build, .venv installs dev-cpu.txt. uv reads no pip
# config, so it is named to uv here and exported to the validation venvs' builds (tests/support/locked_venv.py).
# `make test LOCAL_WHEELS=` ignores it: PyPI alone, as on a machine without the folder.
LOCAL_WHEELS ?= /opt/wheels
export LOCAL_WHEELS
UV_FIND_LINKS := $(if $(and $(LOCAL_WHEELS),$(wildcard $(LOCAL_WHEELS))),--find-links $(LOCAL_WHEELS))
export UV_PYTHON_DOWNLOADS := never
DEMO_RUN_ID ?= demo
PYTEST_ARGS ?=
# pytest-xdist workers: two per core, at most 4 (tests/support/workers.py gives 4 workers port ranges of their own):
# the tests spend about half their time waiting on the servers, CLIs and Prefect processes they start, so a second
# worker per core fills that time. PYTEST_WORKERS=0 runs in this process, one test after another.
PYTEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( 2 * n < 4 ? 2 * n : 4 )))
# When make started: `make test` prints the set-up time (venvs) apart from pytest's own test time.
MAKE_START := $(shell date +%s)

SGLANG_VENVS := .venv-sglang/.built
TRAINER_VENVS := .venv-trainers/.built
TRANSFORMERS_GPU_VENV := .venv-transformers-gpu/.ready

.PHONY: setup demo test check-locks lint typecheck clean-demo help sglang-venvs trainer-venvs bench bench-quick lock screenshots

help:
	@echo "make demo   - run the whole flow locally (2 CPU servers, sample prompts) into ./runs/"
	@echo "make test   - run the test suite"
	@echo "make lint   - ruff + mypy"
	@echo "make check-locks - every committed lock installs from PyPI alone on every interpreter and machine it serves"
	@echo "make screenshots - refresh docs/screenshots/*.png from a real server, worker and headless chromium (apt-get install -y chromium)"
	@echo "make lock   - refresh every lock in requirements/ from pyproject.toml and the venv recipes (commit them)"
	@echo "make bench  - datagen's whole flow vs an ideal and a SpecForge-style client on simulated servers (~10 min)"

$(STAMP): $(LOCKS) pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -c 'import sys; sys.exit(sys.version_info[:2] not in ((3, 11), (3, 12)))' || { \
		echo "the dev locks support CPython 3.11 and 3.12: rm -rf $(VENV) and run make with PYTHON=python3.12"; \
		exit 1; }
	$(BIN)/python -m pip install -q --no-deps --require-hashes -r requirements/bootstrap.txt
	lock=$$($(BIN)/python requirements/refresh.py dev-lock) && echo "installing $$lock" && \
		$(UV) pip sync -q --python $(BIN)/python --require-hashes $(UV_FIND_LINKS) $$lock
	$(UV) pip install -q --python $(BIN)/python --no-deps --build-constraints requirements/build.txt -e .
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m flows.cli_entry demo --run-id $(DEMO_RUN_ID)

# Per-version sglang venvs (the wheel + a few small packages, from requirements/sglang-*.txt) for the
# real-parser contract tests; rebuilt when a lock changes.
$(SGLANG_VENVS): tests/support/sglang_venv.py tests/support/locked_venv.py $(wildcard requirements/sglang-*.txt) $(STAMP)
	$(BIN)/python -m tests.support.sglang_venv
	touch $(SGLANG_VENVS)

sglang-venvs: $(SGLANG_VENVS)

# SpecForge's and speculators' data-loading code (from requirements/trainer-*.txt) for the export tests.
$(TRAINER_VENVS): tests/support/trainer_venvs.py tests/support/locked_venv.py $(wildcard requirements/trainer-*.txt) $(STAMP)
	$(BIN)/python -m tests.support.trainer_venvs
	touch $(TRAINER_VENVS)

trainer-venvs: $(TRAINER_VENVS)

# The transformers release the GPU serving set pins (requirements/transformers-gpu.txt), for the chat-template tests.
$(TRANSFORMERS_GPU_VENV): tests/support/transformers_gpu_venv.py tests/support/locked_venv.py requirements/transformers-gpu.txt $(STAMP)
	$(BIN)/python -m tests.support.transformers_gpu_venv
	touch $(TRANSFORMERS_GPU_VENV)

# Machines of this kind set PYTHONDONTWRITEBYTECODE=1, and then nothing keeps compiled modules: each of a run's
# ~250 Python processes (workers, CLIs, servers, flow runs) compiles datagen's modules again, and every worker
# rewrites the asserts of every test module again (~3 of its ~6 CPU-s of collection). The tests keep them.
test: export PYTHONDONTWRITEBYTECODE :=
test: $(STAMP) $(SGLANG_VENVS) $(TRAINER_VENVS) $(TRANSFORMERS_GPU_VENV)
	@echo "set-up (venvs) ready after $$(( $$(date +%s) - $(MAKE_START) )) s; the tests' own time is pytest's last line"
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

# Asks PyPI (one request per locked project, no downloads): CI runs it before the tests.
check-locks: $(STAMP)
	$(BIN)/python requirements/check_pypi.py

lint: $(STAMP)
	$(BIN)/ruff check datagen flows tasks tests benchmarks requirements
	$(BIN)/ruff format --check datagen flows tasks tests benchmarks requirements
	$(BIN)/mypy

# Simulated servers (benchmarks/simulator.py) on this machine; BENCH_ARGS="--quick" for a short run.
BENCH_ARGS ?=
bench: $(STAMP)
	$(BIN)/python benchmarks/bench.py $(BENCH_ARGS)

bench-quick: $(STAMP)
	$(BIN)/python benchmarks/bench.py --quick $(BENCH_ARGS)

# Compile the project's locks, sync .venv to the new dev.txt, then lock the validation venvs against it.
lock:
	test -x $(BIN)/python || { $(PYTHON) -m venv $(VENV) && $(BIN)/python -m pip install -q "uv>=0.13"; }
	$(BIN)/python requirements/refresh.py project
	$(MAKE) setup
	$(BIN)/python requirements/refresh.py validation

screenshots: $(STAMP)
	docs/screenshots/refresh.sh

clean-demo:
	rm -rf runs datasets
