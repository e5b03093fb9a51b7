# `make train` and `make test` work on a fresh machine: they create .venv when missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
NPROC ?= 2
# make test runs this many tests at once: a multi-process test leaves a core idle for a
# third of its time (starts, waits on timeouts, single-rank phases)
TEST_JOBS ?= 2
ARGS ?=

.PHONY: train test bench gpu-check docs clean

$(BIN)/llmtrain: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: an unpinned torch would pull the multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

train: $(BIN)/llmtrain
	$(BIN)/python -m compileall -q llmtrain
	$(BIN)/torchrun --standalone --nproc-per-node $(NPROC) -m llmtrain train --config debug_cpu $(ARGS)

test: $(BIN)/llmtrain
	$(BIN)/python -m compileall -q llmtrain  # bytecode once, not in each of hundreds of processes
	@# a test file's tests stay on one worker, so the runs its tests share run once; then
	@# the tests marked alone (the two chaos soaks), apart from the rest, side by side
	$(BIN)/python -m pytest tests -n $(TEST_JOBS) --dist loadfile -m "not alone" --durations=25 $(ARGS)
	$(BIN)/python -m pytest tests -n $(TEST_JOBS) --dist load -m alone --durations=5 $(ARGS)

# On a GPU node: the CUDA/NCCL/NVML/FP8 checks (tests/gpu), then the GPU figures. The venv's
# torch==2.13.0 from PyPI is the CUDA build on Linux x86-64.
NO_GPU := make gpu-check: torch %s in $(VENV) sees no CUDA GPU (a CPU build, or no driver): \
  check nvidia-smi, then install torch==2.13.0 from PyPI or the CUDA wheel index into $(VENV)
gpu-check: $(BIN)/llmtrain
	@# a CPU build of torch 2.13.0 satisfies the pin too, and then every GPU test skips
	@$(BIN)/python -c "import sys, torch; torch.cuda.is_available() or sys.exit('$(NO_GPU)' \
	  % torch.__version__)"
	$(BIN)/python -m pytest tests/gpu -s -p no:cacheprovider $(ARGS)
	$(BIN)/python benchmarks/gpu.py

bench: $(BIN)/llmtrain
	$(BIN)/python benchmarks/step_overhead.py
	$(BIN)/python benchmarks/checkpoint.py
	$(BIN)/python benchmarks/checkpoint_index.py
	$(BIN)/python benchmarks/watchdog.py
	$(BIN)/python benchmarks/store_scale.py
	$(BIN)/python benchmarks/control_plane.py
	$(BIN)/python benchmarks/agreement.py
	$(BIN)/python benchmarks/startup.py
	$(BIN)/python benchmarks/recovery.py
	$(BIN)/python benchmarks/sampler.py
	$(BIN)/python benchmarks/data_prepare.py
	$(BIN)/python benchmarks/api_overhead.py

# docs/config.md from the Config dataclasses, then the site (site/), as the tests check it
docs: $(BIN)/llmtrain
	$(BIN)/llmtrain config --reference > docs/config.md
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf runs .pytest_cache site
