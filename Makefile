# Two commands do everything on a fresh machine with Python >= 3.11:
#   make serve   install, then run the gateway in front of 4 local reference workers
#   make test    install what the tests need (redis-server too), lint, type-check, run the suite
# The interpreter the virtual environment is built from (make ... PYTHON=/path/to/python3.12
# picks another). By default the distribution's own /usr/bin/python3 when it is 3.11 or newer
# and can build a venv: distributions build CPython with optimizations (profile-guided, LTO, a
# static interpreter) as the python:3.11-slim image of the Dockerfile does, which version
# managers such as pyenv leave out unless asked, and the gateway spends 10-20% more CPU per
# request on such a build (BENCHMARKS.md, "the interpreter's build"). Otherwise python3 from
# PATH.
SYSTEM_PYTHON ?= /usr/bin/python3
ifeq ($(origin PYTHON),undefined)
PYTHON := $(shell $(SYSTEM_PYTHON) -c 'import sys, ensurepip; ensurepip.version(); \
  sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1 && echo $(SYSTEM_PYTHON) || echo python3)
endif
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: serve test lint typecheck redis browser clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python >= 3.11 is required")'
	@echo "building $(VENV) from $(PYTHON) ($$($(PYTHON) -c 'import sys; print(sys.version.split()[0])'))"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet torch==2.13.0 || echo "torch unavailable: torch tests will skip"
	touch $(STAMP)

# make serve PORT=9000 WORKERS=2 CONFIG=gateway.toml: the gateway on PORT, workers from PORT+1.
PORT    ?= 8000
WORKERS ?= 4
CONFIG  ?=

serve: $(STAMP)
	$(PY) -m infra local serve --workers $(WORKERS) --port $(PORT) \
	  --worker-base-port $(shell expr $(PORT) + 1) $(if $(CONFIG),--gateway-config $(CONFIG))

redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing redis-server (Debian package)"; \
	    DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	  else echo "redis-server missing and not root: Redis tests will be skipped"; fi; }

# Headless Chromium and its driver for the status page's browser test (Debian packages).
browser:
	@{ command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; } || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing chromium and chromium-driver (Debian packages)"; \
	    DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	  else echo "chromium missing and not root: the browser test will be skipped"; fi; }

lint: $(STAMP)
	$(VENV)/bin/ruff check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

test: $(STAMP) redis browser lint typecheck
	$(VENV)/bin/pytest -q

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
