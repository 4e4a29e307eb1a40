# k3-sppp: Kimi K3 sequence parallelism across pipeline stages, on vLLM.
#
#   make apply          pinned vLLM into .venv (if absent), verify, apply
#   make test           unit, distributed (CPU, gloo), `vllm serve` (CPU
#                       ranks), evaluation and tooling tests: the `vllm
#                       serve` ones first, the rest in [TEST_JOBS=2]
#                       pytest-xdist workers [PYTEST_ARGS=] [TEST_PATHS=]
#   make test-serving   only the tests that run the series inside real
#                       `vllm serve` servers on CPU ranks
#   make revert         byte-identical original vLLM again (FORCE=1: also
#                       files edited since apply, each kept as
#                       *.k3-sppp-drift[.N], never overwritten)
#   make status         what is applied where, and any drift
#   make check          dry run: which patch and hunk would fail
#   make pr-diff        build/pr/: one diff and description per upstream
#                       pull request (patches/pull-requests.ini), in order
#                       (BASE=0.33.0: build/pr-0.33.0/, that base's series)
#   make rebase         the series three-way onto another vLLM tree, written
#                       as a patch set for it: VLLM=TREE [OUT=build/rebased]
#                       [ONTO_VERSION=] (where TREE does not say its version);
#                       a hunk that does not carry over is named, not written
#   make lint           ruff, and every series (each base's, on its own venv:
#                       builds the venvs it lacks): consistency, every prefix
#                       applies, the pull requests' order
#   make manifest       regenerate patches/base.sha256 (the wheel's RECORD) and
#                       patches/patched.sha256 (what the series writes);
#                       BASE=0.33.0: those of bases/0.33.0/patches
#   make nccl-bench     time the SP hand-off (the series' and 0.34.0's gather,
#                       send, re-shard) and the packed end gather over
#                       NCCL: NPROC=4 NCCL_ARGS="--part handoff --tp 2"
#                       (gloo on CPU: a small grid, a few minutes)
#   make comm-report    what one step communicates, per rank and phase, on
#                       real CPU ranks (COMM_ARGS="--tp 2 --pp 2 --tokens 17";
#                       the ranks' start-up output: build/comm-report.log);
#                       beside it 0.34.0's replicated hand-off, per rank and
#                       per N (measured, then derived to N=32768)
#   make buffer-report  bytes each rank keeps in its PP hand-off buffers
#                       (receive buffers, capture outputs), full capacity
#                       against shard-sized, on real CPU ranks
#                       (BUFFER_ARGS="--tp 8 --pp 2"), then derived at Kimi
#                       K3's production shape
#   make serve          print one arm's serve command for one node; RUN=1
#                       checks the node and starts it: ARM=mega-sp|fi-ep|
#                       fi-noep|mega-sp-seed NODE_RANK= CHECKPOINT= (or
#                       MODEL=, as the seed) MASTER_ADDR= HOST_IP=
#                       [DEEPGEMM=, every arm; else vLLM's bundled copy]
#                       [SERVE_PYTHON=, default .venv's]
#   make evaluate       against a running arm, GSM8K then bench sweeps, one
#                       manifest, resumable: ARM= BASE_URL= CHECKPOINT=
#                       [SWEEP=prefill,decode|all|none] [LIMIT=] [REPEAT=N]
#                       [POINTS=] [SERVED_MODEL=Kimi-K3] [GSM8K_DATA=dir]
#                       [SEED=N: lm-eval's and the bench client's]
#   make gsm8k          GSM8K with lm-eval against a running arm: ARM=
#                       BASE_URL= [SERVED_MODEL=Kimi-K3] [LIMIT=]
#                       [SEED=0,1234,1234,1234] [GSM8K_DATA=dir] [FORCE=1]
#   make gsm8k-compare  table and paired verdict per arm [BASELINE=fi-ep]
#   make bench          a throughput sweep against a running arm: ARM=
#                       BASE_URL= CHECKPOINT= [TOKENIZER=, default CHECKPOINT]
#                       [SWEEP=prefill|decode|mixed|all] [POINTS=128x1,8192x4]
#                       [REPEAT=N: every point N times, N x the time]
#                       [SERVED_MODEL=Kimi-K3] [SEED=2026]
#                       [ALLOW_PREFIX_CACHING=1]
#   make bench-report   per sweep: tables (means over runs), verdicts, JSON
#                       summary and plots from results/bench
#   make gpu-bundle     build/gpu-bundle/: patched vLLM sources, wheels, test
#                       bed and GPU checks for the lent GPU (run.py CHECK)
#   make mutate         mutation testing of the lines the series installs
#                       (resumable; MUTATE_ARGS="--limit N", "--files F ..."
#                       or "--jobs N" on more cores; hours on 2 cores)
#   make setup          only the pinned .venv (BASE=0.33.0: .venv-0.33.0)
#   make pristine       each other base's vLLM as its wheel's Python sources
#                       (.cache/pristine-vllm-VERSION, checked; make test
#                       needs them, where that base has no venv)
#
# MODEL= is the checkpoint directory, as the seed exports it (CHECKPOINT= is
# the same, and wins): the Python tools' --checkpoint. Their --model is the
# served model name, as `vllm bench serve`'s --model and lm-eval's model=:
# make's SERVED_MODEL=. TOKENIZER=, BASE_URL=, SEED= and LIMIT= are their
# --tokenizer, --base-url, --seed and --limit, in those tools' meanings
# (.venv/bin/python -m eval.bench run --help, eval.gsm8k run --help).
# BASE=0.33.0 works on vLLM 0.33.0 instead of the default (setup.cfg's vllm,
# 0.34.0): setup, apply, test, revert, status, check, pr-diff, manifest,
# rebase, serve and the evaluation targets use .venv-0.33.0 (built by the
# first of them that needs it), and apply.py picks the series kept for that
# vLLM (bases/0.33.0/patches) by the venv's version. BASE is one of
# setup.cfg's vllm_bases.
# VLLM=/path points apply, revert, status, check and pr-diff at your own vLLM
# (site-packages, venv, checkout root or the vllm/ package) instead of .venv,
# and tells evaluate, gsm8k and bench whose patch state to record; for rebase
# it is the tree the series moves onto. Its vLLM version picks the series.
# Needs: python3 (3.9+) for apply.py; PYTHON=python3.11 (3.11+, as vLLM)
# on PATH to build .venv, or PYTHON=/path/to/python3.11.

SHELL := /bin/bash
.DEFAULT_GOAL := help

pin = $(shell sed -n 's/^$(1) *= *//p' setup.cfg)
PYTHON ?= $(call pin,python)
# The vLLM release: the default (setup.cfg's vllm) lives in .venv, any other
# of setup.cfg's vllm_bases in .venv-BASE. apply.py picks the series by the
# target's vLLM version: patches/ for the default, bases/BASE/patches/ else.
DEFAULT_BASE := $(call pin,vllm)
BASES := $(call pin,vllm_bases)
BASE ?= $(DEFAULT_BASE)
ifeq ($(filter $(BASE),$(BASES)),)
$(error BASE=$(BASE): the series is kept for vLLM $(BASES) (setup.cfg vllm_bases))
endif
VENV := $(if $(filter $(BASE),$(DEFAULT_BASE)),.venv,.venv-$(BASE))
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.k3-sppp-setup
# The venv of BASE as apply.py's target (none: .venv is its default).
BASE_TARGET := $(if $(filter $(BASE),$(DEFAULT_BASE)),,--target=$(VENV))
# The path reaches apply.py through the environment (make exports VLLM),
# never through the recipe's text: the shell sees no quote, backtick or $ of it.
TARGET := $(if $(VLLM),--target="$$VLLM",$(BASE_TARGET))
APPLY := python3 apply.py
PYTEST_ARGS ?=
TEST_PATHS ?=

.PHONY: help setup apply revert status check test pristine lint manifest pr-diff \
	rebase comm-report buffer-report nccl-bench serve evaluate gsm8k gsm8k-compare bench \
	bench-report gpu-bundle mutate test-serving

help:
	@sed -n '3,/^$$/s/^# \{0,1\}//p' $(MAKEFILE_LIST)

setup: $(STAMP)

# vLLM 0.33.0 needs Python 3.11 or newer, and .venv about 11 GiB (measured:
# `du -sh .venv`): say so, and how to get either, before a venv is attempted,
# not as pip's OSError halfway through.
SETUP_FREE_GIB ?= 12
$(STAMP): setup.cfg
	@test -x $(VPY) || { \
	if ! command -v "$(PYTHON)" > /dev/null 2>&1; then \
		echo "make setup: $(PYTHON) is not on PATH; vLLM $(BASE) needs" \
			"Python 3.11 or newer. Install it (Ubuntu 22.04: sudo apt install" \
			"python3.11 python3.11-venv; or uv python install 3.11) or point" \
			"PYTHON= at one: make apply PYTHON=/path/to/python3.11" >&2; \
		exit 1; \
	fi; \
	"$(PYTHON)" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { \
		echo "make setup: $(PYTHON) is Python" \
			"$$("$(PYTHON)" -c 'import platform; print(platform.python_version())')," \
			"vLLM $(BASE) needs 3.11 or newer: PYTHON=/path/to/python3.11" >&2; \
		exit 1; }; \
	free_kib=$$(df -Pk . | awk 'NR == 2 { print $$4 }'); \
	if [ "$$free_kib" -lt $$(($(SETUP_FREE_GIB) * 1048576)) ]; then \
		echo "make setup: $$((free_kib / 1048576)) GiB free on the disk of" \
			"$(CURDIR); $(VENV) (vLLM $(BASE), torch $(call pin,torch)" \
			"with its CUDA libraries) needs about $(SETUP_FREE_GIB) GiB. Free" \
			"space there, or clone k3-sppp onto a larger disk" >&2; \
		exit 1; \
	fi; \
	"$(PYTHON)" -m venv $(VENV) || { rm -rf $(VENV); \
		echo "make setup: $(PYTHON) -m venv failed (Debian/Ubuntu: sudo apt" \
			"install python3.11-venv)" >&2; exit 1; }; }
	rm -rf $(VENV)/wheel && $(VPY) -m pip download --quiet --no-deps \
		"vllm==$(BASE)" -d $(VENV)/wheel
	$(VPY) _requirements.py $(VENV)/wheel/vllm-*.whl $(BASE) > $(VENV)/requirements.txt
	$(VPY) -m pip install --quiet -r $(VENV)/requirements.txt \
		"torch==$(call pin,torch)" $(call pin,dev) \
		$(foreach req,$(call pin,eval),"$(req)")
	$(VPY) -m pip install --quiet --no-deps $(VENV)/wheel/vllm-*.whl
	rm -rf $(VENV)/wheel
	$(VPY) -c 'import importlib.metadata as m, sys; \
		got = {p: m.version(p).split("+")[0] for p in ("vllm", "torch")}; \
		want = {"vllm": "$(BASE)", "torch": "$(call pin,torch)"}; \
		sys.exit(0 if got == want else f"pins not met: {got} != {want}")'
	@touch $@

apply: $(if $(VLLM),,setup)
	$(APPLY) apply $(TARGET)

revert:
	$(APPLY) revert $(TARGET) $(if $(FORCE),--force)

# Not applied (3), drift (4) and another revision (6) are answers, not make
# errors; scripts read apply.py's own exit code. Interrupted (5) and errors fail.
status:
	@$(APPLY) status $(TARGET); code=$$?; \
	case $$code in 0|3|4|6) ;; *) exit $$code ;; esac

check:
	$(APPLY) check $(TARGET)

# Tests always run in BASE's venv (.venv, or .venv-BASE), so they apply there
# whatever VLLM says; an older revision of this patch set applied there
# (exit 6) is replaced. The tests that ask apply.py about "the project's
# venv" get that one: apply.py's default target is the project venv whose
# Python runs it.
# What vLLM, torch and the tests write to TMPDIR (ZeroMQ sockets, torchrun's
# logs, inductor's cache, pytest's tmp_path, the ranks' output) goes to one
# directory per run: removed after a passing run, kept and named after a
# failing one, so repeated runs do not fill a node's /tmp. Open to all, as
# /tmp is: the tooling tests run apply.py as another user on trees in it.
# pytest with a TMPDIR of its own: removed after a pass, kept and named after
# a failure (the ranks' and servers' output is in it). $(1) runs pytest as
# `run_pytest ARGS` and leaves the exit code in rc.
define pytest_in_own_tmpdir
@tmp=$$(mktemp -d -t k3-sppp-test-XXXXXX) && chmod 755 "$$tmp"; \
run_pytest() { TMPDIR="$$tmp" $(VPY) -m pytest "$$@"; }; $(1); \
if [ $$rc -eq 0 ]; then rm -rf "$$tmp"; \
else echo "make $@: temporary files kept in $$tmp"; fi; exit $$rc
endef

# The whole suite in two steps. tests/serving first, alone: its servers' ranks
# spin for a second after each step and take both cores from whatever runs
# beside them. Then the rest in TEST_JOBS pytest-xdist workers, each test file
# whole to one worker, so its module fixtures are built once, and
# tests/distributed whole to one worker, so its rank pools and fork servers
# are; the longest first (conftest.py, LONGEST_FIRST; TEST_JOBS=0: in one
# process). A step that PYTEST_ARGS leaves without tests (pytest's exit 5)
# passes if the other ran some. TEST_PATHS=... runs one pytest over those.
TEST_JOBS ?= 2
SERVING_TESTS := tests/serving
define whole_suite
run_pytest $(SERVING_TESTS) $(PYTEST_ARGS); serving=$$?; \
run_pytest -n $(TEST_JOBS) --dist loadfile --ignore=$(SERVING_TESTS) $(PYTEST_ARGS); \
rest=$$?; \
if [ $$serving -eq 5 ] && [ $$rest -ne 5 ]; then serving=0; fi; \
if [ $$rest -eq 5 ] && [ $$serving -ne 5 ]; then rest=0; fi; \
rc=$$serving; if [ $$rc -eq 0 ]; then rc=$$rest; fi
endef

test: setup pristine
	@$(APPLY) status $(BASE_TARGET) > /dev/null; if [ $$? -eq 6 ]; then \
		echo "make test: $(VENV) has another revision of the patch set; replacing it"; \
		$(APPLY) revert $(BASE_TARGET); fi
	$(APPLY) apply $(BASE_TARGET)
	$(call pytest_in_own_tmpdir,$(if $(TEST_PATHS),run_pytest $(TEST_PATHS) $(PYTEST_ARGS); rc=$$?,$(whole_suite)))

# A pristine tree of every other base's vLLM, for apply.py lint and the
# tooling tests, which check each base's series on its own release: where
# that base's venv is absent, the Python sources of its wheel (pip download
# --no-deps, a few hundred MB, never installed), unpacked into
# .cache/pristine-vllm-VERSION and checked against the wheel's RECORD and the
# series' base.sha256 (_pristine.py); once, then kept.
PRISTINE := .cache/pristine-vllm
pristine: setup
	@for base in $(filter-out $(BASE),$(BASES)); do \
		venv=.venv-$$base; [ "$$base" = "$(DEFAULT_BASE)" ] && venv=.venv; \
		if [ -d "$$venv" ] || [ -d "$(PRISTINE)-$$base" ]; then continue; fi; \
		mkdir -p .cache && wheel=$$(mktemp -d .cache/wheel-XXXXXX) && \
		$(VPY) -m pip download --quiet --no-deps "vllm==$$base" -d "$$wheel" && \
		$(VPY) _pristine.py "$$wheel"/vllm-$$base-*.whl "$(PRISTINE)-$$base"; \
		rc=$$?; rm -rf "$$wheel"; [ $$rc -eq 0 ] || exit $$rc; done

# Only the tests that run the series inside real `vllm serve` servers on CPU
# ranks (tests/serving; part of make test).
test-serving: TEST_PATHS := tests/serving
test-serving: test

# Every series is linted on a pristine venv of its own vLLM (.venv and
# .venv-BASE, apply.py lint finds them), so the venvs it lacks are built.
lint: setup
	@for base in $(filter-out $(BASE),$(BASES)); do \
		$(MAKE) --no-print-directory setup BASE=$$base || exit; done
	$(VPY) -m ruff check .
	$(VPY) -m ruff format --check .
	$(APPLY) lint

manifest: setup
	$(APPLY) manifest $(BASE_TARGET)

# One directory per base: each run removes the diffs no pull request writes.
PR_DIR := build/pr$(if $(BASE_TARGET),-$(BASE))
pr-diff: setup
	$(APPLY) export $(TARGET) --pulls $(PR_DIR)

OUT ?= build/rebased
rebase: setup
	@test -n "$(VLLM)" || { echo "make rebase: say which tree: VLLM=TREE"; exit 2; }
	$(APPLY) rebase $(BASE_TARGET) --onto "$(VLLM)" --out "$(OUT)" \
		$(if $(ONTO_VERSION),--onto-version "$(ONTO_VERSION)")

comm-report: setup
	$(VPY) -m eval.comm_report $(COMM_ARGS)

buffer-report: setup
	$(VPY) -m eval.buffer_report $(BUFFER_ARGS)

NPROC ?= 4
nccl-bench: setup
	NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
		$(VPY) -m torch.distributed.run --nproc-per-node $(NPROC) \
		eval/nccl_bench.py $(NCCL_ARGS)

# Run by the interpreter that serves: vLLM 0.33.0's (Python 3.11+), whatever
# python3 the node has.
SERVE_PYTHON ?= $(abspath $(VPY))
serve:
	@command -v "$(SERVE_PYTHON)" > /dev/null || { \
		echo "make serve: no python at SERVE_PYTHON=$(SERVE_PYTHON): run" \
			"\`make apply\` (it builds .venv) or set SERVE_PYTHON= to the python" \
			"of the environment that serves vLLM $(BASE)" >&2; exit 1; }
	@"$(SERVE_PYTHON)" -m eval.serve --arm "$(ARM)" --node-rank "$(NODE_RANK)" \
		--checkpoint "$(or $(CHECKPOINT),$(MODEL))" --master-addr "$(MASTER_ADDR)" \
		--host-ip "$(HOST_IP)" --deepgemm "$(DEEPGEMM)" --python "$(SERVE_PYTHON)" \
		$(if $(RUN),--run)

# The clients' options in `vllm bench serve`'s meanings: the served model name
# (SERVED_MODEL=) is their --model; the checkpoint (CHECKPOINT=, or MODEL= as
# the seed exports it) is --checkpoint, the bench's tokenizer unless TOKENIZER=
# names another. A MODEL= that is not a path is refused, naming SERVED_MODEL=.
CLIENT_OPTIONS = $(if $(SERVED_MODEL),--model "$(SERVED_MODEL)") \
	$(if $(or $(CHECKPOINT),$(MODEL)),--checkpoint "$(or $(CHECKPOINT),$(MODEL))") \
	$(if $(TOKENIZER),--tokenizer "$(TOKENIZER)") $(if $(SEED),--seed "$(SEED)")

evaluate: setup
	$(VPY) -m eval.evaluate --arm "$(ARM)" --base-url "$(BASE_URL)" $(CLIENT_OPTIONS) \
		$(if $(SWEEP),--sweeps "$(SWEEP)") \
		$(if $(POINTS),--points "$(POINTS)") $(if $(REPEAT),--repeat "$(REPEAT)") \
		$(if $(LIMIT),--limit $(LIMIT)) $(if $(GSM8K_DATA),--data "$(GSM8K_DATA)") \
		$(if $(VLLM),--target "$(VLLM)") $(if $(ALLOW_PREFIX_CACHING),--allow-prefix-caching)

gsm8k: setup
	$(VPY) -m eval.gsm8k run --arm "$(ARM)" --base-url "$(BASE_URL)" \
		$(CLIENT_OPTIONS) $(if $(LIMIT),--limit $(LIMIT)) \
		$(if $(GSM8K_DATA),--data "$(GSM8K_DATA)") $(if $(VLLM),--target "$(VLLM)") \
		$(if $(FORCE),--force)

BASELINE ?= fi-ep
gsm8k-compare: setup
	$(VPY) -m eval.gsm8k compare --baseline $(BASELINE)

bench: setup
	$(VPY) -m eval.bench run --arm "$(ARM)" --base-url "$(BASE_URL)" $(CLIENT_OPTIONS) \
		$(if $(SWEEP),--sweep "$(SWEEP)") \
		$(if $(POINTS),--points "$(POINTS)") $(if $(REPEAT),--repeat "$(REPEAT)") \
		$(if $(VLLM),--target "$(VLLM)") $(if $(ALLOW_PREFIX_CACHING),--allow-prefix-caching)

bench-report: setup
	$(VPY) -m eval.bench report

gpu-bundle: setup
	$(VPY) -m eval.gpu_bundle

mutate: apply
	nice -n 19 $(VPY) -m eval.mutate $(MUTATE_ARGS)
