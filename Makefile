# The two commands a new user runs. Each creates .venv and installs the pinned requirements
# first; the stamp is keyed on the requirements' hash, so a re-run does not reinstall.
SHELL := /bin/bash
PY := .venv/bin/python
HASH := $(shell cat requirements-cpu.txt requirements-gpu.txt scripts/install.sh | sha256sum | cut -c1-16)
STAMP := .venv/.installed-$(HASH)

.PHONY: test demo compare install
install: $(STAMP)

$(STAMP): requirements-cpu.txt requirements-gpu.txt scripts/install.sh
	bash scripts/install.sh $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

demo: $(STAMP)
	$(PY) scripts/demo.py

compare: $(STAMP)
	$(PY) scripts/compare.py
