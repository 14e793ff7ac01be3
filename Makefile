# Two entry points on a fresh machine (Python >= 3.10 with venv):
#   make demo   creates .venv, installs dflash-pipe, runs the embedded demo (tiny target, CPU is fine)
#   make test   creates .venv, installs dflash-pipe with its test tools, runs the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
# Pin torch first: on the CPU CI machines this resolves to a local CPU build; a bare `torch` would pull CUDA.
TORCH ?= torch==2.13.0

.PHONY: demo test lint clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --no-compile $(TORCH)
	$(PY) -m pip install -q --no-compile -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/dflash-pipe launch

test: $(VENV)/.installed
	$(PY) -m pytest

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check dflash_pipe tests bench
	$(VENV)/bin/ruff format --check dflash_pipe tests bench

clean:
	rm -rf $(VENV) runs
