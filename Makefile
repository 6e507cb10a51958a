# The two commands a newcomer needs: `make demo` and `make test` (both set up .venv on first use).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast setup lint approval-chat

setup: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -e '.[cpu,test,real-model]'
	$(PY) -m vllm_allowed_tools.devtools.cpu_setup
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/vllm-allowed-tools demo

# The approval chat (examples/approval_chat): the real model (serve-tiny --flavour real) with an
# approval policy, and a page at http://127.0.0.1:8765/ where a person answers the approvals (sign
# in with a printed API key).
approval-chat: $(STAMP)
	$(PY) examples/approval_chat/app.py

# Two workers (pytest-xdist): each test group (a module, or one server configuration of a
# parametrized module: tests/conftest.py) runs whole on one worker, so no server starts twice for
# it; WORKERS=0 runs serially.
WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -q -ra --durations=25 $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadscope) tests

# The tests that start no server (unit, property, in-process middleware): a few minutes.
test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -m "not server" $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadscope) tests
