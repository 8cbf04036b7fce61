"""The red-team hook: a malicious node is the real daemon with one ``Attack`` plugged in.

``dilocox-node --attack MODULE:CLASS`` (also ``DILOCOX_ATTACK``) imports CLASS, a subclass of
``Attack``, and calls its methods where an attacker running a modified copy of the daemon could
change what it sends. Every method defaults to "change nothing", so an attack overrides only what
it needs; bench/attacks/ holds one small file per attack (docs/security.md). A node started with
an attack says so in its log and in ``NodeStatus.attack``: it is a test tool, never a setting for
a real swarm.
"""

from __future__ import annotations

import importlib
import logging
from typing import Optional

import torch

logger = logging.getLogger(__name__)


class AttackError(ValueError):
    """``--attack`` does not name an importable Attack subclass."""


class Attack:
    """Override the hooks an attack needs; each receives what the honest code would send.

    ``cfg`` is the node's NodeConfig (read-only)."""

    name = "attack"

    def __init__(self, cfg) -> None:
        self.cfg = cfg

    def pseudo_gradient(self, tensors: list[torch.Tensor], round_index: int) -> list[torch.Tensor]:
        """The round's pseudo-gradient (CPU fp32, parameter shapes) before it is compressed and sent."""
        return tensors

    def gather(self, fields: dict, round_index: int) -> dict:
        """The metadata all-gathered in matchmaking (RoundGather fields, payload digest and length)."""
        return fields

    def contribution(self, payload: bytes, round_index: int) -> bytes:
        """Our sparse contribution as announced (digest, length) and served to every group-mate."""
        return payload

    def payload(self, payload: bytes, requester: str, key: str) -> bytes:
        """The contribution bytes served to group-mate ``requester`` (sparse rounds; after
        ``contribution``): serving different bytes to different peers is equivocation."""
        return payload

    def batch(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One training batch (text: int64 [batch, seq]; images: uint8 [batch, 28, 28] and int64 labels)
        before the inner step: data poisoning."""
        return inputs, targets

    def bind(self, state) -> None:
        """Called once the node's daemon.replica_state.ReplicaState exists: an attack may read theta
        (``state.outer.global_params``), SCAFFOLD's control variates (``state.control``) and the schedule."""
        self.state = state

    def training_loss(self, model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                      loss_fn) -> torch.Tensor:
        """The loss the inner step minimizes; the honest one is ``loss_fn(model, inputs, targets)``."""
        return loss_fn(model, inputs, targets)


def load_attack(spec: Optional[str], cfg) -> Optional[Attack]:
    """Import ``MODULE:CLASS`` and build it with ``cfg``; None for no spec. Raises AttackError."""
    if not spec:
        return None
    module_name, _, class_name = spec.partition(":")
    if not module_name or not class_name:
        raise AttackError(f"attack {spec!r} must be MODULE:CLASS")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise AttackError(f"attack {spec!r} cannot be loaded: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, Attack)):
        raise AttackError(f"attack {spec!r} is not a subclass of dilocox.daemon.redteam.Attack")
    attack = cls(cfg)
    logger.warning("RED TEAM: this node runs attack %s (%s); it is a test tool, not a swarm member",
                   attack.name, spec)
    return attack
