"""Hugging Face round trip, tokenizer included: the project's SentencePiece tokenizer as Hugging Face
files that encode token for token alike, and, offline, a GPT-2-shaped model with its own tokenizer
imported (from-hf), its data tokenized with that tokenizer, trained by a V-cycle from the imported
weights (init-run), and exported (to-hf) so that ``transformers`` alone generates what Megatron does."""

import json

import numpy
import pytest
import torch

from launch_helpers import launch, make_corpus, preprocess, small_config

EDGE_CASES = [
    " leading space", "  two leading spaces", "\nstarts with a newline", "\n\n\tx = 1\n", "ends with spaces  ",
    "<cls> a <sep> b <mask>", "x<cls>y", "unicode: é 漢字 😀 \u2581 ▁x", "digits 1234567 3.14", "", " ", "\n",
    "a<s>b</s>c<pad>", "    indented\n        more\n",
]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def test_sentencepiece_as_hugging_face_files_encodes_real_text_alike(tmp_path):
    from transformers import AutoTokenizer

    from megatron_multilevel.data.corpus import stdlib_files
    from megatron_multilevel.data.hf_tokenizer import save_hf_tokenizer
    from megatron_multilevel.data.tokenizer import SentencePieceTokenizer, sentences_of, train_sentencepiece

    files = stdlib_files()
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files[:300]]
    train_sentencepiece(sentences_of(texts[:60]), str(tmp_path / "sp.model"), vocab_size=2000)
    save_hf_tokenizer(str(tmp_path / "sp.model"), str(tmp_path / "hf"))
    sp = SentencePieceTokenizer(str(tmp_path / "sp.model"))
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    assert len(hf) == sp.vocab_size and hf.eos_token_id == sp.eod and hf.pad_token_id == sp.pad
    tokens = 0
    for text in texts[60:] + EDGE_CASES:  # source files the tokenizer was not trained on, and edge cases
        ids = sp.tokenize(text)
        assert hf(text, add_special_tokens=False)["input_ids"] == ids, repr(text[:80])
        assert hf.decode(ids) == sp.detokenize(ids), repr(text[:80])
        assert sp.detokenize(ids) == text or "\u2581" in text  # SentencePiece reads "▁" as a space
        tokens += len(ids)
    assert tokens > 300_000


def _gpt2_with_tokenizer(path, texts):
    """A tiny GPT-2 and a byte-level BPE tokenizer of its own, written the way GPT-2's files are."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = GPT2TokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                             unk_token="<|endoftext|>")
    fast.save_pretrained(path)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=len(fast), n_positions=32,
                                       bos_token_id=None, eos_token_id=None))
    model.save_pretrained(path)
    return fast


def test_from_hf_vcycle_to_hf_with_the_models_own_tokenizer(tmp_path):
    from transformers import AutoTokenizer, pipeline

    from megatron_multilevel.checkpoints import convert
    from megatron_multilevel.checkpoints.full import load_full
    from megatron_multilevel.checkpoints.hf_generation import greedy_continuation
    from megatron_multilevel.checkpoints.init_run import init_run
    from megatron_multilevel.data.preprocess import read_documents

    inputs = make_corpus(tmp_path / "corpus", documents=60)
    texts = list(read_documents(inputs))
    gpt2 = _gpt2_with_tokenizer(tmp_path / "gpt2", texts)
    # import: the weights, and the tokenizer files beside them
    convert.from_hf(str(tmp_path / "gpt2"), str(tmp_path / "imported"), fmt="safetensors", overwrite=False)
    imported, cfg, meta = load_full(str(tmp_path / "imported"))
    assert meta["tokenizer"] == "tokenizer" and (tmp_path / "imported" / "tokenizer" / "tokenizer.json").is_file()
    # the data, tokenized with GPT-2's own tokenizer (the command line, as a user runs it)
    result = preprocess(inputs, tmp_path / "data", tokenizer_model=str(tmp_path / "gpt2"))
    assert result.returncode == 0, result.stderr[-3000:]
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(tmp_path / "data"))  # kept while its memory map is read
    first = numpy.asarray(dataset[0]).tolist()
    assert first == gpt2(texts[0])["input_ids"] + [gpt2.eos_token_id]
    # a V-cycle that starts from the imported weights
    model_block = json.loads((tmp_path / "imported" / "model_config.json").read_text())["model"]
    config = small_config(tmp_path / "run.json", kind="gpt", prefix=str(tmp_path / "data"),
                          tokenizer_model=str(tmp_path / "gpt2"), output_dir=tmp_path / "run", model=model_block)
    init_run(str(tmp_path / "imported"), str(config), str(tmp_path / "run"))
    start = convert.load_source(str(tmp_path / "run"))
    assert all(torch.equal(start.tensors[k], imported[k]) for k in imported)
    run = launch(tmp_path / "run" / "config.json")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "resuming from phase00-step0000000" in run.stdout and "done: final validation loss" in run.stdout
    trained = convert.load_source(str(tmp_path / "run"))
    # the run keeps its (Hugging Face) tokenizer directory, and exports with that copy
    assert trained.tokenizer == str(tmp_path / "run" / "tokenizer")
    kept = sorted(p.name for p in (tmp_path / "run" / "tokenizer").iterdir())
    assert kept == sorted(p.name for p in (tmp_path / "gpt2").iterdir())
    assert not torch.equal(trained.tensors["embedding.word_embeddings.weight"], imported["embedding.word_embeddings.weight"])
    # export: the directory alone is a working transformers model with its tokenizer
    convert.to_hf(str(tmp_path / "run"), str(tmp_path / "export"), overwrite=False)
    exported = AutoTokenizer.from_pretrained(str(tmp_path / "export"), local_files_only=True)
    for text in texts[:20]:
        assert exported(text)["input_ids"] == gpt2(text)["input_ids"]
    prompt = texts[1][:24]
    ids = gpt2(prompt)["input_ids"]
    ours, _ = greedy_continuation(trained.tensors, trained.model, ids, 8)
    generator = pipeline("text-generation", model=str(tmp_path / "export"), device="cpu")
    out = generator(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False, return_full_text=False,
                    pad_token_id=gpt2.eos_token_id)
    assert out[0]["generated_text"] == gpt2.decode(ids + ours)[len(prompt):]


def test_to_hf_writes_the_runs_sentencepiece_tokenizer(tmp_path, dist_single):
    """A consolidated checkpoint carries its tokenizer; to-hf turns it into Hugging Face files and
    ``pipeline("text-generation")`` continues a prompt as the Megatron model does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    from conftest import random_state_dict
    from megatron_multilevel.checkpoints import convert
    from megatron_multilevel.checkpoints.full import save_full
    from megatron_multilevel.checkpoints.hf_generation import greedy_continuation
    from megatron_multilevel.config import ModelConfig
    from megatron_multilevel.data.preprocess import prepare

    stats = prepare(make_corpus(tmp_path / "corpus", documents=60), str(tmp_path / "data"), vocab_size=512)
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=512, max_sequence_length=32)
    tensors = random_state_dict(cfg)
    save_full(str(tmp_path / "full"), tensors, cfg, tokenizer=stats["tokenizer_model"])
    convert.to_hf(str(tmp_path / "full"), str(tmp_path / "export"), overwrite=False)
    from megatron_multilevel.data.tokenizer import SentencePieceTokenizer

    sp = SentencePieceTokenizer(stats["tokenizer_model"])
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "export"), local_files_only=True)
    prompt = "The coarse model averages the fine"
    ids = sp.tokenize(prompt)
    assert hf(prompt, add_special_tokens=False)["input_ids"] == ids
    ours, margins = greedy_continuation(tensors, cfg, ids, 10)
    assert min(margins) > 1e-3  # no near-tie, so the two implementations must agree exactly
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"), local_files_only=True)
    generated = model.generate(torch.tensor([ids]), max_new_tokens=10, min_new_tokens=10, do_sample=False,
                               pad_token_id=sp.pad)
    assert generated[0, len(ids):].tolist() == ours
    out = pipeline("text-generation", model=str(tmp_path / "export"), device="cpu")(
        prompt, max_new_tokens=10, min_new_tokens=10, do_sample=False, return_tensors=True, pad_token_id=sp.pad)
    assert list(out[0]["generated_token_ids"]) == ids + ours
