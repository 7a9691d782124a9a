"""The schedule planner: from the committed study points, the multilevel schedule to use at a model
size and token budget, the saving to expect, and when to train something else instead.

The law is a least-squares fit of the best multilevel schedule's equal-quality FLOPs saving (the
median over seeds, against the point's best-tuned training from scratch) to

    saving = a + b * ln(tokens per parameter) [+ c * ln(parameters)]

(the size term only where the points hold three sizes or more, each measured at two budgets or
more: with one point a size's effect cannot be told from its budget's), with the embedding counted in the
parameters, as Chinchilla does. Its uncertainty is the usual prediction interval of a linear fit
(residual standard error, widened by the point's leverage); its quality is stated by the residual
error and the leave-one-out errors (:func:`leave_one_out`). Two controls decide before the law
does: where the coarse model alone reached the best scratch's final loss at a measured point at
or beyond the budget asked about, the smaller model is the advice; where the interval does not lie
above zero (the saving is not shown), training the full model from scratch is. After them, the
nearest measured point decides between the cycles and growth: where a growth method (progressive
stacking as published, a peer) saved more there than every cycle, it is the candidate. A candidate
is the advice only if every measurement behind it reaches the bar (:data:`BAR`, 25% by default):
the law's saving for a cycle; for a growth, its saving at that point and, given the model's depth,
at the nearest measured depth on every corpus measured there. Under the bar, scratch is. The advice says
what it rests on: the sizes and budgets of the points, and how far beyond them the model asked about
lies (a law without a size term carries its points' saving to any size unchanged).

Beyond the measured sizes (more than :data:`SIZE_MARGIN` times the largest point's parameters, or
under the smallest's over it) there is no advice: nothing measured stands behind one, and at the
scale people pretrain a law fitted to models of a few million parameters may say the opposite of
the published scaling laws. The planner then says what was measured (sizes, tokens per parameter,
seeds) and what the published laws say at the model's budget (:func:`published_regime`: Hoffmann
et al. 2022's compute-optimal 20 tokens per parameter); what it carries over from its points is
returned as extrapolated (``extrapolated_advice``), never as the advice.
"""

import dataclasses
import math
from typing import Optional, Sequence

import numpy


# the FLOPs saving at equal quality a method must be expected to reach before it is advised: under
# it, the moving parts of a schedule (levels, transitions, their tuning) are not worth their risk
BAR = 0.25
# how far beyond the measured sizes (a factor on the parameters) the planner still advises: a model
# up to twice the largest measured one (or half the smallest) is near enough to what was measured
SIZE_MARGIN = 2.0
# Hoffmann et al. (2022, "Chinchilla"): compute-optimal training takes about 20 tokens per parameter,
# and "near" it, within a factor of 2 (the loss's optimum is flat there)
COMPUTE_OPTIMAL_TPP = 20.0
NEAR_OPTIMAL = 2.0


@dataclasses.dataclass(frozen=True)
class StudyPoint:
    """One study point, as the planner reads it."""

    point: str
    study: str
    shape: str
    parameters: int
    tokens_per_parameter: float
    method: Optional[str]  # the best multilevel schedule (None: none has an equal-quality saving)
    saving: Optional[float]  # its median equal-quality FLOPs saving
    schedule: Optional[dict]  # its shape (schedule_of)
    control_seeds: Optional[tuple]  # the seeds in which the coarse model alone reached scratch's loss,
    # and the seeds it ran: (reached, ran); None where no control was run
    growth: Optional[tuple] = None  # the best growth method measured there (progressive stacking or
    # a peer) and its median equal-quality saving: (method, saving); None where none reached scratch
    growth_point: Optional[str] = None  # the point whose runs measured ``growth`` (a later pin's at the
    # same shape and budget); None: this point's own
    late: Optional[dict] = None  # the late expansion's best run there (savings.best_late); None: not run
    growth_run: Optional[dict] = None  # what growth did there, saving or not (savings.growth_verdict);
    # None: no growth ran
    corpus: Optional[str] = None  # the text it was trained on; None: the embedded default
    seeds: Optional[int] = None  # the seeds its runs were trained with; None: not recorded

    @property
    def layers(self) -> int:
        """The full model's depth (its shape is ``<layers>x<hidden>``)."""
        return int(self.shape.split("x")[0])

    @property
    def smaller_model_suffices(self) -> Optional[bool]:
        """The control's verdict: the coarse model alone reached scratch's loss in some seed."""
        return None if self.control_seeds is None else self.control_seeds[0] > 0


def schedule_of(multilevel: dict, steps: int) -> dict:
    """The shape of a two-level schedule (a ``multilevel`` block of a run made for a ``steps``-step
    scratch budget): the cycle, the coarse share (first coarse visit over scratch's steps), the
    second visit's length over the first's, E_a (fine steps before coalescing over scratch's steps)."""
    levels = multilevel["levels"]
    coarse = levels[1]  # a cycle's coarse visits, or growth's steps before growing
    visits = coarse.get("visits") or [{"steps": coarse["steps"] if "steps" in coarse else coarse["steps_before"]}]
    return {"cycle": multilevel.get("cycle", "v"), "num_levels": multilevel.get("num_levels", len(levels)),
            "coarse_share": visits[0]["steps"] / steps,
            "revisit": visits[1]["steps"] / visits[0]["steps"] if len(visits) > 1 else None,
            "ea": levels[0].get("steps_before", 0) / steps}


@dataclasses.dataclass(frozen=True)
class Fit:
    coefficients: tuple  # a, b[, c]
    covariance: tuple  # (X^T X)^-1, as nested tuples
    residual_std: float
    points: int
    log_tpp_range: tuple  # the ln(tokens per parameter) the fit saw, lowest and highest
    with_size: bool
    parameter_range: tuple  # the parameters of the points the fit saw, fewest and most

    def predict(self, parameters: float, tokens_per_parameter: float) -> tuple[float, float]:
        """The expected saving and the half-width of its prediction interval (one standard error
        of a new point: residual error widened by the leverage)."""
        x = numpy.array(_features(parameters, tokens_per_parameter, self.with_size))
        cov = numpy.array(self.covariance)
        mean = float(x @ numpy.array(self.coefficients))
        return mean, self.residual_std * math.sqrt(1.0 + float(x @ cov @ x))

    def extrapolates(self, tokens_per_parameter: float) -> bool:
        lo, hi = self.log_tpp_range
        return not lo <= math.log(tokens_per_parameter) <= hi


def times_beyond(value: float, lowest: float, highest: float) -> float:
    """How many times ``value`` lies beyond ``[lowest, highest]``: 1 inside it, 10 at ten times the
    highest or a tenth of the lowest."""
    return max(value / highest, lowest / value, 1.0)


def _features(parameters: float, tokens_per_parameter: float, with_size: bool) -> list:
    x = [1.0, math.log(tokens_per_parameter)]
    return x + [math.log(parameters)] if with_size else x


def fit(points: Sequence[StudyPoint]) -> Fit:
    """The law, fitted to the points with a measured saving."""
    measured = [p for p in points if p.saving is not None]
    per_size = {}
    for p in measured:
        per_size[p.parameters] = per_size.get(p.parameters, 0) + 1
    with_size = sum(1 for n in per_size.values() if n >= 2) >= 3
    k = 3 if with_size else 2
    if len(measured) <= k:
        raise ValueError(f"the planner needs more than {k} study points with a measured saving, got {len(measured)}")
    x = numpy.array([_features(p.parameters, p.tokens_per_parameter, with_size) for p in measured])
    y = numpy.array([p.saving for p in measured])
    coefficients, *_ = numpy.linalg.lstsq(x, y, rcond=None)
    residual = y - x @ coefficients
    std = math.sqrt(float(residual @ residual) / (len(measured) - k))
    cov = numpy.linalg.inv(x.T @ x)
    logs = [math.log(p.tokens_per_parameter) for p in measured]
    sizes = [p.parameters for p in measured]
    return Fit(tuple(float(c) for c in coefficients), tuple(tuple(float(v) for v in row) for row in cov), std,
               len(measured), (min(logs), max(logs)), with_size, (min(sizes), max(sizes)))


def leave_one_out(points: Sequence[StudyPoint]) -> list[dict]:
    """Each measured point predicted by the law fitted to all the others."""
    out = []
    for held in points:
        if held.saving is None:
            continue
        others = fit([p for p in points if p is not held])
        mean, half = others.predict(held.parameters, held.tokens_per_parameter)
        out.append({"point": held.point, "measured": held.saving, "predicted": mean, "interval": half,
                    "error": mean - held.saving})
    return out


def _distance(p: StudyPoint, parameters: float, tokens_per_parameter: float) -> float:
    return math.hypot(math.log(p.tokens_per_parameter / tokens_per_parameter), math.log(p.parameters / parameters))


def late_verdict(points: Sequence[StudyPoint], parameters: float, tokens_per_parameter: float,
                 layers: Optional[int] = None) -> Optional[dict]:
    """What the late expansion did at the measured point nearest the model asked about (in depth
    first, then in size and budget): its best run's method, final loss above the best-tuned
    scratch and saving (None: it never reached scratch), with that point's depth, size and budget;
    None where no point ran it."""
    measured = [p for p in points if p.late is not None]
    if not measured:
        return None
    at = min(measured, key=lambda p: (abs(math.log(p.layers / (layers or p.layers))),
                                      _distance(p, parameters, tokens_per_parameter)))
    return {"point": at.point, **at.late, "layers": at.layers, "parameters": at.parameters,
            "tokens_per_parameter": at.tokens_per_parameter}


def growth_at_depth(points: Sequence[StudyPoint], layers: Optional[int]) -> list[dict]:
    """What growth did at the measured depth nearest ``layers``, on every corpus measured there
    (``growth_verdict`` with the point, its corpus and depth), or [] without ``layers``. A saving
    measured at 4 layers on one corpus is not evidence for 16 layers on another: these are."""
    measured = [p for p in points if p.growth_run is not None]
    if layers is None or not measured:
        return []
    depth = min({p.layers for p in measured}, key=lambda d: (abs(math.log(d / layers)), -d))
    return [{"point": p.point, "corpus": p.corpus, "layers": p.layers, **p.growth_run}
            for p in measured if p.layers == depth]


def published_regime(parameters: float, tokens: float) -> dict:
    """What the published scaling laws say of training a model of ``parameters`` on ``tokens``:
    ``regime`` ``"near compute-optimal"`` (within :data:`NEAR_OPTIMAL` of Hoffmann et al.'s 20 tokens
    per parameter), ``"larger than compute-optimal"`` (fewer tokens: a smaller model on more tokens
    reaches a lower loss with the same FLOPs) or ``"past compute-optimal"`` (more tokens: trained
    longer, as models are for cheaper inference); and the compute-optimal model for the same training
    FLOPs (6 N D, and D = 20 N)."""
    tpp = tokens / parameters
    optimal = math.sqrt(6 * parameters * tokens / (6 * COMPUTE_OPTIMAL_TPP))
    regime = ("larger than compute-optimal" if tpp < COMPUTE_OPTIMAL_TPP / NEAR_OPTIMAL else
              "past compute-optimal" if tpp > COMPUTE_OPTIMAL_TPP * NEAR_OPTIMAL else "near compute-optimal")
    return {"regime": regime, "tokens_per_parameter": tpp, "compute_optimal_parameters": optimal,
            "compute_optimal_tokens": COMPUTE_OPTIMAL_TPP * optimal}


def measured_ranges(points: Sequence[StudyPoint]) -> dict:
    """What the study points measured: their number, and the range of their parameters, tokens per
    parameter and seeds (None where no point records its seeds)."""
    seeds = [p.seeds for p in points if p.seeds is not None]
    return {"points": len(points), "parameters": [min(p.parameters for p in points), max(p.parameters for p in points)],
            "tokens_per_parameter": [min(p.tokens_per_parameter for p in points),
                                     max(p.tokens_per_parameter for p in points)],
            "seeds": [min(seeds), max(seeds)] if seeds else None, "size_margin": SIZE_MARGIN}


def plan(points: Sequence[StudyPoint], parameters: float, tokens: float, layers: Optional[int] = None,
         bar: float = BAR) -> dict:
    """The advice for a model of ``parameters`` trained on ``tokens``: ``advice`` (``"multilevel"``,
    ``"growth"``, ``"smaller model"``, ``"scratch"``), the expected saving and its interval, the
    schedule of the nearest measured point (what a multilevel run would use), the growth method that
    saved more than it there (``growth``; then the advice, unless the smaller model's), the control
    that decided, and what the advice rests on: the fit's ranges of tokens per parameter and of
    parameters, how many times beyond each the model lies (``beyond``, 1 inside), whether the law
    has a size term, and the size of the points that decided. With ``layers`` (the model's depth):
    the depths of the law's points and how far beyond them it lies. ``late``: what the late
    expansion did at the nearest point that ran it (:func:`late_verdict`), never the advice unless
    it saved something there. ``bar``: the saving a multilevel schedule or growth must be expected
    to reach to be the advice (the weakest measurement behind it: the law's expected saving, or the
    growth's at the nearest point and, with ``layers``, at the nearest measured depth on every corpus);
    under it, the advice is scratch and ``candidate`` says what fell short and by how much.

    ``measured``: the points' sizes, budgets and seeds (:func:`measured_ranges`); ``published``: what
    the published laws say at this budget (:func:`published_regime`). Beyond the measured sizes
    (``within_measured_sizes`` false) ``advice`` and ``candidate`` are None and what the points' rule
    would have said is ``extrapolated_advice``."""
    if parameters <= 0 or tokens <= 0:
        raise ValueError(f"parameters and tokens must be positive, got {parameters} and {tokens}")
    if not 0 <= bar < 1:
        raise ValueError(f"bar is a share of the FLOPs in [0, 1), got {bar}")
    if layers is not None and layers <= 0:
        raise ValueError(f"layers must be positive, got {layers}")
    tpp = tokens / parameters
    law = fit(points)
    depths = sorted({p.layers for p in points if p.saving is not None})
    mean, half = law.predict(parameters, tpp)
    scheduled = [p for p in points if p.schedule is not None and p.saving is not None]
    nearest = min(scheduled, key=lambda p: _distance(p, parameters, tpp))
    # the control: the coarse model alone reaching scratch's loss at a measured point with at least
    # this many tokens per parameter (it suffices at fewer tokens too: the full model needs more)
    suffices = [p for p in points if p.smaller_model_suffices and p.tokens_per_parameter >= tpp]
    out = {"parameters": parameters, "tokens": tokens, "tokens_per_parameter": tpp, "saving": mean,
           "interval": half, "extrapolated": law.extrapolates(tpp), "fit_points": law.points,
           "tokens_per_parameter_range": [math.exp(v) for v in law.log_tpp_range],
           "parameters_range": list(law.parameter_range), "size_term": law.with_size,
           "beyond": {"parameters": times_beyond(parameters, *law.parameter_range),
                      "tokens_per_parameter": times_beyond(tpp, *(math.exp(v) for v in law.log_tpp_range)),
                      "layers": None if layers is None else times_beyond(layers, depths[0], depths[-1])},
           "schedule": nearest.schedule, "from_point": nearest.point,
           "from_point_size": {"parameters": nearest.parameters, "tokens_per_parameter": nearest.tokens_per_parameter},
           "layers": layers, "layers_range": [depths[0], depths[-1]],
           "late": late_verdict(points, parameters, tpp, layers),
           "control": suffices[0].point if suffices else None,
           "control_seeds": suffices[0].control_seeds if suffices else None,
           "control_size": None if not suffices else {"parameters": suffices[0].parameters,
                                                      "tokens_per_parameter": suffices[0].tokens_per_parameter}}
    # a multilevel schedule only where the law's interval lies above zero: elsewhere it is not
    # shown to pay, and the full model from scratch is the safe advice
    advice = "smaller model" if suffices else "multilevel" if mean - half > 0 else "scratch"
    # a growth method that saved more than every cycle at the nearest measured point (progressive
    # stacking as published did at 80 tokens per parameter): the better choice there, if the
    # smaller model is not
    better = nearest.growth if nearest.growth is not None and nearest.growth[1] > max(nearest.saving, 0.0) else None
    out["growth"] = None if better is None else {"point": nearest.growth_point or nearest.point,
                                                 "method": better[0], "saving": better[1],
                                                 "cycle_method": nearest.method, "cycle_saving": nearest.saving}
    if better is not None and advice != "smaller model":
        advice = "growth"
    out["at_depth"] = growth_at_depth(points, layers)
    out["bar"], out["candidate"] = bar, None
    if advice in ("multilevel", "growth"):
        # the weakest measurement behind the advice; growth at the model's depth counts only where it
        # was measured nearer that depth than the point the advice comes from
        behind = [mean] if advice == "multilevel" else [better[1]]
        if advice == "growth" and out["at_depth"] and layers is not None and (
                abs(math.log(out["at_depth"][0]["layers"] / layers)) < abs(math.log(nearest.layers / layers))):
            # not reached (above scratch at the full budget): nothing saved; under scratch at the full
            # budget with no shorter budget run: not measured, so not counted
            behind += [v["saving"] or 0.0 for v in out["at_depth"] if v["saving"] is not None or v["above_scratch"] > 0]
        if min(behind) < bar:
            out["candidate"] = {"advice": advice, "saving": min(behind)}
            advice = "scratch"
    measured = measured_ranges(points)
    within = times_beyond(parameters, *measured["parameters"]) <= SIZE_MARGIN
    out.update(measured=measured, published=published_regime(parameters, tokens), within_measured_sizes=within,
               extrapolated_advice=None if within else advice)
    if not within:
        return {**out, "advice": None, "candidate": None}
    return {**out, "advice": advice}
