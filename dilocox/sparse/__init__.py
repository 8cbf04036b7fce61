"""SparseLoCo pseudo-gradient codec: chunked top-k, 2-bit codes, error feedback, as self-describing bytes.

Source: SparseLoCo (Sarfi et al., arXiv 2508.15706). Per replica r and outer step t,
with a local fp32 error-feedback buffer e_r:

    e_r <- beta * e_r + delta_r
    c_r <- Q_bits(TopK_chunk(e_r));   e_r <- e_r - decode(c_r)
    all-gather c_r;   Delta = sum_r w_r decode(c_r) / sum_r w_r    (the outer step is done elsewhere)

Published recipe: chunks of 4096 values, top-64 per chunk (1.56%), 2-bit values, beta = 0.95,
outer lr 1, no outer momentum. Taken from the reference optimizer (one-covenant/SparseLoCo, read in
a published port of its ``TopKCompressor`` and ``SparseLoCo.step``, and in Templar's
``tplr/compress/topk.py``): the EF update order above
(``error_buffer.mul_(decay).add_(grad)``, compress, subtract the *local decompression*), top-k by
|e| per chunk, 12-bit indices for 4096-value chunks (Templar's ``pack12``). Where we differ **(ours)**:

* chunks are runs of ``chunk`` consecutive values of all tensors flattened and concatenated, not
  64x64 tiles of each matrix; a chunk may straddle two tensors. The last chunk may be short
  (L < chunk values): it sends min(topk, L) values, and its padding is never selected;
* values are quantized per chunk with one fp32 absmax scale s and a uniform mid-rise quantizer
  (below), not the reference's per-tensor "statistical" bins (mean shift, 1.5 sigma bins, an fp32
  lookup table of bin means): no table to send per chunk, and the error is bounded by s / 2^bits;
* indices within a chunk are sorted ascending and distinct (the reference uses unsorted top-k and
  a scatter "mean" that would hide duplicates): one canonical payload per selection, so a receiver
  can reject anything else. Values tied with the topk-th largest |e| go to the lowest positions, so
  the payload is a function of e alone (whatever the machine or thread count);
* indices have a fixed width, ceil(log2 chunk) bits. Templar's current index codec
  (``tplr/compress/bits.py``) Rice-codes counts per 64- or 128-value sub-chunk, then offsets or
  bitmaps, about 8 bits per index at 1.56% density; fixed width costs a third more index bytes but
  gives a size known in advance, vectorized packing and a simple validation;
* the mean divides by the sum of the weights of all accepted contributions (zeros where a peer did
  not select a value; the reference's scatter "mean" averages only over the peers that picked a
  position), in float64 over peer ids in sorted order, so every member gets the same bits; it and
  the robust rules (dilocox/robust.py, with its determinism contract) run on the sorted union of
  the positions the accepted contributions sent.

Modules: ``wire`` (the payload format: config, layout, bit packing, Rice-coded indices, validation and decoding
of untrusted bytes), ``quantizer`` (the per-chunk values' codes), ``codec`` (top-k with error feedback:
SparseCodec), ``aggregate`` (the union of the sent positions and the group's weighted or robust aggregate, kept sparse:
SparseAggregate),
``compressor`` (the daemon's compressor around the codec) and ``threads`` (work split between threads, the
same bits whatever their count). This package re-exports their public names.


Speed (``make bench-aggregate``: the daemon's config, top-128 of each 4096 with Rice-coded indices,
norm bound 2, one contribution outsized; 50 M values, one thread of a busy 2-core VM, medians): per
value, encode 5.4 ns, decode 1 ns, the aggregate of 4 contributions 6 ns under the mean and 11 ns
under centered-clip, of 8 contributions 17 and 41 ns (the rule's rows span the union of the sent
positions, which grows with k). Everything is vectorized numpy over the chunks, a cache-sized block
at a time; with more torch threads (``torch.set_num_threads``) the chunks, the contributions and the
rule's column batches are split between threads (Python threads: numpy releases the GIL), with the
same bits. ``python -m bench.codec_speed`` times this against an older version and prints a digest of
the outputs to compare between machines.
"""

from dilocox.sparse.aggregate import SparseAggregate, aggregate, aggregate_scaled, aggregate_sparse, union
from dilocox.sparse.codec import SparseCodec
from dilocox.sparse.compressor import LocalState, SparseCompressor, SparseRound
from dilocox.sparse.quantizer import decode_rows, encode_rows, quantize_rows
from dilocox.sparse.wire import (
    HEADER,
    HEADER_BYTES,
    MAGIC,
    RICE_FLAG,
    SCALE_BYTES,
    SUPPORTED_BITS,
    UNARY,
    VERSION,
    ContributionError,
    Layout,
    SparseConfig,
    decode,
    decode_positions,
    encode_positions,
    layout,
    pack_bits,
    parse,
    payload_bytes,
    positions,
    sent_positions,
    unpack_bits,
)

__all__ = ["HEADER", "HEADER_BYTES", "MAGIC", "RICE_FLAG", "SCALE_BYTES", "SUPPORTED_BITS", "UNARY", "VERSION",
           "ContributionError", "Layout", "LocalState", "SparseCodec", "SparseCompressor", "SparseConfig",
           "SparseAggregate", "SparseRound", "aggregate", "aggregate_scaled", "aggregate_sparse", "decode",
           "decode_positions", "decode_rows",
           "encode_positions", "encode_rows", "layout", "pack_bits", "parse", "payload_bytes", "positions",
           "quantize_rows", "sent_positions", "union", "unpack_bits"]
