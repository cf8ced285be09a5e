"""What a torchtitan debug job reads besides its config, made here (no hub; tests/test_torchtitan.py and gpu_check's
own_trainer step use it): a word-level tokenizer folder (`--hf_assets_path`: tokenizer.json and tokenizer_config.json,
BOS and EOS named) whose vocabulary fits the llama3 debug model's 2048 embeddings, and a folder of JSON lines (`--dataloader.dataset_path`, read by torchtitan's c4_test
loader: `load_dataset(path, split="train")`) of documents of varied lengths, so that a packed row of torchtitan's
text loader holds document boundaries (its per-document positions restart there)."""

from __future__ import annotations

import json
import os
import random

WORDS = 1500  # the vocabulary: <unk>, <s>, </s> and WORDS words, under the debug model's 2048
DOCUMENTS = 400


def make_assets(folder: str, seed: int = 0) -> tuple[str, str]:
    """(tokenizer folder, dataset folder) under `folder`, made once (deterministic in `seed`)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    tokenizer_dir, data_dir = os.path.join(folder, "tokenizer"), os.path.join(folder, "c4_tiny")
    if os.path.isfile(os.path.join(data_dir, "train.jsonl")):
        return tokenizer_dir, data_dir
    os.makedirs(tokenizer_dir, exist_ok=True)
    os.makedirs(data_dir, exist_ok=True)
    words = [f"w{i}" for i in range(WORDS)]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(os.path.join(tokenizer_dir, "tokenizer.json"))
    with open(os.path.join(tokenizer_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False, "add_eos_token": False}, f)
    rng = random.Random(seed)
    with open(os.path.join(data_dir, "train.jsonl.tmp"), "w") as f:
        for _ in range(DOCUMENTS):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(5, 60)))}) + "\n")
    os.replace(os.path.join(data_dir, "train.jsonl.tmp"), os.path.join(data_dir, "train.jsonl"))
    return tokenizer_dir, data_dir
