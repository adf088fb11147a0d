"""vLLM's general-plugin entry point (group ``vllm.general_plugins``): vLLM calls ``register()``
in its API server, engine core and worker processes."""

from vlite_probe import start


def register() -> None:
    """Start the probe in this vLLM process when ``VLITE_PROBE=1`` (else nothing)."""
    start()
