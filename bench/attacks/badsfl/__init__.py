"""BadSFL (arXiv 2411.16167) against SCAFFOLD on label-sharded Fashion-MNIST, with the daemon's own code.

``python -m bench.attacks.badsfl.run``: the benchmark (sim.py: the in-process federation; attacks.py: the
attacker clients; run.py: the settings side by side). plugin.py: the same attack on a real node
(``dilocox-node --attack bench.attacks.badsfl.plugin:BadSFL``) and a 4-node runner.
"""
