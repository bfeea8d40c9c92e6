"""Counting each entry's senders (diloco.sparse_average = senders): a payload's marks (sparse_twins.marks) decoded
by the decode kernel, or its twin, add one MARK at every entry the payload sends, and nothing for a chunk of zeros
(a joiner's) or one holding a NaN."""

from __future__ import annotations

import pytest
import torch

from zb.collectives import kernels, sparse_twins
from zb.collectives.build import use_cpp
from zb.collectives.sparse_twins import SparseScheme


@pytest.mark.parametrize("cpp", [False, pytest.param(True, marks=pytest.mark.skipif(
    not use_cpp(), reason="C++ kernels unavailable (no compiler or ZB_USE_CPP=0)"))])
def test_marks_count_the_payloads_that_send_each_entry(cpp: bool) -> None:
    scheme, n = SparseScheme(64, 8), 64 * 5 + 20          # a short last chunk: K' = 8 of its 20
    torch.manual_seed(3)
    inputs = [torch.distributions.Laplace(0.0, 1.0).sample((n,)) for _ in range(3)]
    inputs[0][: n // 2] *= 1e-3
    inputs.append(torch.zeros(n))                          # a joiner's zeros: scale 0, sends nothing
    inputs[1][130] = float("nan")                          # chunk 2 of node 1 sends NaNs, not values
    counts, want = torch.zeros(n), torch.zeros(n)
    for x in inputs:
        payload = torch.empty(scheme.payload_bytes(n), dtype=torch.uint8)
        kernels.sparse_compress(x, payload, scheme, cpp=cpp)
        values = torch.zeros(n)
        assert kernels.sparse_decode_add(payload, values, scheme, cpp=cpp)
        want += ((values != 0) & ~values.isnan()).float()
        assert kernels.sparse_decode_add(sparse_twins.marks(payload, n, scheme), counts, scheme, cpp=cpp)
    assert torch.equal(counts, want * sparse_twins.MARK)
    assert want.max() == 3 and want[128:192].sum() == 2 * 8   # chunk 2: node 1's NaN chunk does not count
    assert int(want.sum()) == 3 * 6 * 8 - 8                 # 3 senders x 6 chunks x K, less the NaN chunk
