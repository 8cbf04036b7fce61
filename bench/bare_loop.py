"""A bare Hugging Face training loop of a dilocox model preset: the ceiling a node's inner loop is measured against.

``bench/gpu_check.sh`` runs it on the card its nodes use. What it runs: ``LlamaForCausalLM(LlamaConfig(**preset))``
(the preset's shape, dilocox/model.py), token batches drawn once and kept on the device (no data loading), the
forward under ``torch.autocast`` bf16 where the precision resolves to bf16 (``auto``: bf16 on a CUDA device with
native bf16, dilocox.diloco.resolve_precision), cross-entropy, backward, ``clip_grad_norm_`` (as the inner loop
does), AdamW (fused on CUDA), TF32 allowed on CUDA, and with ``--compile`` each decoder layer compiled as
``--compile`` does for a node. No outer step, no status board, no checkpoints.

Model FLOPs per token (PaLM, arXiv 2204.02311, appendix B): 6 N + 12 L T d, N the parameters that multiply
(all but the input embedding table, a lookup), L layers, T the sequence length, d the hidden size; the second
term is attention's QK^T and AV (2 T d multiply-adds each per layer and token, x3 for forward and backward),
counted over the full T x T square as the paper does. MFU = FLOPs per token x tokens/s / the card's dense peak
(``--peak-tflops``: 989 for an H100 SXM in bf16; an fp32 run through TF32 has half that).

Output: one JSON line (tokens/s, seconds per step, MFU, peak device memory in bytes, the FLOPs terms) on stdout,
and to ``--out``. Runs on CPU too (``--model tiny --device cpu``), where MFU is against whatever peak is given.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from dilocox.diloco import allow_tf32, compile_layers, resolve_precision, training_device
from dilocox.model import ModelSpec


def flops_per_token(llama: dict, seq_len: int) -> dict:
    """Training FLOPs per token of a LlamaConfig's fields at ``seq_len``: dict(params, matmul_params,
    attention, total), total = 6 matmul_params + attention, attention = 12 L T d (module docstring)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**llama))
    params = sum(p.numel() for p in model.parameters())
    matmul = params - model.model.embed_tokens.weight.numel()
    attention = 12 * llama["num_hidden_layers"] * seq_len * llama["hidden_size"]
    return dict(params=params, matmul_params=matmul, attention=attention, total=6 * matmul + attention)


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def run(model_name: str, device: str, precision: str, batch_size: int, seq_len: int, micro_batch_size: int,
        steps: int, warmup: int, compile_: bool, peak_tflops: float, seed: int = 0) -> dict:
    """Time ``steps`` optimizer steps after ``warmup`` untimed ones; the result dict (module docstring)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = ModelSpec.resolve(model_name)
    device = training_device(device)
    precision = resolve_precision(precision, device)
    batch_size, seq_len = batch_size or spec.batch_size, seq_len or spec.seq_len
    llama = {**spec.llama, "max_position_embeddings": max(seq_len, spec.llama.get("max_position_embeddings", 0))}
    cuda = torch.device(device).type == "cuda"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**llama)).to(device)
    if cuda:
        allow_tf32()
        torch.cuda.reset_peak_memory_stats(device)
    if compile_:
        compile_layers(model)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda or None)
    tokens = torch.randint(0, llama["vocab_size"], (batch_size, seq_len + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    m = micro_batch_size or batch_size
    times = []
    for step in range(warmup + steps):
        _sync(device)
        began = time.perf_counter()
        for a in range(0, batch_size, m):
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                logits = model(input_ids=x[a:a + m]).logits
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y[a:a + m].flatten())
            (loss * (min(m, batch_size - a) / batch_size)).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        if step >= warmup:
            times.append(time.perf_counter() - began)
    step_s = statistics.median(times)
    tokens_per_s = batch_size * seq_len / step_s
    flops = flops_per_token(llama, seq_len)
    peak_bytes = torch.cuda.max_memory_allocated(device) if cuda else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # CPU: the process's peak RSS
    return dict(loop="bare", model=model_name, device=device, card=torch.cuda.get_device_name(device) if cuda else
                "cpu", precision=precision, compile=compile_, batch_size=batch_size, seq_len=seq_len,
                micro_batch_size=micro_batch_size, steps=steps, step_s=step_s, tokens_per_second=tokens_per_s,
                mfu=flops["total"] * tokens_per_s / (peak_tflops * 1e12), peak_tflops=peak_tflops,
                flops_per_token=flops, peak_memory_bytes=int(peak_bytes), final_loss=float(loss.detach()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-150m", help="a dilocox preset (tiny, llama-150m, ...) or config file")
    ap.add_argument("--device", default="auto", help="cpu, cuda[:N] or auto")
    ap.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    ap.add_argument("--batch-size", type=int, default=0, help="sequences per step (default: the preset's)")
    ap.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (default: the preset's)")
    ap.add_argument("--micro-batch-size", type=int, default=0, help="sequences per forward (default: the batch)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps (the median is reported)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens there)")
    ap.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="the card's dense peak (H100 SXM bf16: 989)")
    ap.add_argument("--out", type=Path, help="also write the JSON line here")
    a = ap.parse_args(argv)
    result = run(a.model, a.device, a.precision, a.batch_size, a.seq_len, a.micro_batch_size, a.steps, a.warmup,
                 a.compile, a.peak_tflops)
    line = json.dumps(result, sort_keys=True)
    print(line, flush=True)
    if a.out:
        a.out.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
