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
	$(VPY) -m pip install -q -r requirements-dev.txt
	touch $@

# A .pth entry is what an editable install amounts to, without pip building
# the extension a second time; `pip install --no-build-isolation -e .` works too.
$(EDIT): $(DEPS)
	$(VPY) -c "import site, sys; open(site.getsitepackages()[0] + '/cplib-src.pth', 'w').write(sys.argv[1] + '\\n')" "$(CURDIR)"
	touch $@

# Incremental native build (ninja) into cplib/_C*.so.
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
