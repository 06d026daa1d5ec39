"""Rounded JSON (``round: d``) is exact (issue 29 item 2): every value sent is the decimal with
``d`` places nearest the TRUE float32 value (ties half to even), within ``0.5 * 10**-d`` of
it, and its JSON text is that short decimal. Checked against Python's ``round(float, d)``,
which is correctly rounded on the exact binary value (hand-computed ties below)."""

from __future__ import annotations

import numpy as np
import orjson
import pytest
import torch

from attnscope.service import encoding as enc
from attnscope.service.encoding import codecs


def _text(x: np.ndarray, d: int, **kw) -> bytes:
    """The JSON text of ``x`` sent with ``round: d`` (the codec's streamed pieces)."""
    got = enc.encode_tensor(torch.from_numpy(np.ascontiguousarray(x)), "json", round_=d, **kw)
    return b"".join(enc.iter_json(got, 64))


@pytest.mark.regression  # issue 29: np.round on float32 sent 0.00205000001 as 0.002
def test_value_just_past_a_tie_rounds_up():
    x = np.array([0.00205000001], np.float32)  # true value 0.002050000010058284...
    assert _text(x, 4) == b"[0.0021]"  # float32 np.round gave [0.002]: 5.000001e-5 off


@pytest.mark.parametrize("value, d, want", [
    # exact ties of the binary value go to the even last digit (hand-computed)
    (0.125, 2, b"0.12"), (0.375, 2, b"0.38"), (-0.125, 2, b"-0.12"), (2.5, 0, b"2.0"),
    (3.5, 0, b"4.0"), (0.0625, 3, b"0.062"), (0.0078125, 6, b"0.007812"),
    # not ties: float32(0.125 +- 1 ulp), float32(0.0021) stays 0.0021 (its text, not 0.0020999)
    (np.nextafter(np.float32(0.125), np.float32(1)), 2, b"0.13"),
    (np.nextafter(np.float32(0.125), np.float32(0)), 2, b"0.12"),
    (0.0021, 4, b"0.0021"), (0.1, 1, b"0.1"), (0.99995, 4, b"0.9999"),  # f32 0.99995 < tie
    (1.0 / 3.0, 10, b"0.3333333433"),  # float32(1/3) = 0.3333333432674407958984375
])
def test_ties_and_hand_computed_values(value, d, want):
    assert _text(np.array([value], np.float32), d) == b"[" + want + b"]"


def _near_ties(rng: np.random.Generator, d: int, n: int) -> np.ndarray:
    """float32 values at and around ``(k + 1/2) / 10**d`` (the float32 nearest each tie and
    its two neighbours): where float32 rounding goes wrong."""
    k = rng.integers(0, 10 ** min(d + 1, 7), n)
    t = ((k + 0.5) / 10.0 ** d).astype(np.float32)
    return np.concatenate([t, np.nextafter(t, np.float32(np.inf)),
                           np.nextafter(t, np.float32(-np.inf))])


@pytest.mark.parametrize("d", range(0, 11))
def test_every_value_within_half_a_unit_of_the_true_float32(d):
    rng = np.random.default_rng(d)
    mags = 10.0 ** rng.uniform(-12, 12, 4000)
    x = np.concatenate([_near_ties(rng, d, 2000), (mags * rng.choice([-1, 1], 4000)),
                        rng.random(4000)]).astype(np.float32)
    sent = orjson.loads(_text(x, d))
    want = [round(float(v), d) for v in x]  # correctly rounded on the exact float32 value
    assert sent == want
    # the bound, exactly: x * 10**d is exact in float64, the decimal's last place an integer
    k = np.rint(np.asarray(sent) * 10.0 ** d)
    assert np.all(np.abs(x.astype(np.float64) * 10.0 ** d - k) <= 0.5)


def test_text_is_the_short_decimal():
    rng = np.random.default_rng(7)
    x = np.concatenate([_near_ties(rng, 4, 5000), rng.random(5000)]).astype(np.float32)
    square = x[: 100 * 100].reshape(100, 100)
    for text in (_text(x, 4), b"".join(codecs.TrilRows(square, 4).pieces(64))):
        for tok in text.replace(b"[", b"").replace(b"]", b"").split(b","):
            assert len(tok.partition(b".")[2]) <= 4 and b"e" not in tok, tok


def test_tril_layout_and_asarray_use_the_same_rule():
    x = np.full((3, 3), 0.00205000001, np.float32)
    body = orjson.loads(_text(x, 4, layout="tril"))
    assert body["data"] == [[0.0021], [0.0021] * 2, [0.0021] * 3]
    assert codecs.round_decimals(x, 4).dtype == np.float64
    assert np.all(np.asarray(codecs.RoundedArray(x, 4)) == 0.0021)
