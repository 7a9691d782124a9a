"""Build Megatron-Core ``GPTModel`` / ``BertModel`` from a :class:`ModelConfig`, at any level.

Needs ``torch.distributed`` and Megatron's ``parallel_state`` to be initialised (see
``megatron_multilevel.distributed``); the tensor-parallel size is read from there. Whether the model
runs sequence-parallel is an argument (``RunConfig.level_sequence_parallel`` resolves it per level);
the layer spec is chosen here, with the norm that supports sequence parallelism where Megatron's
local spec would build one that rejects it.
"""

import dataclasses
import functools
import importlib.util

import torch
import torch.nn.functional as F

from megatron_multilevel.config import ModelConfig, check_sequence_parallel_supported
from megatron_multilevel.config.pipeline import PipelineSplit
from megatron_multilevel.cpu_shims import apply_cpu_shims
from megatron_multilevel.parallel.stages import TIED_OUTPUT, WORD_EMBEDDING
from megatron_multilevel.parallel.tp_layout import partition_dim
from megatron_multilevel.plan import is_metadata, parameter_plan
from megatron_multilevel.residual_step import set_residual_step


ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "swiglu": F.silu,  # with gated_linear_unit: silu(gate) * up
}


def transformer_engine_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def use_transformer_engine(cfg: ModelConfig) -> bool:
    """Whether ``cfg`` resolves to the Transformer Engine layer spec."""
    if cfg.transformer_impl == "local":
        return False
    if cfg.transformer_impl == "transformer_engine":
        if not transformer_engine_available():
            raise ValueError(
                "model.transformer_impl = 'transformer_engine' needs CUDA and transformer_engine; "
                "valid choices here are ['auto', 'local']"
            )
        return True
    return transformer_engine_available()


def check_fp8(cfg: ModelConfig) -> None:
    """``model.fp8`` needs the Transformer Engine layers (on a GPU): else a ``ValueError`` naming it."""
    if cfg.fp8 is not None and not use_transformer_engine(cfg):
        raise ValueError(f"model.fp8 = {cfg.fp8!r} needs the Transformer Engine layers on a GPU (transformer_impl "
                         f"'auto' or 'transformer_engine' with transformer_engine installed and CUDA); here the "
                         f"valid choice is null")


def transformer_config(
    cfg: ModelConfig, *, params_dtype: torch.dtype = torch.float32, perform_initialization: bool = True,
    sequence_parallel: bool = False, pipeline: PipelineSplit = PipelineSplit(),
):
    """Megatron's ``TransformerConfig`` for ``cfg`` on the current parallel layout (its TP and PP
    sizes; ``pipeline`` names the split of the layers over the stages), sequence-parallel or not."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_gpu = torch.cuda.is_available()
    assert parallel_state.get_pipeline_model_parallel_world_size() == pipeline.size, (
        "the parallel state is not the layout's", parallel_state.get_pipeline_model_parallel_world_size(), pipeline)
    stages = {} if pipeline.size == 1 else dict(
        pipeline_model_parallel_size=pipeline.size, pipeline_dtype=params_dtype,
        num_layers_in_first_pipeline_stage=pipeline.first, num_layers_in_last_pipeline_stage=pipeline.last)
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.kv_channels,
        ffn_hidden_size=cfg.ffn_hidden_size,
        normalization=cfg.normalization,
        gated_linear_unit=cfg.gated,
        activation_func=ACTIVATIONS[cfg.activation],
        add_bias_linear=cfg.add_bias_linear,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        layernorm_epsilon=cfg.layernorm_epsilon,
        init_method_std=cfg.init_method_std,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        perform_initialization=perform_initialization,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # Every rank builds the full master weight and slices it: a TP run starts from exactly the
        # weights of a TP=1 run with the same seed. Off on GPU, where it would be slow at scale.
        use_cpu_initialization=not on_gpu,
        # Fusions need CUDA (or trigger torch.compile on CPU); DeepSpeed owns gradient accumulation.
        bias_activation_fusion=on_gpu and cfg.activation == "gelu" and cfg.add_bias_linear,
        masked_softmax_fusion=on_gpu,
        bias_dropout_fusion=on_gpu,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        # on the Transformer Engine layers only (check_fp8 refuses it otherwise before a run; a tool
        # building a model to read or convert weights on a CPU builds it without)
        fp8=cfg.fp8 if cfg.fp8 is not None and use_transformer_engine(cfg) else None,
        **stages,
    )


def build_model(
    cfg: ModelConfig, *, params_dtype: torch.dtype = torch.float32, perform_initialization: bool = True,
    sequence_parallel: bool = False, pipeline: PipelineSplit = PipelineSplit(),
) -> torch.nn.Module:
    """A Megatron-Core GPT or BERT model, or under pipeline parallelism (``pipeline``, the layout
    of the current parallel state) this rank's stage of it: its layers, the embeddings on the first
    stage, the final norm and output layer on the last (Megatron-Core's pre- and post-process).

    ``perform_initialization=False`` skips the random init, for a model whose parameters are
    all about to be overwritten (a level built by a transition).

    ``sequence_parallel`` (at TP > 1) builds it sequence-parallel; to train it under DeepSpeed the
    caller then adds the gradient hooks of ``parallel/sequence_parallel.py``, as ``LevelEngines``
    does for every model it builds."""
    model = _build(cfg, params_dtype, perform_initialization, sequence_parallel, pipeline)
    if not perform_initialization:
        _set_tensor_parallel_attributes(model, cfg)
    # Depth-muP's branch multiplier: Megatron-Core's layers have none, so a forward hook on each
    # residual branch multiplies its output (the hook the ODE strategy's coarse step uses).
    return set_residual_step(model, cfg.branch_multiplier)


def _set_tensor_parallel_attributes(model: torch.nn.Module, cfg: ModelConfig) -> None:
    """Megatron marks tensor-parallel parameters (``tensor_model_parallel``, ``partition_dim``)
    only while initialising them; without initialisation, mark them from the plan."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    plan = parameter_plan(cfg)
    for name, p in model.named_parameters():
        if name == TIED_OUTPUT and cfg.share_embeddings_and_output_weights:
            name = WORD_EMBEDDING  # the last pipeline stage's copy of the tied word embedding
        dim = partition_dim(plan.rule(name)[1])
        if dim is not None and not hasattr(p, "partition_dim"):
            set_tensor_model_parallel_attributes(p, is_parallel=True, dim=dim, stride=1)


def _build(cfg: ModelConfig, params_dtype: torch.dtype, perform_initialization: bool,
           sequence_parallel: bool, pipeline: PipelineSplit) -> torch.nn.Module:
    from megatron.core import parallel_state

    apply_cpu_shims()
    config = transformer_config(cfg, params_dtype=params_dtype, perform_initialization=perform_initialization,
                                sequence_parallel=sequence_parallel, pipeline=pipeline)
    stage = dict(pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage())
    if config.sequence_parallel:
        check_sequence_parallel_supported(cfg.kind)
    te = use_transformer_engine(cfg)
    if cfg.kind == "gpt":
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_local_spec,
            get_gpt_layer_with_transformer_engine_spec,
        )

        spec = (
            get_gpt_layer_with_transformer_engine_spec()
            if te
            else get_gpt_layer_local_spec(normalization=cfg.normalization)
        )
        if config.sequence_parallel and not te:
            # Megatron's torch norm (the local spec's without Apex) rejects sequence parallelism.
            spec = local_spec_with_sequence_parallel_norms(spec, config)
        return GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=cfg.vocab_size,
            max_sequence_length=cfg.max_sequence_length,
            share_embeddings_and_output_weights=cfg.share_embeddings_and_output_weights,
            position_embedding_type=cfg.position_embedding_type,
            rotary_base=cfg.rotary_base,
            **stage,
        )
    from megatron.core.models.bert.bert_layer_specs import (
        bert_layer_local_spec,
        get_bert_layer_with_transformer_engine_spec,
    )
    from megatron.core.models.bert.bert_model import BertModel

    spec = get_bert_layer_with_transformer_engine_spec() if te else bert_layer_local_spec
    return BertModel(
        config=config,
        num_tokentypes=cfg.num_tokentypes,
        transformer_layer_spec=spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_sequence_length,
        share_embeddings_and_output_weights=cfg.share_embeddings_and_output_weights,
        position_embedding_type=cfg.position_embedding_type,
        add_binary_head=cfg.add_binary_head,
        **stage,
    )


class SequenceParallelTorchNorm:
    """Megatron's ``WrappedTorchNorm`` (torch ``LayerNorm`` / ``RMSNorm``, the local layer spec's
    norm without Apex) that also runs under sequence parallelism: a norm acts on each token alone,
    so on a sequence shard it is the same module; its parameters are marked ``sequence_parallel``
    as Megatron's fused norms mark theirs. Parameter names stay ``weight`` / ``bias``."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        norm_cls = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}[config.normalization]
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            setattr(p, "sequence_parallel", config.sequence_parallel)
        return norm


def local_spec_with_sequence_parallel_norms(layer_spec, config):
    """The block spec of this rank's layers (all of them, or its pipeline stage's) of the local
    ``layer_spec`` and a final norm, with :class:`SequenceParallelTorchNorm` wherever Megatron
    would build its torch norm."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import (
        LayerNormImpl,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    num_layers = get_num_layers_to_build(config)
    layer_spec = _replace_module(layer_spec, WrappedTorchNorm, SequenceParallelTorchNorm)
    final_norm = SequenceParallelTorchNorm if LayerNormImpl is WrappedTorchNorm else LayerNormImpl
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * num_layers, layer_norm=final_norm)


def _replace_module(spec, old: type, new: type):
    """``spec`` (a ModuleSpec, a submodules dataclass or a module class) with ``old`` replaced by ``new``."""
    if spec is old:
        return new
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: _replace_module(getattr(spec, f.name), old, new) for f in dataclasses.fields(spec)}
        return dataclasses.replace(spec, **{k: v for k, v in changes.items() if v is not getattr(spec, k)})
    return spec


def load_parameters(model: torch.nn.Module, state_dict: dict) -> None:
    """Load a parameter state dict (as the operators return it) into ``model``, strictly.

    ``_extra_state`` entries (layer metadata, not parameters) keep the model's own values.
    """
    result = model.load_state_dict(state_dict, strict=False)
    missing = [k for k in result.missing_keys if not is_metadata(k)]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"state dict does not fit the model: missing {missing[:8]}, "
            f"unexpected {result.unexpected_keys[:8]}"
        )


def parameter_state_dict(model: torch.nn.Module) -> dict:
    """The model's parameters by name, detached (no ``_extra_state``)."""
    return {k: v.detach() for k, v in model.state_dict().items() if not is_metadata(k)}


def model_logits(model: torch.nn.Module, cfg: ModelConfig, tokens: torch.Tensor) -> torch.Tensor:
    """Logits ``[b, s, vocab / tp]`` of ``tokens`` ``[b, s]`` (no padding; BERT segment 0)."""
    b, s = tokens.shape
    if cfg.kind == "gpt":
        position_ids = torch.arange(s, device=tokens.device).expand(b, s)
        return model(tokens, position_ids, None)
    attention_mask = torch.ones(b, s, device=tokens.device)
    tokentype_ids = torch.zeros_like(tokens) if cfg.num_tokentypes else None
    logits, _ = model(tokens, attention_mask, tokentype_ids)
    return logits


def language_model_loss(
    model: torch.nn.Module,
    cfg: ModelConfig,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    padding_mask: "torch.Tensor | None" = None,
    tokentype_ids: "torch.Tensor | None" = None,
) -> torch.Tensor:
    """Mean cross-entropy over the positions of ``loss_mask`` (next token for GPT, masked tokens
    for BERT), computed by Megatron's vocab-parallel cross-entropy (correct at any TP size)."""
    losses = token_losses(model, cfg, tokens, labels, padding_mask=padding_mask, tokentype_ids=tokentype_ids)
    return masked_mean(losses, loss_mask)


def token_losses(
    model: torch.nn.Module,
    cfg: ModelConfig,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    *,
    padding_mask: "torch.Tensor | None" = None,
    tokentype_ids: "torch.Tensor | None" = None,
) -> torch.Tensor:
    """The per-token losses ``[b, s]`` of ``model``; a pipeline stage other than the last returns
    its output hidden states instead (its input: the previous stage's, set by the schedule)."""
    b, s = tokens.shape
    if cfg.kind == "gpt":
        position_ids = torch.arange(s, device=tokens.device).expand(b, s)
        return model(tokens, position_ids, None, labels=labels)
    if padding_mask is None:
        padding_mask = torch.ones(b, s, device=tokens.device)
    if not cfg.num_tokentypes:
        tokentype_ids = None  # the data has segment ids; a model without their embedding ignores them
    elif tokentype_ids is None:
        tokentype_ids = torch.zeros_like(tokens)
    out = model(tokens, padding_mask, tokentype_ids, lm_labels=labels)
    return out[0] if isinstance(out, tuple) else out


def masked_mean(losses: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """The mean of ``losses`` over the positions of ``loss_mask``."""
    mask = loss_mask.float()
    return (losses.float() * mask).sum() / mask.sum().clamp(min=1.0)
