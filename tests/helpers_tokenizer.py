"""Tiny tokenizers trained in memory for tests: no network, no real model, a second to build.

Two kinds, matching the two families the engine serves:
- byte-level BPE (GPT-2 / Qwen / Llama 3 style): every byte is a token, so tokens can end in the
  middle of a multi-byte UTF-8 character;
- SentencePiece-like BPE with byte fallback (Llama 2 / Mistral style): "▁" marks a space, the
  decoder strips the leading space of a decode, unknown characters become <0xXX> byte pieces.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

FAMILY = "👨\u200d👩\u200d👧\u200d👦"  # family emoji: four people joined by ZERO WIDTH JOINER

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world, hello there!",
    "Speculative decoding drafts tokens with a small model and verifies them in one pass.",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < n; ++i) { total += values[i]; }  // sum the values",
    'print("hello, world")  # {"key": [1, 2, 3]}',
    "中文是一种语言。我们正在测试分词器的增量解码。你好，世界！",
    "日本語のテキストです。こんにちは、世界。東京は大きい都市です。",
    "Waving hands 👋🏽 👋🏽 and rockets 🚀🚀 launch; family " + FAMILY + " at home.",
    "Mixed: résumé naïve café — “quotes” and ellipsis… ok",
]

# Texts for streaming tests, deliberately including characters rare or absent in CORPUS.
STREAM_TEXTS = {
    "english": "Hello world, the quick brown fox.",
    "code": "def add(a, b):\n    return a + b  # 加法\n",
    "cjk": "你好，世界！中文测试。日本語のテキスト、東京。",
    "emoji": "Hi 👋🏽! Launch 🚀 now 🎉 with " + FAMILY + " 🧑🏿‍💻",
    "mixed": "résumé 中文 👋🏽 code(x) 日本語 🚀" + FAMILY + "!",
}


# The byte-fallback tokenizer learns only these characters beyond ASCII; the rest of the CJK text
# and every emoji go to <0xXX> byte pieces, mixed with whole-character pieces as in Llama 2.
_FALLBACK_EXTRA = "世界 好 日 é 👋 🏽 🚀 \u200d"


def _train(tokenizer: RustTokenizer, trainer: trainers.BpeTrainer, corpus: list[str]) -> None:
    tokenizer.train_from_iterator(corpus * 4, trainer=trainer)


def build_byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with ChatML special tokens and chat template."""
    tokenizer = RustTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # A small vocabulary keeps most CJK characters and emoji split across byte tokens, which is
    # the case the detokenizer has to get right.
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    _train(tokenizer, trainer, CORPUS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def build_byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """SentencePiece-like BPE ("▁" for spaces, <0xXX> byte pieces), without a chat template."""
    tokenizer = RustTokenizer(models.BPE())
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    corpus = [line for line in CORPUS if line.isascii()] + [_FALLBACK_EXTRA]
    _train(tokenizer, trainer, corpus)
    # Add the 256 byte pieces to the model vocabulary and switch byte fallback on.
    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab) + len(spec["added_tokens"]))
    spec["model"]["byte_fallback"] = True
    spec["model"]["unk_token"] = "<unk>"
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    _renumber_vocab(spec)
    return PreTrainedTokenizerFast(
        tokenizer_object=RustTokenizer.from_str(json.dumps(spec)),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def _renumber_vocab(spec: dict) -> None:
    """Give model tokens ids after the added special tokens' ids, all distinct and dense."""
    added = {t["content"]: t["id"] for t in spec["added_tokens"]}
    next_id = max(added.values()) + 1
    vocab = spec["model"]["vocab"]
    for token in sorted(vocab, key=vocab.__getitem__):
        if token in added:
            vocab[token] = added[token]
        else:
            vocab[token] = next_id
            next_id += 1


def save_tokenizer_dir(
    hf_tokenizer: PreTrainedTokenizerFast,
    path: Path,
    generation_eos: int | list[int] | None = None,
) -> Path:
    """Save like a model directory, optionally with a generation_config.json eos_token_id."""
    path.mkdir(parents=True, exist_ok=True)
    hf_tokenizer.save_pretrained(str(path))
    if generation_eos is not None:
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return path


def byte_token_ids(hf_tokenizer: PreTrainedTokenizerFast, data: bytes) -> list[int]:
    """Ids of the single-byte tokens of a byte-level tokenizer spelling ``data`` byte by byte."""
    alphabet = _byte_to_unicode()
    ids = hf_tokenizer.convert_tokens_to_ids([alphabet[b] for b in data])
    assert all(isinstance(i, int) and i >= 0 for i in ids), "byte token missing from the vocab"
    return list(ids)


def _byte_to_unicode() -> dict[int, str]:
    """The byte -> printable character table of byte-level BPE vocabularies.

    Printable Latin-1 bytes stand for themselves; the other bytes (controls, space, ...) are
    shifted, in order, to code points from 256 upwards.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table
