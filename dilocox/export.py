"""Hugging Face export: ``dilocox-ctl export CHECKPOINT_DIR... --hf OUT`` writes ``config.json``,
``model.safetensors`` and the tokenizer, which ``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` and
``AutoTokenizer.from_pretrained(OUT)`` load.

The weights are θ, the global parameters every replica holds (not one replica's local parameters), from the
newest good checkpoint of each directory (dilocox/checkpoint.py). A checkpoint of a text model carries its
``architecture`` (daemon/replica_state.py): the LlamaConfig fields, each parameter's Hugging Face name and the
tokenizer. Pipeline stages: give every stage's directory; their parameters are joined into one model, and
the stages must hold the same run and outer step and together every parameter exactly once.

Tokenizer: a BPE's tokenizer.json is copied (from ``--tokenizer`` or the path the checkpoint names, checked
against its SHA-256); a bytes model gets a tokenizer.json that maps text to the same ids (id = byte value,
dilocox/tokenizer.py's ``bytes_tokenizer_json``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from dilocox.checkpoint import load_latest_checkpoint
from dilocox.tokenizer import bytes_tokenizer_json, load_tokenizer


class ExportError(ValueError):
    """Checkpoints that cannot make one model (none found, no architecture, stages that do not fit)."""


def _stage_checkpoint(directory: Path) -> dict:
    found = load_latest_checkpoint(Path(directory))
    if found is None:
        raise ExportError(f"{directory}: no readable checkpoint (step-*.pt with a matching .sha256)")
    path, state = found
    arch = state.get("architecture") if isinstance(state, dict) else None
    if not arch:
        raise ExportError(f"{path}: no model architecture in it (an image or emulated workload, or written before "
                          f"checkpoints carried it)")
    params = state["global_params"]
    if len(arch["names"]) != len(params):
        raise ExportError(f"{path}: {len(params)} tensors for {len(arch['names'])} names")
    return dict(path=path, run=state.get("run_id"), step=int(state["outer_step"]), stage=state.get("stage", "0/1"),
                arch=arch, tensors=dict(zip(arch["names"], params)))


def join_stages(directories: list[Path]) -> tuple[dict, dict[str, torch.Tensor], int]:
    """(architecture, name -> fp32 tensor, outer_step) of one model from one or more stage checkpoints.
    Raises ExportError when runs, steps or architectures differ, or a parameter is missing or doubled."""
    parts = [_stage_checkpoint(d) for d in directories]
    first = parts[0]
    for p in parts[1:]:
        for key in ("run", "step"):
            if p[key] != first[key]:
                raise ExportError(f"{p['path']} is {key} {p[key]!r}, {first['path']} is {first[key]!r}: export "
                                  f"checkpoints of one run at one outer step")
        if p["arch"]["llama"] != first["arch"]["llama"]:
            raise ExportError(f"{p['path']} and {first['path']} hold different model configurations")
    tensors: dict[str, torch.Tensor] = {}
    for p in parts:
        doubled = tensors.keys() & p["tensors"].keys()
        if doubled:
            raise ExportError(f"{p['path']} repeats {sorted(doubled)[0]} (the same stage given twice?)")
        tensors.update(p["tensors"])
    stages = {p["stage"] for p in parts}
    total = int(first["stage"].split("/")[1])
    if len(stages) != total:
        raise ExportError(f"a model of {total} stages needs one checkpoint directory per stage; got stages "
                          f"{sorted(stages)}")
    return first["arch"], tensors, first["step"]


def export_hf(directories: list[Path], out: Path, tokenizer: Optional[str] = None) -> Path:
    """Write the Hugging Face model of the checkpoints in ``directories`` to ``out``; returns ``out``.
    ``tokenizer`` overrides the tokenizer.json path a checkpoint names (its SHA-256 must match). Raises
    ExportError (or TokenizerError) naming the problem."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    arch, tensors, step = join_stages(directories)
    config = LlamaConfig(**arch["llama"])
    config.architectures = ["LlamaForCausalLM"]
    tok = arch["tokenizer"]
    if tok.get("eot_id") is not None:
        config.eos_token_id = tok["eot_id"]
    with torch.device("meta"):
        expected = set(LlamaForCausalLM(config).state_dict())
    missing, extra = expected - tensors.keys(), tensors.keys() - expected
    if missing or extra:
        raise ExportError(f"the checkpoints do not make a LlamaForCausalLM: missing {sorted(missing)[:3]}, "
                          f"unexpected {sorted(extra)[:3]}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    save_file({k: v.detach().to(torch.float32).contiguous() for k, v in tensors.items()},
              str(out / "model.safetensors"), metadata=dict(format="pt", outer_step=str(step)))
    _write_tokenizer(tok, out, tokenizer)
    return out


def _write_tokenizer(tok: dict, out: Path, override: Optional[str]) -> None:
    loaded = load_tokenizer(override or tok["name"])  # "bytes" loads without a file
    if loaded.digest != tok["digest"]:
        raise ExportError(f"tokenizer {loaded.name} has SHA-256 {loaded.digest}; the model was trained with "
                          f"{tok['digest']} ({tok['name']}): pass the tokenizer it was trained with")
    text = bytes_tokenizer_json() if loaded.is_bytes else loaded.json_path().read_text(encoding="utf-8")
    eos = loaded.decode([loaded.eot_id]) if loaded.eot_id is not None else None
    (out / "tokenizer.json").write_text(text, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="PreTrainedTokenizerFast", eos_token=eos, model_max_length=int(1e9)), indent=1))
