# rnnserve: two commands do all set-up.
#   make serve   creates .venv if needed and serves ./models (cuDNN if a GPU is usable, else the CPU reference engine)
#   make test    creates .venv with the test extra and runs the whole suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# `make serve HTTP_PORT=9000`, or the server's own variables (`RNNSERVE_HTTP_PORT=9000 make serve`)
HTTP_PORT ?= $(or $(RNNSERVE_HTTP_PORT),8000)
GRPC_PORT ?= $(or $(RNNSERVE_GRPC_PORT),8001)
REPOSITORY ?= $(or $(RNNSERVE_REPOSITORY),models)
DEVICE ?= $(or $(RNNSERVE_DEVICE),auto)

.PHONY: serve test gpu-test bench-cpu models clean

$(VENV)/.core: pyproject.toml setup.py service/engines/reference/native/kernels.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
	  echo "GPU found: installing the gpu extra (cupy, cuDNN)"; $(PY) -m pip install -q -e '.[gpu]' || true; fi
	touch $@

$(VENV)/.test: $(VENV)/.core
	$(PY) -m pip install -q -e '.[test]'
	touch $@

serve: $(VENV)/.core
	$(PY) -m service.cli serve --repository $(REPOSITORY) --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --device $(DEVICE)

test: $(VENV)/.test
	KERAS_BACKEND=torch $(PY) -m pytest -q -p no:cacheprovider

gpu-test: $(VENV)/.test
	$(PY) -m pytest -q -m gpu

bench-cpu: $(VENV)/.test
	$(PY) bench/cpu_engine.py

models: $(VENV)/.test
	KERAS_BACKEND=torch $(PY) models/train_examples.py

clean:
	rm -rf $(VENV) .pytest_cache
