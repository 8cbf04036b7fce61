"""The Python parts of bench/gpu_check.sh on CPU: the bare transformers loop (bench/bare_loop.py) on the tiny model,
its FLOPs count, and the report (bench/gpu_report.py) over metrics.jsonl records."""

from __future__ import annotations

import json

import pytest

from bench import bare_loop, gpu_report
from dilocox.model import ModelSpec


def test_flops_per_token_counts_multiplying_parameters_and_attention():
    llama = ModelSpec.resolve("llama-150m").llama
    f = bare_loop.flops_per_token(llama, 1024)
    d, layers = llama["hidden_size"], llama["num_hidden_layers"]
    assert f["params"] - f["matmul_params"] == llama["vocab_size"] * d  # the input embedding is a lookup
    assert f["attention"] == 12 * layers * 1024 * d
    assert f["total"] == 6 * f["matmul_params"] + f["attention"]


def test_the_bare_loop_trains_the_tiny_model_on_cpu(tmp_path):
    out = tmp_path / "bare.json"
    assert bare_loop.main(["--model", "tiny", "--device", "cpu", "--steps", "3", "--warmup", "1",
                           "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert (r["device"], r["precision"], r["batch_size"], r["seq_len"]) == ("cpu", "fp32", 8, 64)
    assert r["tokens_per_second"] > 0 and 0 < r["mfu"] < 1 and r["peak_memory_bytes"] > 0
    assert r["final_loss"] < 6  # ln 256 = 5.5 at the start


def _row(digest: str, compute_s: float, **phases) -> dict:
    return dict(compute_s=compute_s, digest=digest, device_peak_bytes=2**30, tokens_per_second=1.0,
                **{k: phases.get(k, 0.1) for k in gpu_report.PHASES})


def test_the_report_reads_each_nodes_rounds_after_the_first(tmp_path, capsys):
    for node in ("n0", "n1"):
        (tmp_path / node).mkdir()
        rows = [_row("aaaa1111", 9.0), _row("bbbb2222", 2.0, wait_s=0.5), _row("cccc3333", 2.0, wait_s=0.5)]
        (tmp_path / node / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "bare.json").write_text(json.dumps(dict(card="cpu", precision="fp32", compile=False, mfu=0.5,
                                                        tokens_per_second=4096.0, peak_memory_bytes=2**30)))
    s = gpu_report.report(tmp_path, "tiny", 8, 64, 10, 989.0)
    n0 = s["nodes"]["n0"]
    assert n0["tokens_per_second"] == pytest.approx(10 * 8 * 64 / 2.0)  # round 1 (compilation) left out
    assert n0["wait_fraction"] == pytest.approx(0.25) and n0["digests"] == ["aaaa1111", "bbbb2222", "cccc3333"]
    flops = bare_loop.flops_per_token(ModelSpec.resolve("tiny").llama, 64)["total"]
    assert n0["mfu"] == pytest.approx(flops * 2560 / 989e12)
    assert json.loads((tmp_path / "summary.json").read_text())["nodes"]["n1"]["rounds"] == 3
    printed = capsys.readouterr().out
    assert "node n0: 3 rounds, 2,560 tokens/s" in printed and "node n1 / bare loop: 0.62" in printed
