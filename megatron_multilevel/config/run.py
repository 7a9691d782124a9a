"""A whole run: ``RunConfig`` (our blocks plus the DeepSpeed keys they sit in), the checks that
span blocks, ``load_config`` and ``config_to_dict``.

DeepSpeed reads the file as it is and ignores the top-level keys it does not know
(``model``, ``multilevel``, ...). We read our blocks into strict dataclasses and check every
other top-level key against DeepSpeed's own keys, because DeepSpeed would silently ignore a
typo such as ``"zero_optimisation"``. Every "is this run valid" answer is given here, by
``load_config``, before anything is built.
"""

import dataclasses
import os
import warnings
from dataclasses import dataclass, field

from megatron_multilevel.config.data import DataConfig
from megatron_multilevel.config.deepspeed import (
    DEEPSPEED_KEYS,
    MONITOR_KEYS,
    OPTIMIZER_STATE_KEYS,
    STATE_OPTIMIZERS,
    check_batch_and_zero,
    carries_optimizer_state,
    deep_merge,
    optimizer_state_keys,
)
from megatron_multilevel.config.model import (
    ModelConfig,
    check_model_parallel,
    coarse_model_config,
    undivided_size,
    valid_tp_sizes,
)
from megatron_multilevel.config.multilevel import MultilevelConfig
from megatron_multilevel.config.optimizers import check_optimizers
from megatron_multilevel.config.pipeline import (
    PipelineSplit,
    check_pipeline_deepspeed,
    check_pipeline_method,
    level_splits,
)
from megatron_multilevel.config.parallel import (
    ParallelConfig,
    check_sequence_parallel_supported,
    resolve_sequence_parallel,
)
from megatron_multilevel.config.parsing import check_finite, parse_dataclass, read_json, to_dict, warn_one_line
from megatron_multilevel.config.scale import apply_steps_scale
from megatron_multilevel.config.training import TrainingConfig
from megatron_multilevel.config.unread import check_unread_keys
from megatron_multilevel.cycles import arrivals


@dataclass
class RunConfig:
    """A whole run: our blocks plus the DeepSpeed config they sit in."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The fine model."""
    multilevel: MultilevelConfig = field(default_factory=MultilevelConfig)
    """The multilevel method and its cycle."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Tensor parallelism."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training data."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """The training loop."""
    deepspeed: dict = field(default_factory=dict)
    """Every DeepSpeed key of the file, passed to ``deepspeed.initialize`` (per level overrides merged)."""

    def __post_init__(self):
        if self.data.seq_length > self.model.max_sequence_length:
            raise ValueError(
                f"data.seq_length = {self.data.seq_length} exceeds model.max_sequence_length = "
                f"{self.model.max_sequence_length}"
            )
        check_unread_keys(self)
        if self.multilevel.enabled and self.multilevel.strategy == "ode":
            self._check_ode()
        if "scheduler" in self.deepspeed:
            raise ValueError(
                "config: DeepSpeed's 'scheduler' is not used; the learning rate of every phase is "
                "set by training.lr and multilevel.levels[*].lr_before / lr_after"
            )
        for level, (cfg, tp) in enumerate(zip(self.level_models(), self.level_tp_sizes())):
            self._check_level_parallel(level, cfg, tp)
        self._check_pipelines()
        self._check_sequence_parallel()
        self._check_width_symmetry()
        self._check_continued_schedule()
        check_optimizers(self)
        for level in range(len(self.level_models())):
            check_batch_and_zero(self.level_deepspeed(level), "" if level == 0 else f" (level {level})")
        if self.multilevel.optimizer_state == "map":
            self._check_mapped_state()
        self._check_unused_rate()
        ml = self.multilevel
        if ml.enabled and ml.strategy == "coalesce" and ml.growth_operator == "ligo":
            for level in ml.grown_levels():
                stage = self.level_deepspeed(level).get("zero_optimization", {}).get("stage", 0)
                if stage == 3:
                    raise ValueError(f"multilevel.growth_operator 'ligo' trains its operator on the grown level's "
                                     f"whole layers, which ZeRO-3 partitions; level {level} runs ZeRO stage 3 "
                                     f"(valid choices there: 0, 1, 2)")


    def _check_unused_rate(self) -> None:
        """A multilevel run trains at its levels' schedules, not at ``optimizer.params.lr``: a rate
        there that the full model's first phase does not train at is said, not silently dropped."""
        rate = self.deepspeed.get("optimizer", {}).get("params", {}).get("lr")
        if rate is None or not self.multilevel.enabled:
            return
        fine = [spec for spec in self.multilevel.phase_specs() if spec.level == 0 and spec.steps]
        if fine and fine[0].lr.peak != rate:
            warn_one_line(f"optimizer.params.lr = {rate!r} is not used by a multilevel run: the full model's first "
                          f"phase trains at {fine[0].lr.peak!r} (its level's schedule; each level has its own)")

    def _check_continued_schedule(self) -> None:
        """``lr_schedule = "continue"`` runs one schedule over the whole run: every phase that trains
        needs the first one's decay, min_ratio and decay_fraction."""
        ml = self.multilevel
        if not (ml.enabled and ml.lr_schedule == "continue"):
            return
        trained = [(i, spec) for i, spec in enumerate(ml.phase_specs()) if spec.steps]
        assert trained, "a multilevel run trains"
        first = trained[0][1]
        for i, p in trained[1:]:
            if (p.lr.decay, p.lr.min_ratio, p.lr.decay_fraction) != (first.lr.decay, first.lr.min_ratio,
                                                                       first.lr.decay_fraction):
                def shape(lr):
                    return f"decay {lr.decay!r}, min_ratio {lr.min_ratio}, decay_fraction {lr.decay_fraction}"
                raise ValueError(
                    f"multilevel.lr_schedule = \"continue\" runs one schedule over the whole run, so every phase "
                    f"needs the same lr decay, min_ratio and decay_fraction: the first phase (level {first.level}) "
                    f"has {shape(first.lr)}; phase {i} ({p.name}, level {p.level}) has {shape(p.lr)}. Make them equal, or use "
                    f"lr_schedule \"restart\" (valid choices: restart, continue)"
                )

    def _check_width_symmetry(self) -> None:
        """Warn when a level is grown in width with nothing to break the symmetry of the copies.

        De-coalescing in width copies each coarse unit into a pair with the same incoming and
        halved outgoing weights, so the two receive the same gradient and AdamW update. A level
        first reached by growing (an F-cycle's finer levels, every level of ``grow``) has no model
        from before coalescing to interpolate with; without dropout or ``perturbation_std`` noise
        its copies stay equal for the rest of the run, and it trains at the coarse width while
        paying for the fine one. Legal (a benchmark may want exactly that), hence a warning.

        bert2BERT's AKI (``width_growth = "aki"``) draws a layer's new units from the layer above,
        which breaks the pairs of every layer but the small model's top one: having no layer above,
        that one grows by FPI, and its new heads and FFN units stay copies (measured: after 9,400
        steps of GPT 8 x 32 grown by AKI, the top layer's FFN and QKV rows of each pair, and those
        of its stacked copy, are still equal, every other layer's apart)."""
        ml = self.multilevel
        if not (ml.enabled and ml.strategy == "coalesce" and ml.coalesce_width) or ml.perturbation_std > 0:
            return
        order = ml.walk()
        grown = sorted({level for level, arrival in zip(order, arrivals(order)) if arrival == "grow"})
        if not grown or self.model.hidden_dropout > 0 or self.model.attention_dropout > 0:
            return
        which = ("the copied units of the coarser model's top layer (multilevel.width_growth 'aki' draws every other "
                 "layer's new units from the layer above; the top layer has none)" if ml.width_growth == "aki"
                 else "the copied units")
        warnings.warn(
            f"multilevel: cycle {ml.cycle!r} grows level(s) {grown} in width (multilevel.coalesce_width = true) "
            f"from a coarser level, and nothing breaks the symmetry of {which} "
            f"(multilevel.perturbation_std = 0, model.hidden_dropout = model.attention_dropout = 0): "
            f"they stay equal and train at half their width. Set multilevel.perturbation_std "
            f"(e.g. 0.01) or a dropout, or coalesce depth only (multilevel.coalesce_width = false)",
            UserWarning,
            stacklevel=2,
        )

    def _check_mapped_state(self) -> None:
        """``optimizer_state = "map"`` carries an optimizer's state through every transition: it
        must be one whose state the transitions know, the same at every level."""
        keys = []
        for level in range(len(self.level_tp_sizes())):
            ds = self.level_deepspeed(level)
            kind = ds.get("optimizer", {"type": "AdamW"}).get("type", "")
            if not carries_optimizer_state(kind):
                where = "" if level == 0 else f" at level {level} (multilevel.levels[{level}].deepspeed)"
                raise ValueError(
                    f"multilevel.optimizer_state = 'map' carries Adam's moments or SGD's momentum; "
                    f"optimizer.type is {kind!r}{where}, valid choices are {list(STATE_OPTIMIZERS)}"
                )
            keys.append(optimizer_state_keys(ds))
        if len(set(keys)) > 1:
            states = ", ".join(f"level {i}: {list(k)}" for i, k in enumerate(keys))
            raise ValueError(
                f"multilevel.optimizer_state = 'map' carries one optimizer's state through every level, and "
                f"the levels' optimizers keep different state ({states}); use the same optimizer at every "
                f"level, or optimizer_state 'reset'"
            )

    def _check_ode(self) -> None:
        ode = self.multilevel.ode
        layers = self.model.num_layers
        if layers % 2 or layers < 2:
            raise ValueError(
                f"model.num_layers = {layers}: the ODE strategy's coarse models keep every other layer "
                f"and need an even number of layers"
            )
        if ode.coarse_tensor_model_parallel_size is not None:
            coarse, key = self.level_models()[1], "multilevel.ode.coarse_tensor_model_parallel_size"
            try:
                check_model_parallel(coarse, ode.coarse_tensor_model_parallel_size, key=key)
            except ValueError as e:
                raise ValueError(f"{e} (the coarse models keep the fine width); valid values are "
                                 f"{valid_tp_sizes(coarse)}") from None
        coarse_where = "multilevel.ode.coarse_deepspeed (merged into the top-level DeepSpeed keys): "
        for level, where in ((0, ""), (1, coarse_where)):
            try:
                self._check_ode_deepspeed(self.level_deepspeed(level), coarse=level == 1)
            except ValueError as e:
                raise ValueError(f"{where}{e}") from None
        if ode.optimizer_state == "map":
            fine, coarse = (optimizer_state_keys(self.level_deepspeed(level)) for level in (0, 1))
            if fine != coarse:
                raise ValueError(
                    f"multilevel.ode.optimizer_state = 'map' carries the fine optimizer's state {list(fine)} into the "
                    f"coarse optimizer and back, and multilevel.ode.coarse_deepspeed gives the coarse models an "
                    f"optimizer with state {list(coarse)}; use the same optimizer at both levels, or "
                    f"optimizer_state 'keep' or 'reset'"
                )

    def _check_ode_deepspeed(self, ds: dict, *, coarse: bool) -> None:
        """The ODE strategy's checks of one level's DeepSpeed config (the file's keys, plus the coarse
        overrides for ``coarse``)."""
        state = self.multilevel.ode.optimizer_state
        optimizer = ds.get("optimizer", {"type": "AdamW"})
        kind = optimizer.get("type", "")
        if not carries_optimizer_state(kind):
            raise ValueError(
                f"optimizer.type = {kind!r}: the ODE strategy carries the state of "
                f"{list(OPTIMIZER_STATE_KEYS)}; valid choices are {list(STATE_OPTIMIZERS)}"
            )
        check_batch_and_zero(ds)
        stage = ds.get("zero_optimization", {}).get("stage", 0)
        if kind == "SGD" and stage and not ds.get("zero_allow_untested_optimizer"):
            raise ValueError(
                f"optimizer.type = 'SGD' with zero_optimization.stage = {stage}: DeepSpeed needs "
                f"\"zero_allow_untested_optimizer\": true for SGD under ZeRO"
            )
        low_precision = any(ds.get(k, {}).get("enabled") for k in ("bf16", "fp16"))
        # the coarse optimizer's state is read and written only when it is mapped
        carried = state == "map" or (state == "keep" and not coarse)
        if low_precision and not stage and carried:
            raise ValueError(
                f"multilevel.ode.optimizer_state = {state!r} with bf16/fp16 needs "
                f"zero_optimization.stage >= 1: without ZeRO, DeepSpeed's low-precision wrapper keeps the "
                f"optimizer state where the transitions cannot carry it"
            )
        if self.multilevel.ode.coherence == "first_order" and ds.get("fp16", {}).get("enabled"):
            raise ValueError("multilevel.ode.coherence = 'first_order' is not supported with fp16 (loss scaling); "
                             "use bf16 or fp32")

    def level_models(self) -> list[ModelConfig]:
        """The model config of every level, finest first (only the fine one without multilevel)."""
        models = [self.model]
        ml = self.multilevel
        if ml.enabled and ml.strategy == "ode":
            return [self.model, coarse_model_config(self.model, width=False, depth=True)]
        for _ in range(ml.num_levels - 1 if ml.enabled else 0):
            models.append(coarse_model_config(models[-1], width=ml.coalesce_width, depth=ml.coalesce_depth))
        return models

    def level_tp_sizes(self) -> list[int]:
        """The tensor-parallel size of every level."""
        default = self.parallel.tensor_model_parallel_size
        if not self.multilevel.enabled:
            return [default]
        if self.multilevel.strategy == "ode":
            return [default, self.multilevel.ode.coarse_tensor_model_parallel_size or default]
        return [lv.tensor_model_parallel_size or default for lv in self.multilevel.levels]

    def level_pipelines(self) -> list[PipelineSplit]:
        """The pipeline stages of every level (level 0 takes the ``parallel`` block's uneven split)."""
        return level_splits(self.parallel, self.multilevel)

    def _check_pipelines(self) -> None:
        ml = self.multilevel
        for level, (model, split) in enumerate(zip(self.level_models(), self.level_pipelines())):
            own = ml.enabled and ml.strategy == "coalesce" and ml.levels[level].pipeline_model_parallel_size
            split.stage_layers(model.num_layers, f"multilevel.levels.{level}" if own else "parallel")
            check_pipeline_deepspeed(split, self.level_deepspeed(level), level)
            check_pipeline_method(ml, split, level)

    def level_sequence_parallel(self) -> list[bool]:
        """Whether every level runs sequence-parallel (``parallel.sequence_parallel`` resolved at its TP size)."""
        setting, kind = self.parallel.sequence_parallel, self.model.kind
        return [resolve_sequence_parallel(setting, tp, kind) for tp in self.level_tp_sizes()]

    def _check_sequence_parallel(self) -> None:
        for level, (tp, on) in enumerate(zip(self.level_tp_sizes(), self.level_sequence_parallel())):
            if not on:
                continue
            check_sequence_parallel_supported(self.model.kind)
            if self.data.seq_length % tp:
                raise ValueError(
                    f"level {level}: parallel.sequence_parallel splits each sequence over the "
                    f"{tp} tensor-parallel ranks, and data.seq_length = {self.data.seq_length} is not "
                    f"divisible by {tp}; set data.seq_length to a multiple of {tp}, or "
                    f"parallel.sequence_parallel to false (valid choices are [null, true, false])"
                )

    def level_deepspeed(self, level: int) -> dict:
        """The DeepSpeed keys of ``level``: the file's, with the level's overrides deep-merged."""
        ml = self.multilevel
        overrides = {}
        if ml.enabled and ml.strategy == "coalesce":
            overrides = ml.levels[level].deepspeed
        elif ml.enabled and level == 1:
            overrides = ml.ode.coarse_deepspeed
        merged = deep_merge(self.deepspeed, overrides)
        return {k: v for k, v in merged.items() if k not in MONITOR_KEYS}  # the run's monitors (metrics.py)

    def monitors(self) -> dict:
        """The DeepSpeed monitor blocks of the config (``tensorboard``, ``wandb``, ``csv_monitor``,
        ``comet``): what the run's metrics also go to."""
        return {k: v for k, v in self.deepspeed.items() if k in MONITOR_KEYS}

    def check_world_size(self, world_size: int) -> None:
        """Raise ``ValueError``, naming the key, if a level's tensor-parallel size does not divide
        ``world_size``."""
        for level, (model, tp, split) in enumerate(zip(self.level_models(), self.level_tp_sizes(),
                                                       self.level_pipelines())):
            if world_size % (tp * split.size):
                if split.size > 1:
                    raise ValueError(f"level {level}: tensor_model_parallel_size {tp} x pipeline_model_parallel_size "
                                     f"{split.size} does not divide the world size {world_size}")
                valid = [d for d in valid_tp_sizes(model) if world_size % d == 0]
                raise ValueError(
                    f"level {level}: {self._tp_key(level)} = {tp} does not divide the world size {world_size}; "
                    f"valid values are {valid}"
                )

    def _tp_key(self, level: int) -> str:
        """The key that sets ``level``'s tensor-parallel size (as a ``dotted.key=value`` override
        writes it)."""
        ml = self.multilevel
        if ml.enabled and ml.strategy == "ode" and level == 1 and ml.ode.coarse_tensor_model_parallel_size:
            return "multilevel.ode.coarse_tensor_model_parallel_size"
        if ml.enabled and ml.strategy == "coalesce" and ml.levels[level].tensor_model_parallel_size:
            return f"multilevel.levels.{level}.tensor_model_parallel_size"
        return "parallel.tensor_model_parallel_size"

    def _own_tp_key(self, level: int) -> str:
        """The key that gives ``level`` a tensor-parallel size of its own."""
        ml = self.multilevel
        if level == 0 or not ml.enabled:
            return self._tp_key(0)
        if ml.strategy == "ode":
            return "multilevel.ode.coarse_tensor_model_parallel_size"
        return f"multilevel.levels.{level}.tensor_model_parallel_size"

    def _check_level_parallel(self, level: int, model: ModelConfig, tp: int) -> None:
        """Raise ``ValueError`` if ``level`` (model ``model``) cannot be split over ``tp`` ranks,
        naming the key to change and the sizes that would work.

        A coarse level has half the heads and FFN units of the level above it, so a size that
        splits the fine model may not split it; such a level then needs its own size, even where
        it inherits the size that is right for the fine model."""
        undivided = undivided_size(model, tp)
        if undivided is None:
            return
        key, own = self._tp_key(level), self._own_tp_key(level)
        name = undivided.split(" = ")[0]
        sizes = f"model.{undivided}" if level == 0 else (
            f"{undivided} at this level (model.{name} = {getattr(self.model, name)} at level 0)")
        setting = f"{key} = {tp}" if key == own else f"tensor_model_parallel_size = {tp} (from {key})"
        raise ValueError(
            f"level {level}: {setting} does not divide {sizes}; set {own} to one of {valid_tp_sizes(model)}"
        )


OUR_KEYS = tuple(f.name for f in dataclasses.fields(RunConfig) if f.name != "deepspeed")


def _one_peak(data: dict) -> dict:
    """A run from scratch trains at ``training.lr.peak``; DeepSpeed users set the rate in
    ``optimizer.params.lr``. Given alone, that one is the peak (a copy of ``data`` says so); given
    both and different, the config is refused, since only one can be the rate trained at. (A
    multilevel run's rates are its levels' schedules: see ``RunConfig._check_unused_rate``.)"""
    optimizer = data.get("optimizer")
    rate = optimizer.get("params", {}).get("lr") if isinstance(optimizer, dict) else None
    multilevel = data.get("multilevel")
    if rate is None or (isinstance(multilevel, dict) and multilevel.get("enabled")):
        return data
    training = data.get("training", {})
    lr = training.get("lr", {}) if isinstance(training, dict) else {}
    if not isinstance(lr, dict):
        return data  # the parser says what is wrong with it
    if "peak" not in lr:
        return {**data, "training": {**training, "lr": {**lr, "peak": rate}}}
    if lr["peak"] != rate:
        raise ValueError(
            f"optimizer.params.lr = {rate!r} and training.lr.peak = {lr['peak']!r} differ: the run trains at "
            f"training.lr.peak (the schedule's peak; DeepSpeed's scheduler is not used); set one of them, or both alike"
        )
    return data


def match_optimizer_rate(data: dict, peak: float) -> None:
    """Make a from-scratch config ``data`` that gives ``optimizer.params.lr`` give it as ``peak``, the
    rate its schedule trains at (both given must agree: :func:`_one_peak`)."""
    params = data.get("optimizer", {}).get("params", {})
    if "lr" in params:
        params["lr"] = peak


def load_config(source: "str | os.PathLike | dict") -> RunConfig:
    """Parse a run config from a JSON file path or an already loaded dict."""
    data = source if isinstance(source, dict) else read_json(source)
    if not isinstance(data, dict):
        raise ValueError("config: the top level must be a JSON object")
    check_finite(data)
    data = _one_peak(apply_steps_scale(data))
    unknown = sorted(k for k in data if k not in OUR_KEYS and k not in DEEPSPEED_KEYS)
    if unknown:
        raise ValueError(
            f"config: unknown top-level key(s) {unknown}; valid keys are our blocks "
            f"{list(OUR_KEYS)} and DeepSpeed's {sorted(DEEPSPEED_KEYS)}"
        )
    ours = {k: v for k, v in data.items() if k in OUR_KEYS}
    ours["deepspeed"] = {k: v for k, v in data.items() if k in DEEPSPEED_KEYS}
    return parse_dataclass(RunConfig, ours, "config")


def config_to_dict(cfg: RunConfig) -> dict:
    """The run config as one JSON object again (DeepSpeed keys at the top level)."""
    data = to_dict(cfg)
    data.update(data.pop("deepspeed"))
    return data
