"""Prepare pretraining data: text or JSONL -> tokenizer -> Megatron indexed dataset.

    # train a tokenizer on the corpus and write corpus.bin / corpus.idx / corpus.model (GPT)
    python tools/preprocess_data.py --input data/*.txt --output-prefix data/corpus --vocab-size 8000

    # BERT (masked LM): one sentence per non-blank line, with an existing tokenizer
    python tools/preprocess_data.py --input data/wiki.jsonl --json-key text --output-prefix data/wiki \\
        --tokenizer-model data/corpus.model --split-sentences

    # a Hugging Face tokenizer directory, e.g. the GPT-2 that convert_checkpoint.py from-hf imported
    python tools/preprocess_data.py --input data/mine.jsonl --output-prefix data/mine --tokenizer-model path/to/gpt2

Then point a run config at it: ``"data": {"prefix": "data/corpus", "tokenizer_model": "data/corpus.model"}``,
or blend several datasets made with the same tokenizer: ``"blend": [0.3, "data/corpus", 0.7, "data/mine"]``.
Beside the dataset, ``PREFIX.meta.json`` records the tokenizer it was made with; a run refuses a
dataset made with another one. Flags take hyphens or underscores, as Megatron's and DeepSpeed's tools do.
"""

import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--input", "--input-files", "--input_files", nargs="+", required=True,
                   help="text files (one document each) or .jsonl files (one document per line); globs allowed")
    p.add_argument("--output-prefix", "--output_prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--vocab-size", "--vocab_size", type=int, default=8000, help="when training a tokenizer")
    p.add_argument("--tokenizer-model", "--tokenizer_model", default=None,
                   help="an existing SentencePiece model, or a Hugging Face tokenizer directory "
                        "(default: train a SentencePiece model on the input, PREFIX.model)")
    p.add_argument("--json-key", "--json_key", default="text", help="the text field of JSONL records")
    p.add_argument("--split-sentences", "--split_sentences", action="store_true",
                   help="BERT: each non-blank line is a sentence")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_multilevel.data.preprocess import prepare

    inputs = []
    for pattern in args.input:
        matches = sorted(glob.glob(pattern))
        if not matches:
            print(f"error: no input matches {pattern!r}", file=sys.stderr)
            return 2
        inputs += matches
    try:
        stats = prepare(inputs, args.output_prefix, vocab_size=args.vocab_size, tokenizer_model=args.tokenizer_model,
                        split_sentences=args.split_sentences, json_key=args.json_key)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(stats, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
