# Every target installs what it needs into .venv first (idempotent: a stamp file skips the install when
# pyproject.toml and constraints.txt have not changed).
PYTHON ?= python3
VENV ?= .venv
CONSTRAINTS ?= constraints.txt
# where torch and torchvision come from, when set: e.g. PyTorch's CPU-only builds, without the 4 GB of CUDA libraries
# (make TORCH_INDEX=https://download.pytorch.org/whl/cpu install; docs/guide/development.md)
TORCH_INDEX ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.bnpfed-installed
DOCS_STAMP := $(VENV)/.bnpfed-docs-installed

.PHONY: install demo test bench docs clean

install: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH_INDEX),$(PY) -m pip install -q -c $(CONSTRAINTS) torch torchvision --index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[vision,test,flower,ot,laplace]'
	$(PY) -c "import torch, torchvision, pyro; print('installed torch', torch.__version__, 'torchvision', torchvision.__version__, 'pyro', pyro.__version__)"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/bnpfed demo
	$(VENV)/bin/bnpfed pfnm --partition dirichlet --rounds 3
	$(VENV)/bin/bnpfed fuse --rounds 3

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/run.py

# the docs site into site/, strictly: a warning (a broken link, a docstring griffe cannot parse, a missing page)
# fails the build. Its packages have their own stamp, so `make test` does not need them.
$(DOCS_STAMP): $(STAMP) pyproject.toml $(CONSTRAINTS)
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) build site *.egg-info
