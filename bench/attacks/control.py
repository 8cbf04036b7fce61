"""A lie about SCAFFOLD's client control variate (``--outer-algorithm scaffold``): ``CraftedControl`` replaces its
c_i after each round's option-II update with 2 c_i + 0.01 (BadSFL, arXiv 2411.16167, tampers with the control
variates it reports; here the lie steers the liar's own next rounds through the correction c - c_i). Every round it
sends stays consistent with the c_i it commits, so its contribution links hold; the next commitment's c_i is not
what option II left, which an audit of SCAFFOLD's rounds checks (dilocox/audit.py, the control-variate link)."""

from __future__ import annotations

import torch
from dilocox.daemon.redteam import Attack


class CraftedControl(Attack):
    name = "crafted-control-variate"

    def bind(self, state) -> None:
        super().bind(state)
        if state.control is None:
            raise ValueError("crafted-control-variate needs --outer-algorithm scaffold")

    def pseudo_gradient(self, tensors: list[torch.Tensor], round_index: int) -> list[torch.Tensor]:
        control = self.state.control  # c_i was just updated from this pseudo-gradient (option II)
        control.c_i = [2.0 * c + 0.01 for c in control.c_i]
        return tensors
