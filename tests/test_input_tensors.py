"""Request tensors (``/v1/run``'s ``vector`` / ``value``) decoded by ``encoding/inputs.py``:
a base64 shape whose element count overflows int64 is refused as too big (a 422 naming the
field), never wrapped to a small count that the byte check then accepts (a 500 at reshape)."""

import pytest

from service.encoding.inputs import decode_input
from service.errors import InvalidRequest


@pytest.mark.parametrize("shape", [[2**32, 2**32, 2**32], [2**62, 4, 1], [2**63, 2]])
def test_overflowing_shape_is_refused(shape):
    x = {"encoding": "base64", "dtype": "float32", "shape": shape, "data": ""}
    with pytest.raises(InvalidRequest, match="at most 67108864 elements"):
        decode_input(x, "interventions.0.vector")


def test_small_shape_still_decodes():
    x = {"encoding": "base64", "dtype": "float32", "shape": [2, 0], "data": ""}
    assert decode_input(x, "v").shape == (2, 0)
