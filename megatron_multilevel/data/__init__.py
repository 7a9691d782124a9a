"""Data: SentencePiece tokenizers, Megatron indexed datasets, the embedded default corpus."""
