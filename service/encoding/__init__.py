"""Tensors become wire data in exactly one place (CONVENTIONS.md): this package.

* :mod:`.codecs`: one tensor -> its wire form (json nested lists, rounded, ``layout="tril"``,
  sparse flat / coo, base64, binary placeholders), the NaN/inf and float16 range checks, and
  :func:`estimate_encoded_bytes` (what each form costs in memory);
* :mod:`.negotiation`: ``Accept`` -> JSON or safetensors (:func:`wants_binary`);
* :mod:`.responses`: a body -> JSON (one shot or streamed in bounded chunks) or one
  safetensors file, produced off the event loop, cut at the request's deadline and freed
  when the client goes away (:func:`tensor_response`, :class:`ChunkedResponse`).

Forms (schemas.common documents them; decoders, numpy only:
``clients/python/attnscope/client/wire.py``): ``json``; ``base64`` ``{"encoding": "base64",
"dtype", "shape", "data", "layout"}``, little-endian; ``binary``: the whole response as one
safetensors file (``application/x-safetensors``) whose ``__metadata__["attnscope"]`` holds the
JSON body with each tensor replaced by ``{"encoding": "binary", "name", "dtype", "shape",
"stored_shape", "layout"}``; ``tril`` (causal ``[..., T, T]``: the lower triangle only) and
``sparse`` (top-k per query row and/or a threshold, flat or coordinate indices, with the kept
mass of every row).

Everything callers used from the former single module is re-exported here.
"""

from .codecs import (  # noqa: F401
    _ST_DTYPE, _WIRE, LAZY, PIECE_BYTES, Base64Text, BinaryTensor, RoundedArray, TrilRows,
    _b64, _check_finite, _encode_tril, _json_array, _packed, _wire_array, array_pieces,
    encode_sparse, encode_tensor, estimate_encoded_bytes, to_numpy,
)
from .negotiation import SAFETENSORS, wants_binary  # noqa: F401
from .responses import (  # noqa: F401
    CHUNK_BYTES, DEADLINE_KEY, STREAM_MIN_BYTES, ChunkedResponse, ORJSONResponse,
    _array_bytes, _collect_binary, _default, _then_release, body_response, dumps, iter_json, respond,
    safetensors_parts, tensor_response,
)
from ..errors import InvalidRequest, NonFiniteValues, NotAcceptable  # noqa: F401
