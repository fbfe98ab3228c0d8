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

.PHONY: install demo test test-sweep lint docs figures bench conformance resume-matrix gpu-wheels gpu-check gpu-rehearsal clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PIP) install -U "pip>=23" "setuptools>=64" wheel
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH_SPEC)"
	$(PIP) install "packaging" "ninja" "py-cpuinfo" "psutil" "numpy" "pydantic"
	$(PIP) install --no-build-isolation -e ".[all,dev]"
	touch $@

install: $(VENV)/.installed

# the precision and threads from a quick probe of this machine (it says which and why): bf16-true where the CPU
# computes bf16 natively, 32-true where it emulates it (~10x slower: an hour); one thread where more wait on each other
demo: install
	@set -- $$($(PY) -m lightning_lowmem.demo.probe) && \
	echo "OMP_NUM_THREADS=$$2 lowmem fit --config configs/demo.yaml --trainer.precision $$1" && \
	OMP_NUM_THREADS=$$2 $(VENV)/bin/lowmem fit --config configs/demo.yaml --trainer.precision $$1

test: install
	$(PY) -m pytest -q -p no:cacheprovider --timeout=300 --doctest-modules lightning_lowmem tests

# The extra cases of the slow tests that `make test` runs one case per cause of (RunIf(sweep=True), tests/helpers/runif.py):
# more random kills during saves and the control (DeepSpeed's own save killed), the two-rank ZeRO save, the other
# adapter resumes in new processes, a real DeepSpeed op build (~6 min on 2 cores)
test-sweep: install
	LOWMEM_SWEEP=1 $(PY) -m pytest -q -p no:cacheprovider --timeout=900 tests/strategies/test_zero_reliability.py tests/strategies/test_offload_reliability.py tests/callbacks/test_adapters_io.py tests/strategies/test_zero_start.py

# Stop and resume in a new process, every strategy and precision, the accumulation windows (long: ~30 min on 2 cores;
# `make test` runs one case per cause)
resume-matrix: install
	LOWMEM_RESUME_MATRIX=1 $(PY) -m pytest -q -p no:cacheprovider --timeout=900 -m slow tests/test_resume_across_processes.py

# ruff's default rules of the pinned minor version (pyproject.toml's dev extra), over the whole tree; then the import
# contract of pyproject.toml ([tool.importlinter]: each layer of the package imports only the layers below it)
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

# The documentation site (docs/, mkdocs.yml) into the ignored site/; --strict fails on any warning: a broken link
# or anchor, an API name mkdocstrings cannot resolve, a docstring it cannot parse
docs: install
	$(VENV)/bin/mkdocs build --strict --site-dir site

# Rewrite every figure block of README.md and docs/ from benchmarks/results/*.json (tests/test_docs_figures.py
# fails while a committed page differs from what this writes)
figures: install
	$(PY) benchmarks/figures.py

bench: install
	$(PY) benchmarks/run.py all

# The whole conformance corpus (every module x every flag against plain Lightning; `make test` runs a slice of it):
# resumable, re-runs every cell after a code change; results in benchmarks/results/conformance.{json,md}
conformance: install
	$(PY) tests/conformance/run.py

# GPU checks (docs/gpu-checks.md): six stages of at most 7 minutes each, offline, on the GPU machine's own python3
# (no venv, nothing from a registry); stage 1 is the headline. `PY=...` on the command line picks the interpreter.
GPU_PY := $(if $(filter command line,$(origin PY)),$(PY),python3)

# here, with the network: the wheels the stages need that the GPU image lacks, into the ignored .whl/ (checked)
gpu-wheels:
	$(GPU_PY) benchmarks/gpu/wheels.py download .whl

# there, from the repository root: make gpu-check STAGE=1 (then 2 to 6, each on its own); results in
# benchmarks/results/gpu/ and in $$LOWMEM_GPU_OUT when set, rewritten as each figure is measured
gpu-check:
	@case "$(STAGE)" in 1|2|3|4|5|6) ;; *) echo "Passed STAGE='$(STAGE)'; expected 1 to 6: make gpu-check STAGE=1" >&2; exit 2;; esac
	$(GPU_PY) benchmarks/gpu/run_stage.py --stage $(STAGE) --wheels .whl

# here, without a GPU: the six stages on the CPU (tiny sizes), the network cut, the GPU image mimicked; the
# project's venv stands in for the image's python3 (`PY=...` picks another)
REHEARSAL_PY := $(if $(filter command line,$(origin PY)),$(PY),$(VENV)/bin/python)
gpu-rehearsal: install
	test -d .whl || $(MAKE) gpu-wheels
	@if [ "$$(id -u)" = 0 ] && command -v unshare >/dev/null 2>&1; then \
		echo "unshare -n -- $(REHEARSAL_PY) benchmarks/gpu/rehearse.py"; unshare -n -- $(REHEARSAL_PY) benchmarks/gpu/rehearse.py; \
	else \
		echo "not root or no unshare: the network stays up (pip --no-index)"; $(REHEARSAL_PY) benchmarks/gpu/rehearse.py --network-up-ok; \
	fi

clean:
	rm -rf $(VENV) lightning_logs runs site
