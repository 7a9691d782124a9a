"""Groupings of fine units into coarse units ("level maps"), and their JSON form.

A :class:`Grouping` of ``n`` fine units into ``n/2`` coarse ones is the surjection ``pi`` of the
paper: coarse unit ``i`` is made of the two fine units ``j`` with ``pi(j) = i``. From it come the
averaging matrix ``F`` (``n/2 x n``, ``F[i, j] = 1/2``) and the copy matrix ``C`` (``n x n/2``).

A :class:`LevelMap` holds every grouping one coalescing step uses: hidden units (in whole
head-sized blocks), query groups (heads follow their group), FFN units, and layers. De-coalescing
must use the grouping coalescing used, so a level map is saved beside every checkpoint.
"""

import dataclasses
import json
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Literal, Optional

import torch

from megatron_multilevel.config import ModelConfig, RunConfig, coarse_model_config, undivided_size, valid_tp_sizes
from megatron_multilevel.config.parsing import parse_dataclass

Pairing = Literal["halves", "adjacent"]
PAIRINGS = ("halves", "adjacent")
DEPTH_SCALINGS = ("none", "ode", "identity")
PARAMETRISATIONS = ("folded", "explicit")
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Grouping:
    """``assignment[j]`` is the coarse unit of fine unit ``j``; every coarse unit has two."""

    assignment: tuple[int, ...]

    def __post_init__(self):
        n = len(self.assignment)
        counts = [0] * (n // 2)
        ok = n % 2 == 0 and n > 0
        for i in self.assignment if ok else ():
            if not (isinstance(i, int) and 0 <= i < n // 2):
                ok = False
                break
            counts[i] += 1
        if not ok or any(c != 2 for c in counts):
            raise ValueError(
                f"a grouping of {n} units must map exactly two fine units to each of the "
                f"{n // 2} coarse units 0..{n // 2 - 1}"
            )

    @classmethod
    def halves(cls, n: int) -> "Grouping":
        """Unit ``j`` with ``j + n/2`` (the paper's ``[I/2, I/2]``)."""
        return cls(tuple(j % (n // 2) for j in range(n))) if n % 2 == 0 else cls._bad(n)

    @classmethod
    def adjacent(cls, n: int) -> "Grouping":
        """Unit ``2i`` with ``2i + 1``."""
        return cls(tuple(j // 2 for j in range(n))) if n % 2 == 0 else cls._bad(n)

    @classmethod
    def make(cls, n: int, pairing: Pairing, *, shards: int = 1, block: int = 1) -> "Grouping":
        """``pairing`` applied inside each of ``shards`` contiguous shards, on blocks of ``block`` units.

        Partners then lie in the same tensor-parallel shard, and coarse shard ``r`` (the
        contiguous split of the coarse units) is made of fine shard ``r`` alone.
        """
        if pairing not in PAIRINGS:
            raise ValueError(f"invalid pairing {pairing!r}; valid choices are {list(PAIRINGS)}")
        if n % (2 * shards * block):
            raise ValueError(f"{n} units cannot be paired in blocks of {block} inside {shards} shard(s)")
        per_shard = n // shards // block
        local = getattr(cls, pairing)(per_shard).assignment
        blocks = [r * (per_shard // 2) + local[b] for r in range(shards) for b in range(per_shard)]
        return cls(tuple(blocks[j // block] * block + j % block for j in range(n)))

    @classmethod
    def _bad(cls, n: int) -> "Grouping":
        raise ValueError(f"{n} units cannot be halved")

    @property
    def num_fine(self) -> int:
        return len(self.assignment)

    @property
    def num_coarse(self) -> int:
        return len(self.assignment) // 2

    @cached_property
    def index(self) -> torch.Tensor:
        """Fine unit -> coarse unit, for ``index_select`` (de-coalescing copies)."""
        return torch.tensor(self.assignment, dtype=torch.long)

    @cached_property
    def partners(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The two fine units of each coarse unit, lower index first."""
        first = [-1] * self.num_coarse
        second = [-1] * self.num_coarse
        for j, i in enumerate(self.assignment):
            if first[i] < 0:
                first[i] = j
            else:
                second[i] = j
        return torch.tensor(first, dtype=torch.long), torch.tensor(second, dtype=torch.long)

    @cached_property
    def structure(self) -> str:
        """``halves`` (``j`` with ``j + n/2``), ``adjacent`` (``2i`` with ``2i+1``) or ``general``:
        the first two are done with views instead of index gathers."""
        if self == Grouping.halves(self.num_fine):
            return "halves"
        if self == Grouping.adjacent(self.num_fine):
            return "adjacent"
        return "general"

    def expand(self, block: int, *, stacks: int = 1) -> "Grouping":
        """The grouping of the ``block`` consecutive units of each unit (e.g. a head's channels),
        repeated over ``stacks`` stacked copies of the whole dimension (SwiGLU's gate and up)."""
        n, m = self.num_fine * block, self.num_coarse * block
        return Grouping(
            tuple(
                s * m + self.assignment[j // block] * block + j % block
                for s in range(stacks)
                for j in range(n)
            )
        )

    def averaging_matrix(self) -> torch.Tensor:
        """``F`` (``n/2 x n``): row ``i`` averages the two fine units of coarse unit ``i``."""
        f = torch.zeros(self.num_coarse, self.num_fine, dtype=torch.float64)
        f[self.index, torch.arange(self.num_fine)] = 0.5
        return f

    def copy_matrix(self) -> torch.Tensor:
        """``C`` (``n x n/2``): fine unit ``j`` copies coarse unit ``pi(j)``."""
        c = torch.zeros(self.num_fine, self.num_coarse, dtype=torch.float64)
        c[torch.arange(self.num_fine), self.index] = 1.0
        return c


@dataclass(frozen=True)
class LevelMap:
    """Everything needed to coalesce ``fine`` into the next level and to de-coalesce back."""

    fine: ModelConfig
    """The model being coalesced."""
    hidden: Optional[Grouping]
    """Hidden units (null: width is not coalesced)."""
    query_groups: Optional[Grouping]
    """Query groups; the heads of a group follow it. Equal to heads for multi-head attention."""
    ffn: Optional[Grouping]
    """FFN units."""
    layers: Optional[Grouping]
    """Layers (null: depth is not coalesced)."""
    depth_scaling: Literal["none", "ode", "identity"] = "none"
    """``ode``: coarse layers are Euler steps of twice the size (residual outputs x2 / x1/2).
    ``identity``: coalescing as ``ode``; de-coalescing gives the first layer of each pair the
    coarse layer and the second the identity (residual outputs zero), so the fine model computes
    the coarse model's function."""

    def __post_init__(self):
        width = (self.hidden, self.query_groups, self.ffn)
        if any(g is None for g in width) and any(g is not None for g in width):
            raise ValueError("level map: hidden, query_groups and ffn groupings go together")
        if self.depth_scaling not in DEPTH_SCALINGS:
            raise ValueError(f"level map: invalid depth_scaling {self.depth_scaling!r}; "
                             f"valid choices are {list(DEPTH_SCALINGS)}")
        self.check_model(self.fine)
        if self.coarse is None:  # pragma: no cover - coarse_model_config raises first
            raise AssertionError

    @property
    def width(self) -> bool:
        return self.hidden is not None

    @property
    def depth(self) -> bool:
        return self.layers is not None

    @cached_property
    def coarse(self) -> ModelConfig:
        return coarse_model_config(self.fine, width=self.width, depth=self.depth)

    def check_model(self, cfg: ModelConfig) -> None:
        """Raise ``ValueError`` if this map does not fit a model of config ``cfg``."""
        expected = {
            "hidden_size": self.hidden,
            "num_query_groups": self.query_groups,
            "ffn_hidden_size": self.ffn,
            "num_layers": self.layers,
        }
        for name, grouping in expected.items():
            if grouping is not None and grouping.num_fine != getattr(cfg, name):
                raise ValueError(f"level map does not match the model: its grouping has {grouping.num_fine} "
                                 f"units for model.{name} = {getattr(cfg, name)}")
        for name in ("kind", "num_attention_heads", "kv_channels", "activation",
                     "share_embeddings_and_output_weights", "normalization", "add_bias_linear",
                     "num_layers", "hidden_size", "num_query_groups", "ffn_hidden_size",
                     "vocab_size", "position_embedding_type", "num_tokentypes", "add_binary_head"):
            if getattr(cfg, name) != getattr(self.fine, name):
                raise ValueError(f"level map does not match the model: model.{name} is {getattr(cfg, name)!r}, "
                                 f"the map was made for {getattr(self.fine, name)!r}")

    @cached_property
    def unit_groupings(self) -> dict[str, Grouping]:
        """The grouping of each kind of tensor dimension (see ``plan.py``); empty without width."""
        if not self.width:
            return {}
        cfg = self.fine
        return {
            "hidden": self.hidden,
            # Fused QKV rows, per query group: [q of its heads | k | v], kv_channels rows each.
            "qkv": self.query_groups.expand((cfg.heads_per_group + 2) * cfg.kv_channels),
            # Attention output: heads in order, the heads of a group adjacent.
            "heads": self.query_groups.expand(cfg.heads_per_group * cfg.kv_channels),
            "ffn": self.ffn,
            # SwiGLU's linear_fc1 stacks [gate; up].
            "ffn_glu": self.ffn.expand(1, stacks=2),
        }

    def shard(self, rank: int, tensor_model_parallel_size: int) -> Optional["LevelMap"]:
        """This map restricted to tensor-parallel shard ``rank``, or None if partners cross shards.

        The restricted map acts on one rank's shards (heads, query groups, FFN and vocab split
        ``tp`` ways, hidden whole) exactly as this map acts on the full tensors.
        """
        tp = tensor_model_parallel_size
        if tp == 1:
            return self
        cfg = self.fine
        local_cfg = dataclasses.replace(
            cfg,
            num_attention_heads=cfg.num_attention_heads // tp,
            num_query_groups=cfg.num_query_groups // tp,
            ffn_hidden_size=cfg.ffn_hidden_size // tp,
            vocab_size=cfg.vocab_size // tp,
        )
        if not self.width:
            return dataclasses.replace(self, fine=local_cfg)
        local = {}
        for name in ("query_groups", "ffn"):
            assignment = getattr(self, name).assignment
            n = len(assignment) // tp
            part = [i - rank * (n // 2) for i in assignment[rank * n : (rank + 1) * n]]
            if any(not 0 <= i < n // 2 for i in part):
                return None
            local[name] = Grouping(tuple(part))
        return dataclasses.replace(self, fine=local_cfg, **local)

    def to_json(self) -> str:
        data = {
            "format": FORMAT_VERSION,
            "fine": dataclasses.asdict(self.fine),
            "depth_scaling": self.depth_scaling,
        }
        for name in ("hidden", "query_groups", "ffn", "layers"):
            grouping = getattr(self, name)
            data[name] = None if grouping is None else list(grouping.assignment)
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str, model: Optional[ModelConfig] = None) -> "LevelMap":
        """Read a level map; with ``model``, also check that it fits that model."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"level map: not valid JSON ({e})") from None
        expected = {"format", "fine", "depth_scaling", "hidden", "query_groups", "ffn", "layers"}
        if not isinstance(data, dict) or set(data) != expected:
            got = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"level map: expected keys {sorted(expected)}, got {got}")
        if data["format"] != FORMAT_VERSION:
            raise ValueError(f"level map: unsupported format {data['format']!r}")
        groupings = {}
        for name in ("hidden", "query_groups", "ffn", "layers"):
            try:
                groupings[name] = None if data[name] is None else Grouping(tuple(data[name]))
            except (TypeError, ValueError) as e:
                raise ValueError(f"level map {name!r}: {e}") from None
        level_map = cls(
            fine=parse_dataclass(ModelConfig, data["fine"], "level_map.fine"),
            depth_scaling=data["depth_scaling"],
            **groupings,
        )
        if model is not None:
            level_map.check_model(model)
        return level_map


def hidden_block_size(cfg: ModelConfig) -> int:
    """Hidden units are grouped in whole head-sized blocks where the hidden size allows it."""
    return cfg.kv_channels if cfg.hidden_size % (2 * cfg.kv_channels) == 0 else 1


def grouping_shards(fine_tp: int, coarse_tp: int) -> int:
    """How many contiguous shards a step's width groupings keep partners inside.

    With the same TP size at both levels, that size: partners lie in one rank's shard, so every
    rank coalesces and de-coalesces its own shards with no communication (the fast path). A step
    that changes the TP size gathers, projects and reshards anyway, so its groupings need only be
    local to shards that both levels hold whole: the greatest common divisor of the two sizes.
    It always fits, since ``Grouping.make`` needs the coarse head and FFN counts divisible by the
    shard count, and the gcd divides the coarse level's own TP size, which divides them.
    """
    return math.gcd(fine_tp, coarse_tp)


def make_level_map(
    fine: ModelConfig,
    *,
    width: bool = True,
    depth: bool = True,
    width_pairing: Pairing = "halves",
    depth_pairing: Pairing = "adjacent",
    depth_scaling: Literal["none", "ode", "identity"] = "none",
    tensor_model_parallel_size: int = 1,
    coarse_tensor_model_parallel_size: Optional[int] = None,
) -> LevelMap:
    """The level map of one coalescing step of ``fine``, run at ``tensor_model_parallel_size``,
    into a coarse level run at ``coarse_tensor_model_parallel_size`` (None: the same).

    Width groupings pair units inside each of ``grouping_shards(fine TP, coarse TP)`` shards.
    """
    coarse = coarse_model_config(fine, width=width, depth=depth)
    fine_tp = tensor_model_parallel_size
    coarse_tp = fine_tp if coarse_tensor_model_parallel_size is None else coarse_tensor_model_parallel_size
    for what, cfg, tp, key in (("fine", fine, fine_tp, "tensor_model_parallel_size"),
                               ("coarse", coarse, coarse_tp, "coarse_tensor_model_parallel_size")):
        undivided = undivided_size(cfg, tp)
        if undivided is not None:
            raise ValueError(
                f"{what} level: tensor_model_parallel_size = {tp} does not divide its {undivided}; "
                f"set {key} to one of {valid_tp_sizes(cfg)}"
            )
    shards = grouping_shards(fine_tp, coarse_tp)
    hidden = query_groups = ffn = layers = None
    if width:
        hidden = Grouping.make(fine.hidden_size, width_pairing, block=hidden_block_size(fine))
        query_groups = Grouping.make(fine.num_query_groups, width_pairing, shards=shards)
        ffn = Grouping.make(fine.ffn_hidden_size, width_pairing, shards=shards)
    if depth:
        layers = Grouping.make(fine.num_layers, depth_pairing)
    return LevelMap(fine, hidden, query_groups, ffn, layers, depth_scaling)


def run_level_maps(cfg: RunConfig) -> list[LevelMap]:
    """The groupings a run of the coalesce strategy makes when it starts (a resumed run reads them
    from its checkpoint instead): one level map per coalescing step, for the two levels' own
    tensor-parallel sizes. None for training from scratch or the ODE strategy (its layer
    selections are in the phases)."""
    ml = cfg.multilevel
    if not ml.enabled or ml.strategy == "ode":
        return []
    models, tps = cfg.level_models(), cfg.level_tp_sizes()
    return [
        make_level_map(models[level], width=ml.coalesce_width, depth=ml.coalesce_depth,
                       width_pairing=ml.width_pairing, depth_pairing=ml.depth_pairing,
                       depth_scaling=ml.depth_scaling, tensor_model_parallel_size=tps[level],
                       coarse_tensor_model_parallel_size=tps[level + 1])
        for level in range(ml.num_levels - 1)
    ]


def make_level_maps(fine: ModelConfig, num_levels: int, **kwargs) -> list[LevelMap]:
    """The ``num_levels - 1`` level maps of a V-cycle, finest first (K levels by recursion)."""
    if num_levels < 2:
        raise ValueError(f"num_levels must be >= 2, got {num_levels}")
    maps = []
    cfg = fine
    for _ in range(num_levels - 1):
        maps.append(make_level_map(cfg, **kwargs))
        cfg = maps[-1].coarse
    return maps


@dataclass(frozen=True)
class LayerSelection:
    """The ODE strategy's coarse model: fine layer ``2i + parity`` becomes coarse layer ``i``.

    Embeddings, final norm and output layer are shared (copied); a coarse layer is an Euler step
    ``residual_scale`` times as long, folded into its residual-branch outputs' weights or taken
    in the forward pass (``parametrisation``). Nothing is averaged, so the map is the same on
    every tensor-parallel shard.
    """

    fine: ModelConfig
    """The fine model."""
    parity: int
    """0: the even layers (coarse model A), 1: the odd ones (coarse model B)."""
    residual_scale: int = 2
    """The coarse step ``h``, 1 or 2: what a coarse layer's residual-branch outputs are multiplied by."""
    parametrisation: Literal["folded", "explicit"] = "folded"
    """``folded``: the weights of those outputs are multiplied by ``h`` on restriction;
    ``explicit``: they are copied and the coarse model's forward pass multiplies the outputs."""

    def __post_init__(self):
        if self.parity not in (0, 1):
            raise ValueError(f"layer selection: invalid parity {self.parity!r}; valid choices are [0, 1]")
        for name, choices in (("residual_scale", [1, 2]), ("parametrisation", list(PARAMETRISATIONS))):
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"layer selection: invalid {name} {value!r}; valid choices are {choices}")
        if self.fine.num_layers % 2:
            raise ValueError(f"layer selection: model.num_layers = {self.fine.num_layers} is odd; the coarse models "
                             f"keep every other layer of an even number of layers")

    @cached_property
    def coarse(self) -> ModelConfig:
        return coarse_model_config(self.fine, width=False, depth=True)

    @property
    def layers(self) -> tuple[int, ...]:
        """The fine layer of each coarse layer, in coarse order."""
        return tuple(range(self.parity, self.fine.num_layers, 2))

    @property
    def weight_scale(self) -> int:
        """Factor of a coarse layer's residual-branch weights against its fine layer's."""
        return self.residual_scale if self.parametrisation == "folded" else 1

    @property
    def forward_step(self) -> int:
        """Factor the coarse model's forward pass applies to each residual-branch output."""
        return self.residual_scale if self.parametrisation == "explicit" else 1

    def describe(self) -> str:
        which = "even" if self.parity == 0 else "odd"
        where = " in the forward pass" if self.parametrisation == "explicit" else ""
        return (f"the {which} fine layers {list(self.layers)} of {self.fine.num_layers}, residual-branch outputs "
                f"x{self.residual_scale}{where}")

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT_VERSION, "strategy": "ode", "fine": dataclasses.asdict(self.fine),
                           "parity": self.parity, "residual_scale": self.residual_scale,
                           "parametrisation": self.parametrisation})

    @classmethod
    def from_json(cls, text: str) -> "LayerSelection":
        """Read a layer selection; one written before ``parametrisation`` existed is ``folded``."""
        data = json.loads(text)
        expected = {"format", "strategy", "fine", "parity", "residual_scale", "parametrisation"}
        required = expected - {"parametrisation"}
        if not isinstance(data, dict) or not required <= set(data) <= expected or data["strategy"] != "ode":
            raise ValueError(f"layer selection: expected keys {sorted(expected)} with strategy 'ode'")
        return cls(parse_dataclass(ModelConfig, data["fine"], "layer_selection.fine"), data["parity"],
                   data["residual_scale"], data.get("parametrisation", "folded"))
