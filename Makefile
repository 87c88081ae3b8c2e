# Set-up and the two README commands. Idempotent: each step leaves a stamp in .stamps/ and runs again
# only when the files it depends on change.
#   make serve   set everything up in .venv/ and serve the bundled model on 127.0.0.1:8000
#   make test    set everything up in .venv/ and run the test suite
#   make typecheck  the static type check CI runs first
PYTHON ?= python3
VENV := .venv
STAMPS := .stamps
BIN := $(VENV)/bin
SERVE_ARGS ?=
PYTEST_ARGS ?=
OP_SOURCES := $(wildcard ops_ext/*.cc ops_ext/*.h ops_ext/*.inc ops_ext/*.cu)

.PHONY: serve test typecheck install system clean
.DELETE_ON_ERROR:

serve: install
	$(BIN)/mtpserve serve $(SERVE_ARGS)

# pytest exits 5 when it collected no tests: that is a broken suite, not a pass.
test: install $(STAMPS)/test-deps
	@$(BIN)/python -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing on purpose" >&2; exit 1; fi; \
	exit $$rc

# Static types: basedpyright over the package as setup.py assembles it (scripts/typecheck.py says how).
typecheck: install $(STAMPS)/test-deps
	$(BIN)/python scripts/typecheck.py

install: $(STAMPS)/install

$(STAMPS)/system: scripts/system-packages.sh
	@mkdir -p $(STAMPS)
	sh scripts/system-packages.sh
	@touch $@

$(STAMPS)/venv: requirements.txt $(STAMPS)/system
	@mkdir -p $(STAMPS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	$(BIN)/python -m pip install -q -r requirements.txt
	@touch $@

$(STAMPS)/test-deps: requirements-test.txt $(STAMPS)/venv
	$(BIN)/python -m pip install -q -r requirements-test.txt
	@touch $@

# Builds ops_ext/ into daemon/_ops_pd_.so (paddle.utils.cpp_extension needs Paddle installed first).
$(STAMPS)/install: $(STAMPS)/venv setup.py pyproject.toml $(OP_SOURCES)
	$(BIN)/python -m pip install -q --no-build-isolation -e .
	@touch $@

clean:
	rm -rf $(STAMPS) build *.egg-info daemon/_ops*.so
