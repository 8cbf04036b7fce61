"""Lossless narrowing wire codec for hivemind averaging: integer codes travel as uint8 / int16.

hivemind sends each tensor part with the averager's ``CompressionBase`` and the reducer answers
with ``mean - part`` serialized by the *stock* codec of the same ``CompressionType``
(hivemind/averaging/allreduce.py, compression/serialization.py: a fixed registry). Any lossy
codec would therefore give every peer a different mean. This codec keeps type ``NONE`` (whose
stock decoder reads the dtype named in the message) and picks, per part, the narrowest dtype that
holds every value exactly: uint8 when all values are integers in [0, 255] (dilocox.quantize's
8-bit codes), int16 for integers in [-32768, 32767] (16-bit codes), else float32. The reducer
accumulates in fp32 whatever dtype arrives, and answers in fp32, so nothing is ever rounded.
"""

from __future__ import annotations

import torch
from hivemind.compression import CompressionBase, CompressionInfo, NoCompression
from hivemind.proto import runtime_pb2


def narrowest_dtype(tensor: torch.Tensor) -> torch.dtype:
    """uint8 / int16 if every value is an integer in range, else float32."""
    if tensor.numel() == 0 or not torch.isfinite(tensor).all() or not torch.equal(tensor, tensor.round()):
        return torch.float32
    lo, hi = float(tensor.min()), float(tensor.max())
    if 0 <= lo and hi <= 255:
        return torch.uint8
    if -32768 <= lo and hi <= 32767:
        return torch.int16
    return torch.float32


class NarrowingCompression(CompressionBase):
    """Lossless: ``extract(compress(x)) == x`` bit for bit for any fp32 ``x``."""

    compression_type = runtime_pb2.CompressionType.NONE

    def __init__(self):
        self._plain = NoCompression()

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        tensor = tensor.detach()
        if tensor.dtype == torch.float32:
            tensor = tensor.to(narrowest_dtype(tensor))
        return self._plain.compress(tensor, info, allow_inplace)

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        return self._plain.extract(serialized_tensor).to(torch.float32)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 1.0  # hivemind sizes parts by this; 1.0 keeps parts at part_size_bytes of fp32 values
