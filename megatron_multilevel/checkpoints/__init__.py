"""Checkpoint conversion: DeepSpeed checkpoints of any layout, consolidated files, Hugging Face."""
