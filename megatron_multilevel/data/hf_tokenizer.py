"""This project's SentencePiece tokenizer as Hugging Face tokenizer files (``tokenizer.json`` and friends).

Built with ``tokenizers`` from the SentencePiece model itself so that it encodes token for token
like ``SentencePieceProcessor.encode`` for the options ``train_sentencepiece`` uses:

- BPE over the pieces, merges ranked by the score of the piece they make (SentencePiece merges the
  adjacent pair whose union has the highest score), byte fallback for characters without a piece;
- the normalizer: no character mapping (``identity``), spaces written as ``▁``, and the dummy prefix
  (one ``▁`` before the text, not before each piece of text between user-defined symbols);
- user-defined pieces (``<cls>``, ``<sep>``, ``<mask>``, the newline) cut out whole and never merged;
- control pieces (``<s>``, ``</s>``, ``<pad>``) not produced from text, as in SentencePiece
  (``split_special_tokens``); the end-of-sequence token is ``</s>``, the end of every GPT document.

One difference is known: a text whose part between two user-defined pieces (a whole line, say) is
exactly a control piece's name (``</s>`` alone on a line) gets that control id here, the characters
in SentencePiece; ``tokenizers`` looks whole parts up in the vocabulary before merging
(``ignore_merges``), which is what keeps user-defined pieces whole.
"""

import os
import re

from megatron_multilevel.data.tokenizer import SentencePieceTokenizer

NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6  # sentencepiece_model.proto piece types


def _proto(model_path: str):
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    with open(model_path, "rb") as f:
        proto.ParseFromString(f.read())
    return proto


def _check_supported(proto, model_path: str) -> None:
    spec, norm = proto.trainer_spec, proto.normalizer_spec
    problems = [
        (spec.model_type == 2, "model_type", spec.model_type, "BPE (2)"),
        (not norm.precompiled_charsmap, "normalization_rule_name", norm.name, "identity"),
        (not norm.remove_extra_whitespaces, "remove_extra_whitespaces", True, False),
        (norm.escape_whitespaces, "escape_whitespaces", False, True),
        (not spec.treat_whitespace_as_suffix, "treat_whitespace_as_suffix", True, False),
    ]
    for ok, key, value, needed in problems:
        if not ok:
            raise ValueError(f"tokenizer {model_path!r}: {key} is {value!r}; the Hugging Face export reproduces "
                             f"SentencePiece exactly only for {needed!r} (the options of tools/preprocess_data.py)")


def sentencepiece_to_tokenizers(model_path: str):
    """A ``tokenizers.Tokenizer`` that encodes like the SentencePiece model ``model_path``."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    proto = _proto(model_path)
    _check_supported(proto, model_path)
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    normal = {p.piece: (p.score, i) for i, p in enumerate(proto.pieces) if p.type == NORMAL}
    ranked = sorted((-score, i, piece[:k], piece[k:]) for piece, (score, i) in normal.items()
                    for k in range(1, len(piece)) if piece[:k] in normal and piece[k:] in normal)
    user_defined = [p.piece for p in proto.pieces if p.type == USER_DEFINED]
    tok = Tokenizer(BPE(vocab=vocab, merges=[(a, b) for _, _, a, b in ranked], unk_token=proto.trainer_spec.unk_piece,
                        fuse_unk=True, byte_fallback=proto.trainer_spec.byte_fallback,
                        ignore_merges=bool(user_defined)))  # an isolated user-defined piece maps to itself
    # Metaspace adds no dummy prefix to a text that starts with "▁" (a space); SentencePiece does
    tok.normalizer = normalizers.Sequence([normalizers.Replace(" ", "▁"), normalizers.Replace(Regex("\\A▁"), "▁▁")])
    steps = []
    if proto.normalizer_spec.add_dummy_prefix:  # one "▁" before the whole text, as SentencePiece
        steps.append(pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False))
    if user_defined:
        pattern = "|".join(re.escape(p) for p in sorted(user_defined, key=len, reverse=True))
        steps.append(pre_tokenizers.Split(Regex(pattern), behavior="isolated"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if proto.normalizer_spec.add_dummy_prefix:
        dec.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(dec)
    return tok


def save_hf_tokenizer(model_path: str, out_dir: str) -> None:
    """Write ``model_path`` (a SentencePiece model of this project) as Hugging Face tokenizer files
    into ``out_dir``, readable by ``transformers.AutoTokenizer.from_pretrained(out_dir)`` offline."""
    from transformers import PreTrainedTokenizerFast

    sp = SentencePieceTokenizer(model_path)
    piece = sp.inv_vocab
    fast = PreTrainedTokenizerFast(
        tokenizer_object=sentencepiece_to_tokenizers(model_path), split_special_tokens=True,
        bos_token=piece[sp._sp.bos_id()], eos_token=piece[sp.eod], unk_token=piece[sp._sp.unk_id()],
        pad_token=piece[sp.pad], cls_token=piece[sp.cls], sep_token=piece[sp.sep], mask_token=piece[sp.mask],
        clean_up_tokenization_spaces=False, model_max_length=int(1e30),
    )
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
