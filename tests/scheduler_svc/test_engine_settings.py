"""scheduler_svc/engine_settings.py: the tokenizer the engine core and the API processes load,
and what their start imports."""

from __future__ import annotations

import json
import subprocess
import sys

from pagedserve.core.models import read_max_position_embeddings
from pagedserve.scheduler.engine_settings import auto_tokenizer

TEXTS = ["Hello, world!", "  spaces\tand\nnewlines ", "naïve café 東京 🙂", "<|im_start|>x"]


def test_the_generic_fast_tokenizer_is_autotokenizers_own(model_dir, tokenizer):
    mine = auto_tokenizer(model_dir)
    assert type(mine) is type(tokenizer)
    for text in TEXTS:
        assert mine(text).input_ids == tokenizer(text).input_ids
        ids = tokenizer(text).input_ids
        assert mine.decode(ids) == tokenizer.decode(ids)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "and?"}]
    assert (mine.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    assert (mine.eos_token_id, mine.pad_token_id, len(mine)) == (
        tokenizer.eos_token_id, tokenizer.pad_token_id, len(tokenizer))


def test_another_tokenizer_class_goes_through_autotokenizer(model_dir, tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "GPT2Tokenizer"  # (no generic class: AutoTokenizer decides)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    mine = auto_tokenizer(tmp_path)
    assert type(mine).__name__ != "TokenizersBackend"
    assert mine("Hello, world!").input_ids == tokenizer("Hello, world!").input_ids


def test_a_sentencepiece_only_tokenizer_loads(tmp_path):
    """Checkpoints of Llama 2's generation and Mistral 7B v0.1's era may ship tokenizer.model
    alone: read through sentencepiece (a dependency), it encodes as sentencepiece does."""
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"the quick brown fox {i} jumps over the lazy dog\n"
                              for i in range(200)))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "tokenizer"),
                                   vocab_size=60, model_type="bpe", minloglevel=2)
    (tmp_path / "tokenizer.vocab").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>"}))
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    mine = auto_tokenizer(tmp_path)
    text = "the lazy fox jumps over 7 quick dogs"
    assert mine.encode(text, add_special_tokens=False) == sp.encode(text)
    assert mine.decode(sp.encode(text)) == sp.decode(sp.encode(text))
    assert mine.eos_token_id == sp.eos_id() == 2


def test_the_tokenizer_and_the_context_length_load_without_torch(model_dir):
    """AutoTokenizer and AutoConfig import torch (2-3 s of CPU and ~250 MB in every engine
    core and API process); neither path that serves the default model does."""
    code = ("import sys; from pathlib import Path; "
            "from pagedserve.scheduler.engine_settings import auto_tokenizer; "
            "from pagedserve.core.models import read_max_position_embeddings; "
            "auto_tokenizer(Path(sys.argv[1])); print(read_max_position_embeddings(sys.argv[1]), "
            "'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(model_dir)], capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.split() == ["8192", "False"]


def test_the_context_length_is_the_configs_or_its_language_models(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "gemma3", "text_config": {"max_position_embeddings": 131072}}))
    assert read_max_position_embeddings(tmp_path) == 131072
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "max_position_embeddings": 4096}))
    assert read_max_position_embeddings(tmp_path) == 4096
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert read_max_position_embeddings(tmp_path) == 2048  # LlamaConfig's default
