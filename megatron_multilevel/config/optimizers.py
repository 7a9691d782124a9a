"""The DeepSpeed ``optimizer`` block, checked before anything is built.

DeepSpeed 0.19.8 builds the optimizer that ``optimizer.type`` names with ``optimizer.params`` as
keyword arguments (``DeepSpeedEngine._configure_basic_optimizer``). A parameter that optimizer does
not take surfaces as a traceback at the first engine, after the model and the data are built
(``FusedLion.__init__() got an unexpected keyword argument 'eps'``), or is ignored without a word
(Muon). The tables below are DeepSpeed's types, the class each one builds, and that class's keyword
arguments; ``tests/test_first_hour.py`` keeps them equal to the installed DeepSpeed and torch.
"""

from megatron_multilevel.config.deepspeed import deep_merge
from megatron_multilevel.config.parsing import warn_one_line
from megatron_multilevel.config.muon import check_muon, check_muon_params, is_muon

# The classes DeepSpeed may build, and the keyword arguments ``optimizer.params`` may pass to each
# (the ones DeepSpeed passes itself left out).
CLASS_PARAMS = {
    "torch.optim.Adam": ("amsgrad", "betas", "capturable", "decoupled_weight_decay", "differentiable", "eps",
                         "foreach", "fused", "lr", "maximize", "weight_decay"),
    "torch.optim.AdamW": ("amsgrad", "betas", "capturable", "differentiable", "eps", "foreach", "fused", "lr",
                          "maximize", "weight_decay"),
    "torch.optim.Adagrad": ("differentiable", "eps", "foreach", "fused", "initial_accumulator_value", "lr",
                            "lr_decay", "maximize", "weight_decay"),
    "torch.optim.ASGD": ("alpha", "capturable", "differentiable", "foreach", "lambd", "lr", "maximize", "t0",
                         "weight_decay"),
    "torch.optim.Adadelta": ("capturable", "differentiable", "eps", "foreach", "lr", "maximize", "rho",
                             "weight_decay"),
    "torch.optim.Adafactor": ("beta2_decay", "d", "eps", "foreach", "lr", "maximize", "weight_decay"),
    "torch.optim.Adamax": ("betas", "capturable", "differentiable", "eps", "foreach", "lr", "maximize",
                           "weight_decay"),
    "torch.optim.LBFGS": ("history_size", "line_search_fn", "lr", "max_eval", "max_iter", "tolerance_change",
                          "tolerance_grad"),
    "torch.optim.NAdam": ("betas", "capturable", "decoupled_weight_decay", "differentiable", "eps", "foreach", "lr",
                          "maximize", "momentum_decay", "weight_decay"),
    "torch.optim.RAdam": ("betas", "capturable", "decoupled_weight_decay", "differentiable", "eps", "foreach", "lr",
                          "maximize", "weight_decay"),
    "torch.optim.RMSprop": ("alpha", "capturable", "centered", "differentiable", "eps", "foreach", "lr", "maximize",
                            "momentum", "weight_decay"),
    "torch.optim.Rprop": ("capturable", "differentiable", "etas", "foreach", "lr", "maximize", "step_sizes"),
    "torch.optim.SGD": ("dampening", "differentiable", "foreach", "fused", "lr", "maximize", "momentum", "nesterov",
                        "weight_decay"),
    "torch.optim.SparseAdam": ("betas", "eps", "lr", "maximize"),
    "deepspeed.ops.adam.FusedAdam": ("amsgrad", "betas", "bias_correction", "eps", "lr", "set_grad_none",
                                     "weight_decay"),  # adam_w_mode: DeepSpeed's
    "deepspeed.ops.adam.DeepSpeedCPUAdam": ("amsgrad", "betas", "bias_correction", "eps", "lr",
                                            "weight_decay"),  # adamw_mode, fp32_optimizer_states: DeepSpeed's
    "deepspeed.ops.lion.FusedLion": ("betas", "lr", "set_grad_none", "weight_decay"),
    "deepspeed.ops.lion.DeepSpeedCPULion": ("betas", "fp32_optimizer_states", "lr", "weight_decay"),
    # max_grad_norm is refused by DeepSpeed for every type (gradient_clipping replaces it)
    "deepspeed.ops.lamb.FusedLamb": ("amsgrad", "betas", "bias_correction", "eps", "eps_inside_sqrt", "lr",
                                     "max_coeff", "min_coeff", "weight_decay"),
    "deepspeed.ops.adagrad.DeepSpeedCPUAdagrad": ("amsgrad", "eps", "fp32_optimizer_states", "lr", "weight_decay"),
    # the keys DeepSpeed reads for the Muon half and the auxiliary Adam half of each group
    "deepspeed.runtime.zero.muon.muon_optimizer.MuonWithAuxAdam": ("adam_lr", "betas", "eps", "lr", "momentum",
                                                                   "muon_lr", "ns_method", "weight_decay"),
}

# Keys DeepSpeed reads (and removes) before it builds Adam, AdamW and Muon.
ADAM_KEYS = ("adam_w_mode", "fp32_optimizer_states", "torch_adam")

# DeepSpeed's own types (matched in any case): the class built with ZeRO-Offload of the optimizer,
# and without. Adam, AdamW and Muon choose their class from their params as well (``optimizer_class``).
# mup's MuAdam, MuAdamW and MuSGD pass their params on to the torch class.
DEEPSPEED_TYPES = {
    "Adagrad": ("deepspeed.ops.adagrad.DeepSpeedCPUAdagrad", "torch.optim.Adagrad"),
    "Adam": ("deepspeed.ops.adam.DeepSpeedCPUAdam", "deepspeed.ops.adam.FusedAdam"),
    "AdamW": ("deepspeed.ops.adam.DeepSpeedCPUAdam", "deepspeed.ops.adam.FusedAdam"),
    "Lamb": ("deepspeed.ops.lamb.FusedLamb", "deepspeed.ops.lamb.FusedLamb"),
    "Lion": ("deepspeed.ops.lion.DeepSpeedCPULion", "deepspeed.ops.lion.FusedLion"),
    "MuAdam": ("torch.optim.Adam", "torch.optim.Adam"),
    "MuAdamW": ("torch.optim.AdamW", "torch.optim.AdamW"),
    "MuSGD": ("torch.optim.SGD", "torch.optim.SGD"),
    "Muon": ("deepspeed.runtime.zero.muon.muon_optimizer.MuonWithAuxAdam",) * 2,
}

# Any other type is looked up in torch.optim by its exact name.
TORCH_TYPES = ("ASGD", "Adadelta", "Adafactor", "Adamax", "LBFGS", "NAdam", "RAdam", "RMSprop", "Rprop", "SGD",
               "SparseAdam")

VALID_TYPES = (*DEEPSPEED_TYPES, *TORCH_TYPES)


def optimizer_class(kind: str, params: dict, *, offload: bool) -> tuple[str, tuple[str, ...]]:
    """The class DeepSpeed builds for ``optimizer.type = kind`` and the ``optimizer.params`` it takes.

    ``offload``: ``zero_optimization.offload_optimizer`` puts the optimizer on the CPU or NVMe."""
    own = {name.lower(): name for name in DEEPSPEED_TYPES}
    if kind.lower() in own:
        name = own[kind.lower()]
        cls = DEEPSPEED_TYPES[name][0 if offload else 1]
        extra = ()
        if name in ("Adam", "AdamW", "Muon"):
            extra = ADAM_KEYS
            if name != "Muon" and params.get("torch_adam"):
                # Adam means AdamW too unless adam_w_mode is false
                adamw = name == "AdamW" or params.get("adam_w_mode", True)
                cls = "torch.optim.AdamW" if adamw else "torch.optim.Adam"
        return cls, tuple(sorted(CLASS_PARAMS[cls] + extra))
    if kind in TORCH_TYPES:
        cls = f"torch.optim.{kind}"
        return cls, CLASS_PARAMS[cls]
    spelled = [name for name in TORCH_TYPES if name.lower() == kind.lower()]
    hint = f" (torch's types are matched as spelled: {spelled[0]!r})" if spelled else ""
    raise ValueError(f"optimizer.type = {kind!r} is not an optimizer DeepSpeed 0.19.8 builds{hint}; valid types are "
                     f"{list(VALID_TYPES)}")


MAX_LR = 10.0
"""Above this a rate is a typo (or a unit slip), whatever the optimizer: no model trains there."""


def check_param_values(params: dict) -> None:
    """The values of ``optimizer.params`` that torch would refuse only after the model is built (or
    take and diverge on): a rate in (0, MAX_LR], betas in [0, 1), a positive eps, a weight decay >= 0."""
    def number(key):
        value = params[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"optimizer.params.{key} must be a number, got {value!r}")
        return value

    for key in ("lr", "adam_lr", "muon_lr"):
        if key in params and not 0 < number(key) <= MAX_LR:
            raise ValueError(f"optimizer.params.{key} must be in (0, {MAX_LR:g}], got {params[key]!r}")
    if "betas" in params:
        betas = params["betas"]
        if not (isinstance(betas, list) and len(betas) == 2 and all(
                isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)):
            raise ValueError(f"optimizer.params.betas must be two numbers in [0, 1), got {betas!r}")
    if "eps" in params and not number("eps") > 0:
        raise ValueError(f"optimizer.params.eps must be positive, got {params['eps']!r}")
    if "weight_decay" in params and not number("weight_decay") >= 0:
        raise ValueError(f"optimizer.params.weight_decay must be >= 0, got {params['weight_decay']!r}")


def check_optimizer(deepspeed: dict, *, where: str = "") -> None:
    """Raise ``ValueError`` naming the key if ``deepspeed``'s ``optimizer`` block has a type DeepSpeed
    does not build or a parameter its optimizer does not take. ``where`` prefixes the message."""
    block = deepspeed.get("optimizer")
    if block is None:  # the trainer's default, AdamW
        return
    try:
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise ValueError(f"optimizer must be an object with a \"type\"; valid types are {list(VALID_TYPES)}")
        params = block.get("params", {})
        if not isinstance(params, dict):
            raise ValueError("optimizer.params must be an object")
        offload = (deepspeed.get("zero_optimization") or {}).get("offload_optimizer") or {}
        cls, valid = optimizer_class(block["type"], params, offload=offload.get("device") in ("cpu", "nvme"))
        bad = [f"optimizer.params.{key}" for key in params if key not in valid]
        if bad:
            what = (f"{bad[0]} is not a parameter" if len(bad) == 1 else
                    f"{', '.join(bad[:-1])} and {bad[-1]} are not parameters")
            raise ValueError(f"{what} of optimizer.type = {block['type']!r} (DeepSpeed builds {cls}); valid params "
                             f"are {list(valid)}")
        check_param_values(params)
        if is_muon(deepspeed):
            check_muon_params(params)
    except ValueError as e:
        raise ValueError(f"{where}{e}") from None


def check_optimizers(cfg) -> None:
    """Check the optimizer of a ``RunConfig``, and every level's, where a level overrides it; Muon's
    layout at every level (``config.muon.check_muon``)."""
    check_optimizer(cfg.deepspeed)
    for level, tp in enumerate(cfg.level_tp_sizes()):
        check_muon(cfg.level_deepspeed(level), tp, where="" if level == 0 else f" (level {level})")
    if not cfg.multilevel.enabled:
        return
    warn_fresh_moments(cfg)
    ode = cfg.multilevel.ode
    if ode is not None and {"optimizer", "zero_optimization"} & set(ode.coarse_deepspeed):
        where = "multilevel.ode.coarse_deepspeed (merged into the top-level DeepSpeed keys): "
        check_optimizer(deep_merge(cfg.deepspeed, ode.coarse_deepspeed), where=where)
    for i, level in enumerate(cfg.multilevel.levels):
        if {"optimizer", "zero_optimization"} & set(level.deepspeed):
            where = f"multilevel.levels[{i}].deepspeed (merged into the top-level DeepSpeed keys): "
            check_optimizer(deep_merge(cfg.deepspeed, level.deepspeed), where=where)


# Adam's second-moment decay above which zero moments under a carried step count update the new
# layers far more than a fresh Adam would (see ``warn_fresh_moments``).
FRESH_MOMENTS_BETA2 = 0.99


def warn_fresh_moments(cfg) -> None:
    """Say, in one line, where ``grown_moments = "zero"`` meets an Adam whose ``betas[1]`` is above
    ``FRESH_MOMENTS_BETA2``. The new layers' moments start at zero but keep the run's step count:
    DeepSpeed's ZeRO optimizers hold one flat partition, and one step count, per parameter group,
    so a count of their own would need groups of their own at every stage. Adam then does not
    correct their bias: after ``k`` steps their update is ``(1 - b1^k) / sqrt(1 - b2^k)`` times a
    fresh Adam's, 0.45 to 1.1 with betas (0.9, 0.95) (a short warm-up of their own), but 3 to 6.5
    with (0.9, 0.999) over their first hundred steps."""
    ml = cfg.multilevel
    if ml.strategy != "coalesce" or ml.optimizer_state != "map" or ml.grown_moments != "zero":
        return
    for level in ml.grown_levels():
        optimizer = cfg.level_deepspeed(level).get("optimizer", {"type": "AdamW"})
        if optimizer.get("type", "AdamW").lower() not in ("adam", "adamw", "muon"):
            continue
        beta2 = optimizer.get("params", {}).get("betas", (0.9, 0.999))[1]
        if beta2 > FRESH_MOMENTS_BETA2:
            warn_one_line(f"multilevel.grown_moments 'zero' starts the new layers' Adam moments at zero under the "
                          f"run's step count (no bias correction of their own): with optimizer.params.betas[1] = "
                          f"{beta2} their first updates are 3 to 6.5 times a fresh Adam's; betas [0.9, 0.95] keep "
                          f"them within 0.45 to 1.1 (docs/growth.md)")
            return
