"""``Client`` and ``AsyncClient``: one base, two transports (openai-python's shape).

Configuration (argument, else environment, else default):

* ``base_url``: ``ATTNSCOPE_BASE_URL``, default ``http://127.0.0.1:8000`` (the one variable
  for the server address, also read by the command line; ``ATTNSCOPE_URL`` is accepted as a
  deprecated alias, with a warning, when ``ATTNSCOPE_BASE_URL`` is not set);
* ``api_key``: ``ATTNSCOPE_API_KEY``, sent as ``Authorization: Bearer <key>``; none = no header;
* ``timeout``: seconds or an ``httpx.Timeout`` (default 60 s, 5 s to connect);
* ``max_retries``: extra attempts after the first (default 2; every endpoint is a pure read,
  so a POST is safe to repeat) on connection errors,
  timeouts, 408, 429 and 5xx (not on ``non_finite_values``, which is deterministic). The wait
  is the server's ``Retry-After`` (seconds or HTTP date; ``retry-after-ms`` too) when it gives
  one up to 60 s, else exponential backoff ``0.5 s * 2**attempt`` capped at 8 s, minus up to
  25 % jitter;
* ``http_client``: an ``httpx.Client`` / ``httpx.AsyncClient`` to send through (tests pass the
  in-process app, e.g. starlette's ``TestClient``); the caller keeps ownership of it.

Tensor forms: every method takes the request's own encoding options (``encoding``, ``layout``,
``sparse``, ...) and ``binary=True`` asks for an ``application/x-safetensors`` response (raw
tensor bytes); ``.numpy()`` decodes every form the same way.

Each endpoint method builds the request with the shared schema model (so a typo in an option
or an empty text raises :class:`RequestValidationError` before anything is sent), posts it,
and returns the response schema model with ``.numpy()`` on every tensor field. Errors: see
``_errors.py``.
"""

from __future__ import annotations

import asyncio
import email.utils
import importlib
import inspect
import os
import random
import time
import warnings
from typing import Any, Mapping, Sequence, TypeVar

import httpx
import orjson
import pydantic
from pydantic import BaseModel

from ._errors import (
    APIConnectionError,
    APIResponseValidationError,
    APIStatusError,
    APITimeoutError,
    RequestValidationError,
    status_error,
)
from . import wire

#: the media type of a streamed response: progress lines, then the body (docs/api.md)
NDJSON = "application/x-ndjson"
from ._tensors import attach_numpy
from .notebook import view_class
from .run import RunOutput, run_output
from attnscope.schemas import HooksResponse, RunRequest
from attnscope.schemas import (
    AttentionRequest,
    AttentionResponse,
    ModelInfo,
    TokenizeRequest,
    TokenizeResponse,
)
from attnscope.schemas.heads import HeadsRequest, HeadsResponse
from attnscope.schemas.interventions import (
    AblateRequest, AblateResponse, PatchRequest, PatchResponse, PredictionsRequest,
    PredictionsResponse,
)
from attnscope.schemas.links import LinksRequest, LinksResponse
from attnscope.schemas.path_patch import PathPatchRequest, PathPatchResponse
from attnscope.schemas.lens import (
    LogitAttributionRequest, LogitAttributionResponse, LogitLensRequest, LogitLensResponse,
)
from attnscope.schemas.circuits import CircuitsRequest, CircuitsResponse
from attnscope.schemas.scratch import ScratchAttentionRequest, ScratchAttentionResponse
from attnscope.schemas.trajectories import TrajectoriesRequest, TrajectoriesResponse
from attnscope.schemas.verify import VerifyRequest, VerifyResponse
from attnscope.schemas.norms import NormsRequest, NormsResponse
from attnscope.schemas.rollout import RolloutRequest, RolloutResponse

__version__ = "0.1.0"
DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT = httpx.Timeout(60.0, connect=5.0)
DEFAULT_MAX_RETRIES = 2
BASE_URL_ENV = "ATTNSCOPE_BASE_URL"
DEPRECATED_URL_ENV = "ATTNSCOPE_URL"  # the command line's variable before 0.2
API_KEY_ENV = "ATTNSCOPE_API_KEY"
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
NO_RETRY_TYPES = frozenset({"non_finite_values"})

M = TypeVar("M", bound=BaseModel)


def parse_retry_after(headers: httpx.Headers) -> float | None:
    """Seconds to wait from ``retry-after-ms`` or ``Retry-After`` (seconds or HTTP date)."""
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            return float(ms) / 1000.0
        except ValueError:
            pass
    ra = headers.get("retry-after")
    if ra is None:
        return None
    try:
        return float(ra)
    except ValueError:
        pass
    parsed = email.utils.parsedate_tz(ra)
    if parsed is None:
        return None
    return email.utils.mktime_tz(parsed) - time.time()


def resolve_base_url(base_url: str | None = None, warn=None) -> str | None:
    """The server address: ``base_url`` if given, else ``ATTNSCOPE_BASE_URL``, else the
    deprecated ``ATTNSCOPE_URL`` (with a ``DeprecationWarning``, or ``warn(message)`` when
    given), else None (the caller's default). When both variables are set and differ,
    ``ATTNSCOPE_BASE_URL`` wins and the warning says that ``ATTNSCOPE_URL`` was ignored."""
    if base_url:
        return base_url
    new, old = os.environ.get(BASE_URL_ENV) or None, os.environ.get(DEPRECATED_URL_ENV) or None
    msg = None
    if old is not None and new is None:
        msg = (f"{DEPRECATED_URL_ENV} is deprecated: set {BASE_URL_ENV} instead (using "
               f"{DEPRECATED_URL_ENV}={old})")
        new = old
    elif old is not None and old.rstrip("/") != new.rstrip("/"):
        msg = (f"{DEPRECATED_URL_ENV}={old} is ignored: {BASE_URL_ENV}={new} is the server "
               f"address ({DEPRECATED_URL_ENV} is deprecated)")
    if msg is not None:
        if warn is not None:
            warn(msg)
        else:
            warnings.warn(msg, DeprecationWarning, stacklevel=3)
    return new


def _tl_heads(heads: Any) -> Any:
    """``[[layer, head], ...]`` from TransformerLens' forms of a head selection: a list of
    ``(layer, head)`` pairs or a ``{layer: [head, ...]}`` dict (``detect_head(heads=...)``),
    or a numpy array / tensor ``[n, 2]``; numpy integers become ints. Anything else is passed
    on for the request schema to refuse (naming the field)."""
    if hasattr(heads, "tolist"):
        heads = heads.tolist()
    if isinstance(heads, Mapping):
        return [[int(layer), int(h)] for layer, hs in heads.items() for h in hs]
    if isinstance(heads, (list, tuple)):
        return [p.tolist() if hasattr(p, "tolist") else (
            [int(x) for x in p] if isinstance(p, (list, tuple)) and all(
                isinstance(x, int) or type(x).__module__ == "numpy" for x in p) else p)
            for p in heads]
    return heads


class BaseClient:
    """What Client and AsyncClient share: configuration, request building, retry policy,
    error mapping and response parsing. Not used directly."""

    INITIAL_RETRY_DELAY = 0.5
    MAX_RETRY_DELAY = 8.0
    MAX_RETRY_AFTER = 60.0

    def __init__(self, base_url: str | None, api_key: str | None, timeout: Any,
                 max_retries: int, http_client: httpx.Client | httpx.AsyncClient | None,
                 default_headers: dict[str, str] | None):
        if base_url is None:
            base_url = resolve_base_url()
        if base_url is None and http_client is not None and str(http_client.base_url):
            base_url = str(http_client.base_url)
        self.base_url = (base_url or DEFAULT_BASE_URL).rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        self.timeout = timeout if timeout is not None else DEFAULT_TIMEOUT
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.max_retries = max_retries
        self._owns_http = http_client is None
        self._default_headers = dict(default_headers or {})

    @staticmethod
    def _lib(http) -> Any:
        """The httpx-compatible module ``http`` comes from (httpx, or httpx2 for starlette's
        TestClient): its exception classes are the ones its transport raises."""
        root = "httpx"
        for cls in type(http).__mro__:
            root = cls.__module__.split(".")[0]
            if root.startswith("httpx"):
                break
        try:
            lib = importlib.import_module(root)
        except ImportError:  # pragma: no cover
            return httpx
        ok = all(hasattr(lib, n) for n in ("TimeoutException", "TransportError", "HTTPStatusError"))
        return lib if ok else httpx

    # -- building ---------------------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        h = {"accept": "application/json", "user-agent": f"attnscope-client/{__version__}"}
        if self.api_key:
            h["authorization"] = f"Bearer {self.api_key}"
        h.update(self._default_headers)
        return h

    def _build(self, http, method: str, path: str, body: Any,
               binary: bool = False) -> httpx.Request:
        url = path if path.startswith(("http://", "https://")) else self.base_url + path
        headers = self._headers()
        if binary:
            headers["accept"] = f"{wire.SAFETENSORS}, application/json;q=0.5"
        return http.build_request(method, url, json=body, headers=headers,
                                  timeout=self._timeout_arg())

    def _timeout_arg(self) -> Any:
        """``self.timeout`` in a form every httpx-compatible client takes: a number or None as
        given, an ``httpx.Timeout`` as its (connect, read, write, pool) tuple (httpx2, which
        starlette's TestClient uses, refuses another library's Timeout object)."""
        t = self.timeout
        if isinstance(t, (int, float)) or t is None:
            return t
        if all(hasattr(t, n) for n in ("connect", "read", "write", "pool")):
            return (t.connect, t.read, t.write, t.pool)
        return t

    # -- retry policy -----------------------------------------------------------------------
    @staticmethod
    def _should_retry(response: httpx.Response) -> bool:
        if response.headers.get("x-should-retry") == "false":
            return False
        if response.status_code not in RETRY_STATUSES:
            return False
        try:
            etype = response.json().get("error", {}).get("type")
        except (ValueError, AttributeError):
            etype = None
        return etype not in NO_RETRY_TYPES

    def _retry_delay(self, attempt: int, response: httpx.Response | None) -> float:
        """Seconds before retry number ``attempt`` (0-based): Retry-After when given and
        <= 60 s, else ``INITIAL_RETRY_DELAY * 2**attempt`` capped at ``MAX_RETRY_DELAY``,
        with up to 25 % jitter subtracted."""
        if response is not None:
            ra = parse_retry_after(response.headers)
            if ra is not None and 0 <= ra <= self.MAX_RETRY_AFTER:
                return ra
        delay = min(self.INITIAL_RETRY_DELAY * 2.0 ** attempt, self.MAX_RETRY_DELAY)
        return delay * (1.0 - 0.25 * random.random())

    # -- results ----------------------------------------------------------------------------
    @staticmethod
    def _parse(response: httpx.Response, cast_to: type[M] | None) -> Any:
        arrays = None
        try:
            if response.headers.get("content-type", "").startswith(wire.SAFETENSORS):
                if cast_to is None:
                    return wire.decode_binary_response(response.content)
                data, arrays = wire.read_safetensors(response.content)
            else:
                # orjson (~3x faster than the standard library on big tensor bodies); big
                # base64 texts cut out first, never parsed as JSON strings (wire.loads)
                data = wire.loads(response.content, as_text=True)
        except ValueError as exc:
            raise APIResponseValidationError(
                f"the service answered {response.status_code} with a body that is not JSON",
                response) from exc
        if cast_to is None:
            return data
        try:
            # notebook.view_class: the same class with _repr_html_ (Jupyter shows the view)
            return attach_numpy(view_class(cast_to).model_validate(data), arrays)
        except pydantic.ValidationError as exc:
            raise APIResponseValidationError(
                f"the {response.request.url.path} answer does not fit {cast_to.__name__}: {exc}",
                response, data) from exc

    def _raise_status(self, response: httpx.Response):
        try:
            response.raise_for_status()
        except self._x.HTTPStatusError as exc:
            raise status_error(response) from exc

    # -- streamed progress (docs/api.md "Streamed progress") ----------------------------------
    def _stream_request(self, method: str, path: str, body: Any) -> httpx.Request:
        request = self._build(self._http, method, path, body)
        request.headers["accept"] = f"{NDJSON}, application/json;q=0.5"
        return request

    @staticmethod
    def _stream_line(response: httpx.Response, line: str, cast_to, on_progress):
        """One NDJSON line: a progress line -> ``on_progress(done, total, unit)`` (returns its
        result, maybe awaitable), the body -> ``("done", parsed)``, an error line -> raises the
        typed error of the status the job would have had."""
        try:
            data = orjson.loads(line)
        except ValueError as exc:
            raise APIResponseValidationError("a streamed line is not JSON", response) from exc
        if isinstance(data, dict) and set(data) == {"progress"}:
            p = data["progress"]
            return None if on_progress is None else on_progress(
                int(p["done"]), int(p["total"]), str(p.get("unit", "")))
        if isinstance(data, dict) and isinstance(data.get("error"), dict) and \
                set(data) <= {"error", "status"}:
            status = int(data.get("status") or 500)
            raise status_error(type(response)(status, json={"error": data["error"]},
                                              request=response.request))
        if cast_to is None:
            return ("done", data)
        try:
            return ("done", attach_numpy(view_class(cast_to).model_validate(data), None))
        except pydantic.ValidationError as exc:
            raise APIResponseValidationError(
                f"the {response.request.url.path} answer does not fit {cast_to.__name__}: {exc}",
                response, data) from exc

    @staticmethod
    def _stream_cut(response: httpx.Response):
        return APIConnectionError("the streamed response ended before its last line (the body "
                                  "or an error)", response.request)


def _validated(request_model: type[M], path: str, **fields) -> M:
    """``request_model(**fields)``; raises :class:`RequestValidationError` (not pydantic's
    error) when the fields do not fit it."""
    try:
        return request_model(**fields)
    except pydantic.ValidationError as exc:
        raise RequestValidationError.from_pydantic(exc, f"{path} request") from exc


def _head_pairs(heads: Any) -> list[list[int]]:
    """``heads`` (pairs, or a numpy array / tensor ``[n, 2]``) as ``[[layer, head], ...]``;
    raises :class:`RequestValidationError` for a flat pair (``(1, 0)``: give ``[(1, 0)]``) or
    anything else that is not a list of pairs."""
    if hasattr(heads, "tolist"):  # a numpy array or torch tensor [n, 2]: plain ints
        heads = heads.tolist()
    try:
        pairs = [h.tolist() if hasattr(h, "tolist") else list(h) for h in heads]
    except TypeError:
        raise RequestValidationError(
            f"invalid /v1/ablate request: heads: give a list of [layer, head] pairs, e.g. "
            f"[[1, 0]] or [(1, 0), (1, 3)]; got {heads!r}", "heads") from None
    return pairs


class _Endpoints:
    """One method per endpoint, written once for both clients: ``_call`` is synchronous in
    :class:`Client` and a coroutine in :class:`AsyncClient` (so ``await`` the methods there)."""

    def _call(self, method: str, path: str, body: Any, cast_to,
              binary: bool = False):  # pragma: no cover
        raise NotImplementedError

    def _call_stream(self, method: str, path: str, body: Any, cast_to,
                     on_progress):  # pragma: no cover
        raise NotImplementedError

    def _post_model(self, path: str, request_model: type[BaseModel], response_model,
                    text: str | list[str] | None, texts: list[str] | None, options: dict):
        if isinstance(text, (list, tuple)):
            if texts is not None:
                raise RequestValidationError("give text or texts, not both", "texts")
            text, texts = None, list(text)
        fields: dict[str, Any] = dict(options)
        binary = bool(fields.pop("binary", False))
        if text is not None:
            fields["text"] = text
        if texts is not None:
            fields["texts"] = texts
        req = _validated(request_model, path, **fields)
        body = req.model_dump(mode="json", exclude_unset=True)
        return self._call("POST", path, body, response_model, binary)

    def request(self, method: str, path: str, json: Any = None, cast_to: type[M] | None = None):
        """Send any request: ``path`` relative to ``base_url``; returns ``cast_to`` parsed (with
        ``.numpy()`` on tensors) or the decoded JSON. Same retries and errors as the methods."""
        return self._call(method, path, json, cast_to)

    def health(self):
        """``GET /healthz`` -> ``{"status": "ok"}`` while the process serves HTTP."""
        return self._call("GET", "/healthz", None, None)

    def ready(self):
        """``GET /readyz`` -> ``{"status": "ready", "model": id}``; :class:`NotReadyError` (503,
        after retries) while the model loads."""
        return self._call("GET", "/readyz", None, None)

    def model(self) -> ModelInfo:
        """``GET /v1/model``: id, revision, architecture, causal, n_layers, n_heads, d_model,
        d_head, n_ctx, vocab_size, device, dtype, fallback."""
        return self._call("GET", "/v1/model", None, ModelInfo)

    def tokenize(self, text: str | list[str] | None = None, *, texts: list[str] | None = None,
                 **options) -> TokenizeResponse:
        """``POST /v1/tokenize``: tokens as the analyses see them (``.tokens`` for one text,
        ``.results`` for a list). Options: ``add_bos``.

        Every text method also takes token ids instead of text: ``tokens=[...]`` (one
        sequence) or ``token_lists=[[...], ...]``, used exactly as given (no BOS added);
        ``add_bos`` (default None = the model's convention: BOS for GPT-2) applies to text.
        ``ablate``: ``reference_token_lists``, ``resample_tokens``; ``patch``:
        ``clean_tokens``, ``corrupted_tokens``; ``scratch_attention``: ``tokens``,
        ``query_tokens``. Responses echo the ``add_bos`` used."""
        return self._post_model("/v1/tokenize", TokenizeRequest, TokenizeResponse, text, texts,
                                options)

    def attention(self, text: str | list[str] | None = None, *, texts: list[str] | None = None,
                  **options) -> AttentionResponse:
        """``POST /v1/attention``: patterns ``[layer, head, query_pos, key_pos]`` (``[layer,
        query_pos, key_pos]`` with ``head_mean``) for one text (``.attention``) or a list
        (``.results``). Options (``AttentionRequest``): ``layers``, ``heads``, ``head_mean``,
        ``include_scores``, ``add_bos``, ``encoding`` ('json'|'base64'), ``dtype``, ``round``.
        ``.attention.pattern.numpy()`` is a float32 array; masked scores are ``-inf``."""
        return self._post_model("/v1/attention", AttentionRequest, AttentionResponse, text,
                                texts, options)

    def heads(self, text: str | list[str] | None = None, *, texts: list[str] | None = None,
              error_measure: str | None = None, heads: Any = None, exclude_heads: Any = None,
              **options) -> HeadsResponse:
        """``POST /v1/heads``: scores (previous_token, duplicate_token, induction, next_token,
        self, sink, entropy, ...) and a label for every head, layer-major (``.heads``); several
        texts are averaged. ``error_measure``: ``"mul"`` (default) or ``"abs"``, TransformerLens
        4.3 ``detect_head``'s; ``heads``: the heads to score, as TransformerLens takes them (a
        list of ``(layer, head)`` pairs or a ``{layer: [head, ...]}`` dict; None = all; the
        response lists only those, where detect_head gives the others -1); ``exclude_heads``:
        heads to leave out (same forms). Other options (``HeadsRequest``): ``thresholds``
        (dict), ``probe`` (dict), ``exclude_bos``, ``exclude_current_token``, ``round``.
        Sources: TransformerLens head_detector.py; 004_e7341cee07d297e4.txt."""
        if error_measure is not None:
            options["error_measure"] = error_measure
        if heads is not None:
            options["heads"] = _tl_heads(heads)
        if exclude_heads is not None:
            options["exclude_heads"] = _tl_heads(exclude_heads)
        return self._post_model("/v1/heads", HeadsRequest, HeadsResponse, text, texts, options)

    def links(self, text: str | list[str] | None = None, *, texts: list[str] | None = None,
              layer: int = 0, **options) -> LinksResponse:
        """``POST /v1/links``: for each query token its strongest earlier key token(s) in
        ``layer`` (head mean, or ``head=``) (``.links.links``: query, key, weight). Options
        (``LinksRequest``): ``head``, ``top_k``, ``exclude_self``, ``ignore``, ``direction``,
        ``round``. Source: 000_1c89b6c8c2a32040.txt ``strongest_previous_token``."""
        return self._post_model("/v1/links", LinksRequest, LinksResponse, text, texts,
                                {"layer": layer, **options})

    def scratch_attention(self, **options) -> ScratchAttentionResponse:
        """``POST /v1/scratch-attention``: the textbook ``softmax(Q K^T / sqrt(d_k) + mask) V``
        on ``q``/``k``/``v`` matrices (nested lists or numpy arrays) or on ``text``'s static
        token embeddings; ``.weights``, ``.scores``, ``.output`` have ``.numpy()``. Options
        (``ScratchAttentionRequest``): ``variant``, ``n_heads``, ``scale``, ``project``,
        ``query_text``, ``seed``, ``encoding``, ``round``. Source: 000_1c89b6c8c2a32040.txt."""
        for name in ("q", "k", "v"):
            if hasattr(options.get(name), "tolist"):
                options[name] = options[name].tolist()
        req = _validated(ScratchAttentionRequest, "/v1/scratch-attention", **options)
        return self._call("POST", "/v1/scratch-attention",
                          req.model_dump(mode="json", exclude_unset=True),
                          ScratchAttentionResponse)

    def trajectories(self, text: str | list[str] | None = None, *,
                     texts: list[str] | None = None, **options) -> TrajectoriesResponse:
        """``POST /v1/trajectories``: hidden states standardised and PCA-projected, per-token
        paths ``[token, state, component]`` (``.trajectories.paths.numpy()``), start-to-end
        distances, explained variance. Options (``TrajectoriesRequest``): ``include_final``,
        ``n_components``, ``positions``, ``encoding``, ``dtype``, ``round``, ``add_bos``.
        Source: 000_1c89b6c8c2a32040.txt."""
        return self._post_model("/v1/trajectories", TrajectoriesRequest, TrajectoriesResponse,
                                text, texts, options)

    def verify(self, text: str | list[str] | None = None, *, texts: list[str] | None = None,
               **options) -> VerifyResponse:
        """``POST /v1/verify``: attention recomputed from scratch from the model's own q/k/v
        against the model's, max abs difference per layer/head, pass/fail at ``tolerance``
        (``.verification.passed``). Options (``VerifyRequest``): ``layers``, ``tolerance``,
        ``projections`` (also recompute q/k/v from the attention input with the current
        weights: ~3x the cost)."""
        return self._post_model("/v1/verify", VerifyRequest, VerifyResponse, text, texts,
                                options)

    def attention_norms(self, text: str | list[str] | None = None, *,
                        texts: list[str] | None = None, **options) -> NormsResponse:
        """``POST /v1/attention-norms``: value-weighted contribution norms (Kobayashi et al.
        2020) for one text (``.norms``) or a list (``.results``): ``norms``
        ``||alpha^h_ij f_h(x_j)||`` ``[layer, head, query_pos, key_pos]``, ``summed``
        ``||sum_h alpha^h_ij f_h(x_j)||`` ``[layer, query_pos, key_pos]``, ``value_norms``
        ``||f_h(x_j)||`` ``[layer, head, key_pos]``, each with ``.numpy()``. Options
        (``NormsRequest``): ``layers``, ``heads``, ``per_head``, ``summed``, ``value_norms``,
        ``value_bias`` ('include'|'exclude'), ``output_bias`` ('exclude'|'distribute'),
        ``encoding``, ``dtype``, ``round``, ``layout``, ``sparse``, ``binary``."""
        return self._post_model("/v1/attention-norms", NormsRequest, NormsResponse, text, texts,
                                options)

    def rollout(self, text: str | list[str] | None = None, *, texts: list[str] | None = None,
                **options) -> RolloutResponse:
        """``POST /v1/rollout``: attention rollout per layer (Abnar & Zuidema 2020) for one
        text (``.rollout``) or a list (``.results``): ``rollout`` ``[layer, query_pos,
        key_pos]`` (rows sum to 1) and, with ``flow=True`` (texts up to 16 tokens), ``flow``
        ``[flow_layer, query_pos, key_pos]``. Options (``RolloutRequest``): ``fusion``
        ('mean'|'max'|'min'), ``residual`` (0.5), ``discard`` ([0, 1)), ``sink``
        ('keep'|'drop'), ``layers``, ``flow``, ``flow_layers``, ``encoding``, ``dtype``,
        ``round``, ``layout``, ``sparse``, ``binary``."""
        return self._post_model("/v1/rollout", RolloutRequest, RolloutResponse, text, texts,
                                options)


    def predictions(self, text: str | list[str] | None = None, *, texts: list[str] | None = None,
                    **options) -> PredictionsResponse:
        """``POST /v1/predictions`` (causal LMs): per position the ``top_k`` next tokens
        (prob, logit), the actual next token's log-prob (nats) and rank (1 = top), its loss,
        the entropy, and the mean loss (``.predictions`` / ``.results``). Options
        (``PredictionsRequest``): ``top_k``, ``positions``, ``add_bos``."""
        return self._post_model("/v1/predictions", PredictionsRequest, PredictionsResponse,
                                text, texts, options)

    def logit_lens(self, text: str | list[str] | None = None, *,
                   texts: list[str] | None = None, **options) -> LogitLensResponse:
        """``POST /v1/logit-lens``: every residual state through ln_final and the unembedding
        (TransformerLens ``accumulated_resid(apply_ln=True)``; ``ln`` 'own' | 'final'): per
        state the mean loss (nats) and per position the top-k tokens and the next token's (or
        ``target``'s) rank and log-prob (``.prompts[i].states``). Options
        (``LogitLensRequest``): ``ln``, ``incl_mid``, ``top_k``, ``positions``, ``target``,
        ``tokens``/``token_lists``, ``add_bos``."""
        return self._post_model("/v1/logit-lens", LogitLensRequest, LogitLensResponse, text,
                                texts, options)

    def logit_attribution(self, text: str | list[str] | None = None, *,
                          texts: list[str] | None = None, **options) -> LogitAttributionResponse:
        """``POST /v1/logit-attribution``: direct logit attribution to ``target`` (minus
        ``distractor``) per head (``hook_result``), MLP, embedding and bias, through ln_final
        with its scale frozen (TransformerLens ``apply_ln_to_stack``); the parts plus the
        reported ln_final bias term sum to the logit difference. Options
        (``LogitAttributionRequest``): ``target``, ``distractor``, ``positions``,
        ``tokens``/``token_lists``, ``add_bos``."""
        return self._post_model("/v1/logit-attribution", LogitAttributionRequest,
                                LogitAttributionResponse, text, texts, options)

    def circuits(self, **options) -> CircuitsResponse:
        """``POST /v1/circuits`` (weights only): per head the OV/QK circuits' summaries
        (copying score, Elhage et al. 2021; top singular values) and the Q-, K-, V-composition
        scores between heads (TransformerLens ``all_composition_scores``). Options
        (``CircuitsRequest``): ``top_k``, ``composition``."""
        req = _validated(CircuitsRequest, "/v1/circuits", **options)
        return self._call("POST", "/v1/circuits", req.model_dump(mode="json", exclude_unset=True),
                          CircuitsResponse)

    def ablate(self, text: str | None = None, *, heads: list[list[int]] | list[tuple[int, int]] | None = None,
               **options) -> AblateResponse:
        """``POST /v1/ablate``: ``heads`` ([[layer, head], ...]) ablated together, ``method``
        'zero' | 'mean' (``reference_texts``) | 'resample' (``resample_text``); per position
        KL(clean ‖ ablated), delta loss (nats), top-k before/after (``.positions``),
        ``logit_diff={"target", "distractor"}`` before/after, ``include_patterns`` (encodings
        as /v1/attention; ``binary=True``). ``scan=True`` (no heads): every head alone ->
        ``.scan.grid`` / ``.scan.effect`` ``[layer][head]`` on ``scan_metric`` 'loss' | 'kl' |
        'logit_diff' | 'metric'. ``components=[...]``: any component ablated together (with
        or without ``heads``): ``{"kind": "head", "layer", "head"}``, ``{"kind": "mlp",
        "layer"}`` (hook_mlp_out), ``{"kind": "attn", "layer"}`` (hook_attn_out),
        ``{"kind": "neuron", "layer", "neurons": [...]}`` (mlp.hook_post), ``{"kind":
        "direction", "hook": "blocks.3.hook_resid_post", "vector": [...], "positions"}``
        (projection out of the unit vector; mean/resample set its coefficient). ``metric``: a
        declared /v1/run metric (``attnscope.client.run`` builders) -> ``.metric`` clean /
        ablated / resample / normalized. Source: S004, verify by intervention."""
        fields = dict(options)
        binary = bool(fields.pop("binary", False))
        if heads is not None:
            fields["heads"] = _head_pairs(heads)
        if text is not None:  # else tokens=[...] (ids as given) in the options
            fields["text"] = text
        req = _validated(AblateRequest, "/v1/ablate", **fields)
        return self._call("POST", "/v1/ablate", req.model_dump(mode="json", exclude_unset=True),
                          AblateResponse, binary)

    def patch(self, clean_text: str | None = None, corrupted_text: str | None = None,
              *, on_progress=None, **options) -> PatchResponse:
        """``POST /v1/patch``: activation patching clean -> corrupted, ``.heads`` ``[layer][head]``
        of the normalised metric ``(patched - corrupted) / (clean - corrupted)`` (TransformerLens
        ``get_act_patch_attn_head_out_all_pos``); ``per_position`` -> ``.heads_per_position``,
        ``residual`` -> ``.residual`` ``[layer][pos]``; ``metric`` 'logit_diff' (with
        ``logit_diff={"target", "distractor"}``) or 'loss', or a declared /v1/run metric
        (``attnscope.client.run`` builders: logit_diff / prob / logprob / loss / kl, KL's run
        1 = the clean run); ``method='attribution'`` for the linear approximation from one
        backward (``.approximation`` says so). ``hook=`` 'resid_pre' | 'resid_mid' |
        'resid_post' | 'attn_out' | 'mlp_out' (``[layer, pos]``) | 'z' | 'q' | 'k' | 'v'
        (``[layer, head]``, ``by_position=True``: ``[layer, pos, head]``) | 'pattern'
        (``[layer, head]`` / ``[layer, head, dest_pos]``) -> ``.grid`` (``raw``,
        ``normalized``, ``axes``, and ``function``: the TransformerLens 4.3 ``get_act_patch_*``
        it equals; as numpy: ``numpy.array(res.grid.raw, dtype=float)``, None -> NaN);
        ``patch_layers`` / ``patch_heads`` / ``patch_positions`` subsets.
        ``on_progress(done, total, unit)``: called while the grid runs (unit 'cells'; the
        response streamed as NDJSON, docs/api.md "Streamed progress"); the result is the same."""
        texts = {k: v for k, v in (("clean_text", clean_text),
                                    ("corrupted_text", corrupted_text)) if v is not None}
        req = _validated(PatchRequest, "/v1/patch", **texts, **options)
        body = req.model_dump(mode="json", exclude_unset=True)
        if on_progress is not None:
            return self._call_stream("POST", "/v1/patch", body, PatchResponse, on_progress)
        return self._call("POST", "/v1/patch", body, PatchResponse)

    def path_patch(self, pairs: Sequence[Any] | None = None, *, clean: Any = None,
                   corrupted: Any = None, senders: Sequence[Any] | None = None,
                   receivers: Sequence[Any] | None = None, metric: Mapping[str, Any] | None = None,
                   on_progress=None, **options) -> PathPatchResponse:
        """``POST /v1/path-patch``: path patching (Wang et al. 2022): the ``senders``' outputs
        from the other run reach the ``receivers`` only along the direct path, everything else
        frozen at the base run (``direction`` 'corrupted_to_clean', the default: base = clean).
        ``pairs``: dicts of the schema, or ``(clean, corrupted)`` tuples of texts or token id
        lists (or one pair as ``clean=``/``corrupted=``). ``senders``: ``(layer, head)`` for a
        head, an int for an MLP, or dicts; ``receivers``: ``(layer, "q"|"k"|"v")`` for every
        head of a layer, ``(layer, head, "k")`` for one, an int for an MLP's input, ``"logits"``,
        or dicts. ``metric``: a /v1/run metric (``attnscope.client.run`` builders' dicts, every
        term's prompt null). ``grid=True`` (no senders/receivers): every sender head x receiver
        head input -> ``.grid.raw`` ``[sender_layer][sender_head][receiver_layer]
        [receiver_head][input]``. Raw statistics in ``.base``/``.other``/``.patched`` (mean,
        std, n), ``.normalized`` = (patched - base) / (other - base).
        ``on_progress(done, total, unit)``: called after each chunk of pairs (unit 'pairs'; the
        response streamed as NDJSON, docs/api.md "Streamed progress")."""
        fields: dict[str, Any] = dict(options)

        def side(name, v):
            if isinstance(v, str):
                return {f"{name}_text": v}
            return {f"{name}_tokens": [int(t) for t in v]}

        def pair(x):
            if isinstance(x, Mapping):
                return dict(x)
            c, k = x
            return {**side("clean", c), **side("corrupted", k)}

        if clean is not None or corrupted is not None:
            if pairs is not None or clean is None or corrupted is None:
                raise RequestValidationError("give pairs, or clean and corrupted (one pair)",
                                             "pairs")
            pairs = [(clean, corrupted)]
        if pairs is not None:
            fields["pairs"] = [pair(x) for x in pairs]

        def sender(x):
            if isinstance(x, Mapping):
                return dict(x)
            if isinstance(x, int):
                return {"kind": "mlp", "layer": x}
            layer, head = x
            return {"kind": "head", "layer": int(layer), "head": int(head)}

        def receiver(x):
            if isinstance(x, Mapping):
                return dict(x)
            if x == "logits":
                return {"kind": "logits"}
            if isinstance(x, int):
                return {"kind": "mlp", "layer": x}
            if len(x) == 2:
                return {"kind": "head", "layer": int(x[0]), "input": x[1]}
            return {"kind": "head", "layer": int(x[0]), "heads": [int(x[1])], "input": x[2]}

        if senders is not None:
            fields["senders"] = [sender(x) for x in senders]
        if receivers is not None:
            fields["receivers"] = [receiver(x) for x in receivers]
        if metric is not None:
            fields["metric"] = dict(metric)
        req = _validated(PathPatchRequest, "/v1/path-patch", **fields)
        body = req.model_dump(mode="json", exclude_unset=True)
        if on_progress is not None:
            return self._call_stream("POST", "/v1/path-patch", body, PathPatchResponse,
                                     on_progress)
        return self._call("POST", "/v1/path-patch", body, PathPatchResponse)

    def hooks(self) -> HooksResponse:
        """``GET /v1/hooks``: every hook point of the resident model (TransformerLens 4.x
        names, axis names, sizes; null where the request sets them)."""
        return self._call("GET", "/v1/hooks", None, HooksResponse)

    def run(self, tokens: Sequence[Sequence[int]] | None = None, *,
            texts: Sequence[str] | None = None, cache: Sequence[Any] = (),
            interventions: Sequence[dict] = (), metrics: Mapping[str, dict] | None = None,
            binary: bool = True, **options):
        """``POST /v1/run``: one hooked forward on the server -> :class:`~.run.RunOutput`
        (``out.cache["blocks.0.attn.hook_z"]`` ``[batch, pos, head, d_head]`` as numpy, TL's
        names and shapes; ``out.metrics``, ``out.grads``, ``out.logits``/``out.top``,
        ``out.loss``). ``tokens``: prompts as ids ``[batch, pos]`` (used as given; the
        request's ``token_lists``) or ``texts`` (BOS per
        ``add_bos``, default the model's convention); ``cache``: hook names/patterns or
        :func:`~.run.cached` entries; ``interventions`` / ``metrics``: the builders of
        :mod:`attnscope.client.run` (or plain dicts). Options (``RunRequest``): ``add_bos``,
        ``logits`` ({positions, top_k, full}), ``loss``, ``grad`` ({metric, hooks}),
        ``dtype``, ``encoding``, ``round``. ``binary`` (default): one safetensors response,
        arrays read without a JSON parse. Raises :class:`RequestValidationError` before
        sending when the request does not fit the schema; the service's 4xx as usual."""
        fields: dict[str, Any] = dict(options)
        if tokens is not None:  # [batch, pos] ids, as TransformerLens' run_with_cache(tokens)
            fields["token_lists"] = [[int(t) for t in p] for p in tokens]
        if texts is not None:
            fields["texts"] = list(texts)
        fields["cache"] = list(cache)
        fields["interventions"] = list(interventions)
        fields["metrics"] = dict(metrics or {})
        if not binary:
            fields.setdefault("encoding", "base64")
        req = _validated(RunRequest, "/v1/run", **fields)
        result = self._call("POST", "/v1/run", req.model_dump(mode="json", exclude_unset=True),
                            None, binary)
        if inspect.isawaitable(result):
            async def finish():
                return _run_output(await result)
            return finish()
        return _run_output(result)


def _run_output(body) -> RunOutput:
    return run_output(body)


class Client(BaseClient, _Endpoints):
    """Synchronous client. Use as a context manager or call :meth:`close`.

    >>> with Client("http://127.0.0.1:8000") as c:          # doctest: +SKIP
    ...     res = c.attention("Then I tried", layers=[0])
    ...     res.attention.pattern.numpy().shape              # [layer, head, query, key]
    """

    def __init__(self, base_url: str | None = None, *, api_key: str | None = None,
                 timeout: float | httpx.Timeout | None = None,
                 max_retries: int = DEFAULT_MAX_RETRIES, http_client: httpx.Client | None = None,
                 default_headers: dict[str, str] | None = None):
        super().__init__(base_url, api_key, timeout, max_retries, http_client, default_headers)
        self._http = http_client if http_client is not None else httpx.Client()
        self._x = self._lib(self._http)
        self._sleep = time.sleep

    def _send(self, request, stream: bool = False):
        """Send ``request`` with the client's retries (timeouts, transport errors and the
        statuses :meth:`_should_retry` accepts, up to ``max_retries`` times; Retry-After
        honoured). Returns the last response: a success, or the error to raise (a streamed
        error's body already read)."""
        for attempt in range(self.max_retries + 1):
            last = attempt == self.max_retries
            try:
                response = self._http.send(request, stream=stream)
            except self._x.TimeoutException as exc:
                if not last:
                    self._sleep(self._retry_delay(attempt, None))
                    continue
                raise APITimeoutError(request) from exc
            except self._x.TransportError as exc:
                if not last:
                    self._sleep(self._retry_delay(attempt, None))
                    continue
                raise APIConnectionError(f"cannot reach {self.base_url}: {exc}", request) from exc
            if response.is_success or last:
                return response
            if stream:
                response.read()
            if not self._should_retry(response):
                return response
            response.close()
            self._sleep(self._retry_delay(attempt, response))
        raise AssertionError("unreachable")  # pragma: no cover

    def _call(self, method: str, path: str, body: Any, cast_to, binary: bool = False):
        response = self._send(self._build(self._http, method, path, body, binary))
        if response.is_success:
            return self._parse(response, cast_to)
        self._raise_status(response)

    def _call_stream(self, method: str, path: str, body: Any, cast_to, on_progress):
        """:meth:`_call` for a streamed answer: retries as it does until the 200 arrives;
        then the progress lines go to ``on_progress`` and the last line is the result (an
        answer that is not NDJSON, from an older service, is parsed as ever)."""
        response = self._send(self._stream_request(method, path, body), stream=True)
        try:
            if not response.is_success or \
                    not response.headers.get("content-type", "").startswith(NDJSON):
                response.read()
                if response.is_success:
                    return self._parse(response, cast_to)
                self._raise_status(response)
            try:
                for line in response.iter_lines():
                    if line.strip():
                        got = self._stream_line(response, line, cast_to, on_progress)
                        if isinstance(got, tuple) and got[:1] == ("done",):
                            return got[1]
            except self._x.TransportError as exc:
                raise self._stream_cut(response) from exc
            raise self._stream_cut(response)
        finally:
            response.close()

    def close(self) -> None:
        """Close the underlying httpx client if this client created it."""
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait_until_ready(self, timeout: float = 120.0, interval: float = 0.5) -> dict:
        """Poll ``/readyz`` until 200 or ``timeout`` seconds; raises the last error."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._call("GET", "/readyz", None, None)
            except APIStatusError as exc:
                if exc.status_code != 503 or time.monotonic() > deadline:
                    raise
            except APIConnectionError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(interval)


class AsyncClient(BaseClient, _Endpoints):
    """Asynchronous client: the same methods as :class:`Client`, awaited.

    >>> async with AsyncClient() as c:                      # doctest: +SKIP
    ...     res = await c.attention("Then I tried", layers=[0])
    """

    def __init__(self, base_url: str | None = None, *, api_key: str | None = None,
                 timeout: float | httpx.Timeout | None = None,
                 max_retries: int = DEFAULT_MAX_RETRIES,
                 http_client: httpx.AsyncClient | None = None,
                 default_headers: dict[str, str] | None = None):
        super().__init__(base_url, api_key, timeout, max_retries, http_client, default_headers)
        self._http = http_client if http_client is not None else httpx.AsyncClient()
        self._x = self._lib(self._http)
        self._sleep = asyncio.sleep

    async def _send(self, request, stream: bool = False):
        """:meth:`Client._send`, awaited."""
        for attempt in range(self.max_retries + 1):
            last = attempt == self.max_retries
            try:
                response = await self._http.send(request, stream=stream)
            except self._x.TimeoutException as exc:
                if not last:
                    await self._sleep(self._retry_delay(attempt, None))
                    continue
                raise APITimeoutError(request) from exc
            except self._x.TransportError as exc:
                if not last:
                    await self._sleep(self._retry_delay(attempt, None))
                    continue
                raise APIConnectionError(f"cannot reach {self.base_url}: {exc}", request) from exc
            if response.is_success or last:
                return response
            if stream:
                await response.aread()
            if not self._should_retry(response):
                return response
            await response.aclose()
            await self._sleep(self._retry_delay(attempt, response))
        raise AssertionError("unreachable")  # pragma: no cover

    async def _call(self, method: str, path: str, body: Any, cast_to,
                    binary: bool = False):
        response = await self._send(self._build(self._http, method, path, body, binary))
        if response.is_success:
            return self._parse(response, cast_to)
        self._raise_status(response)

    async def _call_stream(self, method: str, path: str, body: Any, cast_to, on_progress):
        """:meth:`Client._call_stream`, awaited (``on_progress`` may be a coroutine function)."""
        response = await self._send(self._stream_request(method, path, body), stream=True)
        try:
            if not response.is_success or \
                    not response.headers.get("content-type", "").startswith(NDJSON):
                await response.aread()
                if response.is_success:
                    return self._parse(response, cast_to)
                self._raise_status(response)
            try:
                async for line in response.aiter_lines():
                    if line.strip():
                        got = self._stream_line(response, line, cast_to, on_progress)
                        if inspect.isawaitable(got):
                            await got
                        elif isinstance(got, tuple) and got[:1] == ("done",):
                            return got[1]
            except self._x.TransportError as exc:
                raise self._stream_cut(response) from exc
            raise self._stream_cut(response)
        finally:
            await response.aclose()

    async def close(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
