# The README's two commands: `make demo` (the main job) and `make test` (the test suite).
# Both create .venv on first use (torch from the local CPU wheel: `pip install torch==2.13.0`) and reuse it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: demo test lint bench clean

$(BIN)/memtrim: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev,demo,models]'
	touch $(BIN)/memtrim

demo: $(BIN)/memtrim
	$(BIN)/memtrim demo $(ARGS)

test: $(BIN)/memtrim
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy  # targets: [tool.mypy] files in pyproject.toml (src/memtrim)
	# one process per CPU (at most 4), torch on one thread in each: 5:09 against 6:32 in turn on 2 cores (28-11)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(BIN)/python -m pytest -q -n auto --maxprocesses=4 $(ARGS)

lint: $(BIN)/memtrim
	$(BIN)/ruff check src tests benchmarks

bench: $(BIN)/memtrim
	$(BIN)/python benchmarks/tracker_overhead.py

clean:
	rm -rf $(VENV) report build src/*.egg-info .pytest_cache
