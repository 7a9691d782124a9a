"""Restriction and prolongation of the multilevel ODE strategy, on full (unsharded) tensors.

Pure maths: no ``torch.distributed`` here; ``parallel/ode_transition.py`` applies these functions to
live models, one parameter at a time.

A pre-LN layer is one Euler step ``x <- x + h F(x; theta_l)``. The coarse model of a
:class:`~megatron_multilevel.level_maps.LayerSelection` takes every other layer with a step
``h = residual_scale`` times as long. ``F``'s residual-branch outputs (``ParamRule.residual``:
attention output projection and second FFN linear, weight and bias) are linear in their own
parameters, so ``h F(x; theta) = F(x; S theta)``, ``S`` multiplying those parameters by ``h``. The
selection's ``parametrisation`` says where ``h`` goes, and ``s = selection.weight_scale`` is its
factor on the weights: ``h`` (``folded``: ``S`` applied to the weights, the coarse forward pass
plain) or 1 (``explicit``: the weights copied, the coarse forward pass multiplying each
residual-branch output by ``h``, ``residual_step.py``). From the same fine model both compute the
same function. Everything below is written with ``s``:

- restriction ``R``: coarse layer ``i`` is a copy of fine layer ``2i + parity`` with its
  residual-branch outputs multiplied by ``s``; the shared parameters (embeddings, final norm,
  output layer) are copied. ``R`` is linear and acts on optimizer moments the same way
  (``degree`` 2 for squared moments). Gradients restrict differently, by the adjoint of the
  prolongation (:func:`restrict_gradient`).
- prolongation: the fine model before restriction plus the coarse change, ``theta_h + c P (theta_H_end
  - theta_H_start)``, where ``P`` divides the residual-branch outputs by ``s`` and writes coarse layer
  ``i``'s change into fine layer ``2i + parity`` (``correction``), and also into the skipped layer of
  the same pair (``constant``) or the mean of the two neighbouring changes into each skipped layer
  (``linear``). With no coarse change the fine model comes back bit for bit; multiplying and dividing
  by 1 or 2 is exact in binary floating point.

Why the explicit form takes ``s = 1`` throughout. Write ``L_f(psi)`` for the folded coarse loss
and ``L_e(phi) = L_f(S phi)`` for the explicit one: the explicit coarse model at ``phi = theta``
(the copied fine layers) computes what the folded one computes at ``psi = S theta``. A change of
``phi`` is a change of the fine parameters as they stand, so ``P`` writes it back unscaled; such a
``P`` only copies and sums with weights, and its adjoint (``<P^T g, e> = <g, P e>``) sums the
receiving fine layers' gradients with the same weights and scales nothing. The optimizer moments,
in gradient units of parameters that are the fine ones, carry over with factor ``1 = s ** degree``.
In the folded form a change of ``psi`` is ``S`` times one of ``theta`` and ``grad L_f = S^-1 grad
L_e`` (the chain rule), hence ``1 / s`` in ``P`` and ``P^T`` and the moments' degrees -1 and -2.
"""

from typing import Literal, Mapping, Optional, Sequence

import torch

from megatron_multilevel.config import ModelConfig
from megatron_multilevel.level_maps import LayerSelection
from megatron_multilevel.operators import split_layers
from megatron_multilevel.plan import is_metadata, layer_prefix, parameter_plan

StateDict = dict[str, torch.Tensor]
Prolongation = Literal["correction", "constant", "linear"]
PROLONGATIONS = ("correction", "constant", "linear")


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype


def scale_residuals(layer: Mapping[str, torch.Tensor], selection: LayerSelection, factor: float) -> StateDict:
    """A copy of one layer (names local to the layer) with its residual-branch outputs times ``factor``."""
    return _layer_residuals_times(layer, selection.fine, factor)


def _layer_residuals_times(layer: Mapping[str, torch.Tensor], cfg: ModelConfig, factor: float) -> StateDict:
    """A copy of one layer of ``cfg``'s architecture with its residual-branch outputs times ``factor``."""
    rules = parameter_plan(cfg).layer
    out = {}
    for name, t in layer.items():
        if is_metadata(name):
            continue
        if name not in rules:
            raise ValueError(f"parameter {name!r} is not in the multilevel plan; known: {sorted(rules)}")
        if rules[name].residual and factor != 1.0:
            out[name] = (t.to(_compute_dtype(t)) * factor).to(t.dtype)
        else:
            out[name] = t.clone()
    return out


def restrict_layer(fine_layer: Mapping[str, torch.Tensor], selection: LayerSelection, *, degree: int = 1) -> StateDict:
    """The coarse layer made from its fine layer: its residual-branch outputs times
    ``weight_scale ** degree`` (1 for parameters; -1 and -2 for optimizer moments, which are in
    gradient and squared-gradient units: ``parallel.ode_transition.DEGREE``)."""
    return scale_residuals(fine_layer, selection, float(selection.weight_scale) ** degree)


def unrestrict_layer(coarse_layer: Mapping[str, torch.Tensor], selection: LayerSelection, *,
                     degree: int = 1) -> StateDict:
    """The inverse of :func:`restrict_layer` (used to carry optimizer moments back)."""
    return scale_residuals(coarse_layer, selection, float(selection.weight_scale) ** -degree)


def restrict(state_dict: Mapping[str, torch.Tensor], selection: LayerSelection, *, degree: int = 1) -> StateDict:
    """The coarse model's parameters (or gradients, or moments) from the fine model's full state dict."""
    model, layers = split_layers(state_dict, selection.fine, selection.fine.num_layers, "fine")
    out = {name: t.clone() for name, t in model.items()}
    for i, j in enumerate(selection.layers):
        coarse = restrict_layer(layers[j], selection, degree=degree)
        out.update({layer_prefix(selection.coarse, i) + name: t for name, t in coarse.items()})
    return out


def fold_step(coarse: Mapping[str, torch.Tensor], selection: LayerSelection) -> StateDict:
    """The parameters of a coarse model of ``selection`` with its forward step folded into its
    residual-branch outputs: the plain coarse model of the same function (for an explicit one, the
    folded one's parameters; for a folded one, a copy)."""
    return _every_layer_times(coarse, selection.fine, selection.coarse.num_layers, float(selection.forward_step),
                              "coarse")


def fold_branch_multiplier(state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig) -> StateDict:
    """The parameters of the plain model (no branch multiplier) that computes what a depth-muP model
    of ``cfg`` computes: its branch multiplier folded into every residual branch's output weights
    and biases (a copy for a model without depth-muP)."""
    return _every_layer_times(state_dict, cfg, cfg.num_layers, float(cfg.branch_multiplier), "model")


def unfold_branch_multiplier(state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig) -> StateDict:
    """The inverse of :func:`fold_branch_multiplier`: the parameters of a depth-muP model of ``cfg``
    that computes what the plain model of ``state_dict`` computes (a copy without depth-muP)."""
    return _every_layer_times(state_dict, cfg, cfg.num_layers, 1.0 / float(cfg.branch_multiplier), "model")


def _every_layer_times(state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig, num_layers: int, factor: float,
                       role: str) -> StateDict:
    """A copy of a full state dict of ``num_layers`` layers of ``cfg``'s architecture with every
    layer's residual-branch outputs times ``factor``."""
    model, layers = split_layers(state_dict, cfg, num_layers, role)
    out = {name: t.clone() for name, t in model.items()}
    for i, layer in enumerate(layers):
        out.update({layer_prefix(cfg, i) + name: t for name, t in _layer_residuals_times(layer, cfg, factor).items()})
    return out


def restrict_gradient(gradient: Mapping[str, torch.Tensor], selection: LayerSelection,
                      prolongation: "Prolongation" = "correction") -> StateDict:
    """How a gradient of the fine loss restricts: the adjoint ``P^T`` of the prolongation of coarse
    changes (:func:`prolong` with ``correction_scale`` 1), so that ``<P^T g, e> = <g, P e>`` for every
    coarse change ``e``. MG/OPT needs this restriction for the gradients of its first-order
    coherence: a descent direction of the corrected coarse objective is then one of the fine loss
    once prolonged. Coarse layer ``i`` gathers every fine layer that receives its change, weighted
    as it receives it (``prolongation_sources``), with the residual-branch outputs divided by the
    weight scale ``s`` (``P`` divides them so; the map is diagonal, its own transpose: 1 in the
    explicit parametrisation); the shared parameters' gradients are copied. Not :func:`restrict`:
    where parameters restrict as ``theta_H = s theta_h``, gradients scale by ``1 / s`` (the chain
    rule), and with ``constant`` or ``linear`` prolongation a coarse layer's gradient sums its
    pair's or neighbours'."""
    model, layers = split_layers(gradient, selection.fine, selection.fine.num_layers, "fine")
    out = {name: t.clone() for name, t in model.items()}
    sums: list[Optional[StateDict]] = [None] * selection.coarse.num_layers
    for j, sources in enumerate(prolongation_sources(selection, prolongation)):
        if not sources:
            continue
        scaled = scale_residuals(layers[j], selection, 1.0 / selection.weight_scale)
        for i, weight in sources:
            part = scaled if weight == 1.0 else {name: t * weight for name, t in scaled.items()}
            sums[i] = part if sums[i] is None else {name: sums[i][name] + t for name, t in part.items()}
    for i, layer in enumerate(sums):
        assert layer is not None, f"coarse layer {i} receives no fine layer's gradient"
        out.update({layer_prefix(selection.coarse, i) + name: t for name, t in layer.items()})
    return out


def coarse_change(start: Mapping[str, torch.Tensor], end: Mapping[str, torch.Tensor], selection: LayerSelection,
                  correction_scale: float, *, layer: bool) -> StateDict:
    """``correction_scale * (end - start)`` in the fine model's scale (residual-branch outputs of a
    layer divided by the weight scale), in the compute dtype."""
    out = {}
    for name, e in end.items():
        if is_metadata(name):
            continue
        out[name] = e.to(_compute_dtype(e)) - start[name].to(_compute_dtype(e))
    if layer:
        out = scale_residuals(out, selection, 1.0 / selection.weight_scale)
    if correction_scale != 1.0:
        out = {name: t * correction_scale for name, t in out.items()}
    return out


def prolongation_sources(selection: LayerSelection, prolongation: Prolongation) -> list[list[tuple[int, float]]]:
    """For each fine layer, the coarse layers whose change it receives, with their weights."""
    if prolongation not in PROLONGATIONS:
        raise ValueError(f"invalid prolongation {prolongation!r}; valid choices are {list(PROLONGATIONS)}")
    coarse_of = {j: i for i, j in enumerate(selection.layers)}
    sources = []
    for j in range(selection.fine.num_layers):
        if j in coarse_of:
            sources.append([(coarse_of[j], 1.0)])
        elif prolongation == "correction":
            sources.append([])
        elif prolongation == "constant":  # the coarse layer of the pair (2k, 2k + 1)
            sources.append([(j // 2, 1.0)])
        else:
            neighbours = [coarse_of[n] for n in (j - 1, j + 1) if n in coarse_of]
            sources.append([(i, 1.0 / len(neighbours)) for i in neighbours])
    return sources


def add_change(before: Mapping[str, torch.Tensor], changes: Sequence[tuple[Mapping[str, torch.Tensor], float]]
               ) -> StateDict:
    """``before + sum(weight * change)``, parameter by parameter; a copy of ``before`` with no change."""
    out = {}
    for name, t in before.items():
        if is_metadata(name):
            continue
        if not changes:
            out[name] = t.clone()
            continue
        total = None
        for change, weight in changes:
            part = change[name] if weight == 1.0 else change[name] * weight
            total = part if total is None else total + part
        out[name] = (t.to(total.dtype) + total).to(t.dtype)
    return out


def prolong(fine_before: Mapping[str, torch.Tensor], coarse_end: Mapping[str, torch.Tensor],
            selection: LayerSelection, *, prolongation: Prolongation = "correction", correction_scale: float = 1.0,
            coarse_start: Optional[Mapping[str, torch.Tensor]] = None) -> StateDict:
    """The fine model after a coarse phase: ``fine_before`` plus the prolonged coarse change.

    ``coarse_start`` is the coarse model the phase started from; None means ``restrict(fine_before)``
    (what the restriction wrote).
    """
    if coarse_start is None:
        coarse_start = restrict(fine_before, selection)
    fine_model, fine_layers = split_layers(fine_before, selection.fine, selection.fine.num_layers, "fine")
    start_model, start_layers = split_layers(coarse_start, selection.fine, selection.coarse.num_layers, "coarse start")
    end_model, end_layers = split_layers(coarse_end, selection.fine, selection.coarse.num_layers, "coarse end")
    out = add_change(fine_model, [(coarse_change(start_model, end_model, selection, correction_scale, layer=False),
                                   1.0)])
    changes = [coarse_change(s, e, selection, correction_scale, layer=True) for s, e in zip(start_layers, end_layers)]
    for j, sources in enumerate(prolongation_sources(selection, prolongation)):
        layer = add_change(fine_layers[j], [(changes[i], w) for i, w in sources])
        out.update({layer_prefix(selection.fine, j) + name: t for name, t in layer.items()})
    return out
