# Two entry points on a fresh machine (Python >= 3.10 with venv):
#   make demo   creates .venv, installs dflash-pipe, runs the embedded demo (tiny target, CPU is fine)
#   make test   creates .venv, installs dflash-pipe with its test tools, builds the test assets, runs the suite
#   make test-fast   the same without the tests marked slow (a few minutes; CI runs them all)
VENV ?= .venv
PY := $(VENV)/bin/python
# Pin torch first: on the CPU CI machines this resolves to a local CPU build; a bare `torch` would pull CUDA.
TORCH ?= torch==2.13.0

.PHONY: demo assets test test-fast lint clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --no-compile $(TORCH)
	$(PY) -m pip install -q --no-compile -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/dflash-pipe launch

# The cached builds the tests read (demo target, reference venv, real target, speculators site), made side
# by side (tests/assets.py) before the suite runs.
assets: $(VENV)/.installed
	$(PY) -m tests.assets

test: assets
	$(PY) -m pytest

# While iterating: every test but those marked slow (pyproject.toml's markers), about 3 minutes on 2 cores
# once the assets are cached. Not a substitute for `make test` before a change lands: CI runs every test.
test-fast: assets
	$(PY) -m pytest -m "not slow"

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check dflash_pipe tests bench
	$(VENV)/bin/ruff format --check dflash_pipe tests bench

clean:
	rm -rf $(VENV) runs
