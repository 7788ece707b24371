"""ModelSpec: what the model runner needs to know of an architecture, read off a HF config."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ModelError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: its attention window (0 = full attention) and RoPE kind."""

    window: int
    rope_key: str  # key into ModelSpec.rope_params ("default", or a layer type such as "sliding_attention")


@dataclass(frozen=True)
class ModelSpec:
    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_eps: float
    activation: str  # "silu" | "gelu_tanh"
    gemma_norms: bool  # (1 + w) RMSNorm, sandwich norms around attention and MLP, scaled embeddings
    qk_norm: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    attn_scale: float
    embed_scale: float | None
    final_logit_softcap: float | None
    attn_logit_softcap: float | None
    tie_embeddings: bool
    max_position: int
    layers: tuple[LayerSpec, ...]
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, kv_dtype: str, full_layers_only: bool = False) -> int:
        """2 x layers x kv_heads x a row's bytes: head_dim elements of kv_dtype, and for int8 the
        row's float32 scale (sliding layers counted unless asked not to)."""
        layers = sum(1 for layer in self.layers if not (full_layers_only and layer.window))
        row = self.head_dim * KV_ELEMENT_BYTES[kv_dtype] + (4 if kv_dtype == "int8" else 0)
        return 2 * layers * self.num_kv_heads * row

    def tensor_names(self) -> tuple[str, ...]:
        """The model's tensors under their transformers names (its state dict's keys): what a
        GGUF file's tensors are mapped to and checked against, without building a transformers
        model (whose import alone loads torch's compiler stack and Triton)."""
        names = ["model.embed_tokens.weight"]
        norms = ("input_layernorm", "pre_feedforward_layernorm", "post_attention_layernorm",
                 "post_feedforward_layernorm") if self.gemma_norms else ("input_layernorm", "post_attention_layernorm")
        for i in range(self.num_layers):
            attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            for proj in ("q_proj", "k_proj", "v_proj"):
                names += [attn + proj + ".weight"] + ([attn + proj + ".bias"] if self.qkv_bias else [])
            names += [attn + "o_proj.weight"] + ([attn + "o_proj.bias"] if self.o_bias else [])
            if self.qk_norm:
                names += [attn + "q_norm.weight", attn + "k_norm.weight"]
            for proj in ("gate_proj", "up_proj", "down_proj"):
                names += [mlp + proj + ".weight"] + ([mlp + proj + ".bias"] if self.mlp_bias else [])
            names += [f"model.layers.{i}.{norm}.weight" for norm in norms]
        return tuple(names + ["model.norm.weight", "lm_head.weight"])


KV_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1}


def spec_from_config(config) -> ModelSpec:
    """Read a transformers PretrainedConfig into a ModelSpec, or raise ModelError."""
    arch = getattr(config, "model_type", None)
    if arch == "gemma3":  # a multimodal Gemma 3 config: kvpage runs its text model
        config = config.get_text_config()
        arch = config.model_type
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"unsupported model architecture {arch!r}; kvpage supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    num_layers = config.num_hidden_layers
    gemma = arch == "gemma3_text"

    layer_types = getattr(config, "layer_types", None)
    sliding_window = getattr(config, "sliding_window", None) or 0
    layers = []
    for i in range(num_layers):
        if arch == "mistral":
            window = sliding_window
        elif layer_types is not None:
            window = sliding_window if layer_types[i] == "sliding_attention" else 0
        else:
            window = 0
        rope_key = layer_types[i] if gemma else "default"
        layers.append(LayerSpec(window=int(window), rope_key=rope_key))

    if gemma:
        activation = "gelu_tanh"
        attn_scale = config.query_pre_attn_scalar**-0.5
        embed_scale = config.hidden_size**0.5
        final_softcap = getattr(config, "final_logit_softcapping", None)
        attn_softcap = getattr(config, "attn_logit_softcapping", None)
    else:
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ModelError(f"unsupported activation {act!r} in a {arch} model")
        activation = "silu"
        attn_scale = head_dim**-0.5
        embed_scale = None
        final_softcap = None
        attn_softcap = None
    if attn_softcap:
        raise ModelError("attention logit soft-capping is not supported by kvpage's paged attention")

    eos = getattr(config, "eos_token_id", None)
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    return ModelSpec(
        arch=arch,
        num_layers=num_layers,
        hidden_size=config.hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        rms_eps=config.rms_norm_eps,
        activation=activation,
        gemma_norms=gemma,
        qk_norm=arch in ("qwen3", "gemma3_text"),
        qkv_bias=arch == "qwen2" or bool(getattr(config, "attention_bias", False)),
        o_bias=bool(getattr(config, "attention_bias", False)) and arch != "qwen2",
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        attn_scale=attn_scale,
        embed_scale=embed_scale,
        final_logit_softcap=final_softcap,
        attn_logit_softcap=attn_softcap,
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        max_position=int(getattr(config, "max_position_embeddings", 2048)),
        layers=tuple(layers),
        bos_token_id=getattr(config, "bos_token_id", None),
        eos_token_ids=eos_ids,
    )
