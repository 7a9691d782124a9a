"""Masked structural growth's layer mask (MSG: Yao et al., "Masked Structural Growth for 2x Faster
Language Model Pre-training", ICLR 2024), for the layers that depth growth adds.

After a level is grown (``multilevel.growth_mask_steps > 0``), the second layer of every depth
group computes ``h + m * (layer(h) - h)`` from its input ``h``: at ``m = 0`` it is the identity, so
the grown model computes exactly the model it was grown from, whatever the new layer's weights
(copies of the smaller model's layers with ``depth_scaling = "none"``, as MSG's code makes them by
default); ``m`` ramps linearly, ``step / growth_mask_steps`` at step ``step`` of the grown level's
phase, and the mask is removed when it reaches 1. The mask is not a parameter: the optimizer never
sees it, and gradients reach the new layers scaled by ``m``. It is a function of the phase's step
only, so a resumed run masks as the uninterrupted one did.

Written here because neither Megatron-Core nor DeepSpeed has a layer mask: a forward hook on
Megatron-Core's ``TransformerLayer`` (whose forward returns ``(hidden_states, context)``). Module
code only: every tensor-parallel rank holds the layer's whole input and output (or the same
sequence shard of both), and the mix is elementwise.
"""

from typing import Optional, Sequence

import torch

from megatron_multilevel.operators import depth_groups


def transformer_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The transformer layers of a Megatron-Core GPT (``decoder``) or BERT (``encoder``) model."""
    stack = getattr(model, "decoder", None) or getattr(model, "encoder", None)
    assert stack is not None and hasattr(stack, "layers"), type(model)
    return stack.layers


def grown_layers(level_map) -> list[int]:
    """The fine layers that growing through ``level_map`` adds: the second of every depth group."""
    assert level_map.depth, "only depth growth adds layers"
    return [group[1] for group in depth_groups(level_map)]


class LayerMask:
    """Mixes the output of ``layers`` with their input at a weight set by :meth:`at`."""

    def __init__(self, layers: Sequence[torch.nn.Module], steps: int):
        assert steps > 0, steps
        self.steps = steps
        self.value = 0.0
        self._handles = [layer.register_forward_hook(self._mix, with_kwargs=True) for layer in layers]

    def at(self, step: int) -> float:
        """Set the mask for step ``step`` (0-based) of the grown level's phase; its value."""
        self.value = min(1.0, step / self.steps)
        return self.value

    def _mix(self, module, args, kwargs, output):
        if self.value >= 1.0:
            return output
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        out, *rest = output
        return (hidden + self.value * (out - hidden), *rest)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def finish(self, step: int) -> None:
        """The phase ended at ``step``: the mask has reached 1 (the config holds it within the
        phase), and comes off."""
        assert self.at(step) == 1.0, (step, self.steps)
        self.remove()


def growth_mask(model: torch.nn.Module, level_map, steps: int) -> Optional[LayerMask]:
    """The mask of the layers that growing ``model`` through ``level_map`` added (None for
    ``steps`` 0)."""
    if not steps:
        return None
    # by the whole model's index (Megatron-Core's 1-based layer_number): a pipeline stage holds some
    layers = {layer.layer_number - 1: layer for layer in transformer_layers(model)}
    return LayerMask([layers[i] for i in grown_layers(level_map) if i in layers], steps)
