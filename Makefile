# Two commands on a fresh clone (each sets up whatever is missing first):
#   make serve    the OpenAI-compatible server on the bundled model (ARGS="--model X" for another)
#   make test     the whole test suite: unit, parity with transformers, server, every notebook
# The virtual environment is made once, in .venv, with the CPU build of torch installed
# first: a bare `torch` requirement could pull a multi-GB CUDA build. On a CUDA machine,
# install the CUDA build of your choice into .venv before `make`.

VENV ?= .venv
PYTHON ?= python3
TORCH ?= torch==2.13.0
ARGS ?=
STAMP := $(VENV)/.installed

.PHONY: setup serve test

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -c "import torch" 2>/dev/null || \
		$(VENV)/bin/python -m pip install --quiet "$(TORCH)"
	$(VENV)/bin/python -m pip install --quiet -e ".[dev]"
	touch $@

serve: $(STAMP)
	$(VENV)/bin/python -m minivllm.serve $(ARGS)

test: $(STAMP)
	$(VENV)/bin/pytest --nbval-lax
