# The two commands of the quick start; each creates .venv on first use (tools/setup_env.sh, again
# when pyproject.toml changes) and reuses it after:
#
#   make run     the main job: a multilevel run (the recipe: an F-cycle) on the embedded default, its baseline and control (launch/pretrain_vcycle.sh)
#   make test    the tests (python -m pytest -q tests), less the long multi-process cases marked slow
#   make test-all    every test, the slow ones included
#
# ARGS go to the launcher, e.g. make run ARGS="configs/bert_tiny_cpu.json --num_procs 2".
# Your own environment (a GPU machine's CUDA torch), no .venv: make run PYTHON=python

VENV := .venv
STAMP := $(VENV)/.installed

ifeq ($(origin PYTHON),undefined)
  PYTHON := $(CURDIR)/$(VENV)/bin/python
  SETUP := $(STAMP)
  export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
endif
# DeepSpeed compiles its small CPU ops once into this cache.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions

.PHONY: run test test-all setup
run: $(SETUP)
	PYTHON="$(PYTHON)" launch/pretrain_vcycle.sh $(ARGS)

test: $(SETUP)
	"$(PYTHON)" -m pytest -q tests

test-all: $(SETUP)
	"$(PYTHON)" -m pytest -q tests -m ""

setup: $(STAMP)

$(STAMP): pyproject.toml tools/setup_env.sh
	bash tools/setup_env.sh $(VENV)
	touch $@
