# tahnode: `make demo` runs the swarm on one machine, `make test` runs the test suite.
# Both bootstrap .venv on first use. TORCH picks the torch requirement by the machine: with an
# NVIDIA GPU (nvidia-smi lists one) the default CUDA build, without one the CPU build CI pins
# (torch==2.13.0), so a CPU machine downloads no nvidia-* wheels. TORCH=... overrides either.
PYTHON ?= python3
CPU_TORCH := torch==2.13.0
TORCH ?= $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo torch || echo $(CPU_TORCH))
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# pytest-xdist workers: most slow tests wait on daemons, so two share 2 cores well; the tests that
# change the root network namespace still run one at a time (tests/conftest.py). 0 runs in-process.
TEST_WORKERS ?= 2

.PHONY: all venv test demo bench proto clean

all: test

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[kernels,test,p2p]"
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

demo: $(STAMP)
	$(VENV)/bin/tahnode demo

bench: $(STAMP)
	$(VENV)/bin/tahnode bench kernels

# Regenerates the committed protobuf/gRPC modules (tests/test_proto.py checks they are current).
proto: $(STAMP)
	$(PY) -m tahnode.proto.generate

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
