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


def parameter_count(cfg: ModelConfig) -> int:
    """Every parameter of the Megatron-Core model ``cfg`` builds, embeddings included (as Chinchilla
    counts them): what "tokens per parameter" divides by. By formula, so that a planner can size a
    model it never builds (tested against the built models' counts)."""
    h, f, b = cfg.hidden_size, cfg.ffn_hidden_size, int(cfg.add_bias_linear)
    norm = 2 * h if cfg.normalization == "LayerNorm" else h
    qkv = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.kv_channels
    attn = cfg.num_attention_heads * cfg.kv_channels
    up = f * (2 if cfg.gated else 1)
    layer = norm + (h + b) * qkv + attn * h + b * h + norm + (h + b) * up + f * h + b * h
    total = cfg.num_layers * layer + norm + cfg.vocab_size * h
    if cfg.position_embedding_type == "learned_absolute":
        total += cfg.max_sequence_length * h
    if not cfg.share_embeddings_and_output_weights:
        total += cfg.vocab_size * h
    if cfg.kind == "bert":
        total += cfg.num_tokentypes * h + h * h + h + norm + cfg.vocab_size  # token types, LM head, its bias
        if cfg.add_binary_head:
            total += h * h + h + 2 * h + 2  # pooler and the binary head
    return total


TRAINING_BYTES_PER_PARAMETER = 16
"""Weights, gradients and Adam's two moments, in fp32 (or bf16 weights and gradients beside fp32
master weights and moments: 2 + 2 + 4 + 4 + 4): the least a parameter under training takes."""


def check_fits(cfg: ModelConfig, world_size: int, bytes_per_rank: int, where: str) -> None:
    """Raise ``ValueError`` with the estimate where the model ``cfg`` cannot train on ``world_size``
    ranks of ``bytes_per_rank`` each even fully partitioned (ZeRO-3 and tensor parallelism at their
    most, activations not counted): a size that would otherwise end in an allocation traceback, or
    in the machine swapping, after start-up. ``where`` names the memory (a GPU's, the CPU's share)."""
    params = parameter_count(cfg)
    need = TRAINING_BYTES_PER_PARAMETER * params / world_size
    if need > bytes_per_rank:
        raise ValueError(
            f"model ({cfg.num_layers} layers, hidden {cfg.hidden_size}, vocabulary {cfg.vocab_size}) has {params:.3g} "
            f"parameters: training takes at least {TRAINING_BYTES_PER_PARAMETER} bytes each (weights, gradients, "
            f"Adam's moments), {need:.3g} bytes per rank even spread over all {world_size} rank(s), and a rank has "
            f"{bytes_per_rank:.3g} ({where}); make the model smaller or use more ranks")
