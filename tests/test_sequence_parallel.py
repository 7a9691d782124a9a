"""Sequence parallelism (``parallel.sequence_parallel``) under the DeepSpeed engine.

Two gloo ranks at TP=2, with sequence parallelism on and off, train a few steps through
``deepspeed.initialize`` (ZeRO 0, 2 with gradient accumulation, 3) and must reproduce the
one-process run: losses and every parameter after the steps. The sequence-parallel norm and
bias gradients are partial on each rank; the hooks of ``parallel/sequence_parallel.py`` sum them,
and a run with the hooks removed must drift. A V-cycle transition (fine -> coarse -> fine) at TP=2
with sequence parallelism must also reproduce one process, and every model a transition builds
must carry the parameter marks and the hooks.
"""

import functools

import pytest
import torch

from distributed_helpers import run_ranks

GLOBAL_BATCH = 4
SEQ = 16
STEPS = 3
ALPHA = 0.25


def _model_config(variant):
    from megatron_multilevel.config import ModelConfig

    kw = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=SEQ)
    if variant == "llama":
        kw.update(position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
                  add_bias_linear=False, num_query_groups=2, share_embeddings_and_output_weights=False)
    return ModelConfig(kind="gpt", **kw)


def _ds_config(stage, dp, accumulation=1):
    return {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // (dp * accumulation),
        "gradient_accumulation_steps": accumulation,
        # A large eps: the first Adam steps must not amplify float noise in near-zero gradients.
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }


def _engine(model, stage, accumulation=1):
    import deepspeed
    from megatron.core import parallel_state as ps

    from megatron_multilevel.parallel.mpu import mpu

    config = _ds_config(stage, ps.get_data_parallel_world_size(), accumulation)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu)
    return engine


def _train_step(engine, cfg, seed):
    """One optimizer step on a fixed global batch (this rank's data-parallel slice, in
    micro-batches); returns the global mean loss."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_multilevel.models import language_model_loss

    data = torch.randint(0, cfg.vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = data.chunk(dp)[dp_rank]
    total = torch.zeros(())
    micro = mine.chunk(engine.gradient_accumulation_steps())
    for batch in micro:
        tokens, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        loss = language_model_loss(engine, cfg, tokens, labels, torch.ones_like(tokens))
        engine.backward(loss)
        engine.step()
        total += loss.detach() / len(micro)
    dist.all_reduce(total, group=ps.get_data_parallel_group())
    return total.item() / dp


def _full_parameters(module, cfg):
    """Every parameter as a full tensor, gathered over ZeRO-3 and the TP group."""
    import deepspeed
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    out = {}
    for name, p in module.named_parameters():
        with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
            value = p.data.detach().clone().float()
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            shards = [torch.empty_like(value) for _ in range(tp)]
            dist.all_gather(shards, value.contiguous(), group=ps.get_tensor_model_parallel_group())
            if name.endswith("linear_fc1.weight") and cfg.gated:  # rank r holds [gate_r; up_r]
                halves = [s.chunk(2) for s in shards]
                value = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
            else:
                value = torch.cat(shards, dim=p.partition_dim)
        out[name] = value
    return out


def _marks(module):
    """The parameters marked sequence-parallel, and those with the gradient hook."""
    from megatron_multilevel.parallel.sequence_parallel import has_sequence_parallel_grad_hook

    params = list(module.named_parameters())
    return {"marked": sorted(n for n, p in params if getattr(p, "sequence_parallel", False)),
            "hooked": sorted(n for n, p in params if has_sequence_parallel_grad_hook(p))}


def _expected_marks(module):
    """What Megatron's sequence parallelism acts on per sequence shard: every norm and the
    row-parallel biases."""
    return sorted(n for n, _ in module.named_parameters()
                  if "layernorm" in n or n.endswith(("linear_proj.bias", "linear_fc2.bias")))


def _remove_hooks(module):
    for p in module.parameters():
        handle = getattr(p, "_sequence_parallel_grad_hook", None)
        if handle is not None:
            handle.remove()
            p._sequence_parallel_grad_hook = None


def _train_case(case):
    from megatron_multilevel.distributed import set_seed, set_tensor_model_parallel_size
    from megatron_multilevel.config import resolve_sequence_parallel
    from megatron_multilevel.models import build_model
    from megatron_multilevel.parallel.sequence_parallel import register_sequence_parallel_grad_hooks

    cfg = _model_config(case["variant"])
    sequence_parallel = resolve_sequence_parallel(case["sp"], case["tp"], cfg.kind)
    set_tensor_model_parallel_size(case["tp"])
    set_seed(7)
    model = build_model(cfg, sequence_parallel=sequence_parallel)
    if sequence_parallel:  # as LevelEngines does for every model it builds
        register_sequence_parallel_grad_hooks(model)
    out = {"sp": model.config.sequence_parallel, "expected_marks": _expected_marks(model)}
    if case.get("no_hooks"):
        _remove_hooks(model)
    engine = _engine(model, case["stage"], case.get("accumulation", 1))
    out["marks"] = _marks(engine.module)
    out["losses"] = [_train_step(engine, cfg, seed=s) for s in range(STEPS)]
    out["params"] = _full_parameters(engine.module, cfg)
    return out


def _train_worker(rank, world, cases):
    return [_train_case(case) for case in cases]


def _max_diff(a, b):
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    cases = [dict(variant=v, tp=1, stage=0, sp=None) for v in ("gpt", "llama")]
    (results,) = run_ranks(_train_worker, 1, tmp_path_factory.mktemp("one"), cases)
    return dict(zip(("gpt", "llama"), results))


def test_tp2_with_and_without_sequence_parallel_equals_one_process(one_process, tmp_path):
    cases = [
        dict(variant="gpt", tp=2, stage=0, sp=True),
        dict(variant="gpt", tp=2, stage=0, sp=False),
        dict(variant="gpt", tp=2, stage=2, sp=True, accumulation=2),
        dict(variant="gpt", tp=2, stage=3, sp=True),
        dict(variant="llama", tp=2, stage=1, sp=True),
        dict(variant="llama", tp=2, stage=3, sp=True, accumulation=2),
        dict(variant="gpt", tp=2, stage=0, sp=True, no_hooks=True),  # the check itself can fail
    ]
    results = run_ranks(_train_worker, 2, tmp_path, cases)
    for case, rank0, rank1 in zip(cases, *results):
        assert rank0["losses"] == rank1["losses"], case
        assert rank0["sp"] == case["sp"], case
        ref = one_process[case["variant"]]
        if case.get("no_hooks"):
            assert rank0["marks"]["hooked"] == []
            assert _max_diff(rank0["params"], ref["params"]) > 1e-3, case
            continue
        marked = rank0["expected_marks"] if case["sp"] else []
        assert rank0["marks"] == {"marked": marked, "hooked": marked}, case
        assert rank0["losses"] == pytest.approx(ref["losses"], abs=1e-5), case
        assert _max_diff(rank0["params"], ref["params"]) < 1e-5, case
        assert _max_diff(rank1["params"], ref["params"]) < 1e-5, case


def _transition_case(case):
    """Fine (one step) -> coarse (one step) -> fine (one step), as the V-cycle runs it."""
    from megatron_multilevel.distributed import set_seed, set_tensor_model_parallel_size
    from megatron_multilevel.level_maps import make_level_map
    from megatron_multilevel.config import resolve_sequence_parallel
    from megatron_multilevel.models import build_model
    from megatron_multilevel.parallel.sequence_parallel import register_sequence_parallel_grad_hooks
    from megatron_multilevel.parallel.staging import Layout
    from megatron_multilevel.parallel.transition import coarsen, prolong
    from megatron_multilevel.training.engines import build_empty_model

    cfg = _model_config("gpt")
    fine_layout = Layout(case["fine_tp"], case["fine_stage"])
    coarse_layout = Layout(case["coarse_tp"], case["coarse_stage"])
    lm = make_level_map(cfg, tensor_model_parallel_size=2)

    def target(level_cfg, layout):  # as LevelEngines builds a transition's target
        sp = resolve_sequence_parallel(case["sp"], layout.tensor_model_parallel_size, "gpt")
        return functools.partial(build_empty_model, level_cfg, layout, _ds_config(layout.zero_stage, 1),
                                 sequence_parallel=sp)

    set_tensor_model_parallel_size(fine_layout.tensor_model_parallel_size)
    set_seed(7)
    fine_sp = resolve_sequence_parallel(case["sp"], fine_layout.tensor_model_parallel_size, "gpt")
    model = build_model(cfg, sequence_parallel=fine_sp)
    if fine_sp:
        register_sequence_parallel_grad_hooks(model)
    fine = _engine(model, fine_layout.zero_stage)
    losses = [_train_step(fine, cfg, seed=1)]
    staged, before = coarsen(fine.module, lm, fine_layout=fine_layout, coarse_layout=coarse_layout,
                             build_target=target(lm.coarse, coarse_layout))
    del fine
    coarse = _engine(staged.model, coarse_layout.zero_stage)
    marks = {"coarse": (_marks(coarse.module), _expected_marks(coarse.module), coarse.module.config.sequence_parallel)}
    losses.append(_train_step(coarse, lm.coarse, seed=2))
    staged = prolong(coarse.module, before, lm, ALPHA, coarse_layout=coarse_layout, fine_layout=fine_layout,
                     build_target=target(lm.fine, fine_layout))
    del coarse
    fine = _engine(staged.model, fine_layout.zero_stage)
    marks["fine"] = (_marks(fine.module), _expected_marks(fine.module), fine.module.config.sequence_parallel)
    losses.append(_train_step(fine, cfg, seed=3))
    return {"losses": losses, "marks": marks, "params": _full_parameters(fine.module, cfg)}


def _transition_worker(rank, world, cases):
    return [_transition_case(case) for case in cases]


def test_transitions_keep_sequence_parallelism(tmp_path):
    # (fine TP, fine ZeRO stage, coarse TP, coarse ZeRO stage)
    layouts = [(2, 0, 2, 0), (2, 1, 2, 3), (2, 2, 1, 2)]
    cases = [dict(fine_tp=a, fine_stage=b, coarse_tp=c, coarse_stage=d, sp=True) for a, b, c, d in layouts]
    one = dict(fine_tp=1, fine_stage=0, coarse_tp=1, coarse_stage=0, sp=None)
    (ref,) = run_ranks(_transition_worker, 1, tmp_path / "one", [one])
    results = run_ranks(_transition_worker, 2, tmp_path / "two", cases)
    for case, rank0, rank1 in zip(cases, *results):
        assert rank0["losses"] == rank1["losses"], case
        for level, tp in (("fine", case["fine_tp"]), ("coarse", case["coarse_tp"])):
            marks, expected, sp = rank0["marks"][level]
            assert sp == (tp > 1), (case, level)
            marked = expected if tp > 1 else []
            assert marks == {"marked": marked, "hooked": marked}, (case, level)
        assert rank0["losses"] == pytest.approx(ref[0]["losses"], abs=1e-5), case
        assert _max_diff(rank0["params"], ref[0]["params"]) < 1e-5, case


def test_config_validation():
    from megatron_multilevel.config import load_config

    def config(**parallel):
        return {"train_batch_size": 4, "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                                                 "vocab_size": 64, "max_sequence_length": 16},
                "data": {"seq_length": 15}, "parallel": parallel}

    with pytest.raises(ValueError, match=r"level 0: parallel.sequence_parallel .* data.seq_length = 15 is not "
                                         r"divisible by 2.*\[null, true, false\]"):
        load_config(config(tensor_model_parallel_size=2, sequence_parallel=True))
    with pytest.raises(ValueError, match="parallel.sequence_parallel: expected true or false"):
        load_config(config(sequence_parallel="on"))
    load_config(config(tensor_model_parallel_size=2, sequence_parallel=False))  # off: any length
    at_tp1 = load_config(config(tensor_model_parallel_size=1, sequence_parallel=True))
    assert at_tp1.level_sequence_parallel() == [False]  # Megatron needs TP > 1
    # Levels with their own TP size: each that runs sequence-parallel needs the length divisible by it.
    cfg = config(tensor_model_parallel_size=1, sequence_parallel=True)
    cfg["multilevel"] = {"enabled": True, "levels": [{}, {"tensor_model_parallel_size": 2, "steps_before": 1}]}
    with pytest.raises(ValueError, match="level 1: parallel.sequence_parallel"):
        load_config(cfg)
    cfg["data"]["seq_length"] = 16
    assert load_config(cfg).level_sequence_parallel() == [False, True]


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto turns sequence parallelism on with CUDA")
def test_auto_is_off_on_cpu_and_bert_needs_apex():
    from megatron_multilevel.config import load_config

    base = {"train_batch_size": 4, "parallel": {"tensor_model_parallel_size": 2},
            "model": {"kind": "bert", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                      "vocab_size": 64, "max_sequence_length": 16}, "data": {"seq_length": 16}}
    assert load_config(base).level_sequence_parallel() == [False]
    base["parallel"]["sequence_parallel"] = True
    with pytest.raises(ValueError, match=r"parallel.sequence_parallel = true: .*BERT.*Apex.*\[null, false\]"):
        load_config(base)
