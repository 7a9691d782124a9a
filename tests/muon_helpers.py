"""What the Muon tests share: the state of an engine's parameters, read at any ZeRO stage."""

import torch

from megatron_multilevel.config import MUON_STATE_KEYS

KEYS = ("momentum_buffer", "exp_avg", "exp_avg_sq")


def engine_state(engine, key):
    """Full parameters (``key`` None) or optimizer state ``key`` by name, of the parameters that keep
    it: at ZeRO 0 straight from torch's per-parameter state, at ZeRO 3 (and for Adam's moments at
    ZeRO 1/2) through DeepSpeed's ``safe_get_full_optimizer_state``; Muon's momentum at ZeRO 1/2
    through the project's reader (checked against ZeRO 0 by the caller)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_optimizer_state

    from megatron_multilevel.parallel.muon_state import read_momentum
    from megatron_multilevel.parallel.zero import link_optimizer_state

    opt = inner_optimizer(engine)
    link_optimizer_state(engine.optimizer)  # ZeRO 1/2 link the first group's parameters only, lazily
    out = {}
    for name, p in engine.module.named_parameters():
        if key is None:
            if hasattr(p, "ds_id"):
                with deepspeed.zero.GatheredParameters([p]):
                    out[name] = p.data.float().clone()
            else:
                out[name] = p.data.float().clone()
        elif (key in MUON_STATE_KEYS) == p.use_muon:
            if not (hasattr(p, "ds_id") or hasattr(p, "_hp_mapping")):
                out[name] = opt.state[p][key].float().clone()
            elif key == "momentum_buffer" and not hasattr(p, "ds_id"):
                out[name] = read_momentum(engine.optimizer, p)
            else:
                out[name] = safe_get_full_optimizer_state(p, key).float().clone()
    return out


def engine_states(engine):
    return {key: engine_state(engine, key) for key in (None, *KEYS)}


def whole_state(states: dict, key: str) -> dict:
    """State ``key`` of every parameter (zeros for those that keep another)."""
    return {name: states[key].get(name, torch.zeros_like(p)) for name, p in states[None].items()}


def inner_optimizer(engine):
    opt = engine.optimizer
    while hasattr(opt, "optimizer"):
        opt = opt.optimizer
    return opt
