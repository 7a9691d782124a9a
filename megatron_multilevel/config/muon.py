"""DeepSpeed's Muon (``"optimizer": {"type": "Muon"}``): which parameters it orthogonalises, the state
each parameter keeps, and the layouts it trains the same model in.

DeepSpeed 0.19.8 builds ``MuonWithAuxAdam``: the parameters tagged ``use_muon`` get Muon (a momentum,
``momentum_buffer``, orthogonalised by Newton-Schulz), the others its auxiliary Adam (``exp_avg``,
``exp_avg_sq`` and a step count). Following the published recipe (Keller Jordan's, and Megatron-Core's
``get_megatron_muon_optimizer``), Muon takes the transformer layers' weight matrices only; the
embeddings, the output layer and the heads, the norms and the biases are Adam's
(:func:`muon_parameter`; DeepSpeed's own tagging, by name, would give Megatron's ``output_layer``
to Muon). Refused before anything is built (:func:`check_muon`), each one line naming the key:

- a tensor-parallel size above 1: DeepSpeed orthogonalises each rank's shard of a matrix, not the
  matrix (a blockwise Muon, Megatron-Core's ``muon_tp_mode`` default), so another TP size would
  train another model, and a reshard would change the optimizer;
- ``gradient_clipping`` > 0 at ZeRO stages 1-3, which clip Muon's orthogonalised update with the
  norm of all of them (every step shrunk by about the square root of the matrices' rows, which
  Newton-Schulz does not undo), where stage 0 clips the gradient; with Muon the key defaults to 0
  (:func:`muon_defaults`), not DeepSpeed's 1;
- ``zero_optimization.reduce_scatter`` true at ZeRO stage 3, which DeepSpeed refuses for Muon after
  the model is built (it defaults to false there with Muon);
- bf16 or fp16 without ZeRO: DeepSpeed's ``BF16_Optimizer`` refuses Muon with Megatron's
  model-parallel groups, and its fp16 wrapper keeps the state on fp32 copies no stream reads.
"""

import re

MUON_TYPE = "muon"
MUON_STATE_KEYS = ("momentum_buffer",)
AUX_ADAM_STATE_KEYS = ("exp_avg", "exp_avg_sq")
NS_METHODS = ("gram", "standard")  # DeepSpeed's ``ns_method`` values (original_muon.NS_METHODS)
_LAYER = re.compile(r"^(decoder|encoder)\.layers\.\d+\.")


def is_muon(deepspeed: dict) -> bool:
    """Whether a (merged) DeepSpeed config trains with Muon."""
    optimizer = deepspeed.get("optimizer") or {}
    return isinstance(optimizer, dict) and str(optimizer.get("type", "")).lower() == MUON_TYPE


def muon_parameter(name: str, shape) -> bool:
    """Whether Muon (rather than its auxiliary Adam) trains the parameter ``name`` of ``shape`` (its
    shape as a layer: a ZeRO-3 parameter's ``ds_shape``): a weight matrix of a transformer layer."""
    return len(tuple(shape)) == 2 and _LAYER.match(name) is not None


def parameter_state_keys(name: str, shape) -> tuple[str, ...]:
    """The state Muon keeps for the parameter ``name`` of ``shape``: its momentum, or Adam's moments."""
    return MUON_STATE_KEYS if muon_parameter(name, shape) else AUX_ADAM_STATE_KEYS


def check_muon_params(params: dict) -> None:
    """The values of Muon's ``optimizer.params`` that DeepSpeed would take and fail on (or diverge
    with) after the model is built: a momentum in [0, 1), a known ``ns_method``."""
    momentum = params.get("momentum", 0.0)
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
        raise ValueError(f"optimizer.params.momentum must be a number in [0, 1), got {momentum!r}")
    if params.get("ns_method", "gram") not in NS_METHODS:
        raise ValueError(f"optimizer.params.ns_method = {params['ns_method']!r}; valid choices are {list(NS_METHODS)}")


def check_muon(deepspeed: dict, tp: int, *, where: str = "") -> None:
    """Raise ``ValueError`` naming the key if a level (its merged DeepSpeed keys ``deepspeed``, its
    tensor-parallel size ``tp``) trains with Muon in a layout that would train another model."""
    if not is_muon(deepspeed):
        return
    if tp != 1:
        raise ValueError(f"tensor_model_parallel_size{where} = {tp} with optimizer.type = 'Muon': DeepSpeed "
                         f"orthogonalises each rank's shard of a matrix, not the matrix; valid values are [1]")
    zero = deepspeed.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    clipping = deepspeed.get("gradient_clipping", 0.0)
    if stage and clipping:
        raise ValueError(f"gradient_clipping{where} = {clipping!r} with optimizer.type = 'Muon' at "
                         f"zero_optimization.stage = {stage}: DeepSpeed clips Muon's orthogonalised update there, "
                         f"not the gradient; valid values are [0] (or stage 0)")
    low = [k for k in ("bf16", "fp16") if (deepspeed.get(k) or {}).get("enabled")]
    if low and not stage:
        raise ValueError(f"{low[0]}.enabled{where} with optimizer.type = 'Muon' needs ZeRO: DeepSpeed's 16-bit "
                         f"optimizers without it refuse Muon (bf16, with Megatron's groups) or keep its state where "
                         f"no transition reads it; valid zero_optimization.stage values are [1, 2, 3]")
    if stage == 3 and zero.get("reduce_scatter", False):
        raise ValueError(f"zero_optimization.reduce_scatter{where} = true with optimizer.type = 'Muon' at "
                         f"zero_optimization.stage = 3: DeepSpeed refuses it; valid values are [false]")


def muon_defaults(deepspeed: dict) -> None:
    """Set, in a level's DeepSpeed config that trains with Muon, what :func:`check_muon` requires and
    DeepSpeed's defaults contradict: no gradient clipping, no reduce scatter at ZeRO stage 3."""
    if not is_muon(deepspeed):
        return
    deepspeed.setdefault("gradient_clipping", 0.0)
    zero = deepspeed.get("zero_optimization") or {}
    if zero.get("stage", 0) == 3:
        deepspeed["zero_optimization"] = {**zero, "reduce_scatter": zero.get("reduce_scatter", False)}
