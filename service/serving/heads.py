"""/v1/heads: scores and a label for every head."""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from attnscope.schemas import HeadsRequest
from ..analysis import heads as H
from ..analysis.verify_recorded import AttentionParams
from ..errors import InvalidRequest, NonFiniteValues
from ..runtime import Runtime, TokenizedText
from .core.estimates import heads_bytes
from .core.engine import Plan
from .core.table import Endpoint
from attnscope.schemas import HeadsResponse

PROBE_MEMO_ENTRIES = 64  # distinct probe options kept per runtime
_PROBE_MEMO_LOCK = threading.Lock()


def probe_tokens(rt: Runtime, probe) -> tuple[TokenizedText, int]:
    """The induction probe as tokens: [BOS] + segment x repeats (causal; BOS = the tokenizer's
    bos, else eos), or [CLS] + segment x repeats + [SEP] (encoders), and the segment's start
    position. Raises 422 errors (probe over n_ctx, segment longer than the vocabulary).

    Kept in ``rt.memo`` per (segment_length, repeats, seed): building it walks the whole
    vocabulary (~6 ms for GPT-2's 50,257 tokens), and it depends on nothing else."""
    key = ("induction_probe", probe.segment_length, probe.repeats, probe.seed)
    hit = rt.memo.get(key)
    if hit is None:
        hit = _build_probe_tokens(rt, probe)
        with _PROBE_MEMO_LOCK:  # no insert while another thread counts the keys
            if sum(1 for k in rt.memo if k[0] == "induction_probe") < PROBE_MEMO_ENTRIES:
                rt.memo[key] = hit
    return hit


def _build_probe_tokens(rt: Runtime, probe) -> tuple[TokenizedText, int]:
    tok = rt.tokenizer
    special = set(tok.all_special_ids)
    candidates = [i for i in range(len(tok)) if i not in special]
    if rt.adapter.causal:
        start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        prefix, suffix = ([start] if start is not None else []), []
    else:
        prefix = [tok.cls_token_id] if tok.cls_token_id is not None else []
        suffix = [tok.sep_token_id] if tok.sep_token_id is not None else []
    ids = H.build_induction_probe(candidates, probe.segment_length, probe.repeats, probe.seed,
                                  prefix, suffix, rt.adapter.n_ctx)
    return rt.tokenized_from_ids(ids, "probe"), len(prefix)


def _num(x: float, nd: int | None) -> float | None:
    x = float(x)
    return None if math.isnan(x) else (round(x, nd) if nd is not None else x)


def selected_heads(rt: Runtime, req: HeadsRequest) -> list[tuple[int, int]]:
    """The heads to score, layer-major: ``req.heads`` (null = every head) minus
    ``req.exclude_heads``.

    Raises:
        InvalidRequest: a pair outside the model (param ``heads.i`` / ``exclude_heads.i``,
            naming the value and the range), a pair given twice in one list, or nothing left.
    """
    L, NH = rt.adapter.n_layers, rt.adapter.n_heads
    for field in ("heads", "exclude_heads"):
        seen: dict[tuple[int, int], int] = {}
        for i, (layer, head) in enumerate(getattr(req, field) or []):
            param = f"{field}.{i}"
            if layer >= L:
                raise InvalidRequest(f"{param} = [{layer}, {head}]: layer {layer} is out of range "
                                     f"(the model has {L} layers, 0..{L - 1})", param)
            if head >= NH:
                raise InvalidRequest(f"{param} = [{layer}, {head}]: head {head} is out of range "
                                     f"(the model has {NH} heads per layer, 0..{NH - 1})", param)
            if (layer, head) in seen:
                raise InvalidRequest(f"{param} = [{layer}, {head}] repeats {field}."
                                     f"{seen[(layer, head)]} (each head once)", param)
            seen[(layer, head)] = i
    chosen = ({(int(l), int(h)) for l, h in req.heads} if req.heads is not None
              else {(l, h) for l in range(L) for h in range(NH)})
    left = sorted(chosen - {(int(l), int(h)) for l, h in req.exclude_heads})
    if not left:
        n = len(chosen)
        raise InvalidRequest(f"exclude_heads leaves none of the {n} selected "
                             f"head{'s' if n != 1 else ''} to score", "exclude_heads")
    return left


def plan(rt: Runtime, req: HeadsRequest, items: list[TokenizedText]) -> Plan:
    """Checks (each text at least 2 tokens, as TransformerLens detect_head), the induction
    probe's tokens (forwarded with the texts) and the job: per-head scores averaged over the
    texts, the probe score, every label a head passes and its margins
    (service/analysis/heads.py). ``req.add_bos`` is resolved (the engine: null -> the model's
    convention, service/serving/core/inputs.py)."""
    for i, it in enumerate(items):
        if len(it) < 2:
            param = req.input_param(i)
            raise InvalidRequest(f"{param} has {len(it)} token; head scores need at least 2 "
                                 "tokens (as TransformerLens detect_head does)", param)
    chosen = selected_heads(rt, req)
    probe, start = (probe_tokens(rt, req.probe) if req.probe.enabled else (None, 0))

    def job(forwards) -> dict:
        for fw in forwards:
            # a NaN/inf anywhere makes the sum non-finite (patterns are in [0, 1]: no overflow)
            if not torch.isfinite(fw.pattern.sum()):
                raise NonFiniteValues("the model's attention pattern holds NaN/inf; refusing to score it")
        # the norm scores (independent of the pattern scores) on the second core meanwhile
        norms = (_helper().submit(_norm_score_lists, rt, forwards[: len(items)],
                                  torch.get_num_threads()) if req.norm_scores else None)
        # a layer's sliding window caps the entropy normaliser's count of visible keys
        win = ({"windows": rt.windows} if any(w is not None for w in rt.windows) else {})
        per_text = [H.head_scores(fw.pattern, fw.tokens.input_ids, rt.adapter.causal,
                                  req.exclude_bos, req.exclude_current_token,
                                  req.error_measure, **win)
                    for fw in forwards[: len(items)]]
        scores = H.mean_over_texts(per_text)
        L, NH = scores["self"].shape
        scores["induction_probe"] = (
            H.induction_probe_score(forwards[-1].pattern, start, req.probe.segment_length,
                                    req.probe.repeats)
            if probe else torch.full((L, NH), math.nan, dtype=torch.float64))
        bos = rt.tokenizer.bos_token_id
        th = req.thresholds.model_dump()  # the API's (defaults + overrides); the analysis has none
        out = []
        lists = {n: scores[n].tolist() for n in H.SCORE_NAMES}  # not 1,440 tensor lookups
        for layer, head in chosen:  # layer-major
            s = {n: _num(lists[n][layer][head], req.round) for n in H.SCORE_NAMES}
            c = H.classify_all(s, th)
            out.append({"layer": layer, "head": head, "label": c["label"],
                        "labels": c["labels"], "margin": c["margin"],
                        "margins": c["margins"], "scores": s})
        if norms is not None:
            lists = norms.result()
            for r in out:
                r["norm_scores"] = {k: _num(lists[k][r["layer"]][r["head"]], req.round)
                                    for k in lists}
        return {
            "model": rt.model_ref(),
            "n_texts": len(items),
            "n_tokens": [len(it) for it in items],
            "add_bos": bool(req.add_bos),
            "sink_position": 0,
            "sink_tokens": [it.tokens[0].label for it in items],
            "sink_is_bos": [bool(rt.adapter.causal and bos is not None and it.input_ids[0] == bos)
                            for it in items],
            "dtype": rt.info["dtype"],
            "label_scores": dict(H.LABEL_SCORE),
            "exclude_bos": req.exclude_bos,
            "exclude_current_token": req.exclude_current_token,
            "error_measure": req.error_measure,
            "selected_heads": None if req.heads is None else [list(p) for p in req.heads],
            "exclude_heads": [list(p) for p in req.exclude_heads],
            "thresholds": th,
            "label_order": list(H.LABEL_ORDER) + ["none"],
            "probe": None if probe is None else {
                "segment_length": req.probe.segment_length, "repeats": req.probe.repeats,
                "seed": req.probe.seed, "start": start, "method": "olsson_all_earlier_repeats",
                "n_queries": (req.probe.repeats - 1) * req.probe.segment_length,
                "tokens": [t.as_dict() for t in probe.tokens],
            },
            "heads": out,
        }

    lengths = [len(it) for it in items] + ([len(probe)] if probe else [])
    est = heads_bytes(lengths, rt.adapter.n_layers, rt.adapter.n_heads)
    return Plan(items + ([probe] if probe else []), job, est,
                detail=", one of them the induction probe" if probe else "", small_ops=True)


def _helper() -> ThreadPoolExecutor:
    """One thread beside the device thread for a job's independent half (made on first use)."""
    global _HELPER
    with _PROBE_MEMO_LOCK:
        if _HELPER is None:
            _HELPER = ThreadPoolExecutor(1, thread_name_prefix="attnscope-heads")
    return _HELPER


_HELPER: ThreadPoolExecutor | None = None


def _norm_score_lists(rt: Runtime, forwards, n_threads: int) -> dict[str, list]:
    """Each head's norm scores (service.analysis.norms.noop_scores), mean over texts, as
    ``{name: [layer][head]}`` lists. Runs on :func:`_helper`'s thread with the job's intra-op
    thread count ``n_threads`` (torch keeps a count per thread: the helper would otherwise keep
    the one it first ran with), restored after."""
    prev = torch.get_num_threads()
    if prev != n_threads:
        torch.set_num_threads(n_threads)
    try:
        return _norm_score_tensors(rt, forwards)
    finally:
        if prev != n_threads:
            torch.set_num_threads(prev)


def _norm_score_tensors(rt: Runtime, forwards) -> dict[str, list]:
    from ..analysis.norms import noop_scores, value_gram, value_norms

    L, NH = rt.adapter.n_layers, rt.adapter.n_heads
    acc = {"noop": torch.zeros(L, NH, dtype=torch.float64),
           "sink_norm_share": torch.zeros(L, NH, dtype=torch.float64)}
    for layer in range(L):
        p = AttentionParams.of(rt.adapter, layer)
        # W_O^h W_O^h^T depends on the weights only: kept in rt.memo per layer, keyed by the
        # tensor's storage and version counter (an in-place weight change makes a new key)
        key = ("value_gram", layer, p.W_o.data_ptr(), p.W_o._version)
        gram = rt.memo.get(key)
        if gram is None:
            gram = value_gram(p.W_o, NH)
            with _PROBE_MEMO_LOCK:
                for old in [k for k in rt.memo if k[:2] == ("value_gram", layer)]:
                    rt.memo.pop(old, None)
                rt.memo[key] = gram
        for fw in forwards:
            vn = value_norms(fw.tensors.v[layer], p.W_o, gram=gram)  # ||f_h(x_j)|| [head, key]
            for k, v in noop_scores(fw.pattern[layer], vn).items():
                acc[k][layer] += v / len(forwards)
    return {k: v.tolist() for k, v in acc.items()}


ENDPOINTS = [
    Endpoint(
        path='/v1/heads', name='heads',
        request=HeadsRequest, response=HeadsResponse,
        summary='Classify every head: pattern scores, induction probe, label',
        description="""Tokens: BOS prepended by default where the model has one (``add_bos`` null -> true for
GPT-2, as on every endpoint), as TransformerLens' ``detect_head`` and S004 tokenize; echoed
in ``add_bos``.

Per head: TransformerLens ``head_detector`` scores (previous_token, duplicate_token,
induction; fraction of attention mass on the pattern, [0, 1]), next_token (encoders),
self, sink, entropy (nats) and entropy_normalized ([0, 1]), mean_distance (tokens), the
induction probe (Olsson et al. 2022: mass on the successors of the token in all earlier
repeats; [0, 1]), S004's own previous_s004 / sink_s004 (used for S004's thresholds), every
label a head passes (``labels``), the primary ``label`` and the margins to the thresholds.
Several texts: each score is the mean over texts. Field descriptions give every formula.
``error_measure`` ('mul' | 'abs': TransformerLens 4.3 detect_head's) for the pattern scores;
``heads`` / ``exclude_heads`` ([layer, head] pairs) choose the heads reported (echoed as
``selected_heads`` / ``exclude_heads``).

Errors: 422 blank text, text under 2 tokens, over n_ctx tokens, probe over n_ctx, a head
outside the model or given twice, nothing left after exclude_heads; 413; 429; 503.""",
        plan=plan,
        invalid='Invalid request: blank text, a text of fewer than 2 tokens, too many tokens, a probe longer than n_ctx, a bad threshold, a head outside the model or given twice, every head excluded.',
        tags=('heads',), order=40,
    ),
]
