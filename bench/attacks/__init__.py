"""Red-team attacks: each is a ``dilocox.daemon.redteam.Attack`` subclass a real node loads with
``--attack bench.attacks.MODULE:CLASS`` (docs/security.md). One small file per attack."""
