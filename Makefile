# cplib developer entry points. Every target creates .venv and installs the
# pinned dependencies first, so each works on a fresh machine.
PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
DEPS   := $(VENV)/.deps-installed
EDIT   := $(VENV)/.cplib-editable
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

.PHONY: all build demo test test-torch torch-venv bench cuda-check cuda-build clean

all: build

$(VPY):
	@echo "creating $(VENV)"
	@$(PYTHON) -m venv $(VENV)

$(DEPS): requirements-dev.txt requirements/torch-default.txt | $(VPY)
	@$(QUIET) $(LOGS)/install.log "installing the pinned dependencies into $(VENV)" -- \
	  $(VPY) -m pip install -r requirements/torch-default.txt -r requirements-dev.txt
	@touch $@

# A .pth entry is what an editable install amounts to, without pip building
# the extension a second time; `pip install --no-build-isolation -e .` works too.
$(EDIT): $(DEPS)
	@$(VPY) -c "import site, sys; open(site.getsitepackages()[0] + '/cplib-src.pth', 'w').write(sys.argv[1] + '\\n')" "$(CURDIR)"
	@touch $@

# Incremental native build (ninja) into cplib/_C*.so.
build: $(EDIT)
	@$(QUIET) $(LOGS)/build.log "building cplib._C" -- $(VPY) setup.py build_ext --inplace

demo: build
	@echo "running the CP training demo on $(NPROC) CPU ranks"
	@$(VPY) -m torch.distributed.run --standalone --nproc-per-node $(NPROC) examples/demo.py

test: build
	$(VPY) -m pytest -q tests

# pytest's own script, not `python -m pytest`: the source tree must not
# shadow the installed package.
# TESTS picks the test files (CI gives the version-sensitive ones).
TESTS ?= tests
# The venv and pinned dependencies alone (CI prepares them while other
# stages run).
torch-venv:
	@test -x $(TVENV)/bin/python || $(PYTHON) -m venv $(TVENV)
	@$(QUIET) $(LOGS)/install-$(TORCH).log "installing $(TORCH_PIN) and the pinned dependencies into $(TVENV)" -- \
	  $(TPIP) install -r requirements/torch-$(TORCH).txt -r requirements-dev.txt

test-torch: torch-venv
	@$(QUIET) $(LOGS)/build-$(TORCH).log "building and installing cplib beside $(TORCH_PIN)" -- \
	  env CPLIB_CUDA=0 MAX_JOBS=$(NPROC) $(TPIP) install -v --no-build-isolation --no-deps .
	@cd / && $(CURDIR)/$(TVENV)/bin/python -c "import torch, cplib; print('cplib', cplib.__version__, 'from', cplib.__file__, 'on torch', torch.__version__)"
	$(TVENV)/bin/pytest -q $(TESTS)

bench: build
	$(VPY) benchmarks/run_all.py

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
cuda-build:
	@test -x $(CUDA_VENV)/bin/python || $(PYTHON) -m venv $(CUDA_VENV)
	@$(QUIET) $(LOGS)/install-cuda.log "installing $(CUDA_TORCH) into $(CUDA_VENV)" -- \
	  $(CUDA_VENV)/bin/pip install $(CUDA_TORCH) numpy==2.4.6 setuptools==84.2.1 ninja==1.13.2 wheel==0.45.1
	@NVINC=$$($(CUDA_VENV)/bin/python -c "import glob, os, sysconfig; print(':'.join(glob.glob(os.path.join(sysconfig.get_paths()['purelib'], 'nvidia', '*', 'include'))))"); \
	CPATH="$$NVINC$${CPATH:+:$$CPATH}" CUDA_HOME=$${CUDA_HOME:-/usr/local/cuda} CPLIB_CUDA=1 MAX_JOBS=$(NPROC) \
	  $(QUIET) $(LOGS)/build-cuda.log "building cplib._C with CUDA" -- \
	  $(CUDA_VENV)/bin/python setup.py build_ext --build-lib build/cuda/lib --build-temp build/cuda/tmp
	@ls -l build/cuda/lib/cplib/_C*.so

clean:
	rm -rf build cplib/_C*.so *.egg-info

# The GPU check on a GPU machine: build with the system compiler,
# the whole suite, the CUDA demo, the GPU benchmark and compute-sanitizer, in
# one output folder ($OUT, else benchmarks/out/gpu-check/). Uses the
# installed python3 and torch (no venv, no network).
.PHONY: gpu-check
gpu-check:
	benchmarks/gpu/run.sh
