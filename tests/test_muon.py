"""DeepSpeed's Muon as a first-class optimizer: its config refusals, which parameters it trains
(the layers' weight matrices; the embeddings, output layer, norms and biases go to its auxiliary
Adam), and its state (Muon's momentum, the auxiliary Adam's moments and step) carried through
coalescing and de-coalescing at every ZeRO stage, through depth growth, resharding and a real run.

Each transition is checked against the operators applied by hand to the full state read before
it; the state of every ZeRO stage against ZeRO 0's, read straight from torch's per-parameter
state (ZeRO 1/2 keep Muon's momentum in a layout of their own: whole matrices per rank). The
workers run without ``torch.compile`` (DeepSpeed compiles Muon's update: minutes on a CPU, for
the same arithmetic).
"""

import functools
import json

import pytest
import torch

from distributed_helpers import run_ranks
from muon_helpers import KEYS, engine_states, inner_optimizer, whole_state
from megatron_multilevel.config import load_config, muon_parameter, optimizer_state_keys

# a large eps: the first Adam steps must not amplify float noise in near-zero gradients
MUON = {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 1e-2, "momentum": 0.9, "eps": 1e-3, "weight_decay": 0.0,
                                   "torch_adam": True}}
ALPHA = 0.25
GLOBAL_BATCH, SEQ = 4, 16


def _load(optimizer=MUON, **blocks):
    return load_config({"train_batch_size": 4, "optimizer": optimizer, **blocks})


def _levels(*deepspeed, **level) -> dict:
    """A two-level V-cycle config whose coarse level takes ``deepspeed`` (and ``level``'s keys)."""
    coarse = {"steps_before": 2, **({"deepspeed": deepspeed[0]} if deepspeed else {}), **level}
    return {"multilevel": {"enabled": True, "optimizer_state": "map",
                           "levels": [{"steps_before": 2, "steps_after": 2}, coarse]}}


@pytest.mark.parametrize("config, message", [
    (dict(optimizer={"type": "Muon", "params": {"ns_steps": 5}}),
     r"^optimizer.params.ns_steps is not a parameter of optimizer.type = 'Muon' \(DeepSpeed builds "
     r"deepspeed.runtime.zero.muon.muon_optimizer.MuonWithAuxAdam\); valid params are \['adam_lr', 'adam_w_mode', "
     r"'betas', 'eps', 'fp32_optimizer_states', 'lr', 'momentum', 'muon_lr', 'ns_method', 'torch_adam', "
     r"'weight_decay'\]$"),
    (dict(optimizer={"type": "Muon", "params": {"momentum": 1.0}}),
     r"^optimizer.params.momentum must be a number in \[0, 1\), got 1.0$"),
    (dict(optimizer={"type": "Muon", "params": {"ns_method": "svd"}}),
     r"^optimizer.params.ns_method = 'svd'; valid choices are \['gram', 'standard'\]$"),
    (dict(parallel={"tensor_model_parallel_size": 2}),
     r"^tensor_model_parallel_size = 2 with optimizer.type = 'Muon': DeepSpeed orthogonalises each rank's shard "
     r"of a matrix, not the matrix; valid values are \[1\]$"),
    (_levels(tensor_model_parallel_size=2), r"^tensor_model_parallel_size \(level 1\) = 2 with optimizer.type"),
    (dict(gradient_clipping=1.0, zero_optimization={"stage": 1}),
     r"^gradient_clipping = 1.0 with optimizer.type = 'Muon' at zero_optimization.stage = 1: DeepSpeed clips "
     r"Muon's orthogonalised update there, not the gradient; valid values are \[0\] \(or stage 0\)$"),
    (_levels({"zero_optimization": {"stage": 2}}), None),  # no clipping given: none, at any stage
    (dict(gradient_clipping=0.5, **_levels({"zero_optimization": {"stage": 2}})),
     r"^gradient_clipping \(level 1\) = 0.5 with optimizer.type = 'Muon' at zero_optimization.stage = 2"),
    (dict(zero_optimization={"stage": 3, "reduce_scatter": True}),
     r"^zero_optimization.reduce_scatter = true with optimizer.type = 'Muon' at zero_optimization.stage = 3: "
     r"DeepSpeed refuses it; valid values are \[false\]$"),
    (dict(bf16={"enabled": True}),
     r"^bf16.enabled with optimizer.type = 'Muon' needs ZeRO: .*; valid zero_optimization.stage values are "
     r"\[1, 2, 3\]$"),
    (dict(bf16={"enabled": True}, zero_optimization={"stage": 1}), None),
    (dict(optimizer={"type": "Muon", "params": {"lr": 0.02}}, **_levels({"optimizer": {"type": "AdamW"}})),
     r"level 0: \['momentum_buffer', 'exp_avg', 'exp_avg_sq'\], level 1: \['exp_avg', 'exp_avg_sq'\]"),
], ids=["unknown-key", "momentum", "ns-method", "tp", "level-tp", "clipping", "no-clipping-given",
        "level-clipping", "reduce-scatter", "bf16-zero0", "bf16-zero1", "mixed-map"])
def test_muon_configs_are_checked_before_anything_is_built(config, message):
    if message is None:
        _load(**config)
        return
    with pytest.raises(ValueError, match=message):
        _load(**config)


def test_a_muon_levels_deepspeed_config_and_carried_state():
    """What each level's engine is built with: no clipping (DeepSpeed's default is 1.0), no reduce
    scatter at ZeRO 3, clipping where it is given at ZeRO 0; the state a transition carries."""
    from megatron_multilevel.training.engines import LevelEngines

    cfg = _load(gradient_clipping=0.5, **_levels({"zero_optimization": {"stage": 3}, "gradient_clipping": 0.0}))
    levels = LevelEngines(cfg, 1)
    fine, coarse = levels.ds_config(0, 1e-3), levels.ds_config(1, 1e-3)
    assert (fine["gradient_clipping"], coarse["gradient_clipping"]) == (0.5, 0.0)
    assert coarse["zero_optimization"] == {"stage": 3, "reduce_scatter": False}
    assert levels.optimizer_state_keys() == KEYS == optimizer_state_keys({"optimizer": {"type": "muon"}})
    assert LevelEngines(_load(), 1).ds_config(0, 1e-3)["gradient_clipping"] == 0.0


@pytest.mark.usefixtures("dist_single")
@pytest.mark.parametrize("variant", ["gpt_untied", "gpt_llama", "bert_untied_binary"])
def test_muon_takes_the_layers_weight_matrices_and_adam_the_rest(variant):
    """The published recipe: Muon for the transformer layers' 2D weights; the embeddings, the
    output layer, BERT's heads, the norms and the biases to the auxiliary Adam."""
    from conftest import small_config
    from megatron_multilevel.models import build_model

    cfg = small_config(variant)
    names = {name: tuple(p.shape) for name, p in build_model(cfg).named_parameters()}
    muon = sorted(n for n, shape in names.items() if muon_parameter(n, shape))
    layer = "encoder" if cfg.kind == "bert" else "decoder"
    expected = sorted(f"{layer}.layers.{i}.{leaf}.weight" for i in range(cfg.num_layers) for leaf in (
        "self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"))
    assert muon == expected
    assert any(len(shape) == 2 and not muon_parameter(n, shape) for n, shape in names.items() if "output" in n
               or "head" in n)


def test_the_layers_rate_and_the_halves_rates_survive_deepspeeds_split():
    """Depth-muP's layer rate factor under Muon: each group the engine passes holds one half, and
    DeepSpeed's split of the groups into Muon and Adam halves keeps every group's rate: the
    layers' matrices at ``muon_lr`` times the factor, their norms and biases at ``adam_lr`` times it,
    the rest at ``adam_lr``."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from megatron_multilevel.training.engines import parameter_groups

    shapes = {"embedding.word_embeddings.weight": (96, 8), "decoder.layers.0.mlp.linear_fc1.weight": (32, 8),
              "decoder.layers.0.mlp.linear_fc1.bias": (32,), "decoder.layers.0.input_layernorm.weight": (8,),
              "decoder.final_layernorm.weight": (8,), "output_layer.weight": (96, 8)}
    params = {n: torch.nn.Parameter(torch.zeros(s)) for n, s in shapes.items()}
    for n, p in params.items():
        p.use_muon = muon_parameter(n, p.shape)
    groups = parameter_groups(params.items(), 0.1, 1e-3, 0.25, muon_rates=(0.02, 4e-3))
    split = DeepSpeedEngine._muon_param_groups(groups, {"lr": 1e-3, "muon_lr": 0.02, "adam_lr": 4e-3,
                                                        "momentum": 0.9, "weight_decay": 0.1})
    rate = {id(p): (group["lr"], group["use_muon"], group["weight_decay"]) for group in split for p in group["params"]}
    assert {n: rate[id(p)] for n, p in params.items()} == {
        "embedding.word_embeddings.weight": (4e-3, False, 0.1), "output_layer.weight": (4e-3, False, 0.1),
        "decoder.layers.0.mlp.linear_fc1.weight": (0.02 * 0.25, True, 0.1),
        "decoder.layers.0.mlp.linear_fc1.bias": (4e-3 * 0.25, False, 0.0),
        "decoder.layers.0.input_layernorm.weight": (4e-3 * 0.25, False, 0.0),
        "decoder.final_layernorm.weight": (4e-3, False, 0.0)}


# ---- transitions at every ZeRO stage, against the operators and against ZeRO 0 ----

def _model_config():
    from megatron_multilevel.config import ModelConfig

    return ModelConfig(kind="gpt", num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=96,
                       max_sequence_length=SEQ, share_embeddings_and_output_weights=False)


def _ds_config(stage: int, dp: int) -> dict:
    from megatron_multilevel.config import muon_defaults

    config = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // dp, "gradient_accumulation_steps": 1,
              "optimizer": json.loads(json.dumps(MUON)), "zero_optimization": {"stage": stage},
              "steps_per_print": 10**9}
    muon_defaults(config)
    return config


def _engine(model, stage: int):
    """The engine a level of a run builds (``LevelEngines.engine``'s groups and tags)."""
    import deepspeed
    from megatron.core import parallel_state as ps

    from megatron_multilevel.parallel.mpu import mpu
    from megatron_multilevel.training.engines import muon_tags, parameter_groups

    params = MUON["params"]
    groups = parameter_groups(model.named_parameters(), 0.0, params["lr"], muon_rates=(params["lr"], params["adam_lr"]))
    with muon_tags(True):
        engine, *_ = deepspeed.initialize(model=model, model_parameters=groups,
                                          config=_ds_config(stage, ps.get_data_parallel_world_size()), mpu=mpu)
    return engine


def _train_step(engine, cfg, seed: int) -> float:
    """One step on a fixed global batch, this rank taking its data-parallel slice; the global loss."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_multilevel.models import language_model_loss

    data = torch.randint(0, cfg.vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    dp = ps.get_data_parallel_world_size()
    mine = data.chunk(dp)[ps.get_data_parallel_rank()]
    tokens, labels = mine[:, :-1].contiguous(), mine[:, 1:].contiguous()
    loss = language_model_loss(engine, cfg, tokens, labels, torch.ones_like(tokens))
    engine.backward(loss)
    engine.step()
    value = loss.detach().clone()
    dist.all_reduce(value, group=ps.get_data_parallel_group())
    return value.item() / dp


def _muon_case(rank, world, stage):
    """Train the fine model a step, coalesce with Muon's state mapped, train the coarse model a step,
    de-coalesce and interpolate, train a step: the states around each transition, the losses, and
    the largest deviation of each carried state from the operators applied to the state before."""
    import torch._dynamo

    from megatron_multilevel.distributed import set_seed, set_tensor_model_parallel_size
    from megatron_multilevel.level_maps import make_level_map
    from megatron_multilevel.models import build_model
    from megatron_multilevel.operators import coalesce, decoalesce, interpolate
    from megatron_multilevel.config import STATE_DEGREE
    from megatron_multilevel.parallel.staging import Layout, load_moments
    from megatron_multilevel.parallel.transition import coarsen, prolong
    from megatron_multilevel.training.engines import build_empty_model

    torch._dynamo.config.disable = True
    cfg = _model_config()
    lm = make_level_map(cfg, tensor_model_parallel_size=1, coarse_tensor_model_parallel_size=1)
    layout = Layout(1, stage)
    set_tensor_model_parallel_size(1)
    set_seed(7)
    fine = _engine(build_model(cfg), stage)
    tags = {name: p.use_muon for name, p in fine.module.named_parameters()}
    out = {"losses": [_train_step(fine, cfg, seed=1)], "tags": tags, "diffs": {}, "shared": _shared_matrices(fine)}
    out["fine"] = engine_states(fine)
    staged, before = coarsen(fine.module, lm, fine_layout=layout, coarse_layout=layout, optimizer=fine.optimizer,
                             moments=KEYS, build_target=functools.partial(build_empty_model, lm.coarse, layout,
                                                                          _ds_config(stage, 1)))
    del fine
    coarse = _engine(staged.model, stage)
    load_moments(coarse, staged)
    out["coalesced"] = engine_states(coarse)
    for key in KEYS:  # the offline operators take whole state dicts: the others' state as zeros
        want = coalesce(whole_state(out["fine"], key), lm, degree=STATE_DEGREE[key])
        out["diffs"][f"coalesce {key}"] = _max_diff(out["coalesced"][key], want)
    out["losses"].append(_train_step(coarse, lm.coarse, seed=2))
    out["coarse"] = engine_states(coarse)
    staged = prolong(coarse.module, before, lm, ALPHA, coarse_layout=layout, fine_layout=layout,
                     optimizer=coarse.optimizer, moments=KEYS,
                     build_target=functools.partial(build_empty_model, cfg, layout, _ds_config(stage, 1)))
    del coarse
    fine = _engine(staged.model, stage)
    load_moments(fine, staged)
    out["prolonged"] = engine_states(fine)
    for key in KEYS:
        want = interpolate(whole_state(out["fine"], key),
                           decoalesce(whole_state(out["coarse"], key), lm, degree=STATE_DEGREE[key]), ALPHA)
        out["diffs"][f"prolong {key}"] = _max_diff(out["prolonged"][key], want)
    out["losses"].append(_train_step(fine, cfg, seed=3))
    out["steps"] = sorted({int(s["step"]) for s in inner_optimizer(fine).state.values() if "step" in s})
    return out if rank == 0 else None


def _shared_matrices(engine) -> int:
    """ZeRO 1/2: how many Muon matrices two data-parallel ranks' partitions both overlap (each holds
    them whole); 0 elsewhere."""
    import torch.distributed as dist

    if not hasattr(engine.optimizer, "params_in_partition"):
        return 0
    names = {id(p): name for name, p in engine.module.named_parameters()}
    mine = {names[id(p)] for params in engine.optimizer.params_in_partition for p in params if p.use_muon}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return len(set.intersection(*every)) if len(every) > 1 else 0


def _max_diff(got: dict, want: dict) -> float:
    want = {name: want[name] for name in got}  # of the parameters that keep the state
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    return max((got[k] - want[k]).abs().max().item() for k in want)


def _ode_case(rank, world, stage):
    """The ODE strategy's restriction (the odd layers, their residual-branch outputs' weights doubled)
    with Muon's state mapped: each state key scaled by its degree, against the ODE operators; then
    a coarse step."""
    import torch._dynamo

    from megatron_multilevel.config import STATE_DEGREE
    from megatron_multilevel.distributed import set_seed, set_tensor_model_parallel_size
    from megatron_multilevel.level_maps import LayerSelection
    from megatron_multilevel.models import build_model
    from megatron_multilevel.ode_operators import restrict as restrict_tensors
    from megatron_multilevel.parallel.ode_transition import restrict
    from megatron_multilevel.parallel.staging import Layout, load_moments
    from megatron_multilevel.training.engines import build_empty_model

    torch._dynamo.config.disable = True
    cfg = _model_config()
    sel = LayerSelection(cfg, 1, 2, "folded")
    layout = Layout(1, stage)
    set_tensor_model_parallel_size(1)
    set_seed(7)
    fine = _engine(build_model(cfg), stage)
    _train_step(fine, cfg, seed=1)
    before = engine_states(fine)
    staged, _ = restrict(fine.module, sel, fine_layout=layout, coarse_layout=layout, optimizer=fine.optimizer,
                         keys=KEYS, map_state=True,
                         build_target=functools.partial(build_empty_model, sel.coarse, layout, _ds_config(stage, 1)))
    del fine
    coarse = _engine(staged.model, stage)
    load_moments(coarse, staged)
    after = engine_states(coarse)
    diffs = {key: _max_diff(after[key], restrict_tensors(whole_state(before, key), sel, degree=STATE_DEGREE[key]))
             for key in KEYS}
    # the residual branch's output matrix: its momentum halved (a gradient's units), not copied
    name = "decoder.layers.{}.self_attention.linear_proj.weight"
    halved = torch.equal(after["momentum_buffer"][name.format(0)], before["momentum_buffer"][name.format(1)] / 2)
    loss = _train_step(coarse, sel.coarse, seed=2)
    return {"diffs": diffs, "halved": halved, "loss": loss} if rank == 0 else None


def _worker(rank, world, stages):
    return [_muon_case(rank, world, stage) for stage in stages] + [_ode_case(rank, world, stages[-1])]


def _check(results: dict, reference) -> None:
    """Every case maps exactly, keeps each key for its own parameters only, and (``reference``: the
    ZeRO 0 run on as many ranks) holds the same states and losses."""
    for stage, r in results.items():
        assert r["diffs"] and max(r["diffs"].values()) < 1e-6, (stage, r["diffs"])
        assert {n for n, m in r["tags"].items() if m} == {n for n, t in r["fine"][None].items()
                                                          if muon_parameter(n, t.shape)}
        for point in ("fine", "coalesced", "coarse", "prolonged"):  # each key for its own parameters
            muon = {n for n, t in r[point][None].items() if muon_parameter(n, t.shape)}
            assert muon and set(r[point]["momentum_buffer"]) == muon, (stage, point)
            assert set(r[point]["exp_avg"]) == set(r[point]["exp_avg_sq"]) == set(r[point][None]) - muon
        assert all(t.abs().max() > 0 for key in KEYS for t in r["fine"][key].values()), stage
        assert r["steps"] == [3], (stage, r["steps"])  # the auxiliary Adam's: one per level visited
        if reference is None:
            continue
        assert r["losses"] == pytest.approx(reference["losses"], rel=1e-5), stage
        for point in ("fine", "coalesced", "coarse", "prolonged"):
            for key in (None, *KEYS):
                got, want = r[point][key], reference[point][key]
                assert _max_diff(got, want) < 1e-5 * max(1.0, max(t.abs().max().item() for t in want.values())), (
                    stage, point, key)


def test_muon_state_maps_exactly_through_a_v_cycle_in_one_process(tmp_path):
    """ZeRO 0 and 1 in one process: coalescing and the interpolating return map Muon's momentum
    and the auxiliary Adam's moments as the operators do (momentum and first moment of degree -1,
    second moment -2), the step count carries on, and ZeRO 1's whole-matrix momentum is ZeRO 0's."""
    zero0, zero1, ode = run_ranks(_worker, 1, tmp_path, [0, 1])[0]
    _check({0: zero0}, None)
    _check({1: zero1}, zero0)
    assert max(ode["diffs"].values()) < 1e-6 and ode["halved"], ode


def test_muon_state_maps_exactly_at_every_zero_stage_on_two_ranks(tmp_path):
    """DP=2 at ZeRO 0, 1, 2 and 3: each maps exactly, and ZeRO 1-3 hold ZeRO 0's states (ZeRO 1/2's
    momentum of a matrix split between the two ranks' partitions included) and train alike."""
    *cases, ode = run_ranks(_worker, 2, tmp_path, [0, 1, 2, 3])[0]
    results = dict(zip((0, 1, 2, 3), cases))
    assert max(ode["diffs"].values()) < 1e-6 and ode["halved"], ode  # the ODE restriction at ZeRO 3
    assert results[1]["shared"] and results[2]["shared"]  # a matrix split between the partitions
    _check({0: results[0]}, None)
    _check({s: results[s] for s in (1, 2, 3)}, results[0])
