"""The ODE strategy's transitions on live models, one process and two, against the pure operators.

Each case trains the fine model one step, restricts it (with the coherence vector of the next
batch), checks that the coarse gradient at the restricted point is the restricted fine gradient,
trains the coarse model one step, prolongs it back and trains one more step. At each point the
parameters (and the optimizer state that is kept or mapped) are gathered with an independent
reference gather and compared with the pure operators applied to the gathered tensors; the losses
of every layout are compared with the one-process run. The coarse model may run in another layout
than the fine one (TP size and ZeRO stage), as ``multilevel.ode.coarse_*`` sets it.
"""

import functools

import pytest
import torch

from distributed_helpers import run_ranks
from test_transitions import _CountCollectives, _max_diff, _reference_gather
from test_transitions import _model_config as _shared_model_config

GLOBAL_BATCH = 4
SEQ = 16
RESIDUAL_SCALE = 2


def _model_config(kind):
    """``gpt``, ``bert`` or ``llama`` (a GPT with RoPE, RMSNorm, SwiGLU and GQA)."""
    return _shared_model_config(kind, kind="bert" if kind == "bert" else "gpt")


def _ds_config(case, dp, stage):
    if case["optimizer"] == "sgd":
        optimizer = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.0}}
    else:
        # a large eps, so that float noise in near-zero gradients is not amplified into lr-sized differences
        optimizer = {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-3, "weight_decay": 0.0, "torch_adam": True}}
    return {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // dp, "gradient_accumulation_steps": 1,
            "optimizer": optimizer, "zero_optimization": {"stage": stage}, "steps_per_print": 10**9,
            "zero_allow_untested_optimizer": True}


def _engine(model, case, stage):
    import deepspeed
    from megatron.core import parallel_state as ps

    from megatron_multilevel.parallel.mpu import mpu

    config = _ds_config(case, ps.get_data_parallel_world_size(), stage)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu)
    return engine


def _my_batch(cfg, seed):
    """This rank's data-parallel slice of a fixed global batch."""
    from megatron.core import parallel_state as ps

    data = torch.randint(0, cfg.vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    mine = data.chunk(ps.get_data_parallel_world_size())[ps.get_data_parallel_rank()]
    return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()


def _loss(model, cfg, seed):
    from megatron_multilevel.models import language_model_loss

    tokens, labels = _my_batch(cfg, seed)
    return language_model_loss(model, cfg, tokens, labels, torch.ones_like(tokens))


def _train_step(engine, cfg, seed):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    loss = _loss(engine, cfg, seed)
    engine.backward(loss)
    engine.step()
    value = loss.detach().clone()
    dist.all_reduce(value, group=ps.get_data_parallel_group())
    return value.item() / ps.get_data_parallel_world_size()


def _gather_dict(values, cfg):
    """Full tensors of a dict of this rank's tensor-parallel shards (by the plan's layout)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_multilevel.parallel.tp_layout import partition_dim, unshard
    from megatron_multilevel.plan import parameter_plan

    plan, tp = parameter_plan(cfg), ps.get_tensor_model_parallel_world_size()
    out = {}
    for name, t in values.items():
        rule = plan.rule(name)[1]
        if tp > 1 and partition_dim(rule) is not None:
            shards = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(shards, t.contiguous(), group=ps.get_tensor_model_parallel_group())
            t = unshard(shards, rule)
        out[name] = t
    return out


def _dot(a, b):
    """``<a, b>`` of two dicts of full tensors, in float64."""
    return sum(torch.dot(t.double().flatten(), b[n].double().flatten()).item() for n, t in a.items())


def _independent_statistics(fine, coarse, v):
    """Norms, cosine and rho of full gradients, one flat vector each."""
    flat = {k: torch.cat([t.double().flatten() for _, t in sorted(d.items())]) for k, d in
            (("fine", fine), ("coarse", coarse), ("v", v))}
    norms = {k: t.norm().item() for k, t in flat.items()}
    return {"fine_grad_norm": norms["fine"], "coarse_grad_norm": norms["coarse"], "v_norm": norms["v"],
            "cosine": torch.dot(flat["fine"], flat["coarse"]).item() / (norms["fine"] * norms["coarse"]),
            "rho": norms["v"] / norms["fine"]}


def _shard_like(full, module, cfg):
    """This rank's tensor-parallel shards of full tensors, split as Megatron's own parameter
    attributes say (an independent counterpart of ``_reference_gather``)."""
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    params = dict(module.named_parameters())
    out = {}
    for name, t in full.items():
        p = params[name]
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            if name.endswith("linear_fc1.weight") and cfg.gated:
                gate, up = t.chunk(2, dim=0)
                t = torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])
            else:
                t = t.chunk(tp, dim=p.partition_dim)[rank]
        out[name] = t.contiguous()
    return out


def _coarse_model(sel, layout, ds_config):
    """An empty coarse model, taking the explicit step in its forward pass where ``sel`` says so."""
    from megatron_multilevel.residual_step import set_residual_step
    from megatron_multilevel.training.engines import build_empty_model

    return set_residual_step(build_empty_model(sel.coarse, layout, ds_config), sel.forward_step)


def _case(case):
    from megatron_multilevel.distributed import set_seed, set_tensor_model_parallel_size
    from megatron_multilevel.level_maps import LayerSelection
    from megatron_multilevel.models import build_model
    from megatron_multilevel.ode_operators import prolong as prolong_tensors
    from megatron_multilevel.ode_operators import restrict as restrict_tensors
    from megatron_multilevel.ode_operators import restrict_gradient, unrestrict_layer
    from megatron_multilevel.parallel import coherence
    from megatron_multilevel.parallel.ode_transition import DEGREE, prolong, prolonged_change_norm, restrict
    from megatron_multilevel.parallel.staging import Layout, load_moments
    from megatron_multilevel.parallel.zero import materialize_optimizer_state
    from megatron_multilevel.training.engines import build_empty_model

    cfg = _model_config(case["kind"])
    sel = LayerSelection(cfg, case["parity"], RESIDUAL_SCALE, case.get("parametrisation", "folded"))
    fine_layout = Layout(case["tp"], case["stage"])
    coarse_layout = Layout(case.get("coarse_tp", case["tp"]), case.get("coarse_stage", case["stage"]))
    layouts = dict(fine_layout=fine_layout, coarse_layout=coarse_layout)
    keys = ("momentum_buffer",) if case["optimizer"] == "sgd" else ("exp_avg", "exp_avg_sq")
    keys = () if case["state"] == "reset" else keys
    set_tensor_model_parallel_size(fine_layout.tensor_model_parallel_size)
    set_seed(7)
    fine = _engine(build_model(cfg), case, fine_layout.zero_stage)
    out = {"losses": [_train_step(fine, cfg, seed=1)]}
    fine_full = _reference_gather(fine, cfg)
    fine_state = {k: _reference_gather(fine, cfg, k) for k in keys}
    fine_grad = coherence.step_gradients(fine.module, lambda m: _loss(fine.module, cfg, 2), 1)
    restricted_grad = restrict_gradient(_gather_dict(fine_grad, cfg), sel, case["prolongation"])

    with _CountCollectives() as counter:
        if keys:
            materialize_optimizer_state(fine.optimizer, keys)
        target = functools.partial(_coarse_model, sel, coarse_layout, _ds_config(case, 1, coarse_layout.zero_stage))
        staged, before = restrict(fine.module, sel, **layouts, build_target=target, optimizer=fine.optimizer,
                                  keys=keys, map_state=case["state"] == "map")
    out["restrict_collectives"] = counter.count
    del fine
    coarse = _engine(staged.model, case, coarse_layout.zero_stage)
    load_moments(coarse, staged)
    coarse_module = coarse.module
    diffs = {"restrict": _max_diff(_reference_gather(coarse, sel.coarse), restrict_tensors(fine_full, sel))}
    for k in keys if case["state"] == "map" else ():
        diffs[f"restrict_{k}"] = _max_diff(_reference_gather(coarse, sel.coarse, k),
                                           restrict_tensors(fine_state[k], sel, degree=DEGREE[k]))
    # first-order coherence: with v added, the coarse gradient at R theta is R grad L_fine(theta)
    coarse_grad = coherence.step_gradients(coarse.module, lambda micro: _loss(coarse_module, sel.coarse, 2), 1)
    restricted_here = _shard_like(restricted_grad, coarse.module, sel.coarse)  # in the coarse layout
    v = {n: fine_grad_r - coarse_grad[n] for n, fine_grad_r in restricted_here.items()}
    # the coherence diagnostics against the same quantities on the gathered full tensors
    v_here, stats = coherence.statistics(restricted_here, coarse_grad, sel.coarse)
    diffs["v"] = max((v_here[n] - t).abs().max().item() for n, t in v.items())
    full_coarse_grad = _gather_dict(coarse_grad, sel.coarse)
    full_v = {n: restricted_grad[n] - g for n, g in full_coarse_grad.items()}
    expected = _independent_statistics(restricted_grad, full_coarse_grad, full_v)
    diffs["statistics"] = max(abs(stats[k] - x) / max(abs(x), 1e-12) for k, x in expected.items())
    coarse_start = restrict_tensors(fine_full, sel)
    v_dot_start, expected_v_dot_start = coherence.parameter_dot(v, coarse.module, sel.coarse), _dot(full_v, coarse_start)
    diffs["v_dot_start"] = abs(v_dot_start - expected_v_dot_start) / abs(expected_v_dot_start)
    # with two accumulation steps (the same batch twice) each gets half of v
    hook = coherence.CoherenceHook(coarse.module, v, 2)
    coherent = coherence.step_gradients(coarse.module, lambda micro: _loss(coarse_module, sel.coarse, 2), 2)
    diffs["coherent_gradient"] = _max_diff(_gather_dict(coherent, sel.coarse), restricted_grad)
    hook.remove()
    hook = coherence.CoherenceHook(coarse.module, v, 1)
    out["coarse_gradient_was_different"] = _max_diff(_gather_dict(coarse_grad, sel.coarse), restricted_grad)
    out["losses"].append(_train_step(coarse, sel.coarse, seed=2))  # the hook acts on this step
    hook.remove()
    coarse_full = _reference_gather(coarse, sel.coarse)
    coarse_state = {k: _reference_gather(coarse, sel.coarse, k) for k in keys}

    # the phase's change in fine units, |P (end - start)|, and <v, end - start>
    norm = prolonged_change_norm(coarse.module, before, sel, **layouts, prolongation=case["prolongation"])
    change = prolong_tensors({n: torch.zeros_like(t) for n, t in fine_full.items()}, coarse_full, sel,
                             prolongation=case["prolongation"], coarse_start=coarse_start)
    expected_norm = _dot(change, change) ** 0.5
    diffs["change_norm"] = abs(norm - expected_norm) / expected_norm
    v_dot = coherence.parameter_dot(v, coarse.module, sel.coarse) - v_dot_start
    expected_v_dot = _dot(full_v, {n: t - coarse_start[n] for n, t in coarse_full.items()})
    diffs["v_dot_change"] = abs(v_dot - expected_v_dot) / max(abs(expected_v_dot), 1e-3 * abs(v_dot_start))
    with counter:
        staged = prolong(coarse.module, before, sel, **layouts, prolongation=case["prolongation"],
                         build_target=functools.partial(build_empty_model, sel.fine, fine_layout,
                                                        _ds_config(case, 1, fine_layout.zero_stage)),
                         optimizer=coarse.optimizer,
                         state=case["state"])
    out["collectives"] = counter.count
    del coarse
    fine = _engine(staged.model, case, fine_layout.zero_stage)
    load_moments(fine, staged)
    diffs["prolong"] = _max_diff(_reference_gather(fine, cfg),
                                 prolong_tensors(fine_full, coarse_full, sel, prolongation=case["prolongation"]))
    for k in keys:
        expected = dict(fine_state[k])
        if case["state"] == "map":
            stack = "decoder" if cfg.kind == "gpt" else "encoder"
            expected.update({n: t for n, t in coarse_state[k].items() if not n.startswith(f"{stack}.layers.")})
            for i, j in enumerate(sel.layers):
                layer = {n.split(".", 3)[3]: t for n, t in coarse_state[k].items() if n.startswith(f"{stack}.layers.{i}.")}
                expected.update({f"{stack}.layers.{j}.{n}": t
                                 for n, t in unrestrict_layer(layer, sel, degree=DEGREE[k]).items()})
        diffs[f"prolong_{k}"] = _max_diff(_reference_gather(fine, cfg, k), expected)
    out["losses"].append(_train_step(fine, cfg, seed=3))
    out["diffs"] = diffs
    return out


def _worker(rank, world, cases):
    return [_case(case) for case in cases]


def _cases(layouts, **kw):
    """``layouts``: (TP, ZeRO stage) of both models, or (fine TP, fine stage, coarse TP, coarse stage)."""
    base = dict(kind="gpt", optimizer="adamw", state="map", parity=1, prolongation="linear")
    cases = []
    for tp, stage, *coarse in layouts:
        layout = {"tp": tp, "stage": stage}
        if coarse:
            layout.update(coarse_tp=coarse[0], coarse_stage=coarse[1])
        cases.append({**base, **kw, **layout})
    return cases


REFERENCE_CASES = (
    _cases([(1, 0)]) + _cases([(1, 0)], optimizer="sgd", state="keep", parity=0, prolongation="correction")
    + _cases([(1, 0)], kind="bert", state="keep", prolongation="constant")
    + _cases([(1, 0)], kind="llama", optimizer="sgd", state="map", parity=0)
    + _cases([(1, 0)], state="reset", prolongation="correction")
    + _cases([(1, 0)], parametrisation="explicit")
    + _cases([(1, 0)], kind="bert", optimizer="sgd", state="map", prolongation="constant", parametrisation="explicit")
)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    (results,) = run_ranks(_worker, 1, tmp_path_factory.mktemp("ref"), REFERENCE_CASES)
    return {_key(c): r for c, r in zip(REFERENCE_CASES, results)}


def _key(case):
    return tuple(sorted((k, v) for k, v in case.items() if k not in ("tp", "stage", "coarse_tp", "coarse_stage")))


def _check(results, cases, reference):
    for per_rank in zip(*results):
        for r in per_rank[1:]:
            assert r["losses"] == pytest.approx(per_rank[0]["losses"], abs=1e-6)
    for case, result in zip(cases, results[0]):
        for name, diff in result["diffs"].items():
            tolerance = 1e-5 if name == "coherent_gradient" else 1e-6
            assert diff < tolerance, (case, name, diff)
        ref = reference[_key(case)]
        assert result["losses"] == pytest.approx(ref["losses"], abs=2e-5), (case, result["losses"], ref["losses"])


def test_one_process_matches_the_operators(reference):
    """GPT, BERT and Llama-style GPT; AdamW and SGD with momentum; reset, keep and map; every
    prolongation; both parities; both parametrisations."""
    _check([list(reference.values())], REFERENCE_CASES, reference)
    for result in reference.values():
        assert result["coarse_gradient_was_different"] > 1e-3  # v is not trivially zero
        assert all(0 < loss < 10 for loss in result["losses"])
        assert result["collectives"] == 0


def test_two_processes(reference, tmp_path):
    """TP=2 (shard-local: no communication), DP=2 with ZeRO-1, -2 and -3 (gathered one parameter at
    a time), TP=2 with ZeRO-3, the explicit step at TP=2 and under ZeRO-3: the one-process result."""
    layouts = [(2, 0), (1, 1), (1, 2), (1, 3), (2, 3)]
    cases = _cases(layouts) + _cases([(2, 0), (1, 3)], optimizer="sgd", state="keep", parity=0,
                                     prolongation="correction")
    cases += _cases([(2, 1)], kind="bert", state="keep", prolongation="constant")
    cases += _cases([(1, 2)], kind="llama", optimizer="sgd", state="map", parity=0)
    cases += _cases([(2, 0), (1, 3)], parametrisation="explicit")  # the step's hooks at TP=2 and under ZeRO-3
    results = run_ranks(_worker, 2, tmp_path, cases)
    _check(results, cases, reference)
    assert results[0][0]["collectives"] == 0  # TP=2, no ZeRO-3: every rank maps its own shards


@pytest.mark.slow
def test_two_processes_tensor_parallel_change(reference, tmp_path):
    """The coarse model at another TP size than the fine one (TP=2 <-> TP=1 with DP=2), ZeRO stages
    equal or not on the two sides: every tensor gathered, mapped and resharded; the one-process
    result."""
    # (fine TP, fine ZeRO stage, coarse TP, coarse ZeRO stage)
    cases = _cases([(2, 1, 1, 1), (2, 3, 1, 3)])
    cases += _cases([(2, 1, 1, 3)], optimizer="sgd", state="keep", parity=0, prolongation="correction")
    cases += _cases([(2, 0, 1, 3)], state="reset", prolongation="correction")
    cases += _cases([(2, 3, 1, 1)], kind="bert", state="keep", prolongation="constant")
    cases += _cases([(1, 3, 2, 0)], kind="llama", optimizer="sgd", state="map", parity=0)
    results = run_ranks(_worker, 2, tmp_path, cases)
    _check(results, cases, reference)
    for case, result in zip(cases, results[0]):
        # the TP=2 model is gathered whole (restriction reads the fine model, prolongation the coarse one)
        assert result["restrict_collectives" if case["tp"] == 2 else "collectives"] > 0, case


def _gate_worker(rank, world):
    """A 4-layer GPT whose odd layers are identities (residual outputs zero) and whose even layers
    are strong (residual outputs x10): at residual scale 1 the even coarse model is the fine model's
    own function (a perfect first-order model, v = 0), the odd one drops every layer that acts."""
    from megatron_multilevel.distributed import set_seed, set_tensor_model_parallel_size
    from megatron_multilevel.level_maps import LayerSelection
    from megatron_multilevel.models import build_model
    from megatron_multilevel.ode_operators import restrict as restrict_tensors
    from megatron_multilevel.ode_operators import restrict_gradient
    from megatron_multilevel.parallel import coherence
    from megatron_multilevel.plan import parameter_plan

    cfg = _model_config("gpt")
    set_tensor_model_parallel_size(1)
    set_seed(7)
    fine = build_model(cfg)
    plan = parameter_plan(cfg)
    with torch.no_grad():
        for name, p in fine.named_parameters():
            layer, rule = plan.rule(name)
            if layer is not None and rule.residual:
                p.mul_(0.0 if layer % 2 else 10.0)
    fine_grad = coherence.step_gradients(fine, lambda m: _loss(fine, cfg, 2), 1)
    full = {n: p.detach().clone() for n, p in fine.named_parameters()}
    out = {}
    for parity in (0, 1):
        sel = LayerSelection(cfg, parity, 1)
        coarse = build_model(sel.coarse)
        coarse.load_state_dict(restrict_tensors(full, sel), strict=False)
        coarse_grad = coherence.step_gradients(coarse, lambda m: _loss(coarse, sel.coarse, 2), 1)
        _, stats = coherence.statistics(restrict_gradient(fine_grad, sel), coarse_grad, sel.coarse)
        out[parity] = {"stats": stats, "installs": coherence.installs(stats, 1.0),
                       "ungated": coherence.installs(stats, None)}
    return out


def test_the_gate_tells_an_incoherent_coarse_model_from_a_coherent_one(tmp_path):
    """The coherence gate (``coherence_max_ratio`` 1.0) installs the term for the coarse model that
    models the fine one (rho ~ 0, cosine 1) and not for the one that does not (rho > 1)."""
    (out,) = run_ranks(_gate_worker, 1, tmp_path)
    even, odd = out[0], out[1]
    assert even["stats"]["rho"] < 1e-5 and even["stats"]["cosine"] > 1 - 1e-6, even
    assert odd["stats"]["rho"] > 1.0, odd
    assert even["installs"] and not odd["installs"]
    assert even["ungated"] and odd["ungated"]  # null: no gate
