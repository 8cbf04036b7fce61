"""Decoder-only transformer (Llama architecture) built from ``transformers.LlamaConfig``.

Weights are randomly initialised from a seed, never downloaded. The model stays a plain
``LlamaForCausalLM`` (embed_tokens -> layers -> norm -> lm_head); dilocox/stages.py cuts the
same architecture into pipeline stages along ``model.layers``.

Presets (the vocabulary is the tokenizer's: 256 for bytes):
  * ``tiny``:  2 layers, d=64,  ~0.13 M parameters, seq 64,  batch 8  (tests; trains in seconds on CPU)
  * ``small``: 4 layers, d=256, ~3.3 M parameters,  seq 128, batch 16 (the demo default)
A path to a ``.json`` or ``.toml`` file gives LlamaConfig fields plus optional ``seq_len`` and
``batch_size``.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path

import torch

from dilocox.data import VOCAB_SIZE

PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 seq_len=64, batch_size=8),
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                  seq_len=128, batch_size=16),
}


class ModelSpecError(ValueError):
    """An unknown preset or an unreadable / invalid model config file."""


@dataclass
class ModelSpec:
    """LlamaConfig keyword arguments plus the training window (seq_len tokens x batch_size sequences)."""

    llama: dict
    seq_len: int
    batch_size: int

    @classmethod
    def resolve(cls, name_or_path: str, vocab_size: int = VOCAB_SIZE) -> "ModelSpec":
        """A preset or a LlamaConfig file; ``vocab_size``: the tokenizer's (dilocox/tokenizer.py), which a file
        may repeat but not contradict. Raises ModelSpecError naming the problem."""
        if name_or_path in PRESETS:
            fields = dict(PRESETS[name_or_path])
        else:
            path = Path(name_or_path)
            if not path.is_file():
                raise ModelSpecError(f"model {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a file")
            try:
                text = path.read_text(encoding="utf-8")
                fields = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
            except (OSError, ValueError) as e:
                raise ModelSpecError(f"cannot read model config {path}: {e}") from e
            if not isinstance(fields, dict):
                raise ModelSpecError(f"model config {path} must hold a table/object of LlamaConfig fields")
        seq_len = int(fields.pop("seq_len", 128))
        batch_size = int(fields.pop("batch_size", 16))
        if fields.get("vocab_size", vocab_size) != vocab_size:
            raise ModelSpecError(f"vocab_size {fields['vocab_size']} in {name_or_path} differs from the tokenizer's "
                                 f"{vocab_size}: the vocabulary comes from --tokenizer (drop the field)")
        fields.pop("vocab_size", None)
        llama = dict(vocab_size=vocab_size, num_key_value_heads=fields.get("num_attention_heads", 4),
                     max_position_embeddings=seq_len, tie_word_embeddings=False, **fields)
        return cls(llama=llama, seq_len=seq_len, batch_size=batch_size)


def build_model(spec: ModelSpec, seed: int) -> torch.nn.Module:
    """A randomly initialised LlamaForCausalLM; the same seed gives bit-identical weights everywhere."""
    from transformers import LlamaConfig, LlamaForCausalLM  # heavy import, only when a model is built

    try:
        config = LlamaConfig(**spec.llama)
    except (TypeError, ValueError) as e:
        raise ModelSpecError(f"invalid Llama config: {e}") from e
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model


def causal_lm_loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats/token); inputs and targets are int64 [batch, seq]."""
    out = model(inputs)
    logits = out if isinstance(out, torch.Tensor) else out.logits  # StageModule or LlamaForCausalLM
    return lm_loss(logits, targets)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits [batch, seq, vocab] against int64 targets [batch, seq]."""
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
