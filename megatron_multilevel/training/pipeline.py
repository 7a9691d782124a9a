"""Train and evaluate a pipelined level: Megatron-Core's schedule for the passes, DeepSpeed's engine
for the rest.

Megatron-Core's schedule (1F1B, ``get_forward_backward_func``) runs every micro-batch of a global
step through the stages, sending activations and their gradients between them, and calls backward
itself: DeepSpeed's engine never sees the loss. After it, as DeepSpeed's own pipeline engine
does after its schedule, a step (1) sums the gradients of the word embedding tied to the output
layer over the first and last stages (Megatron's embedding group), (2) has the engine reduce the
gradients over the data-parallel ranks (ZeRO-1 into its partitions), (3) clips them by their global
norm over every stage, and (4) takes the engine's optimizer step. Every engine of a pipelined level
is at a gradient-accumulation boundary at every ``step()``: one schedule is one global step.
"""

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from megatron_multilevel.config import ModelConfig
from megatron_multilevel.data.datasets import Batch
from megatron_multilevel.models import masked_mean, model_logits, token_losses


def set_up_pipelined_engine(engine) -> None:
    """Make ``engine`` (of one pipeline stage) take the gradients a schedule leaves: every ``step()``
    is a boundary, and ZeRO-1 reduces gradients whose backward ran outside it (DeepSpeed's flag for
    its own pipeline engine, which runs backward outside ZeRO too). The tied output weight of the last
    stage (Megatron marks it ``shared``) is not counted twice in ZeRO-1's gradient norm."""
    engine.set_gradient_accumulation_boundary(True)
    engine.pipeline_parallelism = True
    for p in engine.module.parameters():
        if getattr(p, "shared", False):
            p.ds_pipe_replicated = True


@dataclass
class PipelineStep:
    """One pipelined level's passes: ``train`` (a global step) and ``evaluate`` (forward only)."""

    cfg: ModelConfig
    seq_length: int
    micro_batch: int
    clip: float = 0.0
    """The gradient-norm clip this step applies itself (a level without ZeRO); 0: none, or the optimizer's."""

    def train(self, engine, batches: Sequence[Batch]) -> torch.Tensor:
        """Forward and backward of ``batches`` (this rank's micro-batches of one global step) and the
        optimizer step; the mean of the micro-batches' losses, on every stage."""
        from megatron.core import parallel_state as ps

        store = self._schedule(engine.module, batches, forward_only=False)
        _sum_tied_embedding_grads(engine.module)
        engine.allreduce_gradients()
        if self.clip > 0:
            _clip_by_global_norm(engine.module.parameters(), self.clip)
        engine.step()
        loss = torch.stack([r["loss"] for r in store]).mean() if store else torch.zeros((), dtype=torch.float32)
        return _from_last_stage(loss.float().reshape(1).to(_device()), ps)[0]

    @torch.no_grad()
    def evaluate(self, module, batches: Sequence[Batch]) -> torch.Tensor:
        """``[sum of the losses, number of tokens, sum of the micro-batches' mean losses]`` of
        ``batches`` (forward only), on every stage."""
        from megatron.core import parallel_state as ps

        store = self._schedule(module, batches, forward_only=True)
        total = torch.zeros(3, dtype=torch.float64, device=_device())
        for r in store:
            total += torch.stack([r["sum"], r["count"], r["loss"]]).double()
        return _from_last_stage(total, ps)

    @torch.no_grad()
    def logits(self, module, tokens: torch.Tensor) -> torch.Tensor:
        """The logits ``[b, s, vocab / tp]`` of ``tokens`` (one micro-batch through the stages), on
        every stage."""
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        cfg = self.cfg

        def forward_step(data_iterator, model):
            out = model_logits(model, cfg, next(data_iterator))
            return out, lambda logits: (logits.float().sum() * 0, {"logits": logits.float()})

        store = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([tokens]), model=[module], num_microbatches=1,
            seq_length=tokens.shape[1], micro_batch_size=tokens.shape[0], forward_only=True)
        shape = (*tokens.shape, cfg.vocab_size // ps.get_tensor_model_parallel_world_size())
        value = store[0]["logits"].contiguous() if store else torch.empty(shape, device=_device())
        return _from_last_stage(value, ps)

    def _schedule(self, module, batches: Sequence[Batch], *, forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        cfg, data = self.cfg, iter(batches)

        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            out = token_losses(model, cfg, batch.tokens, batch.labels, padding_mask=batch.padding_mask,
                               tokentype_ids=batch.tokentype_ids)

            def loss_func(losses):
                loss = masked_mean(losses, batch.loss_mask)
                count = batch.loss_mask.float().sum()
                # the schedule divides the returned loss in place by the number of micro-batches
                return loss, {"loss": loss.detach().clone(), "sum": loss.detach() * count, "count": count}

            return out, loss_func

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data, model=[module], num_microbatches=len(batches),
            seq_length=self.seq_length, micro_batch_size=self.micro_batch, forward_only=forward_only)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _from_last_stage(value: torch.Tensor, ps) -> torch.Tensor:
    """``value`` as the last stage computed it, on every stage of this rank's pipeline."""
    dist.broadcast(value, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
    return value


def _sum_tied_embedding_grads(module) -> None:
    """The word embedding and the output layer are one weight held twice (first and last stage):
    each copy takes the sum of both gradients, as Megatron's ``finalize_model_grads`` does."""
    from megatron.core import parallel_state as ps

    if not getattr(module, "share_embeddings_and_output_weights", False) or not ps.is_rank_in_embedding_group():
        return
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return
    weight = module.shared_embedding_or_output_weight()  # None on a stage in between
    if weight is None:
        return
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    dist.all_reduce(weight.grad, group=ps.get_embedding_group())


def _clip_by_global_norm(parameters, max_norm: float) -> float:
    """Scale the gradients so that their norm over the whole model (every stage and tensor-parallel
    shard, the tied embedding and replicated parameters once) is at most ``max_norm``; the norm
    before. Megatron-Core's ``clip_grads`` does this on CUDA tensors only; this is its rule (and
    DeepSpeed's coefficient, ``max_norm / (norm + 1e-6)``) on any device."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    counted = [p.grad for p in parameters if p.grad is not None and param_is_not_shared(p)
               and param_is_not_tensor_parallel_duplicate(p)]
    squares = torch.zeros(1, dtype=torch.float32, device=_device())
    for g in counted:
        squares += g.detach().float().pow(2).sum()
    dist.all_reduce(squares, group=ps.get_model_parallel_group())
    norm = math.sqrt(squares.item())
    coefficient = max_norm / (norm + 1e-6)
    if coefficient < 1:
        for g in grads:
            g.detach().mul_(coefficient)
    return norm
