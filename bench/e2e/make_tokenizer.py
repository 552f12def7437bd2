"""Write a small offline tokenizer (tokenizer.json + tokenizer_config.json) into a model folder.

A dummy-weights model has no tokenizer, but SGLang's own benchmark client
(`python -m sglang.bench_serving --backend sglang`) loads one (it measures time to first token and
inter-token latency from the streamed *text*), and the server needs one to stream text. This makes
a word-level tokenizer whose vocabulary has exactly `vocab_size` entries, so every id the model can
produce decodes to text: id 0 `<s>` (BOS), 1 `</s>` (EOS), 2 `<unk>`, and `w3` ... `w{vocab-1}`.
Every non-special token decodes to a plain ASCII word (no partial UTF-8 bytes, so SGLang's incremental
detokenizer never holds text back), and decoding joins words with spaces.

    python3 bench/e2e/make_tokenizer.py MODEL_DIR [--vocab-size N]   (default: config.json's vocab_size)

Generated on the machine that runs the server (a few MB; not committed). Needs `tokenizers`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

SPECIAL = ("<s>", "</s>", "<unk>")


def vocab(vocab_size: int) -> dict:
    if vocab_size < len(SPECIAL) + 1:
        raise ValueError(f"vocab_size {vocab_size} is too small")
    v = {tok: i for i, tok in enumerate(SPECIAL)}
    for i in range(len(SPECIAL), vocab_size):
        v[f"w{i}"] = i
    return v


def write_tokenizer(model_dir: str, vocab_size: int, model_max_length: int = 1 << 20) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab=vocab(vocab_size), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(SPECIAL))
    os.makedirs(model_dir, exist_ok=True)
    tok.save(os.path.join(model_dir, "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "</s>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as fh:
        json.dump(cfg, fh, indent=1)
    with open(os.path.join(model_dir, "special_tokens_map.json"), "w") as fh:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>"}, fh, indent=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--vocab-size", type=int, default=None)
    a = ap.parse_args(argv)
    n = a.vocab_size
    if n is None:
        with open(os.path.join(a.model_dir, "config.json")) as fh:
            n = int(json.load(fh)["vocab_size"])
    write_tokenizer(a.model_dir, n)
    print(f"wrote a {n}-entry word-level tokenizer into {a.model_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
