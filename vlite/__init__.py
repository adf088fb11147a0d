"""vlite: a readable paged-KV-cache inference engine that diagnoses KV-cache leaks."""

__version__ = "0.1.0"
