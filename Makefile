# cplib developer entry points. Every target creates .venv and installs the
# pinned dependencies first, so each works on a fresh machine.
PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
DEPS   := $(VENV)/.deps-installed
INSTALLED := $(VENV)/.cplib-installed
NPROC  ?= 2
# Each setup stage prints one line; its full output goes to build/logs/
# (CPLIB_VERBOSE=1 shows everything).
LOGS   := build/logs
QUIET  := $(PYTHON) build_support/quiet.py

# torch.compile's inductor cache, per checkout: code compiled against another
# checkout's op schemas (a shared /tmp cache) must never be replayed here.
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/build/torchinductor

# ccache, when installed, caches compiled objects across builds and clones
# (paths are hashed relative to the repository root); CPLIB_CCACHE=0 skips it.
ifneq ($(CPLIB_CCACHE),0)
ifneq ($(wildcard /usr/lib/ccache/g++),)
export PATH := /usr/lib/ccache:$(PATH)
export CCACHE_BASEDIR := $(CURDIR)
endif
endif

# `make test-torch TORCH=oldest|default|newest`: the suite against another
# torch (requirements/torch-$(TORCH).txt), in its own venv, with cplib
# pip-installed there (a CPU wheel built against that torch, whose registry
# build is a CUDA one; this also checks that `pip install` works beside it).
TORCH     ?= newest
TORCH_PIN := $(shell sed -n 's/^\(torch==[^ ]*\).*/\1/p' requirements/torch-$(TORCH).txt)
TVENV     := .venv-$(subst ==,-,$(TORCH_PIN))
# No pip config files there: a machine-wide cap on torch releases (seen on dev
# machines) must not veto the release the project pins.
TPIP      := env PIP_CONFIG_FILE=/dev/null $(TVENV)/bin/python -m pip

.PHONY: all build wheel develop demo test test-gpu-on-cpu test-torch torch-venv bench cuda-check cuda-build cuda-wheel clean \
        lint lint-python lint-native format-native

all: build

$(VPY):
	@echo "creating $(VENV)"
	@$(PYTHON) -m venv $(VENV)

# The clients (accelerate, torchtitan: tests/integrations/) come last: torchtitan
# without its declared dependencies (requirements/clients.txt says why).
$(DEPS): requirements-dev.txt requirements/torch-default.txt requirements/clients.txt \
         requirements/clients-nodeps.txt | $(VPY)
	@$(QUIET) $(LOGS)/install.log "installing the pinned dependencies into $(VENV)" -- \
	  $(VPY) -m pip install -r requirements/torch-default.txt -r requirements-dev.txt
	@$(QUIET) $(LOGS)/install-clients.log "installing the pinned clients into $(VENV)" -- \
	  sh -c '$(VPY) -m pip install -r requirements/clients.txt && \
	         $(VPY) -m pip install --no-deps -r requirements/clients-nodeps.txt'
	@touch $@

# The wheel: one file (abi3, LibTorch's stable ABI) for every torch from 2.11
# and every CPython from 3.11, built once against the default torch and
# installed everywhere else as it is. Rebuilt when a source changes (ccache
# and ninja keep that incremental).
SOURCES     := $(shell find csrc cplib -name '*.c' -o -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.py') setup.py pyproject.toml
WHEEL_STAMP := dist/.cpu-wheel
WHEEL        = $(firstword $(wildcard dist/cplib-*-abi3-*.whl))
$(WHEEL_STAMP): $(DEPS) $(SOURCES)
	@mkdir -p dist && rm -rf dist/cplib-*.whl build/lib.*  # objects stay in build/temp.*
	@$(QUIET) $(LOGS)/wheel.log "building the cplib wheel (abi3, CPU, torch >= 2.11)" -- \
	  env CPLIB_CUDA=0 MAX_JOBS=$(NPROC) $(VPY) -m pip wheel --no-build-isolation --no-deps -w dist .
	@touch $@
wheel: $(WHEEL_STAMP)
	@ls dist/cplib-*-abi3-*.whl

# `make build`: that wheel installed into .venv (pip, no compiler). The
# tests, the demo and the benchmarks run against the installed package.
$(INSTALLED): $(WHEEL_STAMP)
	@rm -f $$($(VPY) -c "import site; print(site.getsitepackages()[0])")/cplib-src.pth
	@$(QUIET) $(LOGS)/install-wheel.log "installing $(notdir $(WHEEL)) into $(VENV)" -- \
	  $(VPY) -m pip install --no-deps --force-reinstall $(WHEEL)
	@touch $@
build: $(INSTALLED)

# `make develop`: the extension built in place (cplib/_C.abi3.so) and the
# source tree on .venv's path, for `python -m pytest` from the checkout.
develop: $(DEPS)
	@$(VPY) -c "import site, sys; open(site.getsitepackages()[0] + '/cplib-src.pth', 'w').write(sys.argv[1] + '\\n')" "$(CURDIR)"
	@$(QUIET) $(LOGS)/build.log "building cplib._C in place" -- $(VPY) setup.py build_ext --inplace

demo: build
	@echo "running the CP training demo on $(NPROC) CPU ranks"
	@cd examples && $(CURDIR)/$(VPY) -m torch.distributed.run --standalone --nproc-per-node $(NPROC) demo.py

# pytest's own script, not `python -m pytest`: the source tree must not
# shadow the installed package.
# TESTS picks the test files (CI gives the version-sensitive ones).
TESTS ?= tests
test: build
	$(VENV)/bin/pytest -q $(TESTS)

# The GPU tests' bodies on the CPU: CPLIB_GPU_TESTS_ON_CPU=1 swaps the device
# of the tests marked cuda_on_cpu (tests/<feature>/test_gpu_*.py), so their
# logic is proven without a GPU (CI runs this). The other cuda tests need a GPU.
test-gpu-on-cpu: build
	CPLIB_GPU_TESTS_ON_CPU=1 $(VENV)/bin/pytest -q -m cuda_on_cpu tests

# `make lint`: every linter, clean or it fails (CI runs it first). Python:
# the pinned ruff (requirements/lint.txt; rules in pyproject.toml's
# [tool.ruff]), installed into .venv on its own (no torch needed to lint);
# C/C++/CUDA: the pinned clang-format (lint-native below).
LINT_DEPS := $(VENV)/.lint-installed
$(LINT_DEPS): requirements/lint.txt | $(VPY)
	@$(QUIET) $(LOGS)/install-lint.log "installing the pinned linters into $(VENV)" -- \
	  $(VPY) -m pip install -r requirements/lint.txt
	@touch $@
lint-python: $(LINT_DEPS)
	$(VENV)/bin/ruff check --no-cache .
lint: lint-python lint-native

# The venv and pinned dependencies alone (CI prepares them while other
# stages run).
torch-venv:
	@test -x $(TVENV)/bin/python || $(PYTHON) -m venv $(TVENV)
	@$(QUIET) $(LOGS)/install-$(TORCH).log "installing $(TORCH_PIN) and the pinned dependencies into $(TVENV)" -- \
	  $(TPIP) install -r requirements/torch-$(TORCH).txt -r requirements-dev.txt

# The same wheel installed beside another torch; build_support/check_wheel.py
# fails unless the installed extension is byte for byte the wheel's.
test-torch: torch-venv $(WHEEL_STAMP)
	@$(QUIET) $(LOGS)/install-wheel-$(TORCH).log "installing $(notdir $(WHEEL)) beside $(TORCH_PIN)" -- \
	  $(TPIP) install --no-deps --force-reinstall $(WHEEL)
	@cd / && $(CURDIR)/$(TVENV)/bin/python $(CURDIR)/build_support/check_wheel.py $(CURDIR)/$(WHEEL)
	$(TVENV)/bin/pytest -q $(TESTS)

bench: build
	$(VPY) benchmarks/run_all.py

# `make lint-native`: the pinned clang-format (requirements/lint-native.txt;
# style in .clang-format) in check mode over csrc/: fails, naming each line,
# when a file is not formatted. `make format-native` formats them in place.
LINT_NATIVE_DEPS := $(VENV)/.lint-native-installed
NATIVE_SOURCES = $(sort $(shell find csrc -name '*.c' -o -name '*.h' -o -name '*.cpp' -o -name '*.cu' -o -name '*.cuh'))
$(LINT_NATIVE_DEPS): requirements/lint-native.txt | $(VPY)
	@$(QUIET) $(LOGS)/install-lint-native.log "installing the pinned clang-format into $(VENV)" -- \
	  $(VPY) -m pip install -r requirements/lint-native.txt
	@touch $@
lint-native: $(LINT_NATIVE_DEPS)
	@$(VENV)/bin/clang-format --dry-run --Werror $(NATIVE_SOURCES)
	@echo "clang-format: $(words $(NATIVE_SOURCES)) files under csrc/ formatted"
format-native: $(LINT_NATIVE_DEPS)
	$(VENV)/bin/clang-format -i $(NATIVE_SOURCES)

# Syntax/type check of every CUDA source with nvcc (no GPU needed).
cuda-check:
	@for f in csrc/cuda/*.cu; do \
	  echo "nvcc -c $$f (sm_90)"; \
	  nvcc -std=c++17 -arch=sm_90 -Icsrc/include -Xcompiler -Wall,-Wextra -c $$f -o /dev/null || exit 1; \
	done

# The whole extension built with CUDA against a CUDA build of torch, in its
# own venv and build folder (the CPU .venv and cplib/_C*.so are untouched).
# Compiling needs no GPU; CUDA_HOME defaults to /usr/local/cuda, and the
# headers torch's CUDA build pulls in (cuSPARSE, cuBLAS) come from its pip
# nvidia-* packages.
CUDA_VENV  := .venv-cuda
CUDA_TORCH ?= torch==2.14.1
# The wheel's GPUs (setup.py's CUDA_ARCHS, "8.0;9.0;10.0+PTX"): A100 (sm_80),
# H100/H200 (sm_90), B200 (sm_100), and PTX of the newest for later ones; nvcc
# 13.0 compiles for sm_75 to sm_121. `make cuda-arch-check` reads them back.
CUDA_ARCHS := $(shell sed -n 's/^CUDA_ARCHS = "\(.*\)"/\1/p' setup.py)
CUDA_ARCH_REQUIRE := --require 80,90,100 --ptx 100
# The CUDA wheel: the same kind of file (abi3, stable ABI, torch >= 2.11),
# with the CUDA kernels, for torch builds with CUDA 13. Built against torch
# 2.14.1's CUDA build in its own venv and build folder, into dist/cuda/.
cuda-wheel:
	@test -x $(CUDA_VENV)/bin/python || $(PYTHON) -m venv $(CUDA_VENV)
	@$(QUIET) $(LOGS)/install-cuda.log "installing $(CUDA_TORCH) into $(CUDA_VENV)" -- \
	  $(CUDA_VENV)/bin/pip install $(CUDA_TORCH) numpy==2.4.6 setuptools==84.2.1 ninja==1.13.2 wheel==0.45.1
	@mkdir -p dist/cuda && rm -rf dist/cuda/cplib-*.whl build/cuda/lib.*
	@NVINC=$$($(CUDA_VENV)/bin/python -c "import glob, os, sysconfig; print(':'.join(glob.glob(os.path.join(sysconfig.get_paths()['purelib'], 'nvidia', '*', 'include'))))"); \
	CPATH="$$NVINC$${CPATH:+:$$CPATH}" CUDA_HOME=$${CUDA_HOME:-/usr/local/cuda} CPLIB_CUDA=1 MAX_JOBS=$(NPROC) \
	  TORCH_CUDA_ARCH_LIST="$(CUDA_ARCHS)" \
	  CPLIB_BUILD_BASE=build/cuda $(QUIET) $(LOGS)/build-cuda.log "building the CUDA wheel" -- \
	  $(CUDA_VENV)/bin/python -m pip wheel --no-build-isolation --no-deps -w dist/cuda .
	@ls -l dist/cuda/cplib-*.whl
cuda-build: cuda-wheel

# The architectures in the built CUDA wheel (its .nv_fatbin), no GPU needed.
cuda-arch-check:
	@$(PYTHON) build_support/cuda_arch.py $(firstword $(wildcard dist/cuda/cplib-*-abi3-*.whl)) $(CUDA_ARCH_REQUIRE)

clean:
	rm -rf build dist cplib/_C*.so *.egg-info

# The GPU check (docs/gpu-check.md). Here: `make gpu-prep` builds the CUDA
# wheel and writes it with its commit into .gpu-prep/ (ignored; carried to the
# GPU machine). There: `bash benchmarks/gpu/run.sh` (what `make gpu-check`
# runs; a bare GPU image may have no make) installs that wheel beside the
# machine's torch (or builds in place when none is carried) and runs the CUDA
# tests, the GPU benchmark, compute-sanitizer and the CUDA demo, under 530 s,
# into $OUT (else benchmarks/out/gpu-check/). Uses the installed python3 and
# torch there (no venv, no network).
GPU_PREP := .gpu-prep
.PHONY: gpu-prep gpu-check cuda-arch-check
gpu-prep: cuda-wheel
	@$(PYTHON) build_support/gpu_prep.py write $(firstword $(wildcard dist/cuda/cplib-*-abi3-*.whl)) $(GPU_PREP)
gpu-check:
	bash benchmarks/gpu/run.sh
