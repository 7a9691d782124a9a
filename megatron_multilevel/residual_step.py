"""The explicit step of the ODE strategy's coarse models: forward hooks that multiply each
transformer layer's residual-branch outputs by ``h``, so that the layer computes ``x + h F(x)``.

Megatron's ``TransformerLayer`` adds what its ``self_attention`` and ``mlp`` modules return to the
residual stream in its bias-dropout-add; each returns ``(output, bias)``, the bias kept apart for
that add (None without ``add_bias_linear``). A hook on each module multiplies both by ``h``, which
is what multiplying the output projection's weight and bias by ``h`` does (the folded step of
``ode_operators``), up to float rounding. The hooks see the module's output after its own
tensor-parallel reduction, so they hold at any TP size and with sequence parallelism; under ZeRO-3
DeepSpeed's hooks only gather and release the parameters around them.
"""

import torch

BRANCHES = ("self_attention", "mlp")
# The attribute of a branch module that holds its hook.
ATTRIBUTE = "residual_step_hook"


class ResidualStep:
    """A forward hook on one residual branch: its ``(output, bias)`` times ``step``."""

    def __init__(self, module: torch.nn.Module, step: float):
        self.step = step
        self.handle = module.register_forward_hook(self)

    def __call__(self, module, args, output):
        out, bias = output
        return out * self.step, None if bias is None else bias * self.step


def _branches(model: torch.nn.Module) -> list[torch.nn.Module]:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    assert layers, f"{type(model).__name__} has no transformer layer"
    return [getattr(layer, name) for layer in layers for name in BRANCHES]


def set_residual_step(model: torch.nn.Module, step: float) -> torch.nn.Module:
    """``model``, its forward pass multiplying every layer's residual-branch outputs by ``step``
    (1: no hook). Idempotent: a later call replaces the step of an earlier one."""
    for branch in _branches(model):
        if hasattr(branch, ATTRIBUTE):
            getattr(branch, ATTRIBUTE).handle.remove()
            delattr(branch, ATTRIBUTE)
        if step != 1:
            setattr(branch, ATTRIBUTE, ResidualStep(branch, step))
    return model


def residual_step(model: torch.nn.Module) -> float:
    """The step ``model``'s forward pass takes (1 without hooks)."""
    steps = {getattr(branch, ATTRIBUTE).step if hasattr(branch, ATTRIBUTE) else 1 for branch in _branches(model)}
    assert len(steps) == 1, f"the layers take different steps {sorted(steps)}"
    return steps.pop()
