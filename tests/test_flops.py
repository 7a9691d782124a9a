"""Training FLOPs per token against figures worked out by hand.

The convention (``flops.py``): a matrix multiply of an ``m x n`` weight costs ``2 m n``
FLOPs per token forward and twice that backward, so ``6 m n`` in training; the attention scores
``Q K^T`` and their weighted sum ``A V`` cost ``2 * seq * (heads * head size)`` each per token
and layer forward, ``12 * seq * heads * head size`` in training (no causal discount). The output
layer counts whether or not it is tied to the embedding; lookups, norms and elementwise work do
not count.
"""

import pytest

from megatron_multilevel.config import ModelConfig
from megatron_multilevel.flops import flops_per_token, forward_flops_per_token


def test_gpt2_124m():
    cfg = ModelConfig(kind="gpt", num_layers=12, hidden_size=768, num_attention_heads=12, vocab_size=50257,
                      max_sequence_length=1024)
    seq = 1024
    qkv = 768 * (3 * 768)  # 1_769_472
    proj = 768 * 768  # 589_824
    fc1 = 768 * 3072  # 2_359_296
    fc2 = 3072 * 768  # 2_359_296
    per_layer = qkv + proj + fc1 + fc2
    assert per_layer == 7_077_888
    output_layer = 50257 * 768  # 38_597_376
    weights = 12 * per_layer + output_layer
    assert weights == 123_532_032
    scores = 2 * seq * 768  # Q K^T per token and layer, forward
    weighted_sum = 2 * seq * 768  # A V
    attention = 3 * 12 * (scores + weighted_sum)  # forward and backward, 12 layers
    assert attention == 113_246_208
    expected = 6 * weights + attention
    assert expected == 854_438_400
    assert flops_per_token(cfg, seq) == expected
    assert forward_flops_per_token(cfg, seq) == pytest.approx(expected / 3)


@pytest.mark.parametrize("binary_head", [False, True])
def test_bert_base(binary_head):
    cfg = ModelConfig(kind="bert", num_layers=12, hidden_size=768, num_attention_heads=12, vocab_size=30592,
                      max_sequence_length=512, num_tokentypes=2, add_binary_head=binary_head)
    seq = 512
    per_layer = 768 * 2304 + 768 * 768 + 768 * 3072 + 3072 * 768  # QKV, projection, FFN in and out
    lm_head = 768 * 768  # the dense layer before the output layer
    output_layer = 30592 * 768  # 23_494_656
    weights = 12 * per_layer + lm_head + output_layer
    assert weights == 109_019_136
    if binary_head:
        weights += 768 * 768 + 768 * 2  # pooler and the two-way classifier
        assert weights == 109_610_496
    attention = 3 * 12 * (2 * seq * 768 + 2 * seq * 768)
    assert attention == 56_623_104
    expected = 6 * weights + attention
    assert expected == (714_286_080 if binary_head else 710_737_920)
    assert flops_per_token(cfg, seq) == expected


def test_grouped_query_swiglu():
    """Queries of 4 heads, keys and values of 2 groups, head size 32 (not hidden / heads), SwiGLU."""
    cfg = ModelConfig(kind="gpt", num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                      kv_channels=32, ffn_hidden_size=256, activation="swiglu", vocab_size=1000,
                      max_sequence_length=64, share_embeddings_and_output_weights=False)
    seq = 64
    q, k, v = 128 * (4 * 32), 128 * (2 * 32), 128 * (2 * 32)
    proj = (4 * 32) * 128
    fc1 = 128 * (2 * 256)  # gate and up projections
    fc2 = 256 * 128
    per_layer = q + k + v + proj + fc1 + fc2
    assert per_layer == 147_456
    weights = 2 * per_layer + 1000 * 128
    attention = 3 * 2 * (2 * seq * 128 + 2 * seq * 128)  # 4 query heads of 32
    expected = 6 * weights + attention
    assert expected == 2_734_080
    assert flops_per_token(cfg, seq) == expected


@pytest.mark.parametrize("changes", [
    {},  # the default GPT: tied embeddings, LayerNorm, biases, learned positions
    {"num_layers": 8, "hidden_size": 64, "vocab_size": 512, "max_sequence_length": 64},
    {"share_embeddings_and_output_weights": False, "normalization": "RMSNorm", "activation": "swiglu",
     "position_embedding_type": "rope", "add_bias_linear": False, "num_query_groups": 2},
    {"kind": "bert", "num_tokentypes": 2, "add_binary_head": True},
    {"kind": "bert"},
])
def test_parameter_count_is_the_built_models(changes):
    """The formula counts what Megatron-Core builds, embeddings included."""
    from megatron_multilevel.distributed import init_single_process
    from megatron_multilevel.flops import parameter_count
    from megatron_multilevel.models import build_model

    init_single_process()
    cfg = ModelConfig(**changes)
    assert parameter_count(cfg) == sum(p.numel() for p in build_model(cfg).parameters())
