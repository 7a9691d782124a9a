"""The savings benchmark's run configs (``tools/benchmark_savings.py`` drives them): training
from scratch and each compared method within the same budget (:func:`variant_configs`), the
recipe's settings (``RECIPE``), and a config's whole schedule compressed to a fraction of its
budget (:func:`compress`).
"""

import copy
import dataclasses
import math
import warnings
from typing import Sequence

from megatron_multilevel.config import WIDTH_GROWTHS, coarse_model_config, load_config, match_optimizer_rate
from megatron_multilevel.flops import flops_per_token
from megatron_multilevel.methods import ADVISED


def compress(config: dict, fraction: float) -> dict:
    """``config`` with its whole schedule compressed to ``fraction`` of its steps: every phase,
    every warm-up and the growth's own steps (LiGO's operator, MSG's mask), scaled by the same factor (rounded; a phase that had steps keeps at least
    one), so the phases keep their proportions and each learning-rate schedule its shape."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"budget fraction must be in (0, 1], got {fraction}")
    out = copy.deepcopy(config)

    def scaled(steps: int) -> int:
        return max(1, round(steps * fraction)) if steps else 0

    def schedule(lr: "dict | None") -> None:
        if lr and lr.get("warmup_steps"):
            lr["warmup_steps"] = scaled(lr["warmup_steps"])

    ml = out.get("multilevel", {})
    if not ml.get("enabled"):
        training = out.setdefault("training", {})
        training["train_steps"] = scaled(training.get("train_steps", 600))
        schedule(training.get("lr"))
        return out
    if ml.get("strategy") == "ode":  # the cycles stay; each phase of them shrinks
        block = ml.setdefault("ode", {})
        for key in ("pre_steps", "coarse_steps", "post_steps", "final_steps"):
            if key in block:
                block[key] = scaled(block[key])
        for key in ("fine_lr", "coarse_lr", "final_lr", "first_lr"):
            schedule(block.get(key))
        return out
    for key in ("ligo_steps", "growth_mask_steps"):  # the growth's own steps, as the phases'
        if ml.get(key):
            ml[key] = scaled(ml[key])
    for level in ml["levels"]:
        for key in ("steps_before", "steps_after"):
            if level.get(key):
                level[key] = scaled(level[key])
        schedule(level.get("lr_before"))
        schedule(level.get("lr_after"))
        for visit in level.get("visits") or []:
            visit["steps"] = scaled(visit["steps"])
            schedule(visit.get("lr"))
    return out


SHAPES = {"width+depth": {"coalesce_width": True, "coalesce_depth": True},
          "width": {"coalesce_width": True, "coalesce_depth": False},
          "depth": {"coalesce_width": False, "coalesce_depth": True}}


def _level(steps_before: int, peak: float, *, warmup: int = 0, steps_after: int = 0,
           after_peak: "float | None" = None, after_warmup: int = 0, alpha: "float | None" = None) -> dict:
    level = {"steps_before": steps_before, "lr_before": {"peak": peak, "warmup_steps": warmup}}
    if steps_after:
        level["steps_after"] = steps_after
        level["lr_after"] = {"peak": after_peak or peak, "warmup_steps": after_warmup}
    if alpha is not None:
        level["alpha"] = alpha
    return level


def _flops_ratios(base: dict, multilevel: dict) -> list[float]:
    """FLOPs per step of every level of ``multilevel`` over the fine model's."""

    levels = [{"steps_before": 1}] * multilevel["num_levels"]
    with warnings.catch_warnings():  # a probe for the levels' shapes: its rates (defaults) are never trained
        warnings.simplefilter("ignore")
        cfg = load_config({**base, "training": {}, "multilevel": {**multilevel, "enabled": True, "levels": levels,
                                                                  "cycle": "v", "alpha": 0.5}})
    seq = cfg.data.seq_length
    fine = flops_per_token(cfg.model, seq)
    return [flops_per_token(m, seq) / fine for m in cfg.level_models()]


# The recipe (README, "The recipe"), as keyword arguments of :func:`variant_configs`; its method
# is ``fcycle2``. ``configs/gpt_tiny_cpu.json`` is this at 200 steps, the GPT-Base configs at
# 100,000 with the planner's 10% coarse share, the BERT ones at 300,000 with 50%
# (tests/test_savings.py holds them to it), and ``tools/benchmark_savings.py --recipe`` runs it.
RECIPE = dict(shape="depth", depth_pairing="halves", depth_scaling="identity", coarse_share=0.8, ea=0.1,
              fcycle_revisit=0.5, optimizer_state="map", after_warmup=0, lr_schedule="continue",
              interpolation="correction", alpha=1.0)


# The growths the planner names and writes where one saved more than the cycles, by their method's
# name: what each is (``about``) and its keyword arguments of :func:`variant_configs` (``settings``;
# without ``after_warmup``: the run's warm-up again, as published), from the table of methods.
GROWTHS = ADVISED


def variant_configs(base: dict, *, steps: int, fine_lr: float, coarse_lr_factor: "float | None" = None,
                    ea: float = 0.05, coarse_share: float = 0.5, alpha: float = 0.5, warmup: int = 20,
                    after_warmup: int = 20, budget: str = "flops", depth_scaling: str = "none",
                    perturbation_std: float = 0.0, shape: str = "width+depth", depth_pairing: str = "adjacent",
                    fcycle_revisit: float = 0.25, optimizer_state: str = "reset",
                    after_lr_factor: float = 1.0, ode: "dict | None" = None, lr_schedule: str = "restart",
                    interpolation: str = "blend", gstack_factor: int = 4, gstack_share: "float | None" = None,
                    msg_mask_share: float = 0.05, ligo_share: float = 0.01, bert2bert_init: str = "fpi",
                    methods: "Sequence[str] | None" = None) -> dict[str, dict]:
    """Configs of the compared methods: training from scratch for ``steps`` global batches, and
    each other method within the same budget: the same training FLOPs (``budget="flops"``: the
    cheaper steps of coarse levels buy more steps at the fine level) or the same tokens
    (``"tokens"``).

    - ``scratch``: the fine model, ``steps`` steps;
    - ``vcycle2``: ``ea`` of the steps at the fine level, ``coarse_share`` at the coarse level
      (at ``coarse_lr_factor`` times the learning rate, no warm-up), the rest at
      the fine level after de-coalescing and interpolating with ``alpha``;
    - ``vcycle3``: the same shape over three levels (the middle level gets ``ea`` on the way down
      and a third of the remaining fine steps on the way up);
    - ``wcycle2``: the 2-level W-cycle: ``ea`` fine, half the coarse steps, ``ea`` fine, the other
      half, the rest fine;
    - ``fcycle2``: the 2-level F-cycle (full multigrid): ``coarse_share`` of the steps at the coarse
      level from scratch, grown to the fine level (no interpolation partner yet), ``ea`` fine,
      ``fcycle_revisit`` times the first coarse steps at the coarse level again, then the rest
      fine after interpolating with ``alpha``;
    - ``coarse``: the control: the cycles' coarse model (of ``shape``, at the coarse rate) trained
      alone from scratch for the whole budget, with its own warm-up (the same share of its steps
      as scratch's) and decay. Where it reaches scratch's final loss, the smaller model suffices at
      this budget, and a multilevel saving shows only that the full model was not needed yet;
    - ``stacking``: progressive stacking, a half-depth model trained from scratch for
      ``coarse_share`` of the steps, its layers stacked to full depth, the rest at full depth;
    - ``stacking3``: three stages, a quarter-depth model from scratch for half of ``coarse_share``
      of the steps, stacked to half depth for the other half, then to full depth;
    - ``gstack``: G_stack (Du et al., NeurIPS 2024): a model of ``1 / gstack_factor`` of the depth
      (4, the paper's choice, or 2) trained from scratch for ``gstack_share`` of the steps (default
      ``coarse_share``; :func:`gstack_growth_tokens` is the paper's rule for it), then the whole
      model stacked ``gstack_factor`` times (layer ``k`` of the grown model is layer ``k mod L/g`` of
      the small one: halves-stacking, done twice at once for 4, plain copies), the rest at full
      depth with the optimizer and the schedule restarted, as published (``optimizer_state``,
      ``lr_schedule`` and ``after_warmup`` give it the recipe's levers);
    - ``msg``: MSG's layer growth (Yao et al., ICLR 2024): ``stacking``'s schedule, the stacked
      copies masked in (``multilevel.growth_mask_steps``) over ``msg_mask_share`` of the steps, so
      that the grown model computes the small one at growth (``depth_scaling`` none: plain copies,
      as MSG's code makes them; with ``optimizer_state`` map and ``lr_schedule`` continue the old
      layers keep their moments and the run one schedule, as published, but the new layers get
      copied moments where MSG starts them at zero);
    - ``ligo``: LiGO's learned depth operator (Wang et al., ICLR 2023): ``stacking``'s schedule, the
      growth's coefficients trained for ``ligo_share`` of the steps (``multilevel.growth_operator``),
      those steps' FLOPs taken from the steps after growth;
    - ``bert2bert``: bert2BERT's growth (Chen et al., ACL 2022): the half-width, half-depth model
      (at the narrower models' rate) from scratch for ``coarse_share`` of the steps, grown in width
      and in depth by stacking, at once; in width by ``bert2bert_init``: ``fpi``, function-preserving
      copies (FPI: this project's width de-coalescing), or ``aki``, the advanced knowledge
      initialisation (``multilevel.width_growth``: the rows that write each layer's new units from
      the layer above, ``operators.decoalesce_tensor_aki``; not function-preserving);
    - ``ode2``: the multilevel ODE strategy (Lauga et al.): ``ode_cycles`` cycles (default 4) of
      ``ea / 2`` of the steps at the fine level, ``coarse_share / ode_cycles`` at the coarse model
      of every other layer (at the fine rate: it is as wide) and ``ea / 2`` at the fine level
      again, at a constant rate, then the rest at the fine level, its rate decaying as scratch's
      does. ``ea`` 0 leaves out the fine steps of the cycles: the first coarse model then trains
      from the initialisation (warming up as scratch does), and with ``{"cycles": 1,
      "prolongation": "constant"}`` the run is the coarse model first, its change written into both
      layers of every pair, then the fine model (nested iteration). ``ode`` overrides keys of its
      ``multilevel.ode`` block (``cycles`` among them), e.g. ``{"coherence": "none"}``.

    ``after_lr_factor`` scales the fine level's peak learning rate after every return to it
    (and ``after_warmup`` is its warm-up); ``optimizer_state`` is ``multilevel.optimizer_state``
    of the cycles and of stacking (``map``: growing carries the coarse moments, de-coalesced).
    ``interpolation`` is ``multilevel.interpolation`` of the cycles (``correction``: a return adds
    the coarse change to the fine model instead of blending with it; growth is the same).
    ``lr_schedule`` is ``multilevel.lr_schedule`` of every method but scratch (``continue``: one
    schedule over the whole run, each phase at its own peak; the ODE strategy's constant rates in
    the cycles then follow the run's cosine too).

    ``methods`` limits the result to those (and ``scratch``); a method whose schedule does not fit
    the budget is an error only when asked for.

    ``shape`` is what the V-cycles coalesce: ``"width+depth"`` (the paper's), ``"width"`` or
    ``"depth"``. The steps before coalescing count against the budget like any fine step; so do
    coarse steps, at their FLOPs ratio.
    """
    def config(multilevel: dict) -> dict:
        out = copy.deepcopy(base)
        out["multilevel"] = multilevel
        out.get("training", {}).pop("train_steps", None)  # the levels' steps replace it (config/unread.py)
        return out

    if budget not in ("flops", "tokens"):
        raise ValueError(f"invalid budget {budget!r}; valid choices are ['flops', 'tokens']")
    if bert2bert_init not in WIDTH_GROWTHS:
        raise ValueError(f"invalid bert2bert_init {bert2bert_init!r}; valid choices are {list(WIDTH_GROWTHS)}")
    if shape not in SHAPES:
        raise ValueError(f"invalid shape {shape!r}; valid choices are {sorted(SHAPES)}")
    ea_steps = max(1, round(ea * steps))
    coarse = round(coarse_share * steps)
    shape = SHAPES[shape]
    # a narrower model takes a larger learning rate; by default a shallower one of the same width
    # does not (progressive stacking keeps the fine rate too): coarse_lr_factor None is 3 for a
    # narrower coarse model and 1 for a shallower one, a number sets it for either
    narrow_lr = (3.0 if coarse_lr_factor is None else coarse_lr_factor) * fine_lr  # bert2bert's small model
    if coarse_lr_factor is None:
        coarse_lr_factor = 3.0 if shape["coalesce_width"] else 1.0
    if coarse_lr_factor <= 0:
        raise ValueError(f"invalid coarse_lr_factor {coarse_lr_factor!r}; it must be positive")
    coarse_lr = coarse_lr_factor * fine_lr
    narrower = 1.5 if shape["coalesce_width"] else 1.0
    r2 = _flops_ratios(base, {"num_levels": 2, **shape})
    r3 = _flops_ratios(base, {"num_levels": 3, **shape})
    r_stack = _flops_ratios(base, {"num_levels": 2, "coalesce_width": False, "coalesce_depth": True})

    def remaining(coarse_cost: float, *, coarse_steps: int = coarse, fine_before: int = ea_steps) -> int:
        """Fine steps left after ``fine_before`` fine steps and ``coarse_steps`` coarse steps
        costing ``coarse_cost`` fine steps."""
        if budget == "tokens":
            return steps - fine_before - coarse_steps
        return int(steps - fine_before - coarse_cost)

    after = remaining(coarse * r2[1])
    assert after > 0, "the schedule leaves no fine steps after de-coalescing"
    scratch = copy.deepcopy(base)
    scratch["multilevel"] = {"enabled": False}
    scratch.setdefault("training", {})["train_steps"] = steps
    scratch["training"]["lr"] = {"peak": fine_lr, "warmup_steps": warmup}
    match_optimizer_rate(scratch, fine_lr)
    after_lr = after_lr_factor * fine_lr  # the fine level's peak after a return from a coarser one
    common = {"enabled": True, **shape, "alpha": alpha, "depth_scaling": depth_scaling, "lr_schedule": lr_schedule,
              "interpolation": interpolation,
              "depth_pairing": depth_pairing, "perturbation_std": perturbation_std, "optimizer_state": optimizer_state}
    vcycle2 = config({**common, "num_levels": 2, "levels": [
        _level(ea_steps, fine_lr, warmup=warmup, steps_after=after, after_peak=after_lr, after_warmup=after_warmup),
        _level(coarse, coarse_lr),
    ]})
    # three levels: the middle one trains ea_steps on the way down and a share on the way up
    middle_up = max(1, coarse // 4)
    coarsest = coarse - ea_steps - middle_up
    after3 = remaining((ea_steps + middle_up) * r3[1] + coarsest * r3[2])
    vcycle3 = config({**common, "num_levels": 3, "levels": [
        _level(ea_steps, fine_lr, warmup=warmup, steps_after=after3, after_peak=after_lr, after_warmup=after_warmup),
        _level(ea_steps, coarse_lr, steps_after=middle_up, after_peak=coarse_lr, after_warmup=after_warmup),
        _level(coarsest, coarse_lr * narrower),
    ]})
    def grow(levels: list[dict], **change) -> dict:
        """Progressive stacking over ``levels`` (finest first): depth only, at the fine rate."""
        return config({
            "enabled": True, "cycle": "grow", "num_levels": len(levels), "alpha": 1.0, "coalesce_width": False,
            "coalesce_depth": True, "depth_pairing": "halves", "depth_scaling": depth_scaling,
            "optimizer_state": optimizer_state, "lr_schedule": lr_schedule, "levels": levels, **change})

    stack_after = steps - coarse if budget == "tokens" else int(steps - coarse * r_stack[1])
    stacking_levels = [
        _level(0, fine_lr, steps_after=stack_after, after_peak=after_lr, after_warmup=after_warmup),
        _level(coarse, fine_lr, warmup=warmup),
    ]
    stacking = grow(stacking_levels)
    mask_steps = max(1, round(msg_mask_share * steps))
    if (methods is None or "msg" in methods) and not (msg_mask_share > 0 and mask_steps <= stack_after):
        raise ValueError(f"invalid msg_mask_share {msg_mask_share!r}: it must be in (0, {stack_after / steps:.3g}], "
                         f"within the {stack_after} steps after growth")
    msg = grow(stacking_levels, depth_scaling="none", growth_mask_steps=mask_steps)
    # LiGO's learned depth operator on stacking's growth, trained ligo_share of the steps (each a
    # full model's step: taken from the steps after growth under a FLOPs budget)
    ligo_steps = max(1, round(ligo_share * steps))
    ligo_after = stack_after - (ligo_steps if budget == "flops" else 0)
    if (methods is None or "ligo" in methods) and not (ligo_share > 0 and ligo_after > 0):
        raise ValueError(f"invalid ligo_share {ligo_share!r}: it must be positive and leave steps after growth")
    ligo = grow([{**stacking_levels[0], "steps_after": ligo_after}, stacking_levels[1]],
                growth_operator="ligo", ligo_steps=ligo_steps)
    # three-stage stacking (as Gong et al. grow BERT 3 -> 6 -> 12 layers): a quarter-depth model
    # from scratch for half the coarse steps, stacked to half depth for the other half, then to full
    r3_stack = _flops_ratios(base, {"num_levels": 3, "coalesce_width": False, "coalesce_depth": True})
    quarter = coarse // 2
    stack3_after = (steps - coarse if budget == "tokens"
                    else int(steps - quarter * r3_stack[2] - (coarse - quarter) * r3_stack[1]))
    stacking3 = grow([
        _level(0, fine_lr, steps_after=stack3_after, after_peak=after_lr, after_warmup=after_warmup),
        _level(0, fine_lr, steps_after=coarse - quarter, after_peak=after_lr, after_warmup=after_warmup),
        _level(quarter, fine_lr, warmup=warmup),
    ])
    # bert2BERT (Chen et al., ACL 2022): function-preserving width growth (FPI: every new unit a copy
    # of an old one, the weights that read the copies split between them, which is this project's
    # width de-coalescing) or AKI (the new units' rows from the layer above) with depth stacking, as
    # one growth of the half-width, half-depth model (bert2BERT grows width, then depth), the small
    # model at the narrower models' rate
    r_wd = _flops_ratios(base, {"num_levels": 2, **SHAPES["width+depth"]})
    bert2bert = grow([
        _level(0, fine_lr, steps_after=steps - coarse if budget == "tokens" else int(steps - coarse * r_wd[1]),
               after_peak=after_lr, after_warmup=after_warmup),
        _level(coarse, narrow_lr, warmup=warmup),
    ], coalesce_width=True, depth_scaling="none",
       **({"width_growth": "aki"} if bert2bert_init == "aki" else {}))  # fpi: the key left out, as before
    gstack = _gstack(steps, fine_lr, factor=gstack_factor, share=coarse_share if gstack_share is None else gstack_share,
                     budget=budget, warmup=warmup, after_lr=after_lr, after_warmup=after_warmup,
                     ratios=r3_stack,
                     config=config, optimizer_state=optimizer_state, lr_schedule=lr_schedule)
    # W-cycle: two coarse visits of half the coarse steps each, a fine visit of ea_steps between
    half = max(1, coarse // 2)
    wcycle2 = config({**common, "cycle": "w", "num_levels": 2, "levels": [
        _level(ea_steps, fine_lr, warmup=warmup, steps_after=remaining(2 * half * r2[1], coarse_steps=2 * half,
                                                                   fine_before=2 * ea_steps),
               after_peak=after_lr, after_warmup=after_warmup),
        _level(half, coarse_lr),
    ]})
    # F-cycle: the coarse level from scratch (as stacking starts), grown to the fine level, which
    # trains ea_steps, is coalesced again for a second, shorter coarse visit, and returns by
    # interpolating with the fine model it was coalesced from
    first, second = coarse, max(1, round(fcycle_revisit * coarse))
    fcycle2 = config({**common, "cycle": "f", "num_levels": 2, "levels": [
        _level(ea_steps, fine_lr, warmup=after_warmup, steps_after=remaining((first + second) * r2[1],
                                                                       coarse_steps=first + second),
               after_peak=after_lr, after_warmup=after_warmup),
        {"visits": [{"steps": first, "lr": {"peak": coarse_lr, "warmup_steps": warmup}},
                    {"steps": second, "lr": {"peak": coarse_lr, "warmup_steps": 0}}]},
    ]})
    out = {"scratch": scratch, "coarse": _coarse_alone(scratch, steps if budget == "tokens" else int(steps / r2[1]),
                                                       coarse_lr, shape),
           "vcycle2": vcycle2, "vcycle3": vcycle3, "wcycle2": wcycle2, "fcycle2": fcycle2,
           "stacking": stacking, "stacking3": stacking3, "gstack": gstack, "msg": msg, "ligo": ligo, "bert2bert": bert2bert}
    if methods is None or "ode2" in methods:
        out["ode2"] = _ode_variant(steps, fine_lr, ea=ea, coarse_share=coarse_share, budget=budget, r=r_stack[1],
                                   warmup=warmup, ode=ode, lr_schedule=lr_schedule, config=config)
    return out if methods is None else {name: cfg for name, cfg in out.items() if name == "scratch" or name in methods}


def gstack_growth_tokens(parameters: float, flops: float) -> float:
    """G_stack's growth timing: the tokens ``d`` to train the small model on before stacking it, for
    a grown model of ``parameters`` and a budget of ``flops``, by the rule Du et al. fitted (NeurIPS
    2024, "Stacking Your Transformers", Section 5, and the README of their code, tongxuluo/prts):
    ``log10(d) = 0.88 log10(N) + 163.27 / log10(C) - 5.74``. Fitted on models of 410M to 7B
    parameters and budgets of about 1e20 to 1e22 FLOPs: far from there it is an extrapolation (at
    the CPU study's sizes it asks for more tokens than the whole budget holds)."""
    if parameters <= 0 or flops <= 1:
        raise ValueError(f"G_stack's rule needs positive parameters and more than 1 FLOP, got {parameters}, {flops}")
    return 10 ** (0.88 * math.log10(parameters) + 163.27 / math.log10(flops) - 5.74)


def _gstack(steps: int, fine_lr: float, *, factor: int, share: float, budget: str, warmup: int, after_lr: float,
            after_warmup: int, ratios: list[float], config, optimizer_state: str, lr_schedule: str) -> dict:
    """The ``gstack`` method of :func:`variant_configs` (``ratios``: FLOPs per step of the full,
    half- and quarter-depth models over the full one's)."""
    if factor not in (2, 4):
        raise ValueError(f"invalid gstack_factor {factor!r}; valid choices are [2, 4]")
    if not 0.0 < share < 1.0:
        raise ValueError(f"invalid gstack_share {share!r}; it must be in (0, 1)")
    small = max(1, round(share * steps))
    r = ratios[1] if factor == 2 else ratios[2]
    after = steps - small if budget == "tokens" else int(steps - small * r)
    if after <= 0:
        raise ValueError(f"gstack: {small} small-model steps leave no full-depth steps of the {steps}-step budget")
    grown = _level(0, fine_lr, steps_after=after, after_peak=after_lr, after_warmup=after_warmup)
    # 4: two halves-stackings at once, through a half-depth level that trains no step
    middle = [_level(0, fine_lr)] if factor == 4 else []
    return config({
        "enabled": True, "cycle": "grow", "num_levels": 2 if factor == 2 else 3, "alpha": 1.0,
        "coalesce_width": False, "coalesce_depth": True, "depth_pairing": "halves", "depth_scaling": "none",
        "optimizer_state": optimizer_state, "lr_schedule": lr_schedule,
        "levels": [grown, *middle, _level(small, fine_lr, warmup=warmup)]})


def _coarse_alone(scratch: dict, steps: int, peak: float, shape: dict) -> dict:
    """``scratch`` (a from-scratch config of the fine model) for the coarse model of ``shape`` instead:
    ``steps`` steps at ``peak``, its warm-up the same share of its steps as scratch's."""
    out = copy.deepcopy(scratch)
    fine = load_config(scratch).model
    coarse = coarse_model_config(fine, width=shape["coalesce_width"], depth=shape["coalesce_depth"])
    out["model"] = dataclasses.asdict(coarse)
    lr = out["training"]["lr"]
    warmup = round(lr.get("warmup_steps", 0) * steps / out["training"]["train_steps"])
    out["training"].update(train_steps=steps, lr={**lr, "peak": peak, "warmup_steps": warmup})
    match_optimizer_rate(out, peak)
    return out


# the coherence term off (measured: unguarded it diverges, gated it is at best the run without it);
# asked for, it comes with the line search its convergence rests on (and the config's gate)
ODE_DEFAULTS = {"coarse": "alternate", "residual_scale": 2, "prolongation": "correction", "coherence": "none",
                "correction_scale": 1.0, "line_search": False, "optimizer_state": "keep", "cycles": 4}


def _ode_variant(steps: int, fine_lr: float, *, ea: float, coarse_share: float, budget: str, r: float,
                 warmup: int, ode: "dict | None", lr_schedule: str, config) -> dict:
    """The ``ode2`` method of :func:`variant_configs` (``r``: a coarse step's FLOPs over a fine one's)."""
    block = {**ODE_DEFAULTS, **(ode or {})}
    if block["coherence"] == "first_order" and "line_search" not in (ode or {}):
        block["line_search"] = True
    cycles = block["cycles"]
    # ea 0: no smoothing steps, so the first coarse model trains from the fresh initialisation
    # (nested iteration: the coarse level first, as the F-cycle and stacking start)
    smooth = 0 if ea == 0 else max(1, round(ea * steps / 2))
    coarse = max(1, round(coarse_share * steps / cycles))
    spent = cycles * (2 * smooth) + (cycles * coarse if budget == "tokens" else cycles * coarse * r)
    final = int(steps - spent)
    if final <= 0:
        raise ValueError(f"ode2: {cycles} cycles of {smooth} + {coarse} + {smooth} steps leave no fine steps of the "
                         f"{steps}-step budget; give fewer multilevel.ode.cycles or more steps")
    # constant rates in the cycles, the final phase decaying as scratch does; or one decay over all
    constant = {"peak": fine_lr, "warmup_steps": 0, **({} if lr_schedule == "continue" else {"decay": "constant"})}
    # a coarse model trained from the initialisation warms up as scratch does
    coarse_lr = {**constant, "warmup_steps": warmup if smooth == 0 else 0}
    block.update(pre_steps=smooth, coarse_steps=coarse, post_steps=smooth, final_steps=final,
                 fine_lr=constant, coarse_lr=coarse_lr, final_lr={"peak": fine_lr, "warmup_steps": 0})
    if smooth:  # the first fine phase warms up as scratch does; the later ones do not again
        block["first_lr"] = {**constant, "warmup_steps": warmup}
    return config({"enabled": True, "strategy": "ode", "lr_schedule": lr_schedule, "ode": block})
