"""Distributed transitions on several gloo ranks, each layout compared with one process.

For every layout (TP, ZeRO stage, DP) the worker trains the fine model one step, coarsens it,
trains the coarse model one step, prolongs it back and trains one more step. At each point it
gathers the parameters (and the optimizer state: Adam's moments, SGD's momentum) with an
independent reference gather and checks them against the single-process operators applied to the
gathered tensors. The losses of every
layout are then compared with the one-process run, from what each rank computed and holds on its
own (its loss before any reduction, its parameters), so that a rank that diverges is caught.
"""

import functools

import pytest
import torch

from distributed_helpers import run_ranks

GLOBAL_BATCH = 4
SEQ = 16
ALPHA = 0.25


def _model_config(variant, kind="gpt"):
    from megatron_multilevel.config import ModelConfig

    variant, slabs = variant.removesuffix("-slabs"), variant.endswith("-slabs")

    kw = dict(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=96, max_sequence_length=SEQ)
    if variant == "llama":
        kw.update(position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
                  add_bias_linear=False, num_attention_heads=8, num_query_groups=4,
                  share_embeddings_and_output_weights=False)
    if variant == "wide":  # 8 heads: its coarse level's 4 heads still split over TP=4
        kw.update(num_attention_heads=8)
    if slabs:  # slabs of 24 vocabulary rows (ffn_hidden_size); [250, 64] outsizes every layer tensor
        kw.update(vocab_size=250, ffn_hidden_size=24)
    return ModelConfig(kind=kind, **kw)


# The optimizer state each optimizer of the tests keeps (what ``moments`` carries).
STATE = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


def _ds_config(stage, dp, optimizer="adamw"):
    if optimizer == "sgd":
        params = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.0}}
    else:
        # A large eps: the first Adam steps must not amplify float noise in near-zero gradients
        # into lr-sized differences between layouts.
        params = {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-3, "weight_decay": 0.0, "torch_adam": True}}
    return {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // dp,
        "gradient_accumulation_steps": 1,
        "optimizer": params,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


def _engine(model, stage, optimizer="adamw"):
    import deepspeed
    from megatron.core import parallel_state as ps

    from megatron_multilevel.parallel.mpu import mpu

    config = _ds_config(stage, ps.get_data_parallel_world_size(), optimizer)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu)
    return engine


def _train_step(engine, cfg, seed, out=None):
    """One step on a fixed global batch, this rank taking its data-parallel slice; returns the
    global mean loss. ``out["ranks"]`` (if given) collects what this rank alone computed and holds:
    its loss before any reduction and digests of its parameters before and after the step."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_multilevel.models import language_model_loss

    data = torch.randint(0, cfg.vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = data.chunk(dp)[dp_rank]
    tokens, labels = mine[:, :-1].contiguous(), mine[:, 1:].contiguous()
    held = _held_digest(engine)
    loss = language_model_loss(engine, cfg, tokens, labels, torch.ones_like(tokens))
    engine.backward(loss)
    engine.step()
    if out is not None:
        out.setdefault("ranks", []).append({
            "loss": loss.item(), "params": (held, _held_digest(engine)), "dp": (dp_rank, dp),
            "tp_rank": ps.get_tensor_model_parallel_rank()})
    value = loss.detach().clone()
    dist.all_reduce(value, group=ps.get_data_parallel_group())
    return value.item() / dp


def _held_digest(engine):
    """Digests of the parameter values this rank holds itself: its tensor-parallel shards, and the
    parameters every tensor-parallel rank holds whole (norms, some biases); None under ZeRO-3,
    where a rank holds only its partition."""
    import hashlib

    if any(hasattr(p, "ds_id") for p in engine.module.parameters()):
        return None
    digests = {"shards": hashlib.sha256(), "replicated": hashlib.sha256()}
    for name, p in engine.module.named_parameters():
        kind = "shards" if getattr(p, "tensor_model_parallel", False) else "replicated"
        digests[kind].update(name.encode() + p.detach().float().cpu().numpy().tobytes())
    return {kind: d.hexdigest() for kind, d in digests.items()}


def _reference_gather(engine, cfg, key=None):
    """Full tensors of every parameter (or optimizer state ``key``), gathered without the code under test."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_optimizer_state
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    opt = engine.optimizer
    while hasattr(opt, "optimizer"):
        opt = opt.optimizer
    out = {}
    for name, p in engine.module.named_parameters():
        if key is not None:
            value = safe_get_full_optimizer_state(p, key)
            if value is None:
                value = opt.state[p][key]
        elif hasattr(p, "ds_id"):
            with deepspeed.zero.GatheredParameters([p]):
                value = p.data.clone()
        else:
            value = p.data.clone()
        value = value.float()
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            dim = p.partition_dim
            shards = [torch.empty_like(value) for _ in range(tp)]
            dist.all_gather(shards, value.contiguous(), group=ps.get_tensor_model_parallel_group())
            if name.endswith("linear_fc1.weight") and cfg.gated:
                halves = [s.chunk(2, dim=0) for s in shards]
                value = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
            else:
                value = torch.cat(shards, dim=dim)
        out[name] = value
    return out


def _max_diff(a, b):
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


class _CountCollectives:
    """Counts the collectives called inside the block (to check the fast path sends nothing), and
    records the largest tensor each kind moved."""

    NAMES = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "reduce_scatter_tensor")

    def __init__(self):
        self.count = 0
        self.largest = {}

    def __enter__(self):
        import torch.distributed as dist

        self.saved = {n: getattr(dist, n) for n in self.NAMES}

        def wrap(name, fn):
            def counted(*args, **kwargs):
                self.count += 1
                tensors = [t for a in (*args, *kwargs.values()) for t in (a if isinstance(a, (list, tuple)) else [a])
                           if isinstance(t, torch.Tensor)]
                # Not DeepSpeed's broadcast of each new parameter (as bytes) as zero.Init builds the
                # target model: that is the build, not the stream.
                numel = max((t.numel() for t in tensors if t.dtype != torch.uint8), default=0)
                self.largest[name] = max(self.largest.get(name, 0), numel)
                return fn(*args, **kwargs)
            return counted

        for n, fn in self.saved.items():
            setattr(dist, n, wrap(n, fn))
        # DeepSpeed's backend keeps its own reference to the all-gather (ZeRO-3's gathers).
        self.backend = self._deepspeed_backend()
        if self.backend is not None:
            self.backend_gather = self.backend.all_gather_function
            self.backend.all_gather_function = wrap("deepspeed all_gather", self.backend_gather)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        for n, fn in self.saved.items():
            setattr(dist, n, fn)
        if self.backend is not None:
            self.backend.all_gather_function = self.backend_gather

    @staticmethod
    def _deepspeed_backend():
        from deepspeed.comm import comm

        backend = getattr(comm, "cdb", None)
        return backend if getattr(backend, "all_gather_function", None) is not None else None


def _case(case):
    """One layout case; returns losses and the max deviations from the full-tensor operators."""
    from megatron_multilevel.distributed import set_seed, set_tensor_model_parallel_size
    from megatron_multilevel.level_maps import make_level_map
    from megatron_multilevel.models import build_model
    from megatron_multilevel.operators import coalesce, correct_model, decoalesce, interpolate
    from megatron_multilevel.parallel.staging import Layout, load_moments
    from megatron_multilevel.parallel.transition import coarsen, prolong
    from megatron_multilevel.training.engines import build_empty_model

    cfg = _model_config(case["variant"])
    fine_layout = Layout(case["fine_tp"], case["fine_stage"])
    coarse_layout = Layout(case["coarse_tp"], case["coarse_stage"])
    # The same groupings in every case of a variant (by default shard-local for TP=2), so that
    # all its cases train the same model as the one-process reference made with them.
    fine_tp, coarse_tp = case.get("groupings", (2, 2))
    lm = make_level_map(cfg, tensor_model_parallel_size=fine_tp, coarse_tensor_model_parallel_size=coarse_tp,
                        depth_scaling=case.get("depth_scaling", "none"))
    set_tensor_model_parallel_size(fine_layout.tensor_model_parallel_size)
    set_seed(7)
    opt, state = case["optimizer"], STATE[case["optimizer"]]
    moments = state if case["map_moments"] else ()
    fine = _engine(build_model(cfg), fine_layout.zero_stage, opt)
    out = {}
    out["losses"] = [_train_step(fine, cfg, seed=1, out=out)]
    fine_full = _reference_gather(fine, cfg)
    fine_moments = {k: _reference_gather(fine, cfg, k) for k in state}

    with _CountCollectives() as counter:
        staged, before = coarsen(
            fine.module, lm, fine_layout=fine_layout, coarse_layout=coarse_layout,
            build_target=functools.partial(build_empty_model, lm.coarse, coarse_layout,
                                           _ds_config(coarse_layout.zero_stage, 1, opt)),
            optimizer=fine.optimizer,
            moments=moments, keep=case["keep"], keep_dir=case.get("keep_dir"),
        )
    del fine
    coarse = _engine(staged.model, coarse_layout.zero_stage, opt)
    load_moments(coarse, staged)
    diffs = {"coalesce": _max_diff(_reference_gather(coarse, lm.coarse), coalesce(fine_full, lm))}
    for k in moments:
        diffs[f"coalesce_{k}"] = _max_diff(_reference_gather(coarse, lm.coarse, k), coalesce(fine_moments[k], lm))
    out["losses"].append(_train_step(coarse, lm.coarse, seed=2, out=out))
    coarse_full = _reference_gather(coarse, lm.coarse)
    coarse_moments = {k: _reference_gather(coarse, lm.coarse, k) for k in state}

    with counter:
        staged = prolong(
            coarse.module, before, lm, ALPHA, coarse_layout=coarse_layout, fine_layout=fine_layout,
            build_target=functools.partial(build_empty_model, lm.fine, fine_layout,
                                           _ds_config(fine_layout.zero_stage, 1, opt)),
            optimizer=coarse.optimizer,
            moments=moments, correction=case.get("correction", False),
        )
    out["collectives"], out["largest"] = counter.count, counter.largest
    del coarse
    fine = _engine(staged.model, fine_layout.zero_stage, opt)
    load_moments(fine, staged)
    if case.get("correction"):  # the coarse change added to the fine model (moments are blended)
        expected = correct_model(fine_full, coarse_full, lm, ALPHA)
    else:
        expected = interpolate(fine_full, decoalesce(coarse_full, lm), ALPHA)
    diffs["prolong"] = _max_diff(_reference_gather(fine, cfg), expected)
    for k in moments:
        expected = interpolate(fine_moments[k], decoalesce(coarse_moments[k], lm), ALPHA)
        diffs[f"prolong_{k}"] = _max_diff(_reference_gather(fine, cfg, k), expected)
    out["losses"].append(_train_step(fine, cfg, seed=3, out=out))
    out["diffs"] = diffs
    return out


def _worker(rank, world, cases):
    return [_case(case) for case in cases]


def _cases(variant, layouts, map_moments=True, keep="memory", keep_dir=None, groupings=(2, 2), correction=False,
           depth_scaling="none", optimizer="adamw"):
    return [
        dict(variant=variant, fine_tp=a, fine_stage=b, coarse_tp=c, coarse_stage=d, map_moments=map_moments,
             keep=keep, keep_dir=keep_dir, groupings=groupings, correction=correction, depth_scaling=depth_scaling,
             optimizer=optimizer)
        for a, b, c, d in layouts
    ]


# (fine TP, fine ZeRO stage, coarse TP, coarse ZeRO stage)
TWO_RANKS = [
    (2, 0, 2, 0),  # fast path, no communication
    (1, 1, 1, 1),  # DP=2, ZeRO-1
    (1, 2, 1, 2),  # DP=2, ZeRO-2
    (1, 3, 1, 3),  # DP=2, ZeRO-3, layer streaming
    (2, 3, 2, 3),  # TP=2 with ZeRO-3 (over a DP of 1)
    (2, 1, 1, 1),  # TP 2 -> 1 (and back on prolong)
    (1, 2, 2, 0),  # TP 1 -> 2, ZeRO stage changing too
]
FOUR_RANKS = [
    (2, 1, 2, 1),  # TP=2 x DP=2, fast path under ZeRO-1
    (2, 3, 2, 3),  # TP=2 x DP=2, ZeRO-3
    (2, 2, 1, 3),  # TP=2 x DP=2 -> DP=4 ZeRO-3
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The one-process run of every variant: the losses every layout must reproduce."""
    cases = [c for mm in (True, False) for v in ("gpt", "llama") for c in _cases(v, [(1, 0, 1, 0)], mm)]
    cases += _cases("gpt", [(1, 0, 1, 0)], correction=True) + _cases("gpt", [(1, 0, 1, 0)], correction=True,
                                                                      depth_scaling="identity")
    cases += _cases("gpt", [(1, 0, 1, 0)], optimizer="sgd") + _cases("gpt", [(1, 0, 1, 0)], correction=True,
                                                                     optimizer="sgd")
    (results,) = run_ranks(_worker, 1, tmp_path_factory.mktemp("ref"), cases)
    return {_key(c): r for c, r in zip(cases, results)}


def _key(case):
    return case["variant"], case["map_moments"], case["correction"], case["depth_scaling"], case["optimizer"]


def _check_ranks_agree(case, per_rank, ref_losses=None):
    """What each rank computed and holds on its own, before any reduction: the ranks of one
    data-parallel slice (tensor-parallel peers) have the same loss, the mean of the slices' losses
    is the one-process loss (``ref_losses``), the ranks of one tensor-parallel shard hold the same
    shards, and every rank the same replicated parameters, before and after each step."""
    world = len(per_rank)
    for step in range(len(per_rank[0]["ranks"])):
        mine = [r["ranks"][step] for r in per_rank]
        dp = mine[0]["dp"][1]
        by_slice = {}
        for rank, r in enumerate(mine):
            by_slice.setdefault(r["dp"][0], []).append((rank, r["loss"]))
        assert sorted(by_slice) == list(range(dp)) and sum(map(len, by_slice.values())) == world, (case, by_slice)
        for members in by_slice.values():
            assert all(abs(loss - members[0][1]) <= 1e-6 for _, loss in members), (case, step, members)
        mean = sum(members[0][1] for members in by_slice.values()) / dp
        if ref_losses is not None:
            assert mean == pytest.approx(ref_losses[step], abs=2e-5), (case, step, by_slice, ref_losses[step])
        for when in (0, 1):  # before the step, after it
            held = [(r["tp_rank"], r["params"][when]) for r in mine]
            if any(h is None for _, h in held):
                continue
            assert len({h["replicated"] for _, h in held}) == 1, (case, step, when, "replicated parameters diverged")
            by_shard = {}
            for tp_rank, h in held:
                by_shard.setdefault(tp_rank, set()).add(h["shards"])
            assert all(len(d) == 1 for d in by_shard.values()), (case, step, when, "a shard's replicas diverged")


def _check(results, cases, reference):
    for case, per_rank in zip(cases, zip(*results)):
        _check_ranks_agree(case, per_rank, reference[_key(case)]["losses"])
    for case, result in zip(cases, results[0]):
        for name, diff in result["diffs"].items():
            assert diff < 1e-6, (case, name, diff)
        ref = reference[_key(case)]
        assert result["losses"] == pytest.approx(ref["losses"], abs=2e-5), (case, result["losses"], ref["losses"])


def test_reference_itself_is_exact(reference):
    for result in reference.values():
        for name, diff in result["diffs"].items():
            assert diff < 1e-6, (name, diff)
        assert all(0 < loss < 10 for loss in result["losses"])


def test_two_ranks(reference, tmp_path):
    cases = _cases("gpt", TWO_RANKS) + _cases("llama", [(2, 0, 2, 0), (1, 3, 1, 3), (2, 1, 1, 2)])
    cases += _cases("gpt", [(1, 3, 1, 3)], map_moments=False, keep="disk", keep_dir=str(tmp_path / "keep"))
    # the coarse correction instead of interpolation: fast path, ZeRO-3 streaming, a TP change
    cases += _cases("gpt", [(1, 3, 1, 3), (2, 1, 1, 1)], correction=True)
    cases += _cases("gpt", [(1, 3, 1, 3)], correction=True, depth_scaling="identity")
    cases += _cases("gpt", [(2, 0, 2, 0)], map_moments=False, keep="cpu")
    cases += _cases("gpt", [(2, 0, 2, 0)], correction=True)
    # SGD's momentum carried instead of Adam's moments: ZeRO-2, ZeRO-3 streaming with the correction
    cases += _cases("gpt", [(1, 2, 1, 2)], optimizer="sgd") + _cases("gpt", [(1, 3, 1, 3)], correction=True,
                                                                     optimizer="sgd")
    results = run_ranks(_worker, 2, tmp_path, cases)
    _check(results, cases, reference)
    # The fast path (TP=2 at both levels, shard-local groupings, no ZeRO-3) communicates nothing.
    assert results[0][-3]["collectives"] == 0 and results[0][-4]["collectives"] == 0
    assert results[0][3]["collectives"] > 0  # ZeRO-3 gathers
    assert list((tmp_path / "keep" / "params").glob("layer*.rank1.pt"))


@pytest.mark.slow
def test_four_ranks(reference, tmp_path):
    cases = _cases("gpt", FOUR_RANKS) + _cases("llama", [(2, 1, 2, 1)])
    results = run_ranks(_worker, 4, tmp_path, cases)
    _check(results, cases, reference)


@pytest.mark.slow
def test_vocabulary_moves_in_slabs(tmp_path):
    """The word embedding (tied, GPT) and the untied output layer (Llama) move in slabs of 24
    vocabulary rows: 250 rows are 10 slabs and a partial one; the DP=2 ZeRO-3 partitions and the
    TP=2 shards split them at row 125, inside a slab, and slab boundaries fall inside partitions.
    Coarsening, prolonging and the moments equal the full-tensor operators bit for bit, and no
    collective of a transition moves a whole ``[vocab, hidden]`` matrix, or a broadcast more than a
    slab."""
    from megatron_multilevel.parallel.streams import vocab_slab_rows

    cfg = _model_config("gpt-slabs")
    assert vocab_slab_rows(cfg) == 24 and cfg.vocab_size % 24 and (cfg.vocab_size // 2) % 24
    cases = _cases("gpt-slabs", [(1, 3, 1, 3), (2, 3, 2, 3), (2, 0, 2, 0)])
    cases += _cases("llama-slabs", [(1, 3, 1, 3)], keep="disk", keep_dir=str(tmp_path / "keep"))
    cases += _cases("llama-slabs", [(2, 3, 1, 3), (1, 2, 1, 2)])
    results = run_ranks(_worker, 2, tmp_path, cases)
    embedding, slab = cfg.vocab_size * cfg.hidden_size, vocab_slab_rows(cfg) * cfg.hidden_size
    for case, result in zip(cases, results[0]):
        assert all(d == 0.0 for d in result["diffs"].values()), (case, result["diffs"])
        largest = result["largest"]
        assert all(n < embedding for n in largest.values()), (case, largest)
        assert largest.get("broadcast", 0) <= slab, (case, largest)
    for case, per_rank in zip(cases, zip(*results)):
        _check_ranks_agree(case, per_rank)
    assert results[0][2]["collectives"] == 0  # the fast path still communicates nothing


def _grow_case(cfg, lm, coarse_tp, coarse_stage, fine_tp, fine_stage, width_growth="fpi", keep_branches=False) -> dict:
    """Two steps of the coarse model of ``lm``, a growth to ``cfg`` with the coarse AdamW moments
    carried (``width_growth``), one step of the grown model: the largest difference of each of its
    parameters and moments from the operators applied to the gathered coarse ones, the step counts
    of its optimizer and the three losses."""
    from megatron_multilevel.config import STATE_DEGREE
    from megatron_multilevel.distributed import set_seed, set_tensor_model_parallel_size
    from megatron_multilevel.models import build_model
    from megatron_multilevel.operators import decoalesce
    from megatron_multilevel.parallel.staging import Layout, load_moments
    from megatron_multilevel.parallel.transition import prolong
    from megatron_multilevel.parallel.zero import inner_torch_optimizer
    from megatron_multilevel.training.engines import build_empty_model

    set_tensor_model_parallel_size(coarse_tp)
    set_seed(5)
    coarse = _engine(build_model(lm.coarse), coarse_stage)
    losses = [_train_step(coarse, lm.coarse, seed=1), _train_step(coarse, lm.coarse, seed=2)]
    moments = {k: _reference_gather(coarse, lm.coarse, k) for k in (None, "exp_avg", "exp_avg_sq")}
    staged = prolong(coarse.module, None, lm, 1.0, coarse_layout=Layout(coarse_tp, coarse_stage),
                     fine_layout=Layout(fine_tp, fine_stage), width_growth=width_growth,
                     build_target=functools.partial(build_empty_model, lm.fine, Layout(fine_tp, fine_stage),
                                                    _ds_config(fine_stage, 1)),
                     optimizer=coarse.optimizer, moments=STATE["adamw"], keep_branches=keep_branches)
    del coarse
    fine = _engine(staged.model, fine_stage)
    load_moments(fine, staged)
    diffs = {k: _max_diff(_reference_gather(fine, cfg, k),
                          decoalesce(m, lm, width_growth=width_growth, degree=1 if k is None else STATE_DEGREE[k],
                                     keep_branches=keep_branches))
             for k, m in moments.items()}
    steps = {float(s["step"]) for s in inner_torch_optimizer(fine.optimizer).state.values()}
    losses.append(_train_step(fine, cfg, seed=3))
    return {"diffs": diffs, "steps": steps, "losses": losses}


def _grow_worker(rank, world, layouts, depth_scaling="none"):
    """Progressive growth with the coarse AdamW moments carried: the grown model's parameters and
    moments are the coarse ones de-coalesced (halves pairing: stacked), its step count the coarse
    optimizer's. ``...-mup``: under depth-muP (CompleteP, base 1), where identity layers and MSG's
    masked growth (``msg``) rescale the kept branches and their moments by the multipliers' ratio
    (``operators.keeps_branches``)."""
    import dataclasses

    from megatron_multilevel.level_maps import make_level_map

    cfg = _model_config("gpt")
    keep = depth_scaling == "msg-mup"
    if depth_scaling.endswith("-mup"):
        depth_scaling = "none" if keep else depth_scaling.removesuffix("-mup")
        cfg = dataclasses.replace(cfg, depth_mup_base_layers=1, depth_mup_exponent=1.0)
    lm = make_level_map(cfg, width=False, depth_pairing="halves", depth_scaling=depth_scaling)
    return [_grow_case(cfg, lm, *layout, keep_branches=keep) for layout in layouts]


@pytest.mark.parametrize("depth_scaling", ["none", "identity", "identity-mup", "msg-mup"])
def test_growing_carries_the_coarse_moments(tmp_path, depth_scaling):
    # (coarse TP, coarse ZeRO stage, fine TP, fine ZeRO stage)
    (one,) = run_ranks(_grow_worker, 1, tmp_path / "one", [(1, 0, 1, 0)], depth_scaling)
    two = run_ranks(_grow_worker, 2, tmp_path / "two", [(1, 3, 1, 3), (2, 0, 1, 1), (2, 0, 2, 0)], depth_scaling)
    for result in one + two[0] + two[1]:
        assert set(result["diffs"]) == {None, "exp_avg", "exp_avg_sq"}
        assert all(d < 1e-6 for d in result["diffs"].values()), result["diffs"]
        assert result["steps"] == {2.0}  # Adam's bias correction continues from the coarse steps
        assert result["losses"] == pytest.approx(one[0]["losses"], abs=2e-5)


def _aki_grow_worker(rank, world, cases):
    """Growth in width and depth by AKI (``width_growth="aki"``) with the coarse AdamW moments
    carried, per case ``(variant, coarse TP, coarse ZeRO stage, fine TP, fine ZeRO stage)``: the
    grown parameters and moments are the operators' AKI of the gathered coarse ones, in any layout.
    The groupings are local to two TP shards in every case, so that TP=2 takes the fast path and
    every layout grows the same model."""
    from megatron_multilevel.level_maps import make_level_map
    from megatron_multilevel.parallel.staging import Layout
    from megatron_multilevel.parallel.transition import uses_fast_path

    out = []
    for variant, coarse_tp, coarse_stage, fine_tp, fine_stage in cases:
        cfg = _model_config(variant)
        lm = make_level_map(cfg, depth_pairing="halves", tensor_model_parallel_size=2,
                            coarse_tensor_model_parallel_size=2)
        result = _grow_case(cfg, lm, coarse_tp, coarse_stage, fine_tp, fine_stage, width_growth="aki")
        out.append({**result, "fast": uses_fast_path(lm, Layout(fine_tp, fine_stage), Layout(coarse_tp, coarse_stage))})
    return out


def test_aki_growth_in_every_layout_is_the_one_process_growth(tmp_path):
    """GPT and a GQA SwiGLU model grown by AKI on two ranks (TP=2 on the fast path, ZeRO-3, a TP
    change) equal the operators on the gathered coarse model and the one-process run."""
    one = run_ranks(_aki_grow_worker, 1, tmp_path / "one", [("gpt", 1, 0, 1, 0), ("llama", 1, 0, 1, 0)])[0]
    cases = [("gpt", 2, 0, 2, 0), ("gpt", 1, 3, 1, 3), ("gpt", 2, 0, 1, 1), ("llama", 2, 1, 2, 1),
             ("llama", 1, 2, 2, 3)]
    two = run_ranks(_aki_grow_worker, 2, tmp_path / "two", cases)
    assert [r["fast"] for r in two[0]] == [True, False, False, True, False]
    for case, results in zip(cases, zip(*two)):
        reference = one[0] if case[0] == "gpt" else one[1]
        for result in results:
            assert set(result["diffs"]) == {None, "exp_avg", "exp_avg_sq"}
            assert all(d < 1e-6 for d in result["diffs"].values()), (case, result["diffs"])
            assert result["losses"] == pytest.approx(reference["losses"], abs=2e-5), case
    for result in one:
        assert all(d < 1e-6 for d in result["diffs"].values()), result["diffs"]


def _mpu_worker(rank, world, tp):
    from megatron.core import parallel_state as ps

    from megatron_multilevel.distributed import set_tensor_model_parallel_size
    from megatron_multilevel.parallel.mpu import mpu

    set_tensor_model_parallel_size(tp)
    return {"dp_ranks": mpu.get_data_parallel_group_ranks(), "dp_size": mpu.get_data_parallel_world_size(),
            "tp_rank": ps.get_tensor_model_parallel_rank()}


def test_mpu_names_the_data_parallel_ranks(tmp_path):
    """DeepSpeed asks the mpu for the global ranks of this rank's data-parallel group (ZeRO
    checkpoint utilities): with TP=2 of 4 ranks, ranks 0 and 2 hold shard 0, 1 and 3 shard 1."""
    results = run_ranks(_mpu_worker, 4, tmp_path, 2)
    assert [r["dp_ranks"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["tp_rank"] for r in results] == [0, 1, 0, 1] and {r["dp_size"] for r in results} == {2}


def _perturbed_prolong_worker(rank, world, tp):
    """Coarsen and prolong with ``perturbation_std`` at TP=``tp`` on both levels (the fast path
    where the groupings allow); returns the fine parameters, gathered independently."""
    from megatron_multilevel.distributed import set_seed, set_tensor_model_parallel_size
    from megatron_multilevel.level_maps import make_level_map
    from megatron_multilevel.models import build_model
    from megatron_multilevel.parallel.staging import Layout
    from megatron_multilevel.parallel.transition import coarsen, prolong
    from megatron_multilevel.training.engines import build_empty_model

    cfg = _model_config("gpt")
    lm = make_level_map(cfg, tensor_model_parallel_size=2, coarse_tensor_model_parallel_size=2)
    layout = Layout(tp, 0)
    set_tensor_model_parallel_size(tp)
    set_seed(7)
    staged, before = coarsen(build_model(cfg), lm, fine_layout=layout, coarse_layout=layout,
                             build_target=functools.partial(build_empty_model, lm.coarse, layout))
    staged = prolong(staged.model, before, lm, ALPHA, coarse_layout=layout, fine_layout=layout,
                     build_target=functools.partial(build_empty_model, lm.fine, layout), perturbation_std=0.01,
                     seed=3)
    return _reference_gather(_engine(staged.model, 0), cfg)


def test_perturbation_is_the_same_in_every_layout(tmp_path):
    """The noise of ``perturbation_std`` is seeded by the parameter's name and scaled by the whole
    tensor's deviation: TP=2 (fast path) must build the model one process builds."""
    (one,) = run_ranks(_perturbed_prolong_worker, 1, tmp_path / "one", 1)
    two = run_ranks(_perturbed_prolong_worker, 2, tmp_path / "two", 2)
    assert _max_diff(two[0], one) < 1e-6
