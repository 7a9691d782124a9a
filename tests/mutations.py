"""Break the code on purpose and check that the tests notice (not part of the pytest run).

    python tests/mutations.py                  # every mutation
    python tests/mutations.py flops reader     # those whose name contains a word given
    python tests/mutations.py --no-baseline    # skip running the tests on the unbroken copy first

Each mutation is an exact text substitution in a temporary copy of the repository (sources only:
no ``.git``, virtual environments, caches or runs); the tests that should catch it then run there
with this interpreter. First the same tests run on the unbroken copy: they must pass, else a
"caught" would mean nothing. A mutation whose text is no longer in the code is an error, not a
pass. Prints whether each mutation was caught; exits 1 if any was not, 2 on an error.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIP = shutil.ignore_patterns(".git", ".venv*", ".cache", "runs", "benchmarks", "__pycache__", ".pytest_cache",
                              "*.egg-info")
TRAINER = "megatron_multilevel/training/trainer.py"
COALESCE = "megatron_multilevel/training/coalesce_cycle.py"
FLOPS = "megatron_multilevel/flops.py"
READER = "megatron_multilevel/checkpoints/deepspeed_reader.py"
CHECKPOINT = "megatron_multilevel/training/checkpoint.py"
LOCAL_WRITES = "megatron_multilevel/training/local_writes.py"
ONE_RANK_FAILS = "tests/test_checkpoint_one_rank_fails.py::"
OPERATORS = "megatron_multilevel/operators.py"
TRANSITION = "megatron_multilevel/parallel/transition.py"
TRANSITIONS = ["tests/test_trainer_transitions.py"]
FLOPS_TESTS = ["tests/test_flops.py"]
CONSOLIDATION = ["tests/test_pretrain.py::test_two_processes_with_changing_layouts"]


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    substitutions: tuple  # (path, old text, new text), each old text found exactly once
    tests: tuple


MUTATIONS = [
    Mutation("trainer-alpha", "(a) the coalescing cycle interpolates with alpha 1.0 whatever the config says",
             ((COALESCE, "alpha = 1.0 if before is None else ml.alpha_of(nxt.level)", "alpha = 1.0"),),
             tuple(TRANSITIONS)),
    Mutation("trainer-global-alpha", "the coalescing cycle uses the global alpha, not each level's",
             ((COALESCE, "alpha = 1.0 if before is None else ml.alpha_of(nxt.level)",
               "alpha = 1.0 if before is None else ml.alpha"),),
             tuple(TRANSITIONS)),
    Mutation("trainer-map", "(b) the coalescing cycle ignores optimizer_state 'map'",
             ((COALESCE, "mapped = self._mapped_state()\n        old = release()",
               "mapped = ()\n        old = release()"),),
             tuple(TRANSITIONS)),
    Mutation("trainer-perturbation", "(b) perturbation_std is never applied",
             ((COALESCE, "perturbation_std=ml.perturbation_std,", "perturbation_std=0.0,"),),
             tuple(TRANSITIONS)),
    Mutation("flops-output-and-attention", "(c) FLOPs drop the output layer and halve attention",
             ((FLOPS, "total = cfg.num_layers * (qkv + attn * h + mlp) + cfg.vocab_size * h",
               "total = cfg.num_layers * (qkv + attn * h + mlp)"),
              (FLOPS, "attention = 12 * cfg.num_layers", "attention = 6 * cfg.num_layers")),
             tuple(FLOPS_TESTS)),
    Mutation("flops-output", "FLOPs drop the output layer only",
             ((FLOPS, "total = cfg.num_layers * (qkv + attn * h + mlp) + cfg.vocab_size * h",
               "total = cfg.num_layers * (qkv + attn * h + mlp)"),),
             tuple(FLOPS_TESTS)),
    Mutation("flops-attention", "FLOPs halve attention only",
             ((FLOPS, "attention = 12 * cfg.num_layers", "attention = 6 * cfg.num_layers"),),
             tuple(FLOPS_TESTS)),
    Mutation("schedule-warmup", "warm-up one step late",
             (("megatron_multilevel/training/schedule.py", "return (step + 1) / lr.warmup_steps",
               "return step / lr.warmup_steps"),),
             ("tests/test_schedule.py",)),
    Mutation("interpolation-direction", "interpolation weighs the two models the other way round",
             (("megatron_multilevel/operators.py", "torch.lerp(a.to(dtype), b.to(dtype), alpha)",
               "torch.lerp(b.to(dtype), a.to(dtype), alpha)"),),
             ("tests/test_tp_layout.py::test_single_process_transition_matches_operators",)),
    Mutation("writer-rank-diverges", "the model writer shifts the parameters rank 1 holds by 1e-7",
             (("megatron_multilevel/parallel/streams.py",
               "                else:\n                    p.data.copy_(v)\n",
               "                else:\n                    p.data.copy_(v)\n"
               "                if dist.get_rank() == 1 and not is_zero3(p):\n"
               "                    p.data.add_(1e-7)\n"),),
             ("tests/test_transitions.py::test_two_ranks",)),
    Mutation("save-marks-early", "a checkpoint is named the latest before all its files are written",
             ((CHECKPOINT, '    crash_point(f"save:{tag}")',
               '    if rank == 0:\n        _atomic_write(os.path.join(ckpt, POINTER), tag)\n'
               '    crash_point(f"save:{tag}")'),),
             ("tests/test_pretrain.py::test_resume_after_kill_follows_the_same_trajectory[mid-save]",)),
    Mutation("resume-reruns-finished-phase", "a run resumed at the end of a phase evaluates and saves it again",
             ((TRAINER, 'if row["valid_loss"] is None:  # not finished', 'if True:  # not finished'),),
             ("tests/test_pretrain.py::test_resume_after_kill_follows_the_same_trajectory[during-coalesce]",)),
    Mutation("writer-rank1-shifts", "the model writer shifts the parameters rank 1 holds by 1e-3",
             (("megatron_multilevel/parallel/streams.py",
               "                else:\n                    p.data.copy_(v)\n",
               "                else:\n                    p.data.copy_(v)\n"
               "                if dist.get_rank() == 1 and not is_zero3(p):\n"
               "                    p.data.add_(1e-3)\n"),),
             ("tests/test_pretrain.py::test_bert_two_processes_tensor_parallel",)),
    Mutation("reader-swap-bert-fc2", "the DeepSpeed checkpoint reader swaps BERT's linear_fc2 of layers 0 and 1",
             ((READER, "        shards.append(whole)\n    return shards",
               "        for key in ('weight', 'bias'):\n"
               "            a, b = (f'encoder.layers.{i}.mlp.linear_fc2.{key}' for i in (0, 1))\n"
               "            if a in whole and b in whole:\n"
               "                whole[a], whole[b] = whole[b], whole[a]\n"
               "        shards.append(whole)\n    return shards"),),
             ("tests/test_pretrain.py::test_bert_to_hf_computes_the_megatron_models_logits",)),
    Mutation("reader-swap-fc2", "(d) the DeepSpeed checkpoint reader swaps linear_fc2 of layers 0 and 1",
             ((READER, "        shards.append(whole)\n    return shards",
               "        for key in ('weight', 'bias'):\n"
               "            a, b = (f'decoder.layers.{i}.mlp.linear_fc2.{key}' for i in (0, 1))\n"
               "            if a in whole and b in whole:\n"
               "                whole[a], whole[b] = whole[b], whole[a]\n"
               "        shards.append(whole)\n    return shards"),),
             tuple(CONSOLIDATION)),
    Mutation("coherence-sign", "the ODE strategy installs its coherence term with the wrong sign",
             (("megatron_multilevel/parallel/coherence.py",
               "v = {name: restricted_fine[name] - g for name, g in coarse.items()}",
               "v = {name: g - restricted_fine[name] for name, g in coarse.items()}"),),
             ("tests/test_ode_pretrain.py::test_the_trainers_coherence_term_is_mg_opts",)),
    Mutation("coherence-restriction", "the ODE strategy restricts gradients as parameters (not the adjoint)",
             (("megatron_multilevel/ode_operators.py",
               "scaled = scale_residuals(layers[j], selection, 1.0 / selection.weight_scale)",
               "scaled = scale_residuals(layers[j], selection, float(selection.weight_scale))"),),
             ("tests/test_ode_adjoint.py",)),
    Mutation("transition-check-blind", "a function-preserving transition's jump is never judged",
             (("megatron_multilevel/training/transition_check.py",
               'if check["preserves_function"] and abs(jump) > tolerance:', "if False:"),),
             ("tests/test_transition_check.py::test_a_planted_bug_in_a_function_preserving_growth_stops_the_run",)),
    Mutation("megatron-moments-dropped", "a torch_dist checkpoint's optimizer state is not read",
             (("megatron_multilevel/checkpoints/megatron_dist.py",
               'keys = [k for k in ("exp_avg", "exp_avg_sq", "momentum_buffer")',
               'keys = [k for k in ()'),),
             ("tests/test_megatron_dist.py::test_megatron_tp2_to_a_run_at_tp1_to_megatron_tp4",)),
    Mutation("dist-metadata-unrestricted", "a torch_dist .metadata may ask for any class or function",
             (("megatron_multilevel/checkpoints/safe_dist.py",
               "        if name in METADATA_CLASSES.get(module, ()) or (", "        if True or ("),),
             ("tests/test_safe_readers.py::test_a_payload_in_the_metadata_is_refused_before_anything_runs",)),
    Mutation("dist-metadata-to-megatron", "the torch_dist reader lets Megatron-Core unpickle .metadata first (as reported)",
             (("megatron_multilevel/checkpoints/megatron_dist.py",
               "stored = safe_dist.tensor_shapes(safe_dist.read_metadata(directory))",
               'stored = {k: tuple(v.global_shape) for k, v in __import__("megatron.core.dist_checkpointing", '
               'fromlist=["load"]).load_tensors_metadata(directory).items()}'),),
             ("tests/test_safe_readers.py::test_a_payload_in_the_metadata_is_refused_before_anything_runs",)),
    Mutation("dist-common-unrestricted", "a torch_dist common.pt is unpickled without weights_only",
             (("megatron_multilevel/checkpoints/safe_dist.py",
               "common = load_restricted(path, COMMON_CLASSES, COMMON_HOLDER)",
               "common = torch.load(path, weights_only=False)"),),
             ("tests/test_safe_readers.py::test_a_payload_in_the_common_state_is_refused",)),
    Mutation("dist-shard-refusal-unnamed", "a refused .distcp shard ends in torch's many-line exception",
             (("megatron_multilevel/checkpoints/safe_dist.py",
               "                self._refuse(refusal(path, e, (), SHARDS_HOLDER))", "                raise"),),
             ("tests/test_safe_readers.py::test_a_payload_in_a_shard_is_refused_in_one_line",)),
    Mutation("hf-pickle-unchecked", "a Hugging Face pytorch_model.bin goes to transformers unchecked",
             (("megatron_multilevel/checkpoints/convert.py",
               "        load_restricted(path, (), \"a Hugging Face model's weights\", mmap=True)", "        pass"),),
             ("tests/test_safe_readers.py::test_a_payload_in_a_hugging_face_pickle_is_refused",)),
    Mutation("hf-safetensors-not-preferred", "a Hugging Face pickle is read even where safetensors lie beside it",
             (("megatron_multilevel/checkpoints/convert.py", "for name in HF_SAFETENSORS):\n        return []",
               "for name in HF_SAFETENSORS) and False:\n        return []"),),
             ("tests/test_safe_readers.py::test_hugging_face_safetensors_are_read_rather_than_a_pickle_beside_them",)),
    Mutation("full-pickle-unrestricted", "a consolidated checkpoint's model.pt is unpickled without weights_only",
             (("megatron_multilevel/checkpoints/full.py",
               'tensors = load_restricted(file, (), "a consolidated checkpoint of this project")',
               "tensors = torch.load(file, weights_only=False)"),),
             ("tests/test_safe_readers.py::test_legacy_pickles_are_refused_like_zip_files",)),
    Mutation("legacy-unnamed", "a refused legacy-format pickle is not named by what it asks for",
             (("megatron_multilevel/training/safe_load.py",
               'names = set(re.findall(r"GLOBAL ([\\w.]+)", str(error))) - allowed_names', "names = set()"),),
             ("tests/test_safe_readers.py::test_legacy_pickles_are_refused_like_zip_files",)),
    Mutation("latest-escapes", "a checkpoint tag that leaves the checkpoints directory is followed",
             (("megatron_multilevel/training/checkpoint.py",
               'if not isinstance(tag, str) or tag in ("", ".", "..") or os.path.basename(tag) != tag:',
               "if not isinstance(tag, str):"),),
             ("tests/test_safe_readers.py::test_a_latest_pointer_that_leaves_the_checkpoints_is_refused",
              "tests/test_safe_readers.py::test_a_sidecar_whose_open_level_leaves_the_checkpoints_is_refused")),
    Mutation("json-unbounded", "a JSON config or sidecar of any size is read",
             (("megatron_multilevel/config/parsing.py", "        if size > MAX_JSON_BYTES:", "        if False:"),),
             ("tests/test_safe_readers.py::test_json_configs_and_sidecars_that_are_not_small_objects_are_refused",)),
    Mutation("json-any-top-level", "a JSON config or sidecar whose top level is not an object is taken",
             (("megatron_multilevel/config/parsing.py",
               '    if not isinstance(data, dict):\n        raise ValueError(f"{path}: expected a JSON object',
               '    if False:\n        raise ValueError(f"{path}: expected a JSON object'),),
             ("tests/test_safe_readers.py::test_json_configs_and_sidecars_that_are_not_small_objects_are_refused",)),
    Mutation("npy-cache-unchecked", "a pickle in Megatron-Core's cache of sample indices passes",
             (("megatron_multilevel/data/datasets.py", "        if problem:\n            raise ValueError(f\"refused to read",
               "        if False:\n            raise ValueError(f\"refused to read"),),
             ("tests/test_safe_readers.py::test_a_pickle_in_megatrons_cache_of_sample_indices_is_refused",)),
    Mutation("monitor-silent", "the run's scalars never reach DeepSpeed's monitors",
             (("megatron_multilevel/training/metrics.py", "self.monitor.write_events(", "list("),),
             ("tests/test_monitors.py::test_wandb_offline_and_csv_hold_the_tensorboard_scalars",)),
    Mutation("ode-coherence-ungated", "the ODE strategy installs the coherence term whatever its coherence ratio",
             (("megatron_multilevel/parallel/coherence.py",
               'return max_ratio is None or stats["rho"] <= max_ratio', "return True"),),
             ("tests/test_ode_transitions.py::test_the_gate_tells_an_incoherent_coarse_model_from_a_coherent_one",
              "tests/test_ode_pretrain.py::test_a_closed_gate_is_the_run_without_the_term")),
    Mutation("ode-resume-no-coherence", "an ODE run resumed mid coarse phase comes back without its coherence term",
             (("megatron_multilevel/training/ode_cycle.py",
               'if phase.level == 1 and self.ode.coherence == "first_order" and ctx.state.ode.get("coherence", True):',
               "if False:"),),
             ("tests/test_ode_pretrain.py::test_resume_after_kill_follows_the_same_trajectory",)),
    Mutation("resume-unverified", "a resume loads the newest checkpoint without checking its files",
             ((CHECKPOINT, "            if files is not None:\n                found = manifest.problem(",
               "            if files is None:\n                found = manifest.problem("),),
             ("tests/test_checkpoint_integrity.py::test_a_truncated_newest_checkpoint_falls_back_to_the_one_before",)),
    Mutation("growth-unmasked", "the layers growth adds are not masked (MSG off)",
             ((COALESCE, 'if phase.arrival != "grow":', 'if True:'),),
             ("tests/test_pretrain.py::test_msg_growth_keeps_the_small_models_loss_and_resumes_in_the_ramp",)),
    Mutation("reshard-fresh-optimizer", "reshard writes the run with a fresh optimizer (its old docstring's behaviour)",
             (("megatron_multilevel/checkpoints/reshard.py", "    for item, read in zip(items, optimizer):\n        item.update(read)",
               "    for item, read in zip(items, optimizer):\n        pass"),),
             ("tests/test_reshard.py::test_one_to_two_data_parallel_ranks_under_zero_1_and_3_keeps_the_optimizer",)),
    Mutation("reshard-step-reset", "resharded moments restart Adam's step count (bias correction from step 1)",
             (("megatron_multilevel/checkpoints/reshard.py", 'moments.items()},\n                                  item["step"])',
               'moments.items()},\n                                  0)'),
              ("megatron_multilevel/checkpoints/reshard.py", "if difference != 0.0 or step != item[\"step\"]:",
               "if difference != 0.0:"),),
             ("tests/test_reshard.py::test_one_to_two_data_parallel_ranks_under_zero_1_and_3_keeps_the_optimizer",)),
    Mutation("ligo-copy-start", "LiGO's operator starts with the identity-scaled second copies' residual branches kept",
             (("megatron_multilevel/growth/ligo.py", "c[second, j] = 0.0 if identity and rules[name].residual else 1.0",
               "c[second, j] = 1.0"),),
             ("tests/test_ligo.py::test_the_operator_starts_at_the_copy_growth",)),
    Mutation("ligo-tp-unsummed", "LiGO's coefficient gradients are not summed over tensor-parallel shards",
             (("megatron_multilevel/growth/ligo.py", "if tp > 1 and name in summed:", "if False:"),),
             ("tests/test_ligo.py::test_ligo_in_two_layouts_is_the_one_process_run",)),
    Mutation("aki-same-layer", "AKI draws a layer's new units from that layer, not the one above (FPI)",
             ((OPERATORS, "    return min(coarse_layer + 1, level_map.coarse.num_layers - 1)",
               "    return coarse_layer"),),
             ("tests/test_operators.py::test_aki_matches_its_definition_by_hand",
              "tests/test_operators.py::test_aki_new_units_rows_are_the_next_layers",
              "tests/test_function_preservation.py::test_aki_width_growth_is_not_function_preserving")),
    Mutation("aki-reading-weights-above", "AKI takes the columns that read a new unit from the layer above too",
             ((OPERATORS, '    for dim, d in enumerate(rule.dims):\n        if d.side == "out":\n            new = ',
               '    for dim, d in enumerate(rule.dims):\n        if d.side is not None:\n            new = '),),
             ("tests/test_operators.py::test_aki_matches_its_definition_by_hand",
              "tests/test_operators.py::test_aki_new_units_rows_are_the_next_layers")),
    Mutation("aki-stream-own-layer", "the transition grows each layer by AKI from itself, not the layer above",
             ((TRANSITION, "upper = None if up is None else coarse if up == k else coarse_reader.read_layer(up, [name])",
               "upper = None if up is None else coarse"),),
             ("tests/test_transitions.py::test_aki_growth_in_every_layout_is_the_one_process_growth",)),
    Mutation("aki-moments-fpi", "the transition grows the mapped moments by FPI under AKI",
             ((TRANSITION, "alpha, width_growth=width_growth, grown=grown_moments, degree=STATE_DEGREE[key],",
               "alpha, grown=grown_moments, degree=STATE_DEGREE[key],"),),
             ("tests/test_transitions.py::test_aki_growth_in_every_layout_is_the_one_process_growth",)),
    Mutation("aki-trainer-fpi", "the coalescing cycle grows by FPI whatever multilevel.width_growth says",
             ((COALESCE, 'width_growth=ml.width_growth if before is None else "fpi",', 'width_growth="fpi",'),),
             ("tests/test_trainer_transitions.py::test_growth_by_aki_and_the_return_by_fpi",)),
    Mutation("aki-trainer-returns", "the coalescing cycle asks for AKI on returns that interpolate too",
             ((COALESCE, 'width_growth=ml.width_growth if before is None else "fpi",', "width_growth=ml.width_growth,"),),
             ("tests/test_trainer_transitions.py::test_growth_by_aki_and_the_return_by_fpi",)),
    Mutation("aki-config-v-cycle", "multilevel.width_growth 'aki' is accepted by a cycle that grows no level",
             (("megatron_multilevel/config/multilevel.py", 'if self.enabled and not self.grown_levels():',
               "if False:"),),
             ("tests/test_peers.py::test_width_growth_checks",)),
    Mutation("moments-parameter-units", "the ODE strategy's mapped moments scale like parameters",
             (("megatron_multilevel/config/deepspeed.py",
               'STATE_DEGREE = {"exp_avg": -1, "exp_avg_sq": -2, "momentum_buffer": -1}',
               'STATE_DEGREE = {"exp_avg": 1, "exp_avg_sq": 2, "momentum_buffer": 1}'),),
             ("tests/test_ode.py::test_moments_restrict_in_gradient_units",)),
    Mutation("ode-explicit-no-step", "the explicit coarse model's forward pass takes no step (no hooks)",
             (("megatron_multilevel/residual_step.py", "        if step != 1:\n", "        if False:\n"),),
             ("tests/test_ode_explicit.py::test_the_explicit_coarse_model_computes_the_folded_ones_function",)),
    Mutation("ode-explicit-weights-scaled", "the explicit restriction scales the weights too",
             (("megatron_multilevel/level_maps.py",
               'return self.residual_scale if self.parametrisation == "folded" else 1', "return self.residual_scale"),),
             ("tests/test_ode_explicit.py::test_the_explicit_coarse_model_computes_the_folded_ones_function",)),
    Mutation("ode-explicit-adjoint-scaled", "the explicit gradient restriction divides by the residual scale",
             (("megatron_multilevel/ode_operators.py",
               "scaled = scale_residuals(layers[j], selection, 1.0 / selection.weight_scale)",
               "scaled = scale_residuals(layers[j], selection, 1.0 / selection.residual_scale)"),),
             ("tests/test_ode_adjoint.py::test_gradient_restriction_is_the_adjoint_of_prolongation",)),
    Mutation("ode-explicit-moments-scaled", "the explicit moment mapping scales by the residual scale",
             (("megatron_multilevel/ode_operators.py",
               "return scale_residuals(fine_layer, selection, float(selection.weight_scale) ** degree)",
               "return scale_residuals(fine_layer, selection, float(selection.residual_scale) ** degree)"),),
             ("tests/test_ode_explicit.py::"
              "test_the_explicit_restriction_copies_and_its_moments_carry_over_unscaled",)),
    Mutation("ode-explicit-trainer-folds", "the trainer restricts as folded while the coarse model takes the step",
             (("megatron_multilevel/training/ode_cycle.py",
               "LayerSelection(self.ctx.levels.models[0], phase.parity, self.ode.residual_scale,\n"
               "                              self.ode.parametrisation)",
               "LayerSelection(self.ctx.levels.models[0], phase.parity, self.ode.residual_scale)"),),
             ("tests/test_ode_pretrain.py::"
              "test_the_explicit_step_starts_from_the_same_function_and_trains_otherwise",)),
    Mutation("ode-explicit-unfolded", "to-hf and init-run take an explicit coarse model without its step",
             (("megatron_multilevel/checkpoints/convert.py",
               "return self.tensors if self.step == 1 else fold_step(self.tensors, self.selection)",
               "return self.tensors"),),
             ("tests/test_ode_pretrain.py::test_checkpoint_tools_on_an_explicit_coarse_phase",)),
    Mutation("ode-explicit-reshard-no-step", "reshard checks an explicit coarse model against logits without its step",
             (("megatron_multilevel/checkpoints/reshard.py",
               'full_logits = verify.logits_full(latest["tensors"], latest["model"], tokens, step=step)',
               'full_logits = verify.logits_full(latest["tensors"], latest["model"], tokens)'),),
             ("tests/test_ode_pretrain.py::test_checkpoint_tools_on_an_explicit_coarse_phase",)),
    Mutation("stop-no-agreement", "each rank stops on its own signal only: the ranks do not agree on the step",
             (("megatron_multilevel/training/stop.py", "        dist.all_reduce(received, op=dist.ReduceOp.MAX)\n",
               ""),),
             ("tests/test_stop_one_rank.py::test_sigterm_to_rank_1_alone_stops_both_ranks_at_its_step",
              "tests/test_stop.py::test_sigterm_to_one_rank_stops_both_at_the_same_step")),
    Mutation("stop-one-request-twice", "a signal delivered twice (group and launcher) counts as a second request",
             (("megatron_multilevel/training/stop.py", "if now - self.received_at < SAME_REQUEST_SECONDS:",
               "if False:"),),
             ("tests/test_stop.py::test_the_handler_second_signal_and_grace",)),
    Mutation("stop-not-forwarded", "the launcher does not forward a signal to the ranks",
             (("megatron_multilevel/launching/runner.py", "            process.send_signal(signum)\n",
               "            pass\n"),),
             ("tests/test_stop.py::test_sigterm_to_the_launcher_saves_stops_every_rank_and_resumes_on_the_uninterrupted_"
              "losses",)),
    Mutation("lock-never-held", "a run takes no lock on its directory",
             (("megatron_multilevel/training/run_lock.py",
               "            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)\n",
               "            pass\n"),),
             ("tests/test_run_lock.py", "tests/test_run_lock_race.py")),
    Mutation("save-runtime-error-escapes", "a write failing inside torch's writer escapes the save's handling",
             ((LOCAL_WRITES, "    except RuntimeError as e:\n        said =", "    except ZeroDivisionError as e:\n        said ="),),
             ("tests/test_checkpoint_integrity.py::test_a_file_size_limit_reached_mid_save_removes_the_partial_"
              "checkpoint",)),
    Mutation("save-leaves-deepspeed-early", "a write failing in DeepSpeed's save on one rank skips its remaining "
             "collectives (the ranks out of step)",
             ((CHECKPOINT, "    save_deepspeed_checkpoint(engine, ckpt, tag, writes)",
               "    writes.run(lambda: engine.save_checkpoint(ckpt, tag=tag, save_latest=False))"),),
             (ONE_RANK_FAILS + "test_a_write_failing_in_deepspeed_on_one_rank_raises_the_same_line_on_every_rank",
              ONE_RANK_FAILS + "test_a_save_failing_on_rank_1_in_deepspeed_ends_both_ranks_in_one_line_and_resumes")),
    Mutation("save-writes-uncontained", "DeepSpeed's checkpoint engine writes without containing a failure",
             ((LOCAL_WRITES, "    engine.checkpoint_engine = _ContainedEngine(inner, writes)\n", ""),),
             (ONE_RANK_FAILS + "test_a_write_failing_in_deepspeed_on_one_rank_raises_the_same_line_on_every_rank",)),
    Mutation("save-recovery-script-uncontained", "DeepSpeed's copy of its recovery scripts raises on the copying rank",
             ((LOCAL_WRITES, "lambda path: writes.run(lambda: copy_scripts(path))", "copy_scripts"),),
             (ONE_RANK_FAILS + "test_a_write_failing_in_deepspeed_on_one_rank_raises_the_same_line_on_every_rank",)),
    Mutation("lock-waits", "a run waits for the lock of a directory another run holds, then takes it",
             (("megatron_multilevel/training/run_lock.py", "fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)",
               "fcntl.flock(self.file, fcntl.LOCK_EX)"),),
             ("tests/test_run_lock_race.py",)),
    Mutation("drift-ignores-data", "a resume takes another data block (corpus, sequence length) as a neutral change",
             (("megatron_multilevel/training/config_drift.py", '"data.cache_dir",\n', '"data.",\n'),),
             ("tests/test_config_drift_data.py",)),
    Mutation("resume-ignores-config", "a resume takes any config the checkpoint was not written by",
             (("megatron_multilevel/training/trainer.py", "        if changes and not self.allow_config_change:",
               "        if False:"),),
             ("tests/test_config_drift.py",)),
    Mutation("pipeline-tied-grads-unsummed", "a pipelined step leaves each copy of the tied word embedding its own "
             "gradient", (("megatron_multilevel/training/pipeline.py", "        _sum_tied_embedding_grads(engine.module)\n",
                           ""),),
             ("tests/test_pipeline.py::test_two_stages_are_the_one_process_run",)),
    Mutation("pipeline-unclipped", "a pipelined level without ZeRO never clips its gradients",
             (("megatron_multilevel/training/pipeline.py", "        if self.clip > 0:", "        if False:"),),
             ("tests/test_pipeline.py::test_two_stages_are_the_one_process_run",)),
    Mutation("stages-local-names", "a stage's layers keep their own numbering in the streams",
             (("megatron_multilevel/parallel/stages.py", "int(m.group(2)) + offset", "int(m.group(2))"),),
             ("tests/test_pipeline.py::test_a_transition_across_stages_is_the_operators_on_full_tensors",)),
    Mutation("data-order-ignored", "data.order_samples is ignored: each run shuffles its samples for its own length",
             (("megatron_multilevel/data/datasets.py", "seed=cfg.training.seed, sizes=[order, 1, 1]",
               "seed=cfg.training.seed, sizes=[train_samples, 1, 1]"),),
             ("tests/test_sample_order.py::test_a_shorter_run_reads_a_prefix_of_the_longer_runs_order",)),
    Mutation("mup-growth-no-rescale", "a growth under depth-muP copies the kept branches without the multipliers' ratio",
             ((OPERATORS, "    return float(level_map.fine.branch_multiplier) / float(level_map.coarse.branch_multiplier)",
               "    return 1.0"),),
             ("tests/test_depth_mup.py::test_a_growth_that_preserves_the_function_does_under_depth_mup",
              "tests/test_depth_mup.py::test_msg_under_depth_mup_keeps_the_small_models_loss_and_ramps_its_mask")),
    Mutation("mup-growth-states-as-weights", "a growth under depth-muP rescales the optimizer states like weights",
             ((TRANSITION, "grown=grown_moments, degree=STATE_DEGREE[key],", "grown=grown_moments,"),),
             ("tests/test_transitions.py::test_growing_carries_the_coarse_moments",)),
    Mutation("msg-cycle-no-keep", "the coalescing cycle's MSG growth does not keep the branches (no depth-muP rescale)",
             ((COALESCE, "keep_branches=before is None and ml.growth_mask_steps > 0,", "keep_branches=False,"),),
             ("tests/test_depth_mup.py::test_msg_under_depth_mup_keeps_the_small_models_loss_and_ramps_its_mask",)),
    Mutation("msg-mask-late", "MSG's mask runs one step ahead of the phase's steps",
             (("megatron_multilevel/growth/mask.py", "self.value = min(1.0, step / self.steps)",
               "self.value = min(1.0, (step + 1) / self.steps)"),),
             ("tests/test_depth_mup.py::test_msg_under_depth_mup_keeps_the_small_models_loss_and_ramps_its_mask",)),
    Mutation("muon-momentum-dropped", "the transitions carry Muon's auxiliary Adam moments and not its momentum",
             (("megatron_multilevel/config/deepspeed.py",
               '"muon": ("momentum_buffer", "exp_avg", "exp_avg_sq")', '"muon": ("exp_avg", "exp_avg_sq")'),),
             ("tests/test_muon_run.py::test_growth_maps_the_kept_layers_state_and_zeroes_the_grown_layers",
              "tests/test_muon_run.py::test_resharding_through_zero2_on_two_ranks_keeps_muons_state_exactly")),
    Mutation("muon-zero12-momentum-unwritten", "ZeRO 1/2's whole-matrix Muon momentum is never written",
             (("megatron_multilevel/parallel/muon_state.py", "        mine.copy_(value.reshape(p.shape))",
               "        pass"),),
             ("tests/test_muon.py::test_muon_state_maps_exactly_at_every_zero_stage_on_two_ranks",)),
    Mutation("muon-deepspeeds-tags", "DeepSpeed's own use_muon tags are kept (Megatron's output layer to Muon)",
             (("megatron_multilevel/training/engines.py", "    deepspeed.set_optimizer_flags = tag\n",
               "    deepspeed.set_optimizer_flags = own\n"),),
             ("tests/test_muon.py::test_muon_state_maps_exactly_through_a_v_cycle_in_one_process",)),
    Mutation("megatron-mup-not-unfolded", "from-megatron under a depth-muP config keeps the folded weights",
             (("megatron_multilevel/checkpoints/megatron_dist.py", "    tensors = unfold_branch_multiplier(weights, cfg)\n",
               "    tensors = dict(weights)\n"),),
             ("tests/test_depth_mup.py::test_a_megatron_export_of_a_depth_mup_run_reads_back_under_its_own_config",)),
    Mutation("fresh-intermediate-depth", "a growth through levels that train no step initialises fresh layers for "
             "each intermediate depth", ((COALESCE, "fresh_depth=self._trained_depth(nxt),", "fresh_depth=None,"),),
             ("tests/test_late.py::test_fresh_layers_are_initialised_for_the_model_the_growth_ends_in",)),
]

def copy_repository(into: Path) -> Path:
    repo = into / "repo"
    shutil.copytree(ROOT, repo, ignore=SKIP, symlinks=True)
    return repo


def environment(repo: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(repo) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    return env


def check_imports_the_copy(repo: Path) -> None:
    out = subprocess.run([sys.executable, "-c", "import megatron_multilevel as m; print(m.__file__)"], cwd=repo,
                         env=environment(repo), capture_output=True, text=True, timeout=600)
    where = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-2000:]
    if not where.startswith(str(repo)):
        sys.exit(f"error: the copy's tests would import megatron_multilevel from {where}, not from {repo}")


def apply(repo: Path, mutation: Mutation, *, dry_run: bool = False) -> None:
    for path, old, new in mutation.substitutions:
        file = repo / path
        text = file.read_text()
        count = text.count(old)
        if count != 1:
            raise SystemExit(f"error: mutation {mutation.name}: the text to replace is found {count} times in "
                             f"{path} (expected once); update tests/mutations.py:\n{old}")
        if not dry_run:
            file.write_text(text.replace(old, new))


def run_tests(repo: Path, tests) -> tuple[int, list[str], float]:
    """pytest's exit status, the tests that failed, and the seconds it took."""
    t0 = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "", *tests],
                            cwd=repo, env=environment(repo), capture_output=True, text=True)
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", result.stdout, flags=re.M)
    if result.returncode not in (0, 1):
        print(result.stdout[-4000:] + result.stderr[-4000:])
    return result.returncode, failed, time.perf_counter() - t0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="run the mutations whose name contains one of these")
    parser.add_argument("--no-baseline", action="store_true", help="do not run the tests on the unbroken copy first")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.names or any(n in m.name for n in args.names)]
    if not chosen:
        sys.exit(f"error: no mutation matches {args.names}; known: {[m.name for m in MUTATIONS]}")
    with tempfile.TemporaryDirectory(prefix="mutations-") as tmp:
        pristine = copy_repository(Path(tmp))
        check_imports_the_copy(pristine)
        for m in chosen:  # every target text exists before anything runs
            apply(pristine, m, dry_run=True)
        if not args.no_baseline:
            tests = sorted({t for m in chosen for t in m.tests})
            rc, failed, seconds = run_tests(pristine, tests)
            print(f"baseline (unbroken code, {len(tests)} test selection(s)): "
                  f"{'pass' if rc == 0 else 'FAIL ' + ' '.join(failed)} ({seconds:.0f} s)", flush=True)
            if rc != 0:
                print("error: the tests fail on the unbroken code; no mutation result would mean anything")
                return 2
        survived, broken = [], []
        for m in chosen:
            repo = copy_repository(Path(tmp) / m.name)
            apply(repo, m)
            rc, failed, seconds = run_tests(repo, m.tests)
            if rc == 1:
                verdict = f"caught by {', '.join(failed) or 'a failing test'}"
            elif rc == 0:
                verdict = "NOT CAUGHT"
                survived.append(m.name)
            else:
                verdict = f"ERROR (pytest exit status {rc})"
                broken.append(m.name)
            print(f"{m.name}: {m.what}: {verdict} ({seconds:.0f} s)", flush=True)
            shutil.rmtree(repo.parent)
    if survived:
        print(f"not caught: {', '.join(survived)}")
    if broken:
        print(f"errors: {', '.join(broken)}")
    return 2 if broken else 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
