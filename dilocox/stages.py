"""Pipeline stages of the Llama model: contiguous layer slices that one node holds (DiLoCoX).

DiLoCoX (arXiv 2506.21263, sec. 3.1) splits a replica into M pipeline stages; worker (i, j)
holds stage j of replica i with its own inner optimizer and its share of the outer optimizer.
Here stage k of S holds decoder layers ``layer_range(L, k, S)``; the first stage also holds
``embed_tokens``, the last the final ``norm`` and ``lm_head``. Only those modules are built on a
node: nothing of the other stages is materialised.

Initialisation **(ours)**: every parameter is drawn from its own generator seeded by
(seed, its name in the full ``LlamaForCausalLM``), with the distribution of transformers'
``_init_weights`` (normal(0, initializer_range) for weights, ones for RMSNorm). A parameter is
therefore bit-identical whichever stage split built it, so S = 1 and S = 2 start equal.
"""

from __future__ import annotations

import hashlib
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dilocox.model import ModelSpec, ModelSpecError


def parse_stage(text: str) -> tuple[int, int]:
    """``"K/S"`` -> (K, S) with 0 <= K < S; raises ValueError naming the problem."""
    try:
        k, s = (int(part) for part in text.split("/"))
    except ValueError:
        raise ValueError(f"stage {text!r} must look like K/S (e.g. 0/2: first of two stages)") from None
    if s < 1 or not 0 <= k < s:
        raise ValueError(f"stage {text!r}: need 0 <= K < S and S >= 1")
    return k, s


def layer_range(num_layers: int, stage_index: int, num_stages: int) -> range:
    """Decoder layers of a stage: the balanced contiguous split of ``num_layers`` into ``num_stages``.

    Raises ModelSpecError if there are fewer layers than stages.
    """
    if num_stages > num_layers:
        raise ModelSpecError(f"{num_stages} stages need at least {num_stages} decoder layers, "
                             f"the model has {num_layers}")
    return range(stage_index * num_layers // num_stages, (stage_index + 1) * num_layers // num_stages)


def _seeded_init(param: torch.Tensor, full_name: str, seed: int, std: float) -> None:
    key = hashlib.sha256(f"{seed}/{full_name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & (2**63 - 1))
    with torch.no_grad():
        if param.dim() == 1:  # RMSNorm weights (Llama has no biases)
            param.fill_(1.0)
        else:
            param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float32) * std)


class StageModule(nn.Module):
    """Stage ``stage_index`` of ``num_stages`` of a LlamaForCausalLM.

    forward: first stage int64 token ids [batch, seq] -> hidden [batch, seq, d]; middle stages
    hidden -> hidden; last stage hidden -> logits [batch, seq, vocab] (one stage: ids -> logits).
    ``full_names`` maps each parameter's name here to its name in the full model.
    """

    def __init__(self, spec: ModelSpec, stage_index: int, num_stages: int, seed: int):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

        try:
            # sdpa: what LlamaForCausalLM picks on CPU (None would mean no causal mask)
            self.config = LlamaConfig(**{**spec.llama, "attn_implementation": "sdpa"})
        except Exception as e:  # TypeError, ValueError, huggingface_hub's StrictDataclassClassValidationError
            raise ModelSpecError(f"invalid Llama config: {e}") from e
        cfg = self.config
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.layer_ids = layer_range(cfg.num_hidden_layers, stage_index, num_stages)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if self.is_first else None
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, layer_idx=i) for i in self.layer_ids)
        self.rotary_emb = LlamaRotaryEmbedding(cfg)  # buffers only
        self.norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps) if self.is_last else None
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if self.is_last else None
        self.activation_checkpointing = False  # --activation-checkpointing (set by the node)
        self.full_names = {name: self._full_name(name) for name, _ in self.named_parameters()}
        for name, p in self.named_parameters():
            _seeded_init(p, self.full_names[name], seed, cfg.initializer_range)

    def _full_name(self, name: str) -> str:
        if name.startswith("layers."):
            _, local, rest = name.split(".", 2)
            return f"model.layers.{self.layer_ids[int(local)]}.{rest}"
        return name if name.startswith("lm_head") else f"model.{name}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(x) if self.is_first else x
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(hidden, position_ids=positions)
        # activation checkpointing keeps only each layer's input; its activations are recomputed in the backward
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for layer in self.layers:
            run = partial(checkpoint, layer, use_reentrant=False) if recompute else layer
            # no mask: sdpa attention is then causal (is_causal), which is also what LlamaForCausalLM's own
            # create_causal_mask chooses for unpadded batches; it keeps us off masking_utils, whose
            # arguments change between transformers releases (past_key_values -> cache in 5.x)
            hidden = run(hidden, attention_mask=None, position_embeddings=position_embeddings, position_ids=positions)
        if self.is_last:
            return self.lm_head(self.norm(hidden))
        return hidden


def build_stage(spec: ModelSpec, seed: int, stage_index: int = 0, num_stages: int = 1) -> StageModule:
    """Build only stage ``stage_index`` of ``num_stages`` (the whole model when num_stages = 1)."""
    return StageModule(spec, stage_index, num_stages, seed)


def tensor_bytes(tensors) -> int:
    """Bytes held by an iterable of tensors (storage of each, counted once per tensor)."""
    return sum(t.numel() * t.element_size() for t in tensors)
