"""``training.steps_scale``: any config made short, for a first try or a smoke test, by one key.

Applied once, to the config's JSON before it is parsed (``load_config``): every phase's steps and
warm-up, and the steps that must fit inside a phase (MSG's mask, ``multilevel.growth_mask_steps``;
the ODE strategy's ``coherence_batches``), times the scale, rounded up so that nothing that had steps
gets none; LiGO's operator steps too. Rounding up keeps every "fits inside" relation the checks ask
for (``a <= b`` gives ``ceil(a s) <= ceil(b s)``), and the scaled config is then checked as any
other. The key itself is dropped: the config a run records (``config.json``, its baseline's, the one
a resume compares) holds the scaled steps, so reading it again scales nothing twice.
"""

import copy
import math
from dataclasses import MISSING, fields

from megatron_multilevel.config.multilevel import MultilevelConfig
from megatron_multilevel.config.ode import OdeConfig
from megatron_multilevel.config.training import TrainingConfig, check_steps_scale

# the ODE block's steps (its cycles stay: each phase of them shrinks) and schedules
ODE_STEPS = ("pre_steps", "coarse_steps", "post_steps", "final_steps", "coherence_batches")
ODE_SCHEDULES = ("fine_lr", "coarse_lr", "final_lr", "first_lr")


def field_default(cls: type, name: str):
    """The default of field ``name`` of the config dataclass ``cls`` (a fresh one where it has a factory)."""
    found = next(f for f in fields(cls) if f.name == name)
    return found.default_factory() if found.default is MISSING else found.default


def scaled_steps(steps, scale: float):
    """``steps`` times ``scale``, rounded up (0 stays 0); anything but a positive integer as it is,
    for the parser to judge."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0:
        return steps
    return math.ceil(round(steps * scale, 9))  # 100 * 0.07 is 7.000000000000001: 7, not 8


def apply_steps_scale(data: dict) -> dict:
    """``data`` (a config's JSON, its overrides applied) with ``training.steps_scale`` applied and
    removed; ``data`` itself where it sets none."""
    training = data.get("training")
    if not isinstance(training, dict) or "steps_scale" not in training:
        return data
    scale = training["steps_scale"]
    check_steps_scale(scale)
    out = copy.deepcopy(data)
    del out["training"]["steps_scale"]
    training, ml = out["training"], out.get("multilevel")

    def schedule(lr) -> None:
        if isinstance(lr, dict) and "warmup_steps" in lr:
            lr["warmup_steps"] = scaled_steps(lr["warmup_steps"], scale)

    def scale_keys(block: dict, names, defaults: "type | None" = None) -> None:
        """Scale ``block``'s ``names``: those it gives, and with ``defaults`` (its dataclass) the others too."""
        for name in names:
            if name in block:
                block[name] = scaled_steps(block[name], scale)
            elif defaults is not None:
                block[name] = scaled_steps(field_default(defaults, name), scale)

    if not (isinstance(ml, dict) and ml.get("enabled") is True):
        scale_keys(training, ["train_steps"], TrainingConfig)
        schedule(training.get("lr"))
        return out
    if ml.get("strategy") == "ode":
        if ml.get("ode") is None:
            ml["ode"] = {}
        if isinstance(ml["ode"], dict):
            scale_keys(ml["ode"], ODE_STEPS, OdeConfig)
            for name in ODE_SCHEDULES:
                schedule(ml["ode"].get(name))
        return out
    scale_keys(ml, ["growth_mask_steps"])
    if ml.get("growth_operator") == "ligo":
        scale_keys(ml, ["ligo_steps"], MultilevelConfig)
    for level in ml.get("levels") or []:
        if not isinstance(level, dict):
            continue
        scale_keys(level, ("steps_before", "steps_after"))
        schedule(level.get("lr_before"))
        schedule(level.get("lr_after"))
        for visit in level.get("visits") or []:
            if isinstance(visit, dict):
                scale_keys(visit, ("steps",))
                schedule(visit.get("lr"))
    return out
