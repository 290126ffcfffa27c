# cplib developer entry points. Every target creates .venv and installs the
# pinned dependencies first, so each works on a fresh machine.
PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
DEPS   := $(VENV)/.deps-installed
EDIT   := $(VENV)/.cplib-editable
NPROC  ?= 2

.PHONY: all build demo test bench cuda-check clean

all: build

$(VPY):
	$(PYTHON) -m venv $(VENV)

$(DEPS): requirements-dev.txt | $(VPY)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -r requirements-dev.txt
	touch $@

$(EDIT): $(DEPS) pyproject.toml setup.py
	$(VPY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

# Incremental native build (ninja) into cplib/_C*.so; the editable install
# makes `import cplib` find it from anywhere.
build: $(EDIT)
	$(VPY) setup.py -q build_ext --inplace

demo: build
	$(VPY) -m torch.distributed.run --standalone --nproc-per-node $(NPROC) examples/demo.py

test: build
	$(VPY) -m pytest -q tests

bench: build
	$(VPY) benchmarks/run_all.py

# Syntax/type check of every CUDA source with nvcc (no GPU needed).
cuda-check:
	@for f in csrc/cuda/*.cu; do \
	  echo "nvcc -c $$f (sm_90)"; \
	  nvcc -std=c++17 -arch=sm_90 -Icsrc/include -Xcompiler -Wall,-Wextra -c $$f -o /dev/null || exit 1; \
	done

clean:
	rm -rf build cplib/_C*.so *.egg-info
