"""The ODE strategy inside the trainer (Lauga et al.): its transitions, the coherence hook, the line
search, and what a resume needs; a peer of ``coalesce_cycle.CoalesceCycle``.

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

import functools
import gc
import math
import os
from typing import Callable

import torch
import torch.distributed as dist

from megatron_multilevel.flops import flops_per_token, forward_flops_per_token
from megatron_multilevel.level_maps import LayerSelection
from megatron_multilevel.ode_operators import restrict_gradient
from megatron_multilevel.parallel import coherence
from megatron_multilevel.parallel.ode_transition import (carry, prolong, prolonged_change_norm, reshard_tensors, restrict,
                                                        snapshot_fine)
from megatron_multilevel.parallel.staging import load_moments
from megatron_multilevel.parallel.streams import Groups
from megatron_multilevel.parallel.zero import materialize_optimizer_state
from megatron_multilevel.training import checkpoint
from megatron_multilevel.training.context import RunContext, Transition
from megatron_multilevel.training.schedule import Phase

# The line search halves the correction at most this many times, then drops it.
MAX_HALVINGS = 3


class OdeCycle:
    """Restriction, prolongation and carrying over between the phases of the ODE strategy."""

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.ode = ctx.cfg.multilevel.ode
        self.keys = () if self.ode.optimizer_state == "reset" else ctx.levels.optimizer_state_keys()
        self.before = None  # the fine model before the open coarse phase (a FineSnapshot)
        self.hook = None  # the coherence hook of the open coarse phase

    def selection(self, phase: Phase) -> LayerSelection:
        assert phase.parity is not None, phase
        return LayerSelection(self.ctx.levels.models[0], phase.parity, self.ode.residual_scale,
                              self.ode.parametrisation)

    def phase_fields(self, phase: Phase) -> dict:
        """Fields of ``phase``'s summary row beyond the common ones: its cycle, the extra FLOPs of the
        transition into it, and for a coarse phase the fine layers it holds."""
        fields = {"cycle": phase.cycle, "extra_flops": 0.0}
        if phase.parity is not None:
            fields["fine_layers"] = list(self.selection(phase).layers)
        return fields

    def meta(self, phase: Phase) -> dict:
        """What a checkpoint's sidecar says about the phase (a coarse one: which fine layers it holds)."""
        return {"strategy": "ode", "selection": self.selection(phase).to_json() if phase.parity is not None else None}

    # ------------------------------------------------------------------ transitions
    def transition(self, release: Callable[[], object], phase: Phase, nxt: Phase, end_tag: str) -> Transition:
        """Restrict, prolong or carry over into ``nxt``. ``release()`` hands over the current engine
        (its holder keeps no reference); ``end_tag`` is unused (the ODE strategy records the tag of
        its open fine level itself). The extra FLOPs are the coherence gradients' and line-search losses'."""
        if nxt.arrival == "restrict":
            return self._restrict(release(), nxt)
        if nxt.arrival == "prolong":
            return self._prolong(release(), phase, nxt)
        assert nxt.arrival == "continue", nxt
        old = release()
        staged = carry(old.module, self.ctx.levels.models[0], build_target=self._builder(nxt), optimizer=old.optimizer,
                       keys=self._materialized(old))
        del old
        engine = self._start_engine(staged, nxt)
        if self.ode.optimizer_state == "reset":
            return Transition(engine, "carried over, optimizer afresh")
        return Transition(engine, "carried over " + ("with its optimizer state" if self.keys else
                                                     "(no optimizer state to carry)"))

    def _restrict(self, old, nxt: Phase) -> Transition:
        ctx, state, sel = self.ctx, self.ctx.state, self.selection(nxt)
        extra, fine_grad = 0.0, None
        batches = self.ode.coherence_batches
        if self.ode.coherence == "first_order":
            fine_grad = restrict_gradient(self._gradients(old, 0, batches), sel, self.ode.prolongation)
            extra += batches * flops_per_token(ctx.levels.models[0], ctx.seq) * ctx.tokens_per_step
        if self.ode.line_search:
            state.ode["reference_loss"] = self._batch_loss(old, self._search_step(nxt))
            extra += forward_flops_per_token(ctx.levels.models[0], ctx.seq) * ctx.tokens_per_step
        fine_groups = Groups.current()
        staged, self.before = restrict(
            old.module, sel, fine_layout=self._layout(0), coarse_layout=self._layout(1),
            build_target=self._builder(nxt), optimizer=old.optimizer, keys=self._materialized(old),
            map_state=self.ode.optimizer_state == "map", keep=ctx.cfg.multilevel.keep_fine, keep_dir=ctx.keep_dir(0),
        )
        state.open_levels[0] = checkpoint.tag_of(state.phase, state.step)
        del old
        engine = self._start_engine(staged, nxt)
        what, row = f"restricted to {sel.describe()}", {}
        if fine_grad is not None:
            fine_grad = reshard_tensors(fine_grad, sel.coarse, source=fine_groups, target=Groups.current())
            coarse_grad = self._gradients(engine, 1, batches)
            extra += batches * flops_per_token(ctx.levels.models[1], ctx.seq) * ctx.tokens_per_step
            v, stats = coherence.statistics(fine_grad, coarse_grad, sel.coarse)
            del fine_grad, coarse_grad
            what += "; " + self._gate(engine, v, stats, nxt)
            row["coherence"] = {**stats, "installed": state.ode["coherence"]}
        return Transition(engine, what, extra, row=row)

    def _gate(self, engine, v: dict[str, torch.Tensor], stats: dict, phase: Phase) -> str:
        """Install ``v`` on the coarse model if it models the fine one (``rho`` at most
        ``coherence_max_ratio``), record the measurement; the progress line's words."""
        ctx, state, gate = self.ctx, self.ctx.state, self.ode.coherence_max_ratio
        installed = coherence.installs(stats, gate)
        state.ode["coherence"] = installed  # a resume of this coarse phase installs it again, or not
        if installed:
            self._install(engine, v)
            state.ode["v_dot_start"] = coherence.parameter_dot(v, engine.module, self.selection(phase).coarse)
        ctx.metrics.record("coherence", phase=phase.index, cycle=phase.cycle, global_step=state.global_step,
                           max_ratio=gate, installed=installed, **stats)
        words = f"coherence rho {stats['rho']:.3g}, cosine {stats['cosine']:.3f}: "
        if installed:
            return words + "first-order term on"
        return words + f"above {gate:g}, the coarse loss alone this phase"

    def _prolong(self, coarse, phase: Phase, nxt: Phase) -> Transition:
        ctx, state, sel = self.ctx, self.ctx.state, self.selection(phase)
        scale = self.ode.correction_scale
        coarse_groups = Groups.current()  # each trial builds the fine model in the fine layout
        change = self._change(coarse, sel, coarse_groups)
        if self.ode.trust_radius is not None and change["norm"] * scale > self.ode.trust_radius:
            scale = self.ode.trust_radius / change["norm"]
            change["bounded"] = True
        trials = [scale / 2**k for k in range(MAX_HALVINGS + 1)] + [0.0] if self.ode.line_search else [scale]
        self._remove_hook()
        if self.ode.optimizer_state == "map":
            self._materialized(coarse)
        extra, losses, engine = 0.0, [], None
        for scale in trials:
            staged = prolong(coarse.module, self.before, sel, fine_layout=self._layout(0),
                             coarse_layout=self._layout(1), build_target=self._builder(nxt),
                             prolongation=self.ode.prolongation, correction_scale=scale, optimizer=coarse.optimizer,
                             state=self.ode.optimizer_state, coarse_groups=coarse_groups)
            engine = self._start_engine(staged, nxt, crash=scale == trials[0])
            if scale == 0.0 or not self.ode.line_search:
                break
            losses.append(self._batch_loss(engine, self._search_step(nxt)))
            extra += forward_flops_per_token(ctx.levels.models[0], ctx.seq) * ctx.tokens_per_step
            if losses[-1] <= state.ode["reference_loss"]:
                break
            engine = None
            gc.collect()
        del coarse
        self.before = None
        state.open_levels.pop(0, None)
        ctx.metrics.record("coarse_change", phase=phase.index, cycle=phase.cycle, global_step=state.global_step,
                           correction_scale=scale, **change)
        what = f"prolonged ({self.ode.prolongation}, change x{scale:g}); " + _describe(change)
        if self.ode.line_search:
            reference = state.ode.pop("reference_loss")
            ctx.metrics.record("line_search", phase=nxt.index, global_step=state.global_step,
                               reference_loss=reference, losses=losses, correction_scale=scale)
            what += f"; line search: loss before {reference:.4f}, tried {[round(x, 4) for x in losses]}"
        return Transition(engine, what, extra, row={"correction_scale": scale, "coarse_change": change})

    def _change(self, coarse, sel: LayerSelection, coarse_groups: Groups) -> dict:
        """The coarse phase's change: ``|P (theta_H_end - theta_H_start)|`` in fine units and, with the
        coherence term installed, ``<v, theta_H_end - theta_H_start>`` (the term's part of the
        corrected coarse objective's change; negative where the phase moved along ``-v``)."""
        state = self.ctx.state
        norm = prolonged_change_norm(coarse.module, self.before, sel, fine_layout=self._layout(0),
                                     coarse_layout=self._layout(1), prolongation=self.ode.prolongation,
                                     coarse_groups=coarse_groups)
        v_dot = None
        if self.hook is not None and "v_dot_start" in state.ode:  # absent from checkpoints of older code
            v_dot = coherence.parameter_dot(self.hook.v, coarse.module, sel.coarse) - state.ode.pop("v_dot_start")
        state.ode.pop("coherence", None)
        return {"norm": norm, "v_dot": v_dot, "bounded": False}

    def _start_engine(self, staged, phase: Phase, *, crash: bool = True):
        if crash:
            checkpoint.crash_point(f"transition{phase.index}")
        gc.collect()
        engine = self.ctx.engine(staged.model, phase)
        load_moments(engine, staged)
        return engine

    def _materialized(self, engine) -> tuple[str, ...]:
        """The state keys to carry, created (zero) where the optimizer has not stepped yet."""
        if self.keys:
            materialize_optimizer_state(engine.optimizer, self.keys)
        return self.keys

    def _layout(self, level: int):
        return self.ctx.levels.layout(level)

    def _builder(self, phase: Phase):
        """The ``build_target`` of a transition into ``phase``: an empty model of its level, in its layout."""
        return functools.partial(self.ctx.levels.build_empty_model, phase.level)

    # ------------------------------------------------------------------ coherence and line search
    def _gradients(self, engine, level: int, batches: int = 1) -> dict[str, torch.Tensor]:
        """The mean gradient of the coarse phase's first ``batches`` training batches (from the
        current global step on). The module is called directly: DeepSpeed's own forward allows no
        backward but ``engine.backward``."""
        ctx = self.ctx
        accumulation, step = ctx.levels.accumulation, ctx.state.global_step

        def micro_loss(i: int) -> torch.Tensor:
            batch = ctx.batch(ctx.data.train, level, step + i // accumulation, i % accumulation)
            return ctx.loss(level, batch, engine.module)

        return coherence.step_gradients(engine.module, micro_loss, batches * accumulation)

    def _install(self, engine, v: dict[str, torch.Tensor]) -> None:
        self.hook = coherence.CoherenceHook(engine.module, v, self.ctx.levels.accumulation)

    def _remove_hook(self) -> None:
        if self.hook is not None:
            self.hook.remove()
            self.hook = None

    def _search_step(self, nxt: Phase) -> int:
        """The training batch the line search scores on: the first after the coarse phase."""
        steps = nxt.steps if nxt.arrival == "restrict" else 0
        return min(self.ctx.state.global_step + steps, self.ctx.total_steps - 1)

    @torch.no_grad()
    def _batch_loss(self, engine, step: int) -> float:
        """The fine model's loss on training batch ``step`` (eval mode, averaged over data-parallel ranks)."""
        from megatron.core import parallel_state

        ctx = self.ctx
        engine.eval()
        total = torch.zeros((), dtype=torch.float64, device=next(engine.module.parameters()).device)
        batches = [ctx.batch(ctx.data.train, 0, step, micro) for micro in range(ctx.levels.accumulation)]
        if ctx.levels.pipelined(0):  # through the stages: the sum of the micro-batches' means
            total += ctx.levels.pipeline_step(0, ctx.seq).evaluate(engine.module, batches)[2]
        for batch in batches if not ctx.levels.pipelined(0) else []:
            total += ctx.loss(0, batch, engine).double()
        engine.train()
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
        value = total.item() / ctx.levels.accumulation / parallel_state.get_data_parallel_world_size()
        assert math.isfinite(value), value
        return value

    # ------------------------------------------------------------------ checkpoints and resume
    def save_extra(self, directory: str) -> None:
        """Beside a checkpoint of a coarse phase with coherence: its vector (collective)."""
        if self.hook is not None:
            coherence.save(self.hook.v, self.ctx.levels.models[1], directory)

    def check_resumable(self, sidecar: dict) -> None:
        """A checkpoint of a coarse phase holds a coarse model of its step (``residual_scale``, folded
        or explicit): the config must build the same one, whose change the resumed run writes back."""
        phase = self.ctx.phases[sidecar["state"]["phase"]]
        if phase.parity is None or not sidecar.get("selection"):
            return
        saved, ours = LayerSelection.from_json(sidecar["selection"]), self.selection(phase)
        for key in ("residual_scale", "parametrisation"):
            if getattr(saved, key) != getattr(ours, key):
                raise ValueError(f"the checkpoint in {self.ctx.run_dir} holds a coarse model of multilevel.ode.{key} = "
                                 f"{getattr(saved, key)!r}, the config says {getattr(ours, key)!r}; set it back to "
                                 f"resume, or use another training.output_dir")

    def restore(self, state: checkpoint.RunState) -> None:
        """Rebuild the fine model from before the open coarse phase, if any, from the checkpoint saved
        at the end of the phase before it. Called before the current engine is built: it sets up the
        fine layout, which that engine's replaces."""
        ctx = self.ctx
        before_tag = state.open_levels.get(0)
        if before_tag is None:
            return
        fine_phase = ctx.phases[checkpoint.phase_of(before_tag)]
        coarse_phase = ctx.phases[checkpoint.phase_of(before_tag) + 1]
        engine = ctx.engine(ctx.levels.build_empty_model(0), fine_phase)
        checkpoint.load(engine, ctx.run_dir, before_tag, module_only=not self.keys, restore_rng=False)
        self.before = snapshot_fine(engine.module, self.selection(coarse_phase), fine_layout=self._layout(0),
                                    coarse_layout=self._layout(1), optimizer=engine.optimizer,
                                    keys=self._materialized(engine), keep=ctx.cfg.multilevel.keep_fine,
                                    keep_dir=ctx.keep_dir(0))
        del engine
        gc.collect()

    def resume(self, phase: Phase, tag: str, engine) -> None:
        """Rebuild the coherence hook of the open coarse phase once ``engine`` is loaded from ``tag``."""
        ctx = self.ctx
        if phase.level == 1 and self.ode.coherence == "first_order" and ctx.state.ode.get("coherence", True):
            directory = os.path.join(checkpoint.checkpoint_dir(ctx.run_dir), tag)
            self._install(engine, coherence.load(directory, ctx.levels.models[1],
                                                 next(engine.module.parameters()).device))

    def phase_hook(self, phase: Phase, module) -> None:
        """Nothing added to the steps of a phase (the coherence term hooks the optimizer at
        restriction)."""
        return None


def _describe(change: dict) -> str:
    """The progress line's words for a coarse phase's change."""
    words = f"|P change| {change['norm']:.4g}"
    if change["v_dot"] is not None:
        words += f", <v, change> {change['v_dot']:.4g}"
    return words + (" (bounded by multilevel.ode.trust_radius)" if change["bounded"] else "")
