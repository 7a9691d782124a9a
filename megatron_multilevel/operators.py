"""Coalescing, de-coalescing and interpolation on full (unsharded) tensors.

Pure maths: no ``torch.distributed`` here. Tensor-parallel and ZeRO adapters gather before and
reshard after (``megatron_multilevel.parallel``).

With ``F`` the averaging and ``C`` the copy matrix of a grouping (``level_maps.Grouping``), a
linear weight ``W`` (``out x in``) is coalesced as ``F_out W C_in`` (average partners on the output
side, sum them on the input side) and de-coalesced as ``C_out W F_in`` (copy on the output side,
split evenly on the input side). Both are done with index selects, never with dense matrices,
and ``coalesce(decoalesce(x)) == x`` holds bit for bit: ``(a + a) / 2 == a`` and
``a / 2 + a / 2 == a`` in binary floating point.

Depth: a coarse layer is the average of the (width-coalesced) layers of its group; de-coalescing
copies it into each of them (``depth_scaling`` says how the residual branch is shared).

Growth in width may instead draw the new units of each layer from the layer above (bert2BERT's
AKI, :func:`decoalesce_tensor_aki`; not function-preserving, and not an inverse of coalescing).
"""

from collections import defaultdict
from typing import Mapping, Optional, Sequence

import torch

from megatron_multilevel.config import WIDTH_GROWTHS, ModelConfig, check_alpha
from megatron_multilevel.level_maps import Grouping, LevelMap
from megatron_multilevel.plan import (
    ParamRule,
    is_metadata,
    layer_param_names,
    layer_prefix,
    parameter_plan,
)

StateDict = dict[str, torch.Tensor]


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype


def _check_size(name: str, t: torch.Tensor, dim: int, expected: int, kind: str) -> None:
    if t.shape[dim] != expected:
        raise ValueError(
            f"parameter {name!r} has size {t.shape[dim]} on dim {dim} ({kind}); "
            f"the level map expects {expected}: the level map does not match the model"
        )


def _sum_partners(t: torch.Tensor, dim: int, g: Grouping) -> torch.Tensor:
    """``out[i] = t[first(i)] + t[second(i)]`` along ``dim`` (a new tensor)."""
    n = g.num_coarse
    if g.structure == "halves":
        return torch.add(t.narrow(dim, 0, n), t.narrow(dim, n, n))
    if g.structure == "adjacent":
        pairs = t.unflatten(dim, (n, 2))  # (..., n, 2, ...)
        return torch.add(pairs.select(dim + 1, 0), pairs.select(dim + 1, 1))
    first, second = g.partners
    return t.index_select(dim, first).add_(t.index_select(dim, second))


def _copy_partners(t: torch.Tensor, dim: int, g: Grouping) -> torch.Tensor:
    """``out[j] = t[pi(j)]`` along ``dim`` (a new tensor)."""
    if g.structure == "halves":
        return torch.cat([t, t], dim=dim)
    if g.structure == "adjacent":
        # (..., n, ...) -> (..., n, 2, ...) -> (..., 2n, ...): unit i at 2i and 2i + 1
        return t.unsqueeze(dim + 1).expand(*t.shape[: dim + 1], 2, *t.shape[dim + 1 :]).flatten(dim, dim + 1)
    return t.index_select(dim, g.index)


def _map_width(name: str, t: torch.Tensor, rule: ParamRule, level_map: LevelMap, *, coarsen: bool) -> torch.Tensor:
    out = t.to(_compute_dtype(t))
    if not level_map.width:
        return t.clone()
    for dim, d in enumerate(rule.dims):
        if d.side is None:
            continue
        g = level_map.unit_groupings[d.kind]
        _check_size(name, out, dim, g.num_fine if coarsen else g.num_coarse, d.kind)
        if coarsen:  # average on the output side, sum on the input side
            out = _sum_partners(out, dim, g)
            if d.side == "out":
                out.mul_(0.5)
        else:  # copy on the output side, split evenly on the input side (halved before copying)
            if d.side == "in":
                out = out * 0.5
            out = _copy_partners(out, dim, g)
    if rule.tied_output_norm:
        out = out * (2.0 if coarsen else 0.5)
    return out.to(t.dtype) if out is not t else t.clone()  # always a new tensor


def coalesce_tensor(name: str, t: torch.Tensor, rule: ParamRule, level_map: LevelMap) -> torch.Tensor:
    """Width-coalesce one tensor (``F_out W C_in``); a copy where width is not coalesced."""
    return _map_width(name, t, rule, level_map, coarsen=True)


def decoalesce_tensor(name: str, t: torch.Tensor, rule: ParamRule, level_map: LevelMap) -> torch.Tensor:
    """Width-de-coalesce one tensor (``C_out W F_in``); a copy where width is not coalesced."""
    return _map_width(name, t, rule, level_map, coarsen=False)


def decoalesce_tensor_aki(
    name: str, t: torch.Tensor, upper: torch.Tensor, rule: ParamRule, level_map: LevelMap
) -> torch.Tensor:
    """Widen one tensor of a layer by bert2BERT's advanced knowledge initialisation (AKI), its new
    units drawn from ``upper``, the same tensor of the layer above (the top layer passes its own).

    bert2BERT (Chen et al., ACL 2022, arXiv:2110.07143, width-wise expansion) widens a matrix ``W`` of layer
    ``l`` (its convention ``d_in x d_out``) by FPI in two steps: the in-dimension first, each input
    unit's weights divided by the number of its copies, ``W~(i, *) = W(g_in(i), *) / C(g_in(i))``
    (the weights that read a copied unit split between the copies), then the out-dimension,
    ``U(*, j) = W~(*, g_out(j))`` (each new output unit a copy). AKI keeps the first step, made for
    each layer with its own weights (``W~^l`` from ``W^l``, ``W~^{l+1}`` from ``W^{l+1}``, the same
    split), and fills the out-dimension from both layers: ``U^l(*, j) = W~^l(*, j)`` for the
    ``d_out`` units the small model had, ``W~^{l+1}(*, g_out(j))`` for the new ones; the top
    layer, having none above, uses its own (FPI). Upper layers rather than lower ones because
    neighbouring layers compute alike (the paper's motivation; it reports lower layers worse).

    Here (Megatron weights are ``out x in``; a grouping pairs each unit the small model had with
    its new copy, the pair's second unit, ``Grouping.partners[1]``): the tensor is de-coalesced as
    by FPI (:func:`decoalesce_tensor`: copied on the out side, halved on the in side), and along
    its out-side unit dimension, if it has one, the new units' slices are replaced by those of
    ``upper`` de-coalesced the same way. So in a layer the rows that write a new unit come from
    the layer above, halved on their in side as FPI halves them (the split's normalisation is
    kept: ``C`` is 2 for every unit); the columns that read a new unit, the in side, are this
    layer's own, halved. Every tensor with an out-side unit dimension takes part: the QKV rows of
    a new query group, the FFN input rows of a new FFN unit, and the rows of new hidden units
    (attention and FFN output projections, their biases, the norms' weights and biases).

    Sources, and the readings chosen where they leave it open: the paper's own text was not
    reachable when this was written, so its equation numbers are not given; the equations above
    are as a summary of the paper quotes them (FPI's ``EXPN`` and AKI's out-dimension expansion
    from ``W~^{l+1}``), and the AquilaMoE report (2024, Section 2.2.1) describes AKI the same way
    (FPI widens ``W^(1)`` to ``[w'_1; w'_2; w'_3; w'_1]``, AKI to ``[w'_1; w'_2; w'_3; w'^(2)_1]``,
    the new row the next layer's in-expanded one). The equation is stated for a layer's parameter
    matrices in general, so the hidden dimension's rows take part as the FFN's and the heads' do
    (a third-party reimplementation, MindSpore's model-zoo ``bert2bert``, applies AKI to the FFN
    and the heads only and takes a new unit's reading weights from the upper layer too; not
    followed). Biases and norm vectors are treated as one-row matrices of their out side. The
    paper samples ``g_out`` at random; here the level map's pairing decides which old unit a new
    one copies. Parameters outside the layers (embeddings, final norm, output layer) have no
    upper layer and grow by FPI. Not function-preserving: the grown model computes another
    function than the small one."""
    out = decoalesce_tensor(name, t, rule, level_map)
    if not level_map.width:
        return out
    above = decoalesce_tensor(name, upper, rule, level_map)
    for dim, d in enumerate(rule.dims):
        if d.side == "out":
            new = level_map.unit_groupings[d.kind].partners[1].to(out.device)
            out.index_copy_(dim, new, above.index_select(dim, new))
    return out


def upper_layer(level_map: LevelMap, coarse_layer: int) -> int:
    """The coarse layer AKI draws the new units of ``coarse_layer`` from: the next one, the top
    layer's its own."""
    return min(coarse_layer + 1, level_map.coarse.num_layers - 1)


def check_width_growth(width_growth: str, level_map: LevelMap) -> None:
    """``ValueError`` unless ``width_growth`` (``multilevel.width_growth``) can grow by ``level_map``."""
    if width_growth not in WIDTH_GROWTHS:
        raise ValueError(f"invalid width_growth {width_growth!r}; valid choices are {list(WIDTH_GROWTHS)}")
    if width_growth == "aki" and not level_map.width:
        raise ValueError("width_growth 'aki' draws the units width growth adds from the next layer, and this "
                         "level map does not widen; valid choices here are ['fpi']")


def branch_ratio(level_map: LevelMap) -> float:
    """The fine model's residual-branch multiplier over the coarse model's: 1 without depth-muP,
    ``2 ** -exponent`` under it (its multiplier ``(base / L) ** exponent`` changes with the depth)."""
    return float(level_map.fine.branch_multiplier) / float(level_map.coarse.branch_multiplier)


def keeps_branches(level_map: LevelMap, keep_branches: bool = False) -> bool:
    """Whether the transition keeps each kept layer's branch as the coarse model computed it:
    ``identity`` depth scaling, or a growth that masks the layers it adds (MSG: ``keep_branches``).
    Those growths preserve the function; under depth-muP they rescale each residual branch's output
    (weights and optimizer state) by the multipliers' ratio (:func:`branch_ratio`). The others copy
    the weights and let each level's multiplier act: under CompleteP, plain copies are then Euler
    steps of the coarse layer's step, as Bu's expansion makes them."""
    return level_map.depth and (keep_branches or level_map.depth_scaling == "identity")


def _residual_scale(level_map: LevelMap, rule: ParamRule, degree: int = 1, keep_branches: bool = False) -> float:
    """What coalescing multiplies a residual-branch output's pair average by: 2 (the sum of the
    pair's residual branches) when each layer is an Euler step (``ode``, ``identity``), times, where
    the transition keeps the branches (:func:`keeps_branches`), the depth multipliers' ratio to the
    power ``degree`` (1 for parameters; an optimizer state's ``config.STATE_DEGREE``: in gradient
    units the ratio acts inversely)."""
    if not rule.residual:
        return 1.0
    euler = 2.0 if level_map.depth and level_map.depth_scaling in ("ode", "identity") else 1.0
    return euler * (branch_ratio(level_map) ** degree if keeps_branches(level_map, keep_branches) else 1.0)


def _times(t: torch.Tensor, factor: float) -> torch.Tensor:
    return t if factor == 1.0 else (t.to(_compute_dtype(t)) * factor).to(t.dtype)


def coalesce_layers(fine_layers: Sequence[Mapping[str, torch.Tensor]], level_map: LevelMap, *,
                    degree: int = 1) -> StateDict:
    """One coarse layer from the fine layers of its depth group (names local to the layer).

    ``fine_layers`` holds two layers when depth is coalesced, else one. ``degree``: 1 for
    parameters, an optimizer state's ``config.STATE_DEGREE`` for that state (:func:`_residual_scale`).
    """
    assert len(fine_layers) == (2 if level_map.depth else 1)
    rules = parameter_plan(level_map.fine).layer
    names = list(fine_layers[0])
    for other in fine_layers[1:]:
        if set(other) != set(names):
            raise ValueError(f"layers of one depth group differ in parameters: {sorted(set(other) ^ set(names))}")
    out = {}
    for name in names:
        if is_metadata(name):
            continue
        rule = _lookup(rules, name)
        parts = [coalesce_tensor(name, layer[name], rule, level_map) for layer in fine_layers]
        if len(parts) == 1:
            out[name] = parts[0]
            continue
        dtype = parts[0].dtype
        mean = (parts[0].to(_compute_dtype(parts[0])) + parts[1].to(_compute_dtype(parts[1]))) * 0.5
        out[name] = (mean * _residual_scale(level_map, rule, degree)).to(dtype)
    return out


def decoalesce_layer(coarse_layer: Mapping[str, torch.Tensor], level_map: LevelMap, member: int = 0, *,
                     upper: Optional[Mapping[str, torch.Tensor]] = None, degree: int = 1,
                     keep_branches: bool = False) -> StateDict:
    """The fine layer de-coalesced from one coarse layer, as the ``member``-th layer (0 or 1) of its
    depth group (``depth_groups``). Both copy it, but for the residual-branch outputs: halved in
    each with ``ode`` scaling, kept by the first and zero in the second with ``identity``; where the
    transition keeps the branches (``identity``, or ``keep_branches``: MSG's masked growth), under
    depth-muP divided by the multipliers' ratio (:func:`branch_ratio`, to the power ``degree`` for
    an optimizer state), so that a kept branch computes what it computed. With ``upper`` (the
    coarse layer above, ``upper_layer``; at least ``coarse_layer``'s names), width grows by AKI
    (:func:`decoalesce_tensor_aki`) instead of FPI. Every tensor returned is new (never one of
    ``coarse_layer``'s), so each call's layer is independent."""
    assert member in (0, 1) and (member == 0 or level_map.depth), member
    rules = parameter_plan(level_map.fine).layer
    identity = level_map.depth and level_map.depth_scaling == "identity"
    ratio = branch_ratio(level_map) ** degree if keeps_branches(level_map, keep_branches) else 1.0
    out = {}
    for name, t in coarse_layer.items():
        if is_metadata(name):
            continue
        rule = _lookup(rules, name)
        fine = (decoalesce_tensor(name, t, rule, level_map) if upper is None
                else decoalesce_tensor_aki(name, t, upper[name], rule, level_map))
        if identity and rule.residual:
            out[name] = _times(fine, 1.0 / ratio) if member == 0 else torch.zeros_like(fine)
            continue
        out[name] = _times(fine, 1.0 / _residual_scale(level_map, rule, degree, keep_branches))
    return out


def group_member(level_map: LevelMap, fine_layer: int) -> int:
    """Which layer of its depth group ``fine_layer`` is (0 or 1; 0 when depth is not coalesced)."""
    if not level_map.depth:
        return 0
    return 0 if fine_layer in level_map.layers.partners[0].tolist() else 1


def depth_groups(level_map: LevelMap) -> list[tuple[int, ...]]:
    """The fine layers of each coarse layer, in coarse layer order."""
    if not level_map.depth:
        return [(i,) for i in range(level_map.fine.num_layers)]
    first, second = level_map.layers.partners
    return list(zip(first.tolist(), second.tolist()))


def coarse_layer_of(level_map: LevelMap, fine_layer: int) -> int:
    """The coarse layer that fine layer ``fine_layer`` is de-coalesced from."""
    return level_map.layers.assignment[fine_layer] if level_map.depth else fine_layer


def coalesce_model_params(params: Mapping[str, torch.Tensor], level_map: LevelMap) -> StateDict:
    """Coalesce the parameters outside the transformer layers (embeddings, norms, heads)."""
    rules = parameter_plan(level_map.fine).model
    return {name: coalesce_tensor(name, t, _lookup(rules, name), level_map) for name, t in params.items()}


def decoalesce_model_params(params: Mapping[str, torch.Tensor], level_map: LevelMap) -> StateDict:
    """De-coalesce the parameters outside the transformer layers."""
    rules = parameter_plan(level_map.fine).model
    return {name: decoalesce_tensor(name, t, _lookup(rules, name), level_map) for name, t in params.items()}


def _lookup(rules: dict, name: str) -> ParamRule:
    if name not in rules:
        raise ValueError(f"parameter {name!r} is not in the multilevel plan; known: {sorted(rules)}")
    return rules[name]


def split_layers(state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig, num_layers: int, role: str):
    """``(non-layer params, [{local name: tensor} per layer])`` of a state dict of a model of ``cfg``'s
    parameters with ``num_layers`` layers; unknown or missing names raise."""
    plan = parameter_plan(cfg)
    model, layers = {}, defaultdict(dict)
    for name, t in state_dict.items():
        if is_metadata(name):
            continue
        layer, _ = plan.rule(name)
        if layer is None:
            model[name] = t
        else:
            layers[layer][name.split(".", 3)[3]] = t
    if sorted(layers) != list(range(num_layers)):
        raise ValueError(
            f"the {role} state dict has layers {sorted(layers)}, the level map expects "
            f"{num_layers}: the level map does not match the model"
        )
    missing = sorted(set(plan.model) - set(model))
    specs = (layer_param_names(cfg, te=False), layer_param_names(cfg, te=True))
    for i, layer in layers.items():
        if set(layer) not in specs:
            missing += [f"layers.{i}.{n}" for n in sorted(specs[0] - set(layer))]
    if missing:
        raise ValueError(f"the {role} state dict lacks parameters of the model: {missing[:8]}")
    return model, [layers[i] for i in range(num_layers)]


def coalesce(state_dict: Mapping[str, torch.Tensor], level_map: LevelMap, *, degree: int = 1) -> StateDict:
    """The coarse model's parameters (an optimizer state's, with its ``degree``) from the fine
    model's full state dict."""
    fine_layers = level_map.fine.num_layers
    model, layers = split_layers(state_dict, level_map.fine, fine_layers, "fine")
    out = coalesce_model_params(model, level_map)
    for k, members in enumerate(depth_groups(level_map)):
        coarse = coalesce_layers([layers[i] for i in members], level_map, degree=degree)
        prefix = layer_prefix(level_map.coarse, k)
        out.update({prefix + name: t for name, t in coarse.items()})
    return out


def decoalesce(state_dict: Mapping[str, torch.Tensor], level_map: LevelMap, *, width_growth: str = "fpi",
               degree: int = 1, keep_branches: bool = False) -> StateDict:
    """The fine model's parameters (an optimizer state's, with its ``degree``) de-coalesced from
    the coarse model's full state dict; with ``width_growth`` "aki", every layer widened by AKI
    (:func:`decoalesce_tensor_aki`); ``keep_branches``: as for MSG's masked growth
    (:func:`decoalesce_layer`)."""
    check_width_growth(width_growth, level_map)
    coarse_layers = level_map.coarse.num_layers
    model, layers = split_layers(state_dict, level_map.fine, coarse_layers, "coarse")
    out = decoalesce_model_params(model, level_map)
    for j in range(level_map.fine.num_layers):
        k = coarse_layer_of(level_map, j)
        prefix = layer_prefix(level_map.fine, j)
        upper = layers[upper_layer(level_map, k)] if width_growth == "aki" else None
        fine = decoalesce_layer(layers[k], level_map, group_member(level_map, j), upper=upper, degree=degree,
                                keep_branches=keep_branches)
        out.update({prefix + name: t for name, t in fine.items()})
    return out


def interpolate(
    fine_before: Mapping[str, torch.Tensor], decoalesced: Mapping[str, torch.Tensor], alpha: float
) -> StateDict:
    """``(1 - alpha) * fine_before + alpha * decoalesced``, parameter by parameter.

    ``fine_before`` is the fine model as it was just before coalescing (alpha 0 returns it,
    alpha 1 returns the de-coalesced model: the direction of the paper's Figure 5).
    """
    check_alpha(alpha)
    names = _same_parameters("interpolate", fine_before, decoalesced)
    return {name: interpolate_tensor(fine_before[name], decoalesced[name], alpha) for name in names}


def _same_parameters(op: str, first: Mapping[str, torch.Tensor], *others: Mapping[str, torch.Tensor]) -> list[str]:
    """The parameter names of ``first`` (metadata left out), after checking that every model in
    ``others`` has the same names and shapes; a mismatch is a ``ValueError`` naming ``op``."""
    names = [n for n in first if not is_metadata(n)]
    for other in others:
        other_names = {n for n in other if not is_metadata(n)}
        if set(names) != other_names:
            raise ValueError(f"{op}: the models differ in parameters: {sorted(set(names) ^ other_names)[:8]}")
    for name in names:
        shapes = [tuple(first[name].shape)] + [tuple(other[name].shape) for other in others]
        if len(set(shapes)) > 1:
            raise ValueError(f"{op}: {name!r} has shapes {' and '.join(map(str, shapes))}")
    return names


def correct(
    fine_before: Mapping[str, torch.Tensor], decoalesced_end: Mapping[str, torch.Tensor],
    decoalesced_start: Mapping[str, torch.Tensor], alpha: float,
) -> StateDict:
    """``fine_before + alpha * (decoalesced_end - decoalesced_start)``, parameter by parameter: the
    coarse-grid correction of multigrid (the full approximation scheme). The coarse model's change
    over its visit, de-coalesced, is added to the fine model it was coalesced from, whose own
    detail (what coalescing averages away) is kept, where interpolation keeps only ``1 - alpha``
    of it. A coarse visit that changes nothing returns ``fine_before`` exactly."""
    check_alpha(alpha)
    out = {}
    for name in _same_parameters("correct", fine_before, decoalesced_end, decoalesced_start):
        a, end, start = fine_before[name], decoalesced_end[name], decoalesced_start[name]
        dtype = _compute_dtype(a)
        change = end.to(dtype) - start.to(dtype)
        out[name] = (a.to(dtype) + alpha * change).to(a.dtype)
    return out


def correct_model(fine_before: Mapping[str, torch.Tensor], coarse_end: Mapping[str, torch.Tensor],
                  level_map: LevelMap, alpha: float) -> StateDict:
    """The fine model after a coarse visit, by the coarse-grid correction on full state dicts:
    ``fine_before + alpha * (decoalesce(coarse_end) - decoalesce(coalesce(fine_before)))``; the
    coarse model the visit started from is ``coalesce(fine_before)``, made again."""
    return correct(fine_before, decoalesce(coarse_end, level_map),
                   decoalesce(coalesce(fine_before, level_map), level_map), alpha)


def interpolate_tensor(a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    """``(1 - alpha) * a + alpha * b`` in one pass; exactly ``a`` at 0 and exactly ``b`` at 1
    (``torch.lerp`` computes from the nearer endpoint)."""
    dtype = _compute_dtype(a)
    return torch.lerp(a.to(dtype), b.to(dtype), alpha).to(a.dtype)
