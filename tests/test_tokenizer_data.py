"""Tokenizers (bytes or a trained byte-level BPE), data specs of any size (.jsonl, .jsonl.gz, prepared memmap
shards) and the vocabulary that follows the tokenizer: unit tests on files the tests write, and one swarm
test where a joiner with another tokenizer refuses (exit 2) and one with the same trains with the member."""

from __future__ import annotations

import argparse
import gzip
import json
import math
import re
import signal

import numpy as np
import pytest
import torch
from dilocox.daemon import ctl
from dilocox.daemon.config import add_flags, load_config

from dilocox.data import Corpus, DataError, ReplicaShard, iter_documents
from dilocox.diloco import InnerConfig
from dilocox.model import ModelSpec, ModelSpecError
from dilocox.shards import PreparedData, ShardedTokens, prepare, units
from dilocox.tokenizer import TokenizerError, byte_tokenizer, load_tokenizer, train_bpe
from dilocox.workload import make_workload
from tests.corpus import documents
from tests.helpers import FAST, LocalNode, digests_by_step, start


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return train_bpe(documents(200), 400, out)


def test_a_trained_bpe_round_trips_text_and_names_its_end_of_text(bpe, tmp_path):
    text = "the swarm trains — ünïcode too\n"
    ids = bpe.encode(text)
    assert ids.dtype == np.uint32 and len(ids) < len(text.encode())  # merges shorten common words
    assert bpe.decode(ids) == text and bpe.vocab_size == 400 and bpe.eot_id == 0
    # a folder holding tokenizer.json (as save_pretrained writes it) is the same tokenizer, same digest
    assert load_tokenizer(str(bpe.json_path().parent)).digest == bpe.digest
    other = train_bpe(documents(200, seed=1), 300, tmp_path / "other.json")
    assert other.digest != bpe.digest and other.vocab_size == 300
    with pytest.raises(TokenizerError, match="at least 258"):
        train_bpe(documents(2), 100, tmp_path / "x.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a Hugging Face tokenizer.json"):
        load_tokenizer(str(tmp_path / "bad.json"))
    with pytest.raises(TokenizerError, match="no such file"):
        load_tokenizer(str(tmp_path / "missing.json"))


def test_jsonl_and_gzip_documents_stream_with_clear_errors(tmp_path):
    docs = documents(5)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(docs[:3])))
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps({"body": d}) + "\n\n" for d in docs[3:]))
    assert list(iter_documents(str(tmp_path), "body")) == docs
    with pytest.raises(DataError, match=r"a.jsonl line 1: no string field 'text' \(--text-field\)"):
        list(iter_documents(str(tmp_path / "a.jsonl")))
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "ok"}) + "\n{oops\n")
    with pytest.raises(DataError, match="bad.jsonl line 2: not JSON"):
        list(iter_documents(str(tmp_path / "bad.jsonl")))
    (tmp_path / "notgz.jsonl.gz").write_text("plain")
    with pytest.raises(DataError, match="cannot read data file .*notgz.jsonl.gz"):
        list(iter_documents(str(tmp_path / "notgz.jsonl.gz")))


def test_units_cut_at_line_ends_and_keep_every_character():
    doc = "".join(f"line {i} " * (i % 7 + 1) + "\n" for i in range(2000))
    pieces = list(units(doc, limit=1000))
    assert "".join(pieces) == doc and all(len(p) <= 1000 for p in pieces) and len(pieces) > 10
    assert all(p.endswith("\n") for p in pieces)
    assert list(units("x" * 2500, limit=1000)) == ["x" * 1000, "x" * 1000, "x" * 500]  # one long line


def test_prepared_shards_pack_documents_and_read_back_by_memmap(bpe, tmp_path):
    docs = documents(60)
    index = prepare(iter(docs), bpe, tmp_path / "p", val_fraction=0.1, shard_tokens=500)
    train, val = index["splits"]["train"], index["splits"]["val"]
    assert index["dtype"] == "uint16" and len(train["shards"]) > 3  # 500-token files
    # every 10th document held out; each document followed by <|endoftext|>
    want_train = np.concatenate([np.append(bpe.encode(d), 0) for i, d in enumerate(docs) if i % 10 != 9])
    data = PreparedData.open(tmp_path / "p", bpe)
    assert len(data.train) == train["tokens"] == len(want_train)
    assert np.array_equal(data.train[0:len(data.train)], want_train)
    assert np.array_equal(data.train[480:1030], want_train[480:1030])  # a slice across three files
    assert val["bytes"] == sum(len(d.encode()) for i, d in enumerate(docs) if i % 10 == 9)
    # the same spec prepared again gives the same bytes (every node can prepare its own copy)
    prepare(iter(docs), bpe, tmp_path / "q", val_fraction=0.1, shard_tokens=500)
    assert (tmp_path / "p" / "val-00000.bin").read_bytes() == (tmp_path / "q" / "val-00000.bin").read_bytes()
    # replica windows come out of the memmap like out of an array
    shard = ReplicaShard(data.train, 32, 4, seed=1, shard_key=2)
    x, y = shard.next_batch()
    assert x.shape == (4, 32) and torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < bpe.vocab_size


def test_a_prepared_folder_refuses_another_tokenizer_and_a_cut_shard(bpe, tmp_path):
    prepare(iter(documents(40)), bpe, tmp_path / "p", val_fraction=0.1)
    with pytest.raises(DataError, match=r"was tokenized with .*tokenizer.json.*pass --tokenizer"):
        Corpus.from_spec(str(tmp_path / "p"), 32, tokenizer=byte_tokenizer())
    shard = tmp_path / "p" / "train-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-6])
    with pytest.raises(DataError, match="train-00000.bin holds .* bytes, the index says"):
        Corpus.from_spec(str(tmp_path / "p"), 32, tokenizer=bpe)
    (tmp_path / "p" / "index.json").write_text("[]")
    with pytest.raises(DataError, match="index.json is not dilocox-shards/1"):
        Corpus.from_spec(str(tmp_path / "p"), 32, tokenizer=bpe)
    with pytest.raises(Exception, match="too little text"):
        prepare(iter(["one short document"]), bpe, tmp_path / "r")


def test_memmap_reads_stay_in_bounds_for_uint32_vocabularies(tmp_path):
    mm = np.arange(10, dtype="<u4")
    (tmp_path / "t.bin").write_bytes(mm.tobytes())
    seq = ShardedTokens(tmp_path, dict(shards=[dict(file="t.bin", tokens=10)]), "uint32")
    assert np.array_equal(seq[3:20], mm[3:]) and len(seq[10:12]) == 0
    with pytest.raises(TypeError):
        seq[5]


def test_the_vocabulary_follows_the_tokenizer(bpe, tmp_path):
    assert ModelSpec.resolve("tiny", bpe.vocab_size).llama["vocab_size"] == 400
    (tmp_path / "m.json").write_text(json.dumps(dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                     num_attention_heads=2, vocab_size=256)))
    assert ModelSpec.resolve(str(tmp_path / "m.json"), 400).llama["vocab_size"] == 400  # the tokenizer's wins
    # a Hugging Face config.json as save_pretrained writes it is a model file too
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                vocab_size=32000).save_pretrained(tmp_path / "hf")
    spec = ModelSpec.resolve(str(tmp_path / "hf" / "config.json"), 400)
    assert spec.llama["vocab_size"] == 400 and spec.llama["num_hidden_layers"] == 3
    (tmp_path / "bad.json").write_text(json.dumps(dict(hidden_size=30, num_attention_heads=4)))
    with pytest.raises(ModelSpecError):
        make_workload(str(tmp_path / "bad.json"), "builtin:shakespeare", None, None, 1).build(0, 0, 1)


@pytest.mark.parametrize("preset", ["llama-20m", "llama-150m", "llama-1b"])
def test_presets_have_openDiLoCo_shapes_and_split_into_stages(preset):
    """Built on the meta device (no memory): parameter counts with Mistral's 32000-token vocabulary, and every
    stage split of the layers covers each layer once."""
    from dilocox.stages import StageModule, layer_range

    spec = ModelSpec.resolve(preset, 32000)
    with torch.device("meta"):
        stages = [StageModule(spec, k, 2, seed=0) for k in range(2)]
    total = sum(p.numel() for s in stages for p in s.parameters())
    expected = {"llama-20m": 38.7e6, "llama-150m": 215.0e6, "llama-1b": 1100.0e6}[preset]
    assert abs(total - expected) / expected < 0.01, total
    layers = spec.llama["num_hidden_layers"]
    assert sorted(i for k in range(2) for i in layer_range(layers, k, 2)) == list(range(layers))


def test_a_tiny_model_learns_bpe_tokens_from_prepared_shards(bpe, tmp_path):
    """In-process: the text workload on prepared shards; validation loss (nats/token and bits/byte) falls."""
    prepare(iter(documents(300)), bpe, tmp_path / "p")
    w = make_workload("tiny", str(tmp_path / "p"), None, None, 2, tokenizer=bpe)
    model = w.build(seed=0, stage_index=0, num_stages=1)
    assert model.lm_head.out_features == 400
    loop = w.inner_loop(model, InnerConfig(lr=3e-3, warmup_steps=5, total_steps=200))
    shard, val = w.shard(seed=0, shard_key=1), w.val_batches()

    def bpb():
        return w.corpus.bits_per_byte(loop.evaluate(val))

    before = bpb()
    for step in range(60):
        loop.inner_step(*shard.next_batch(), global_step=step)
    after = bpb()
    assert math.isfinite(after) and after < before - 0.5, (before, after)
    assert 1.5 < w.corpus.val_bytes_per_token < 8  # BPE merges: several bytes per token


def test_ctl_trains_a_tokenizer_and_prepares_data(tmp_path, capsys):
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(80)))
    tok = tmp_path / "tok" / "tokenizer.json"
    assert ctl.main(["tokenizer", "train", str(tmp_path / "c.jsonl"), "--vocab-size", "300", "-o", str(tok)]) == 0
    assert "300 ids" in capsys.readouterr().out
    assert ctl.main(["data", "prepare", str(tmp_path / "c.jsonl"), "--tokenizer", str(tok.parent),
                     "-o", str(tmp_path / "d")]) == 0
    assert re.search(r"wrote .*: [\d,]+ train and [\d,]+ validation tokens \(uint16", capsys.readouterr().out)
    assert ctl.main(["data", "prepare", str(tmp_path / "missing"), "-o", str(tmp_path / "e")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert ctl.main(["data", "prepare", str(tmp_path / "c.jsonl"), "--tokenizer", str(tmp_path / "nope.json"),
                     "-o", str(tmp_path / "e")]) == 2


def test_the_tokenizer_joins_the_swarm_settings(bpe, tmp_path):
    def cfg(*flags):
        parser = argparse.ArgumentParser()
        add_flags(parser)
        return load_config(vars(parser.parse_args(list(flags))), {})

    base = cfg()
    assert "tokenizer" not in base.swarm_settings()  # bytes: settings unchanged from before tokenizers
    ours = cfg("--tokenizer", str(bpe.json_path()))
    assert f"tokenizer=sha256:{bpe.digest}" in ours.swarm_settings()
    assert ours.settings_digest() != base.settings_digest()
    with pytest.raises(Exception, match="cannot read .*missing.json"):
        cfg("--tokenizer", str(tmp_path / "missing.json"))


@pytest.mark.integration
@pytest.mark.swarm  # 44 s: test-swarm (make test's budget)
def test_a_joiner_with_another_tokenizer_refuses_and_one_with_ours_trains_along(bpe, tmp_path):
    prepare(iter(documents(300)), bpe, tmp_path / "data")
    other = train_bpe(documents(100, seed=3), 300, tmp_path / "other.json")
    args = FAST + ["--run-id", "tok", "--checkpoint-every", "1", "--tokenizer", str(bpe.json_path()),
                   "--data", str(tmp_path / "data")]
    a = start(tmp_path, "a", args)
    nodes = [a]
    try:
        x = LocalNode("x", tmp_path / "x", args[:-4] + ["--tokenizer", str(other.json_path()),
                                                         "--data", str(tmp_path / "data"), "--join", a.join_maddr])
        # its own data check fails first (the folder holds another tokenizer's ids): exit 2, named
        assert x.proc.wait(60) == 2 and "was tokenized with" in x.log_tail(), x.log_tail()
        x = LocalNode("x2", tmp_path / "x2", FAST + ["--run-id", "tok", "--tokenizer", str(other.json_path()),
                                                     "--join", a.join_maddr])
        assert x.proc.wait(90) == 2, x.log_tail()
        assert re.search(r"not joining: .* run swarm settings [0-9a-f]{16}; ours are .*tokenizer=sha256:"
                         + other.digest, x.log_tail()), x.log_tail()
        b = start(tmp_path, "b", args + ["--join", a.join_maddr])
        nodes.append(b)
        for n in (a, b):
            n.wait_for(lambda p: [r for r in p.metrics() if r["outcome"] == "applied" and r["group_size"] == 2], 120,
                       "a round applied together")
        assert all(len(d) == 1 for d in digests_by_step(nodes).values())
        rows = [r for r in a.metrics() if math.isfinite(r["val_loss"])]
        assert rows and all(r["val_bits_per_byte"] < r["val_loss"] / math.log(2) for r in rows), rows
        # the node's own checkpoint exports to a model transformers loads, holding theta of its outer step
        from safetensors import safe_open
        from transformers import AutoModelForCausalLM

        assert ctl.main(["export", str(a.workdir / "ckpt"), "--hf", str(tmp_path / "hf")]) == 0
        with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
            step = int(f.metadata()["outer_step"])
        assert step >= 1 and AutoModelForCausalLM.from_pretrained(tmp_path / "hf").config.vocab_size == 400
    finally:
        for n in nodes:
            n.terminate(signal.SIGKILL)


def test_parquet_saved_datasets_and_hf_specs_stream_their_text_field(tmp_path):
    """Parquet files (pyarrow writes them here), a save_to_disk folder, and hf:PATH, which takes the same
    load_dataset(..., streaming=True) path as hf:NAME from the hub (a local folder stands in for a hub repo)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = documents(30)
    (tmp_path / "pq").mkdir()
    for k in range(3):
        pq.write_table(pa.table({"content": docs[10 * k:10 * k + 10], "n": list(range(10))}),
                       tmp_path / "pq" / f"part-{k}.parquet")
    assert list(iter_documents(str(tmp_path / "pq"), "content")) == docs
    assert list(iter_documents(str(tmp_path / "pq" / "part-1.parquet"), "content")) == docs[10:20]
    assert list(iter_documents(f"hf:{tmp_path / 'pq'}", "content")) == docs
    with pytest.raises(DataError, match=r"row 1: no string field 'text' \(--text-field\); it has \['content', 'n'\]"):
        list(iter_documents(str(tmp_path / "pq")))
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "saved"))
    assert list(iter_documents(str(tmp_path / "saved"))) == docs
    datasets.DatasetDict(train=datasets.Dataset.from_dict({"text": docs[:5]})).save_to_disk(str(tmp_path / "dd"))
    assert list(iter_documents(str(tmp_path / "dd"))) == docs[:5]
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match="cannot read data .*bad.parquet"):
        list(iter_documents(str(tmp_path / "bad.parquet")))
    # and a node's corpus from parquet, through the tokenizer, in memory
    corpus = Corpus.from_spec(str(tmp_path / "pq"), 32, text_field="content")
    assert len(corpus.train) + len(corpus.val) == sum(len(d.encode()) for d in docs)


def test_drawing_windows_leaves_no_corpus_pages_in_the_process(tmp_path):
    """A node's resident memory must not grow with the corpus: after 500 batches of random windows from a
    prepared corpus of 16 M tokens, none of its pages stay mapped into this process (smaps' Rss)."""
    from bench.scale import _fake_prepared

    _fake_prepared(tmp_path / "c", 16_000_000)
    corpus = Corpus.from_spec(str(tmp_path / "c"), 256)
    shard = ReplicaShard(corpus.train, 256, 8, seed=0, shard_key=1)
    for _ in range(500):
        shard.next_batch()
    mapped_kb, current = 0, None
    for line in open("/proc/self/smaps"):
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            current = line.split()[-1]
        elif line.startswith("Rss:") and current and str(tmp_path / "c") in current:
            mapped_kb += int(line.split()[1])
    assert mapped_kb < 1024, mapped_kb


def test_data_parts_give_replicas_disjoint_deterministic_streams():
    tokens = np.arange(100_000, dtype=np.uint32)  # a token's value is its position
    seen = []
    for key in range(4):
        shard = ReplicaShard(tokens, 32, 8, seed=3, shard_key=key, parts=4)
        x = torch.cat([shard.next_batch()[0] for _ in range(50)])
        assert int(x.min()) >= 25_000 * key and int(x.max()) < 25_000 * (key + 1)
        seen.append(x)
        again = ReplicaShard(tokens, 32, 8, seed=3, shard_key=key, parts=4)
        again.position = 10  # resumed from a checkpoint's position
        assert torch.equal(again.next_batch()[0], x[80:88])
    whole = ReplicaShard(tokens, 32, 8, seed=3, shard_key=1)  # parts=1: the whole stream, as before
    assert int(torch.cat([whole.next_batch()[0] for _ in range(50)]).max()) > 50_000
    with pytest.raises(DataError, match="--data-parts 5000: part 1 holds 20 tokens"):
        ReplicaShard(tokens, 32, 8, seed=3, shard_key=1, parts=5000)
