# Everything a fresh machine needs: `make demo` runs the main job, `make test` the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION := 2.13.0

.PHONY: demo test bench clean

$(VENV)/.installed: pyproject.toml Makefile
	bash scripts/install-system-packages.sh
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU build of torch first: an unpinned torch would pull the CUDA wheels.
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/demo.py

# One pytest-xdist worker per core, the tests of a file on one worker (its fixtures are
# built once), the longest files first (tests/conftest.py, which also gives each worker
# its share of the cores). Bytecode is written even where the environment says not to,
# or each worker rewrites every test module's asserts anew and each process the suite
# starts compiles the package anew.
test: $(VENV)/.installed
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder

bench: $(VENV)/.installed
	$(PY) bench/attention.py

clean:
	rm -rf $(VENV) build src/*.egg-info
