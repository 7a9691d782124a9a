"""The training driver: from scratch (multilevel disabled), a V-, W-, F- or grow cycle, or the ODE
strategy's cycles, GPT or BERT.

A run is a list of phases (``schedule.py``). The trainer trains each phase, evaluates, logs and
saves; between two phases it hands its engine to the cycle of the run's strategy, which returns the
next phase's: ``CoalesceCycle`` (``coalesce_cycle.py``: coalesce, or de-coalesce and interpolate with
the level's model from before it was coalesced) or ``OdeCycle`` (``ode_cycle.py``: restrict, prolong
or carry over). Both see the run through one ``RunContext`` (``context.py``). Checkpoints are saved
periodically and at the end of every phase, so that a killed run, transition included, resumes from
the last one and follows the same trajectory.
"""

import json
import math
import os
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from megatron_multilevel.config import RunConfig, config_to_dict, load_config
from megatron_multilevel.data.datasets import build_data, ordered_samples
from megatron_multilevel.data.tokenizer import keep_tokenizer
from megatron_multilevel.flops import flops_per_token
from megatron_multilevel.level_maps import LevelMap, run_level_maps
from megatron_multilevel.training import checkpoint, config_drift
from megatron_multilevel.training.checkpoint import RunState
from megatron_multilevel.training.coalesce_cycle import CoalesceCycle
from megatron_multilevel.training.context import RunContext, device
from megatron_multilevel.training.engines import LevelEngines
from megatron_multilevel.training.metrics import Metrics
from megatron_multilevel.training.ode_cycle import OdeCycle
from megatron_multilevel.training.schedule import Phase, build_phases, schedule_signature
from megatron_multilevel.training.stop import Stopped, StopRequest
from megatron_multilevel.training.transition_check import TransitionCheck


class TrainingError(RuntimeError):
    """Training cannot go on (NaN loss); the last good checkpoint is kept."""


class Trainer:
    def __init__(self, cfg: RunConfig, stop: "StopRequest | None" = None, allow_config_change: bool = False):
        """``stop``: the process's signal handler, which the run asks after every step (and between
        phases) whether to save and stop. ``allow_config_change``: a resume may change what the
        checkpoint's config said (``config_drift.py``)."""
        self.cfg = cfg
        self.stop = stop
        self.allow_config_change = allow_config_change
        self.config_changes: dict = {}
        self.phases = build_phases(cfg)
        self.levels = LevelEngines(cfg, dist.get_world_size())
        self.ctx = RunContext(cfg, self.phases, self.levels)
        ordered_samples(cfg, self.ctx.total_steps * self.levels.global_batch)  # data.order_samples, before any compute
        self.rank = dist.get_rank()
        self.engine = None
        self.saved_tag: "str | None" = None
        """The tag of the checkpoint last saved or resumed from."""
        ml = cfg.multilevel
        self.cycle = OdeCycle(self.ctx) if ml.enabled and ml.strategy == "ode" else CoalesceCycle(self.ctx)
        self.check = TransitionCheck(cfg, self._evaluate, lambda *a, **k: self.ctx.metrics.record(*a, **k),
                                     lambda line: self.ctx.metrics.say(line))

    # ---------------------------------------------------------------- setup and resume
    def _level_maps(self, sidecar: "dict | None") -> list[LevelMap]:
        if sidecar is not None:
            return [LevelMap.from_json(text) for text in sidecar["level_maps"]]
        return run_level_maps(self.cfg)

    def _meta(self) -> dict:
        return {"model": asdict(self.cfg.model), "level_maps": [m.to_json() for m in self.ctx.level_maps],
                "config": config_to_dict(self.cfg)}

    def _check_resumable(self, sidecar: dict) -> None:
        ours = asdict(self.cfg.model)
        if sidecar["model"] != ours:
            diff = sorted(k for k in ours if sidecar["model"].get(k) != ours[k])
            raise ValueError(
                f"the checkpoint in {self.ctx.run_dir} is from a different model (model.{', model.'.join(diff)} "
                f"differ); use another training.output_dir"
            )
        saved = sidecar.get("config_phases")
        if saved is not None and saved != self._config_phases():
            raise ValueError(f"the checkpoint in {self.ctx.run_dir} follows a different schedule; "
                             f"use another training.output_dir")
        saved_levels = LevelEngines(load_config(sidecar["config"]), sidecar["world_size"])
        change = self.levels.layout_change(saved_levels)
        if change is not None:
            raise ValueError(f"the checkpoint {sidecar['tag']} in {self.ctx.run_dir} was written in another layout "
                             f"({change}); reshard the run for this one first: python tools/convert_checkpoint.py "
                             f"reshard {self.ctx.run_dir} NEW_RUN_DIR {self.levels.reshard_flags()}")
        self.cycle.check_resumable(sidecar)
        changes = config_drift.trajectory_changes(sidecar["config"], config_to_dict(self.cfg))
        if saved_levels.global_batch != self.levels.global_batch:
            changes["global batch"] = (saved_levels.global_batch, self.levels.global_batch)
        if changes and not self.allow_config_change:
            raise ValueError(
                f"the checkpoint {sidecar['tag']} in {self.ctx.run_dir} was written by another config "
                f"({config_drift.describe(changes)}): run its config, use another training.output_dir, or pass "
                f"--allow-config-change to change it from there on (recorded in {config_drift.CHANGES})")
        self.config_changes = changes

    def _say(self, line: str) -> None:
        """A line on the console before the run's metrics exist (rank 0)."""
        if self.rank == 0:
            print(line, flush=True)

    def _start(self) -> RunState:
        found = checkpoint.read_resumable(self.ctx.run_dir, say=self._say)
        sidecar = found[1] if found else None
        if sidecar is not None:
            self._check_resumable(sidecar)
        self.ctx.level_maps = self._level_maps(sidecar)
        if found is None:
            state = RunState()
            phase = self.phases[0]
            self.engine = self.ctx.engine(self.levels.build_initial_model(phase.level), phase)
            self.ctx.metrics = Metrics(self.ctx.run_dir, enabled=self.rank == 0, monitors=self.cfg.monitors())
            if self.rank == 0:
                with open(os.path.join(self.ctx.run_dir, "config.json"), "w") as f:
                    json.dump(config_to_dict(self.cfg), f, indent=1)
            return state
        tag, sidecar = found
        state = checkpoint.state_of(sidecar)
        self.ctx.state = state
        self.ctx.metrics = Metrics(self.ctx.run_dir, enabled=self.rank == 0, resume_global_step=state.global_step,
                                   resume_phase=state.phase, monitors=self.cfg.monitors())
        self.ctx.metrics.say(f"resuming from {tag} (phase {state.phase + 1}/{len(self.phases)}, step {state.step})")
        if self.config_changes:
            self.ctx.metrics.say(f"config changed from global step {state.global_step} on (--allow-config-change): "
                                 f"{config_drift.describe(self.config_changes)}")
            if self.rank == 0:
                config_drift.record(self.ctx.run_dir, self.config_changes, global_step=state.global_step, tag=tag,
                                    config=config_to_dict(self.cfg))
        self.cycle.restore(state)
        phase = self.phases[state.phase]
        self.engine = self.ctx.engine(self.levels.build_empty_model(phase.level), phase)
        checkpoint.load(self.engine, self.ctx.run_dir, tag, restore_rng=sidecar["world_size"] == dist.get_world_size())
        self.saved_tag = tag
        self.cycle.resume(phase, tag, self.engine)
        self.ctx.metrics.record("resume", global_step=state.global_step, phase=state.phase, tag=tag)
        return state

    # ---------------------------------------------------------------- training
    def _train_step(self, level: int, global_step: int) -> float:
        from megatron.core import parallel_state

        batches = (self.ctx.batch(self.ctx.data.train, level, global_step, m) for m in range(self.levels.accumulation))
        if self.levels.pipelined(level):
            value = self.levels.pipeline_step(level, self.ctx.seq).train(self.engine, list(batches))
        else:
            losses = []
            for batch in batches:
                loss = self.ctx.loss(level, batch, self.engine)
                self.engine.backward(loss)
                self.engine.step()
                losses.append(loss.detach().float())
            value = torch.stack(losses).mean()
        dist.all_reduce(value, group=parallel_state.get_data_parallel_group())
        value = value.item() / parallel_state.get_data_parallel_world_size()
        if not math.isfinite(value):
            raise TrainingError(
                f"loss is {value} at global step {global_step + 1}; stopped, the last good checkpoint "
                f"in {checkpoint.checkpoint_dir(self.ctx.run_dir)} is kept"
            )
        return value

    @torch.no_grad()
    def _evaluate(self, level: int, batches: "int | None" = None) -> float:
        """The held-out loss of the current model over the validation split's first ``batches``
        global batches (default ``training.eval_batches``; collective)."""
        from megatron.core import parallel_state

        t0 = time.perf_counter()
        self.engine.eval()
        total = torch.zeros(2, dtype=torch.float64, device=device())
        for b in range(batches or self.cfg.training.eval_batches):
            micro = [self.ctx.batch(self.ctx.data.valid, level, b, m) for m in range(self.levels.accumulation)]
            if self.levels.pipelined(level):
                total += self.levels.pipeline_step(level, self.ctx.seq).evaluate(self.engine.module, micro)[:2]
                continue
            for batch in micro:
                count = batch.loss_mask.sum()
                total += torch.stack([self.ctx.loss(level, batch, self.engine).double() * count, count.double()])
        self.engine.train()
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
        self.ctx.state.counters["eval_seconds"] += time.perf_counter() - t0
        return (total[0] / total[1].clamp(min=1)).item()

    def _record_valid(self, phase: Phase, loss: float) -> None:
        c = self.ctx.state.counters
        self.ctx.metrics.record(
            "valid", level=phase.level, phase=phase.index, step=self.ctx.state.step,
            global_step=self.ctx.state.global_step,
            loss=loss, tokens=c["tokens"], flops=c["flops"], seconds=c["train_seconds"] + c["transition_seconds"],
        )
        self.ctx.metrics.say(f"[level {phase.level} | phase {phase.index + 1}/{len(self.phases)} | "
                         f"step {self.ctx.state.step}/{phase.steps}] validation loss {loss:.4f}")

    def _check_finite_weights(self) -> None:
        """A step whose loss was finite can still leave non-finite weights (its update overflowed);
        such a model is never saved as a good checkpoint: every rank checks its own parameters (its
        ZeRO-3 partition) and the run stops as on a non-finite loss, the last good checkpoint kept."""
        params = [getattr(p, "ds_tensor", p) for p in self.engine.module.parameters()]
        finite = torch.stack([torch.isfinite(p).all() for p in params]).all().to(torch.int32).reshape(1)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        if not finite.item():
            raise TrainingError(
                f"weights are not finite after global step {self.ctx.state.global_step} (the loss was finite before "
                f"that step's update); stopped, the last good checkpoint in "
                f"{checkpoint.checkpoint_dir(self.ctx.run_dir)} is kept")

    def _config_phases(self) -> list[dict]:
        """The schedule a resume must follow: level and steps of every phase (and the ODE coarse parity)."""
        return schedule_signature(self.phases)

    def _save(self) -> None:
        t0 = time.perf_counter()
        self._check_finite_weights()
        meta = {**self._meta(), "config_phases": self._config_phases(),
                **self.cycle.meta(self.phases[self.ctx.state.phase])}
        self.saved_tag = checkpoint.save(self.engine, self.ctx.run_dir, self.ctx.state, meta=meta,
                                         extra=self.cycle.save_extra)
        checkpoint.rotate(self.ctx.run_dir, self.ctx.state, self.cfg.training.keep_checkpoints)
        self.ctx.state.counters["checkpoint_seconds"] += time.perf_counter() - t0

    def _train_phase(self, phase: Phase, hook=None) -> None:
        state, c, t = self.ctx.state, self.ctx.state.counters, self.cfg.training
        level_cfg = self.levels.models[phase.level]
        step_flops = flops_per_token(level_cfg, self.ctx.seq) * self.ctx.tokens_per_step
        window, window_start, timed = state.log_window, time.perf_counter(), 0
        mask = {}  # the phase hook's value (MSG's mask) the last step trained with, in its train record
        while state.step < phase.steps:
            if hook is not None:
                mask = {"mask": hook.at(state.step)}
            lr = self.engine.get_lr()[0]  # the rate this step applies, as the optimizer holds it
            t0 = time.perf_counter()
            loss = self._train_step(phase.level, state.global_step)
            c["train_seconds"] += time.perf_counter() - t0
            state.step += 1
            state.global_step += 1
            c["tokens"] += self.ctx.tokens_per_step
            c["flops"] += step_flops
            checkpoint.crash_point(f"step{state.global_step}")
            if self.check.due(phase, self._phase_row(phase), state.step):
                if hook is not None:  # the model the next step trains
                    hook.at(state.step)
                self.check.settled(phase, self._phase_row(phase), state.step, state.global_step)
            window.append(loss)
            timed += 1
            if state.step % t.log_interval == 0 or state.step == phase.steps:
                self._phase_row(phase)["train_loss"] = sum(window) / len(window)
                elapsed = time.perf_counter() - window_start
                tps = timed * self.ctx.tokens_per_step / max(elapsed, 1e-9)
                self.ctx.metrics.record(
                    "train", level=phase.level, phase=phase.index, step=state.step, global_step=state.global_step,
                    loss=sum(window) / len(window), lr=lr, tokens=c["tokens"], flops=c["flops"],
                    seconds=c["train_seconds"] + c["transition_seconds"], tokens_per_s=tps, **mask,
                )
                self.ctx.metrics.progress(
                    level=phase.level, phase=phase.index, num_phases=len(self.phases), step=state.step,
                    steps=phase.steps, global_step=state.global_step, total_steps=self.ctx.total_steps,
                    loss=sum(window) / len(window), lr=lr, tokens_per_s=tps, elapsed=time.perf_counter() - self.started,
                    eta=self._eta(), compute=c["flops"] / self._fine_only_flops(c["tokens"]),
                )
                window.clear()
                window_start, timed = time.perf_counter(), 0
            if state.step % t.eval_interval == 0 and state.step < phase.steps:
                if hook is not None:  # the model the next step trains
                    hook.at(state.step)
                self._record_valid(phase, self._evaluate(phase.level))
            if t.save_interval and state.global_step % t.save_interval == 0 and state.step < phase.steps:
                self._save()
            if state.step < phase.steps:  # at the phase's end, after its own checkpoint (run)
                self._stop_if_asked()

    def _stop_if_asked(self) -> None:
        """Save where the run stands (unless its checkpoint is the last one) and raise ``Stopped``,
        if any rank received a signal (collective)."""
        if self.stop is None or not self.stop.agreed():
            return
        state = self.ctx.state
        tag = checkpoint.tag_of(state.phase, state.step)
        if self.saved_tag != tag:
            self._save()
        self.stop.saved = True
        raise Stopped(self.stop.name, state.global_step, tag, checkpoint.checkpoint_dir(self.ctx.run_dir))

    def _fine_only_flops(self, tokens: int) -> float:
        """FLOPs the fine model alone would spend on ``tokens``."""
        return flops_per_token(self.levels.models[0], self.ctx.seq) * tokens

    def _eta(self) -> float:
        """Seconds left, from the FLOPs left and the FLOP rate so far."""
        c = self.ctx.state.counters
        done = c["flops"]
        left = 0.0
        for p in self.phases[self.ctx.state.phase:]:
            steps = p.steps - (self.ctx.state.step if p.index == self.ctx.state.phase else 0)
            left += steps * flops_per_token(self.levels.models[p.level], self.ctx.seq) * self.ctx.tokens_per_step
        return left * c["train_seconds"] / done if done else 0.0

    def _phase_row(self, phase: Phase) -> dict:
        while len(self.ctx.state.phases) <= phase.index:
            p = self.phases[len(self.ctx.state.phases)]
            m = self.levels.models[p.level]
            self.ctx.state.phases.append({
                "phase": p.index, "name": p.name, "level": p.level, "steps": p.steps,
                "model": {"num_layers": m.num_layers, "hidden_size": m.hidden_size,
                          "num_attention_heads": m.num_attention_heads, "ffn_hidden_size": m.ffn_hidden_size},
                "tokens": p.steps * self.ctx.tokens_per_step,
                "flops": p.steps * flops_per_token(m, self.ctx.seq) * self.ctx.tokens_per_step,
                "train_seconds_start": self.ctx.state.counters["train_seconds"],
                "transition_seconds": 0.0, "train_loss": None, "valid_loss": None,
                **self.cycle.phase_fields(p),
            })
        return self.ctx.state.phases[phase.index]

    # ---------------------------------------------------------------- transitions
    def _transition(self, phase: Phase, nxt: Phase, end_tag: str) -> None:
        """Move to ``nxt``'s level through the run's cycle, and count the transition's seconds (and
        the extra FLOPs it spent) against ``nxt``."""
        checked = self.check.before(phase, nxt)  # the model of ``phase`` still in place
        t0 = time.perf_counter()
        done = self.cycle.transition(self._release_engine, phase, nxt, end_tag)
        self.engine = done.engine
        seconds = time.perf_counter() - t0
        self.ctx.state.counters["transition_seconds"] += seconds
        row = self._phase_row(nxt)
        row["transition_seconds"] += seconds
        row.update(done.row, **checked)
        if done.extra_flops:
            self.ctx.state.counters["flops"] += done.extra_flops
            row["flops"] += done.extra_flops
            row["extra_flops"] = row.get("extra_flops", 0.0) + done.extra_flops
        m = self.levels.models[nxt.level]
        self.ctx.metrics.say(
            f"level {phase.level} -> {nxt.level}: {done.what} in {seconds:.2f} s; now {m.num_layers} layers, "
            f"hidden {m.hidden_size}, {m.num_attention_heads} heads"
        )

    def _release_engine(self):
        """The current engine, which the trainer no longer holds (a transition frees it before it
        builds the next level's)."""
        engine, self.engine = self.engine, None
        return engine

    # ---------------------------------------------------------------- the run
    def run(self) -> dict:
        self.started = time.perf_counter()
        self.ctx.state = self._start()
        train_samples = self.ctx.total_steps * self.levels.global_batch
        valid_samples = self.cfg.training.eval_batches * self.levels.global_batch
        self.ctx.data = build_data(self.cfg, train_samples=train_samples, valid_samples=valid_samples)
        if dist.get_rank() == 0:  # the run directory exports with its tokenizer, from anywhere
            keep_tokenizer(self.ctx.data.tokenizer_path, self.ctx.run_dir)
        self.ctx.metrics.say(
            f"{len(self.phases)} phase(s), {self.ctx.total_steps} steps of {self.levels.global_batch} x {self.ctx.seq} "
            f"tokens on {dist.get_world_size()} rank(s); levels: "
            + ", ".join(f"{m.num_layers}x{m.hidden_size}{_layout_note(tp, sp, pp.size, self.levels.accumulation)}"
                        for m, tp, sp, pp in zip(self.levels.models, self.cfg.level_tp_sizes(),
                                                 self.cfg.level_sequence_parallel(), self.cfg.level_pipelines()))
        )
        state = self.ctx.state
        while state.phase < len(self.phases):
            phase = self.phases[state.phase]
            row = self._phase_row(phase)
            if row["valid_loss"] is None:  # not finished (a resumed run may stand at its end)
                hook = self.cycle.phase_hook(phase, self.engine.module)
                if hook is not None:
                    hook.at(state.step)
                if state.step == 0:
                    self.check.arrived(phase, row, state.global_step)
                if state.step == 0 and phase.arrival in ("decoalesce", "grow", "prolong"):
                    self._record_valid(phase, self._evaluate(phase.level))
                self._train_phase(phase, hook)
                if hook is not None:
                    hook.finish(state.step)
                row["valid_loss"] = self._evaluate(phase.level)
                row["train_seconds"] = state.counters["train_seconds"] - row["train_seconds_start"]
                self._record_valid(phase, row["valid_loss"])
                self._save()
            self._stop_if_asked()
            end_tag = checkpoint.tag_of(state.phase, state.step)
            if state.phase + 1 < len(self.phases):
                self._transition(phase, self.phases[state.phase + 1], end_tag)
            state.phase += 1
            state.step = 0
        return self._summary()

    def _summary(self) -> dict:
        c = self.ctx.state.counters
        phases = [{k: v for k, v in row.items() if k != "train_seconds_start"} for row in self.ctx.state.phases]
        summary = {
            "phases": phases,
            "totals": {**c, "wall_seconds": c["train_seconds"] + c["transition_seconds"], "steps": self.ctx.total_steps,
                       "final_valid_loss": self.ctx.state.phases[-1]["valid_loss"]},
            "multilevel": self.cfg.multilevel.enabled,
            "strategy": self.cfg.multilevel.strategy,
        }
        if self.rank == 0:
            with open(os.path.join(self.ctx.run_dir, "summary.json"), "w") as f:
                json.dump(summary, f, indent=1)
            self.ctx.metrics.say(
                f"done: final validation loss {summary['totals']['final_valid_loss']:.4f}, "
                f"{c['flops'] / 1e12:.3f} TFLOPs ({c['flops'] / self._fine_only_flops(c['tokens']):.0%} of the fine "
                f"model alone on the same tokens), {summary['totals']['wall_seconds']:.1f} s training + transitions"
            )
        self.ctx.metrics.close()
        return summary


def run_samples(cfg: RunConfig, world_size: int) -> int:
    """The training samples the run ``cfg`` reads on ``world_size`` ranks: its steps times its global batch."""
    return sum(p.steps for p in build_phases(cfg)) * LevelEngines(cfg, world_size).global_batch


def _layout_note(tp: int, sequence_parallel: bool, pp: int = 1, micro_batches: int = 1) -> str:
    """`` (TP 2, sequence-parallel, PP 2: bubble 33%)`` for the run's opening line; nothing at TP 1
    and PP 1. The bubble is the share of a 1F1B step a stage idles, (p - 1) / (m + p - 1)."""
    parts = [f"TP {tp}"] * (tp > 1) + ["sequence-parallel"] * (tp > 1 and sequence_parallel)
    if pp > 1:
        parts.append(f"PP {pp}: bubble {(pp - 1) / (micro_batches + pp - 1):.0%}")
    return f" ({', '.join(parts)})" if parts else ""
