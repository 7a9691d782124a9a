"""Training FLOPs per token (the accounting of the paper's savings).

``6 * (matmul parameters, output layer included) + 12 * layers * seq * (heads * head size)``:
forward and backward of every matrix multiply, plus the attention scores and their weighted sum.
Embedding lookups, norms and elementwise work are left out, as is usual.
"""

from megatron_multilevel.config import ModelConfig


def matmul_parameters(cfg: ModelConfig) -> int:
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    attn = cfg.num_attention_heads * cfg.kv_channels
    qkv = h * (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.kv_channels
    mlp = h * f * (2 if cfg.gated else 1) + f * h
    total = cfg.num_layers * (qkv + attn * h + mlp) + cfg.vocab_size * h
    if cfg.kind == "bert":
        total += h * h  # LM-head dense
        if cfg.add_binary_head:
            total += h * h + 2 * h
    return total


def flops_per_token(cfg: ModelConfig, seq_length: int) -> float:
    attention = 12 * cfg.num_layers * seq_length * cfg.num_attention_heads * cfg.kv_channels
    return 6.0 * matmul_parameters(cfg) + attention


def forward_flops_per_token(cfg: ModelConfig, seq_length: int) -> float:
    """A forward pass alone: a third of the training FLOPs (the backward pass costs twice the forward)."""
    return flops_per_token(cfg, seq_length) / 3.0
