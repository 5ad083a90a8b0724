# eg2-serve: the habits, one target each. `make run` and `make test` are the README's two commands.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# torch from this machine's disk: 2.14.1 + torchvision 0.29.1 give the full transformers reference
# (its video processor needs torchvision; the 2.13.0 CPU wheel alone has no importable torchvision).
TORCH   ?= torch==2.14.1 torchvision==0.29.1

.PHONY: install run test test-gpu lint format typecheck check bench wheelhouse image image-test image-setup clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

## Start the service (a demo checkpoint with random weights when EG2_MODEL is unset).
run: $(STAMP)
	$(VENV)/bin/eg2 serve

## The test suite CI runs: everything but the GPU tests.
test: $(STAMP)
	$(PY) -m pytest -m "not gpu" -q

## GPU tests (on the H200): parity, weight memory, unpack overlap. Figures go to $(RESULTS).
## On a host without internet, with .whl/ from `make wheelhouse` carried there (docs/GPU.md):
##   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
##   PYTHONPATH=/tmp/site:$$PWD make test-gpu
RESULTS ?= out
test-gpu:
	python3 -m pytest -m gpu -q -s --results $(RESULTS) tests/gpu

lint: $(STAMP)
	$(VENV)/bin/ruff check app eg2_runtime benchmarks scripts tests docker
	$(VENV)/bin/ruff format --check app eg2_runtime benchmarks scripts tests docker

format: $(STAMP)
	$(VENV)/bin/ruff check --fix app eg2_runtime benchmarks scripts tests docker
	$(VENV)/bin/ruff format app eg2_runtime benchmarks scripts tests docker

typecheck: $(STAMP)
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy --strict docker/healthcheck.py docker/image_test.py

check: lint typecheck test

## The benchmark: on a GPU `make bench`; on a CPU `make bench BENCH_ARGS=--quick` (tiny model).
## On a GPU host without internet, after the install line of test-gpu above (docs/GPU.md):
##   PYTHONPATH=/tmp/site:$$PWD python3 -m app.cli bench --out out/bench
BENCH_ARGS ?=
bench: $(STAMP)
	$(VENV)/bin/eg2 bench $(BENCH_ARGS)

## The wheels a GPU host without internet needs for the service, test-gpu and bench, into .whl/
## (git-ignored): what the host's package list (WHEEL_HOST) lacks or holds at another version.
WHEEL_PYTHON   ?= 3.12
WHEEL_PLATFORM ?= manylinux_2_39_x86_64
WHEEL_HOST     ?= scripts/h200-packages.txt
wheelhouse: $(STAMP)
	$(PY) scripts/wheelhouse.py --python $(WHEEL_PYTHON) --platform $(WHEEL_PLATFORM) --host $(WHEEL_HOST) --dest .whl

## The container image (docker/). `make image` builds it with docker or podman, whichever works
## here; `make image-test` runs it and checks it from outside (docker/image_test.py says what).
## Optional, for networks that are not the open internet (README, "Building offline or behind a
## proxy"): CPU_BASE, CUDA_BASE, TORCH_INDEX, TORCH_WHEELS, TORCH_VERSION, CA_BUNDLE, ENGINE
## (docker/image.sh says what each does); empty means the public default. `make image-setup`
## sets up podman on a Debian host and records what this host needs (`make image` runs it when no
## engine works and it can).
VARIANT ?= cpu
IMAGE   ?= eg2-serve:$(VARIANT)

image:
	VARIANT=$(VARIANT) IMAGE=$(IMAGE) docker/image.sh build

image-test: image
	VARIANT=$(VARIANT) IMAGE=$(IMAGE) docker/image.sh test

image-setup:
	docker/setup-podman-debian.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
