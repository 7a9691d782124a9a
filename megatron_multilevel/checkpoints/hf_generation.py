"""The tokenizer of a Hugging Face export, and its check: the exported directory alone (model and
tokenizer, read by ``transformers`` offline) continues a prompt greedily token for token as the
Megatron model does with the project's own tokenizer."""

import os

import torch

from megatron_multilevel.checkpoints.verify import LOGITS_TOLERANCE, single_process_model
from megatron_multilevel.config import ModelConfig
from megatron_multilevel.models import model_logits

PROMPT = "def main():\n    return"
NEW_TOKENS = 8


def write_tokenizer(tokenizer: str, out: str) -> None:
    """Hugging Face tokenizer files in ``out``: a SentencePiece model converted, or a Hugging Face
    tokenizer directory re-saved."""
    if os.path.isdir(tokenizer):
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer, local_files_only=True).save_pretrained(out)
    else:
        from megatron_multilevel.data.hf_tokenizer import save_hf_tokenizer

        save_hf_tokenizer(tokenizer, out)


def greedy_continuation(tensors: dict, cfg: ModelConfig, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """The ``n`` tokens a Megatron GPT picks greedily after ``ids``, and the margin of each pick
    (top logit minus the runner-up: a tie is within float rounding of two implementations)."""
    model = single_process_model(tensors, cfg)
    out, margins = list(ids), []
    with torch.no_grad():
        for _ in range(n):
            logits = model_logits(model, cfg, torch.tensor([out[-cfg.max_sequence_length:]]))[0, -1].float()
            top = torch.topk(logits, 2).values
            margins.append(float(top[0] - top[1]))
            out.append(int(logits.argmax()))
    return out[len(ids):], margins


def check_generation(out: str, tensors: dict, cfg: ModelConfig, tokenizer: str) -> None:
    """Raise ``RuntimeError`` unless ``out`` tokenizes a prompt as ``tokenizer`` does and, for a GPT,
    ``pipeline("text-generation", model=out)`` continues it greedily as the Megatron model does."""
    from transformers import AutoTokenizer, pipeline

    from megatron_multilevel.data.tokenizer import load_tokenizer

    ours = load_tokenizer(tokenizer)
    theirs = AutoTokenizer.from_pretrained(out, local_files_only=True)
    ids = ours.tokenize(PROMPT)
    same_ids = theirs(PROMPT, add_special_tokens=False)["input_ids"] == ids
    print(f"tokenizer: the exported tokenizer encodes the prompt as the project's does: {'yes' if same_ids else 'NO'}")
    if not same_ids:
        raise RuntimeError("verification failed: the exported tokenizer encodes differently")
    if cfg.kind != "gpt":
        return
    n = max(0, min(NEW_TOKENS, cfg.max_sequence_length - len(ids)))
    ours_new, margins = greedy_continuation(tensors, cfg, ids, n)
    generator = pipeline("text-generation", model=out, tokenizer=out, device="cpu")
    result = generator(PROMPT, max_new_tokens=n, min_new_tokens=n, do_sample=False, return_tensors=True,
                       pad_token_id=theirs.pad_token_id or theirs.eos_token_id)
    theirs_new = [int(t) for t in result[0]["generated_token_ids"]][len(ids):]
    first = next((i for i, (a, b) in enumerate(zip(ours_new, theirs_new)) if a != b), None)
    tie = first is not None and margins[first] < LOGITS_TOLERANCE
    print(f"| greedy continuation of {PROMPT!r} | tokens |\n|---|---|\n| Megatron + project tokenizer | {ours_new} |\n"
          f"| transformers pipeline of the export | {theirs_new} |")
    if len(theirs_new) != n or (first is not None and not tie):
        raise RuntimeError(f"verification failed: the exported model continues the prompt differently "
                           f"(from token {first})")
    print("greedy continuation: the same tokens" if first is None else
          f"greedy continuation: the same up to token {first}, where two logits tie within {LOGITS_TOLERANCE}")
