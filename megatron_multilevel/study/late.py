"""The late single expansion's configs (Bu, "Scaling depth capacity via zero/one-layer model
expansion", ICML 2026) and its source-model control, beside the other methods'
(``variants.py``), and the warmup-stable-decay schedule any method's config can be put on.

``late``: a model of ``layers`` transformer layers (the paper's one-layer source; ``L / 2^n`` here,
since each growth doubles depth) trains ``share`` of the steps, is expanded once to the full depth
(a grow cycle through levels that train no step: the transitions compose, and only the first and
the last level train), and the full model trains the rest. The paper's zero-layer source (the
embeddings and the output layer only) is not built: Megatron-Core's transformer block needs at least
one layer. New layers start as ``init`` says:

- ``copy``: copies of the trained layer (``depth_scaling`` none);
- ``copy-ode``: copies whose residual branches' outputs are halved at each doubling (``depth_scaling``
  ode: 1/2^n in all, the one layer's step taken as 2^n Euler steps; the 1/L branch multiplier of
  depth-muP, with which the paper trains both depths);
- ``identity``: copies with their residual branches' output weights zero (function-preserving);
- ``random``: Megatron-Core's fresh initialisation (``growth_operator`` random);
- ``random-identity``: fresh, with zero residual outputs (function-preserving).

With ``optimizer_state`` map the trained layer keeps its Adam moments and ``grown_moments`` says
whether the new layers' start at zero (the paper's fresh state) or copy the trained layer's. Under
``budget`` tokens (the paper's accounting) the run takes scratch's steps, so it spends fewer FLOPs;
under ``flops`` it takes as many steps as scratch's FLOPs buy.

``source``: the ``layers``-layer model alone, on scratch's steps (``tokens``) or FLOPs.
"""

import copy
import dataclasses
import math

from megatron_multilevel.config import OdeConfig, load_config, match_optimizer_rate
from megatron_multilevel.flops import flops_per_token

LATE_INITS = {
    "copy": dict(growth_operator="copy", depth_scaling="none"),
    "copy-ode": dict(growth_operator="copy", depth_scaling="ode"),
    "identity": dict(growth_operator="copy", depth_scaling="identity"),
    "random": dict(growth_operator="random", depth_scaling="none"),
    "random-identity": dict(growth_operator="random", depth_scaling="identity"),
}
DECAYS = ("cosine", "linear", "1-sqrt")


def doublings(num_layers: int, layers: int) -> int:
    """How many depth doublings grow ``layers`` layers into ``num_layers``; ValueError where none do."""
    n = round(math.log2(num_layers / layers)) if layers >= 1 else -1
    if layers < 1 or n < 1 or layers * 2 ** n != num_layers:
        valid = [num_layers // 2 ** i for i in range(1, num_layers.bit_length()) if num_layers % 2 ** i == 0]
        raise ValueError(f"late_layers {layers}: the expansion doubles depth, so the source model of a "
                         f"{num_layers}-layer model has one of {valid} layers")
    return n


def with_schedule(config: dict, *, decay=None, decay_fraction=None, min_ratio=None, grown_moments=None) -> dict:
    """``config`` with every learning-rate schedule in it (from scratch, each level's, each visit's)
    given the decay shape, decay fraction and final ratio that are not None: a warmup-stable-decay
    schedule with ``decay_fraction`` below 1 (under ``lr_schedule`` continue, one over the run); and
    a growth that carries the optimizer state (a grow cycle, ``optimizer_state`` map) given
    ``grown_moments`` where it is not None."""
    change = {k: v for k, v in dict(decay=decay, decay_fraction=decay_fraction, min_ratio=min_ratio).items()
              if v is not None}
    if decay is not None and decay not in DECAYS:
        raise ValueError(f"invalid decay {decay!r}; valid choices are {list(DECAYS)}")
    out = copy.deepcopy(config)
    ml = out.get("multilevel", {})
    if grown_moments is not None and ml.get("cycle") == "grow" and ml.get("optimizer_state") == "map":
        ml["grown_moments"] = grown_moments
    if not change:
        return out
    schedules = [out.get("training", {}).get("lr")]
    for level in out.get("multilevel", {}).get("levels", []):
        schedules += [level.get("lr_before"), level.get("lr_after")]
        schedules += [visit.get("lr") for visit in level.get("visits") or []]
    for lr in schedules:
        if lr is not None:
            lr.update(change)
    ode = ml.get("ode") if ml.get("strategy") == "ode" else None
    if ode is not None and ml.get("lr_schedule") == "continue":  # one schedule over the run: every phase's
        for key in ("fine_lr", "coarse_lr", "final_lr", "first_lr"):
            if ode.get(key) is not None:
                ode[key].update(change)
    elif ode is not None:  # the cycles keep their constant rates; the final phase takes the decay
        _ode_final_decay(ode, change)
    return out


def _ode_final_decay(ode: dict, change: dict) -> None:
    """The ODE block's final phase given ``change``, its decay fraction rescaled from the run's steps
    to the phase's (a decay over the last 20% of the run is one over that many of its final steps)."""
    steps = {key: ode.get(key, getattr(OdeConfig, key)) for key in
             ("cycles", "pre_steps", "coarse_steps", "post_steps", "final_steps")}
    final = ode.get("final_lr") or dict(ode.get("fine_lr") or {})
    final.update(change)
    if "decay_fraction" in change and steps["final_steps"]:
        total = steps["cycles"] * (steps["pre_steps"] + steps["coarse_steps"] + steps["post_steps"])
        total += steps["final_steps"]
        # the steps a from-scratch schedule of the run's length decays over (its warm-up excluded,
        # as training.schedule.lr_factor counts them), as a share of the final phase's
        warmup = (ode.get("first_lr") or {}).get("warmup_steps", 0)
        decay = max(1, round(change["decay_fraction"] * max(1, total - warmup)))
        final["decay_fraction"] = min(1.0, decay / steps["final_steps"])
    ode["final_lr"] = final


def with_depth_mup(config: dict, exponent=None, base_layers: int = 1) -> dict:
    """``config`` with every model in it under depth-muP (``exponent``, at ``base_layers``; None:
    ``config`` as it is). The levels' models are the fine model's, halved: they follow it."""
    if exponent is None:
        return config
    out = copy.deepcopy(config)
    out.setdefault("model", {}).update(depth_mup_base_layers=base_layers, depth_mup_exponent=exponent)
    return out


def with_optimizer(config: dict, optimizer: str, lr: float, adam_lr: "float | None" = None) -> dict:
    """``config`` with ``--optimizer``'s optimizer at ``lr`` (``size``: ``config`` as it is); Muon's
    auxiliary Adam at ``adam_lr``."""
    from megatron_multilevel.study.sizes import muon

    if optimizer == "size":
        return config
    if optimizer != "muon":
        raise ValueError(f"invalid optimizer {optimizer!r}; valid choices are ['size', 'muon']")
    # no gradient clipping, as Muon's recipes train (its update is orthogonalised, whatever the norm)
    return {**copy.deepcopy(config), "optimizer": muon(lr, adam_lr=adam_lr), "gradient_clipping": 0.0}


def mup_suffix(args) -> str:
    """What a scratch run's name gains under ``--depth-mup`` (its runs apart from the plain ones)."""
    return "" if args.depth_mup is None else f"-mup{args.depth_mup:g}-base{args.depth_mup_base}"


def late_configs(scratch: dict, *, steps: int, fine_lr: float, warmup: int, share: float = 0.8, layers: int = 1,
                 init: str = "copy", optimizer_state: str = "map", grown_moments: str = "zero",
                 lr_schedule: str = "continue", after_warmup: int = 0, budget: str = "tokens") -> dict[str, dict]:
    """The ``late`` and ``source`` configs for ``scratch`` (a from-scratch config of the full model
    trained ``steps`` steps at ``fine_lr`` with ``warmup``; its schedule's decay, decay fraction and
    final ratio are kept for both)."""
    if init not in LATE_INITS:
        raise ValueError(f"invalid late_init {init!r}; valid choices are {list(LATE_INITS)}")
    if not 0.0 < share < 1.0:
        raise ValueError(f"invalid late_share {share!r}; it must be in (0, 1)")
    if budget not in ("tokens", "flops"):
        raise ValueError(f"invalid budget {budget!r}; valid choices are ['tokens', 'flops']")
    fine = load_config(scratch).model
    n = doublings(fine.num_layers, layers)
    small = dataclasses.replace(fine, num_layers=layers)
    seq = scratch.get("data", {}).get("seq_length", fine.max_sequence_length)
    r = flops_per_token(small, seq) / flops_per_token(fine, seq)
    total = steps if budget == "tokens" else int(steps / (share * r + 1.0 - share))
    small_steps = max(1, round(share * total))
    after = total - small_steps
    if after < 1:
        raise ValueError(f"late: {small_steps} steps of the {layers}-layer model leave no full-depth steps")
    kept = {k: v for k, v in scratch["training"]["lr"].items() if k in ("decay", "decay_fraction", "min_ratio")}
    moments = {"grown_moments": grown_moments} if optimizer_state == "map" else {}
    levels = ([{"steps_before": 0, "steps_after": after, "lr_after": {"peak": fine_lr, "warmup_steps": after_warmup}}]
              + [{"steps_before": 0, "lr_before": {"peak": fine_lr}} for _ in range(n - 1)]
              + [{"steps_before": small_steps, "lr_before": {"peak": fine_lr, "warmup_steps": warmup}}])
    late = copy.deepcopy(scratch)
    late["training"].pop("train_steps", None)
    late["multilevel"] = {
        "enabled": True, "cycle": "grow", "num_levels": n + 1, "alpha": 1.0, "coalesce_width": False,
        "coalesce_depth": True, "depth_pairing": "halves", "optimizer_state": optimizer_state,
        "lr_schedule": lr_schedule, **LATE_INITS[init], **moments, "levels": levels}
    late = with_schedule(late, **kept)
    source = copy.deepcopy(scratch)
    source["model"] = dataclasses.asdict(small)
    source["training"]["train_steps"] = steps if budget == "tokens" else int(steps / r)
    source["training"]["lr"] = {**scratch["training"]["lr"], "peak": fine_lr,
                                "warmup_steps": round(warmup * source["training"]["train_steps"] / steps)}
    match_optimizer_rate(source, fine_lr)
    return {"late": late, "source": source}


# Bu's recipe as published (ICML 2026): Muon (its auxiliary Adam for the embeddings, the output
# layer, norms and biases), weight decay 0.01, no gradient clipping; one WSD schedule with a 2%
# warm-up and a 10% decay to 0; a one-layer source expanded at tau of the steps to full depth with
# the same rate after it (no second warm-up), the new layers copies of the trained layer or fresh,
# not function-preserving; the new layers' optimizer state zero.
BU_WARMUP, BU_DECAY, BU_WEIGHT_DECAY = 0.02, 0.10, 0.01
BU_INITS = ("copy", "random")


def bu_configs(scratch: dict, *, steps: int, lr: float, adam_lr: "float | None" = None, share: float = 0.9,
               init: str = "copy", decay: str = "1-sqrt") -> dict[str, dict]:
    """Bu's late expansion with its published settings (``bu``), beside its scratch under the same
    optimizer and schedule (``scratch``), from ``scratch`` (a from-scratch config of the full model)
    for ``steps`` steps, Muon at the rate ``lr`` and its auxiliary Adam at ``adam_lr`` (None: ``lr``).
    The expansion must come before the decay: a ``share`` past it is refused
    (``multilevel.growth_in_decay``)."""
    from megatron_multilevel.study.sizes import muon

    if init not in BU_INITS:
        raise ValueError(f"invalid late_init {init!r} for Bu's recipe; valid choices are {list(BU_INITS)}")
    warmup = max(1, round(BU_WARMUP * steps))
    base = copy.deepcopy(scratch)
    base["optimizer"] = muon(lr, adam_lr=adam_lr, weight_decay=BU_WEIGHT_DECAY)
    base["gradient_clipping"] = 0.0
    base["training"]["lr"] = {**base["training"]["lr"], "peak": lr, "warmup_steps": warmup, "decay": decay,
                              "decay_fraction": min(1.0, BU_DECAY * steps / max(1, steps - warmup)),
                              "min_ratio": 0.0}
    late = late_configs(base, steps=steps, fine_lr=lr, warmup=warmup, share=share, layers=1, init=init,
                        optimizer_state="map", grown_moments="zero", lr_schedule="continue", after_warmup=0,
                        budget="tokens")["late"]
    load_config(late)  # the expansion before the decay, or one clear line
    return {"bu": late, "scratch": base}


def add_schedule_flags(p) -> None:
    """The benchmark's flags of the schedule every method runs (warmup-stable-decay), of scratch's
    decay shapes, and of the late expansion (``tools/benchmark_savings.py``)."""
    p.add_argument("--scratch-decay", "--scratch_decay", nargs="+", default=["cosine"], choices=list(DECAYS),
                   help="training from scratch with each of these decay shapes (the best run is the baseline)")
    p.add_argument("--decay", choices=list(DECAYS), default=None,
                   help="every method's decay shape but scratch's (default: each method's own, cosine)")
    p.add_argument("--decay-fraction", "--decay_fraction", type=float, default=None,
                   help="every method's decay over this last share of its schedule's steps, the peak held before "
                        "(warmup-stable-decay; under --lr-schedule continue one schedule over the run)")
    p.add_argument("--min-ratio", "--min_ratio", type=float, default=None,
                   help="every run's final learning rate over its peak, scratch's too (default: the config's 0.1)")
    p.add_argument("--depth-mup", "--depth_mup", type=float, default=None, metavar="EXPONENT",
                   help="every run (scratch's too, named apart) under depth-muP: residual branches times "
                        "(base / L) ** EXPONENT, the layers' rate times (base / L) ** (1 - EXPONENT); 1: CompleteP, "
                        "0.5: Depth-muP")
    p.add_argument("--depth-mup-base", "--depth_mup_base", type=int, default=1,
                   help="--depth-mup: the depth whose model is the standard one (the late source's, 1)")
    p.add_argument("--optimizer", choices=["size", "muon"], default="size",
                   help="every run (scratch's too, named apart) with the size's optimizer, or with DeepSpeed's Muon "
                        "at the same rates (bu always runs Muon)")
    p.add_argument("--muon-adam-lr", "--muon_adam_lr", type=float, default=None,
                   help="--optimizer muon and bu: the peak rate of Muon's auxiliary Adam (embeddings, output layer, "
                        "norms, biases); the swept rate (--scratch-lr, --fine-lr) is the Muon half's (default: the same)")
    p.add_argument("--late-share", "--late_share", type=float, default=0.8,
                   help="late: share of the steps the small model trains before the expansion (the paper's tau)")
    p.add_argument("--late-layers", "--late_layers", type=int, default=1,
                   help="late, source: layers of the small model (the full depth over a power of 2)")
    p.add_argument("--late-init", "--late_init", choices=list(LATE_INITS), default="copy",
                   help="late: the new layers: copies, copies with zero residual outputs (identity), fresh "
                        "(random), or fresh with zero residual outputs (random-identity)")
    p.add_argument("--grown-moments", "--grown_moments", choices=["map", "zero"], default=None,
                   help="growths with --optimizer-state map: the new layers' Adam moments zero or the copied "
                        "layer's (default: late zero, the others as they are)")
