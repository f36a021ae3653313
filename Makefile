# Two commands do all set-up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch; any other torch spec pulls a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed
# 8 iterations: the default stable window is 3-8, so later ones would only cost time.
RUN_ARGS ?= --repeats 3 -ms 8

.PHONY: setup system-deps run test lint docs bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_PIN)"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	@touch $(STAMP)

# System packages the tests use (one-node Slurm, munge, iproute2); skipped where not root.
system-deps:
	@bash scripts/setup_system_deps.sh

run: setup
	$(BIN)/python scripts/performance/run_script.py -m qwen -mr qwen3_30b_a3b --task pretrain -g cpu -ng 2 --ab ep_overlap $(RUN_ARGS)

# Two pytest-xdist workers: many tests wait on worker processes, servers or Slurm more than they compute. A file
# stays on one worker, and so do the tests that share Slurm or network namespaces (tests/unit_tests/conftest.py).
PYTEST_PARALLEL ?= -n 2 --dist loadgroup

# The whole suite as the machine is, then the numerics tests again with the CPU math libraries held to each
# instruction set this machine can run (docs/numerics.md): a bitwise claim true on one kind of CPU only fails here.
test: setup system-deps
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q --durations=20 $(PYTEST_PARALLEL) tests
	$(BIN)/python scripts/numerics_under_isas.py --after-as-is -- $(PYTEST_PARALLEL)

# Lint errors fail the target. `ruff format` is not enforced yet: the code base predates it.
lint: setup
	$(BIN)/ruff check .

docs: setup
	$(BIN)/python scripts/generate_docs.py

# Every benchmark with its short profile, one summary table (full profiles: each script's own flags).
bench: setup
	$(BIN)/python -m pip install --quiet -e ".[test,eval]"
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
