"""``python -m dilocox``: the same as ``dilocox-node``."""

import sys

from dilocox.daemon.cli import node_main

sys.exit(node_main())
