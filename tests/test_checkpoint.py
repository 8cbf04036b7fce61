"""Checkpoints of a real ReplicaState load with torch.load(weights_only=True), and a file that would run
code when unpickled is refused and skipped, not executed."""

from __future__ import annotations

import hashlib
import os
import pickle

import torch

from dilocox.checkpoint import load_latest_checkpoint, save_checkpoint


class Exploit:
    def __reduce__(self):
        return (os.system, ("touch /tmp/dilocox-checkpoint-exploit",))


def test_a_real_state_round_trips_with_weights_only(state, tmp_path):
    state.outer_step = 3
    save_checkpoint(tmp_path, 3, state.checkpoint_state())
    path, saved = load_latest_checkpoint(tmp_path)
    assert path.name == "step-00000003.pt"
    state.restore(saved)  # python and numpy RNG states come back too
    assert state.outer_step == 3


def test_a_checkpoint_that_would_run_code_is_skipped(state, tmp_path):
    marker = "/tmp/dilocox-checkpoint-exploit"
    if os.path.exists(marker):
        os.unlink(marker)
    state.outer_step = 1
    save_checkpoint(tmp_path, 1, state.checkpoint_state())
    evil = pickle.dumps({"outer_step": 2, "x": Exploit()})  # a valid sidecar: only the unpickling can refuse it
    (tmp_path / "step-00000002.pt").write_bytes(evil)
    (tmp_path / "step-00000002.pt.sha256").write_text(hashlib.sha256(evil).hexdigest())
    path, saved = load_latest_checkpoint(tmp_path)
    assert path.name == "step-00000001.pt" and not os.path.exists(marker)
    assert isinstance(saved["global_params"][0], torch.Tensor)


def test_saving_and_loading_a_large_state_holds_no_copy_of_it_in_python_memory(tmp_path):
    """torch.save streams into the file and the checksum is read in chunks: a 64 MB state must not make a
    64 MB bytes object (16 nodes of 25 M values ran out of memory with a BytesIO copy each)."""
    import tracemalloc

    big = dict(global_params=[torch.ones(16 << 20)])  # 64 MB
    tracemalloc.start()
    try:
        path = save_checkpoint(tmp_path, 1, big)
        _, peak_save = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        found = load_latest_checkpoint(tmp_path)
        _, peak_load = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert found is not None and found[0] == path and torch.equal(found[1]["global_params"][0], big["global_params"][0])
    assert path.with_name(path.name + ".sha256").read_text() == hashlib.sha256(path.read_bytes()).hexdigest()
    assert peak_save < 48 << 20 and peak_load < 48 << 20, (peak_save, peak_load)
