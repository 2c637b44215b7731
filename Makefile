# The two commands a newcomer needs: `make demo` and `make test`. Each installs what it needs into .venv.
# The interpreter .venv is made from: the system's /usr/bin/python3 when it is 3.11 or newer and can make venvs,
# else the first python3 on PATH. Debian builds its interpreter with PGO and LTO and links it statically; pyenv's
# default build (first on PATH on machines of this kind) does neither. On a 2-core box of this kind the suite's
# ~250 Python processes spend most of their CPU importing: imports take ~15% less CPU there, a pure-Python loop
# ~25% less, and the suite ran 352.5 s against 384.9 s in the same hour. PYTHON=... picks another.
PYTHON ?= $(shell for candidate in /usr/bin/python3 python3; do \
	$$candidate -c 'import ensurepip, sys, venv; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
	&& { echo $$candidate; break; }; done)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch 2.13.0 is the CPU build that lies on this kind of machine's disk; any other spec pulls a CUDA build.
TORCH_SPEC ?= torch==2.13.0
DEMO_RUN_ID ?= demo
PYTEST_ARGS ?=
# pytest-xdist workers: two per core, at most 4 (tests/support/workers.py gives 4 workers port ranges of their own).
# The suite's tests spend about half their time waiting on the servers, CLIs and Prefect processes they start,
# so a second worker per core fills that time: on 2 cores, 4 workers ran it in 366 s, 3 in 396-422 s, 2 in
# 452-455 s. PYTEST_WORKERS=0 runs in this process, one test after another.
PYTEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( 2 * n < 4 ? 2 * n : 4 )))
# When make started: `make test` prints the set-up time (venvs) apart from pytest's own test time.
MAKE_START := $(shell date +%s)

SGLANG_VENVS := .venv-sglang/.built
TRAINER_VENVS := .venv-trainers/.built

.PHONY: setup demo test lint typecheck clean-demo help sglang-venvs trainer-venvs bench bench-quick

help:
	@echo "make demo   - run the whole flow locally (2 CPU servers, sample prompts) into ./runs/"
	@echo "make test   - run the test suite"
	@echo "make lint   - ruff + mypy"
	@echo "make bench  - datagen's whole flow vs an ideal and a SpecForge-style client on simulated servers (~10 min)"

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[local,dev]" "$(TORCH_SPEC)"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m flows.cli_entry demo --run-id $(DEMO_RUN_ID)

# Per-version sglang venvs (wheel --no-deps + a few small packages) for the real-parser contract tests;
# built once (~2 min from PyPI), reused while tests/support/sglang_venv.py is unchanged.
$(SGLANG_VENVS): tests/support/sglang_venv.py $(STAMP)
	$(BIN)/python -m tests.support.sglang_venv
	touch $(SGLANG_VENVS)

sglang-venvs: $(SGLANG_VENVS)

# SpecForge's and speculators' data-loading code (wheels --no-deps + light packages) for the export tests;
# built once (~1 min from PyPI), reused while tests/support/trainer_venvs.py is unchanged.
$(TRAINER_VENVS): tests/support/trainer_venvs.py $(STAMP)
	$(BIN)/python -m tests.support.trainer_venvs
	touch $(TRAINER_VENVS)

trainer-venvs: $(TRAINER_VENVS)

# Machines of this kind set PYTHONDONTWRITEBYTECODE=1, and then nothing keeps compiled modules: each of a run's
# ~250 Python processes (workers, CLIs, servers, flow runs) compiles datagen's modules again, and every worker
# rewrites the asserts of every test module again (~3 of its ~6 CPU-s of collection). The tests keep them.
test: export PYTHONDONTWRITEBYTECODE :=
test: $(STAMP) $(SGLANG_VENVS) $(TRAINER_VENVS)
	@echo "set-up (venvs) ready after $$(( $$(date +%s) - $(MAKE_START) )) s; the tests' own time is pytest's last line"
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check datagen flows tasks tests benchmarks
	$(BIN)/ruff format --check datagen flows tasks tests benchmarks
	$(BIN)/mypy

# Simulated servers (benchmarks/simulator.py) on this machine; BENCH_ARGS="--quick" for a short run.
BENCH_ARGS ?=
bench: $(STAMP)
	$(BIN)/python benchmarks/bench.py $(BENCH_ARGS)

bench-quick: $(STAMP)
	$(BIN)/python benchmarks/bench.py --quick $(BENCH_ARGS)

clean-demo:
	rm -rf runs datasets
