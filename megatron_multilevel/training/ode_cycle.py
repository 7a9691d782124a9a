"""The ODE strategy inside the trainer: its transitions, the coherence hook, the line search, and
what a resume needs.

Between phases the model is restricted (fine -> coarse model of every other layer), prolonged
(coarse -> fine: the fine model from before the coarse phase plus the coarse change), or carried
over into a new phase of the same level (``parallel/ode_transition.py``). The fine model from
before the coarse phase is kept as the V-cycle keeps its pre-coalescing model, and rebuilt on
resume from the checkpoint saved at the end of the phase before (``RunState.open_levels[0]``).
The coherence vector is saved beside every checkpoint of the coarse phase; the line search's
reference loss is in ``RunState.ode``.

The coarse models may run at their own tensor-parallel size and DeepSpeed settings (ZeRO stage
included; ``multilevel.ode.coarse_*``): transitions then reshard every tensor, and the coherence
vector is built from the fine gradient resharded into the coarse layout.
"""

import gc
import math
import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_multilevel.level_maps import LayerSelection
from megatron_multilevel.ode_operators import restrict as restrict_tensors
from megatron_multilevel.parallel import coherence
from megatron_multilevel.parallel.ode_transition import carry, prolong, reshard_tensors, restrict, snapshot_fine
from megatron_multilevel.parallel.streams import Groups
from megatron_multilevel.parallel.transition import load_moments
from megatron_multilevel.parallel.zero import materialize_optimizer_state
from megatron_multilevel.training import checkpoint
from megatron_multilevel.training.flops import flops_per_token, forward_flops_per_token
from megatron_multilevel.training.schedule import Phase

if TYPE_CHECKING:
    from megatron_multilevel.training.trainer import Trainer

# The line search halves the correction at most this many times, then drops it.
MAX_HALVINGS = 3


class OdeCycle:
    def __init__(self, trainer: "Trainer"):
        self.t = trainer
        self.ode = trainer.cfg.multilevel.ode
        self.keys = () if self.ode.optimizer_state == "reset" else trainer.levels.optimizer_state_keys()
        self.before = None  # the fine model before the open coarse phase (a FineSnapshot)
        self.hook = None  # the coherence hook of the open coarse phase

    def selection(self, phase: Phase) -> LayerSelection:
        assert phase.parity is not None, phase
        return LayerSelection(self.t.levels.models[0], phase.parity, self.ode.residual_scale)

    def meta(self, phase: Phase) -> dict:
        """What a checkpoint's sidecar says about the phase (a coarse one: which fine layers it holds)."""
        return {"strategy": "ode", "selection": self.selection(phase).to_json() if phase.parity is not None else None}

    # ------------------------------------------------------------------ transitions
    def transition(self, phase: Phase, nxt: Phase) -> tuple[str, float]:
        """Move the trainer's engine from ``phase`` to ``nxt``; returns what was done and the extra
        FLOPs it spent (coherence gradients, line-search losses)."""
        if nxt.arrival == "restrict":
            return self._restrict(nxt)
        if nxt.arrival == "prolong":
            return self._prolong(phase, nxt)
        assert nxt.arrival == "continue", nxt
        old = self._release()
        staged = carry(old.module, self.t.levels.models[0], layout=self._layout(0), ds_config=self._ds(nxt),
                       optimizer=old.optimizer, keys=self._materialized(old))
        del old
        self._start_engine(staged, nxt)
        if self.ode.optimizer_state == "reset":
            return "carried over, optimizer afresh", 0.0
        return "carried over " + ("with its optimizer state" if self.keys else "(no optimizer state to carry)"), 0.0

    def _restrict(self, nxt: Phase) -> tuple[str, float]:
        t, state, sel = self.t, self.t.state, self.selection(nxt)
        extra, fine_grad = 0.0, None
        if self.ode.coherence == "first_order":
            fine_grad = restrict_tensors(self._gradients(t.engine, 0), sel)
            extra += flops_per_token(t.levels.models[0], t.seq) * t.tokens_per_step
        if self.ode.line_search:
            state.ode["reference_loss"] = self._batch_loss(t.engine, self._search_step(nxt))
            extra += forward_flops_per_token(t.levels.models[0], t.seq) * t.tokens_per_step
        fine_groups = Groups.current()
        old = self._release()
        staged, self.before = restrict(
            old.module, sel, fine_layout=self._layout(0), coarse_layout=self._layout(1), ds_config=self._ds(nxt),
            optimizer=old.optimizer, keys=self._materialized(old), map_state=self.ode.optimizer_state == "map",
            keep=t.cfg.multilevel.keep_fine, keep_dir=t._keep_dir(0),
        )
        state.open_levels[0] = checkpoint.tag_of(state.phase, state.step)
        del old
        self._start_engine(staged, nxt)
        if fine_grad is not None:
            fine_grad = reshard_tensors(fine_grad, sel.coarse, source=fine_groups, target=Groups.current())
            coarse_grad = self._gradients(t.engine, 1)
            self._install({name: fine_grad[name] - g for name, g in coarse_grad.items()})
            extra += flops_per_token(t.levels.models[1], t.seq) * t.tokens_per_step
        return f"restricted to {sel.describe()}", extra

    def _prolong(self, phase: Phase, nxt: Phase) -> tuple[str, float]:
        t, state, sel = self.t, self.t.state, self.selection(phase)
        scale = self.ode.correction_scale
        trials = [scale / 2**k for k in range(MAX_HALVINGS + 1)] + [0.0] if self.ode.line_search else [scale]
        coarse_groups = Groups.current()  # each trial builds the fine model in the fine layout
        coarse = self._release()
        self._remove_hook()
        if self.ode.optimizer_state == "map":
            self._materialized(coarse)
        extra, losses = 0.0, []
        for scale in trials:
            staged = prolong(coarse.module, self.before, sel, fine_layout=self._layout(0),
                             coarse_layout=self._layout(1), ds_config=self._ds(nxt),
                             prolongation=self.ode.prolongation, correction_scale=scale, optimizer=coarse.optimizer,
                             state=self.ode.optimizer_state, coarse_groups=coarse_groups)
            self._start_engine(staged, nxt, crash=scale == trials[0])
            if scale == 0.0 or not self.ode.line_search:
                break
            losses.append(self._batch_loss(t.engine, self._search_step(nxt)))
            extra += forward_flops_per_token(t.levels.models[0], t.seq) * t.tokens_per_step
            if losses[-1] <= state.ode["reference_loss"]:
                break
            t.engine = None
            gc.collect()
        del coarse
        self.before = None
        state.open_levels.pop(0, None)
        what = f"prolonged ({self.ode.prolongation}, change x{scale:g})"
        if self.ode.line_search:
            reference = state.ode.pop("reference_loss")
            t.metrics.record("line_search", phase=nxt.index, global_step=state.global_step, reference_loss=reference,
                             losses=losses, correction_scale=scale)
            what += f"; line search: loss before {reference:.4f}, tried {[round(x, 4) for x in losses]}"
        t._phase_row(nxt)["correction_scale"] = scale
        return what, extra

    def _start_engine(self, staged, phase: Phase, *, crash: bool = True) -> None:
        if crash:
            checkpoint.crash_point(f"transition{phase.index}")
        gc.collect()
        self.t.engine = self.t._engine(staged.model, phase)
        load_moments(self.t.engine, staged)

    def _release(self):
        """The trainer's engine, which the trainer no longer holds."""
        engine, self.t.engine = self.t.engine, None
        return engine

    def _materialized(self, engine) -> tuple[str, ...]:
        """The state keys to carry, created (zero) where the optimizer has not stepped yet."""
        if self.keys:
            materialize_optimizer_state(engine.optimizer, self.keys)
        return self.keys

    def _layout(self, level: int):
        return self.t.levels.layout(level)

    def _ds(self, phase: Phase) -> dict:
        return self.t.levels.ds_config(phase.level, phase.lr.peak)

    # ------------------------------------------------------------------ coherence and line search
    def _gradients(self, engine, level: int) -> dict[str, torch.Tensor]:
        """The gradient of the first coarse step's batch (the current global step). The module is
        called directly: DeepSpeed's own forward allows no backward but ``engine.backward``."""
        t = self.t
        return coherence.step_gradients(
            engine.module, lambda micro: t._loss(level, t._batch(t.data.train, level, t.state.global_step, micro),
                                                 engine=engine.module),
            t.levels.accumulation,
        )

    def _install(self, v: dict[str, torch.Tensor]) -> None:
        self.hook = coherence.CoherenceHook(self.t.engine.module, v, self.t.levels.accumulation)

    def _remove_hook(self) -> None:
        if self.hook is not None:
            self.hook.remove()
            self.hook = None

    def _search_step(self, nxt: Phase) -> int:
        """The training batch the line search scores on: the first after the coarse phase."""
        steps = nxt.steps if nxt.arrival == "restrict" else 0
        return min(self.t.state.global_step + steps, self.t.total_steps - 1)

    @torch.no_grad()
    def _batch_loss(self, engine, step: int) -> float:
        """The fine model's loss on training batch ``step`` (eval mode, averaged over data-parallel ranks)."""
        from megatron.core import parallel_state

        t = self.t
        engine.eval()
        total = torch.zeros((), dtype=torch.float64, device=next(engine.module.parameters()).device)
        for micro in range(t.levels.accumulation):
            total += t._loss(0, t._batch(t.data.train, 0, step, micro), engine=engine).double()
        engine.train()
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
        value = total.item() / t.levels.accumulation / parallel_state.get_data_parallel_world_size()
        assert math.isfinite(value), value
        return value

    # ------------------------------------------------------------------ checkpoints and resume
    def save_extra(self, directory: str) -> None:
        """Beside a checkpoint of a coarse phase with coherence: its vector (collective)."""
        if self.hook is not None:
            coherence.save(self.hook.v, self.t.levels.models[1], directory)

    def restore_before(self, state) -> None:
        """Rebuild the fine model from before the open coarse phase, if any, from the checkpoint saved
        at the end of the phase before it. Called before the current engine is built: it sets up the
        fine layout, which that engine's replaces."""
        t = self.t
        before_tag = state.open_levels.get(0)
        if before_tag is None:
            return
        fine_phase = t.phases[checkpoint.phase_of(before_tag)]
        coarse_phase = t.phases[checkpoint.phase_of(before_tag) + 1]
        engine = t._engine(t.levels.build_empty_model(0), fine_phase)
        checkpoint.load(engine, t.run_dir, before_tag, module_only=not self.keys, restore_rng=False)
        self.before = snapshot_fine(engine.module, self.selection(coarse_phase), fine_layout=self._layout(0),
                                    coarse_layout=self._layout(1), optimizer=engine.optimizer,
                                    keys=self._materialized(engine), keep=t.cfg.multilevel.keep_fine,
                                    keep_dir=t._keep_dir(0))
        del engine
        gc.collect()

    def resume(self, phase: Phase, tag: str) -> None:
        """Rebuild the coherence hook of the open coarse phase after ``trainer.engine`` was loaded
        from ``tag``."""
        t = self.t
        if phase.level == 1 and self.ode.coherence == "first_order":
            directory = os.path.join(checkpoint.checkpoint_dir(t.run_dir), tag)
            self._install(coherence.load(directory, t.levels.models[1], next(t.engine.module.parameters()).device))
