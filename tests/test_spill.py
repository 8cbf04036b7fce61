"""peers/spill.py: served payloads kept in unlinked files, mapped read-only, and served as they are."""

import mmap

import torch
from dilocox.peers.spill import Spill

from dilocox.catchup import AppliedUpdate, decode, encode, write


def test_a_kept_payload_reads_back_as_written_and_leaves_no_file(tmp_path):
    spill = Spill(tmp_path / "served")
    kept = spill.keep(lambda f: f.write(b"x" * 100_000 + b"end"))
    assert isinstance(kept, mmap.mmap) and len(kept) == 100_003
    assert kept[:3] == b"xxx" and kept[-3:] == b"end" and kept[99_999:100_003] == b"xend"
    assert list((tmp_path / "served").iterdir()) == []  # unlinked at once: nothing left if the node dies
    assert spill.keep(lambda f: None) == b""  # an empty file cannot be mapped


def test_an_update_written_to_a_spill_decodes_as_its_encoding():
    shapes = [(3, 4), (5,)]
    aggregate = [torch.zeros(3, 4), torch.arange(5, dtype=torch.float32)]
    aggregate[0][1, 2] = -0.5
    update = AppliedUpdate(7, "a" * 16, "b" * 16, 3, aggregate, outsized=True)
    kept = Spill().keep(lambda f: write(update, f))
    assert bytes(kept) == encode(update)
    back = decode(bytes(kept), shapes)
    assert back.outer_step == 7 and back.outsized and all(torch.equal(a, b) for a, b in zip(back.aggregate, aggregate))
