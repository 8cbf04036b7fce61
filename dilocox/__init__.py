"""dilocox: peer-to-peer DiLoCo/DiLoCoX pre-training.

Installed, the distribution is one namespace: ``dilocox`` (the algorithm: model, data, inner and
outer optimization; no sockets, no event loop), ``dilocox.peers`` (the swarm as seen from one node),
``dilocox.daemon`` (the process a volunteer runs) and ``dilocox.proto`` (the gRPC API). The
repository keeps those as the top-level folders ``dilocox/``, ``peers/``, ``daemon/`` and ``proto/``;
pyproject.toml's package-dir maps them into this namespace in the wheel, and in a checkout the
repository root is added to this package's search path (below) so the same imports work there.
``__version__`` is the one place the version is written (pyproject.toml reads it).
"""

import os as _os

__version__ = "0.2.0"

# A checkout: daemon/, peers/ and proto/ sit beside this folder; let dilocox.daemon & co. find them there,
# exactly where the wheel puts them (site-packages/dilocox/daemon, ...). Nothing else is on that path.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isdir(_os.path.join(_root, "daemon")):
    __path__.append(_root)
