"""The memory roofline of an offline throughput run: the fastest a GPU could finish it, from the
bytes and FLOPs the run cannot avoid.

Counted for a Llama-family decoder (``ModelShape``):
  * a decode step reads every weight once (``weight_bytes``: each parameter once, a tied
    lm_head with the embedding counted once) and every cached token's K and V in every layer
    (``kv_bytes_per_token`` = 2 x layers x KV heads x head_dim x dtype bytes); its time is those
    bytes over the measured copy bandwidth;
  * a prefill is bounded by matrix FLOPs (``prefill_flops``: 2 FLOPs per weight per token in the
    decoder's linear layers, the lm_head only for each sequence's last token, and 4 x heads x
    head_dim per (query, key) pair of causal attention) over the measured matrix FLOP/s.

``roofline`` runs the workload in waves of ``max_num_seqs`` sequences: each wave prefills its
prompts, then decodes ``output_len - 1`` steps (the prefill samples the first token), step j
attending ``input_len + j`` tokens per sequence. Everything else (the norms' arithmetic, the
sampler, launches) is left out: the bound is what no implementation can beat, not an estimate.

Shapes in the docs: the GPU check's target is the 1.07B Llama-3.2-1B shape (``LLAMA_3_2_1B``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """A Llama-family decoder's sizes. dtype_bytes: bytes per weight and per KV element."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    dtype_bytes: int = 2

    @classmethod
    def from_config(cls, config, dtype: str = "bfloat16") -> ModelShape:
        """From a transformers config (LlamaConfig and its relatives).

        Raises:
            ValueError: a dtype other than float32, bfloat16 or float16.
        """
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
        kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.hidden_size, config.num_hidden_layers, config.num_attention_heads, kv, head_dim,
                   config.intermediate_size, config.vocab_size, bool(getattr(config, "tie_word_embeddings", False)),
                   DTYPE_BYTES[dtype])

    def layer_linear_params(self) -> int:
        """Weights of one layer's q, k, v, o, gate, up and down projections (no biases)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.hidden_size * (q + 2 * kv) + q * self.hidden_size + 3 * self.hidden_size * self.intermediate_size

    def num_params(self) -> int:
        """All parameters, a tied embedding/lm_head counted once (what ``model.parameters()`` holds)."""
        embed = self.vocab_size * self.hidden_size
        norms = (2 * self.num_layers + 1) * self.hidden_size
        return self.num_layers * self.layer_linear_params() + norms + embed * (1 if self.tie_word_embeddings else 2)

    def weight_bytes(self) -> int:
        """Bytes of weights a decode step reads: every parameter once (an untied embedding is
        counted whole too, an upper bound of the few rows a step looks up)."""
        return self.num_params() * self.dtype_bytes

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one cached token holds across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def prefill_flops(self, num_seqs: int, prompt_len: int) -> int:
        """Matrix FLOPs to prefill ``num_seqs`` prompts of ``prompt_len`` tokens from scratch."""
        tokens = num_seqs * prompt_len
        linear = 2 * tokens * self.num_layers * self.layer_linear_params()
        lm_head = 2 * num_seqs * self.hidden_size * self.vocab_size  # logits of the last token only
        pairs = num_seqs * prompt_len * (prompt_len + 1) // 2  # causal (query, key) pairs
        attention = 4 * pairs * self.num_heads * self.head_dim * self.num_layers  # QK^T and PV
        return linear + lm_head + attention


LLAMA_3_2_1B = ModelShape(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                          intermediate_size=8192, vocab_size=49152, tie_word_embeddings=True, dtype_bytes=2)


@dataclass
class Roofline:
    """The bound of one workload. Times in seconds; ``output_tokens_per_s`` is the ceiling."""

    weight_bytes: int
    kv_bytes_per_token: int
    decode_bytes: int
    prefill_flops: int
    decode_s: float
    prefill_s: float
    output_tokens: int
    bandwidth_bytes_per_s: float
    matmul_flops_per_s: float

    @property
    def total_s(self) -> float:
        return self.decode_s + self.prefill_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.total_s

    def fraction(self, measured_output_tokens_per_s: float) -> float:
        """How much of the ceiling a measured run reached (0..1)."""
        return measured_output_tokens_per_s / self.output_tokens_per_s

    def as_dict(self) -> dict:
        return dict(asdict(self), total_s=self.total_s, output_tokens_per_s=self.output_tokens_per_s)


def roofline(shape: ModelShape, num_prompts: int, input_len: int, output_len: int, max_num_seqs: int,
             bandwidth_bytes_per_s: float, matmul_flops_per_s: float) -> Roofline:
    """The bound of ``num_prompts`` requests of ``input_len`` prompt and ``output_len`` output
    tokens, ``max_num_seqs`` at a time (see the module docstring).

    Args:
        bandwidth_bytes_per_s: measured device memory bandwidth (bytes/s, e.g. a copy's
            read + write bytes over its time).
        matmul_flops_per_s: measured matrix throughput (FLOP/s, e.g. a large bf16 matmul).

    Raises:
        ValueError: a count below 1 or a non-positive rate.
    """
    if min(num_prompts, input_len, output_len, max_num_seqs) < 1:
        raise ValueError("num_prompts, input_len, output_len and max_num_seqs must each be at least 1")
    if bandwidth_bytes_per_s <= 0 or matmul_flops_per_s <= 0:
        raise ValueError("bandwidth and matmul FLOP/s must be positive")
    weights, per_token = shape.weight_bytes(), shape.kv_bytes_per_token()
    decode_bytes = flops = 0
    for start in range(0, num_prompts, max_num_seqs):
        batch = min(max_num_seqs, num_prompts - start)
        flops += shape.prefill_flops(batch, input_len)
        for j in range(1, output_len):  # step j: the batch's j-th new token, over input_len + j tokens each
            decode_bytes += weights + per_token * batch * (input_len + j)
    return Roofline(weights, per_token, decode_bytes, flops, decode_bytes / bandwidth_bytes_per_s,
                    flops / matmul_flops_per_s, num_prompts * output_len, bandwidth_bytes_per_s, matmul_flops_per_s)


__all__ = ["DTYPE_BYTES", "LLAMA_3_2_1B", "ModelShape", "Roofline", "roofline"]
