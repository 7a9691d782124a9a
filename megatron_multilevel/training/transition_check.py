"""The check of every transition: how much the loss moved on one fixed held-out batch.

Just before a transition, just after it (at the next phase's first step, with that phase's layer
mask in place) and after the next phase's first ``training.transition_check_steps`` steps, the loss
on the validation split's first global batch is measured (a forward pass of one batch, collective).
Each transition gets a ``transition`` record in the metrics, the three losses in the next phase's
summary row (``transition_check``) and one progress line. A transition that preserves the function
(a growth whose new model computes the old one: MSG's mask at 0, ``depth_scaling = "identity"``,
width growth by FPI; no noise, no learned operator; see :func:`preserves_function`) moves the loss
by float rounding only; beyond
``training.transition_check_tolerance`` the run stops with one line (``transition_check = "error"``)
or says it (``"warn"``). Coalescing, interpolation and the ODE strategy's transitions change the
function by design: their jump is recorded, never judged.
"""

from typing import Callable

from megatron_multilevel.config import RunConfig
from megatron_multilevel.training.schedule import Phase


class TransitionJump(RuntimeError):
    """A function-preserving transition moved the loss beyond the tolerance."""


def preserves_function(cfg: RunConfig, phase: Phase, nxt: Phase) -> bool:
    """Whether the transition from ``phase`` into ``nxt`` leaves the model's function unchanged: a
    return to a finer level whose every part preserves it. A growth (the first arrival, nothing to
    interpolate with): no noise, no learned operator, width by FPI, depth by MSG's mask or
    identity layers. A later return: the de-coalesced coarse model alone (``blend`` at alpha 1),
    its depth by identity layers."""
    ml = cfg.multilevel
    if ml.strategy != "coalesce" or nxt.level >= phase.level or ml.perturbation_std:
        return False
    if nxt.arrival == "grow":
        width = not ml.coalesce_width or ml.width_growth == "fpi"
        depth = not ml.coalesce_depth or ml.growth_mask_steps > 0 or ml.depth_scaling == "identity"
        return width and depth and ml.growth_operator != "ligo"
    blended = ml.interpolation == "blend" and ml.alpha_of(nxt.level) == 1.0
    return blended and (not ml.coalesce_depth or ml.depth_scaling == "identity")


class TransitionCheck:
    """Measures and judges the transitions of one run. ``evaluate(level, batches)`` is the
    trainer's held-out loss over ``batches`` global batches of the validation split."""

    def __init__(self, cfg: RunConfig, evaluate: Callable[[int, int], float], record, say):
        self.cfg, self.evaluate, self.record, self.say = cfg, evaluate, record, say
        self.mode = cfg.training.transition_check
        self.steps = cfg.training.transition_check_steps

    def before(self, phase: Phase, nxt: Phase) -> dict:
        """What the next phase's row keeps of the transition about to happen (the model of
        ``phase`` still in place)."""
        if self.mode == "off":
            return {}
        return {"transition_check": {"from_level": phase.level, "preserves_function": preserves_function(
            self.cfg, phase, nxt), "before": self.evaluate(phase.level, 1), "after": None, "after_steps": None}}

    def arrived(self, phase: Phase, row: dict, global_step: int) -> None:
        """At the first step of ``phase`` (its model in place): the loss just after the transition,
        recorded, said and judged."""
        check = row.get("transition_check")
        if not check or check["after"] is not None:
            return
        check["after"] = self.evaluate(phase.level, 1)
        jump = check["after"] - check["before"]
        self.record("transition", level=phase.level, phase=phase.index, global_step=global_step,
                    from_level=check["from_level"], loss_before=check["before"], loss_after=check["after"],
                    jump=jump, preserves_function=check["preserves_function"])
        kind = "function-preserving, " if check["preserves_function"] else ""
        self.say(f"[level {check['from_level']} -> {phase.level}] loss on the check batch {check['before']:.4f} -> "
                 f"{check['after']:.4f} ({kind}jump {jump:+.2e})")
        tolerance = self.cfg.training.transition_check_tolerance
        if check["preserves_function"] and abs(jump) > tolerance:
            line = (f"the transition into phase {phase.index + 1} (level {check['from_level']} -> {phase.level}) "
                    f"preserves the function, but the loss on the check batch moved {check['before']:.6f} -> "
                    f"{check['after']:.6f} ({jump:+.3g}, tolerance {tolerance:g}: "
                    f"training.transition_check_tolerance)")
            if self.mode == "error":
                raise TransitionJump(line + "; stopped, the last checkpoint (before the transition) kept "
                                            "(training.transition_check = \"warn\" goes on)")
            self.say("warning: " + line)

    def due(self, phase: Phase, row: dict, step: int) -> bool:
        """Whether the phase's step ``step`` is the one after which :meth:`settled` measures."""
        check = row.get("transition_check")
        return bool(check) and step == min(self.steps, phase.steps) and check["after_steps"] is None

    def settled(self, phase: Phase, row: dict, step: int, global_step: int) -> None:
        """After the phase's step ``step`` (where :meth:`due`): the loss on the check batch once the
        first ``transition_check_steps`` steps are done."""
        check = row["transition_check"]
        check["after_steps"] = self.evaluate(phase.level, 1)
        check["steps"] = step
        self.record("transition_settled", level=phase.level, phase=phase.index, global_step=global_step,
                    steps=step, loss=check["after_steps"], loss_before=check["before"])
