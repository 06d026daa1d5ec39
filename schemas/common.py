"""Shared pieces of the contract: tensors on the wire, tokens, model identity, errors."""

from __future__ import annotations

import sys
from typing import Annotated, Any, ClassVar, Literal, Union

import annotated_types
from pydantic import (
    AfterValidator, BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema,
    field_validator, model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError
from pydantic_core import core_schema as _cs

from .errors import ERROR_TYPES

# Length limits of the lists in requests. Each list field has ``max_length`` (a longer list is
# refused from its length alone, StrictModel) and ``fail_fast`` (validation stops at the first
# invalid element): an invalid body costs one error, however many elements it holds.
MAX_TEXTS = 4096
"""Most texts in a list of texts (``texts``, ``reference_texts``): the ceiling of the
``max_batch`` setting, whose value (default 32) the service checks."""
MAX_INDICES = 1024
"""Most layer or head indices in one selection (``layers``, ``heads``, ``flow_layers``); each
index is distinct and below the model's count, which the service checks."""
MAX_POSITIONS = 131_072
"""Most token positions in one list (``positions``, ``ignore``): 128 Ki, the longest context
of the models in use; each position is distinct and below the text's token count, which the
service checks."""
MAX_HEAD_PAIRS = 16_384
"""Most ``[layer, head]`` pairs in one list (``/v1/ablate`` ``heads``): more than any model has
heads (GPT-3 175B: 96 x 96 = 9,216); each pair is distinct and in the model, which the service
checks."""


def _integral(v: Any) -> Any:
    """A JSON number with a zero fractional part (``10.0``, ``1e2``) as the int it is, up to
    2**53 in magnitude (floats past it are not exact integers: ``1e308`` stays a float, so the
    strict int validator refuses it, rather than a 309-digit int reaching the messages);
    anything else unchanged (for the strict int validator to judge)."""
    return int(v) if type(v) is float and v.is_integer() and abs(v) <= 2.0 ** 53 else v


def _json_integers(node: Any) -> Any:
    """``node`` (a pydantic core schema) with every int validator preceded by
    :func:`_integral`: JSON Schema's ``integer`` is any number with a zero fractional part, so
    an integer field takes ``10.0`` as 10 (``10.5``, ``true``, ``"10"`` stay refused). The JSON
    schema is the int's own (``type: integer`` with its bounds)."""
    if isinstance(node, dict):
        if node.get("type") == "int":
            return _cs.no_info_before_validator_function(_integral, node)
        if node.get("type") == "function-before" and \
                (node.get("function") or {}).get("function") is _integral:
            return node  # a nested model's, already wrapped
        return {k: v if k in ("metadata", "serialization", "ref") else _json_integers(v)
                for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_json_integers(x) for x in node)
    return node


# --- rules between fields, stated in the JSON schema (StrictModel.json_rules) -------------------
# Each helper returns a JSON Schema object; a model's ``json_rules`` are ``allOf``'d onto its
# schema. A field is "unset" when absent or null (what the validators' ``is None`` sees).

def present(*fields: str) -> dict:
    """Every one of ``fields`` is given and not null."""
    return {"required": list(fields),
            "properties": {f: {"not": {"type": "null"}} for f in fields}}


def unset(*fields: str) -> dict:
    """None of ``fields`` is given (absent or null)."""
    return {"properties": {f: {"type": "null"} for f in fields}}


def equals(field: str, value: Any, default: Any) -> dict:
    """``field`` is ``value`` (absent counts as its ``default``)."""
    js = {"properties": {field: {"const": value}}}
    return js if value == default else {"required": [field], **js}


def one_of(*alternatives: tuple[str, ...] | str) -> dict:
    """Exactly one of the ``alternatives`` (a field, or fields given together) is given, every
    other field named is unset; ``()`` as an alternative: none given."""
    alts = [(a,) if isinstance(a, str) else tuple(a) for a in alternatives]
    names = [f for a in alts for f in a]
    branches = []
    for a in alts:
        rest = [f for f in dict.fromkeys(names) if f not in a]
        js = present(*a) if a else {"properties": {}}
        js["properties"].update(unset(*rest)["properties"])
        branches.append(js)
    return {"anyOf": branches}


def _not(js: dict) -> dict:
    """``{"not": js}``, without a double negation."""
    return js["not"] if set(js) == {"not"} else {"not": js}


def negate(condition: dict) -> dict:
    """The complement of a condition made by :func:`present`, :func:`unset`, :func:`equals`
    (and ``anyOf`` / ``allOf`` of them), spelled as branches on single fields: a generator
    (schemathesis' canonical form) intersects those by field, where ``if`` / ``not`` of a whole
    object multiply its cases."""
    if set(condition) == {"anyOf"}:
        return {"allOf": [negate(c) for c in condition["anyOf"]]}
    if set(condition) == {"allOf"}:
        return {"anyOf": [negate(c) for c in condition["allOf"]]}
    if set(condition) <= {"properties", "required"}:
        props, req = condition.get("properties", {}), condition.get("required", [])
        branches = [{"properties": {f: False}} for f in req]  # a required field absent
        branches += [{"required": [f], "properties": {f: _not(js)}} for f, js in props.items()]
        return branches[0] if len(branches) == 1 else {"anyOf": branches}
    return _not(condition)


def cases(*branches: list[dict]) -> dict:
    """One of ``branches`` holds, each a list of conditions that hold together. Exclusive
    cases, each spelling what it allows of every field involved, cost a generator fewer
    intersections than one rule per check (schemathesis gives up on a schema whose rules
    multiply past its bound)."""
    return {"anyOf": [{"allOf": list(b)} if len(b) > 1 else b[0] for b in branches]}


def when(condition: dict, then: dict) -> dict:
    """``then`` holds wherever ``condition`` does (``if``/``then``, spelled as ``anyOf``
    [not condition, condition and then])."""
    return {"anyOf": [negate(condition), {"allOf": [condition, then]}]}


# Python's whitespace (str.isspace, what str.strip removes), spelled out: ECMA-262's and
# Python's ``\s`` differ (U+001C..U+001F, U+0085, U+FEFF), this class means the same in both.
_SPACE = "".join(c if c not in "\\]^-" else "\\" + c for c in map(chr, range(sys.maxunicode + 1))
                 if c.isspace())
NON_BLANK_PATTERN = "[^" + _SPACE.encode("unicode_escape").decode("ascii") + "]"
"""JSON Schema ``pattern`` of a text with a non-whitespace character (the service strips
Python's whitespace, ``str.isspace``)."""


def _schema_extra(kind: str, **keywords: Any):
    """A ``Field(json_schema_extra=...)`` adding ``keywords`` to the field's ``kind`` branch
    (``"string"``, ``"array"``): inside ``anyOf`` for an optional field."""
    def extra(js: dict) -> None:
        for branch in js.get("anyOf", [js]):
            if branch.get("type") == kind:
                branch.update(keywords)
    return extra


INDEX_MARK = "x-attnscope-index"
"""Marks an index field's JSON schema with what it indexes (``"layer"``, ``"head"``,
``"token"``: a vocabulary id, ``"neuron"``: an MLP neuron): the served OpenAPI (service/ops/openapi.py) bounds it by the
resident model's count (``maximum``, and ``maxItems`` of a list of distinct indices)."""


ENCODER_ONLY_MARK = "x-attnscope-encoder-only"
"""Marks an enum field's values that only an encoder accepts: the served OpenAPI of a causal
model leaves them out of the enum."""


AT_MOST_MARK = "x-attnscope-at-most"
"""Marks a count field bounded by a size of the resident model (``"d_model"``): the served
OpenAPI gives it that ``maximum``."""


def index_list(what: str | None = None) -> Any:
    """``json_schema_extra`` of a list of distinct indices that the service refuses empty
    (``check_indices``): ``minItems`` 1, ``uniqueItems``; ``what``: see :data:`INDEX_MARK`."""
    return _schema_extra("array", minItems=1, uniqueItems=True,
                         **({INDEX_MARK: what} if what else {}))


def index_of(what: str) -> Any:
    """``json_schema_extra`` of one index field (an integer, or a list of token ids)."""
    return _schema_extra("integer", **{INDEX_MARK: what}) if what != "token" else \
        _schema_extra("array", **{INDEX_MARK: what})


def distinct_positions(*, minimum: int | None = None) -> Any:
    """``json_schema_extra`` of a list of positions the service refuses with a repeat
    (``uniqueItems``), each at least ``minimum`` where given (the bound by the text's own
    token count is checked by the service: no schema can state it)."""
    def extra(js: dict) -> None:
        for branch in js.get("anyOf", [js]):
            if branch.get("type") == "array":
                branch["uniqueItems"] = True
                if minimum is not None and isinstance(branch.get("items"), dict):
                    branch["items"]["minimum"] = max(branch["items"].get("minimum", minimum),
                                                     minimum)
    return extra


NON_BLANK = _schema_extra("string", pattern=NON_BLANK_PATTERN)
"""``json_schema_extra`` of a text field whose validator refuses a blank text."""
NON_EMPTY = _schema_extra("array", minItems=1)
"""``json_schema_extra`` of a list field whose validator refuses an empty list."""

BATCH_MARK = "x-attnscope-batch"
"""JSON-schema mark of a list of prompts the server caps at ``max_batch`` (texts, token-id
lists): the served OpenAPI gives it ``maxItems`` = the setting (service/ops/openapi.py
``model_bounds``); other lists keep their own bounds."""

BATCH = _schema_extra("array", minItems=1, **{BATCH_MARK: True})
"""``json_schema_extra`` of a non-empty list of prompts capped at ``max_batch``."""


def ids_as_given(*id_fields: str) -> dict:
    """Token ids are used as given: with any of ``id_fields`` given, ``add_bos`` is not true
    (resolve in service/serving/core/inputs.py)."""
    return when({"anyOf": [present(f) for f in id_fields]},
                {"properties": {"add_bos": {"not": {"const": True}}}})


TOKEN_IDS_AS_GIVEN = ids_as_given("tokens", "token_lists")


class StrictModel(BaseModel):
    """Base for requests: unknown fields are rejected (422), never silently ignored, and values
    are never coerced across JSON types (pydantic strict mode): ``"yes"`` or ``1`` is not a
    boolean, ``true``, ``1.5`` or ``"1"`` is not an index, ``true`` is not a number (an integer
    is still accepted where a float is expected). A number with a zero fractional part is an
    integer (``1.0`` is the index 1), as JSON Schema's ``integer`` says.

    The OpenAPI states what the validators check between fields: each class's ``json_rules``
    (JSON Schema objects made by :func:`one_of`, :func:`present`, :func:`when` ...; a subclass
    adds to its bases') are the ``allOf`` of its schema.

    The cost of refusing a body is bounded, before anything in it is validated: an object with
    more keys than the model has fields gets one error (``too_many_fields``, at its first
    unknown key), not one per unknown key; a list longer than its field's ``max_length`` gets
    one ``too_long`` error from its length alone (pydantic's own check comes after the first
    invalid element when the field is ``fail_fast``)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    json_rules: ClassVar[tuple[dict, ...]] = ()

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        return _json_integers(handler(source))

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: Any, handler: Any) -> Any:
        js = handler(core_schema)
        rules = [r for c in reversed(cls.__mro__) for r in c.__dict__.get("json_rules", ())]
        if rules:
            handler.resolve_ref_schema(js).setdefault("allOf", []).extend(rules)
        return js

    @model_validator(mode="before")
    @classmethod
    def _bounded(cls, data: Any) -> Any:
        if type(data) is not dict:
            return data
        fields = cls.model_fields
        if len(data) > len(fields):
            # distinct keys, more than the fields: one of the first len(fields) + 1 is unknown
            key = next(k for k in data if k not in fields)
            raise _one_error(cls, key, data[key], PydanticCustomError(
                "too_many_fields", "Extra inputs are not permitted: the object has {count} "
                "keys, {model} has {limit} fields",
                {"count": len(data), "model": cls.__name__, "limit": len(fields)}))
        for name, limit in _list_limits(cls).items():
            value = data.get(name)
            if type(value) is list and len(value) > limit:
                raise _one_error(cls, name, value, "too_long", {
                    "field_type": "List", "max_length": limit, "actual_length": len(value)})
        return data


def _one_error(model: type, key: str, value: Any, error: str | PydanticCustomError,
               ctx: dict | None = None) -> ValidationError:
    """A ValidationError of one error at ``key`` (pydantic prefixes the model's location):
    ``error`` is a pydantic error type (with its ``ctx``) or a custom error."""
    details = InitErrorDetails(type=error, loc=(key,), input=value)
    if ctx is not None:
        details["ctx"] = ctx
    return ValidationError.from_exception_data(model.__name__, [details])


def field_error(model: type, loc: tuple, message: str, value: Any = None, *,
                missing: bool = False) -> ValidationError:
    """A ValidationError at the field ``loc`` (``("grad", "metric")``) for a model validator
    to raise, so that the 422 envelope's ``param`` names that field (a ``ValueError`` raised in
    a model validator has the model's own location: ``param`` null). ``missing``: the field
    is absent from the body (the error's type is then pydantic's ``missing``, which the
    envelope's loc keeps though the body lacks the key)."""
    err = PydanticCustomError("missing" if missing else "value_error", message)
    return _one_error(model, loc[0], value, err) if len(loc) == 1 else \
        ValidationError.from_exception_data(model.__name__, [
            InitErrorDetails(type=err, loc=tuple(loc), input=value)])


_LIST_LIMITS: dict[type, dict[str, int]] = {}


def _list_limits(model: type) -> dict[str, int]:
    """``{field: max_length}`` of the model's fields that have one."""
    got = _LIST_LIMITS.get(model)
    if got is None:
        got = _LIST_LIMITS[model] = {
            name: m.max_length for name, f in model.model_fields.items() for m in f.metadata
            if isinstance(m, annotated_types.MaxLen)}
    return got


class LenientModel(BaseModel):
    """Base for responses: unknown fields are accepted so old clients survive additive changes."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())


def _nested_numbers(depth: int, ints: bool = False) -> dict:
    """JSON schema of nested lists of numbers (``null`` = a masked entry), ``depth`` levels at
    most: what a tensor looks like as JSON. Written out (not recursive) so every tool reads it."""
    leaf: list[dict] = [{"type": "integer"}] if ints else [{"type": "number"}, {"type": "null"}]
    schema: dict = {"type": "array", "items": {"anyOf": leaf}}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": {"anyOf": [*leaf, schema]}}
    return schema


NestedNumbers = Annotated[list[Any], WithJsonSchema({
    **_nested_numbers(5),
    "title": "NestedNumbers",
    "description": "A tensor as nested JSON lists of numbers, row-major; null = a masked "
    "entry (-inf, e.g. a future key's pre-softmax score).",
})]
"""A tensor as nested JSON lists. Validated as a plain list (no per-number work on big
tensors); its OpenAPI schema spells the nesting (numbers or null, up to 5 levels)."""

class Base64Tensor(LenientModel):
    """A compact tensor: raw little-endian bytes in base64, with dtype and shape.

    Decode with ``numpy.frombuffer(base64.b64decode(data), dtype="<f4" or "<f2").reshape(shape)``
    (the client's ``.numpy()`` does this). Masked attention scores are ``-inf`` here.
    With ``layout`` 'tril' the data holds only the lower triangle (diagonal included) of the
    last two axes, row by row: ``prod(shape[:-2]) * n * (n + 1) / 2`` elements for ``n =
    shape[-1]``; entries above the diagonal are 0 (pattern) or -inf (scores).
    """

    encoding: Literal["base64"] = Field("base64", description="Always 'base64'.")
    dtype: Literal["float16", "float32", "int32", "int64"] = Field(
        description="Element type, little-endian (IEEE 754 floats, two's complement ints)."
    )
    shape: list[int] = Field(description="Tensor shape, row-major (C order).")
    data: str = Field(description="Standard base64 of the little-endian element bytes.")
    layout: Literal["full", "tril"] = Field(
        "full", description="'full': every element; 'tril': the lower triangle (diagonal "
        "included) of the last two axes only, row-major (causal patterns/scores)."
    )
    fill: Literal["0", "-inf"] | None = Field(
        None, description="layout 'tril': value of the entries not sent (above the diagonal): "
        "'0' for patterns, '-inf' for masked scores."
    )


class TrilTensor(LenientModel):
    """A causal ``[..., query_pos, key_pos]`` tensor as JSON, lower triangle only (``layout``
    'tril' with encoding 'json'): ``data[...][q]`` lists the ``q + 1`` values of keys
    ``0..q``. Keys after the query are 0 (pattern) or masked (scores) and are not sent."""

    encoding: Literal["tril"] = Field("tril", description="Always 'tril'.")
    shape: list[int] = Field(description="Full tensor shape; the last two axes are equal.")
    data: NestedNumbers = Field(description="Nested lists; the innermost row q holds q + 1 values.")
    fill: Literal["0", "-inf"] = Field(
        "0", description="Value of the entries not sent (above the diagonal): '0' for "
        "patterns, '-inf' for masked scores."
    )


class SparseTensor(LenientModel):
    """A sparse attention pattern (request option ``sparse``): only the kept entries.

    Kept entries: per query row, the ``top_k`` largest weights and/or those ``>= threshold``
    (zeros are never sent). ``format`` 'flat': ``indices[i]`` is the row-major flat index into
    ``shape``; 'coo': ``indices`` has shape ``[nnz, ndim]``, one coordinate tuple (e.g.
    ``[layer, head, query_pos, key_pos]``) per kept entry. Entries are in row-major order.
    ``row_mass`` (shape ``shape[:-1]``) is the sum of the kept weights of each query row, the
    fraction of that row's attention mass that was kept (rows sum to 1): nothing dropped is
    hidden. Each of ``indices``, ``values`` and ``row_mass`` is JSON lists (encoding 'json'),
    a Base64Tensor (encoding 'base64'), or a BinaryTensorRef (binary responses).
    """

    encoding: Literal["sparse"] = Field("sparse", description="Always 'sparse'.")
    format: Literal["flat", "coo"] = Field(description="Index format: 'flat' or 'coo'.")
    shape: list[int] = Field(description="Dense tensor shape, row-major.")
    nnz: int = Field(description="Number of kept entries.")
    top_k: int | None = Field(None, description="Keys kept per query row at most (null = no cap).")
    threshold: float | None = Field(None, description="Smallest weight kept (null = none).")
    indices: Annotated[Any, WithJsonSchema({"anyOf": [
        _nested_numbers(2, ints=True), {"$ref": "#/components/schemas/Base64Tensor"},
        {"$ref": "#/components/schemas/BinaryTensorRef"}]})] = Field(
        description="int indices: [nnz] (flat) or [nnz, ndim] (coo): JSON lists, a "
        "Base64Tensor (int32/int64) or a BinaryTensorRef.")
    values: Annotated[Any, WithJsonSchema({"anyOf": [
        _nested_numbers(1), {"$ref": "#/components/schemas/Base64Tensor"},
        {"$ref": "#/components/schemas/BinaryTensorRef"}]})] = Field(
        description="Kept weights, [nnz], in the order of indices.")
    row_mass: Annotated[Any, WithJsonSchema({"anyOf": [
        _nested_numbers(4), {"$ref": "#/components/schemas/Base64Tensor"},
        {"$ref": "#/components/schemas/BinaryTensorRef"}]})] = Field(
        description="Kept mass per query row, shape shape[:-1], in [0, 1].")
    min_row_mass: float = Field(description="Smallest row_mass (1.0 = nothing was dropped).")


class BinaryTensorRef(LenientModel):
    """In a binary (``application/x-safetensors``) response: where a tensor's bytes are.

    ``name`` is the tensor's key in the safetensors file. The stored tensor has
    ``stored_shape``; with ``layout`` 'tril' it holds the packed lower triangle of ``shape``.
    """

    encoding: Literal["binary"] = Field("binary", description="Always 'binary'.")
    name: str = Field(description="Key of the tensor in the safetensors file.")
    dtype: Literal["float16", "float32", "int32", "int64"] = Field(description="Element type.")
    shape: list[int] = Field(description="Logical tensor shape.")
    stored_shape: list[int] = Field(description="Shape of the stored (possibly packed) tensor.")
    layout: Literal["full", "tril"] = Field("full", description="'full' or 'tril' (packed).")
    fill: Literal["0", "-inf"] | None = Field(
        None, description="layout 'tril': value of the entries not stored above the diagonal."
    )


TensorField = Union[Base64Tensor, SparseTensor, TrilTensor, BinaryTensorRef, NestedNumbers]
"""A tensor on the wire: nested JSON lists (encoding 'json'), a Base64Tensor (encoding
'base64'), a TrilTensor (json + layout 'tril'), a SparseTensor (option ``sparse``) or a
BinaryTensorRef (binary responses negotiated by ``Accept``)."""

Encoding = Literal["json", "base64"]
WireDtype = Literal["float32", "float16"]


class TensorOptions(StrictModel):
    """How tensors in a response are encoded (mixin for requests)."""

    encoding: Encoding = Field(
        "json",
        description="'json': nested lists of numbers (optionally rounded); 'base64': "
        "{dtype, shape, data} with little-endian bytes, far smaller and faster.",
    )
    dtype: WireDtype = Field(
        "float32", description="Element type for encoding 'base64' (ignored for 'json')."
    )
    round: int | None = Field(
        None,
        ge=0,
        le=10,
        description="Decimal places for encoding 'json': each value is the decimal with this "
        "many places nearest the exact float32 value (ties to even; within 0.5e-round of it), "
        "written as that short decimal; null = full float32 precision (shortest repr that "
        "round-trips).",
    )


LABEL_DOC = (
    "Readable text the token stands for (byte-level BPE decoded: no 'Ġ'); special tokens by "
    "name. Made visible: bytes of a character split across tokens are '\\xNN' escapes; a "
    "newline, tab and carriage return are the two characters '\\n', '\\t', '\\r' (as "
    "TransformerLens and CircuitsVis show them), other control characters '\\xNN' (C0, DEL) "
    "or '\\u00NN' (C1). Other text, backslashes included, is as is: 'bytes' is the exact form."
)
BYTES_DOC = (
    "The token's raw bytes as lowercase hex ('20636174' for ' cat'): for byte-level BPE "
    "(GPT-2) the bytes the token stands for; for WordPiece (BERT) and special tokens the UTF-8 "
    "of the token string ('##ing', '[CLS]', '<|endoftext|>')."
)
PARTIAL_DOC = (
    "True when 'bytes' is not a whole UTF-8 sequence: the token holds part of a character "
    "split across byte-level tokens (an emoji's 4 bytes over 2 tokens). False for WordPiece "
    "and special tokens."
)


class Token(LenientModel):
    """One analysed token."""

    position: int = Field(description="Index in the analysed sequence (query_pos/key_pos), from 0.")
    id: int = Field(description="Vocabulary id.")
    label: str = Field(description=LABEL_DOC)
    start: int | None = Field(
        description="Character offset of the token's text in the input (inclusive); null for "
        "tokens the tokenizer or the add_bos option inserted."
    )
    end: int | None = Field(description="Character offset (exclusive); null for inserted tokens.")
    special: bool = Field(description="True for tokens inserted by the framing (BOS, [CLS], [SEP]).")
    bytes: str = Field(description=BYTES_DOC)
    partial: bool = Field(description=PARTIAL_DOC)


class ModelRef(LenientModel):
    """Which model produced a response."""

    id: str = Field(description="Model id: hub id or local directory name.")
    revision: str = Field(description="Hub commit hash, or 'sha256:<12 hex>' of a local checkpoint's weights, config and tokenizer files (every file that changes the numbers).")


class AttentionFacts(LenientModel):
    """How the resident model's attention is built (what changes a pattern's definition)."""

    positions: str = Field(description="'learned_absolute' (GPT-2, BERT: position embeddings "
                           "added to the input) or 'rotary' (RoPE, Su et al. 2021: q and k "
                           "rotated by position inside each attention layer; served q/k are "
                           "after rotary).")
    rotary_dim: int | None = Field(None, description="Dimensions of each head that rotate (the "
                                   "first rotary_dim of d_head; the rest pass); null without "
                                   "rotary.")
    rotary_fraction: float | None = Field(None, description="rotary_dim / d_head (GPT-NeoX's "
                                          "rotary_pct, e.g. 0.25); null without rotary.")
    rope_theta: float | None = Field(None, description="RoPE base theta; null without rotary.")
    rope_scaling: dict | None = Field(None, description="The config's rope parameters beyond "
                                      "theta (rope_type, factor, ...) when not the default "
                                      "rope; null otherwise.")
    n_kv_heads: int = Field(description="Key/value heads per layer (= n_heads without "
                            "grouped-query attention).")
    kv_head_of_query_head: list[int] = Field(description="For query head h, the key/value head "
                                             "it reads: h // (n_heads // n_kv_heads) (Hugging "
                                             "Face's repeat_kv). Recorded k/v (and hook_k/"
                                             "hook_v) are on the key/value heads.")
    sliding_window: int | None = Field(None, description="Largest sliding key window of any "
                                       "layer (a query sees its `window` latest keys, itself "
                                       "included); null when every layer attends to all "
                                       "earlier keys.")
    sliding_window_layers: list[int | None] | None = Field(
        None, description="Per layer, its sliding window or null (full attention); null when "
        "no layer has one (Mistral: every layer; Gemma 2: alternate layers).")
    attn_logit_softcap: float | None = Field(None, description="Attention logit soft-cap c "
                                             "(Gemma 2: scores -> c * tanh(scores / c) before "
                                             "the mask); null without.")
    final_logit_softcap: float | None = Field(None, description="Final logit soft-cap (Gemma "
                                              "2: logits -> c * tanh(logits / c)); null "
                                              "without.")
    norm: str = Field(description="Normalisation: 'layernorm', 'rmsnorm' (x / rms(x) * w) or "
                      "'rmsnorm_1p' (Gemma: x / rms(x) * (1 + w)).")
    parallel_residual: bool = Field(description="Attention and MLP read the same residual "
                                    "stream and are added together (GPT-NeoX "
                                    "use_parallel_residual).")
    qkv_bias: bool = Field(description="The q/k/v projections have biases.")
    scaling: list[float] = Field(description="Per layer, the q.k multiplier (1/sqrt(d_head); "
                                 "GPT-2 may divide by layer+1; Gemma 2: "
                                 "query_pre_attn_scalar**-0.5).")


class ModelInfo(LenientModel):
    """GET /v1/model: the resident model."""

    id: str = Field(description="Model id (hub id or local directory) as loaded.")
    revision: str = Field(description="Hub commit hash, or 'sha256:<12 hex>' of a local checkpoint's weights, config and tokenizer files (every file that changes the numbers).")
    requested: str = Field(description="The model the settings asked for.")
    fallback: bool = Field(
        description="True when the requested model could not be had and the bundled checkpoint "
        "was loaded instead."
    )
    fallback_reason: str | None = Field(None, description="Why the fallback happened.")
    architecture: str = Field(description="Hugging Face architecture class, e.g. GPT2LMHeadModel.")
    family: str = Field(description="Adapter family: 'gpt2', 'bert', 'llama', 'mistral', "
                        "'qwen2', 'gemma', 'gemma2' or 'gpt_neox' (Pythia).")
    causal: bool = Field(description="True when attention is causal (a key never follows its query).")
    n_layers: int = Field(description="Number of transformer blocks.")
    n_heads: int = Field(description="Attention heads per layer.")
    d_model: int = Field(description="Residual stream width.")
    d_head: int = Field(description="Width of one head's query/key/value.")
    n_kv_heads: int | None = Field(None, description="Key/value heads per layer (fewer than "
                                   "n_heads under grouped-query attention).")
    attention: AttentionFacts | None = Field(None, description="How attention is built: "
                                             "positions, rotary, key/value heads, sliding "
                                             "windows, soft-caps, norm, parallel residual.")
    n_ctx: int = Field(description="Maximum tokens per text (context length), framing included.")
    vocab_size: int = Field(description="Vocabulary size.")
    device: str = Field(description="Torch device, e.g. 'cpu' or 'cuda:0'.")
    dtype: str = Field(description="Torch dtype of the weights, e.g. 'float32'. Every served "
                       "number is computed in it; float16/bfloat16 drift from float32 (README "
                       "'Numerical precision': patterns up to ~1e-2 / ~7e-2 at T ~ 250).")
    attn_implementation: str = Field(
        "eager", description="Hugging Face attention implementation the model runs with "
        "('eager': the only one that returns attention patterns).")
    bos_token: str | None = Field(None, description="BOS token string (causal models), if any.")
    add_bos_default: bool = Field(
        False, description="What a request's add_bos null means on this model: true for "
        "causal models with a BOS token (BOS prepended to every text, as TransformerLens "
        "does), false for encoders (their own [CLS] ... [SEP] framing).")


class ErrorBody(LenientModel):
    type: str = Field(
        description="Machine-readable error type (branch on this): "
        + ", ".join(f"{t} ({s})" for t, s in ERROR_TYPES.items()) + "."
    )
    message: str = Field(description="Human-readable message naming the field, limit and value.")
    param: str | None = Field(None, description="The request field at fault, dotted, if any.")


class ErrorResponse(LenientModel):
    """The one error envelope of every non-2xx response."""

    error: ErrorBody


def _not_blank(v: str) -> str:
    if not v.strip():
        raise ValueError("text must contain at least one non-whitespace character")
    return v


NonBlankText = Annotated[str, AfterValidator(_not_blank),
                         Field(json_schema_extra={"pattern": NON_BLANK_PATTERN})]


#: the text of the request examples in the OpenAPI document (/docs "Try it out" sends them)
EXAMPLE_TEXT = "When Mary and John went to the store, John gave a drink to"


def example(**body: Any) -> ConfigDict:
    """A request model's config with ``body`` as its OpenAPI example (a body that the
    service answers with 200 on any causal model: tests/test_api.py sends every one)."""
    return ConfigDict(json_schema_extra={"examples": [body]})


#: ``add_bos`` of a request (every request that takes text): one convention on every endpoint.
ADD_BOS_DOC = (
    "Prepend the BOS token to the texts (not to token ids, which are used exactly as given). "
    "null (the default) = the model's convention: true for causal models whose tokenizer has "
    "a BOS token (GPT-2: <|endoftext|>, id 50256; the bundled model: id 0), as "
    "TransformerLens' to_tokens prepends it on every call and as GPT-2 was trained with it "
    "between documents; false for encoders, which always get their own framing ([CLS] ... "
    "[SEP]; true is a 422 there). false = the text's own tokens only, as the source "
    "documents tokenize. The value used is echoed in the response's add_bos. With token ids "
    "only, true is a 422 (put the BOS id first) and null means false."
)
#: ``add_bos`` of a response: what was done.
ADD_BOS_ECHO_DOC = (
    "Whether the BOS token was prepended to the request's texts: the request's add_bos, or "
    "where it was null the model's convention (GPT-2 family: true; encoders: false). False "
    "when only token ids were given (ids are used exactly as given)."
)
#: ``tokens`` of a request: token ids instead of a text.
TOKENS_DOC = (
    "Instead of {text}: the token ids of one sequence, used exactly as given (no BOS, no "
    "framing added; add_bos applies to text only), as TransformerLens' run_with_cache(tokens) "
    "takes them. Each id in 0..vocab_size-1, at most n_ctx ids (else 422 naming the position "
    "or the count and the limit). Labels are the tokenizer's own pieces; offsets are null. "
    f"At most {MAX_POSITIONS} ids."
)
TOKEN_LISTS_DOC = (
    "Instead of {texts}: several token-id sequences (each as 'tokens' is), analysed "
    "independently; results in order. At most max_batch sequences."
)

TokenIds = Annotated[list[int], Field(min_length=1, max_length=MAX_POSITIONS, fail_fast=True,
                                      json_schema_extra={INDEX_MARK: "token"})]
"""One sequence of token ids (non-empty; each id checked against the model's vocabulary). A
field of one sequence spells these constraints in its own Field (so the length is checked
first, StrictModel)."""


def tokens_field(text_field: str) -> str:
    """The token-id twin of a text field: ``text`` -> ``tokens``, ``clean_text`` ->
    ``clean_tokens``, ``texts`` -> ``token_lists``, ``reference_texts`` ->
    ``reference_token_lists``."""
    if text_field.endswith("texts"):
        return text_field[: -len("texts")] + "token_lists"
    return text_field[: -len("text")] + "tokens"


def add_bos_field() -> Any:
    """The ``add_bos`` field of a request (null = the model's convention)."""
    return Field(None, description=ADD_BOS_DOC)


def add_bos_echo() -> Any:
    """The ``add_bos`` field of a response (the value used)."""
    return Field(False, description=ADD_BOS_ECHO_DOC)


def one_input(model: BaseModel, text_field: str, required: bool = True) -> None:
    """Raise ValueError unless ``model`` gives exactly one (``required``) or at most one of
    ``text_field`` and its token-id twin."""
    ids_field = tokens_field(text_field)
    given = [n for n in (text_field, ids_field) if getattr(model, n) is not None]
    if len(given) > 1:
        raise ValueError(f"give either '{text_field}' or '{ids_field}', not both")
    if required and not given:
        raise ValueError(f"give '{text_field}' (a text) or '{ids_field}' (token ids)")


class TextOrTexts(StrictModel):
    """Mixin: exactly one of ``text``, ``texts`` (strings), ``tokens``, ``token_lists``
    (token ids, used as given)."""

    model_config = example(text=EXAMPLE_TEXT)
    json_rules = (one_of("text", "texts", "tokens", "token_lists"), TOKEN_IDS_AS_GIVEN)

    text: str | None = Field(
        None, json_schema_extra=NON_BLANK, description="One text. Always treated as text: strings that spell special tokens "
        "are tokenized as plain text."
    )
    texts: list[NonBlankText] | None = Field(
        None, max_length=MAX_TEXTS, fail_fast=True, json_schema_extra=BATCH,
        description="Several texts (a batch), analysed independently; results in order. At "
        f"most max_batch (a setting, default 32; never more than {MAX_TEXTS}).",
    )
    tokens: list[int] | None = Field(
        None, min_length=1, max_length=MAX_POSITIONS, fail_fast=True,
        json_schema_extra=index_of("token"), description=TOKENS_DOC.format(text="text"))
    token_lists: list[TokenIds] | None = Field(
        None, max_length=MAX_TEXTS, fail_fast=True, json_schema_extra=BATCH,
        description=TOKEN_LISTS_DOC.format(texts="texts"))
    add_bos: bool | None = add_bos_field()

    @model_validator(mode="after")
    def _one_of(self):
        given = [n for n in ("text", "texts", "tokens", "token_lists") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of 'text', 'texts', 'tokens' or 'token_lists'"
                             + (f" (got {', '.join(given)})" if given else ""))
        return self

    @field_validator("text")
    @classmethod
    def _text_not_blank(cls, v):
        if v is not None and not v.strip():
            raise ValueError("text must contain at least one non-whitespace character")
        return v

    @field_validator("texts", "token_lists")
    @classmethod
    def _texts_not_empty(cls, v, info):
        if v is not None and len(v) == 0:
            raise ValueError(f"{info.field_name} must hold at least 1 "
                             f"{'text' if info.field_name == 'texts' else 'sequence'}")
        return v

    @property
    def single(self) -> bool:
        """One input (``text`` or ``tokens``): the response has one result, not ``results``."""
        return self.text is not None or self.tokens is not None

    def input_param(self, i: int = 0) -> str:
        """The request field of input ``i``: ``text``, ``tokens``, ``texts.i`` or
        ``token_lists.i`` (the ``param`` of its errors)."""
        if self.text is not None:
            return "text"
        if self.tokens is not None:
            return "tokens"
        return f"texts.{i}" if self.texts is not None else f"token_lists.{i}"

    def all_texts(self) -> list[str]:
        return [self.text] if self.text is not None else list(self.texts or [])
