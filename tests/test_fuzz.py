"""Property-based fuzzing of everything a node reads from outside: configuration, gRPC requests, gathered
metadata, downloaded states and checkpoint files. Each input either works or fails with the clear error
of its kind; nothing else escapes, and a server keeps serving.

Case counts: tests/conftest.py's profiles (``ci``: 100 per target; ``DILOCOX_FUZZ_PROFILE=long``, ``make
bench-fuzz``: 2,000 per target). The sparse decoder's fuzzer is in tests/test_sparse.py,
certificates' and revocation lists' in tests/test_admission.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import threading

import grpc
import pydantic.v1 as pydantic_v1
import pytest
import torch
from dilocox.daemon.config import ConfigError, NodeConfig, load_config
from dilocox.peers.allgather import screen_gathered
from hypothesis import given
from hypothesis import strategies as st

from dilocox.checkpoint import load_latest_checkpoint, save_checkpoint
from tests.fakes.node import FakeNode
from tests.fakes.transfer import transfer_for

FIELDS = sorted(NodeConfig.model_fields)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=True),
                    st.text(max_size=40), st.binary(max_size=8).map(lambda b: b.decode("latin-1")))
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=3), st.dictionaries(st.text(max_size=5), SCALARS, max_size=2))


@given(flags=st.dictionaries(st.sampled_from(FIELDS + ["no_such_field"]), VALUES, max_size=5),
       env=st.dictionaries(st.sampled_from([f"DILOCOX_{f.upper()}" for f in FIELDS] + ["DILOCOX_NOPE"]),
                           st.text(max_size=30), max_size=4))
def test_config_loader(flags, env):
    try:
        cfg = load_config(flags, env)
    except ConfigError as e:
        assert str(e)
        return
    assert isinstance(cfg, NodeConfig)


@pytest.fixture(scope="module")
def server():
    """A real status server (daemon/service.py) on a loop in a thread, with a fake node."""
    from dilocox.daemon.service import start_server

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    node = FakeNode()
    srv, port, _ = asyncio.run_coroutine_threadsafe(start_server(node, "127.0.0.1:0"), loop).result(30)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield channel, node
    channel.close()
    asyncio.run_coroutine_threadsafe(srv.stop(None), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)


METHODS = ["/dilocox.v1.Node/GetStatus", "/dilocox.v1.Node/ListPeers", "/dilocox.v1.Node/Leave",
           "/grpc.health.v1.Health/Check"]
ACCEPTED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL}


@given(method=st.sampled_from(METHODS), payload=st.binary(max_size=64))
def test_grpc_requests(server, method, payload):
    channel, node = server
    try:
        channel.unary_unary(method, request_serializer=None, response_deserializer=None)(payload, timeout=10)
        code = grpc.StatusCode.OK
    except grpc.RpcError as e:
        code = e.code()
    assert code in ACCEPTED, code
    # still serving
    channel.unary_unary(METHODS[0], request_serializer=None, response_deserializer=None)(b"", timeout=10)


GATHERED = st.dictionaries(
    st.text(min_size=1, max_size=8),
    st.one_of(VALUES, st.fixed_dictionaries({}, optional={
        "outer_step": SCALARS, "start_digest": SCALARS, "weight": SCALARS, "bandwidth_bps": SCALARS,
        "compute_s": SCALARS, "payload_sha256": st.one_of(SCALARS, st.just("ab" * 32)),
        "payload_bytes": SCALARS, "exclusion_votes": st.one_of(SCALARS, st.dictionaries(
            st.text(max_size=8), st.one_of(SCALARS, st.integers(-2, 200)), max_size=4)), "extra": SCALARS})),
    max_size=6)


@given(gathered=GATHERED, round_index=st.integers(0, 100), max_weight=st.floats(0, 1e6))
def test_gathered_metadata(gathered, round_index, max_weight):
    metas, announced, dropped, excluded = screen_gathered(gathered, round_index, max_weight, 1000)
    assert set(metas) == set(gathered)
    assert all(metas[p] is None and dropped[p] == why for p, why in excluded.items())
    assert set(announced) - set(dropped) <= {p for p, m in metas.items() if m is not None}
    for sha, size in announced.values():
        assert size <= 1000


META_FIELDS = ["run_id", "outer_step", "digest", "num_params", "donor_state", "donor_inner_step", "donor_round",
               "compression_rank", "compression_digest", "donor_peer_id"]


@given(data=st.data())
def test_downloaded_states(state, data):
    """Random metadata and tensors, and random edits of a real served state: validate() raises only the
    errors the sync loop catches (pydantic's ValidationError, ValueError)."""
    state.snapshot()
    meta, tensors = transfer_for(state).serve()
    meta, tensors = dict(meta), [t.clone() for t in tensors]
    for key in data.draw(st.lists(st.sampled_from(META_FIELDS + ["extra"]), max_size=3)):
        meta[key] = data.draw(VALUES)
    edits = data.draw(st.lists(st.tuples(st.integers(0, len(tensors) + 1), st.sampled_from(
        ["drop", "zeros", "nan", "shape", "scalar", "none"])), max_size=3))
    for at, how in edits:
        if at >= len(tensors) or tensors[at] is None:
            continue
        if how == "drop":
            del tensors[at]
        elif how == "zeros":
            tensors[at] = torch.zeros_like(tensors[at])
        elif how == "nan":
            tensors[at] = torch.full_like(tensors[at], float("nan"))
        elif how == "shape":
            tensors[at] = torch.zeros(3, 5)
        elif how == "scalar":
            tensors[at] = torch.tensor(1.0)
        else:
            tensors[at] = None
    try:
        transfer_for(state).validate(meta, tensors)
    except (pydantic_v1.ValidationError, ValueError):
        pass


GOOD_CHECKPOINT: dict = {}


@given(data=st.data())
def test_checkpoint_files(state, data, tmp_path_factory):
    """Random bytes, and random edits of a real checkpoint with a matching checksum sidecar: loading
    returns a good checkpoint, and restoring a loaded one raises only ValueError (daemon/node.py reports it
    and ignores the checkpoint), all or nothing."""
    directory = tmp_path_factory.mktemp("ckpt")
    if "good" not in GOOD_CHECKPOINT:  # one real checkpoint for every example
        state.outer_step = 1
        save_checkpoint(directory, 1, state.checkpoint_state())
        GOOD_CHECKPOINT["good"] = (directory / "step-00000001.pt").read_bytes()
    good = GOOD_CHECKPOINT["good"]
    (directory / "step-00000001.pt").write_bytes(good)
    (directory / "step-00000001.pt.sha256").write_text(hashlib.sha256(good).hexdigest())
    kind = data.draw(st.sampled_from(["random", "flip", "cut"]))
    if kind == "random":
        blob = data.draw(st.binary(max_size=2048))
    elif kind == "flip":
        b = bytearray(good)
        for at in data.draw(st.lists(st.integers(0, len(good) - 1), min_size=1, max_size=6)):
            b[at] ^= data.draw(st.integers(1, 255))
        blob = bytes(b)
    else:
        blob = good[:data.draw(st.integers(0, len(good) - 1))]
    (directory / "step-00000002.pt").write_bytes(blob)
    (directory / "step-00000002.pt.sha256").write_text(hashlib.sha256(blob).hexdigest())
    found = load_latest_checkpoint(directory)
    assert found is not None  # step 1 is still there
    path, saved = found
    try:
        state.restore(saved)
    except ValueError:  # what daemon/node.py reports before ignoring the checkpoint
        assert path.name == "step-00000002.pt"  # only a mutated file may fail to restore
    torch.load(io.BytesIO(good), weights_only=True)
