"""dilocox-ctl export: checkpoints of one or more stages to a Hugging Face model that transformers loads and
that computes what the node computes; a bytes model's tokenizer.json; refusals named with exit 2."""

from __future__ import annotations

import pytest
import torch
from dilocox.daemon import ctl

from dilocox.model import ModelSpec
from dilocox.tokenizer import byte_tokenizer, train_bpe
from tests.corpus import documents


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return train_bpe(documents(200), 400, tmp_path_factory.mktemp("tok") / "tokenizer.json")


def _stage_checkpoints(tmp_path, tok, stages):
    """What nodes of ``stages`` stages write: theta of each stage and its architecture, via ReplicaState's
    checkpoint format (global_params in module order + names)."""
    from dilocox.checkpoint import save_checkpoint
    from dilocox.workload import TextWorkload

    spec = ModelSpec.resolve("tiny", tok.vocab_size)
    w = TextWorkload(spec, None, 64, 8, 1, tokenizer=tok)
    dirs = []
    for k in range(stages):
        module = w.build(seed=5, stage_index=k, num_stages=stages)
        d = tmp_path / f"stage{k}"
        save_checkpoint(d, 3, dict(run_id="r", model="tiny", stage=f"{k}/{stages}", outer_step=3,
                                   global_params=[p.detach().clone() for p in module.parameters()],
                                   architecture=w.architecture(module)))
        dirs.append(d)
    return spec, dirs


@pytest.mark.parametrize("stages", [1, 2])
def test_export_loads_in_transformers_and_computes_what_the_node_computes(bpe, tmp_path, stages):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dilocox.stages import build_stage

    spec, dirs = _stage_checkpoints(tmp_path, bpe, stages)
    out = tmp_path / "hf"
    assert ctl.main(["export", *map(str, dirs), "--hf", str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("the swarm trains", return_tensors="pt").input_ids
    assert ids[0].tolist() == bpe.encode("the swarm trains").tolist()
    ours = build_stage(spec, seed=5)  # the whole model, same seed: the joined stages' weights
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, ours(ids), atol=1e-5)
    generated = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert generated.shape == (1, ids.shape[1] + 5)
    assert tokenizer.eos_token == "<|endoftext|>"


def test_export_of_a_bytes_model_reads_bytes_and_refuses_what_does_not_fit(tmp_path, bpe):
    from transformers import AutoTokenizer

    _, dirs = _stage_checkpoints(tmp_path, byte_tokenizer(), 1)
    assert ctl.main(["export", str(dirs[0]), "--hf", str(tmp_path / "hf")]) == 0
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer("héllo").input_ids == list("héllo".encode())
    # half of a two-stage model, or a tokenizer other than the one trained with: exit 2, named
    _, halves = _stage_checkpoints(tmp_path / "two", bpe, 2)
    assert ctl.main(["export", str(halves[0]), "--hf", str(tmp_path / "x")]) == 2
    _, one = _stage_checkpoints(tmp_path / "one", bpe, 1)
    other = train_bpe(documents(50, seed=4), 300, tmp_path / "o.json")
    assert ctl.main(["export", str(one[0]), "--hf", str(tmp_path / "y"), "--tokenizer", str(other.json_path())]) == 2
    assert ctl.main(["export", str(tmp_path / "empty"), "--hf", str(tmp_path / "z")]) == 2
