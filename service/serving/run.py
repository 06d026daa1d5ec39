"""/v1/run and /v1/hooks: one hooked forward with TransformerLens 4.x hook names (remote
execution in the style of nnsight/NDIF, declarative: no user code runs on the server).

The request's prompts, cache selection, interventions, metrics and gradient are turned into
the runtime's declarations (service/runtime/hooked.py) and run in ONE device turn; tensors come
back under TransformerLens' names and shapes through the encoding layer (JSON, base64 or one
safetensors file with ``Accept: application/x-safetensors``)."""

from __future__ import annotations

import math
import re

import numpy as np
import torch

from attnscope.schemas import HooksResponse, RunRequest, RunResponse
from ..encoding import encode_tensor, estimate_encoded_bytes
from ..encoding.inputs import decode_input
from ..errors import BatchTooLarge, InvalidRequest, NonFiniteValues
from ..runtime import hooked as H
from .core.engine import Plan
from .core.table import Endpoint
from .interventions import _single_token, check_lm


#: bytes one top-k token object costs in the response and while it is built (a dict of id,
#: label, bytes, partial, prob, logit, and its JSON), measured ~600
TOP_TOKEN_BYTES = 700


def parts(rt) -> H.GPT2Parts:
    """The resident model's parameter views for the hooked forward (made once per runtime).
    Raises ``UnsupportedModelConfig`` (422) for a model the hooked forward does not run."""
    p = rt.memo.get("hooked_parts")
    if p is None:
        p = rt.memo["hooked_parts"] = H.gpt2_parts(rt.model)
    return p


def check(rt, req: RunRequest) -> None:
    """A causal LM the hooked forward runs (422 ``unsupported_model`` / ``unsupported_model_
    config``), at most ``max_batch`` prompts (422), every hook name known (422 naming the
    closest names)."""
    check_lm(rt)
    p = parts(rt)
    prompts = req.token_lists if req.token_lists is not None else req.texts
    field = "token_lists" if req.token_lists is not None else "texts"
    if len(prompts) > rt.settings.max_batch:
        raise BatchTooLarge(f"{field} holds {len(prompts)} prompts; the limit is "
                            f"{rt.settings.max_batch} (max_batch)", field)
    for i, c in enumerate(req.cache):
        H.resolve(p, c if isinstance(c, str) else c.hook, f"cache.{i}.hook")
    for i, iv in enumerate(req.interventions):
        H.resolve(p, iv.hook, f"interventions.{i}.hook")
    if req.grad is not None:
        for i, h in enumerate(req.grad.hooks):
            H.resolve(p, h, f"grad.hooks.{i}")


def add_bos_of(rt, req) -> bool:
    """The effective BOS rule for texts: the request's, else the model's convention (causal
    models prepend BOS, as TransformerLens' ``to_tokens``)."""
    if req.add_bos is not None:
        return bool(req.add_bos)
    return bool(getattr(rt, "default_add_bos", rt.adapter.causal))


def prompts_of(rt, req: RunRequest) -> list:
    """The prompts as ``TokenizedText`` (ids used as given; texts tokenized, BOS per
    :func:`add_bos_of`), all of one length (422 naming the lengths otherwise)."""
    if req.token_lists is not None:
        items = [rt.tokenized_from_ids(ids, f"token_lists.{i}")
                 for i, ids in enumerate(req.token_lists)]
        field = "token_lists"
    else:
        bos = add_bos_of(rt, req)
        items = [rt.tokenize(t, bos, f"texts.{i}") for i, t in enumerate(req.texts)]
        field = "texts"
    lengths = [len(it) for it in items]
    if len(set(lengths)) > 1:
        raise InvalidRequest(f"{field}: every prompt of a run has the same number of tokens "
                             f"(a batch without padding, as interventions across prompts "
                             f"need); these have {lengths}", field)
    return items


# ------------------------------------------------------------------ request -> declarations
def _token(rt, ref, param: str) -> int:
    if isinstance(ref, str):
        return _single_token(rt, ref, param)
    return int(ref)


def metric_of(rt, m, param: str):
    """A schema metric -> the runtime's metric declaration (token texts -> ids)."""
    if m.kind == "logit_diff":
        terms = [(t.prompt, t.position, _token(rt, t.target, f"{param}.terms.{i}.target"),
                  _token(rt, t.distractor, f"{param}.terms.{i}.distractor"))
                 for i, t in enumerate(m.terms)]
        return H.LogitDiff(terms=terms, reduce=m.reduce)
    if m.kind in ("prob", "logprob"):
        terms = [(t.prompt, t.position, _token(rt, t.target, f"{param}.terms.{i}.target"))
                 for i, t in enumerate(m.terms)]
        return (H.Prob if m.kind == "prob" else H.LogProb)(terms=terms, reduce=m.reduce)
    if m.kind == "loss":
        return H.Loss(terms=[(t.prompt, t.position) for t in m.terms], reduce=m.reduce)
    return H.KL(terms=[(t.prompt, t.reference_prompt, t.position) for t in m.terms],
                reduce=m.reduce)


def _f(x) -> float:
    """A float32 value as its shortest round-tripping decimal (as every endpoint sends them)."""
    return float(str(np.float32(float(x))))


def _sel(x) -> dict:
    return dict(prompts=x.prompts, heads=x.heads, positions=x.positions)


def interventions_of(rt, p: H.GPT2Parts, req: RunRequest, T: int, add_bos: bool,
                     origin: list[int]) -> list:
    """The schema interventions -> the runtime's, in order. Tensors decoded here (on the
    device thread); ``mean`` with reference prompts: their clean means, per matched hook
    (per position when the references have the run's length, else over positions too).
    ``origin`` gets, per runtime intervention, the index of the request's entry it came from
    (a reference mean over a pattern becomes one per matched hook)."""
    out = []
    dev, dt = p.device, p.dtype
    for i, iv in enumerate(req.interventions):
        origin.append(i)
        param = f"interventions.{i}"
        common = dict(hook=iv.hook, **_sel(iv))
        if iv.kind == "zero":
            out.append(H.Zero(**common))
        elif iv.kind == "scale":
            out.append(H.Scale(factor=iv.factor, **common))
        elif iv.kind == "add":
            v = torch.from_numpy(decode_input(iv.vector, f"{param}.vector")).to(dev, dt)
            out.append(H.Add(vector=v, scale=iv.scale, **common))
        elif iv.kind == "set":
            value = None if iv.value is None else torch.from_numpy(
                decode_input(iv.value, f"{param}.value")).to(dev, dt)
            out.append(H.Set(source_prompt=iv.source_prompt, value=value, **common))
        elif iv.reference is None and iv.reference_texts is None:
            out.append(H.Mean(over=iv.over, **common))
        else:
            if iv.reference is not None:
                refs = [rt.tokenized_from_ids(ids, f"{param}.reference.{j}")
                        for j, ids in enumerate(iv.reference)]
            else:
                refs = [rt.tokenize(t, add_bos, f"{param}.reference_texts.{j}")
                        for j, t in enumerate(iv.reference_texts)]
            lengths = sorted({len(r) for r in refs})
            if len(lengths) > 1:
                raise InvalidRequest(f"{param}: the reference prompts have different token "
                                     f"counts {lengths}; give prompts of one length", param)
            ids = torch.tensor([list(r.input_ids) for r in refs], dtype=torch.long)
            names = [h.name for h in H.resolve(p, iv.hook, f"{param}.hook")]
            over = "batch" if lengths[0] == T else "batch_pos"
            scores = [n for n in names if n.endswith("attn.hook_attn_scores")]
            if scores and over != "batch":
                raise InvalidRequest(
                    f"{param}: a mean of {scores[0]} over positions mixes masked (-inf) "
                    f"entries; give reference prompts of the run's length ({T} tokens), whose "
                    "mean is taken per position", param)
            means = H.reference_means(p, ids, names, over=over)
            for n in scores:  # above the diagonal: -inf, re-masked after the edit anyway
                means[n] = torch.nan_to_num(means[n], neginf=0.0)
            out += [H.Mean(reference=means[n], **{**common, "hook": n}) for n in names]
            origin += [i] * (len(names) - 1)
    return out


def cache_of(req: RunRequest) -> dict:
    """``cache`` -> {hook name or pattern: CacheSelect | None}; a hook named twice is a 422."""
    out: dict = {}
    for i, c in enumerate(req.cache):
        key = c if isinstance(c, str) else c.hook
        if key in out:
            raise InvalidRequest(f"cache.{i}: {key!r} is already in the cache selection", f"cache.{i}")
        out[key] = None if isinstance(c, str) else H.CacheSelect(layers=c.layers, **_sel(c))
    return out


def _resolved(values, size: int) -> list[int] | None:
    return None if values is None else [v % size if v < 0 else v for v in values]


def _selections(p: H.GPT2Parts, req: RunRequest, names, B: int, T: int) -> dict:
    """Per cached hook the kept indices along each cut axis (negatives resolved)."""
    out = {}
    for c in req.cache:
        if isinstance(c, str):
            continue
        for hp in H.resolve(p, c.hook):
            if hp.name not in names:
                continue
            sel = {"prompts": _resolved(c.prompts, B), "positions": _resolved(c.positions, T)}
            if hp.head_axis is not None:
                sel["heads"] = c.heads
            out[hp.name] = {k: v for k, v in sel.items() if v is not None}
    return out


_IV = re.compile(r"interventions\[(\d+)\]")
#: the runtime's argument names -> the request's fields (docs/api.md, "Errors": a param names
#: the field as the request spells it)
_RUNTIME_FIELDS = {"logit_positions": "logits.positions"}
_RUNTIME_NAME = re.compile(r"\b(" + "|".join(map(re.escape, _RUNTIME_FIELDS)) + r")\b")


_KEYED = re.compile(r"\b(cache|metrics)\[('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")\]")


def _renumbered(exc: InvalidRequest, origin: list[int],
                cache_keys: dict[str, int] | None = None) -> InvalidRequest:
    """``exc`` with the runtime's names of request entries as the request spells them, in its
    message and its param: ``interventions[k]`` (the runtime's list) -> the request's entry
    ``interventions.{origin[k]}``; ``cache['<hook>']`` -> ``cache.{i}`` (``cache_keys``: hook
    or pattern -> its index in ``cache``); ``metrics['<name>']`` -> ``metrics.<name>``; the
    runtime's argument names -> the request's fields (``logit_positions`` ->
    ``logits.positions``)."""
    def sub(m):
        k = int(m.group(1))
        return f"interventions.{origin[k] if k < len(origin) else k}"

    def keyed(m):
        import ast

        key = ast.literal_eval(m.group(2))
        if m.group(1) == "cache" and cache_keys and key in cache_keys:
            return f"cache.{cache_keys[key]}"
        return f"{m.group(1)}.{key}"

    def fix(text: str) -> str:
        text = _KEYED.sub(keyed, _IV.sub(sub, text))
        return _RUNTIME_NAME.sub(lambda m: _RUNTIME_FIELDS[m.group(1)], text)
    exc.message = fix(exc.message) if hasattr(exc, "message") else exc.message
    if exc.param:
        exc.param = fix(exc.param)
    exc.args = tuple(fix(a) if isinstance(a, str) else a for a in exc.args)
    return exc


def check_no_repeats(req: RunRequest, B: int, T: int) -> None:
    """Each index of a cache entry's selection (``prompts``, ``heads``, ``positions``,
    ``layers``) at most once: a position and its negative twin (``-1`` and ``T - 1``) are the
    same position. A repeat is a 422 naming the entry's field and the repeated element
    (``cache.0.positions.1``); values out of range are left to the range check."""
    for i, c in enumerate(req.cache):
        if isinstance(c, str):
            continue
        for axis in ("prompts", "heads", "positions", "layers"):
            values = getattr(c, axis)
            seen: dict[int, int] = {}
            for j, v in enumerate(values or ()):
                r = v + T if axis == "positions" and -T <= v < 0 else v
                if r in seen:
                    k = seen[r]
                    same = "" if v == values[k] else f" (position {r} of {T})"
                    raise InvalidRequest(
                        f"cache.{i}.{axis}: {axis}[{j}] = {v} repeats {axis}[{k}] = "
                        f"{values[k]}{same}; each index may appear once in a selection",
                        f"cache.{i}.{axis}.{j}")
                seen[r] = j


# ------------------------------------------------------------------ the plan
def _cached_elements(p: H.GPT2Parts, req: RunRequest, B: int, T: int) -> tuple[int, int]:
    """(elements of everything cached, elements of the largest single cached hook)."""
    n = big = 0
    for c in req.cache:
        pattern = c if isinstance(c, str) else c.hook
        for hp in H.resolve(p, pattern):
            shape = list(hp.shape(B, T))
            if not isinstance(c, str):
                if c.layers is not None and hp.layer is not None and hp.layer not in c.layers:
                    continue
                if c.prompts is not None:
                    shape[0] = len(c.prompts)
                if c.heads is not None and hp.head_axis is not None:
                    shape[hp.head_axis] = len(c.heads)
                if c.positions is not None:
                    shape[hp.pos_axis] = len(c.positions)
            n += math.prod(shape)
            big = max(big, math.prod(shape))
    return n, big


def plan(rt, req: RunRequest, items, *, binary: bool = False) -> Plan:
    """Prompts tokenized (cheap, cached), lengths checked, the memory estimate (the hooked
    forward's live tensors, what is cached, the logits, a backward's saved activations and the
    encoded response), and the job: one hooked forward (plus the reference prompts' clean
    forwards for a mean over them) and the encoded body."""
    p = parts(rt)
    prompts = prompts_of(rt, req)
    B, T = len(prompts), len(prompts[0])
    check_no_repeats(req, B, T)
    encoding = "binary" if binary else req.encoding
    L, Hh, D, M, V = p.n_layers, p.n_heads, p.d_model, p.d_mlp, p.d_vocab
    es = p.wte.element_size()
    # the forward's live tensors as lens._forward_bytes measured them (20 d_model + 6 d_mlp per token)
    layer_live = B * (3 * Hh * T * T + T * (20 * D + 6 * M))
    n_cache, n_biggest = _cached_elements(p, req, B, T)
    full_logits = req.loss or (req.logits is not None and req.logits.positions is None)
    n_pos = T if full_logits else (len(req.logits.positions) if req.logits and
                                   req.logits.positions else 1)
    # each cached hook becomes its wire form as soon as its hook has run (``keep`` below): the
    # model-dtype values stay whole only where the wire form is them (json, or float32 when
    # the model is float32); otherwise one hook at a time, beside the encoded copies
    same = encoding == "json" or (req.dtype == "float32" and es == 4)
    est = es * (layer_live + 2 * B * n_pos * V + (n_cache if same else n_biggest))
    est += estimate_encoded_bytes(n_cache, encoding, req.dtype, req.round, "full", None, T)
    if req.logits is not None and req.logits.top_k:  # the top-k token objects of the body
        est += TOP_TOKEN_BYTES * B * n_pos * min(req.logits.top_k, V)
    if req.logits is not None and req.logits.full:
        est += estimate_encoded_bytes(B * n_pos * V, encoding, req.dtype, req.round, "full",
                                      None, T)
    if req.grad is not None:  # the backward keeps every layer's activations, plus the grads
        est += es * L * B * (3 * Hh * T * T + T * (10 * D + 3 * M + 2 * Hh * D))
    add_bos = req.texts is not None and add_bos_of(rt, req)

    def job(_forwards) -> dict:
        ids = torch.tensor([list(it.input_ids) for it in prompts], dtype=torch.long)
        metrics = {n: metric_of(rt, m, f"metrics.{n}") for n, m in req.metrics.items()}
        grad = None if req.grad is None else H.GradRequest(
            metric=metrics[req.grad.metric], hooks=list(req.grad.hooks))
        logit_positions = None if full_logits else (
            list(req.logits.positions) if req.logits and req.logits.positions else [T - 1])
        origin: list[int] = []
        ivs = interventions_of(rt, p, req, T, add_bos, origin)
        enc = lambda t, name: encode_tensor(  # noqa: E731
            t, encoding, req.dtype, req.round, name, allow_neg_inf="hook_attn_scores" in name)
        # every cached hook is encoded (and its model-dtype copy dropped) as soon as its hook
        # has run: the peak is the forward's working set + one copy of the response (issue 25)
        keep = lambda name, t: enc(t, f"cache.{name}")  # noqa: E731
        try:
            res = H.run(p, ids, cache=cache_of(req), interventions=ivs,
                        logit_positions=logit_positions, metrics=metrics, grad=grad,
                        keep=keep)
        except InvalidRequest as exc:  # the runtime's index -> the request's entry
            keys = {c if isinstance(c, str) else c.hook: i for i, c in enumerate(req.cache)}
            raise _renumbered(exc, origin, keys) from None
        body: dict = {
            "model": rt.model_ref(),
            "add_bos": add_bos,
            "prompts": [{"tokens": [t.as_dict() for t in it.tokens], "n_tokens": len(it)}
                        for it in prompts],
            "cache": res.cache,
            "selections": _selections(p, req, res.cache, B, T),
            "logits": None, "loss": None,
            "metrics": {n: {"value": _f(v.value), "values": [_f(x) for x in v.values.tolist()],
                            "reduce": req.metrics[n].reduce} for n, v in res.metrics.items()},
            "grads": {n: enc(g, f"grads.{n}") for n, g in res.grads.items()},
            "grad_value": None if res.grad_value is None else _f(res.grad_value),
        }
        if req.logits is not None or req.loss:
            if not bool(torch.isfinite(res.logits).all()):
                raise NonFiniteValues("logits hold NaN/inf (the forward produced non-finite "
                                      "values)", "logits")
        if req.logits is not None:
            pos = res.logit_positions
            lg = res.logits
            if req.logits.positions is not None and full_logits:
                lg = lg[:, [q % T for q in req.logits.positions]]
                pos = [q % T for q in req.logits.positions]
            out: dict = {"positions": pos, "top": None, "logits": None}
            if req.logits.top_k:
                k = min(req.logits.top_k, V)
                probs = torch.softmax(lg.float(), dim=-1)
                top_p, top_i = probs.topk(k, dim=-1)
                top_l = lg.float().gather(-1, top_i)
                out["top"] = [[[dict(ref, prob=_f(pp), logit=_f(ll)) for ref, pp, ll in
                                zip(rt.token_refs(top_i[b, j].tolist()), top_p[b, j], top_l[b, j])]
                               for j in range(lg.shape[1])] for b in range(B)]
            if req.logits.full:
                out["logits"] = enc(lg, "logits.logits")
            body["logits"] = out
        if req.loss:
            if T < 2:
                raise InvalidRequest("loss needs prompts of at least 2 tokens", "loss")
            lp = torch.log_softmax(res.logits[:, :-1].float(), dim=-1)
            per = -lp.gather(-1, ids[:, 1:, None].to(lp.device))[..., 0]
            body["loss"] = {"per_token": enc(per, "loss.per_token"), "mean": _f(per.mean())}
        for name, m in body["metrics"].items():
            if not (math.isfinite(m["value"]) and all(map(math.isfinite, m["values"]))):
                raise NonFiniteValues(f"metrics.{name} is not finite (NaN or inf in the "
                                      "forward)", f"metrics.{name}")
        return body

    return Plan([], job, int(est))


async def hooks_handler(engine, req=None) -> dict:
    """``GET /v1/hooks``: every hook point of the resident model with axes and sizes."""
    rt = engine.runtime
    return HooksResponse(model=rt.model_ref(), hooks=[
        {"name": h.name, "axes": list(h.axes), "shape": list(h.sizes), "layer": h.layer}
        for h in H.hook_points(parts(rt))])


ENDPOINTS = [
    Endpoint(
        path="/v1/hooks", name="hooks", request=None, response=HooksResponse,
        summary="Hook points of the resident model (TransformerLens 4.x names and shapes)",
        description="""Every activation ``/v1/run`` can cache, edit or differentiate, in forward
order, under its TransformerLens 4.x name (``hook_embed``, ``hook_pos_embed``,
``blocks.{l}.hook_resid_pre``, ``blocks.{l}.ln1.hook_scale`` / ``hook_normalized``,
``blocks.{l}.hook_q_input`` / ``k_input`` / ``v_input`` (per-head split inputs),
``blocks.{l}.attn.hook_q`` / ``k`` / ``v`` / ``z`` ``[batch, pos, head, d_head]``,
``attn.hook_attn_scores`` / ``hook_pattern`` ``[batch, head, query_pos, key_pos]``,
``attn.hook_result`` ``[batch, pos, head, d_model]``, ``hook_attn_out``, ``hook_resid_mid``,
``ln2.*``, ``mlp.hook_pre`` / ``hook_post`` ``[batch, pos, d_mlp]``, ``hook_mlp_out``,
``hook_resid_post``, ``ln_final.hook_scale`` / ``hook_normalized``) with its axis names and the
sizes fixed by the model (null: set by the request). GPT-2-family causal LMs; an encoder is a
422 ``unsupported_model``.""",
        handler=hooks_handler, tags=("run",), order=120,
    ),
    Endpoint(
        path="/v1/run", name="run", request=RunRequest, response=RunResponse,
        summary="One hooked forward: cache activations, apply interventions, read metrics "
                "and gradients (TransformerLens hook names)",
        description="""Remote execution of one forward of the resident causal LM on a batch of
prompts of equal length (``token_lists`` as ids used as given, or ``texts`` with BOS per
``add_bos``), in one device turn:

* ``cache``: hook names or fnmatch patterns (``blocks.*.hook_resid_post``), each with an
  optional layer / prompt / head / position selection, returned under TransformerLens 4.x's
  names and shapes (batch axis first; the values after the interventions at that hook);
* ``interventions``, applied in order inside the forward at their hook: ``zero``, ``mean``
  (over positions, over the batch, or over ``reference`` prompts), ``set`` (the same hook's
  value in another prompt: activation patching in one call; with the per-head
  ``hook_q_input``/``hook_k_input``/``hook_v_input`` path patching, Wang et al. 2022; or a given
  tensor), ``add`` (vector x scale: steering), ``scale``; with head, position and prompt
  selection;
* ``metrics`` from the (edited) logits: logit difference over (position, target,
  distractor) terms, probability, log-probability, next-token loss, KL between two prompts;
* ``grad``: the gradient of one metric with respect to hooks, from one backward (attribution
  patching: Nanda 2023; Kramár et al. 2024);
* ``logits`` (top-k or the full tensor at chosen positions), ``loss`` per token.

The forward runs the model's own weights with Hugging Face's eager operations in its order
(equal to ``GPT2LMHeadModel``'s logits bit for bit when nothing is edited) and equals
TransformerLens 4.3 ``run_with_cache`` / ``run_with_hooks`` to <= 1e-5 (tests/test_hooked.py).
Tensors: any wire form of ``encoding``/``dtype``/``round``; ``Accept:
application/x-safetensors`` returns one safetensors file (the tensors by name, e.g.
``cache.blocks.0.attn.hook_z``).
Errors: 422 unknown hook (the closest names given), selection out of range, tensor of the wrong
shape, ``set`` from a missing prompt, prompts of different lengths, too many tokens, a metric
token that is not one token; 429 over the memory budget (Retry-After); 406; 413; 503.""",
        plan=plan, check=check, tokenize=False, binary=True,
        invalid="Invalid request: unknown hook (closest names given), a selection out of "
                "range, a tensor of the wrong shape, prompts of different lengths, too many "
                "tokens, a metric token that is not one token, memory.",
        tags=("run",), order=121,
    ),
]
