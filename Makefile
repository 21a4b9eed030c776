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

# Benchmarks (not tests). make bench: DDP, FSDP2, DeepSpeed and zeromem step times on five
# model shapes, 2 gloo ranks, as ratios to DDP (benchmarks/results/bench_models.md and .png);
# a few minutes on an idle machine. BENCH_VENV=path reuses an environment with the `bench`
# and `plots` extras. make bench-detail: memory / bytes sent on one model, and collectives.
BENCH_VENV ?= .venv-bench
BENCH_PY := $(BENCH_VENV)/bin/python

$(BENCH_VENV)/.installed: pyproject.toml
	python3 -m venv $(BENCH_VENV)
	$(BENCH_PY) -m pip install -q torch==2.13.0 numpy
	$(BENCH_PY) -m pip install -q -e '.[bench,plots]'
	touch $@

bench: $(BENCH_VENV)/.installed
	OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu $(BENCH_PY) benchmarks/bench_models.py

bench-detail: $(BENCH_VENV)/.installed
	OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu $(BENCH_VENV)/bin/torchrun --standalone --nproc_per_node 2 benchmarks/bench_collectives.py
	OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu $(BENCH_VENV)/bin/torchrun --standalone --nproc_per_node 2 benchmarks/bench_zero.py

.PHONY: install demo test mutants bench bench-detail
