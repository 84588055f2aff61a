"""The bfloat16 copy used for decoding: packed Linear layers against F.linear in bfloat16,
and the original model left untouched."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from transduce.model import Transformer
from transduce.model.bfloat16 import PackedLinear, bfloat16_copy, packing_available
from tests.model.test_transformer import tiny

needs_packing = pytest.mark.skipif(not packing_available(),
                                   reason="no oneDNN bfloat16 support on this CPU")


@needs_packing
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", ["none", "relu"])
@pytest.mark.parametrize("shape", [(128, 48), (3, 1, 48), (1, 48), (2, 5, 48)])
def test_packed_linear_equals_a_bfloat16_linear(bias, activation, shape):
    linear = nn.Linear(48, 72, bias=bias)
    x = torch.randn(shape).bfloat16()
    expected = F.linear(x.double(), linear.weight.bfloat16().double(),
                        None if linear.bias is None else linear.bias.bfloat16().double())
    if activation == "relu":
        expected = expected.relu()
    got = PackedLinear(linear, activation)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (*shape[:-1], 72)
    # Products of bfloat16 inputs, accumulated in float32, rounded once to bfloat16.
    torch.testing.assert_close(got.double(), expected, rtol=8e-3, atol=1e-2)


def test_bfloat16_copy_leaves_the_model_alone():
    model = Transformer(tiny()).eval()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    clone = bfloat16_copy(model)
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    assert all(p.dtype == torch.bfloat16 for p in clone.parameters())
    if packing_available():
        assert not any(type(m) is nn.Linear for m in clone.modules())
        assert not any(key.endswith("packed_weight") for key in clone.state_dict())
        ffn = clone.decoder.layers[0].ffn
        assert ffn.linear1.activation == "relu" and type(ffn.activation) is nn.Identity
