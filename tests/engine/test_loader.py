"""The GGUF dequantizer agrees with the gguf package bit for bit."""

from __future__ import annotations

import numpy as np

from engine.loader import dequantize, smollm2_path


def test_q4_1_q8_0_and_f32_dequantize_exactly_like_gguf():
    import gguf

    reader = gguf.GGUFReader(str(smollm2_path()))
    seen = set()
    for tensor in reader.tensors[:10]:
        kind = tensor.tensor_type.name
        seen.add(kind)
        ours = dequantize(tensor.data, kind, tensor.tensor_type)
        reference = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        assert ours.dtype == np.float32
        assert np.array_equal(ours, reference), tensor.name
    assert seen == {"Q4_1", "Q8_0", "F32"}
