"""Test-only: on this directory's PYTHONPATH, with ``VLITE_TEST_SLOW_LOAD_S`` set, every
``LLMEngine`` (in the API server's process or in the engine core process) sleeps that many
seconds before loading: a model load that a test can interrupt at leisure
(tests/server/test_serve_interrupt_load.py). Python imports ``sitecustomize`` at start-up."""

import os

if os.environ.get("VLITE_TEST_SLOW_LOAD_S"):
    import time

    from vlite.engine import llm_engine

    _init = llm_engine.LLMEngine.__init__

    def _slow_init(self, *args, **kwargs):
        time.sleep(float(os.environ["VLITE_TEST_SLOW_LOAD_S"]))
        _init(self, *args, **kwargs)

    llm_engine.LLMEngine.__init__ = _slow_init
