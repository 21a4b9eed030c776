# make demo: a 2-rank ZeRO training run on CPU with a memory report.
# make test: the test suite. Both set up .venv on first use.
# make mutants: every known-bad edit in tests/mutants/*.json must fail its tests (tools/mutants.py).
VENV ?= .venv
PY := $(VENV)/bin/python
STAGE ?= 2
NPROC ?= 2

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) \
		examples/train.py --config examples/configs/stage$(STAGE).json

test: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests examples benchmarks tools
	$(VENV)/bin/mypy
	OMP_NUM_THREADS=1 $(PY) -m pytest -q

mutants: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(PY) tools/mutants.py

# Benchmarks (not tests): DDP, ZeroRedundancyOptimizer, FSDP2, DeepSpeed and zeromem side by side.
.venv-bench/.installed: pyproject.toml
	python3 -m venv .venv-bench
	.venv-bench/bin/pip install -q torch==2.13.0 numpy deepspeed
	.venv-bench/bin/pip install -q -e .
	touch $@

bench: .venv-bench/.installed
	OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu .venv-bench/bin/torchrun --standalone --nproc_per_node 2 benchmarks/bench_collectives.py
	OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu .venv-bench/bin/torchrun --standalone --nproc_per_node 2 benchmarks/bench_zero.py

.PHONY: install demo test mutants bench
