"""Tokenizers: raw UTF-8 bytes (the default) or a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library).

``--tokenizer bytes`` keeps the vocabulary at 256 and needs nothing trained; ``--tokenizer PATH`` loads
``PATH`` (a ``tokenizer.json``, or a folder holding one as ``transformers``' ``save_pretrained`` writes it).
The model's vocabulary is the tokenizer's (dilocox/model.py). ``digest`` (the SHA-256 of the file's bytes)
joins the swarm settings, so replicas that would read the same ids as different text refuse each other.
Documents are separated by the tokenizer's end-of-text token where it has one (packing, dilocox/shards.py).

``train_bpe`` trains a byte-level BPE (GPT-2's scheme: every byte is a symbol, so any UTF-8 text encodes)
with ``<|endoftext|>`` as its one special token: ``dilocox-ctl tokenizer train CORPUS --vocab-size N -o F``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

BYTES = "bytes"
EOT_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>")  # tried in this order


class TokenizerError(ValueError):
    """A tokenizer spec that cannot be loaded (missing, unreadable, not a tokenizer.json) or trained."""


@dataclass(frozen=True)
class Tokenizer:
    """``vocab_size`` ids; ``eot_id``: the end-of-text id packed between documents (None for bytes);
    ``digest``: ``bytes`` or the first 16 hex digits of the SHA-256 of the tokenizer.json bytes."""

    name: str
    vocab_size: int
    digest: str
    eot_id: Optional[int] = None
    _hf: object = field(default=None, repr=False, compare=False)

    @property
    def is_bytes(self) -> bool:
        return self._hf is None

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` (uint32 [n]), no special tokens added."""
        if self._hf is None:
            return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint32)
        return np.asarray(self._hf.encode(text, add_special_tokens=False).ids, dtype=np.uint32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """``encode`` of each text; the ``tokenizers`` library spreads a batch over its threads."""
        if self._hf is None:
            return [self.encode(t) for t in texts]
        return [np.asarray(e.ids, dtype=np.uint32) for e in self._hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        """The text of ``ids`` (bytes: invalid UTF-8 sequences become U+FFFD)."""
        ids = [int(i) for i in ids]
        if self._hf is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self._hf.decode(ids, skip_special_tokens=False)

    def record(self) -> dict:
        """What prepared shards' index and checkpoints say of the tokenizer: name, digest, vocabulary, end-of-text."""
        return dict(name=self.name, digest=self.digest, vocab_size=self.vocab_size, eot_id=self.eot_id)

    def json_path(self) -> Optional[Path]:
        """The tokenizer.json this tokenizer was loaded from (None for bytes)."""
        return None if self._hf is None else Path(self.name)


def byte_tokenizer() -> Tokenizer:
    return Tokenizer(BYTES, 256, BYTES)


def tokenizer_file(spec: str) -> Path:
    """The tokenizer.json a non-bytes spec names: the file itself, or ``tokenizer.json`` in a folder."""
    path = Path(spec).expanduser()
    return path / "tokenizer.json" if path.is_dir() else path


def file_digest(raw: bytes) -> str:
    """A tokenizer's digest: the first 16 hex digits of the SHA-256 of its tokenizer.json bytes."""
    return hashlib.sha256(raw).hexdigest()[:16]


def load_tokenizer(spec: str) -> Tokenizer:
    """``bytes``, a tokenizer.json, or a folder holding one. Raises TokenizerError naming the path and problem."""
    if spec == BYTES:
        return byte_tokenizer()
    path = tokenizer_file(spec)
    if not path.is_file():
        raise TokenizerError(f"tokenizer {spec!r}: no such file (expected 'bytes', a tokenizer.json or a folder "
                             f"holding one)")
    from tokenizers import Tokenizer as HFTokenizer  # only when a real tokenizer is used

    try:
        raw = path.read_bytes()
        hf = HFTokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:  # OSError, UnicodeDecodeError, or the plain Exception tokenizers raises on bad JSON
        raise TokenizerError(f"tokenizer {path}: not a Hugging Face tokenizer.json ({e})") from e
    vocab = hf.get_vocab_size(with_added_tokens=True)
    if vocab < 2 or vocab > 2**32 - 1:
        raise TokenizerError(f"tokenizer {path}: vocabulary of {vocab} tokens")
    eot = next((hf.token_to_id(t) for t in EOT_NAMES if hf.token_to_id(t) is not None), None)
    return Tokenizer(str(path.resolve()), vocab, file_digest(raw), eot, hf)


def train_bpe(texts: Iterable[str], vocab_size: int, out: Path) -> Tokenizer:
    """Train a byte-level BPE of ``vocab_size`` ids (256 byte symbols, ``<|endoftext|>``, merges) on ``texts``,
    write it to ``out`` (a tokenizer.json) and load it. Raises TokenizerError for a vocabulary under 258."""
    if vocab_size < 258:
        raise TokenizerError(f"--vocab-size {vocab_size}: a byte-level BPE needs at least 258 (256 bytes, "
                             f"<|endoftext|> and one merge)")
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return load_tokenizer(str(out))


def describe(tok: Tokenizer) -> str:
    """One line for logs and ``--help`` output."""
    if tok.is_bytes:
        return "bytes (UTF-8, 256 ids)"
    return f"{tok.name} ({tok.vocab_size} ids, sha256 {tok.digest}, end-of-text id {tok.eot_id})"


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte value 0..255 (the ByteLevel pre-tokenizer's alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def bytes_tokenizer_json() -> str:
    """A Hugging Face tokenizer.json that maps text to exactly the bytes tokenizer's ids (id = byte value): a BPE
    with the 256 byte symbols and no merges behind GPT-2's ByteLevel pre-tokenizer and decoder. An export of a
    bytes model ships it, so ``AutoTokenizer`` reads the model's ids without code of ours."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    tok = HFTokenizer(models.BPE(vocab={sym: b for b, sym in enumerate(_byte_symbols())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()
