"""Llama-family decoder (Llama, SmolLM2, Qwen2, Mistral) over the paged KV cache.

Parameter names follow Hugging Face transformers except two fused projections, as in vLLM:
``qkv_proj`` (q, k, v stacked) and ``gate_up_proj`` (gate, up stacked); ``load_hf_state_dict``
maps HF checkpoints onto them. Numerics follow transformers' Llama (RMSNorm in float32, the
rotary embedding computed by transformers' own ``LlamaRotaryEmbedding``), so float32 greedy
outputs match token for token.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from vlite.engine.models.linear import Linear
from vlite.kernels.attention import AttentionMetadata, paged_attention, store_kvcache

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in float32 as transformers does."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, ``x * cos + rotate_half(x) * sin`` as transformers computes it.

    x: [T, H, D]; cos, sin_signed: [T, 1, D] with ``sin_signed = cat(-sin[:D/2], sin[D/2:])``,
    so ``rotate_half(x) * sin == roll(x, D/2) * sin_signed`` exactly (negating a factor is exact
    in IEEE arithmetic) and the negation is done once per step, not once per layer.
    """
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, head_dim: int, qkv_bias: bool) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.scale = head_dim ** -0.5
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        o_bias = bool(getattr(config, "attention_bias", False)) and qkv_bias
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=o_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """x [T, hidden]; cos, sin [T, 1, D] (sin with its first half negated, see ``apply_rotary``)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        # q and k heads side by side get their rotary in one pass: [T, Hq + Hkv, D]
        qk = apply_rotary(qkv[:, :self.q_size + self.kv_size].view(t, -1, self.head_dim), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; only 'silu' is")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        h = nn.functional.silu(gate).mul_(up)  # in place: one [T, intermediate] temporary, not two
        return self.down_proj(h)


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, head_dim: int, qkv_bias: bool) -> None:
        super().__init__()
        self.self_attn = Attention(config, head_dim, qkv_bias)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Decoder-only Llama-family model whose attention reads and writes the paged KV cache.

    Args:
        config: a transformers config of a supported architecture.
        max_model_len: longest position the rotary table covers, tokens.
        qkv_bias: whether q/k/v projections carry biases (Qwen2: yes).
    """

    def __init__(self, config: PretrainedConfig, max_model_len: int, qkv_bias: bool = False) -> None:
        super().__init__()
        self.config = config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, self.head_dim, qkv_bias)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope_type == "dynamic":
            raise ValueError("rope_type 'dynamic' is not supported (its table depends on the batch's length)")
        self.max_model_len = max_model_len
        self.init_rope_tables()

    def init_rope_tables(self) -> None:
        """cos/sin tables [max_model_len, head_dim] float32 from transformers' rotary embedding
        (so rope theta and rope scaling follow the config exactly). Call again after
        materializing a model built on the meta device."""
        with torch.device("cpu"):
            rotary = LlamaRotaryEmbedding(self.config)
            positions = torch.arange(self.max_model_len)[None, :]
            cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
        half = cos.shape[-1] // 2
        sin_signed = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)  # see apply_rotary
        self.register_buffer("cos_table", cos[0].float(), persistent=False)
        self.register_buffer("sin_table", sin_signed.float(), persistent=False)

    def prepack_cpu_gemm(self) -> None:
        """Prepack every linear layer's weight for oneDNN (see ``linear.py``); CPU only, after
        the weights are loaded. The tied lm_head keeps the embedding's plain weight."""
        for module in self.modules():
            if isinstance(module, Linear):
                tied = module is self.lm_head and self.lm_head.weight is self.embed_tokens.weight
                module.prepack_onednn(keep_weight=tied)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] int64. Returns final hidden states [T, hidden_size]."""
        x = self.embed_tokens(input_ids)
        cos = self.cos_table[positions].to(x.dtype)[:, None, :]  # [T, 1, D]
        sin = self.sin_table[positions].to(x.dtype)[:, None, :]
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] in float32."""
        return self.lm_head(hidden).float()

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy a transformers checkpoint's tensors into this module, fusing q/k/v and gate/up.

        Raises:
            ValueError: a tensor is missing or has the wrong shape.
        """
        sd = {k.removeprefix("model."): v for k, v in state_dict.items()}
        fused: dict[str, torch.Tensor] = {}
        for i in range(self.num_layers):
            p = f"layers.{i}."
            for suffix in ("weight", "bias"):
                names = [f"{p}self_attn.{n}_proj.{suffix}" for n in "qkv"]
                if all(n in sd for n in names):
                    fused[f"{p}self_attn.qkv_proj.{suffix}"] = torch.cat([sd.pop(n) for n in names])
            gate, up = f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"
            if gate in sd and up in sd:
                fused[f"{p}mlp.gate_up_proj.weight"] = torch.cat([sd.pop(gate), sd.pop(up)])
        sd.update(fused)
        if "lm_head.weight" not in sd and self.tie_word_embeddings:
            sd["lm_head.weight"] = sd.get("embed_tokens.weight")
        own = self.state_dict()
        missing = [k for k in own if k not in sd or sd[k] is None]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
        with torch.no_grad():
            for name, param in own.items():
                src = sd[name]
                if tuple(src.shape) != tuple(param.shape):
                    raise ValueError(f"tensor {name}: checkpoint shape {tuple(src.shape)}, "
                                     f"model expects {tuple(param.shape)}")
                param.copy_(src.to(param.dtype))
