"""The supported Megatron-Core versions (0.16 on Python < 3.12, 0.19 on 3.12+) look the same to the
project: parameter names, and the tokenizer interface Megatron's datasets read (megatron_multilevel.compat)."""

import json

import pytest

from conftest import small_config
from megatron_multilevel import compat

# The parameters of one layer of each family, as checkpoints, the plan and the operators name them.
# Frozen: a Megatron-Core version that renames any of them must fail here, on every version tested.
PARAMETER_NAMES = {
    "gpt_llama": [
        "decoder.final_layernorm.weight",
        "decoder.layers.0.input_layernorm.weight",
        "decoder.layers.0.mlp.linear_fc1.weight",
        "decoder.layers.0.mlp.linear_fc2.weight",
        "decoder.layers.0.pre_mlp_layernorm.weight",
        "decoder.layers.0.self_attention.linear_proj.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "embedding.word_embeddings.weight",
        "output_layer.weight",
    ],
    "bert_untied_binary": [
        "binary_head.bias", "binary_head.weight",
        "embedding.position_embeddings.weight", "embedding.tokentype_embeddings.weight",
        "embedding.word_embeddings.weight",
        "encoder.final_layernorm.bias", "encoder.final_layernorm.weight",
        "encoder.layers.0.input_layernorm.bias", "encoder.layers.0.input_layernorm.weight",
        "encoder.layers.0.mlp.linear_fc1.bias", "encoder.layers.0.mlp.linear_fc1.weight",
        "encoder.layers.0.mlp.linear_fc2.bias", "encoder.layers.0.mlp.linear_fc2.weight",
        "encoder.layers.0.pre_mlp_layernorm.bias", "encoder.layers.0.pre_mlp_layernorm.weight",
        "encoder.layers.0.self_attention.linear_proj.bias", "encoder.layers.0.self_attention.linear_proj.weight",
        "encoder.layers.0.self_attention.linear_qkv.bias", "encoder.layers.0.self_attention.linear_qkv.weight",
        "lm_head.dense.bias", "lm_head.dense.weight", "lm_head.layer_norm.bias", "lm_head.layer_norm.weight",
        "output_layer.bias", "output_layer.weight",
        "pooler.dense.bias", "pooler.dense.weight",
    ],
}


@pytest.mark.parametrize("variant", sorted(PARAMETER_NAMES))
def test_parameter_names_are_the_same_on_every_version(dist_single, variant):
    from megatron_multilevel.models import build_model, parameter_state_dict

    model = build_model(small_config(variant, num_layers=1))
    assert sorted(parameter_state_dict(model)) == PARAMETER_NAMES[variant]


class _CharTokenizer(compat.TokenizerBase):
    def __init__(self):
        super().__init__("chars.model", lowercase=True)

    def tokenize(self, text):
        return [ord(c) for c in text.lower()]

    vocab = property(lambda self: {chr(i): i for i in range(128)})
    inv_vocab = property(lambda self: {i: chr(i) for i in range(128)})
    vocab_size = property(lambda self: 128)

    @property
    def eod(self):
        return 0


def test_tokenizer_base_gives_the_datasets_what_they_read():
    tok = _CharTokenizer()
    assert tok.tokenize("Ab") == [97, 98] and tok.eod == 0 and tok.inv_vocab[97] == "a"
    # the index cache names the tokenizer by these (Megatron's datasets serialise them into the cache key)
    assert dict(tok.unique_identifiers) == {
        "class": "_CharTokenizer", "tokenizer_path": ["chars.model"], "lowercase": "True"}
    assert json.loads(json.dumps({"tokenizer": tok}, default=lambda obj: obj.unique_identifiers)) == {
        "tokenizer": dict(tok.unique_identifiers)}
    # ids a tokenizer lacks raise NotImplementedError, which the datasets catch
    for name in ("cls", "sep", "mask", "bos", "eos"):
        with pytest.raises(NotImplementedError):
            getattr(tok, name)


def test_tokenizer_base_matches_megatron_legacy_tokenizer():
    """Where Megatron-Core still ships MegatronLegacyTokenizer, it is the base; the copy kept for
    later versions has the same public interface."""
    if not compat.has_legacy_tokenizer():
        with pytest.raises(ImportError):
            from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer  # noqa: F401
        assert compat.TokenizerBase is compat._TokenizerBase
        return
    from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer

    assert compat.TokenizerBase is MegatronLegacyTokenizer
    public = lambda cls: {n for n in dir(cls) if not n.startswith("_")}  # noqa: E731
    assert public(compat._TokenizerBase) == public(MegatronLegacyTokenizer)
    assert compat._TokenizerBase.__abstractmethods__ == MegatronLegacyTokenizer.__abstractmethods__


def test_known_library_notices_are_dropped_and_nothing_else():
    """What a user sees of a run is the project's own output: the known library notices (0.19's
    GPTModel deprecation, a CUDA-built torch without a GPU) are dropped, their loggers' other
    records are not."""
    import logging

    compat.quiet_library_notices()
    compat.quiet_library_notices()  # idempotent
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    for name, start in compat.KNOWN_NOTICES.items():
        logger = logging.getLogger(name)
        assert sum(isinstance(f, compat._DropNotice) for f in logger.filters) == 1
        logger.addHandler(handler)
        try:
            logger.warning(start + " (the notice)")
            logger.warning("something else from %s", name)
        finally:
            logger.removeHandler(handler)
    assert seen == [f"something else from {name}" for name in compat.KNOWN_NOTICES]
