# The two commands: `make demo` and `make test`. Both set everything up first on a fresh
# Debian machine with Python 3.11: a .venv at the repo root, the package with its dev
# extras, torch 2.13.0 (CPU build) and Debian's etcd-server when `etcd` is not on PATH.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup etcd test demo bench clean

setup: $(STAMP) etcd

$(STAMP): pyproject.toml setup.py kernels/stream_copy.c kernels/qcodec.c
	@$(PYTHON) -m venv --help >/dev/null 2>&1 && $(PYTHON) -c 'import ensurepip' 2>/dev/null || \
	  { echo "installing python3-venv"; $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq python3-venv python3-pip; }
	@[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: the CPU build (an open range pulls a multi-GB CUDA build).
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	@touch $(STAMP)

etcd:
	@command -v etcd >/dev/null 2>&1 || { echo "installing Debian's etcd-server"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq etcd-server; }
	@command -v etcd >/dev/null 2>&1 || { echo "etcd is still not on PATH; install etcd >= 3.4" >&2; exit 1; }

# pytest exits 5 when it collects no test, so an empty run fails here too. Three phases
# (tests/conftest.py marks the files): two workers, a test file staying on one worker; then
# the tests that assert machine-wide state (`serial`) one at a time on one worker, while the
# other runs the CPU-only `sidecar` files (type check, compilers); then alone the `alone`
# file, whose outcome shifts under a second worker's load. Each phase lists its 25 slowest
# tests: CI's bound is 20 minutes, and that list says where the time goes.
test: setup
	$(PY) -m pytest -n 2 --dist loadfile -m "not serial and not sidecar and not alone" --durations=25
	$(PY) -m pytest -n 2 --dist loadgroup -m "serial or sidecar" --durations=25
	$(PY) -m pytest -m alone --durations=25

demo: setup
	$(PY) examples/demo.py

bench: setup
	$(PY) bench/planner.py --members 100000
	$(PY) bench/control_plane.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
