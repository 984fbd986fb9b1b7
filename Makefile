# The two commands: `make demo` and `make test`. Both work on a fresh machine: they create the virtualenv and
# install what they need. torch is pinned first so that nothing later pulls a multi-GB CUDA build.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test install system-deps lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(STAMP): $(PY) agent/pyproject.toml server/pyproject.toml requirements-test.txt requirements-torchtitan.txt
	$(PIP) install -q $(TORCH_PIN)
	$(PIP) install -q -e agent -e server -r requirements-test.txt
	$(PIP) install -q --no-deps -r requirements-torchtitan.txt
	touch $(STAMP)

install: $(STAMP)

# Debian packages the tests use (Prometheus + promtool, docker-compose v1) and the local PostgreSQL.
system-deps:
	bash scripts/system-deps.sh

# The suite runs in TEST_WORKERS processes (pytest-xdist), a test file per process so module fixtures stay whole;
# each process makes its own PostgreSQL database and ports. One torch thread per process: two processes on two
# cores, not four threads fighting for them. TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
test: install lint system-deps
	OMP_NUM_THREADS=1 $(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile

# Lint: ruff (one config, ruff.toml), mypy (mypy.ini: strict on abft/, policy, transport/ and the server) and the
# import contracts of DESIGN.md's layering (.importlinter). `make test` runs it first, so CI enforces it.
LINT_PATHS := agent/attnchecker server/attnchecker_server bench
lint: install
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/mypy --config-file mypy.ini
	PYTHONPATH=agent:server $(VENV)/bin/lint-imports

demo: install
	$(PY) -m attnchecker.cli demo

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
