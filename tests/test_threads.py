"""dilocox/threads.py: torch's CPU threads go to the training thread alone; every other thread runs torch ops on one
thread (no OpenMP team of its own), whatever order the threads start in."""

import json
import os
import subprocess
import sys

import pytest

from dilocox import threads

pytestmark = pytest.mark.integration  # a fresh interpreter: torch's thread settings are process-wide

PROBE = r"""
import json, threading, torch
from dilocox import threads
threads.single_threaded_default()
seen = {"main": torch.get_num_threads()}
def training():
    seen["training"] = threads.claim_for_training(3)
    done.wait()
    seen["training_after"] = torch.get_num_threads()
def helper(name):
    seen[name] = torch.get_num_threads()
done = threading.Event()
t = threading.Thread(target=training); t.start()
while "training" not in seen: pass
for name in ("comm", "codec"):
    h = threading.Thread(target=helper, args=(name,)); h.start(); h.join()
done.set(); t.join()
print(json.dumps(seen))
"""


def test_only_the_training_thread_takes_torch_threads():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "4"})
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen == dict(main=1, training=3, comm=1, codec=1, training_after=3), seen


def test_the_cpu_budget_follows_omp_num_threads(monkeypatch):
    monkeypatch.setattr(threads, "_budget", None)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.cpu_budget() == 3
    monkeypatch.setattr(threads, "_budget", None)
    monkeypatch.setenv("OMP_NUM_THREADS", "junk")
    assert threads.cpu_budget() == len(os.sched_getaffinity(0))
    monkeypatch.setattr(threads, "_budget", None)
