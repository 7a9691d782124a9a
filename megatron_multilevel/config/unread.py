"""Keys that the run's mode never reads, refused rather than silently ignored.

A key set away from its default where the run never reads it, though whoever set it expects it
to change the run (``training.train_steps`` under a multilevel schedule, LiGO's steps without
LiGO, a schedule for a coarsest level's return that never comes, ...), is one ``ValueError`` line
naming the key and what the run reads instead.

Left alone on purpose: a switch turned off keeps the settings of what it switches, so that turning
a feature off on the command line needs no other change (``multilevel.enabled = false``, the
documented way to train a multilevel config's full model alone; ``multilevel.ode.coherence =
"none"``; ``training.transition_check = "off"``; a phase's steps set to 0;
``parallel.sequence_parallel`` at tensor-parallel size 1); a permission nothing needs
(``multilevel.growth_in_decay``) changes nothing anyone expects; and ``training.lr`` under a
multilevel schedule, which the study's configs derived from a scratch config carry (the kept
``late`` runs among them; the baseline falls back on it where no fine phase trains).
"""

from megatron_multilevel.config.data import DataConfig
from megatron_multilevel.config.scale import field_default
from megatron_multilevel.config.training import TrainingConfig

SHORTER = "to shorten any run, set training.steps_scale in (0, 1] instead (e.g. training.steps_scale=0.1)"


def check_unread_keys(cfg) -> None:
    """Raise a ValueError for the first key of ``cfg`` (a ``RunConfig``) set in a mode that never
    reads it."""
    for check in (_training, _multilevel, _data):
        problem = check(cfg)
        if problem:
            raise ValueError(problem)


def _training(cfg) -> "str | None":
    training, ml = cfg.training, cfg.multilevel
    if ml.enabled and training.train_steps != field_default(TrainingConfig, "train_steps"):
        specs = ml.phase_specs()
        steps = (f"its phases' steps are multilevel.levels[i].steps_before and steps_after (or "
                 f"multilevel.levels[i].visits[j].steps)" if ml.strategy == "coalesce" else
                 "its phases' steps are multilevel.ode.pre_steps, coarse_steps and post_steps per cycle "
                 "(multilevel.ode.cycles) and multilevel.ode.final_steps")
        return (f"training.train_steps = {training.train_steps} is not read by a multilevel run (multilevel.enabled "
                f"is true): {steps}, {sum(s.steps for s in specs)} steps in {len(specs)} phases here; {SHORTER}")
    return None


def _multilevel(cfg) -> "str | None":
    ml = cfg.multilevel
    if not (ml.enabled and ml.strategy == "coalesce"):
        return None  # off: the block is set aside, whatever it holds; the ODE strategy refuses these keys itself
    for key in ("ligo_steps", "ligo_lr"):
        value = getattr(ml, key)
        if ml.growth_operator != "ligo" and value != field_default(type(ml), key):
            return (f"multilevel.{key} = {value!r} is not read: it sets LiGO's depth operator, and "
                    f"multilevel.growth_operator is {ml.growth_operator!r}; set growth_operator 'ligo' (valid "
                    f"choices: copy, ligo, random) or remove multilevel.{key} (its default: "
                    f"{field_default(type(ml), key)!r})")
    if ml.cycle == "grow":
        for key, what in (("interpolation", "how a return meets the model kept from before coalescing"),
                          ("keep_fine", "where the model kept from before coalescing waits")):
            value = getattr(ml, key)
            if value != field_default(type(ml), key):
                return (f"multilevel.{key} = {value!r} is not read: it says {what}, and cycle 'grow' only grows "
                        f"(it returns to no level); remove it, or use cycle 'v', 'w' or 'f'")
    last = len(ml.levels) - 1
    for i, level in enumerate(ml.levels):
        if level.visits is not None:
            given = [key for key in ("steps_before", "lr_before", "steps_after", "lr_after")
                     if getattr(level, key) != field_default(type(level), key)]
            if given:
                return (f"multilevel.levels[{i}].{given[0]} is not read: multilevel.levels[{i}].visits gives the "
                        f"steps and schedule of each of the level's visits; keep one of them")
        if i == last and level.lr_after is not None:
            return (f"multilevel.levels[{i}].lr_after is not read: the coarsest level trains steps_before at "
                    f"lr_before (or its visits); remove it")
        if i == last and level.alpha is not None:
            return (f"multilevel.levels[{i}].alpha is not read: alpha weighs a level rebuilt from the next coarser "
                    f"one, and level {i} is the coarsest; set it on a finer level (multilevel.levels[0..{i - 1}]"
                    f".alpha) or multilevel.alpha")
    return None


def _data(cfg) -> "str | None":
    if cfg.model.kind == "bert":
        return None
    for key in ("masking_probability", "short_sequence_probability"):
        value = getattr(cfg.data, key)
        if value != field_default(DataConfig, key):
            return (f"data.{key} = {value!r} is not read: it is BERT's, and model.kind is {cfg.model.kind!r} "
                    f"(valid choices: gpt, bert); remove it")
    return None
