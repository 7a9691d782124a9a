import warnings

import pytest
import torch

from megatron_multilevel.config import ModelConfig

warnings.filterwarnings("ignore")

# Every model variant the project supports, small enough for CPU tests.
VARIANTS = {
    "gpt_tied": dict(kind="gpt"),
    "gpt_untied": dict(kind="gpt", share_embeddings_and_output_weights=False),
    "gpt_llama": dict(
        kind="gpt",
        position_embedding_type="rope",
        normalization="RMSNorm",
        activation="swiglu",
        add_bias_linear=False,
        num_query_groups=2,
        share_embeddings_and_output_weights=False,
    ),
    "gpt_gqa_tied_rope": dict(kind="gpt", position_embedding_type="rope", num_query_groups=2),
    "bert_tied": dict(kind="bert"),
    "bert_untied_binary": dict(
        kind="bert", share_embeddings_and_output_weights=False, num_tokentypes=2, add_binary_head=True
    ),
    "bert_rms_swiglu": dict(kind="bert", normalization="RMSNorm", activation="swiglu", num_tokentypes=2),
}


def small_config(variant: str, **overrides) -> ModelConfig:
    kwargs = dict(
        num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=96, max_sequence_length=16
    )
    kwargs.update(VARIANTS[variant])
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


@pytest.fixture(scope="session")
def dist_single(tmp_path_factory):
    """One-process gloo group and Megatron parallel state, shared by the in-process tests."""
    from megatron_multilevel.distributed import init_distributed

    path = tmp_path_factory.mktemp("rdv") / "file"
    init_distributed(1, init_method=f"file://{path}", rank=0, world_size=1)
    yield


def random_state_dict(cfg: ModelConfig, seed: int = 0) -> dict:
    """A fresh model's parameters with every entry perturbed, so that no tensor is symmetric."""
    from megatron_multilevel.distributed import set_seed
    from megatron_multilevel.models import build_model, parameter_state_dict

    set_seed(seed)
    model = build_model(cfg)
    gen = torch.Generator().manual_seed(seed + 1)
    return {k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in parameter_state_dict(model).items()}


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """The test corpus prepared as GPT and BERT datasets with one tokenizer (a module may make its own)."""
    from launch_helpers import prepare_corpus

    return prepare_corpus(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="session")
def reference(tmp_path_factory, corpus):
    """An uninterrupted one-process GPT V-cycle: what every other layout and resume must match."""
    from launch_helpers import KEEP_ALL, launch, ok, run_config

    tmp = tmp_path_factory.mktemp("reference")
    result = ok(launch(run_config(tmp, corpus, "run", training=KEEP_ALL)))
    return {"dir": tmp / "run", "stdout": result.stdout}
