import dataclasses
import json
import re
import warnings
from pathlib import Path

import pytest

from megatron_multilevel.config import (
    DataConfig,
    LevelConfig,
    LRConfig,
    ModelConfig,
    MultilevelConfig,
    OdeConfig,
    ParallelConfig,
    RunConfig,
    TrainingConfig,
    VisitConfig,
    config_to_dict,
    load_config,
)

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.json"))

# The accepted keys, frozen: adding or renaming one is a deliberate change to this list.
ACCEPTED = {
    RunConfig: ["data", "model", "multilevel", "parallel", "training"],
    ModelConfig: [
        "activation", "add_bias_linear", "add_binary_head", "attention_dropout", "ffn_hidden_size",
        "hidden_dropout", "hidden_size", "init_method_std", "kind", "kv_channels",
        "layernorm_epsilon", "max_sequence_length", "normalization", "num_attention_heads",
        "num_layers", "num_query_groups", "num_tokentypes", "position_embedding_type",
        "depth_mup_base_layers", "depth_mup_exponent", "rotary_base", "share_embeddings_and_output_weights",
        "transformer_impl", "vocab_size", "fp8",
    ],
    MultilevelConfig: [
        "alpha", "coalesce_depth", "coalesce_width", "depth_pairing", "depth_scaling", "enabled",
        "cycle", "grown_moments", "growth_in_decay", "growth_mask_steps", "growth_operator", "interpolation", "keep_fine", "levels", "ligo_lr", "ligo_steps",
        "lr_schedule", "num_levels", "ode",
        "optimizer_state", "perturbation_std", "strategy",
        "width_growth", "width_pairing",
    ],
    OdeConfig: [
        "coarse", "coarse_deepspeed", "coarse_lr", "coarse_steps", "coarse_tensor_model_parallel_size", "coherence",
        "coherence_batches", "coherence_max_ratio",
        "correction_scale", "cycles", "final_lr", "final_steps", "fine_lr", "first_lr", "line_search", "optimizer_state",
        "parametrisation", "post_steps", "pre_steps", "prolongation", "residual_scale", "trust_radius",
    ],
    LevelConfig: [
        "alpha", "deepspeed", "lr_after", "lr_before", "num_layers_in_first_pipeline_stage",
        "num_layers_in_last_pipeline_stage", "pipeline_model_parallel_size", "steps_after", "steps_before",
        "tensor_model_parallel_size", "visits",
    ],
    VisitConfig: ["lr", "steps"],
    LRConfig: ["decay", "decay_fraction", "min_ratio", "peak", "warmup_steps"],
    DataConfig: [
        "blend", "cache_dir", "masking_probability", "num_workers", "order_samples", "prefix", "seq_length",
        "short_sequence_probability", "split", "tokenizer_model", "valid_seed",
    ],
    TrainingConfig: [
        "eval_batches", "eval_interval", "keep_checkpoints", "log_interval", "lr", "output_dir",
        "save_interval", "seed", "steps_scale", "stop_grace_seconds", "train_steps", "transition_check",
        "transition_check_steps", "transition_check_tolerance",
    ],
    ParallelConfig: ["num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
                     "pipeline_model_parallel_size", "sequence_parallel", "tensor_model_parallel_size"],
}


@pytest.mark.parametrize("cls", ACCEPTED, ids=lambda c: c.__name__)
def test_accepted_keys_are_frozen(cls):
    # RunConfig.deepspeed holds the file's DeepSpeed keys, not a key of its own.
    names = sorted(f.name for f in dataclasses.fields(cls) if not (cls is RunConfig and f.name == "deepspeed"))
    assert names == sorted(ACCEPTED[cls])


def _config_modules():
    """Every module of the config package, found by walking it (not from a list of files)."""
    import importlib
    import pkgutil

    import megatron_multilevel.config as package

    return [importlib.import_module(m.name) for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]


def test_every_field_has_a_docstring():
    import ast
    import inspect

    found = set()
    for module in _config_modules():
        tree = ast.parse(inspect.getsource(module))
        for node in tree.body:
            if not (isinstance(node, ast.ClassDef) and dataclasses.is_dataclass(getattr(module, node.name))):
                continue
            found.add(node.name)
            body = node.body
            for i, stmt in enumerate(body):
                if isinstance(stmt, ast.AnnAssign):
                    nxt = body[i + 1] if i + 1 < len(body) else None
                    assert isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant), (
                        f"{module.__name__}.{node.name}.{stmt.target.id} has no docstring"
                    )
    # every block of the config package has its keys frozen above
    assert found == {c.__name__ for c in ACCEPTED}


def test_deepspeed_keys_pass_through():
    cfg = load_config({"train_batch_size": 8, "zero_optimization": {"stage": 2}, "model": {"num_layers": 2}})
    assert cfg.deepspeed == {"train_batch_size": 8, "zero_optimization": {"stage": 2}}
    assert cfg.model.num_layers == 2
    again = load_config(config_to_dict(cfg))
    assert again == cfg


def test_unknown_top_level_key_lists_valid_keys():
    with pytest.raises(ValueError, match=r"unknown top-level key\(s\) \['zero_optimisation'\].*'multilevel'.*zero_optimization"):
        load_config({"zero_optimisation": {"stage": 1}})


@pytest.mark.parametrize(
    "data, message",
    [
        ({"model": {"hidden": 4}}, r"config.model: unknown key\(s\) \['hidden'\]; valid keys are \[.*'hidden_size'"),
        ({"model": {"kind": "t5"}}, r"config.model.kind: invalid value 't5'; valid choices are \['gpt', 'bert'\]"),
        ({"model": {"num_layers": "4"}}, r"config.model.num_layers: expected an integer"),
        ({"model": {"num_layers": 0}}, r"model.num_layers must be a positive integer"),
        ({"model": {"hidden_size": 100, "num_attention_heads": 3}}, r"not divisible by model.num_attention_heads"),
        ({"model": {"num_query_groups": 3}}, r"num_attention_heads \(4\) must be a multiple of model.num_query_groups"),
        ({"model": {"hidden_dropout": 1.0}}, r"model.hidden_dropout must be in \[0, 1\)"),
        ({"model": {"add_binary_head": True}}, r"BERT-only"),
        ({"multilevel": {"alpha": 1.2}}, r"multilevel.alpha must be in \[0, 1\]"),
        ({"multilevel": {"num_levels": 1}}, r"multilevel.num_levels must be >= 2"),
        ({"multilevel": {"width_pairing": "random"}}, r"valid choices are \['halves', 'adjacent'\]"),
        ({"multilevel": {"coalesce_width": False, "coalesce_depth": False}}, r"cannot both be false"),
        ({"multilevel": {"enabled": True, "levels": [{}]}}, r"multilevel.levels has 1 entries; multilevel.num_levels = 2"),
        ({"multilevel": {"enabled": True, "levels": [{"steps_before": 1}, {"steps_before": 0}]}},
         r"levels\[-1\].steps_before must be positive"),
        ({"multilevel": {"levels": [{"deepspeed": {"zero_optimisation": {}}}]}}, r"unknown DeepSpeed key\(s\) \['zero_optimisation'\]"),
        ({"multilevel": {"enabled": True, "num_levels": 3, "levels": [{"steps_before": 1}] * 3}, "model": {"num_layers": 6}},
         r"model.num_layers = 3 cannot be halved"),
        ({"data": {"seq_length": 256}}, r"data.seq_length = 256 exceeds model.max_sequence_length = 128"),
        ({"data": {"prefix": "x"}}, r"data.prefix and data.tokenizer_model go together"),
        ({"data": {"split": "98,0,2"}}, r"needs a validation share"),
        ({"training": {"lr": {"decay": "step"}}}, r"valid choices are \['cosine', 'linear', '1-sqrt', 'constant'\]"),
        ({"scheduler": {"type": "WarmupLR"}}, r"DeepSpeed's 'scheduler' is not used"),
        ({"parallel": {"tensor_model_parallel_size": 3}}, r"tensor_model_parallel_size = 3 does not divide model.num_attention_heads"),
        ({"model": []}, r"config.model: expected an object"),
    ],
)
def test_bad_values(data, message):
    with pytest.raises(ValueError, match=message):
        load_config(data)


def test_top_level_must_be_an_object(tmp_path):
    path = tmp_path / "c.json"
    path.write_text("[1]")
    with pytest.raises(ValueError, match="top level must be a JSON object"):
        load_config(path)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_parse(path):
    cfg = load_config(path)
    assert json.loads(path.read_text())["model"]["kind"] == cfg.model.kind


def test_grow_cycle_schedule():
    from megatron_multilevel.training.schedule import build_phases

    levels = [{"steps_before": 0, "steps_after": 7}, {"steps_before": 5}]
    cfg = load_config({"multilevel": {"enabled": True, "cycle": "grow", "alpha": 1.0, "levels": levels}})
    assert [(p.level, p.steps, p.name) for p in build_phases(cfg)] == [(1, 5, "coarsest"), (0, 7, "after")]
    v = load_config({"multilevel": {"enabled": True, "levels": [{"steps_before": 2, "steps_after": 7}, {"steps_before": 5}]}})
    assert [(p.level, p.steps, p.name) for p in build_phases(v)] == [(0, 2, "before"), (1, 5, "coarsest"), (0, 7, "after")]
    with pytest.raises(ValueError, match="level 0 needs alpha 1.0"):
        load_config({"multilevel": {"enabled": True, "cycle": "grow", "levels": levels}})
    with pytest.raises(ValueError, match=r"levels\[0\].steps_before must be 0 with cycle 'grow'"):
        load_config({"multilevel": {"enabled": True, "cycle": "grow", "alpha": 1.0,
                                    "levels": [{"steps_before": 3}, {"steps_before": 5}]}})


def test_mapped_optimizer_state_of_each_optimizer():
    """``optimizer_state = "map"`` carries Adam's moments or SGD's momentum (nothing for SGD
    without momentum); another optimizer, or levels whose optimizers keep different state, are
    refused before anything is built."""
    from megatron_multilevel.training.engines import LevelEngines

    def levels(optimizer, coarse=None):
        multilevel = {"enabled": True, "optimizer_state": "map",
                      "levels": [{"steps_before": 2, "steps_after": 2},
                                 {"steps_before": 2, **({"deepspeed": {"optimizer": coarse}} if coarse else {})}]}
        return LevelEngines(load_config({"train_batch_size": 4, "optimizer": optimizer, "multilevel": multilevel}), 1)

    assert levels({"type": "AdamW"}).optimizer_state_keys() == ("exp_avg", "exp_avg_sq")
    assert levels({"type": "SGD", "params": {"momentum": 0.9}}).optimizer_state_keys() == ("momentum_buffer",)
    assert levels({"type": "SGD", "params": {"lr": 0.1}}).optimizer_state_keys() == ()
    with pytest.raises(ValueError, match=r"^multilevel.optimizer_state = 'map' carries Adam's moments or SGD's "
                                         r"momentum; optimizer.type is 'Lamb', valid choices are \['Adam', 'AdamW', 'Muon', 'SGD'\]$"):
        levels({"type": "Lamb"})
    with pytest.raises(ValueError, match=r"optimizer.type is 'Lamb' at level 1 \(multilevel.levels\[1\].deepspeed\)"):
        levels({"type": "AdamW"}, coarse={"type": "Lamb"})
    with pytest.raises(ValueError, match=r"level 0: \['exp_avg', 'exp_avg_sq'\], level 1: \['momentum_buffer'\]"):
        levels({"type": "AdamW"}, coarse={"type": "SGD", "params": {"momentum": 0.9}})


def test_continued_schedule_needs_one_decay():
    """``lr_schedule = "continue"`` runs one schedule over the run: a phase that trains with another
    decay or min_ratio is refused when the config is read, naming the phase."""
    cosine, linear = {"peak": 1e-3, "decay": "cosine"}, {"peak": 1e-3, "decay": "linear"}

    def config(coarse_lr, coarse_steps=2):
        return {"train_batch_size": 4, "multilevel": {
            "enabled": True, "lr_schedule": "continue",
            "levels": [{"steps_before": 2, "steps_after": 2, "lr_before": cosine},
                       {"steps_before": coarse_steps, "lr_before": coarse_lr}]}}

    load_config(config(cosine))
    with pytest.raises(ValueError, match=r"the first phase \(level 0\) has decay 'cosine', min_ratio 0.1, decay_fraction 1.0; "
                                         r"phase 1 \(coarsest, level 1\) has decay 'linear'"):
        load_config(config(linear))
    ode = {"train_batch_size": 4, "multilevel": {
        "enabled": True, "strategy": "ode", "lr_schedule": "continue",
        "ode": {"coarse_lr": {"peak": 1e-3, "min_ratio": 0.5}, "pre_steps": 2, "post_steps": 2}}}
    with pytest.raises(ValueError, match=r"phase 1 \(coarse, level 1\) has decay 'cosine', min_ratio 0.5"):
        load_config(ode)
    ode["multilevel"]["ode"]["coarse_lr"]["min_ratio"] = 0.1
    load_config(ode)


def _cycle(cycle: str, **multilevel) -> dict:
    levels = [{"steps_before": 0, "steps_after": 4}, {"steps_before": 4}]
    if cycle == "v":
        levels[0]["steps_before"] = 2
    return {"multilevel": {"enabled": True, "cycle": cycle, "alpha": 1.0, "levels": levels, **multilevel}}


@pytest.mark.parametrize(
    "data, warns",
    [
        (_cycle("grow"), True),                                       # the fine model only ever grown
        (_cycle("f"), True),                                          # an F-cycle grows it from the coarse start
        (_cycle("grow", perturbation_std=0.01), False),                # noise breaks the symmetry
        (_cycle("grow") | {"model": {"hidden_dropout": 0.1}}, False),  # so does dropout
        (_cycle("grow") | {"model": {"attention_dropout": 0.1}}, False),
        (_cycle("grow", coalesce_width=False), False),                 # depth copies are not a width pair
        (_cycle("grow", width_growth="aki"), True),                   # AKI leaves the top layer's copies
        (_cycle("v"), False),                                          # the fine model starts from its own init
    ],
    ids=["grow", "f", "perturbation", "hidden-dropout", "attention-dropout", "depth-only", "aki", "v"],
)
def test_width_growth_without_symmetry_breaking_warns(data, warns):
    """A level reached first by growing in width, with no noise and no dropout, keeps equal copies
    for the whole run; the config says so when it is read (a warning: the run is legal)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(data)
    messages = [str(w.message) for w in caught if "symmetry" in str(w.message)]
    assert len(messages) == int(warns), messages
    if warns:
        assert "multilevel.perturbation_std" in messages[0] and "level(s) [0]" in messages[0]
        assert ("top layer" in messages[0]) == (data["multilevel"].get("width_growth") == "aki"), messages[0]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_do_not_warn_of_width_symmetry(path):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(path)
    assert not [w for w in caught if "symmetry" in str(w.message)]


@pytest.mark.parametrize("name, baseline", [
    ("gpt_base.json", "gpt_base_scratch.json"), ("gpt_base_zero2.json", "gpt_base_scratch.json"),
    ("gpt_base_zero3.json", "gpt_base_scratch.json"), ("gpt_base_grow.json", "gpt_base_scratch.json"),
    ("gpt_base_gstack.json", "gpt_base_scratch.json"), ("gpt_base_msg.json", "gpt_base_scratch.json"),
    ("bert_base.json", "bert_base_scratch.json"),
    ("bert_large.json", "bert_large_scratch.json")])
def test_gpu_recipe_configs_spend_their_scratch_baselines_flops(name, baseline):
    """The README promises the GPU recipe configs run within the FLOPs of their baselines
    (``*_scratch.json``, and use them): hand-computed step counts that drift from it would compare
    unequal budgets."""
    from megatron_multilevel.training.baseline import baseline_config

    root = Path(__file__).parent.parent / "configs"
    run, scratch = load_config(root / name), load_config(root / baseline)
    # "the rest" of a recipe is rounded down, so that a run never spends more than its baseline
    assert scratch.training.train_steps - 1 <= baseline_config(run).training.train_steps <= scratch.training.train_steps
    assert baseline_config(run).model == scratch.model


@pytest.mark.parametrize("changes, message", [
    ({"train_batch_size": 0}, r"^train_batch_size must be a positive integer, got 0$"),
    ({"train_batch_size": -8}, r"^train_batch_size must be a positive integer, got -8$"),
    ({"train_micro_batch_size_per_gpu": "4"}, r"^train_micro_batch_size_per_gpu must be a positive integer, got '4'$"),
    ({"gradient_accumulation_steps": True}, r"^gradient_accumulation_steps must be a positive integer, got True$"),
    ({"zero_optimization": {"stage": 4}}, r"^zero_optimization.stage = 4; valid choices are \[0, 1, 2, 3\]$"),
    ({"zero_optimization": {"stage": "1"}}, r"^zero_optimization.stage = '1'; valid choices are \[0, 1, 2, 3\]$"),
    ({"multilevel": {"enabled": True, "levels": [{"steps_before": 1, "steps_after": 1},
                                                 {"steps_before": 1, "deepspeed": {"zero_optimization": {"stage": 5}}}]}},
     r"^zero_optimization.stage \(level 1\) = 5; valid choices"),
])
def test_batch_sizes_and_zero_stage_are_checked_before_deepspeed_sees_them(changes, message):
    """What DeepSpeed would stop on with an assertion or a validation traceback after start-up is
    one line at load time, naming the key (and the level whose overrides hold it)."""
    with pytest.raises(ValueError, match=message):
        load_config({"train_batch_size": 8, **changes})


def test_a_config_file_that_is_not_json_is_one_line(tmp_path):
    from megatron_multilevel.config.parsing import read_json

    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "train_batch_size": 8,\n  "model": {"num_layers": \n')
    with pytest.raises(ValueError, match=rf"^{re.escape(str(bad))}: not valid JSON: Expecting value at line 4, column 1$"):
        load_config(str(bad))
    with pytest.raises(ValueError, match=r"missing.json: cannot be read \(No such file or directory\)"):
        read_json(tmp_path / "missing.json")


def test_one_learning_rate_for_a_run_from_scratch():
    """A DeepSpeed user's optimizer.params.lr is the peak when training.lr.peak is not given; both
    given and different is refused, naming both and the one the run trains at; a multilevel run,
    which trains at its levels' schedules, says when that rate is not the one its full model uses."""
    adamw = {"type": "AdamW", "params": {"lr": 0.5}}
    assert load_config({"optimizer": adamw}).training.lr.peak == 0.5
    assert load_config({"optimizer": adamw, "training": {"lr": {"peak": 0.5}}}).training.lr.peak == 0.5
    with pytest.raises(ValueError, match=r"^optimizer.params.lr = 0.5 and training.lr.peak = 0.001 differ: "
                                         r"the run trains at training.lr.peak"):
        load_config({"optimizer": adamw, "training": {"lr": {"peak": 1e-3}}})
    levels = [{"steps_before": 2, "lr_before": {"peak": 0.002}, "steps_after": 2}, {"steps_before": 2}]
    with pytest.warns(UserWarning, match=r"optimizer.params.lr = 0.5 is not used by a multilevel run: the full "
                                         r"model's first phase trains at 0.002"):
        load_config({"optimizer": adamw, "multilevel": {"enabled": True, "levels": levels}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config({"optimizer": {"type": "AdamW", "params": {"lr": 0.002}},
                     "multilevel": {"enabled": True, "levels": levels}})
    # such a run's baseline from scratch trains at the full model's rate, and says so in both places
    from megatron_multilevel.training.baseline import baseline_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = load_config({"optimizer": adamw, "multilevel": {"enabled": True, "levels": levels}})
    baseline = baseline_config(run)
    assert baseline.training.lr.peak == 0.002 == baseline.deepspeed["optimizer"]["params"]["lr"]


def _grow(**multilevel) -> dict:
    return _cycle("grow", **{"coalesce_width": False, "depth_pairing": "halves", **multilevel})


@pytest.mark.parametrize(
    "multilevel, message",
    [
        (dict(growth_operator="random", optimizer_state="map"), r"set multilevel.grown_moments to 'zero'"),
        (dict(growth_operator="random", depth_scaling="ode"), r"valid choices are \['none', 'identity'\]"),
        (dict(growth_operator="random", coalesce_width=True), r"coalesce_depth true and coalesce_width false"),
        (dict(grown_moments="zero"), r"with optimizer_state 'reset' every moment starts afresh"),
        (dict(grown_moments="fresh", optimizer_state="map"), r"valid choices are \['map', 'zero'\]"),
    ],
    ids=["random-needs-zero-moments", "random-ode", "random-width", "zero-moments-reset", "bad-moments"],
)
def test_growth_of_new_layers_is_checked(multilevel, message):
    with pytest.raises(ValueError, match=message):
        load_config(_grow(**multilevel))


def test_random_growth_needs_a_grown_level():
    data = _cycle("v", coalesce_width=False, growth_operator="random")
    with pytest.raises(ValueError, match=r"cycle 'v' grows no level"):
        load_config(data)


def test_random_growth_and_zero_moments_are_accepted():
    cfg = load_config(_grow(growth_operator="random", optimizer_state="map", grown_moments="zero",
                            depth_scaling="identity"))
    assert (cfg.multilevel.growth_operator, cfg.multilevel.grown_moments) == ("random", "zero")


@pytest.mark.parametrize("override, says", [
    ("model.init_method_std=NaN", "model.init_method_std must be a finite number, got nan"),
    ("gradient_clipping=NaN", "gradient_clipping must be a finite number, got nan"),
    ("multilevel.levels.0.lr_before.peak=Infinity", "multilevel.levels.0.lr_before.peak must be a finite number, "
                                                    "got inf"),
    ("multilevel.levels.0.lr_before.peak=1e300", "lr.peak must be in (0, 10], got 1e+300"),
    ("optimizer.params.lr=1e300", "optimizer.params.lr must be in (0, 10], got 1e+300"),
    ("optimizer.params.betas=[0.9,1.5]", "optimizer.params.betas must be two numbers in [0, 1), got [0.9, 1.5]"),
    ("optimizer.params.eps=0", "optimizer.params.eps must be positive, got 0"),
    ("optimizer.params.weight_decay=-0.1", "optimizer.params.weight_decay must be >= 0, got -0.1"),
    ("gradient_clipping=-1", "gradient_clipping must be a number >= 0 (0: no clipping), got -1"),
    ("model.init_method_std=0", "model.init_method_std must be positive, got 0"),
    ("training.stop_grace_seconds=-5", "training.stop_grace_seconds must be >= 0 (0: no limit), got -5"),
    ("training.transition_check=loud", "training.transition_check: invalid value 'loud'; valid choices are "
                                       "['error', 'warn', 'off']"),
    ("training.transition_check_tolerance=0", "training.transition_check_tolerance must be a number > 0, got 0"),
    ("training.transition_check_steps=0", "training.transition_check_steps"),
])
def test_values_no_run_can_take_are_one_line_naming_the_key(override, says):
    """NaN, infinities and values out of range, as overrides give them: refused while the config is
    read, before anything is built, naming the key."""
    from megatron_multilevel.config.parsing import apply_overrides
    from megatron_multilevel.pretrain import DEFAULT_CONFIG
    from megatron_multilevel.config.parsing import read_json

    with pytest.raises(ValueError) as e:
        load_config(apply_overrides(read_json(DEFAULT_CONFIG), [override]))
    assert says in str(e.value)


def test_a_model_no_memory_holds_is_refused_with_the_estimate():
    from megatron_multilevel.flops import check_fits

    cfg = ModelConfig(num_layers=96, hidden_size=1 << 20, num_attention_heads=64, vocab_size=50304)
    with pytest.raises(ValueError, match=r"has 1\.27e\+1[0-9] parameters: training takes at least 16 bytes each .* "
                                         r"spread over all 8 rank\(s\), and a rank has 8\.59e\+10 \(its GPU's memory\)"):
        check_fits(cfg, 8, 80 << 30, "its GPU's memory")
    check_fits(ModelConfig(num_layers=24, hidden_size=1024, num_attention_heads=16, vocab_size=50304), 1, 80 << 30,
               "its GPU's memory")
