"""kill -9 while a checkpoint is being written always leaves a loadable, self-consistent checkpoint."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time

import torch

from dilocox.checkpoint import load_latest_checkpoint

WRITER = """
import sys, torch
from pathlib import Path
from dilocox.checkpoint import save_checkpoint
directory, start = Path(sys.argv[1]), int(sys.argv[2])
step = start
while True:  # 16 MB per checkpoint so that a kill often lands inside a write
    save_checkpoint(directory, step, {"outer_step": step, "w": torch.full((4_000_000,), float(step))})
    print(step, flush=True)
    step += 1
"""


def test_sigkill_during_checkpoint_writes_leaves_a_loadable_one(tmp_path):
    rng = random.Random(5)
    step = 1
    for trial in range(6):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(step)],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == str(step)  # one complete checkpoint of this writer at least
        time.sleep(rng.uniform(0.0, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        found = load_latest_checkpoint(tmp_path)
        assert found is not None, f"trial {trial}: nothing loadable"
        path, state = found
        assert state["outer_step"] >= step
        assert torch.equal(state["w"], torch.full((4_000_000,), float(state["outer_step"])))
        assert path.name == f"step-{state['outer_step']:08d}.pt"
        step = state["outer_step"] + 1
    # torn temporary files were never picked up; the next good write removes them
    from dilocox.checkpoint import save_checkpoint

    save_checkpoint(tmp_path, step, {"outer_step": step})
    assert not list(tmp_path.glob(".*.tmp-*"))
    assert len(list(tmp_path.glob("step-*.pt"))) == 3
