"""Decoder-only transformer (Llama architecture) built from ``transformers.LlamaConfig``.

Weights are randomly initialised from a seed, never downloaded. The model stays a plain
``LlamaForCausalLM`` (embed_tokens -> layers -> norm -> lm_head); dilocox/stages.py cuts the
same architecture into pipeline stages along ``model.layers``.

Presets (the vocabulary is the tokenizer's: 256 for bytes):
  * ``tiny``:  2 layers, d=64,  ~0.13 M parameters, seq 64,  batch 8  (tests; trains in seconds on CPU)
  * ``small``: 4 layers, d=256, ~3.3 M parameters,  seq 128, batch 16 (the demo default)
  * ``llama-20m``: 8 layers, d=384, ~20 M parameters with an 8192-token BPE, seq 256, batch 8 (CPU benchmarks)
  * ``llama-150m``, ``llama-1b``: the shapes of OpenDiLoCo's 150 M and 1 B configs (12 layers, d=1024;
    22 layers, d=2048, 4 key-value heads), seq 1024
A path to a ``.json`` or ``.toml`` file gives LlamaConfig fields plus optional ``seq_len`` and
``batch_size``.
"""

from __future__ import annotations

import json
import logging
import tomllib
from dataclasses import dataclass
from pathlib import Path

import torch

from dilocox.data import VOCAB_SIZE

logger = logging.getLogger(__name__)
_HF_ONLY = ("architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "_name_or_path",
            "use_cache", "bos_token_id", "eos_token_id", "pad_token_id")
PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 seq_len=64, batch_size=8),
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                  seq_len=128, batch_size=16),
    # CPU tests and benchmarks: ~20 M parameters with an 8192-token BPE (14.4 M with bytes)
    "llama-20m": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6,
                      rms_norm_eps=1e-5, seq_len=256, batch_size=8),
    # the shapes of OpenDiLoCo's open_diloco/configs/config_150m.json and config_1b.json (sequence length
    # 1024, as its train_fsdp.py); their parameter counts depend on the vocabulary (Mistral's 32000 there)
    "llama-150m": dict(hidden_size=1024, intermediate_size=2688, num_hidden_layers=12, num_attention_heads=16,
                       rms_norm_eps=1e-5, seq_len=1024, batch_size=16),
    "llama-1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                     num_key_value_heads=4, rms_norm_eps=1e-5, seq_len=1024, batch_size=8),
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
        """A preset or a LlamaConfig file (a Hugging Face config.json too); ``vocab_size``: the tokenizer's
        (dilocox/tokenizer.py), which replaces a file's. Raises ModelSpecError naming the problem."""
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
        if fields.get("vocab_size", vocab_size) != vocab_size:  # e.g. a Hugging Face config.json of another model
            logger.warning("model %s: vocab_size %s replaced by the tokenizer's %d (the vocabulary follows "
                           "--tokenizer)", name_or_path, fields["vocab_size"], vocab_size)
        fields.pop("vocab_size", None)
        for key in _HF_ONLY:  # what a saved config.json adds that is no architecture
            fields.pop(key, None)
        llama = dict(vocab_size=vocab_size, num_key_value_heads=fields.get("num_attention_heads", 4),
                     max_position_embeddings=seq_len, tie_word_embeddings=False)
        llama.update(fields)
        _check_shape(llama, name_or_path)
        return cls(llama=llama, seq_len=seq_len, batch_size=batch_size)


def _check_shape(llama: dict, where: str) -> None:
    """What every transformers release needs of a Llama (some check it when the config is made, some never):
    heads that divide the hidden size, and key-value heads that divide the heads. Raises ModelSpecError."""
    try:
        d, heads = int(llama["hidden_size"]), int(llama["num_attention_heads"])
        kv = int(llama.get("num_key_value_heads") or heads)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelSpecError(f"model {where}: hidden_size and num_attention_heads must be integers ({e})") from e
    if min(d, heads, kv) < 1 or d % heads or heads % kv:
        raise ModelSpecError(f"model {where}: hidden_size {d} must be a multiple of num_attention_heads {heads}, "
                             f"and that of num_key_value_heads {kv}")


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
