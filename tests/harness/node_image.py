"""The image that locally forked nodes share (tests/harness/localswarm.py, ``LocalNode(forked=True)``).

multiprocessing's forkserver imports this module once (``set_forkserver_preload``); every node it forks
then starts from these pages copy-on-write instead of importing torch, hivemind and the daemon again.
Importing is all it does: no thread, socket, event loop or tensor work may exist before a fork.
"""

import os

# torch's OpenMP pool reads this when the library loads: one thread per node, as node_env() gives a subprocess
os.environ["OMP_NUM_THREADS"] = "1"

import dilocox.daemon.cli  # noqa: E402,F401  first: it sets the environment defaults hivemind reads on import
import dilocox.daemon.metrics  # noqa: E402,F401
import dilocox.daemon.node  # noqa: E402,F401
import dilocox.peers.lifecycle  # noqa: E402
import hivemind  # noqa: E402,F401
import torch  # noqa: E402,F401
import torch._dynamo  # noqa: E402,F401  what torch.optim's first step imports (with sympy)

dilocox.peers.lifecycle.before_fork()
