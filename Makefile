# k3-sppp: Kimi K3 sequence parallelism across pipeline stages, on vLLM.
#
#   make apply          pinned vLLM into .venv (if absent), verify, apply
#   make test           unit, distributed (CPU, gloo) and tooling tests
#   make revert         byte-identical original vLLM again (FORCE=1: also
#                       files edited since apply, each kept as
#                       *.k3-sppp-drift[.N], never overwritten)
#   make status         what is applied where, and any drift
#   make check          dry run: which patch and hunk would fail
#   make pr-diff        build/pr/: one diff and description per upstream
#                       pull request (patches/pull-requests.ini), in order
#   make rebase         the series three-way onto another vLLM tree, written
#                       as a patch set for it: VLLM=TREE [OUT=build/rebased]
#                       [ONTO_VERSION=] (where TREE does not say its version)
#   make lint           ruff, the series' consistency, the pull requests' order
#   make manifest       regenerate patches/base.sha256 (the wheel's RECORD) and
#                       patches/patched.sha256 (what the series writes)
#   make nccl-bench     time the SP hand-off and the packed end gather over
#                       NCCL (gloo on CPU): NPROC=4 NCCL_ARGS="--part handoff --tp 2"
#   make comm-report    what one step communicates, per rank and phase, on
#                       real CPU ranks (COMM_ARGS="--tp 2 --pp 2 --tokens 17")
#   make serve          print one arm's serve command for one node; RUN=1
#                       checks the node and starts it: ARM=mega-sp|fi-ep|
#                       fi-noep NODE_RANK= MODEL= MASTER_ADDR= HOST_IP=
#                       DEEPGEMM= [SERVE_PYTHON=]
#   make gsm8k          GSM8K with lm-eval against a running arm: ARM=
#                       BASE_URL= MODEL= [LIMIT=] [GSM8K_DATA=dir] [FORCE=1]
#   make gsm8k-compare  table and paired verdict per arm [BASELINE=fi-ep]
#   make bench          the prefill sweep against a running arm: ARM=
#                       BASE_URL= MODEL= TOKENIZER= [POINTS=128x1,8192x4]
#                       [ALLOW_PREFIX_CACHING=1]
#   make bench-report   tables, JSON summary and plots from results/bench
#   make setup          only the pinned .venv
#
# VLLM=/path points apply, revert, status and check at your own vLLM
# (site-packages, venv, checkout root or the vllm/ package) instead of .venv.

SHELL := /bin/bash
.DEFAULT_GOAL := help

pin = $(shell sed -n 's/^$(1) *= *//p' setup.cfg)
PYTHON ?= $(call pin,python)
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.k3-sppp-setup
TARGET := $(if $(VLLM),--target "$(VLLM)")
APPLY := python3 apply.py
PYTEST_ARGS ?=

.PHONY: help setup apply revert status check test lint manifest pr-diff rebase comm-report \
	nccl-bench serve gsm8k gsm8k-compare bench bench-report

help:
	@sed -n '3,/^$$/s/^# \{0,1\}//p' $(MAKEFILE_LIST)

setup: $(STAMP)

$(STAMP): setup.cfg
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet "vllm==$(call pin,vllm)" \
		"torch==$(call pin,torch)" $(call pin,dev) \
		$(foreach req,$(call pin,eval),"$(req)")
	$(VPY) -c 'import importlib.metadata as m, sys; \
		got = {p: m.version(p).split("+")[0] for p in ("vllm", "torch")}; \
		want = {"vllm": "$(call pin,vllm)", "torch": "$(call pin,torch)"}; \
		sys.exit(0 if got == want else f"pins not met: {got} != {want}")'
	@touch $@

apply: $(if $(VLLM),,setup)
	$(APPLY) apply $(TARGET)

revert:
	$(APPLY) revert $(TARGET) $(if $(FORCE),--force)

status:
	$(APPLY) status $(TARGET)

check:
	$(APPLY) check $(TARGET)

# Tests always run in .venv, so they apply there whatever VLLM says; an
# older revision of this patch set applied there (exit 6) is replaced.
test: setup
	@$(APPLY) status > /dev/null; if [ $$? -eq 6 ]; then \
		echo "make test: .venv has another revision of the patch set; replacing it"; \
		$(APPLY) revert; fi
	$(APPLY) apply
	$(VPY) -m pytest $(PYTEST_ARGS)

lint: setup
	$(VPY) -m ruff check .
	$(VPY) -m ruff format --check .
	$(APPLY) lint

manifest: setup
	$(APPLY) manifest

pr-diff: setup
	$(APPLY) export $(TARGET) --pulls build/pr

OUT ?= build/rebased
rebase: setup
	@test -n "$(VLLM)" || { echo "make rebase: say which tree: VLLM=TREE"; exit 2; }
	$(APPLY) rebase --onto "$(VLLM)" --out "$(OUT)" \
		$(if $(ONTO_VERSION),--onto-version "$(ONTO_VERSION)")

comm-report: setup
	$(VPY) -m eval.comm_report $(COMM_ARGS)

NPROC ?= 4
nccl-bench: setup
	NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
		$(VPY) -m torch.distributed.run --nproc-per-node $(NPROC) \
		eval/nccl_bench.py $(NCCL_ARGS)

SERVE_PYTHON ?= $(abspath $(VPY))
serve:
	python3 -m eval.serve --arm "$(ARM)" --node-rank "$(NODE_RANK)" \
		--model "$(MODEL)" --master-addr "$(MASTER_ADDR)" --host-ip "$(HOST_IP)" \
		--deepgemm "$(DEEPGEMM)" --python "$(SERVE_PYTHON)" $(if $(RUN),--run)

gsm8k: setup
	$(VPY) -m eval.gsm8k run --arm "$(ARM)" --base-url "$(BASE_URL)" \
		--model "$(MODEL)" $(if $(LIMIT),--limit $(LIMIT)) \
		$(if $(GSM8K_DATA),--data "$(GSM8K_DATA)") $(if $(VLLM),--target "$(VLLM)") \
		$(if $(FORCE),--force)

BASELINE ?= fi-ep
gsm8k-compare: setup
	$(VPY) -m eval.gsm8k compare --baseline $(BASELINE)

bench: setup
	$(VPY) -m eval.bench run --arm "$(ARM)" --base-url "$(BASE_URL)" \
		--model "$(MODEL)" --tokenizer "$(TOKENIZER)" \
		$(if $(POINTS),--points "$(POINTS)") $(if $(VLLM),--target "$(VLLM)") \
		$(if $(ALLOW_PREFIX_CACHING),--allow-prefix-caching)

bench-report: setup
	$(VPY) -m eval.bench report
