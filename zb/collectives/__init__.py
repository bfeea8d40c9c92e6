"""All-reduce for DiLoCo's pseudo-gradients: fp32 through the backend, or 8, 4 or 2 bits on the wire.

    from zb.collectives import all_reduce, PeerFailure
    stats = all_reduce(tensor, group, op=ReduceOp.AVG, compression="int4",
                       streams=[g2, g3], min_bandwidth_mbps=10.0, timeout_floor_s=10.0,
                       residual=residual)
    stats.wire_bytes, stats.seconds

- tensor: float32 or bfloat16, any shape and length, reduced in place. group: any
  ProcessGroup (a bare ProcessGroupGloo built over a PrefixStore works: only group-relative
  send/recv are used). op: ReduceOp.SUM or ReduceOp.AVG. World size 1 returns at once.
- compression "none": the backend's fp32 all-reduce (gloo or NCCL). "int8", "int4", "int2": a
  pipelined ring on CPU (ring.py) over blockwise-scaled packed codes (twins.py defines the schemes):
  reduce-scatter accumulating in fp32, then an all-gather that forwards the owner's bytes, so every
  rank ends with bit-identical values.
- compression "sparse" (SparseLoCo, arXiv 2508.15706; sparse_twins.py defines it): per chunk of
  `sparse.chunk` values, the `sparse.k` largest entries of `sparse_beta` x residual + tensor, as packed
  indices and 2-bit codes; every rank's payload is gathered over a ring (gather.py: the bytes forwarded
  as they are) and decoded in rank order into zeros, so every rank ends with the same bits. A rank
  sends (W - 1) payloads a call.
- residual (error feedback, quantized widths and sparse): one float32 value per value of the tensor, kept
  by the caller across calls; every quantization this rank performs adds it and keeps what it
  dropped, so across calls the outputs plus every rank's residual equal the inputs summed.
- streams: extra groups with the same members; the tensor is striped over them so a node pair
  uses several TCP connections at once.
- TransferDeadlines: each transfer must finish within timeout_floor_s + bytes / min_bandwidth_mbps; the
  first message may wait start_timeout_s (peers arrive at the all-reduce at different times).
- Failure: PeerFailure (an EnvironmentFailure) with .rank = the suspect group rank (or None);
  the tensor is then undefined and the caller rebuilds the group.
- Non-finite input: a NaN or Inf turns its whole block into NaN on every rank (quantized), or
  propagates as the backend sums it (none); never into finite values.
- Error bound (SUM, per element, W ranks, of the values sent): with A = the sum over ranks of each
  rank's max |x| in the element's block, |result - exact| <= ((1 + q)^W - 1 + W * 2^-22) * A, with
  q = 1/254 (int8), 1/14 (int4), 1 (int2); for AVG divide the bound by W.
- Kernels: C++ (csrc/zb_quant.cpp, built just in time) or their PyTorch twins; ZB_USE_CPP=0
  forces the twins. Results are bit-identical either way.
"""

from zb.collectives.allreduce import COMPRESSIONS, AllReduceStats, all_reduce
from zb.collectives.peer_failure import PeerFailure

__all__ = ["all_reduce", "AllReduceStats", "PeerFailure", "COMPRESSIONS"]
