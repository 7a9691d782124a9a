"""The compared methods, declared once: what each is, which family it belongs to, where it comes
from, the benchmark's flags that set it, and, for the growths the planner can write into a config,
the settings it writes.

Ground floor (standard library only). The benchmark (``tools/benchmark_savings.py --methods``), the
study's report (a run's family from its name, the best cycle and the best growth of a point) and the
planner (``tools/plan_schedule.py``: the growths it names and writes) all read this table; the
configs each method runs are made in ``study/variants.py`` (``late.py`` for the late expansion).
Adding a method: a row here, its config in the study, and its run-time piece where it has one
(``growth/``, a cycle, an operator).
"""

from dataclasses import dataclass, field
from typing import Literal, Optional

Kind = Literal["baseline", "control", "cycle", "growth"]


@dataclass(frozen=True)
class Method:
    """One compared method."""

    name: str
    """Its name in ``--methods`` and the start of every run named after it."""
    kind: Kind
    """``baseline`` (training from scratch), ``control`` (a smaller model alone), ``cycle`` (a
    multilevel cycle of this project) or ``growth`` (a published growth method)."""
    family: str
    """The prefix that names its runs' family (``vcycle2`` and ``vcycle3`` are ``vcycle``)."""
    about: str
    """What it is, in one line."""
    source: str = ""
    """The paper it comes from."""
    flags: tuple[str, ...] = ()
    """The benchmark's flags that only this method reads."""
    advice: Optional[dict] = field(default=None, hash=False, compare=False)
    """For a growth the planner writes: its settings of ``study.variants.variant_configs`` and how
    the benchmark runs it (``about``)."""


METHODS: tuple[Method, ...] = (
    Method("scratch", "baseline", "scratch", "the full model from scratch, the best of its rates and schedules",
           flags=("--scratch-lr", "--scratch-decay-fraction", "--scratch-decay", "--scratch-optimizer")),
    Method("coarse", "control", "coarse", "the cycles' coarse model alone, on the same FLOPs"),
    Method("vcycle2", "cycle", "vcycle", "the 2-level V-cycle", "Zou et al., ICLR 2024"),
    Method("vcycle3", "cycle", "vcycle", "the 3-level V-cycle", "Zou et al., ICLR 2024"),
    Method("wcycle2", "cycle", "wcycle", "the 2-level W-cycle"),
    Method("fcycle2", "cycle", "fcycle", "the 2-level F-cycle (the recipe's cycle)", flags=("--fcycle-revisit",)),
    Method("stacking", "growth", "stacking", "progressive stacking: half depth, stacked once",
           "Gong et al., ICML 2019",
           advice={"about": "progressive stacking as published (multilevel.cycle \"grow\": the half-depth model for half "
                            "the steps, stacked with depth_scaling \"ode\", optimizer_state \"reset\" and lr_schedule "
                            "\"restart\": `tools/benchmark_savings.py --methods stacking --depth-scaling ode`)",
                   "settings": dict(depth_scaling="ode", coarse_share=0.5, optimizer_state="reset",
                                    lr_schedule="restart")}),
    Method("stacking3", "growth", "stacking", "progressive stacking in three stages (quarter, half, full depth)",
           "Gong et al., ICML 2019"),
    Method("gstack", "growth", "gstack", "G_stack: a quarter- (or half-) depth model stacked at once",
           "Du et al., NeurIPS 2024", flags=("--gstack-factor", "--gstack-share"),
           advice={"about": "G_stack as published (a quarter-depth model, stacked four times, AdamW and the schedule "
                            "restarted: `tools/benchmark_savings.py --methods gstack --gstack-factor 4 "
                            "--gstack-share 0.1`)",
                   "settings": dict(gstack_factor=4, gstack_share=0.1, optimizer_state="reset",
                                    lr_schedule="restart")}),
    Method("msg", "growth", "msg", "MSG: stacked copies masked in", "Yao et al., ICLR 2024",
           flags=("--msg-mask-share",),
           advice={"about": "MSG with the recipe's levers (multilevel.cycle \"grow\": the half-depth model for 10% of "
                            "the steps, its layers copied and the copies masked in over 5% of the steps "
                            "(growth_mask_steps), optimizer_state \"map\", lr_schedule \"continue\", no second warm-up: "
                            "`tools/benchmark_savings.py --methods msg --coarse-share 0.1 --optimizer-state map "
                            "--lr-schedule continue --after-warmup 0 --msg-mask-share 0.05`)",
                   "settings": dict(coarse_share=0.1, optimizer_state="map", lr_schedule="continue", after_warmup=0,
                                    msg_mask_share=0.05)}),
    Method("ligo", "growth", "ligo", "LiGO: a learned depth operator", "Wang et al., ICLR 2023",
           flags=("--ligo-share",)),
    Method("bert2bert", "growth", "bert2bert", "bert2BERT: width and depth at once, FPI or AKI",
           "Chen et al., ACL 2022", flags=("--bert2bert-init",)),
    Method("late", "growth", "late", "the late single expansion: a k-layer model grown once to full depth",
           "Bu, ICML 2026", flags=("--late-share", "--late-layers", "--late-init")),
    Method("bu", "growth", "bu", "Bu's late expansion as published: Muon, weight decay 0.01, no clipping, WSD with a "
           "2% warm-up and a 10% decay, one layer expanded at tau (before the decay) by copies or fresh layers",
           "Bu, ICML 2026", flags=("--late-share", "--late-init")),
    Method("source", "control", "source", "the late expansion's k-layer model alone, on scratch's tokens (or FLOPs)",
           flags=("--late-layers",)),
    Method("ode2", "cycle", "ode", "the multilevel ODE strategy", "Lauga et al., 2025", flags=("--ode",)),
)

NAMES = tuple(m.name for m in METHODS)
CYCLE_FAMILIES = tuple(dict.fromkeys(m.family for m in METHODS if m.kind == "cycle"))
GROWTH_FAMILIES = tuple(dict.fromkeys(m.family for m in METHODS if m.kind == "growth"))
ADVISED = {m.name: m.advice for m in METHODS if m.advice is not None}
"""The growths the planner can write, with what each is and its settings."""
FAMILIES = tuple(dict.fromkeys(m.family for m in METHODS))


def family(name: str) -> str:
    """The family of a run named ``name`` (``fcycle2-depth-ea0.1``: ``fcycle``; ``scratch-lr0.004``:
    ``scratch``)."""
    for prefix in FAMILIES:
        if name.startswith(prefix):
            return prefix
    raise AssertionError(f"method {name!r} has no family")
