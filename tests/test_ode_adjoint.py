"""The ODE strategy's gradient restriction is the adjoint of its prolongation (MG/OPT), checked by
inner products on random tensors and by the fine model's own loss, differentiated by finite
differences along prolonged coarse directions."""

import pytest
import torch

from megatron_multilevel.config import ModelConfig
from megatron_multilevel.level_maps import LayerSelection
from megatron_multilevel.ode_operators import PROLONGATIONS, prolong, restrict, restrict_gradient

CFG = ModelConfig(kind="gpt", num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64,
                  max_sequence_length=16)


def _model(seed: int = 0):
    from megatron_multilevel.distributed import init_single_process, set_seed
    from megatron_multilevel.models import build_model

    init_single_process()
    set_seed(seed)
    return build_model(CFG)


def _random_like(shapes: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in shapes.items()}


def _dot(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return sum(float((a[n].double() * b[n].double()).sum()) for n in a)


def _prolonged(change: dict, sel: LayerSelection, prolongation: str, fine_shapes: dict) -> dict:
    """``P change``: what :func:`prolong` adds to a fine model for a coarse change (from zero)."""
    zero_fine = {n: torch.zeros(s, dtype=torch.float64) for n, s in fine_shapes.items()}
    zero_coarse = {n: torch.zeros_like(t) for n, t in change.items()}
    return prolong(zero_fine, change, sel, prolongation=prolongation, coarse_start=zero_coarse)


@pytest.mark.parametrize("prolongation", PROLONGATIONS)
@pytest.mark.parametrize("residual_scale", [1, 2])
@pytest.mark.parametrize("parity", [0, 1])
@pytest.mark.parametrize("parametrisation", ["folded", "explicit"])
def test_gradient_restriction_is_the_adjoint_of_prolongation(prolongation, residual_scale, parity, parametrisation):
    """<P^T g, e> = <g, P e> for random fine g and coarse e, every prolongation, scale, parity and
    parametrisation (explicit: no scale in either map, the pair's or neighbours' sums kept)."""
    sel = LayerSelection(CFG, parity, residual_scale, parametrisation)
    fine_shapes = {n: p.shape for n, p in _model().named_parameters()}
    g = _random_like(fine_shapes, 1)
    coarse_shapes = {n: t.shape for n, t in restrict(g, sel).items()}
    e = _random_like(coarse_shapes, 2)
    lhs = _dot(restrict_gradient(g, sel, prolongation), e)
    rhs = _dot(g, _prolonged(e, sel, prolongation, fine_shapes))
    assert lhs == pytest.approx(rhs, rel=1e-12)
    if sel.weight_scale == 2 or prolongation != "correction":  # the parameters' restriction is not it
        assert _dot(restrict(g, sel), e) != pytest.approx(rhs, rel=1e-3)
    else:  # copying both ways, it is
        assert _dot(restrict(g, sel), e) == pytest.approx(rhs, rel=1e-12)


def _loss_at(model, params: dict, batch) -> float:
    from megatron_multilevel.models import language_model_loss

    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n].to(p.dtype))
        loss = float(language_model_loss(model, CFG, *batch))
        for n, p in model.named_parameters():
            p.copy_(saved[n])
    return loss


@pytest.mark.parametrize("prolongation", PROLONGATIONS)
@pytest.mark.parametrize("parametrisation", ["folded", "explicit"])
def test_the_fine_loss_along_prolonged_directions(prolongation, parametrisation):
    """The fine loss's slope along ``P d`` (central finite difference) is ``<P^T g, d>``; folded, a
    coarse direction built to look like descent under the parameters' restriction (``R g``, residual
    branches times 2) but not under the adjoint raises the fine loss, as the adjoint says."""
    from megatron_multilevel.models import language_model_loss
    from megatron_multilevel.plan import parameter_plan

    model = _model(3)
    sel = LayerSelection(CFG, 0, 2, parametrisation)
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, CFG.vocab_size, (4, 17), generator=g)
    batch = (tokens[:, :-1], tokens[:, 1:], torch.ones(4, 16))
    params = {n: p.detach().double() for n, p in model.named_parameters()}
    fine_shapes = {n: t.shape for n, t in params.items()}
    model.zero_grad()
    language_model_loss(model, CFG, *batch).backward()
    grad = {n: p.grad.double() for n, p in model.named_parameters()}
    adj = restrict_gradient(grad, sel, prolongation)

    def slope(direction: dict, eps: float = 1e-2) -> float:
        """Central differences at eps and eps / 2, extrapolated (Richardson): the O(eps^2) error
        cancels, and the steps stay large against the float32 loss's rounding."""
        norm = _dot(direction, direction) ** 0.5
        step = {n: t / norm for n, t in _prolonged(direction, sel, prolongation, fine_shapes).items()}

        def central(h):
            up = _loss_at(model, {n: params[n] + h * step[n] for n in params}, batch)
            down = _loss_at(model, {n: params[n] - h * step[n] for n in params}, batch)
            return (up - down) / (2 * h)

        return norm * (4 * central(eps / 2) - central(eps)) / 3

    # a direction with a real slope (a random one is nearly orthogonal to the gradient, its slope
    # lost in the float32 loss's rounding): the restricted gradient plus noise of the same norm
    noise = _random_like({n: t.shape for n, t in adj.items()}, 5)
    scale = (_dot(adj, adj) / _dot(noise, noise)) ** 0.5
    d = {n: adj[n] + scale * noise[n] for n in adj}
    assert slope(d) == pytest.approx(_dot(adj, d), rel=0.01)
    if parametrisation == "explicit":  # R g is P^T g up to the pair's or neighbours' sums: nothing to build
        return
    # residual-branch outputs against the rest: descent under R g, ascent under P^T g
    rules = parameter_plan(CFG).layer
    residual = {n: any(n.endswith("." + local) and rule.residual for local, rule in rules.items()) for n in adj}
    r2 = sum(float((adj[n] ** 2).sum()) for n in adj if residual[n])
    o2 = sum(float((adj[n] ** 2).sum()) for n in adj if not residual[n])
    b = 2 * r2 / o2
    built = {n: -adj[n] if residual[n] else b * adj[n] for n in adj}
    assert _dot(restrict(grad, sel), built) < 0  # R g calls it descent (-4 r2 + 2 r2 on the residual branches)
    assert _dot(adj, built) == pytest.approx(r2)  # the adjoint: ascent
    assert slope(built) > 0.5 * r2
