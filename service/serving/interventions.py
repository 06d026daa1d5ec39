"""/v1/predictions, /v1/ablate and /v1/patch: next-token predictions and interventions.

Each ``plan`` makes the model-aware checks (an LM head, heads and positions in range, single
target/distractor tokens, equal token counts), estimates the memory of its intervention
forwards (counted against ``max_request_bytes`` by the engine before any forward runs) and
returns the job, which runs on the device thread after the recorded forwards: the intervention
forwards themselves (service/runtime/interventions.py) and the metric math
(service/analysis/interventions.py). Source: S004, "verify with an intervention"
(docs/sources.md); TransformerLens ``patching``; Nanda 2023 and Kramár et al. 2024 (attribution).

``/v1/ablate`` and ``/v1/patch`` name their texts ``text``/``resample_text``/
``reference_texts`` and ``clean_text``/``corrupted_text``, so they are tokenized here (the
runtime's tokenize cache makes a repeated text free) rather than by the engine.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from attnscope.schemas.interventions import AblateRequest, PatchRequest, PredictionsRequest
from ..analysis import interventions as A
from ..encoding import encode_tensor, estimate_encoded_bytes
from ..errors import BatchTooLarge, InvalidRequest, NonFiniteValues, OutOfRange, n_tokens
from ..runtime import hooked
from ..runtime import interventions as I
from .core.engine import Plan
from .core.table import Endpoint
from attnscope.schemas import AblateResponse, PatchResponse, PredictionsResponse
from .core.cancel import progress
from .core.checks import check_distinct, check_index
from .core.estimates import forward_flops, predictions_bytes
from .common import text_or_results
from .core.inputs import list_length, tokenized, tokenized_list

ATTRIBUTION_NOTE = (
    "attribution patching (Nanda 2023; Kramár et al. 2024, AtP): a linear approximation "
    "(first-order Taylor) of activation patching, grad_z(metric) on the corrupted run times (z_clean - "
    "z_corrupted), from one clean forward, one corrupted forward and one backward; it can be far "
    "off where the metric is not linear in a head's output (e.g. saturated softmax); verify top "
    "heads with method 'exact'"
)


# ------------------------------------------------------------------ helpers
def _num(x) -> float | None:
    """A float32 value as its shortest round-tripping decimal; NaN/inf -> None."""
    v = float(x)
    if not math.isfinite(v):
        return None
    return float(str(np.float32(v)))


def _finite(t, what: str):
    """``t`` (the model's logits, a metric value or a grid of them: tensor or float),
    unchanged, when every value is finite; else :class:`NonFiniteValues` (500
    ``non_finite_values``, naming ``what``): the one rule of every endpoint, a number the model
    produced is never sent as null. (A normalised patching metric whose clean and corrupted
    values are equal has no scale: that NaN is not the model's and stays a documented null.)"""
    ok = bool(torch.isfinite(t).all()) if isinstance(t, torch.Tensor) else math.isfinite(t)
    if not ok:
        raise NonFiniteValues(f"{what} NaN/inf; refusing to report it as numbers")
    return t


def _grid(t: torch.Tensor) -> list:
    """A tensor as nested lists of :func:`_num` (null where not finite)."""
    if t.ndim == 0:
        return _num(t)
    return [_grid(x) for x in t]


def _top(rt, ids: torch.Tensor, logits: torch.Tensor, probs: torch.Tensor) -> list[dict]:
    """The top-k tokens: id, label, bytes, partial (``Runtime.token_refs``), prob, logit."""
    return [dict(ref, prob=_num(p), logit=_num(lg))
            for ref, p, lg in zip(rt.token_refs(ids.tolist()), probs, logits)]


def _tokref(rt, tid: int) -> dict:
    return rt.token_refs([tid])[0]


def check_lm(rt, req=None) -> None:
    """422 ``unsupported_model`` unless the model is a causal LM with an LM head."""
    I.lm_parts(rt)


def _positions(positions: list[int] | None, T: int, field: str, where: str) -> list[int]:
    """The requested positions (each < T, each once), or all ``range(T)``."""
    if positions is None:
        return list(range(T))
    if len(positions) == 0:
        raise InvalidRequest(f"{field} must hold at least one position (or be null for all)", field)
    check_distinct(positions, field)
    for i, p in enumerate(positions):
        if p >= T:
            raise OutOfRange(f"{field}[{i}] = {p} is out of range: {where} has {n_tokens(T)} "
                             f"(valid positions 0..{T - 1})", f"{field}.{i}")
    return list(positions)


def _single_token(rt, s: str, param: str) -> int:
    """The id of ``s`` when it is exactly one token (as plain text, no BOS), else 422."""
    tt = rt.tokenize(s, False, param)
    if len(tt) != 1:
        pieces = [t.label for t in tt.tokens]
        raise InvalidRequest(
            f"{param} {s!r} is {len(tt)} tokens {pieces}, not one; give a string that is a single "
            "token of this model's vocabulary (GPT-2: mind the leading space, e.g. ' Mary')", param,
        )
    return tt.input_ids[0]


def _logit_diff_tokens(rt, opts, T: int, where: str) -> tuple[int, int, int]:
    tgt = _single_token(rt, opts.target, "logit_diff.target")
    dis = _single_token(rt, opts.distractor, "logit_diff.distractor")
    if tgt == dis:
        raise InvalidRequest("logit_diff.target and logit_diff.distractor are the same token",
                             "logit_diff.distractor")
    pos = T - 1 if opts.position is None else opts.position
    if pos >= T:
        raise OutOfRange(f"logit_diff.position = {pos} is out of range: {where} has {n_tokens(T)} "
                         f"(valid positions 0..{T - 1})", "logit_diff.position")
    return tgt, dis, pos


def _check_heads(rt, heads: list[list[int]]) -> list[tuple[int, int]]:
    a = rt.adapter
    out = []
    seen: dict[tuple[int, int], int] = {}
    for i, (layer, head) in enumerate(heads):
        check_index(layer, a.n_layers, "layer", f"heads[{i}][0]", f"heads.{i}.0")
        check_index(head, a.n_heads, "head", f"heads[{i}][1]", f"heads.{i}.1")
        if (layer, head) in seen:
            raise InvalidRequest(f"heads[{i}] = [{layer}, {head}] repeats heads[{seen[(layer, head)]}]",
                                 f"heads.{i}")
        seen[(layer, head)] = i
        out.append((layer, head))
    return out


def _vocab(rt) -> int:
    return int(rt.info.get("vocab_size") or rt.model.config.vocab_size)


# ------------------------------------------------------------------ /v1/predictions
def predictions_plan(rt, req: PredictionsRequest, items) -> Plan:
    """Per text and reported position: the top_k next tokens (probability, logit), the actual
    next token's log-probability and rank, its loss (nats), the entropy; the mean loss. Logits
    from the recorded forward's cached residual stream through the last block, ``ln_f`` and
    the LM head (= Hugging Face's ``GPT2LMHeadModel`` logits). The engine ran ``check_lm``."""
    chosen = []
    for i, it in enumerate(items):
        where = req.input_param(i)
        chosen.append(_positions(req.positions, len(it), "positions", where))
    V = _vocab(rt)
    longest = max(len(it) for it in items)
    est = I.variant_batch_bytes(rt, 1, longest, longest) + 4 * V * longest  # + top-k gather
    est += predictions_bytes([len(it) for it in items], sum(len(p) for p in chosen), req.top_k)

    def job(forwards) -> dict:
        out = []
        for fw, pos in zip(forwards, chosen):
            ids = fw.tokens.input_ids
            logits = _finite(I.recorded_logits(rt, fw.tensors), "the model's logits hold")
            s = A.next_token_stats(logits, ids, req.top_k)
            labels = [t.label for t in fw.tokens.tokens]
            rows, losses = [], []
            for p in pos:
                has_next = p + 1 < len(ids)
                if has_next:
                    losses.append(float(s.loss[p]))
                rows.append({
                    "position": p, "token": labels[p],
                    "next_token": _tokref(rt, ids[p + 1]) if has_next else None,
                    "next_logprob": _num(s.next_logprob[p]) if has_next else None,
                    "next_rank": int(s.next_rank[p]) if has_next else None,
                    "loss": _num(s.loss[p]) if has_next else None,
                    "entropy": _num(s.entropy[p]),
                    "top": _top(rt, s.top_ids[p], s.top_logits[p], s.top_probs[p]),
                })
            out.append({
                "tokens": [t.as_dict() for t in fw.tokens.tokens],
                "positions": rows,
                "mean_loss": _num(np.mean(losses, dtype=np.float64)) if losses else None,
                "n_loss_tokens": len(losses),
            })
        body: dict = {"model": rt.model_ref()}
        return text_or_results(req, body, "predictions", out)

    return Plan(items, job, est, detail=", with the LM head's logits at every position")


# ------------------------------------------------------------------ /v1/ablate
def _components(rt, req: AblateRequest) -> list:
    """``heads`` (as head components, first) and ``components``, resolved and checked: layers,
    heads and neurons in range, nothing repeated, a direction's hook a per-layer hook of the
    hooked forward with a fixed last axis, its vector of that size and not zero (normalised
    to unit length). 422 naming the field otherwise."""
    a = rt.adapter
    p = I.lm_parts(rt)
    out, seen = [], {}
    for layer, head in (req.heads or []):
        out.append(I.Component("head", int(layer), head=int(head)))
        seen[("head", int(layer), int(head))] = f"heads.{len(out) - 1}"
    d_mlp = hooked.resolve(p, "blocks.0.mlp.hook_post")[0].sizes[-1]
    for i, c in enumerate(req.components or []):
        f = f"components.{i}"
        if c.kind != "direction":
            check_index(c.layer, a.n_layers, "layer", f"{f}.layer", f"{f}.layer")
        if c.kind == "head":
            check_index(c.head, a.n_heads, "head", f"{f}.head", f"{f}.head")
            key = ("head", c.layer, c.head)
            comp = I.Component("head", c.layer, head=c.head)
        elif c.kind in ("mlp", "attn"):
            key = (c.kind, c.layer)
            comp = I.Component(c.kind, c.layer)
        elif c.kind == "neuron":
            check_distinct(c.neurons, f"{f}.neurons")
            for j, n in enumerate(c.neurons):
                check_index(n, d_mlp, "neuron", f"{f}.neurons[{j}]", f"{f}.neurons.{j}")
            key = ("neuron", c.layer, tuple(c.neurons))
            comp = I.Component("neuron", c.layer, neurons=list(c.neurons))
        else:
            hps = hooked.resolve(p, c.hook, f"{f}.hook")
            if len(hps) != 1 or hps[0].layer is None:
                raise InvalidRequest(f"{f}.hook: {c.hook!r} must name one per-layer hook "
                                     "(blocks.{l}.<hook>), not a pattern or a model-level hook",
                                     f"{f}.hook")
            hp = hps[0]
            if hp.site not in hooked.LAYER_SITES:  # e.g. blocks.{l}.attn.hook_cos / hook_sin
                raise InvalidRequest(f"{f}.hook: {hp.name} is not an activation of the forward "
                                     "(a rotary table); a direction is projected out of "
                                     "activations: resid, attn/mlp outputs, q/k/v, z, "
                                     "mlp.hook_pre/post", f"{f}.hook")
            d = hp.sizes[-1]
            if d is None:
                raise InvalidRequest(f"{f}.hook: {hp.name}'s last axis ({hp.axes[-1]}) is a "
                                     "position axis; a direction needs a fixed one (d_model, "
                                     "d_mlp, d_head)", f"{f}.hook")
            if len(c.vector) != d:
                raise InvalidRequest(f"{f}.vector: {len(c.vector)} entries given, {hp.name}'s "
                                     f"last axis ({hp.axes[-1]}) has {d}", f"{f}.vector")
            v = torch.tensor(c.vector, dtype=torch.float64)
            norm = float(v.norm())
            if not math.isfinite(norm) or norm == 0.0:
                raise InvalidRequest(f"{f}.vector: a finite, non-zero vector is needed (norm "
                                     f"{norm})", f"{f}.vector")
            if c.positions is not None:
                if not c.positions:  # an empty list would ablate nothing, silently
                    raise InvalidRequest(f"{f}.positions must hold at least one position (or "
                                         "be null for all)", f"{f}.positions")
                check_distinct(c.positions, f"{f}.positions")
            key = ("direction", hp.name, tuple(c.vector), tuple(c.positions or ()))
            comp = I.Component("direction", hp.layer, hook=hp.name, norm=norm,
                               vector=(v / norm).to(p.dtype), positions=c.positions)
        if key in seen:
            raise InvalidRequest(f"{f} repeats {seen[key]}", f)
        seen[key] = f
        out.append(comp)
    return out


def _component_dict(c) -> dict:
    d = {"kind": c.kind, "layer": c.layer}
    if c.kind == "head":
        d["head"] = c.head
    elif c.kind == "neuron":
        d["neurons"] = list(c.neurons)
    elif c.kind == "direction":
        d.update(hook=c.hook, vector_norm=c.norm,
                 positions=None if c.positions is None else list(c.positions))
    return d


def ablate_check(rt, req: AblateRequest) -> None:
    """Before tokenizing: an LM head, heads (and components) in range and distinct, reference
    count."""
    check_lm(rt)
    if req.heads is not None:
        _check_heads(rt, req.heads)
    if req.components is not None:
        _components(rt, req)
    refs = list_length(req, "reference_texts")
    if refs is not None and refs[1] > rt.settings.max_batch:
        field, n = refs
        raise BatchTooLarge(f"{field} holds {n} {'texts' if field == 'reference_texts' else 'sequences'}; "
                            f"the limit is {rt.settings.max_batch} (max_batch)", field)


def ablate_plan(rt, req: AblateRequest, items, *, binary: bool = False,
                refs: list | None = None) -> Plan:
    """Tokenize the texts, check positions / target tokens / the resample text's length, and
    estimate the ablated forwards (a scan: one batch of n_heads variants per layer). ``refs``:
    the reference texts already tokenized (a dataset's texts, tokenized once for all of them)."""
    if req.texts is not None or req.token_lists is not None:
        return _dataset_ablate_plan(rt, req, binary=binary)
    a = rt.adapter
    main = tokenized(rt, req, "text")
    where = "text" if req.text is not None else "tokens"
    items = [main]
    if refs is None:
        refs = tokenized_list(rt, req, "reference_texts") or []
    items += refs
    resample = None
    T = len(main)
    if req.method == "resample":
        resample = tokenized(rt, req, "resample_text")
        if len(resample) != T:
            other = "resample_text" if req.resample_text is not None else "resample_tokens"
            raise InvalidRequest(
                f"{other} has {n_tokens(len(resample))} but {where} has {T}; method 'resample' "
                "needs inputs of the same token count", other)
        items.append(resample)
    # checked once, by ablate_check (the engine's check)
    heads = [(int(lyr), int(h)) for lyr, h in req.heads] if req.heads is not None else None
    comps = _components(rt, req) if req.components is not None else None
    for i, c in enumerate(req.components or []):  # a direction's positions against the text
        for j, q in enumerate(getattr(c, "positions", None) or []):
            if not 0 <= q < T:
                raise OutOfRange(f"components.{i}.positions.{j} = {q} is out of range: {where} "
                                 f"has {n_tokens(T)} (valid 0..{T - 1})",
                                 f"components.{i}.positions.{j}")
    positions = _positions(req.positions, T, "positions", where)
    dm = declared_metric(rt, req.metric, T, main.input_ids, "metric") \
        if req.metric is not None else None
    ld = _logit_diff_tokens(rt, req.logit_diff, T, where) if req.logit_diff is not None else None
    encoding = "binary" if binary else req.encoding
    V = _vocab(rt)
    if req.scan and req.scan_metric == "loss" and not any(p + 1 < T for p in positions):
        raise InvalidRequest("scan_metric 'loss' needs a position with a next token (the text has "
                             f"{T} token{'s' if T != 1 else ''}; the last position has none)",
                             "positions")
    if req.scan:
        n_pos = {"logit_diff": 1, "metric": len(dm.positions) if dm else 1}.get(
            req.scan_metric, len(positions))
        est = I.variant_batch_bytes(rt, a.n_heads, T, n_pos) + 4 * V * T * 3
        detail = (f", plus the scan's {a.n_layers * a.n_heads} ablated forwards in batches of "
                  f"{a.n_heads}")
    else:
        est = I.variant_batch_bytes(rt, 2, T, T)
        detail = ", plus the ablated forward"
        if comps is not None:  # the reference texts' forwards, batched under _batch_budget
            longest = max([T] + [len(r) for r in refs])
            est += min(I.variant_batch_bytes(rt, 1, longest, longest) * (1 + len(refs)),
                       _batch_budget(rt))
            detail = ", plus the ablated forward (and one per neuron/direction hook)"
        if req.include_patterns:
            est += 4 * a.n_layers * a.n_heads * T * T * 2 + estimate_encoded_bytes(
                a.n_layers * a.n_heads * T * T, encoding, req.dtype, req.round, req.layout, None, T)

    def job(forwards, shared: dict | None = None) -> dict:
        """``shared`` (a dataset's job): ``value`` (the dataset's AblationValue) and
        ``logits`` (this text's components-ablated logits ``[pos, vocab]``), computed once
        for the dataset instead of per text."""
        ft = forwards[0].tensors
        shared = shared or {}
        if "value" in shared:
            value = shared["value"]
        elif comps is not None and not req.scan:
            value = None  # the components path takes its own sources
        else:
            value = I.ablation_value(req.method, ft,
                                     [f.tensors for f in forwards[1:1 + len(refs)]],
                                     forwards[-1].tensors if resample is not None else None)
        ids = main.input_ids
        labels = [t.label for t in main.tokens]
        body: dict = {"model": rt.model_ref(), "tokens": [t.as_dict() for t in main.tokens],
                      "method": req.method, "heads": [list(h) for h in heads] if heads else None}
        clean = _finite(I.recorded_logits(rt, ft), "the model's logits hold")  # [pos, vocab]
        ld_body = None
        if ld is not None:
            tgt, dis, lpos = ld
            ld_body = {"target": _tokref(rt, tgt), "distractor": _tokref(rt, dis), "position": lpos,
                       "clean": _num(A.logit_diff(clean[lpos], tgt, dis)), "ablated": None}
        mbody = None
        if dm is not None:
            c_lp = A.log_softmax(clean[dm.positions])
            mbody = {"kind": dm.kind, "reduce": dm.reduce,
                     "clean": _num(_finite(float(dm.values(clean[dm.positions][None], c_lp)[0]),
                                           "the clean run's metric is")),
                     "ablated": None, "resample": None, "normalized": None}
        body["metric"] = mbody
        body["components"] = None if comps is None else [_component_dict(c) for c in comps]
        if req.scan:
            body["scan"] = _scan(rt, req, ft, value, clean, ids, positions, ld, dm)
            body["logit_diff"] = ld_body
            return body
        if comps is not None and "logits" in shared:
            run = I.RunOutput(shared["logits"][None], 0, [])
        elif comps is not None:
            texts = [r.input_ids for r in refs] or [ids]
            src = I.component_sources(rt, comps, req.method, texts,
                                      resample.input_ids if resample is not None else None,
                                      max_bytes=_batch_budget(rt))
            run = I.ablate_components(rt, ids, comps, req.method, src,
                                      capture_patterns=req.include_patterns)
        else:
            run = I.ablate(rt, ft, heads, value, capture_patterns=req.include_patterns)
        abl = _finite(run.logits[0], "the ablated run's logits hold")
        if mbody is not None:
            P = dm.positions
            a_val = float(dm.values(abl[P][None], c_lp)[0])
            mbody["ablated"] = _num(_finite(a_val, "the ablated run's metric is"))
            if resample is not None:
                r_lg = I.recorded_logits(rt, forwards[-1].tensors, P)
                r_val = _finite(float(dm.values(r_lg[None], c_lp)[0]),
                                "the resample run's metric is")
                mbody["resample"] = _num(r_val)
                mbody["normalized"] = _num(A.normalized(torch.tensor(a_val),
                                                        float(mbody["clean"]), r_val))
        lc, la = A.log_softmax(clean), A.log_softmax(abl)
        kl = A.kl_divergence(lc, la)
        ci, cl, cp = A.topk(clean, req.top_k)
        ai, al, ap = A.topk(abl, req.top_k)
        rows, loss_c, loss_a, kls = [], [], [], []
        for p in positions:
            has_next = p + 1 < T
            row = {"position": p, "token": labels[p],
                   "next_token": _tokref(rt, ids[p + 1]) if has_next else None,
                   "loss_clean": None, "loss_ablated": None, "delta_loss": None,
                   "kl": _num(kl[p]),
                   "top_clean": _top(rt, ci[p], cl[p], cp[p]),
                   "top_ablated": _top(rt, ai[p], al[p], ap[p])}
            kls.append(float(kl[p]))
            if has_next:
                c_, a_ = -float(lc[p, ids[p + 1]]), -float(la[p, ids[p + 1]])
                loss_c.append(c_)
                loss_a.append(a_)
                row.update(loss_clean=_num(c_), loss_ablated=_num(a_), delta_loss=_num(a_ - c_))
            rows.append(row)
        body.update(
            positions=rows,
            mean_loss_clean=_num(np.mean(loss_c)) if loss_c else None,
            mean_loss_ablated=_num(np.mean(loss_a)) if loss_a else None,
            mean_kl=_num(np.mean(kls)),
        )
        if ld_body is not None:
            ld_body["ablated"] = _num(A.logit_diff(abl[ld[2]], ld[0], ld[1]))
        body["logit_diff"] = ld_body
        if req.include_patterns and comps is not None:
            pattern = torch.stack([pat[0] for pat in run.patterns]).to(ft.pattern.dtype).cpu()
            body["patterns"] = encode_tensor(pattern, encoding, req.dtype, req.round, "patterns",
                                             layout=req.layout)
        elif req.include_patterns:
            pattern = ft.pattern.clone()  # layers below the first ablated one are unchanged
            for i, pat in enumerate(run.patterns):
                pattern[run.start + i] = pat[0].to(pattern.dtype).cpu()
            body["patterns"] = encode_tensor(pattern, encoding, req.dtype, req.round, "patterns",
                                             layout=req.layout)
        return body

    return Plan(items, job, est, detail=detail)


def _scan(rt, req, ft, value, clean, ids, positions, ld, dm=None) -> dict:
    """Every head ablated alone -> ``grid`` [layer, head] of the scan metric, ``effect`` =
    grid - clean."""
    T = len(ids)
    if req.scan_metric == "metric":
        P = dm.positions
        c_lp = A.log_softmax(clean[P]).to(rt.device)
        clean_v = float(dm.values(clean[P][None], c_lp)[0])

        def metric(lg):
            return dm.values(lg, c_lp)
    elif req.scan_metric == "logit_diff":
        tgt, dis, lpos = ld
        P = [lpos]
        clean_v = float(A.logit_diff(clean[lpos], tgt, dis))

        def metric(lg):
            return A.logit_diff(lg[:, 0], tgt, dis)
    elif req.scan_metric == "loss":
        P = [p for p in positions if p + 1 < T]
        if not P:
            raise InvalidRequest("scan_metric 'loss' needs a position with a next token (not only "
                                 "the last)", "positions")
        nxt = torch.tensor([ids[p + 1] for p in P])
        clean_v = float(A.token_loss(A.log_softmax(clean[P]), nxt).mean())

        def metric(lg):
            return A.token_loss(A.log_softmax(lg), nxt).mean(-1)
    else:  # kl
        P = positions
        lc = A.log_softmax(clean[P]).to(rt.device)
        clean_v = 0.0

        def metric(lg):
            return A.kl_divergence(lc[None], A.log_softmax(lg)).mean(-1)
    grid = _finite(I.ablation_scan(rt, ft, value, metric, P), "the scan's metric grid holds")
    return {"metric": req.scan_metric, "clean": _num(clean_v), "grid": _grid(grid),
            "effect": _grid(grid - clean_v)}


# ------------------------------------------------------------------ /v1/patch
def patch_check(rt, req: PatchRequest) -> None:
    check_lm(rt)


def patch_plan(rt, req: PatchRequest, items) -> Plan:
    """Tokenize both texts (equal token counts, else 422 naming both), resolve the metric,
    estimate the largest batch of patched forwards (per layer: n_heads variants, n_heads x T
    per position, T for the residual stream; attribution: one forward with every activation
    kept for the backward) and return the job."""
    if req.pairs is not None:
        return _dataset_patch_plan(rt, req)
    a = rt.adapter
    clean_t = tokenized(rt, req, "clean_text")
    corr_t = tokenized(rt, req, "corrupted_text")
    clean = "clean_text" if req.clean_text is not None else "clean_tokens"
    corrupted = "corrupted_text" if req.corrupted_text is not None else "corrupted_tokens"
    T = len(clean_t)
    if len(corr_t) != T:
        raise InvalidRequest(
            f"{clean} has {n_tokens(T)} and {corrupted} has {len(corr_t)}; activation "
            "patching needs the same token count (pad or reword one of them)", corrupted)
    if req.hook is not None or not isinstance(req.metric, str):
        return _hook_patch_plan(rt, req, clean_t, corr_t, clean)
    ids = clean_t.input_ids
    ld = None
    if req.metric == "logit_diff":
        ld = _logit_diff_tokens(rt, req.logit_diff, T, clean)
        P = [ld[2]]
    else:
        P = [p for p in _positions(req.positions, T, "positions", clean) if p + 1 < T]
        if not P:
            raise InvalidRequest("metric 'loss' needs a position with a next token (not only the "
                                 "last)", "positions")
    if req.method == "attribution":
        est = I.variant_batch_bytes(rt, 1, T, len(P), grad=True)
        detail = ", plus the attribution forward and backward"
    else:
        widest = max(a.n_heads * (T if req.per_position else 1), T if req.residual else 0)
        n_fwd = a.n_layers * (a.n_heads + (a.n_heads * T if req.per_position else 0)
                              + (T if req.residual else 0))
        est = I.variant_batch_bytes(rt, widest, T, len(P))
        detail = (f", plus {n_fwd} patched forwards in batches of up to {widest} variants "
                  f"(est. {est} bytes for the widest batch)")

    attribution = req.method == "attribution"
    L, Hn = a.n_layers, a.n_heads

    def job(forwards) -> dict:
        fc = forwards[0].tensors
        if ld is not None:
            tgt, dis, _ = ld

            def raw(lg):  # [batch, 1, vocab] -> [batch]
                return A.logit_diff(lg[:, 0], tgt, dis)
        else:
            nxt = torch.tensor([ids[p + 1] for p in P])

            def raw(lg):
                return A.token_loss(A.log_softmax(lg), nxt).mean(-1)
        c_val = _finite(float(raw(I.recorded_logits(rt, fc, P)[None])[0]),
                        "the clean run's metric is")
        if attribution:
            # the corrupted run is the attribution forward itself (metric, z, gradients): one
            # recorded forward (clean), one forward and one backward (corrupted)
            metric = (hooked.LogitDiff(terms=[(0, ld[2], ld[0], ld[1])]) if ld is not None
                      else hooked.Loss(terms=[(0, p) for p in P]))
            m, grads, zk = I.attribution_grads(rt, corr_t.input_ids, metric, with_z=True)
            k_val = _finite(float(m), "the corrupted run's metric is")
        else:
            fk = forwards[1].tensors
            k_val = _finite(float(raw(I.recorded_logits(rt, fk, P)[None])[0]),
                            "the corrupted run's metric is")
        body: dict = {
            "model": rt.model_ref(),
            "clean_tokens": [t.as_dict() for t in clean_t.tokens],
            "corrupted_tokens": [t.as_dict() for t in corr_t.tokens],
            "metric": req.metric, "method": req.method,
            "logit_diff": None if ld is None else {
                "target": _tokref(rt, ld[0]), "distractor": _tokref(rt, ld[1]),
                "position": ld[2], "clean": _num(c_val), "ablated": None},
            "clean_value": _num(c_val), "corrupted_value": _num(k_val),
            "heads_per_position": None, "residual": None, "approximation": None,
        }

        def norm(x):  # the patched metric (checked finite), normalised
            return A.normalized(_finite(x, "the patched metric grid holds"), c_val, k_val)
        if attribution:
            g = torch.stack(grads).cpu()
            zc = I.head_z(fc.pattern, fc.v)
            zk = zk.cpu()
            heads_raw = k_val + A.attribution(g, zc, zk)
            if req.per_position:
                body["heads_per_position"] = _grid(norm(k_val + A.attribution(g, zc, zk, True)))
            body["approximation"] = ATTRIBUTION_NOTE
        else:
            cells = [0]
            total = L * Hn * (1 + (T if req.per_position else 0)) + (L * T if req.residual else 0)
            progress(0, total)

            def by_layer(per_position: bool) -> torch.Tensor:  # one layer a report
                out = None
                for layer in range(L):
                    g = I.head_patch_grid(rt, fc, fk, raw, P, per_position, [layer])
                    if out is None:
                        out = g
                    else:
                        out[layer] = g[layer]
                    cells[0] += Hn * (T if per_position else 1)
                    progress(cells[0], total)
                return out
            heads_raw = by_layer(False)
            if req.per_position:
                body["heads_per_position"] = _grid(norm(by_layer(True)))
            if req.residual:
                body["residual"] = _grid(norm(I.resid_patch_grid(rt, fc, fk, raw, P)))
                progress(total, total)
        body["heads"] = _grid(norm(heads_raw))
        body["heads_raw"] = _grid(heads_raw)  # finite: norm() checked it
        return body

    return Plan([clean_t] if attribution else [clean_t, corr_t], job, est, detail=detail,
                progress="cells")  # attribution: no reports, the body line only


# ------------------------------------------------------------------ declared metrics
def declared_metric(rt, m, T: int, ids, param: str) -> A.DeclaredMetric:
    """A request's declared metric (schemas.run ``Metric``) resolved for one prompt of ``T``
    tokens whose next tokens are ``ids`` (a loss term's target): positions in range (negative
    from the end), token texts single tokens, ids in the vocabulary, every term's prompt
    null/0 (a KL term's runs 0 = measured, 1 = reference); 422 naming the term otherwise."""
    V = _vocab(rt)
    terms = []
    for i, t in enumerate(m.terms):
        tp = f"{param}.terms.{i}"
        if m.kind == "kl":
            for f in ("prompt", "reference_prompt"):
                if getattr(t, f) not in (0, 1):
                    raise InvalidRequest(f"{tp}.{f}: {getattr(t, f)} is not a run here (0 = the "
                                         "run measured, 1 = the reference run)", f"{tp}.{f}")
        elif t.prompt not in (None, 0):
            raise InvalidRequest(f"{tp}.prompt: {t.prompt}; each run is read alone (null or 0)",
                                 f"{tp}.prompt")
        if not -T <= t.position < T:
            raise OutOfRange(f"{tp}.position = {t.position} is out of range for {n_tokens(T)} "
                             f"(valid {-T}..{T - 1})", f"{tp}.position")
        pos = t.position % T
        toks = []
        for name in ("target", "distractor"):
            ref = getattr(t, name, None)
            if ref is None:
                continue
            tid = _single_token(rt, ref, f"{tp}.{name}") if isinstance(ref, str) else int(ref)
            if not 0 <= tid < V:
                raise OutOfRange(f"{tp}.{name} = {tid} is out of range (token ids 0..{V - 1})",
                                 f"{tp}.{name}")
            toks.append(tid)
        if m.kind == "kl":
            terms.append((t.prompt, t.reference_prompt, pos))
        elif m.kind == "loss":
            if pos >= T - 1:
                raise InvalidRequest(f"{tp}.position: {pos} has no next token (the loss at a "
                                     f"position predicts the next; the last is {T - 2})",
                                     f"{tp}.position")
            terms.append((pos, int(ids[pos + 1])))
        else:
            terms.append((pos, *toks))
    return A.DeclaredMetric(m.kind, tuple(terms), m.reduce)


def _legacy_metric(rt, req, T: int, ids, clean: str) -> A.DeclaredMetric:
    """/v1/patch's 'logit_diff' / 'loss' as a declared metric (same numbers)."""
    if req.metric == "logit_diff":
        tgt, dis, pos = _logit_diff_tokens(rt, req.logit_diff, T, clean)
        return A.DeclaredMetric("logit_diff", ((pos, tgt, dis),))
    P = [p for p in _positions(req.positions, T, "positions", clean) if p + 1 < T]
    if not P:
        raise InvalidRequest("metric 'loss' needs a position with a next token (not only the "
                             "last)", "positions")
    return A.DeclaredMetric("loss", tuple((p, int(ids[p + 1])) for p in P))


def _hooked_metric(dm: A.DeclaredMetric):
    """The hooked forward's metric for the gradient of attribution patching, on a batch whose
    row 0 is the run measured and row 1 the reference (clean) run; the sign to apply (a loss
    is the negative log-probability of the clean text's next token)."""
    if dm.kind == "logit_diff":
        return hooked.LogitDiff(terms=[(0, p, t, d) for p, t, d in dm.terms], reduce=dm.reduce), 1
    if dm.kind == "prob":
        return hooked.Prob(terms=[(0, p, t) for p, t in dm.terms], reduce=dm.reduce), 1
    if dm.kind == "logprob":
        return hooked.LogProb(terms=[(0, p, t) for p, t in dm.terms], reduce=dm.reduce), 1
    if dm.kind == "loss":
        return hooked.LogProb(terms=[(0, p, t) for p, t in dm.terms], reduce=dm.reduce), -1
    return hooked.KL(terms=list(dm.terms), reduce=dm.reduce), 1


def _check_sel(values, size: int, field: str, what: str) -> list[int] | None:
    if values is None:
        return None
    if len(values) == 0:
        raise InvalidRequest(f"{field} must hold at least one {what} (or be null for all)", field)
    check_distinct(values, field)
    for i, v in enumerate(values):
        check_index(v, size, what, f"{field}.{i}", f"{field}.{i}")
    return list(values)


#: most rows of one batch of patched forwards (the memory estimate may lower it)
PATCH_CHUNK_BYTES = 512 << 20


def _batch_budget(rt) -> int:
    """The bytes one batched forward of a dataset's texts may take (:data:`PATCH_CHUNK_BYTES`,
    at most half of ``max_request_bytes``)."""
    limit = int(getattr(rt.settings, "max_request_bytes", 0) or 0)
    return min(PATCH_CHUNK_BYTES, limit // 2) if limit else PATCH_CHUNK_BYTES


def _hook_patch_plan(rt, req: PatchRequest, clean_t, corr_t, clean: str) -> Plan:
    """/v1/patch with ``hook`` or a declared metric: every cell of TransformerLens'
    ``get_act_patch_*`` grid at that hook (``I.hook_patch_grid``, exact) or its attribution
    estimate (``I.hook_attribution``), the metric raw and normalised. Without ``hook`` (a
    declared metric on the head grid): z at every position, plus ``per_position`` /
    ``residual`` as before."""
    a = rt.adapter
    T = len(clean_t)
    ids = clean_t.input_ids
    dm = (_legacy_metric(rt, req, T, ids, clean) if isinstance(req.metric, str)
          else declared_metric(rt, req.metric, T, ids, "metric"))
    P = dm.positions
    attribution = req.method == "attribution"
    hook = req.hook or "z"
    kind = I.PATCH_HOOKS[hook][1]
    if req.patch_heads is not None and kind == "pos":
        raise InvalidRequest(f"patch_heads: hook {hook!r} has no head axis", "patch_heads")
    layers = _check_sel(req.patch_layers, a.n_layers, "patch_layers", "layer")
    n_hook_heads = I.hook_heads(rt, hook)  # k/v hooks of a GQA model: the key/value heads
    heads = _check_sel(req.patch_heads, n_hook_heads, "patch_heads",
                       "head" if n_hook_heads == a.n_heads else "key/value head")
    ppos = _check_sel(req.patch_positions, T, "patch_positions", "position")
    grids = [(hook, req.by_position if kind != "pos" else True, "grid")]
    if req.hook is None:  # the head grid's fields, on the declared metric
        grids = [("z", False, "heads")]
        if req.per_position:
            grids.append(("z", True, "heads_per_position"))
        if req.residual:
            grids.append(("resid_pre", True, "residual"))
    es = max(4, next(rt.model.parameters()).element_size())
    if attribution:
        est = I.variant_batch_bytes(rt, 2, T, len(P), grad=True) * 2
        n_rows = 0
        detail = ", plus the attribution forward and backward"
        rows_per = 1
    else:
        per_row = I.variant_batch_bytes(rt, 1, T, len(P)) + es * 2 * T * a.d_model
        limit = int(getattr(rt.settings, "max_request_bytes", 0) or 0)
        budget = min(PATCH_CHUNK_BYTES, limit // 2) if limit else PATCH_CHUNK_BYTES
        rows_per = max(1, budget // max(per_row, 1))
        n_rows = sum(I.patch_cells(rt, h, b, T, layers, heads if I.PATCH_HOOKS[h][1] != "pos"
                                   else None, ppos) for h, b, _ in grids)
        widest = min(rows_per, max(I.patch_cells(rt, h, b, T, None, heads if I.PATCH_HOOKS[h][1]
                                                 != "pos" else None, ppos) // a.n_layers
                                   for h, b, _ in grids))
        # the clean and corrupted runs, every layer's hook values and residual stream kept,
        # and the per-layer cell masks (bool, cells x the hook's leading axes)
        est = per_row * widest + 2 * I.variant_batch_bytes(rt, 1, T, len(P))
        for h, b, _ in grids:
            hp = hooked.resolve(I.lm_parts(rt), I.patch_hook_name(h, 0))[0]
            lead = math.prod(hp.shape(1, T)[1:3 if hp.head_axis is not None else 2])
            est += es * a.n_layers * (3 * math.prod(hp.shape(1, T)) + T * a.d_model) \
                + I.patch_cells(rt, h, b, T, [0], None, ppos) * lead
        detail = (f", plus {n_rows} patched forward rows in batches of up to {widest} (est. "
                  f"{est} bytes)")
    cells = sum(math.prod(I.patch_grid_shape(rt, h, b, T)) for h, b, _ in grids)
    est += 2 * 16 * cells + 4 * 4 * cells  # the grids (float32) and their JSON numbers
    # device work: the clean and corrupted runs, then each layer's patched rows from that layer
    # (attribution: a clean forward, and a forward and backward of the corrupted run, per grid)
    p_ = I.lm_parts(rt)
    dims = dict(n_layers=a.n_layers, d_model=a.d_model,
                d_mlp=hooked.resolve(p_, "blocks.0.mlp.hook_post")[0].sizes[-1],
                logit_positions=len(P), d_vocab=_vocab(rt))
    flops = 2 * forward_flops(T, **dims)
    for h, b, _ in grids:
        if attribution:
            flops += 4 * forward_flops(T, rows=1 + (dm.kind == "kl"), **dims)
            continue
        hs = heads if I.PATCH_HOOKS[h][1] != "pos" else None
        per_layer = I.patch_cells(rt, h, b, T, [0], hs, ppos)
        flops += sum(forward_flops(T, rows=per_layer, layers=a.n_layers - lyr, **dims)
                     for lyr in (layers if layers is not None else range(a.n_layers)))

    def job(_forwards) -> dict:
        p = I.lm_parts(rt)
        ref = I.hook_runs(rt, clean_t.input_ids, [], P)
        c_logits = _finite(ref.logits, "the model's logits hold")  # [1, P, vocab]
        ref_logp = A.log_softmax(c_logits[0])
        c_val = _finite(float(dm.values(c_logits, ref_logp)[0]), "the clean run's metric is")
        k_logits = _finite(I.hook_runs(rt, corr_t.input_ids, [], P).logits,
                           "the model's logits hold")
        k_val = _finite(float(dm.values(k_logits, ref_logp)[0]), "the corrupted run's metric is")

        def metric(lg):
            return dm.values(lg, ref_logp)

        body: dict = {
            "model": rt.model_ref(),
            "clean_tokens": [t.as_dict() for t in clean_t.tokens],
            "corrupted_tokens": [t.as_dict() for t in corr_t.tokens],
            "metric": dm.kind, "method": req.method,
            "logit_diff": None, "clean_value": _num(c_val), "corrupted_value": _num(k_val),
            "heads": None, "heads_raw": None, "heads_per_position": None, "residual": None,
            "grid": None, "approximation": ATTRIBUTION_NOTE if attribution else None,
        }
        if req.metric == "logit_diff":
            pos, tgt, dis = dm.terms[0]
            body["logit_diff"] = {"target": _tokref(rt, tgt), "distractor": _tokref(rt, dis),
                                  "position": pos, "clean": _num(c_val), "ablated": None}
        # progress in cells of the grids asked (cells a grid skips count as done): within
        # a grid, its cells in proportion to its patched forwards run
        sizes = [I.patch_cells(rt, h, b, T, layers, heads if I.PATCH_HOOKS[h][1] != "pos"
                               else None, ppos) for h, b, _ in grids]
        total, before = sum(sizes), 0
        progress(0, total)
        for (h, by_pos, field), size in zip(grids, sizes):
            hkind = I.PATCH_HOOKS[h][1]
            hs = heads if hkind != "pos" else None
            if attribution:
                gm, sign = _hooked_metric(dm)
                _, grads, acts_c, acts_k = I.hook_attribution(
                    rt, clean_t.input_ids, corr_t.input_ids, h, gm,
                    with_clean_row=dm.kind == "kl")
                together = hkind != "pos" and not by_pos and ppos is not None
                keep = {("pos", True): (0,), ("head", False): (1,), ("head", True): (0, 1),
                        ("pattern", False): (0,), ("pattern", True): (0, 1)}[(hkind, by_pos)]
                if together:  # the chosen positions patched together: their cells summed
                    keep = (0, 1)
                per = torch.stack([A.patch_attribution(g, c, k, keep).cpu()
                                   for g, c, k in zip(grads, acts_c, acts_k)])
                if together:
                    per = (per[:, ppos].sum(1) if hkind == "head" else per[:, :, ppos].sum(2))
                raw = k_val + sign * per
                raw = _mask_cells(raw, hkind, by_pos, layers, hs, ppos)
                n_fwd, skipped = 0, 0
            else:
                n_done = []
                raw, skipped = I.hook_patch_grid(
                    rt, clean_t.input_ids, corr_t.input_ids, h, by_pos, metric, P, layers, hs,
                    ppos, max_rows=rows_per,
                    progress=lambda done, n, size=size, before=before: (
                        n_done.append(done), progress(before + size * done // n, total)))
                n_fwd = len(n_done)
            before += size
            progress(before, total)
            computed = ~torch.isnan(raw) if (layers or hs or ppos) else None
            if computed is not None:
                _finite(raw[computed], "the patched metric grid holds")
            else:
                _finite(raw, "the patched metric grid holds")
            normed = A.normalized(raw, c_val, k_val)
            if field == "grid":
                body["grid"] = {
                    "hook": h, "hook_name": I.patch_hook_name(h, 0).replace("blocks.0.",
                                                                            "blocks.{layer}."),
                    "function": I.TL_FUNCTIONS[(h, by_pos)],
                    "axes": list(I.patch_grid_axes(h, by_pos)), "shape": list(raw.shape),
                    "raw": _grid(raw), "normalized": _grid(normed), "n_forwards": n_fwd,
                    "cells_skipped": skipped}
            elif field == "heads":
                body["heads"], body["heads_raw"] = _grid(normed), _grid(raw)
            elif field == "heads_per_position":  # [layer, pos, head] -> [layer, head, pos]
                body["heads_per_position"] = _grid(normed.transpose(1, 2))
            else:
                body["residual"] = _grid(normed)
        return body

    return Plan([], job, est, detail=detail, device_flops=flops, device_param=clean,
                progress="cells")


def _mask_cells(raw: torch.Tensor, kind: str, by_pos: bool, layers, heads, positions):
    """NaN outside the requested layers / heads / positions (attribution computes every cell
    in one backward; the grid reports the ones asked, as the exact method does)."""
    out = raw.clone()
    axes = I.patch_grid_axes({"pos": "resid_pre", "head": "z", "pattern": "pattern"}[kind],
                             by_pos)
    for name, sel in (("layer", layers), ("head", heads),
                      ("pos", positions if (kind == "pos" or by_pos) else None),
                      ("dest_pos", positions if by_pos else None)):
        if sel is None or name not in axes:
            continue
        ax = axes.index(name)
        drop = torch.ones(out.shape[ax], dtype=torch.bool)
        drop[list(sel)] = False
        idx = [slice(None)] * out.ndim
        idx[ax] = drop
        out[tuple(idx)] = float("nan")
    return out


# ------------------------------------------------------------------ /v1/patch over a dataset
from .core import cancel  # noqa: E402  (checkpoint and the progress sink of dataset jobs)

DATASET_NOTE = (
    "pairs: every pair patched as its own request (the single-pair numbers, float32 as served), "
    "then, cell by cell in float64: clean_value / corrupted_value / grid.raw / heads_raw = the "
    "mean over pairs; grid.normalized / heads = normalised of the means, (mean patched - mean "
    "corrupted) / (mean clean - mean corrupted) (Wang et al. 2022); dataset.grid."
    "normalized_mean = the mean of each pair's own normalised value (Heimersheim & Nanda 2024); "
    "std = sample standard deviation (ddof 1), sem = std / sqrt(n)")


def _f64(x) -> float | None:
    v = float(x)
    return v if math.isfinite(v) else None


def _grid64(t: np.ndarray):
    """A float64 array as nested lists (null where NaN/inf), no rounding."""
    if t.ndim == 0:
        return _f64(t)
    return [_grid64(x) for x in t]


def _nested(x) -> np.ndarray:
    """A served grid (nested lists, null = NaN) back as float64."""
    def conv(v):
        return [conv(w) for w in v] if isinstance(v, list) else (np.nan if v is None else v)
    return np.array(conv(x), dtype=np.float64)


def _spread(v: np.ndarray):
    """(mean, sample std ddof 1, standard error) over axis 0; std/sem None for one value."""
    n = v.shape[0]
    mean = v.mean(0)
    if n < 2:
        return mean, None, None
    std = v.std(0, ddof=1)
    return mean, std, std / math.sqrt(n)


def _statistic(v: np.ndarray, per_pair: bool) -> dict:
    mean, std, sem = _spread(v)
    return {"mean": _f64(mean), "std": None if std is None else _f64(std),
            "sem": None if sem is None else _f64(sem), "n": len(v),
            "values": [float(x) for x in v] if per_pair else None}


class _QuietProgress:
    """While one pair's job runs: its own progress reports are not sent (the dataset reports
    pairs done); its cancel checks still run."""

    def __enter__(self):
        self.token = cancel.current()
        self.sink = getattr(self.token, "progress", None)
        if self.sink is not None:
            self.token.progress = None
        return self

    def report(self, done: int, total: int) -> None:
        if self.sink is not None:
            self.sink(done, total)

    def __exit__(self, *exc):
        if self.sink is not None:
            self.token.progress = self.sink
        return False


def _pair_side(rt, pr, side: str, bos: bool, i: int):
    ids = getattr(pr, f"{side}_tokens")
    if ids is not None:
        return rt.tokenized_from_ids(list(ids), f"pairs.{i}.{side}_tokens"), f"{side}_tokens"
    return (rt.tokenize(getattr(pr, f"{side}_text"), bos, f"pairs.{i}.{side}_text"),
            f"{side}_text")


def _dataset_patch_plan(rt, req: PatchRequest) -> Plan:  # noqa: C901
    """/v1/patch over ``pairs``: each pair tokenized (equal token counts within a pair, else
    422 ``pairs.{i}.corrupted_*`` naming both; one length for grids with a position axis, else
    422 ``pairs.{i}``), planned as a single-pair request (:func:`_hook_patch_plan`: the same
    checks, estimates and forwards; a check failing for one pair names ``pairs.{i}``), then
    the grids' statistics over pairs (:data:`DATASET_NOTE`). Memory: the largest pair's
    estimate (pairs run one after another) plus the statistics; device work: the sum."""
    bos = bool(req.add_bos)
    if isinstance(req.metric, str):
        kind, reduce = req.metric, "mean"
    else:
        kind, reduce = req.metric.kind, req.metric.reduce
    position_axis = req.hook is not None and (I.PATCH_HOOKS[req.hook][1] == "pos"
                                              or req.by_position)
    subs, infos = [], []
    for i, pr in enumerate(req.pairs):
        c_t, c_f = _pair_side(rt, pr, "clean", bos, i)
        k_t, k_f = _pair_side(rt, pr, "corrupted", bos, i)
        T = len(c_t)
        if len(k_t) != T:
            raise InvalidRequest(
                f"pairs.{i}: {c_f} has {n_tokens(T)} and {k_f} has {len(k_t)}; activation "
                "patching needs the two prompts of a pair of the same token count",
                f"pairs.{i}.{k_f}")
        if position_axis and infos and T != infos[0]["n_tokens"]:
            raise InvalidRequest(
                f"pairs.{i}: {n_tokens(T)}, pairs.0 has {infos[0]['n_tokens']}; hook "
                f"{req.hook!r}{' by_position' if req.by_position else ''} has a position axis, so "
                "its grids average over pairs of one length (group the pairs by length, or use "
                "an all-position head grid)", f"pairs.{i}")
        if pr.metric is not None and (pr.metric.kind != kind or pr.metric.reduce != reduce):
            raise InvalidRequest(
                f"pairs.{i}.metric: a {pr.metric.kind!r} ({pr.metric.reduce}) metric; every "
                f"pair's is the request's kind and reduce ({kind!r}, {reduce}) so that they "
                "average", f"pairs.{i}.metric")
        sub = req.model_copy(update=dict(
            pairs=None, per_pair=False, clean_text=None, corrupted_text=None,
            clean_tokens=list(c_t.input_ids), corrupted_tokens=list(k_t.input_ids),
            metric=pr.metric if pr.metric is not None else req.metric))
        try:
            sp = _hook_patch_plan(rt, sub, c_t, k_t, f"pairs.{i}.{c_f}")
        except InvalidRequest as e:  # a check of this pair: name it
            if pr.metric is not None and (e.param or "").startswith("metric"):
                e.param = f"pairs.{i}.{e.param}"
            if not e.message.startswith(f"pairs.{i}"):
                e.message = f"pairs.{i}: {e.message}"
                e.args = (e.message,)
            raise
        subs.append(sp)
        infos.append({"n_tokens": T, "clean_tokens": [t.as_dict() for t in c_t.tokens],
                      "corrupted_tokens": [t.as_dict() for t in k_t.tokens]})
    n = len(subs)
    per_pair = req.per_pair
    # the statistics: the stacked per-pair grids (float64) and ~10 grids of JSON numbers
    first_bytes = max(sp.response_bytes for sp in subs)
    est = first_bytes + n * first_bytes // 4 * (2 if per_pair else 1) + 1024 * n
    flops = sum(sp.device_flops for sp in subs)
    field = "grid" if req.hook is not None else "heads"

    def job(_forwards) -> dict:
        bodies = []
        with _QuietProgress() as q:
            q.report(0, n)
            for i, sp in enumerate(subs):
                cancel.checkpoint()
                bodies.append(sp.job([]))
                q.report(i + 1, n)
        cv = np.array([b["clean_value"] for b in bodies], dtype=np.float64)
        kv = np.array([b["corrupted_value"] for b in bodies], dtype=np.float64)
        if field == "grid":
            raw = np.stack([_nested(b["grid"]["raw"]) for b in bodies])
            nrm = np.stack([_nested(b["grid"]["normalized"]) for b in bodies])
        else:
            raw = np.stack([_nested(b["heads_raw"]) for b in bodies])
            nrm = np.stack([_nested(b["heads"]) for b in bodies])
        with np.errstate(invalid="ignore", divide="ignore"):
            raw_mean, raw_std, raw_sem = _spread(raw)
            c_mean, k_mean = float(cv.mean()), float(kv.mean())
            of_means = (raw_mean - k_mean) / (c_mean - k_mean)
            defined = cv != kv  # a pair whose clean and corrupted metrics differ
            nd = nrm[defined]
            if len(nd):
                n_mean, n_std, n_sem = _spread(nd)
            else:
                n_mean = np.full(raw.shape[1:], np.nan)
                n_std = n_sem = None
        none_grid = _grid64(np.full(raw.shape[1:], np.nan))
        body = dict(bodies[0])
        body.update(clean_tokens=[], corrupted_tokens=[], clean_value=_f64(c_mean),
                    corrupted_value=_f64(k_mean))
        if body.get("logit_diff") is not None:
            body["logit_diff"] = dict(body["logit_diff"], clean=_f64(c_mean))
        if field == "grid":
            body["grid"] = dict(bodies[0]["grid"], raw=_grid64(raw_mean),
                                normalized=_grid64(of_means),
                                n_forwards=sum(b["grid"]["n_forwards"] for b in bodies),
                                cells_skipped=sum(b["grid"]["cells_skipped"] for b in bodies))
        else:
            body["heads_raw"], body["heads"] = _grid64(raw_mean), _grid64(of_means)
        body["dataset"] = {
            "n_pairs": n, "pairs": infos,
            "clean": _statistic(cv, per_pair), "corrupted": _statistic(kv, per_pair),
            "grid": {
                "raw_std": none_grid if raw_std is None else _grid64(raw_std),
                "raw_sem": none_grid if raw_sem is None else _grid64(raw_sem),
                "normalized_mean": _grid64(n_mean),
                "normalized_std": none_grid if n_std is None else _grid64(n_std),
                "normalized_sem": none_grid if n_sem is None else _grid64(n_sem),
                "n_normalized": int(defined.sum()),
                "per_pair_raw": _grid64(raw) if per_pair else None,
                "per_pair_normalized": _grid64(nrm) if per_pair else None},
            "n_forwards": sum(b["grid"]["n_forwards"] for b in bodies) if field == "grid"
            else sum(b["grid"]["n_forwards"] if b.get("grid") else 0 for b in bodies),
            "note": DATASET_NOTE,
        }
        return body

    extra = {"progress": "pairs"} if "progress" in getattr(Plan, "__dataclass_fields__", {}) \
        else {}
    return Plan([], job, int(est), detail=f", plus {n} pairs' patching grids (each planned as "
                f"its own request)", device_flops=flops, device_param="pairs", **extra)


# ------------------------------------------------------------------ /v1/ablate over a dataset
def _dataset_ablate_plan(rt, req: AblateRequest, *, binary: bool = False) -> Plan:
    """/v1/ablate over ``texts`` / ``token_lists``: each text planned as a single-text request
    (:func:`ablate_plan`: the same checks and ablated forwards; a check failing for one text
    names ``texts.{i}``) with method 'mean' taking its means over every position of the whole
    dataset (its texts as the reference texts) unless reference_texts are given; the engine
    records each text (and reference) once. The metrics per text, their mean over texts
    (float64 of the served float32 values), sample std (ddof 1) and sem = std / sqrt(n)."""
    field = "texts" if req.texts is not None else "token_lists"
    data = tokenized_list(rt, req, "texts")
    refs = tokenized_list(rt, req, "reference_texts")
    pooled = req.method == "mean" and refs is None
    ref_ids = [list(t.input_ids) for t in (data if pooled else refs or [])]
    subs = []
    shared_refs = None  # the dataset's reference texts tokenized once, not once per text (n^2)
    for i, t in enumerate(data):
        sub = req.model_copy(update=dict(
            texts=None, token_lists=None, per_text=False, text=None, tokens=list(t.input_ids),
            reference_texts=None,
            reference_token_lists=ref_ids if req.method == "mean" else None))
        try:
            if shared_refs is None:
                shared_refs = tokenized_list(rt, sub, "reference_texts") or []
            sp = ablate_plan(rt, sub, [], binary=binary, refs=shared_refs)
        except InvalidRequest as e:
            if (e.param or "") in ("tokens", "text"):
                e.param = f"{field}.{i}"
            if not e.message.startswith(f"{field}.{i}"):
                e.message = f"{field}.{i}: {e.message}"
                e.args = (e.message,)
            raise
        subs.append(sp)
    n, R = len(data), len(refs or [])
    items = list(data) + list(refs or [])
    est = max(sp.response_bytes for sp in subs) + 2048 * n * (2 if req.per_text else 1)
    comps = _components(rt, req) if req.components is not None else None
    budget = _batch_budget(rt)
    if comps is not None and not req.scan:  # the batched forwards (at most the budget)
        longest = max(len(t) for t in data)
        est += min(budget, I.variant_batch_bytes(rt, n, longest, longest))
    if req.scan:
        est += 3 * 16 * rt.adapter.n_layers * rt.adapter.n_heads * n
    per_text = req.per_text

    def job(forwards) -> dict:
        texts_fw, ref_fw = forwards[:n], forwards[n:n + R]
        mean_fw = list(texts_fw) if pooled else list(ref_fw)
        bodies = []
        with _QuietProgress() as q:
            q.report(0, n)
            # once for the dataset, not per text: the heads' mean z, the components' means
            # and their ablated forwards (the texts of one length batched)
            shared: dict = {}
            if req.method == "mean" and (comps is None or req.scan):
                shared["value"] = I.ablation_value("mean", texts_fw[0].tensors,
                                                   [f.tensors for f in mean_fw])
            if comps is not None and not req.scan:
                src = I.component_sources(
                    rt, comps, req.method,
                    [list(t.input_ids) for t in (data if pooled else refs or [])], None,
                    max_bytes=budget)
                got: dict = {}

                def each(i, logits):
                    cancel.checkpoint()
                    fw = [texts_fw[i]] + (mean_fw if req.method == "mean" else [])
                    got[i] = subs[i].job(fw, dict(shared, logits=logits))
                    q.report(len(got), n)
                I.ablate_components_many(rt, [list(t.input_ids) for t in data], comps,
                                         req.method, src, each, max_bytes=budget)
                bodies = [got[i] for i in range(n)]
            else:
                for i, sp in enumerate(subs):
                    cancel.checkpoint()
                    fw = [texts_fw[i]] + (mean_fw if req.method == "mean" else [])
                    bodies.append(sp.job(fw, shared))
                    q.report(i + 1, n)
        stats, vals = {}, {}

        def add(name, xs):
            if any(x is None for x in xs):
                return
            v = np.array(xs, dtype=np.float64)
            vals[name] = v
            stats[name] = _statistic(v, per_text)
        if not req.scan:
            add("mean_loss_clean", [b["mean_loss_clean"] for b in bodies])
            add("mean_loss_ablated", [b["mean_loss_ablated"] for b in bodies])
            if "mean_loss_clean" in vals and "mean_loss_ablated" in vals:
                add("delta_loss", list(vals["mean_loss_ablated"] - vals["mean_loss_clean"]))
            add("mean_kl", [b["mean_kl"] for b in bodies])
        if bodies[0].get("logit_diff") is not None:
            add("logit_diff_clean", [b["logit_diff"]["clean"] for b in bodies])
            if not req.scan:
                add("logit_diff_ablated", [b["logit_diff"]["ablated"] for b in bodies])
        if bodies[0].get("metric") is not None:
            add("metric_clean", [b["metric"]["clean"] for b in bodies])
            if not req.scan:
                add("metric_ablated", [b["metric"]["ablated"] for b in bodies])
        body = dict(bodies[0])
        body.update(tokens=[], positions=None)
        for name in ("mean_loss_clean", "mean_loss_ablated", "mean_kl"):
            if name in body:
                body[name] = _f64(vals[name].mean()) if name in vals else None
        if body.get("logit_diff") is not None:
            body["logit_diff"] = dict(body["logit_diff"], clean=_f64(vals["logit_diff_clean"]
                                                                     .mean()))
            if "logit_diff_ablated" in vals:
                body["logit_diff"]["ablated"] = _f64(vals["logit_diff_ablated"].mean())
        if body.get("metric") is not None:
            body["metric"] = dict(body["metric"], clean=_f64(vals["metric_clean"].mean()))
            if "metric_ablated" in vals:
                body["metric"]["ablated"] = _f64(vals["metric_ablated"].mean())
        ds = {"n_texts": n, "n_tokens": [len(t) for t in data],
              "mean_over": ("dataset" if pooled else "reference_texts")
              if req.method == "mean" else "", "stats": stats,
              "scan_std": None, "scan_sem": None, "per_text_scan": None}
        if req.scan:
            grids = np.stack([_nested(b["scan"]["grid"]) for b in bodies])
            cl = [b["scan"]["clean"] for b in bodies]
            add("scan_clean", cl)
            mean, std, sem = _spread(grids)
            c = vals["scan_clean"].mean() if "scan_clean" in vals else np.nan
            body["scan"] = dict(bodies[0]["scan"], clean=_f64(c), grid=_grid64(mean),
                                effect=_grid64(np.stack([_nested(b["scan"]["effect"])
                                                         for b in bodies]).mean(0)))
            ds["scan_std"] = None if std is None else _grid64(std)
            ds["scan_sem"] = None if sem is None else _grid64(sem)
            ds["per_text_scan"] = _grid64(grids) if per_text else None
        body["dataset"] = ds
        return body

    extra = {"progress": "texts"} if "progress" in getattr(Plan, "__dataclass_fields__", {}) \
        else {}
    return Plan(items, job, int(est), detail=f", plus {n} texts' ablated forwards", **extra)


ENDPOINTS = [
    Endpoint(
        path='/v1/predictions', name='predictions',
        request=PredictionsRequest, response=PredictionsResponse,
        summary='Next-token predictions',
        description="""For each position p of ``text`` (or each of ``texts``): the ``top_k`` most probable next
tokens (probability, logit), the log-probability (nats) and rank (1 = top) of the token that
actually follows, the per-token loss ``-log p`` (nats), the entropy of the next-token
distribution (nats) and the mean loss. Equal to Hugging Face's ``GPT2LMHeadModel`` logits
and loss. Causal LMs only: an encoder answers 422 ``unsupported_model``.""",
        plan=predictions_plan,
        check=check_lm,
        invalid='Invalid request: an encoder without an LM head (unsupported_model), positions out of range, too many tokens.',
        tags=('interventions',), order=90,
    ),
    Endpoint(
        path='/v1/ablate', name='ablate',
        request=AblateRequest, response=AblateResponse,
        summary='Ablate attention heads',
        description="""Ablate ``heads`` ([[layer, head], ...]) together (``method`` zero / mean / resample,
on each head's z before the output projection, TransformerLens ``hook_z``) and report per
position KL(clean ‖ ablated) (nats), the change of loss on the actual next token, top-k
before/after, the logit difference of ``logit_diff`` before/after and optionally the
patterns after the ablation ``[layer, head, query_pos, key_pos]`` (any /v1/attention
encoding; ``Accept: application/x-safetensors`` too). ``scan``: every head ablated alone,
an effect grid ``[layer, head]`` on ``scan_metric``. Source: S004 (docs/sources.md).""",
        plan=ablate_plan,
        check=ablate_check,
        binary=True,
        tokenize=False,
        invalid='Invalid request: no LM head, heads/positions out of range or repeated, target/distractor not one token, resample_text of another token count, memory.',
        tags=('interventions',), order=91,
    ),
    Endpoint(
        path='/v1/patch', name='patch',
        request=PatchRequest, response=PatchResponse,
        summary='Activation patching clean -> corrupted',
        description="""Patch the clean run's head outputs z into the corrupted run one head at a time ->
``heads`` ``[layer, head]`` of the normalised metric ``(patched - corrupted) / (clean -
corrupted)`` (TransformerLens ``get_act_patch_attn_head_out_all_pos``), optionally
``heads_per_position`` ``[layer, head, pos]`` and ``residual`` ``[layer, pos]``
(``get_act_patch_resid_pre``). ``method`` 'attribution': the linear approximation from one
backward (Nanda 2023; Kramár et al. 2024), said so in ``approximation``.""",
        plan=patch_plan,
        check=patch_check,
        tokenize=False,
        streams=True,
        invalid='Invalid request: no LM head, texts of different token counts, target/distractor not one token, too many patched forwards for max_request_bytes.',
        tags=('interventions',), order=92,
    ),
]
