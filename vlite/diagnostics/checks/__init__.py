"""What the leak checker concludes from a run: the engine's state at quiescence (``snapshot``),
the drain invariant, trend and attribution (``detect``), per-request registries, zombies,
coverage, evidence for leaked blocks and the host-memory verdict."""
