# The two commands of the README: `make demo` (the main job) and `make test`.
# Each creates .venv and installs everything on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
# NOTE: torch==2.13.0 is the CPU wheel on this project's machines. It is installed only when the
# venv cannot import torch already: the venv sees the system site-packages, so a CUDA torch you
# already have is kept. deepspeed builds against that torch (--no-build-isolation), otherwise its
# build environment would download a multi-GB CUDA torch of its own.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo test lint bench conformance gpu-check clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PIP) install -U "pip>=23" "setuptools>=64" wheel
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH_SPEC)"
	$(PIP) install "packaging" "ninja" "py-cpuinfo" "psutil" "numpy" "pydantic"
	$(PIP) install --no-build-isolation -e ".[all,dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/lowmem fit --config configs/demo.yaml

test: install
	$(PY) -m pytest -q -p no:cacheprovider --timeout=300 --doctest-modules lightning_lowmem tests

# ruff's default rules of the pinned minor version (pyproject.toml's dev extra), over the whole tree
lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) benchmarks/run.py all

# The whole conformance corpus (every module x every flag against plain Lightning; `make test` runs a slice of it):
# resumable, re-runs every cell after a code change; results in benchmarks/results/conformance.{json,md}
conformance: install
	$(PY) tests/conformance/run.py

# On a machine with a CUDA GPU: every CUDA test (`-m cuda`, and the RunIf(min_cuda_gpus) ones, which run only there),
# the CPU-stand-in tests of the CUDA transfer logic (`-k deferred`), then the benchmarks, into benchmarks/results/gpu/.
gpu-check: install
	$(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu-check needs a CUDA GPU (torch.cuda.is_available() is False)')"
	$(PY) -m pytest -q -p no:cacheprovider --timeout=900 -m cuda tests
	$(PY) -m pytest -q -p no:cacheprovider --timeout=900 -k deferred tests
	LOWMEM_BENCH_RESULTS=benchmarks/results/gpu $(PY) benchmarks/run.py all

clean:
	rm -rf $(VENV) lightning_logs runs
