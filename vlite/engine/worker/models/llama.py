"""Llama-family decoder (Llama, SmolLM2, Qwen2, Mistral) over the paged KV cache.

Parameter names follow Hugging Face transformers except two fused projections, as in vLLM:
``qkv_proj`` (q, k, v stacked) and ``gate_up_proj`` (gate, up stacked); ``load_hf_state_dict``
maps HF checkpoints onto them. With tensor parallelism (``tp``, see ``parallel_layers.py``) each
rank builds only its own heads, its slice of the intermediate size and of the vocabulary, and
``load_weights`` reads only those slices of the checkpoint. Numerics follow transformers' Llama (RMSNorm in float32, the
rotary embedding computed by transformers' own ``LlamaRotaryEmbedding``), so float32 greedy
outputs match token for token.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from vlite.engine.worker.models.cpu_layer_loop import CpuLayerLoop
from vlite.engine.worker.models.linear import Linear
from vlite.engine.worker.models.parallel_layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    check_tp_size,
    partition_heads,
)
from vlite.kernels.attention import AttentionMetadata, paged_attention
from vlite.kernels.fused_ops import CppOps, TorchOps, ops_for

FusedOps = TorchOps | CppOps


def rope_tables(config: PretrainedConfig, max_model_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin tables [max_model_len, head_dim] float32 from transformers' own rotary
    embedding (so rope theta and rope scaling follow the config exactly); sin has its first half
    negated (see ``fused_ops.rotate``)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # heavy: only here

    with torch.device("cpu"):
        rotary = LlamaRotaryEmbedding(config)
        positions = torch.arange(max_model_len)[None, :]
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    half = cos.shape[-1] // 2
    sin_signed = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
    return cos[0].float().contiguous(), sin_signed.float().contiguous()


class RMSNorm(nn.Module):
    """The parameters of a root-mean-square norm (Zhang & Sennrich 2019): ``weight`` [hidden] and
    ``eps``. The decoder applies it through its step's ops (``fused_ops``: ``rms_norm`` or
    ``fused_add_rms_norm``, float32 inside as transformers computes it)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps


class Attention(nn.Module):
    """Self-attention over this rank's heads (all heads when tp.size is 1)."""

    def __init__(self, config: PretrainedConfig, head_dim: int, qkv_bias: bool, tp: TPGroup) -> None:
        super().__init__()
        total_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.heads = partition_heads(config.num_attention_heads, total_kv, tp)
        self.num_heads = self.heads.num_q
        self.num_kv_heads = self.heads.num_kv
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.scale = head_dim ** -0.5
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        o_bias = bool(getattr(config, "attention_bias", False)) and qkv_bias
        self.o_proj = RowParallelLinear(self.q_size, config.hidden_size, o_bias, tp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, ops: FusedOps) -> torch.Tensor:
        """x [T, hidden]; cos, sin [T, D] in x's dtype (sin with its first half negated, see
        ``fused_ops.rotate``)."""
        k_cache, v_cache = kv_cache
        q, k, v = ops.rotary_store(self.qkv_proj(x), cos, sin, meta.slot_mapping, k_cache, v_cache,
                                   self.num_heads, self.num_kv_heads)
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(o.reshape(x.shape[0], self.q_size))


class MLP(nn.Module):
    """SwiGLU MLP over this rank's slice of the intermediate size."""

    def __init__(self, config: PretrainedConfig, tp: TPGroup) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size // tp.size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = RowParallelLinear(self.intermediate_size, config.hidden_size, False, tp)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; only 'silu' is")

    def forward(self, x: torch.Tensor, ops: FusedOps) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, head_dim: int, qkv_bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.self_attn = Attention(config, head_dim, qkv_bias, tp)
        self.mlp = MLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                ops: FusedOps) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream as vLLM carries it: x is the previous layer's MLP output and
        ``residual`` the sum before it (None in the first layer, where x is the embedding); the
        add and the norm are one fused op. Returns (MLP output, residual), both [T, hidden]."""
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            residual, x = x, ops.rms_norm(x, norm1.weight, norm1.eps)
        else:
            ops.fused_add_rms_norm(x, residual, norm1.weight, norm1.eps)
        x = self.self_attn(x, cos, sin, kv_cache, meta, ops)
        ops.fused_add_rms_norm(x, residual, norm2.weight, norm2.eps)
        return self.mlp(x, ops), residual


class LlamaForCausalLM(nn.Module):
    """Decoder-only Llama-family model whose attention reads and writes the paged KV cache.

    Args:
        config: a transformers config of a supported architecture.
        max_model_len: longest position the rotary table covers, tokens.
        qkv_bias: whether q/k/v projections carry biases (Qwen2: yes).
        tp: this rank's place in the tensor-parallel group (default: one rank, the whole model).
        rope: ``rope_tables(config, max_model_len)`` computed elsewhere (saves a worker the
            import of transformers' modeling code, about 200 MB per process).

    ``num_kv_heads`` is this rank's KV head count (what its KV cache holds).

    Raises:
        ValueError: ``tp.size`` cannot split the model's heads or intermediate size (one line,
            listing the sizes that can).
    """

    def __init__(self, config: PretrainedConfig, max_model_len: int, qkv_bias: bool = False,
                 tp: TPGroup | None = None, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.config = config
        self._rope = rope  # precomputed ``rope_tables`` (a worker gets them from the engine)
        self.tp = tp = tp or TPGroup()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        total_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        check_tp_size(tp.size, config.num_attention_heads, total_kv, config.intermediate_size)
        self.num_kv_heads = partition_heads(config.num_attention_heads, total_kv, tp).num_kv
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, self.head_dim, qkv_bias, tp)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tp)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope_type == "dynamic":
            raise ValueError("rope_type 'dynamic' is not supported (its table depends on the batch's length)")
        self.max_model_len = max_model_len
        self.init_rope_tables()
        # the decoder layers as one C++ call per step (cpu_layer_loop.py); the model runner sets
        # it once the weights are packed and the KV cache exists, else every step runs the Python loop
        self.cpu_layer_loop: CpuLayerLoop | None = None

    def init_rope_tables(self) -> None:
        """Register the cos/sin tables (``rope_tables``) as float32 buffers. Call again after
        materializing a model built on the meta device."""
        cos, sin_signed = self._rope if self._rope is not None else rope_tables(self.config, self.max_model_len)
        self.register_buffer("cos_table", cos.float(), persistent=False)
        self.register_buffer("sin_table", sin_signed.float(), persistent=False)

    def prepack_cpu_gemm(self, backend: str = "onednn") -> None:
        """Pack every linear layer's weight for ``backend`` ("onednn" or "vlite", see
        ``linear.py``); CPU only, after the weights are loaded. The tied lm_head keeps the
        embedding's plain weight."""
        for module in self.modules():
            if isinstance(module, Linear):
                tied = module is self.lm_head and self.lm_head.weight is self.embed_tokens.weight
                module.prepack(backend, keep_weight=tied)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] int64. Returns final hidden states [T, hidden_size]."""
        x = self.embed_tokens(input_ids)
        cos = self.cos_table[positions].to(x.dtype)  # [T, D]
        sin = self.sin_table[positions].to(x.dtype)
        if self.cpu_layer_loop is not None:
            hidden = self.cpu_layer_loop.forward(x, cos, sin, kv_caches, meta)
            if hidden is not None:
                return hidden
        ops = ops_for(x, self.config.hidden_size, self.head_dim, self.layers[0].mlp.intermediate_size)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, cos, sin, kv_cache, meta, ops)
        ops.fused_add_rms_norm(x, residual, self.norm.weight, self.norm.eps)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, hidden_size] -> logits [N, vocab_size] in float32 (on rank 0 under tensor
        parallelism, gathered from every rank's vocabulary slice; None on the other ranks)."""
        return self.lm_head.logits(hidden)

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy a transformers checkpoint's tensors (HF names) into this module (this rank's slices).

        Raises:
            ValueError: a tensor is missing or has the wrong shape.
        """
        from vlite.engine.worker.loader import WeightSource

        self.load_weights(WeightSource.from_state_dict(state_dict))

    def _pieces(self, name: str) -> list[tuple[str, int, int, int]] | None:
        """How this rank's parameter ``name`` is made from HF tensors: (hf_name, dim, start, stop)
        slices concatenated along dim 0 (q/k/v and gate/up are fused here). None: tied, skip."""
        tp = self.tp
        if name in ("embed_tokens.weight", "lm_head.weight"):
            if name == "lm_head.weight" and self.tie_word_embeddings:
                return None
            layer = self.embed_tokens if name == "embed_tokens.weight" else self.lm_head
            return [(name, 0, layer.vocab_start, layer.vocab_end)]
        parts = name.split(".")
        if parts[0] != "layers" or parts[2] not in ("self_attn", "mlp"):
            return [(name, 0, 0, -1)]  # norms: replicated
        prefix, proj, suffix = ".".join(parts[:3]), parts[3], parts[4]
        attn = self.layers[int(parts[1])].self_attn
        d = self.head_dim
        if proj == "qkv_proj":
            h = attn.heads
            return [(f"{prefix}.q_proj.{suffix}", 0, h.q_start * d, (h.q_start + h.num_q) * d),
                    (f"{prefix}.k_proj.{suffix}", 0, h.kv_start * d, (h.kv_start + h.num_kv) * d),
                    (f"{prefix}.v_proj.{suffix}", 0, h.kv_start * d, (h.kv_start + h.num_kv) * d)]
        if proj == "gate_up_proj":
            i = self.config.intermediate_size // tp.size
            return [(f"{prefix}.gate_proj.{suffix}", 0, tp.rank * i, (tp.rank + 1) * i),
                    (f"{prefix}.up_proj.{suffix}", 0, tp.rank * i, (tp.rank + 1) * i)]
        if proj == "o_proj" and suffix == "weight":
            return [(f"{prefix}.o_proj.weight", 1, attn.heads.q_start * d, (attn.heads.q_start + attn.heads.num_q) * d)]
        if proj == "down_proj" and suffix == "weight":
            i = self.config.intermediate_size // tp.size
            return [(f"{prefix}.down_proj.weight", 1, tp.rank * i, (tp.rank + 1) * i)]
        return [(name, 0, 0, -1)]  # row-parallel biases: whole, on rank 0

    def load_weights(self, source) -> None:
        """Fill every parameter from ``source`` (a ``vlite.engine.worker.loader.WeightSource`` with HF
        names), reading only this rank's slices; vocabulary shards past the end stay zero (padding).

        Raises:
            ValueError: a tensor is missing or has the wrong shape.
        """
        own = self.state_dict()
        plans = {name: self._pieces(name) for name in own}
        missing = sorted({hf for plan in plans.values() if plan for hf, *_ in plan if hf not in source})
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
        with torch.no_grad():
            for name, param in own.items():
                plan = plans[name]
                if plan is None:
                    continue
                src = torch.cat([source.read(hf, dim, start, stop) for hf, dim, start, stop in plan])
                if src.shape[0] < param.shape[0] and name in ("embed_tokens.weight", "lm_head.weight"):
                    param.zero_()
                    param[:src.shape[0]].copy_(src.to(param.dtype))
                    continue
                if tuple(src.shape) != tuple(param.shape):
                    raise ValueError(f"tensor {name}: checkpoint shape {tuple(src.shape)}, "
                                     f"model expects {tuple(param.shape)}")
                param.copy_(src.to(param.dtype))
