"""The savings benchmark's sizes (``tools/benchmark_savings.py --size``): per size, the model, the
sequence length, the global batch, the steps of training from scratch (the budget) and the full
model's peak learning rate, or a shipped config to start from (``SIZES``); and the AdamW of every
size that names no other optimizer (:func:`adamw`).
"""

SIZES = {
    # The pilot's model, on sequences of 64 tokens to fit the CPU budget.
    "cpu": dict(model={"kind": "gpt", "num_layers": 8, "hidden_size": 256, "num_attention_heads": 8,
                       "vocab_size": 4096, "max_sequence_length": 64},
                seq=64, batch=16, steps=480, fine_lr=1e-3),
    # Half the width and depth, for the scale study (a larger learning rate suits the smaller model).
    "cpu-small": dict(model={"kind": "gpt", "num_layers": 4, "hidden_size": 128, "num_attention_heads": 4,
                             "vocab_size": 4096, "max_sequence_length": 64},
                      seq=64, batch=16, steps=960, fine_lr=2e-3),
    # The regime study's long points (benchmarks/JOURNAL.md, "Where it pays"): models small enough to
    # train at 20 and more tokens per parameter on 2 CPU cores, on the embedded corpus at a 512-piece
    # vocabulary (8.7 million tokens: about one epoch at 20 tokens per parameter of 8 x 64). Their
    # rate: the best of 1e-3, 2e-3 and 4e-3 for scratch on 4 x 64 at 20 tokens per parameter.
    "cpu-4x64": dict(model={"kind": "gpt", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
                            "vocab_size": 512, "max_sequence_length": 64},
                     seq=64, batch=16, steps=4600, fine_lr=4e-3),
    "cpu-8x64": dict(model={"kind": "gpt", "num_layers": 8, "hidden_size": 64, "num_attention_heads": 4,
                            "vocab_size": 512, "max_sequence_length": 64},
                     seq=64, batch=16, steps=8500, fine_lr=4e-3),
    # The regime study's second size at 80 tokens per parameter (9,400 steps, 1.1 epochs): deeper and
    # narrower than 4 x 64, half its parameters (120,128), the same heads (4, of width 8) and rate.
    "cpu-8x32": dict(model={"kind": "gpt", "num_layers": 8, "hidden_size": 32, "num_attention_heads": 4,
                            "vocab_size": 512, "max_sequence_length": 64},
                     seq=64, batch=16, steps=9400, fine_lr=4e-3),
    # The late expansion's deep point: sixteen layers, so that a one-layer model can be grown to full
    # depth in one expansion (four doublings), at the regime study's width and vocabulary; 221,760
    # parameters, 80 tokens per parameter at 17,400 steps (2.0 epochs of the embedded corpus).
    "cpu-16x32": dict(model={"kind": "gpt", "num_layers": 16, "hidden_size": 32, "num_attention_heads": 4,
                             "vocab_size": 512, "max_sequence_length": 64},
                      seq=64, batch=16, steps=17400, fine_lr=4e-3),
    # The ODE paper's model (Lauga et al.: GPT decoder, 12 blocks, width 256, 8 heads) and optimizer
    # (SGD; with its momentum, as configs/gpt_ode_alternating.json), at the CPU data budget.
    "ode-paper": dict(model={"kind": "gpt", "num_layers": 12, "hidden_size": 256, "num_attention_heads": 8,
                             "vocab_size": 4096, "max_sequence_length": 64},
                      seq=64, batch=16, steps=480, fine_lr=0.1,
                      optimizer={"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0}}),
    # BERT of the headline GPT's shape (masked-language modelling with the binary head, as the
    # BERT configs have it), on the embedded corpus, for the BERT study (benchmarks/JOURNAL.md).
    "cpu-bert": dict(model={"kind": "bert", "num_layers": 8, "hidden_size": 256, "num_attention_heads": 8,
                            "vocab_size": 4096, "max_sequence_length": 64},
                     seq=64, batch=16, steps=480, fine_lr=1e-3),
    # BERT at the regime study's small shape and vocabulary, for the BERT study's long point (20 tokens
    # per parameter at 4,700 steps; the 8 x 256 BERT would need 300,000 steps for that on 2 cores).
    "cpu-bert-4x64": dict(model={"kind": "bert", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
                                 "vocab_size": 512, "max_sequence_length": 64},
                          seq=64, batch=16, steps=4700, fine_lr=4e-3),
    "tiny": dict(model={"kind": "gpt", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
                        "vocab_size": 512, "max_sequence_length": 32},
                 seq=32, batch=8, steps=12, fine_lr=2e-3),
    "gpt-base": dict(config="configs/gpt_base_scratch.json", steps=20000, fine_lr=6e-4),
    "bert-base": dict(config="configs/bert_base_scratch.json", steps=60000, fine_lr=1e-4),
}


def adamw(lr: float) -> dict:
    """The AdamW of every size that names no other optimizer."""
    return {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95], "weight_decay": 0.01, "torch_adam": True}}


def muon(lr: float, *, adam_lr: "float | None" = None, weight_decay: float = 0.01) -> dict:
    """DeepSpeed's Muon at ``lr`` for the layers' matrices (Keller Jordan's momentum 0.95), its
    auxiliary Adam (torch's, as ``adamw``'s, with its betas) at ``adam_lr`` (None: ``lr``) for the
    embeddings, the output layer, norms and biases; both follow the run's schedule."""
    params = {"lr": lr, "momentum": 0.95, "betas": [0.9, 0.95], "weight_decay": weight_decay, "torch_adam": True}
    if adam_lr is not None:
        params["adam_lr"] = adam_lr
    return {"type": "Muon", "params": params}
