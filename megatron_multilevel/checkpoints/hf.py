"""Exchange with Hugging Face ``transformers`` where the architectures match.

- GPT <-> ``GPT2LMHeadModel``: learned positions, LayerNorm, GELU (exact, or the tanh
  approximation GPT-2 uses), biases, multi-head attention; tied or untied output layer.
- BERT <-> ``MegatronBertForMaskedLM``: the pre-LN BERT that Megatron trains (the original
  post-LN ``BertForMaskedLM`` computes something else).

The maps are pure tensor reshuffles (Megatron's fused per-head ``[q k v]`` rows against
GPT-2's ``[Q | K | V]`` columns of a transposed ``Conv1D``, or BERT's separate projections), so a
round trip gives back the same tensors bit for bit.
"""

from typing import Optional

import torch

from megatron_multilevel.config import ModelConfig

GPT_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_new"}
MODEL_TYPES = {"gpt": "gpt2", "bert": "megatron-bert"}  # our model kind -> Hugging Face model type
HF_CLASSES = {"gpt2": "GPT2LMHeadModel", "megatron-bert": "MegatronBertForMaskedLM"}


def check_model_type(model_type: str) -> None:
    if model_type not in HF_CLASSES:
        raise ValueError(f"Hugging Face model type {model_type!r} is not supported; valid: {sorted(HF_CLASSES)}")


def hf_model_class(model_type: str):
    """The ``transformers`` class of a Hugging Face model type this project exchanges with."""
    check_model_type(model_type)
    import transformers

    return getattr(transformers, HF_CLASSES[model_type])


def check_exportable(cfg: ModelConfig) -> None:
    """Raise ``ValueError`` naming the first feature a Hugging Face model cannot reproduce."""
    checks = [
        (cfg.position_embedding_type == "learned_absolute", "position_embedding_type", cfg.position_embedding_type, "learned_absolute"),
        (cfg.normalization == "LayerNorm", "normalization", cfg.normalization, "LayerNorm"),
        (cfg.add_bias_linear, "add_bias_linear", cfg.add_bias_linear, True),
        (cfg.num_query_groups == cfg.num_attention_heads, "num_query_groups", cfg.num_query_groups,
         cfg.num_attention_heads),
        (cfg.kv_channels * cfg.num_attention_heads == cfg.hidden_size, "kv_channels", cfg.kv_channels,
         cfg.hidden_size // cfg.num_attention_heads),
    ]
    if cfg.kind == "gpt":
        checks.append((cfg.activation in GPT_ACTIVATIONS, "activation", cfg.activation, list(GPT_ACTIVATIONS)))
    else:
        checks.append((cfg.activation == "gelu", "activation", cfg.activation, "gelu"))
        checks.append((not cfg.add_binary_head, "add_binary_head", cfg.add_binary_head, False))
    for ok, key, value, needed in checks:
        if not ok:
            target = HF_CLASSES[MODEL_TYPES[cfg.kind]]
            raise ValueError(f"cannot export to Hugging Face {target}: model.{key} is {value!r}, it needs {needed!r}")


def hf_config(cfg: ModelConfig):
    check_exportable(cfg)
    if cfg.kind == "gpt":
        from transformers import GPT2Config

        return GPT2Config(
            vocab_size=cfg.vocab_size, n_positions=cfg.max_sequence_length, n_embd=cfg.hidden_size,
            n_layer=cfg.num_layers, n_head=cfg.num_attention_heads, n_inner=cfg.ffn_hidden_size,
            activation_function=GPT_ACTIVATIONS[cfg.activation], layer_norm_epsilon=cfg.layernorm_epsilon,
            resid_pdrop=cfg.hidden_dropout, embd_pdrop=cfg.hidden_dropout, attn_pdrop=cfg.attention_dropout,
            tie_word_embeddings=cfg.share_embeddings_and_output_weights, bos_token_id=None, eos_token_id=None,
        )
    from transformers import MegatronBertConfig

    return MegatronBertConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads, intermediate_size=cfg.ffn_hidden_size, hidden_act="gelu",
        max_position_embeddings=cfg.max_sequence_length, type_vocab_size=max(1, cfg.num_tokentypes),
        layer_norm_eps=cfg.layernorm_epsilon, hidden_dropout_prob=cfg.hidden_dropout,
        attention_probs_dropout_prob=cfg.attention_dropout, tie_word_embeddings=cfg.share_embeddings_and_output_weights,
    )


def model_config_from_hf(hf, hf_sd: Optional[dict] = None) -> ModelConfig:
    """Our model config of a Hugging Face GPT-2 or Megatron-BERT config (and state dict: a single
    all-zero token-type embedding is what a BERT without segments exports as)."""
    check_model_type(hf.model_type)
    if hf.model_type == "gpt2":
        act = {v: k for k, v in GPT_ACTIVATIONS.items()}.get(hf.activation_function)
        if act is None:
            raise ValueError(f"GPT-2 activation {hf.activation_function!r} has no Megatron counterpart; "
                             f"supported: {sorted(GPT_ACTIVATIONS.values())}")
        return ModelConfig(
            kind="gpt", num_layers=hf.n_layer, hidden_size=hf.n_embd, num_attention_heads=hf.n_head,
            ffn_hidden_size=hf.n_inner or 4 * hf.n_embd, vocab_size=hf.vocab_size, max_sequence_length=hf.n_positions,
            activation=act, layernorm_epsilon=hf.layer_norm_epsilon,
            share_embeddings_and_output_weights=hf.tie_word_embeddings,
        )
    if hf.hidden_act != "gelu":  # megatron-bert
        raise ValueError(f"Megatron-BERT activation {hf.hidden_act!r} is not supported; it needs 'gelu'")
    tokentypes = hf.type_vocab_size
    segments = None if hf_sd is None else hf_sd.get("bert.embeddings.token_type_embeddings.weight")
    if tokentypes == 1 and segments is not None and not segments.any():
        tokentypes = 0
    return ModelConfig(
        kind="bert", num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
        num_attention_heads=hf.num_attention_heads, ffn_hidden_size=hf.intermediate_size,
        vocab_size=hf.vocab_size, max_sequence_length=hf.max_position_embeddings,
        num_tokentypes=tokentypes, layernorm_epsilon=hf.layer_norm_eps,
        share_embeddings_and_output_weights=hf.tie_word_embeddings,
    )


def _qkv_to_separate(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Megatron rows ``[q_h k_h v_h]`` per head -> ``[Q | K | V]`` (each all heads)."""
    rest = w.shape[1:]  # (hidden,) for the weight, () for the bias
    # (heads * 3 * head_size, *rest) -> (heads, 3, head_size, *rest) -> (3, heads, head_size, *rest)
    # -> (3 * heads * head_size, *rest)
    return w.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(-1, *rest)


def _separate_to_qkv(w: torch.Tensor, heads: int) -> torch.Tensor:
    """``[Q | K | V]`` (each all heads) -> Megatron rows ``[q_h k_h v_h]`` per head."""
    rest = w.shape[1:]  # (hidden,) for the weight, () for the bias
    # (3 * heads * head_size, *rest) -> (3, heads, head_size, *rest) -> (heads, 3, head_size, *rest)
    # -> (heads * 3 * head_size, *rest)
    return w.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(-1, *rest)


def _layer_map(cfg: ModelConfig) -> dict[str, str]:
    """Megatron name inside a layer -> Hugging Face name inside a layer (non-QKV parameters)."""
    if cfg.kind == "gpt":
        return {
            "input_layernorm.weight": "ln_1.weight", "input_layernorm.bias": "ln_1.bias",
            "self_attention.linear_proj.weight": "attn.c_proj.weight", "self_attention.linear_proj.bias": "attn.c_proj.bias",
            "pre_mlp_layernorm.weight": "ln_2.weight", "pre_mlp_layernorm.bias": "ln_2.bias",
            "mlp.linear_fc1.weight": "mlp.c_fc.weight", "mlp.linear_fc1.bias": "mlp.c_fc.bias",
            "mlp.linear_fc2.weight": "mlp.c_proj.weight", "mlp.linear_fc2.bias": "mlp.c_proj.bias",
        }
    return {
        "input_layernorm.weight": "attention.ln.weight", "input_layernorm.bias": "attention.ln.bias",
        "self_attention.linear_proj.weight": "attention.output.dense.weight",
        "self_attention.linear_proj.bias": "attention.output.dense.bias",
        "pre_mlp_layernorm.weight": "ln.weight", "pre_mlp_layernorm.bias": "ln.bias",
        "mlp.linear_fc1.weight": "intermediate.dense.weight", "mlp.linear_fc1.bias": "intermediate.dense.bias",
        "mlp.linear_fc2.weight": "output.dense.weight", "mlp.linear_fc2.bias": "output.dense.bias",
    }


def _model_map(cfg: ModelConfig) -> dict[str, str]:
    if cfg.kind == "gpt":
        out = {"embedding.word_embeddings.weight": "transformer.wte.weight",
               "embedding.position_embeddings.weight": "transformer.wpe.weight",
               "decoder.final_layernorm.weight": "transformer.ln_f.weight",
               "decoder.final_layernorm.bias": "transformer.ln_f.bias"}
        if not cfg.share_embeddings_and_output_weights:
            out["output_layer.weight"] = "lm_head.weight"
        return out
    out = {"embedding.word_embeddings.weight": "bert.embeddings.word_embeddings.weight",
           "embedding.position_embeddings.weight": "bert.embeddings.position_embeddings.weight",
           "encoder.final_layernorm.weight": "bert.encoder.ln.weight",
           "encoder.final_layernorm.bias": "bert.encoder.ln.bias",
           "lm_head.dense.weight": "cls.predictions.transform.dense.weight",
           "lm_head.dense.bias": "cls.predictions.transform.dense.bias",
           "lm_head.layer_norm.weight": "cls.predictions.transform.LayerNorm.weight",
           "lm_head.layer_norm.bias": "cls.predictions.transform.LayerNorm.bias",
           "output_layer.bias": "cls.predictions.bias"}
    if cfg.num_tokentypes:
        out["embedding.tokentype_embeddings.weight"] = "bert.embeddings.token_type_embeddings.weight"
    if not cfg.share_embeddings_and_output_weights:
        out["output_layer.weight"] = "cls.predictions.decoder.weight"
    return out


def _transposed(cfg: ModelConfig, local: str) -> bool:
    """GPT-2's Conv1D stores weights as (in, out)."""
    return cfg.kind == "gpt" and local.endswith("weight") and ("linear_" in local)


def to_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Megatron parameter names and layouts -> the Hugging Face model's."""
    check_exportable(cfg)
    h = cfg.num_attention_heads
    stack, hf_layers = ("decoder", "transformer.h") if cfg.kind == "gpt" else ("encoder", "bert.encoder.layer")
    out = {hf: sd[meg].clone() for meg, hf in _model_map(cfg).items()}
    if cfg.kind == "bert":
        out["cls.predictions.decoder.bias"] = out["cls.predictions.bias"].clone()  # the same vocab bias
        if not cfg.num_tokentypes:
            out["bert.embeddings.token_type_embeddings.weight"] = torch.zeros(1, cfg.hidden_size)
    for i in range(cfg.num_layers):
        prefix, hp = f"{stack}.layers.{i}.", f"{hf_layers}.{i}."
        for local, hf in _layer_map(cfg).items():
            t = sd[prefix + local]
            out[hp + hf] = t.t().contiguous() if _transposed(cfg, local) else t.clone()  # (out, in) -> (in, out)
        # heads * head_size == hidden (check_exportable): the rows [Q | K | V] each take hidden
        w = _qkv_to_separate(sd[prefix + "self_attention.linear_qkv.weight"], h)  # (3 * hidden, hidden)
        b = _qkv_to_separate(sd[prefix + "self_attention.linear_qkv.bias"], h)  # (3 * hidden,)
        if cfg.kind == "gpt":
            out[hp + "attn.c_attn.weight"] = w.t().contiguous()  # (3 * hidden, hidden) -> (hidden, 3 * hidden)
            out[hp + "attn.c_attn.bias"] = b
        else:  # (3 * hidden, hidden) -> 3 x (hidden, hidden); (3 * hidden,) -> 3 x (hidden,)
            for part, wp, bp in zip(("query", "key", "value"), w.chunk(3), b.chunk(3)):
                out[hp + f"attention.self.{part}.weight"] = wp.contiguous()
                out[hp + f"attention.self.{part}.bias"] = bp.contiguous()
    return out


def from_hf_state_dict(hf_sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face parameter names and layouts -> Megatron's (the inverse of ``to_hf_state_dict``)."""
    h = cfg.num_attention_heads
    stack, hf_layers = ("decoder", "transformer.h") if cfg.kind == "gpt" else ("encoder", "bert.encoder.layer")
    missing = [hf for hf in _model_map(cfg).values() if hf not in hf_sd]
    if missing:
        raise ValueError(f"the Hugging Face checkpoint lacks {missing[:4]}")
    out = {meg: hf_sd[hf].clone() for meg, hf in _model_map(cfg).items()}
    for i in range(cfg.num_layers):
        prefix, hp = f"{stack}.layers.{i}.", f"{hf_layers}.{i}."
        for local, hf in _layer_map(cfg).items():
            t = hf_sd[hp + hf]
            out[prefix + local] = t.t().contiguous() if _transposed(cfg, local) else t.clone()  # (in, out) -> (out, in)
        # w: (3 * hidden, hidden), b: (3 * hidden,), rows [Q | K | V]
        if cfg.kind == "gpt":  # (hidden, 3 * hidden) -> (3 * hidden, hidden)
            w, b = hf_sd[hp + "attn.c_attn.weight"].t(), hf_sd[hp + "attn.c_attn.bias"]
        else:  # 3 x (hidden, hidden) -> (3 * hidden, hidden); 3 x (hidden,) -> (3 * hidden,)
            w = torch.cat([hf_sd[hp + f"attention.self.{p}.weight"] for p in ("query", "key", "value")])
            b = torch.cat([hf_sd[hp + f"attention.self.{p}.bias"] for p in ("query", "key", "value")])
        out[prefix + "self_attention.linear_qkv.weight"] = _separate_to_qkv(w, h).contiguous()
        out[prefix + "self_attention.linear_qkv.bias"] = _separate_to_qkv(b, h).contiguous()
    return out


def hf_model(cfg: ModelConfig, sd: Optional[dict] = None):
    """A ``transformers`` model of ``cfg`` (random weights, or ``sd`` in Hugging Face names), eval mode."""
    model = hf_model_class(MODEL_TYPES[cfg.kind])(hf_config(cfg))
    if sd is not None:
        result = model.load_state_dict(sd, strict=False)
        unexpected = list(result.unexpected_keys)
        missing = [k for k in result.missing_keys if k not in ("lm_head.weight", "cls.predictions.decoder.weight",
                                                               "cls.predictions.decoder.bias")]
        assert not unexpected and not missing, (missing, unexpected)
        if hasattr(model, "tie_weights"):
            model.tie_weights()
    return model.eval()


def hf_logits(model, cfg: ModelConfig, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if cfg.kind == "gpt":
            return model(input_ids=tokens).logits
        return model(input_ids=tokens, attention_mask=torch.ones_like(tokens),
                     token_type_ids=torch.zeros_like(tokens)).logits
