"""The prompt tokenizer: CLIP's byte-level BPE, read from the checkpoint's tokenizer.json, and
the synthetic one `sammie synth` writes.

A prompt becomes exactly what transformers' `Sam3Processor` feeds the model: the tokenizer's
ids with BOS / EOS (its post-processor adds them), padded to 32 with the pad token, and a mask
of the real ones. A prompt over 32 tokens is refused (the model has 32 positions; the
reference raises there too).

The synthetic tokenizer has CLIP's format (normaliser, pre-tokeniser split, byte-level alphabet,
`</w>` word ends, BOS 49406 / EOS 49407) with merges learned from `CONCEPT_WORDS` (COCO's 80
categories, colours, a few attributes), so common prompts are a few tokens, as with CLIP's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

BOS, EOS = "<|startoftext|>", "<|endoftext|>"
BOS_ID, EOS_ID = 49406, 49407
MAX_TOKENS = 32
SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""

CONCEPT_WORDS = (
    "person bicycle car motorcycle airplane bus train truck boat traffic light fire hydrant "
    "stop sign parking meter bench bird cat dog horse sheep cow elephant bear zebra giraffe "
    "backpack umbrella handbag tie suitcase frisbee skis snowboard sports ball kite baseball "
    "bat glove skateboard surfboard tennis racket bottle wine glass cup fork knife spoon bowl "
    "banana apple sandwich orange broccoli carrot hot dog pizza donut cake chair couch potted "
    "plant bed dining table toilet tv laptop mouse remote keyboard cell phone microwave oven "
    "toaster sink refrigerator book clock vase scissors teddy hair drier toothbrush "
    "red green blue yellow white black orange purple pink brown gray grey striped small large "
    "round square circle triangle ring disk stripe dot shape the a every all of left right top "
    "bottom mug shadow sky tree road window door wheel visual"
).split()


def _trained_merges(words: list[str]) -> list[tuple[str, str]]:
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
    tok.normalizer = _normalizer(normalizers, Regex)
    tok.pre_tokenizer = _pre_tokenizer(pre_tokenizers, Regex)
    trainer = trainers.BpeTrainer(vocab_size=2000, show_progress=False, end_of_word_suffix="</w>",
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(words)] * 4, trainer)
    merges = json.loads(tok.to_str())["model"]["merges"]
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]


def _normalizer(normalizers, Regex):
    return normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "),
                                 normalizers.Lowercase()])


def _pre_tokenizer(pre_tokenizers, Regex):
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def write_synthetic_tokenizer(out: str | Path) -> None:
    """tokenizer.json, vocab.json, merges.txt, tokenizer_config.json, special_tokens_map.json
    in CLIP's format (CLIPTokenizer / CLIPTokenizerFast load them)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, \
        processors

    out = Path(out)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda ch: ord(ch))
    vocab: dict[str, int] = {}
    for tok in alphabet + [ch + "</w>" for ch in alphabet]:
        vocab.setdefault(tok, len(vocab))
    merges = []
    for a, b in _trained_merges(list(CONCEPT_WORDS)):
        if a in vocab and b in vocab and a + b not in vocab:
            vocab[a + b] = len(vocab)
            merges.append((a, b))
    vocab[BOS], vocab[EOS] = BOS_ID, EOS_ID
    bpe = models.BPE(vocab=vocab, merges=merges, end_of_word_suffix="</w>", unk_token=EOS,
                     fuse_unk=False)
    tok = Tokenizer(bpe)
    tok.normalizer = _normalizer(normalizers, Regex)
    tok.pre_tokenizer = _pre_tokenizer(pre_tokenizers, Regex)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.RobertaProcessing((EOS, EOS_ID), (BOS, BOS_ID),
                                                      trim_offsets=False, add_prefix_space=False)
    tok.add_special_tokens([BOS, EOS])
    tok.save(str(out / "tokenizer.json"))
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (out / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    special = {"bos_token": BOS, "eos_token": EOS, "unk_token": EOS, "pad_token": EOS}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=1))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "CLIPTokenizer", "model_max_length": MAX_TOKENS,
         "do_lower_case": True, "errors": "replace", **special}, indent=1))


class PromptTokenizer:
    """A checkpoint's tokenizer.json, as Sam3Processor pads it (max_length 32)."""

    def __init__(self, ckpt: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(ckpt) / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{ckpt}: no tokenizer.json (the checkpoint's CLIP tokenizer)")
        self.tok = Tokenizer.from_file(str(path))
        self.tok.no_padding()
        self.tok.no_truncation()
        cfg_path = Path(ckpt) / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        pad = cfg.get("pad_token", EOS)
        pad = pad.get("content", EOS) if isinstance(pad, dict) else pad
        pad_id = self.tok.token_to_id(pad)
        self.pad_id = EOS_ID if pad_id is None else pad_id

    def count(self, text: str) -> int:
        return len(self.tok.encode(text).ids)

    def encode(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (ids [T, 32] long, mask [T, 32] bool). ValueError naming a prompt over 32
        tokens."""
        ids = torch.full((len(texts), MAX_TOKENS), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(texts), MAX_TOKENS), dtype=torch.bool)
        for i, enc in enumerate(self.tok.encode_batch(list(texts))):
            n = len(enc.ids)
            if n > MAX_TOKENS:
                raise ValueError(f"prompt {texts[i][:60]!r} is {n} tokens with BOS and EOS; "
                                 f"the model reads at most {MAX_TOKENS}")
            ids[i, :n] = torch.tensor(enc.ids)
            mask[i, :n] = True
        return ids, mask
