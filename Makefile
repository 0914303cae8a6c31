# gradzip: `make demo` and `make test` work on a fresh machine.
# The venv gets the CPU build of torch by default; GPU users override TORCH_SPEC,
# e.g. `make test TORCH_SPEC="torch==2.13.0" PIP_EXTRA="--index-url ..."`.
PYTHON      ?= python3
VENV        ?= .venv
TORCH_SPEC  ?= torch==2.13.0
PIP_EXTRA   ?=
PY          := $(VENV)/bin/python
STAMP       := $(VENV)/.installed

.PHONY: venv demo test test-fast test-dist test-all lint bench clean gpu-kit

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned, so the package's torch>=2.9 range never pulls a CUDA build.
	$(PY) -m pip install --quiet $(PIP_EXTRA) "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet $(PIP_EXTRA) -e ".[dev,lab,compare,hf,parquet]" || \
	  $(PY) -m pip install --quiet $(PIP_EXTRA) -e ".[dev,lab]"
	# the ft extra (torchft, for train --ft) on its own: where it cannot be installed,
	# everything else still is, and the tests that need it are skipped
	$(PY) -m pip install --quiet $(PIP_EXTRA) "torchft>=0.2" || \
	  echo "torchft could not be installed: gradzip train --ft is unavailable"
	# Triton, for the fused GPU kernels; on a CPU its interpreter runs them in the tests
	# (tests/test_kernels.py, skipped where it cannot be installed)
	$(PY) -m pip install --quiet $(PIP_EXTRA) "triton>=3.5" || \
	  echo "triton could not be installed: the kernel tests are skipped"
	# compile every numba kernel once, now, so that no first run pays for it (~1 min)
	$(VENV)/bin/gradzip codecs warm
	touch $(STAMP)

# The main job, on built-in data: the race of `gradzip compare --preset quick` (PyTorch's
# own hooks and gradzip chains training a tiny GPT on 2 ranks over a 100 Mbit/s link
# shaped in a network namespace); report and plots in runs/demo. Then the whole path of
# gradient analysis: a short 2-rank run captured into an HDF5 archive, and
# `gradzip analyze` of it (runs/demo/analysis/summary.md). A few minutes on 2 cores.
demo: $(STAMP)
	$(VENV)/bin/gradzip compare --preset quick --out runs/demo
	rm -rf runs/demo/grads runs/demo/capture-run runs/demo/analysis
	$(PY) -m torch.distributed.run --standalone --nproc_per_node 2 -m gradzip train \
	  --model tiny --dataset stdlib --max-tokens 200000 --max-steps 20 --parallel ddp \
	  --codec none --threads 1 --capture runs/demo/grads --capture-every 5 \
	  --out runs/demo/capture-run --no-progress --no-tensorboard
	$(VENV)/bin/gradzip archive verify runs/demo/grads
	$(VENV)/bin/gradzip analyze runs/demo/grads --out runs/demo/analysis --workers 2
	@echo; echo "The race's answer (runs/demo/report.md):"; cat runs/demo/verdict.txt

# Every test not marked slow, in one run: the single-process tests fill the gaps between
# the long ones that spawn real gloo ranks (marked dist), and worksteal keeps both
# workers busy to the end (21 min on 2 cores, 2026-12-02, against 29 as two runs).
# test-fast (about 9 min) and test-dist (about 20) run one tier each.
test: $(STAMP)
	$(PY) -m pytest -n 2 --dist worksteal -q -m "not slow" --durations=10

test-fast: $(STAMP)
	$(PY) -m pytest -n 2 -q -m "not slow and not dist" --durations=10

test-dist: $(STAMP)
	$(PY) -m pytest -n 2 -q -m "dist and not slow" --durations=10

test-all: $(STAMP)
	$(PY) -m pytest -n 2 -q -m "slow or not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples
	$(VENV)/bin/mypy

# For a borrowed GPU host without network (Python 3.12 with torch, numba, h5py, xxhash):
# gradzip's wheel and the dependencies it lacks as cp312 manylinux wheels, in gpu-kit/
# (git-ignored; about 25 MB). There, from the repository root:
#   python -m pip install --no-index --find-links gpu-kit gradzip rich tqdm
#   gradzip bench gpu --out runs/gpu
gpu-kit: $(STAMP)
	rm -rf gpu-kit && mkdir -p gpu-kit
	$(PY) -m pip download --quiet --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux_2_28_x86_64 --dest gpu-kit \
	  constriction isal lz4 zstandard cffi tqdm rich
	$(PY) -m pip wheel --quiet --no-deps --wheel-dir gpu-kit .

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
