# gradzip: `make demo` and `make test` work on a fresh machine.
# The venv gets the CPU build of torch by default; GPU users override TORCH_SPEC,
# e.g. `make test TORCH_SPEC="torch==2.13.0" PIP_EXTRA="--index-url ..."`.
PYTHON      ?= python3
VENV        ?= .venv
TORCH_SPEC  ?= torch==2.13.0
PIP_EXTRA   ?=
PY          := $(VENV)/bin/python
STAMP       := $(VENV)/.installed

.PHONY: venv demo test test-all lint bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned, so the package's torch>=2.9 range never pulls a CUDA build.
	$(PY) -m pip install --quiet $(PIP_EXTRA) "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet $(PIP_EXTRA) -e ".[dev,compare,hf,parquet]" || \
	  $(PY) -m pip install --quiet $(PIP_EXTRA) -e ".[dev]"
	touch $(STAMP)

# The main job, on built-in data: the race of `gradzip compare --preset quick` (PyTorch's
# own hooks and gradzip chains training a tiny GPT on 2 ranks over a 100 Mbit/s link
# shaped in a network namespace); report and plots in runs/demo. A few minutes on 2 cores.
demo: $(STAMP)
	$(VENV)/bin/gradzip compare --preset quick --out runs/demo

test: $(STAMP)
	$(PY) -m pytest -n 2 -q

test-all: $(STAMP)
	$(PY) -m pytest -n 2 -q -m "slow or not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
