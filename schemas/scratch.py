"""POST /v1/scratch-attention: the textbook scaled dot-product attention on raw inputs.

Sources: ``attention(Q, K, V, mask)``, ``project_embeddings`` and the attention variants (self,
causal, cross, multi-head split) of 000_1c89b6c8c2a32040.txt; attention without scaling on a
toy embedding of 001_92e9928af52718c3.txt.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from .common import (
    LenientModel, ModelRef, TensorField, TensorOptions, Token, example)
from .common import ADD_BOS_DOC, add_bos_echo, one_input
from .common import AT_MOST_MARK, _schema_extra
from .common import NON_BLANK, equals, ids_as_given, index_of, one_of, present, unset, when

MAX_POS = 512
"""Most rows (positions) a q/k/v matrix may have."""
MAX_DIM = 1024
"""Most columns (vector width) a q/k/v matrix may have."""
MAX_ELEMENTS = 65536
"""Most numbers in one q/k/v matrix."""
MAX_WEIGHTS = 4_194_304
"""Most numbers in the weights (and in the scores) of one response: n_heads x query_pos x
key_pos (e.g. 16 heads x 512 x 512). Larger requests get a 422 before any work."""

Variant = Literal["self", "causal", "cross"]


def _check_matrix(v: list[list[float]] | None, name: str) -> list[list[float]] | None:
    if v is None:
        return v
    if len(v) == 0:
        raise ValueError(f"{name} must have at least 1 row")
    width = len(v[0])
    if width == 0:
        raise ValueError(f"{name} rows must have at least 1 number")
    for i, row in enumerate(v):
        if len(row) != width:
            raise ValueError(
                f"{name} must be a rectangular matrix [pos, d]: row 0 has {width} numbers but "
                f"row {i} has {len(row)}"
            )
    if len(v) * width > MAX_ELEMENTS:
        raise ValueError(
            f"{name} has {len(v)} x {width} = {len(v) * width} numbers; the limit is {MAX_ELEMENTS}"
        )
    for i, row in enumerate(v):
        for j, x in enumerate(row):
            if not math.isfinite(x):
                raise ValueError(f"{name}[{i}][{j}] is {x}; every number must be finite")
    return v


Matrix = Annotated[list[Annotated[list[float], Field(max_length=MAX_DIM, fail_fast=True,
                                                    json_schema_extra={"minItems": 1})]],
                   Field(json_schema_extra={"minItems": 1})]
"""A q/k/v matrix ``[pos, d]``: at most MAX_DIM numbers a row, validation stopping at the first
invalid number (a row of a million strings costs one error)."""


class ScratchAttentionRequest(TensorOptions):
    """softmax(Q K^T / sqrt(d_k) + mask) V on matrices you give, or on a text's static token
    embeddings. Give either all of ``q``, ``k``, ``v`` or ``text``."""

    model_config = example(text="The cat sat on the mat")
    json_rules = (
        {"anyOf": [  # q, k and v (nothing of the text source), or a text / token ids
            {"allOf": [present("q", "k", "v"),
                       unset("text", "tokens", "query_text", "query_tokens", "project"),
                       {"properties": {"add_bos": {"not": {"const": True}}}}]},
            {"allOf": [unset("q", "k", "v"), one_of("text", "tokens")]}]},
        ids_as_given("tokens"),
        one_of((), "query_text", "query_tokens"),
        when({"anyOf": [present("query_text"), present("query_tokens")]},
             equals("variant", "cross", "self")),
    )

    q: Matrix | None = Field(
        None, max_length=MAX_POS, fail_fast=True,
        description=f"Queries [query_pos, d_k] (at most {MAX_POS} rows, {MAX_DIM} columns, "
        f"{MAX_ELEMENTS} numbers; finite).",
    )
    k: Matrix | None = Field(
        None, max_length=MAX_POS, fail_fast=True,
        description="Keys [key_pos, d_k] (same width as q; the same limits)."
    )
    v: Matrix | None = Field(
        None, max_length=MAX_POS, fail_fast=True,
        description="Values [key_pos, d_v] (same rows as k; the same limits)."
    )
    text: str | None = Field(
        None, json_schema_extra=NON_BLANK,
        description="Instead of q/k/v: the text whose static token embeddings (the model's "
        "input embedding matrix rows, float64, no positions) are Q = K = V (source "
        "000_1c89b6c8c2a32040.txt, 'Implementing attention').",
    )
    query_text: str | None = Field(
        None, json_schema_extra=NON_BLANK,
        description="Variant 'cross' with 'text': the queries are this text's token embeddings; "
        "when absent the queries are seeded uniform random numbers in [0, 1) shaped like the keys "
        "(the source's torch.rand_like).",
    )
    tokens: list[int] | None = Field(
        None, min_length=1, max_length=MAX_POS, fail_fast=True,
        json_schema_extra=index_of("token"),
        description="Instead of q/k/v or text: token ids whose embeddings are used, exactly as "
        "given (no BOS added; each in 0..vocab_size-1, at most n_ctx)."
    )
    query_tokens: list[int] | None = Field(
        None, min_length=1, max_length=MAX_POS, fail_fast=True,
        json_schema_extra=index_of("token"),
        description="Instead of query_text: the queries' token ids, exactly as given."
    )
    add_bos: bool | None = Field(
        None, description="'text' source: " + ADD_BOS_DOC
    )
    project: int | None = Field(
        None, ge=1, le=MAX_DIM, json_schema_extra=_schema_extra("integer", **{AT_MOST_MARK: "d_model"}),
        description="'text' source: project Q and K (not V) onto this many PCA components fitted "
        "on the whole embedding matrix (whiten=True; the exact PCA, equal to scikit-learn's "
        "svd_solver='full' with its signs, of which the source's project_embeddings' "
        "svd_solver='randomized' is an approximation; deterministic, seed-independent); "
        "null = no projection. At most min(vocab, d_model).",
    )
    variant: Variant = Field(
        "self",
        description="'self': no mask; 'causal': a key never follows its query "
        "(tril mask; needs as many queries as keys); 'cross': queries from another sequence "
        "(query_text, or seeded random), no mask.",
    )
    n_heads: int = Field(
        1, ge=1, le=64,
        description="Multi-head split: the width of Q/K and of V is split into n_heads equal "
        "slices (must divide both), attention runs per head, outputs are concatenated. "
        f"n_heads x query_pos x key_pos may be at most {MAX_WEIGHTS}.",
    )
    scale: bool = Field(
        True,
        description="Divide the scores by sqrt(d_k) (d_k = per-head key width). Off reproduces "
        "the unscaled toy example of 001_92e9928af52718c3.txt.",
    )
    seed: int = Field(
        0, ge=0, le=2**32 - 1,
        description="Seed of the random queries (cross without query_text). The PCA of "
        "'project' is exact and uses no seed.",
    )

    @field_validator("q", "k", "v")
    @classmethod
    def _matrix(cls, v, info):
        v = _check_matrix(v, info.field_name)
        if v is not None and len(v[0]) > MAX_DIM:
            raise ValueError(
                f"{info.field_name} rows have {len(v[0])} numbers; the limit is {MAX_DIM}"
            )
        return v

    @field_validator("text", "query_text")
    @classmethod
    def _not_blank(cls, v):
        if v is not None and not v.strip():
            raise ValueError("text must contain at least one non-whitespace character")
        return v

    @model_validator(mode="after")
    def _source(self):
        given = [n for n in ("q", "k", "v") if getattr(self, n) is not None]
        one_input(self, "text", required=False)
        one_input(self, "query_text", required=False)
        source = "text" if self.text is not None else ("tokens" if self.tokens is not None
                                                        else None)
        if given and source is not None:
            raise ValueError(f"give either q, k and v or {source}, not both")
        if given and len(given) < 3:
            missing = [n for n in ("q", "k", "v") if n not in given]
            raise ValueError(f"q, k and v go together; missing: {', '.join(missing)}")
        if not given and source is None:
            raise ValueError("give q, k and v (matrices [pos, d]), text or tokens")
        if given:
            for name in ("query_text", "query_tokens", "project"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} applies to the 'text' source only")
            if self.add_bos:
                raise ValueError("add_bos applies to the 'text' source only")
        query = "query_text" if self.query_text is not None else "query_tokens"
        if getattr(self, query) is not None and self.variant != "cross":
            raise ValueError(
                f"{query} applies to variant 'cross' only (variant is {self.variant!r})"
            )
        return self


class ScratchAttentionResponse(LenientModel):
    model: ModelRef | None = Field(None, description="The model whose embeddings were used ('text' source).")
    add_bos: bool = add_bos_echo()
    source: Literal["matrices", "embeddings"] = Field(description="Where Q, K and V came from.")
    variant: Variant = Field(description="The attention variant.")
    n_heads: int = Field(description="Number of heads the widths were split into.")
    d_k: int = Field(description="Per-head query/key width.")
    d_v: int = Field(description="Per-head value width.")
    scaling: float = Field(description="The multiplier applied to Q K^T: 1/sqrt(d_k), or 1 unscaled.")
    tokens: list[Token] | None = Field(None, description="Key/value tokens ('text' source).")
    query_tokens: list[Token] | None = Field(
        None, description="Query tokens ('text' source; null for random queries)."
    )
    weights: TensorField = Field(
        description="Attention weights (post-softmax) [head, query_pos, key_pos], each row sums "
        "to 1 over key_pos, in [0, 1]; the head axis has length 1 without a split."
    )
    scores: TensorField = Field(
        description="Pre-softmax scores Q K^T * scaling [head, query_pos, key_pos]; masked "
        "entries null (json) / -inf (base64)."
    )
    output: TensorField = Field(
        description="weights @ V with heads concatenated: [query_pos, n_heads * d_v] (the "
        "width of v)."
    )
