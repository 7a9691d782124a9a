"""The coalescing strategy inside the trainer (Zou et al.): its transitions and what a resume needs.

Between phases of different levels the model is coalesced into the coarser level, or de-coalesced
from it and interpolated with (or corrected from) the level's model from before it was coalesced
(``parallel/transition.py``); the first arrival at a level of an F- or grow cycle grows it. The
model from before coalescing (with its mapped optimizer moments) is kept per open level, and rebuilt
on resume from the checkpoint saved at the end of the phase that was coalesced
(``RunState.open_levels``).
"""

import functools
import gc
from typing import Callable, Optional

from megatron_multilevel.flops import flops_per_token
from megatron_multilevel.parallel.staging import FineSnapshot, load_moments
from megatron_multilevel.parallel.transition import coarsen, prolong, snapshot_level
from megatron_multilevel.training import checkpoint
from megatron_multilevel.growth.ligo import learn_depth_operator
from megatron_multilevel.growth.mask import growth_mask
from megatron_multilevel.training.context import PhaseHook, RunContext, Transition
from megatron_multilevel.training.schedule import Phase


class CoalesceCycle:
    """Coalescing, de-coalescing and interpolation between the levels of a V-, W-, F- or grow cycle."""

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.snapshots: dict[int, FineSnapshot] = {}  # open level -> its model from before coalescing

    def phase_fields(self, phase: Phase) -> dict:
        """Fields of ``phase``'s summary row beyond the common ones: none."""
        return {}

    def meta(self, phase: Phase) -> dict:
        """What a checkpoint's sidecar says of the phase beyond the common fields: nothing."""
        return {}

    def save_extra(self, directory: str) -> None:
        """Files beside a checkpoint's: none (the kept models are rebuilt from checkpoints)."""

    def check_resumable(self, sidecar: dict) -> None:
        """Nothing beyond the trainer's checks (the level maps come from the checkpoint)."""

    def restore(self, state: checkpoint.RunState) -> None:
        """Rebuild the model from before coalescing of every open level, from its checkpoint. Called
        before the current engine is built: it sets up each level's layout, which that engine's replaces."""
        for level, before_tag in sorted(state.open_levels.items()):
            self.snapshots[level] = self._snapshot_from_checkpoint(level, before_tag)

    def resume(self, phase: Phase, tag: str, engine) -> None:
        """Nothing to rebuild once the current engine is loaded."""

    def phase_hook(self, phase: Phase, module) -> Optional[PhaseHook]:
        """MSG's mask of the layers that growing into ``phase``'s level added to ``module``, where
        the run masks them (``multilevel.growth_mask_steps``); else None."""
        ml = self.ctx.cfg.multilevel
        if phase.arrival != "grow":
            return None
        return growth_mask(module, self.ctx.level_maps[phase.level], ml.growth_mask_steps)

    def transition(self, release: Callable[[], object], phase: Phase, nxt: Phase, end_tag: str) -> Transition:
        """Coalesce into, or de-coalesce (and interpolate) into, ``nxt``'s level. ``release()`` hands
        over the current engine (its holder keeps no reference, so that it is freed before the next
        level's engine is built); ``end_tag`` is the checkpoint at the end of ``phase``."""
        ctx, ml = self.ctx, self.ctx.cfg.multilevel
        extra = 0.0  # FLOPs beyond the phases' steps (LiGO's operator)
        mapped = self._mapped_state()
        old = release()
        build_target = functools.partial(ctx.levels.build_empty_model, nxt.level)
        if nxt.level > phase.level:
            assert phase.level not in self.snapshots, f"level {phase.level} is coalesced twice without being rebuilt"
            staged, before = coarsen(
                old.module, ctx.level_maps[phase.level], fine_layout=ctx.levels.layout(phase.level),
                coarse_layout=ctx.levels.layout(nxt.level), build_target=build_target, optimizer=old.optimizer,
                moments=mapped, keep=ml.keep_fine, keep_dir=ctx.keep_dir(phase.level),
            )
            self.snapshots[phase.level] = before
            ctx.state.open_levels[phase.level] = end_tag
            what = "coalesced"
        else:
            before = self.snapshots.pop(nxt.level, None)
            assert (before is None) == (nxt.arrival == "grow"), (nxt, sorted(self.snapshots))
            # growing: no model of this level to interpolate with (mapped moments: the coarse ones, grown)
            alpha = 1.0 if before is None else ml.alpha_of(nxt.level)
            staged = prolong(
                old.module, before, ctx.level_maps[nxt.level], alpha,
                coarse_layout=ctx.levels.layout(phase.level), fine_layout=ctx.levels.layout(nxt.level),
                build_target=build_target, optimizer=old.optimizer, moments=mapped,
                perturbation_std=ml.perturbation_std, seed=ctx.cfg.training.seed + nxt.index,
                correction=ml.interpolation == "correction",
                width_growth=ml.width_growth if before is None else "fpi",
                grown="fresh" if before is None and ml.growth_operator == "random" else "copy",
                grown_moments="zero" if before is None and ml.grown_moments == "zero" else "copy",
                keep_branches=before is None and ml.growth_mask_steps > 0,
                fresh_depth=self._trained_depth(nxt),
            )
            ctx.state.open_levels.pop(nxt.level, None)
            grown = "de-coalesced, grown" + (" by AKI" if ml.width_growth == "aki" else "")
            grown += ", new layers fresh" if ml.growth_operator == "random" else ""
            grown += ", their moments zero" if ml.grown_moments == "zero" else ""
            what = (grown if before is None else "de-coalesced and interpolated"
                    if ml.interpolation == "blend" else "de-coalesced, coarse correction added")
            what += f" (alpha {alpha})"
            if before is None and ml.growth_operator == "ligo":
                extra, said = self._learn_growth(staged.model, nxt)
                what += said
        checkpoint.crash_point(f"transition{nxt.index}")
        old = None
        gc.collect()
        engine = ctx.engine(staged.model, nxt)
        load_moments(engine, staged)
        return Transition(engine, what, extra_flops=extra)

    def _trained_depth(self, nxt: Phase) -> int:
        """The depth of the first model from ``nxt`` on that trains: a growth through levels that
        train no step (the late expansion) initialises its fresh layers for the model it ends in."""
        trained = next((p for p in self.ctx.phases[nxt.index:] if p.steps), nxt)
        return self.ctx.levels.models[trained.level].num_layers

    def _learn_growth(self, model, nxt: Phase) -> tuple[float, str]:
        """LiGO's depth operator trained on the grown ``model`` (``growth/ligo.py``) on the batches
        of the steps the grown level is about to train (they are seen again there): its FLOPs (each
        step a forward and backward pass of the grown model) and what to say of it."""
        from megatron.core import parallel_state as ps

        ctx, ml = self.ctx, self.ctx.cfg.multilevel
        start = ctx.state.global_step
        losses = learn_depth_operator(
            model, ctx.level_maps[nxt.level],
            batch=lambda step, micro: ctx.batch(ctx.data.train, nxt.level, start + step, micro),
            loss=lambda module, batch: ctx.loss(nxt.level, batch, module), steps=ml.ligo_steps, lr=ml.ligo_lr,
            accumulation=ctx.levels.accumulation, tp_group=ps.get_tensor_model_parallel_group(),
            dp_group=ps.get_data_parallel_group(),
        )
        flops = ml.ligo_steps * flops_per_token(ctx.levels.models[nxt.level], ctx.seq) * ctx.tokens_per_step
        return flops, f", LiGO's depth operator trained {ml.ligo_steps} steps (loss {losses[0]:.4f} -> {losses[-1]:.4f})"

    def _snapshot_from_checkpoint(self, level: int, tag: str) -> FineSnapshot:
        """Rebuild the pre-coalescing snapshot of ``level`` from its checkpoint, saved at the end of
        the phase that was coalesced."""
        ctx = self.ctx
        phase = ctx.phases[checkpoint.phase_of(tag)]
        assert phase.level == level and phase.name == "before", (level, tag, phase)
        engine = ctx.engine(ctx.levels.build_empty_model(level), phase)
        mapped = self._mapped_state()
        checkpoint.load(engine, ctx.run_dir, tag, module_only=not mapped, restore_rng=False)
        snapshot = snapshot_level(
            engine.module, ctx.level_maps[level], fine_layout=ctx.levels.layout(level),
            coarse_layout=ctx.levels.layout(level + 1), optimizer=engine.optimizer, moments=mapped,
            keep=ctx.cfg.multilevel.keep_fine, keep_dir=ctx.keep_dir(level),
        )
        del engine
        gc.collect()
        return snapshot

    def _mapped_state(self) -> tuple[str, ...]:
        """The optimizer state the transitions carry: none unless ``optimizer_state`` is ``map``;
        then Adam's moments, or SGD's momentum."""
        return self.ctx.levels.optimizer_state_keys() if self.ctx.cfg.multilevel.optimizer_state == "map" else ()

