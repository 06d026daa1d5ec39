"""POST /v1/path-patch: path patching (Wang et al. 2022, IOI; Goldowsky-Dill et al. 2023) on the
hooked forward (service/runtime/hooked.py), in one device turn.

Per group of pairs of one length (and per chunk of pairs, by the memory estimate):

1. One hooked forward of the base and the other prompts caching what the construction needs:
   the senders' outputs (``blocks.{l}.attn.hook_result`` heads, ``blocks.{l}.hook_mlp_out``),
   the base run's residual stream at the receivers (``hook_resid_pre`` for head inputs,
   ``hook_resid_mid`` for MLP inputs, the last ``hook_resid_post`` for the logits), and the
   metric on both runs.
2. The patched forwards, from the base run's residual stream entering the first receiver's
   layer (``run(start=, resid_pre=)``): each receiver's input is ``Set`` to the base run's
   value plus the senders' change ``sum_s (out_s_other - out_s_base)`` (the "delta"
   construction of the README's worked example: with every other component frozen at the base
   run, that is exactly what reaches the receiver along the direct path), at the receiver
   positions; everything after the receivers runs normally. Head receivers:
   ``blocks.{l}.hook_{q,k,v}_input`` of those heads; MLP receivers: ``blocks.{l}.ln2.
   hook_normalized`` set to LayerNorm's pre-affine value of the patched input (the MLP alone
   sees it); the logits: the forward starts at ``ln_final`` from the patched final residual.
   The grid batches every (pair, sender head, receiver head, input) cell of one receiver layer
   as rows of one forward (a per-row mask on the split input), in chunks of rows sized by the
   memory estimate.

Where the family changes the construction (issue 28; the response's ``construction`` says so):

* Gemma 2 normalises the attention output (``ln1_post``) before the residual stream, so a
  head's change is not additive: per sender layer a hooked forward from that layer's
  ``hook_resid_pre`` sets the sender heads' ``attn.hook_z`` to the other run's (a per-row head
  mask for the grid) and reads ``hook_attn_out``; its change from the base run is the layer's
  senders' change (exactly TransformerLens' freeze loop, tests/test_path_patch_families.py).
* GPT-NeoX's parallel residual has no ``hook_resid_mid``: an MLP receiver's input is
  ``ln2.hook_normalized`` of ``hook_resid_pre`` plus the change (the MLP's own input), and a
  head does not reach its own layer's MLP.
* Grouped-query attention: k/v receivers are key/value heads (``hook_k_input`` /
  ``hook_v_input`` have ``n_kv_heads`` heads); the grid's k/v receiver axis has that many
  cells (the rest null), ``receiver_heads`` / ``head_axes`` say so.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from attnscope.schemas import PathPatchRequest, PathPatchResponse
from ..analysis import path_patch as A
from ..errors import (ContextLengthExceeded, InvalidRequest, NonFiniteValues, OutOfRange,
                      UnsupportedModelConfig, n_tokens)
from ..runtime import hooked as H
from .core.cancel import checkpoint, progress
from .core.engine import Plan
from .core.estimates import forward_flops
from .core.table import Endpoint
from .interventions import check_lm
from .run import _f, add_bos_of, metric_of, parts

#: the most bytes one forward of a request (the base runs of a chunk of pairs, or one chunk of
#: patched rows) is planned to take; a quarter of max_request_bytes when that is smaller
CHUNK_BYTES = 256 << 20

CONSTRUCTION = (
    "direct path only: every receiver input (at the receiver positions) is set to the base "
    "run's value plus sum over senders of (sender output in the other run - in the base run) at "
    "the sender positions, i.e. the residual stream with every component other than the senders "
    "frozen at the base run; head outputs are attn.hook_result (z_h W_O^h, no b_O), MLP outputs "
    "hook_mlp_out; after the receivers the model runs normally")
#: what the construction becomes on a family that changes it (issue 28), appended to it
POST_NORM = (
    "; {fam}: the attention output is normalised (ln1_post) before the residual stream, so a "
    "head's change is not additive: the sender heads of a layer take their attn.hook_z from the "
    "other run (at the sender positions), the layer's other heads stay at the base run, and the "
    "layer's hook_attn_out is recomputed through o_proj and ln1_post; the change of that "
    "hook_attn_out is the layer's senders' change (senders of one layer patched together)")
PARALLEL = (
    "; {fam}: parallel residual (no hook_resid_mid): an MLP receiver's input is the MLP's own "
    "input, blocks.{{l}}.ln2.hook_normalized = ln2's pre-affine value of hook_resid_pre plus the "
    "senders' change (TransformerLens 4.3: blocks.{{l}}.mlp.hook_in after ln2's weight), and a "
    "head does not reach its own layer's MLP")
GQA = (
    "; {fam}: grouped-query attention ({n} query heads, {kv} key/value heads): k and v "
    "receivers are key/value heads (heads index hook_k_input / hook_v_input's {kv} heads, "
    "head_axis 'kv_head'; patching kv head g's input reaches query heads g*{g}..g*{g}+{g1}); q "
    "receivers are query heads")


def construction(p) -> str:
    """The response's ``construction`` text for the resident model's family."""
    fam = getattr(p, "family", "gpt2")
    out = CONSTRUCTION
    if _post_norm(p):
        out += POST_NORM.format(fam=fam)
    if getattr(p, "parallel", False):
        out += PARALLEL.format(fam=fam)
    if _gqa(p):
        g = p.n_heads // p.n_kv_heads
        out += GQA.format(fam=fam, n=p.n_heads, kv=p.n_kv_heads, g=g, g1=g - 1)
    return out


# ------------------------------------------------------------------ checks
def _describe(c) -> str:
    if c.kind == "logits":
        return "the logits"
    if c.kind == "mlp":
        return f"MLP {c.layer}"
    if hasattr(c, "head"):
        return f"head L{c.layer}H{c.head}"
    return f"layer {c.layer} heads' {c.input} inputs"


def _precedes(s, r, parallel: bool = False) -> bool:
    """Whether sender ``s``'s output reaches receiver ``r``'s input along the residual stream:
    a head feeds later layers' heads and its own layer's MLP on (not under GPT-NeoX's parallel
    residual, where the MLP reads ``hook_resid_pre`` as the heads do); an MLP feeds later
    layers."""
    if r.kind == "logits":
        return True
    if s.kind == "head" and r.kind == "mlp" and not parallel:
        return r.layer >= s.layer
    return r.layer > s.layer


def _check_metric_roles(m, param: str) -> None:
    for i, t in enumerate(m.terms):
        if m.kind == "kl":
            for f in ("prompt", "reference_prompt"):
                if getattr(t, f) not in (0, 1):
                    raise InvalidRequest(
                        f"{param}.terms.{i}.{f}: {getattr(t, f)} is not a run of path patching "
                        "(0 = the run measured, 1 = the base run)", f"{param}.terms.{i}.{f}")
        elif t.prompt not in (None, 0):
            raise InvalidRequest(
                f"{param}.terms.{i}.prompt: {t.prompt}; path patching reads each run alone "
                "(null or 0)", f"{param}.terms.{i}.prompt")


def _post_norm(p) -> bool:
    """Whether the model normalises the attention output before the residual (Gemma 2's
    ``ln1_post``): then a head sender's change is not additive over heads."""
    return getattr(p.blocks[0], "lnpa_w", None) is not None


def _n_receiver_heads(p, inp: str) -> int:
    """Heads of a receiver input: query heads for q; key/value heads for k and v (their
    ``hook_k_input`` / ``hook_v_input`` have ``n_kv_heads`` heads under grouped-query
    attention, as /v1/patch counts k/v grids)."""
    return p.n_heads if inp == "q" else getattr(p, "n_kv_heads", p.n_heads)


def _gqa(p) -> bool:
    return getattr(p, "n_kv_heads", p.n_heads) != p.n_heads


def _head_axis(p, inp: str) -> str:
    """'kv_head' where a receiver input's heads are key/value heads (k, v under GQA)."""
    return "kv_head" if _gqa(p) and inp != "q" else "head"


def check(rt, req: PathPatchRequest) -> None:
    """A causal LM the hooked forward runs; components in range, none repeated; every sender
    before every receiver; the logits receiver alone; metric terms naming runs 0/1 only; every
    pair's own metric of the request's kind and reduce."""
    check_lm(rt)
    p = parts(rt)
    L, Hn = p.n_layers, p.n_heads
    parallel = bool(getattr(p, "parallel", False))

    def layer(v, param):
        if not 0 <= v < L:
            raise OutOfRange(f"{param} = {v} is out of range: the model has {L} layers (valid "
                             f"0..{L - 1})", param)

    def head(v, param, inp="q"):
        n = _n_receiver_heads(p, inp)
        if not 0 <= v < n:
            what = (f"{n} key/value heads per layer ({inp} receivers count key/value heads: "
                    f"{Hn} query heads share them)" if n != Hn else f"{Hn} heads per layer")
            raise OutOfRange(f"{param} = {v} is out of range: the model has {what} (valid "
                             f"0..{n - 1})", param)

    if req.grid and L < 2:
        raise InvalidRequest("grid: the model has one layer, so no head comes after another",
                             "grid")
    seen: set = set()
    for i, s in enumerate(req.senders or []):
        layer(s.layer, f"senders.{i}.layer")
        if s.kind == "head":
            head(s.head, f"senders.{i}.head")
        key = (s.kind, s.layer, getattr(s, "head", None))
        if key in seen:
            raise InvalidRequest(f"senders.{i}: {_describe(s)} is listed twice", f"senders.{i}")
        seen.add(key)
    seen = set()
    recv = req.receivers or []
    for j, r in enumerate(recv):
        if r.kind != "logits":
            layer(r.layer, f"receivers.{j}.layer")
        keys = [(r.kind, getattr(r, "layer", None), None, None)]
        if r.kind == "head":
            hs = r.heads if r.heads is not None else list(range(_n_receiver_heads(p, r.input)))
            for k, h in enumerate(hs):
                head(h, f"receivers.{j}.heads.{k}", r.input)
            keys = [("head", r.layer, r.input, h) for h in hs]
        for key in keys:
            if key in seen:
                what = (f"head L{key[1]}H{key[3]}'s {key[2]} input" if key[0] == "head"
                        else _describe(r))
                raise InvalidRequest(f"receivers.{j}: {what} is already a receiver",
                                     f"receivers.{j}")
            seen.add(key)
    if any(r.kind == "logits" for r in recv) and len(recv) > 1:
        j = next(j for j, r in enumerate(recv) if r.kind == "logits")
        raise InvalidRequest(f"receivers.{j}: the logits are a receiver alone (setting the final "
                             "residual stream would erase the other receivers' effects)",
                             f"receivers.{j}")
    for j, r in enumerate(recv):
        for i, s in enumerate(req.senders or []):
            if not _precedes(s, r, parallel):
                own = (f"; under {getattr(p, 'family', 'this model')}'s parallel residual not "
                       "its own layer's MLP, which reads hook_resid_pre" if parallel else
                       " (and, for a head, its own layer's MLP)")
                raise InvalidRequest(
                    f"receivers.{j}: {_describe(r)} is not after sender {i} ({_describe(s)}): a "
                    f"sender's output reaches later layers only{own}", f"receivers.{j}")
    _check_metric_roles(req.metric, "metric")
    for i, pr in enumerate(req.pairs):
        if pr.metric is None:
            continue
        if pr.metric.kind != req.metric.kind or pr.metric.reduce != req.metric.reduce:
            raise InvalidRequest(
                f"pairs.{i}.metric: a {pr.metric.kind!r} ({pr.metric.reduce}) metric; every "
                f"pair's is the request's kind and reduce ({req.metric.kind!r}, "
                f"{req.metric.reduce}) so that they average", f"pairs.{i}.metric")
        _check_metric_roles(pr.metric, f"pairs.{i}.metric")


# ------------------------------------------------------------------ the plan
def _side(rt, pr, side: str, bos: bool, i: int):
    ids = getattr(pr, f"{side}_tokens")
    if ids is not None:
        return rt.tokenized_from_ids(list(ids), f"pairs.{i}.{side}_tokens")
    return rt.tokenize(getattr(pr, f"{side}_text"), bos, f"pairs.{i}.{side}_text")


def _positions(values, T: int, param: str, i: int) -> list[int] | None:
    if values is None:
        return None
    out = []
    for k, v in enumerate(values):
        if not -T <= v < T:
            raise OutOfRange(f"{param}.{k} = {v} is out of range for pair {i} of "
                             f"{n_tokens(T)} (valid {-T}..{T - 1})", f"{param}.{k}")
        out.append(v % T)
    if len(set(out)) != len(out):
        raise InvalidRequest(f"{param}: a position repeats for pair {i} ({values} with "
                             f"{n_tokens(T)})", param)
    return sorted(out)


def _terms(hm, kind: str, T: int, V: int, param: str) -> list[tuple]:
    """The metric's terms for a prompt of T tokens, positions resolved, checked (422 naming
    the term)."""
    out = []
    for i, t in enumerate(hm.terms):
        tp = f"{param}.terms.{i}"
        pos = t[2] if kind == "kl" else t[1]
        if not -T <= pos < T:
            raise OutOfRange(f"{tp}.position = {pos} is out of range for {n_tokens(T)} "
                             f"(valid {-T}..{T - 1})", f"{tp}.position")
        pos %= T
        if kind == "loss" and pos >= T - 1:
            raise InvalidRequest(f"{tp}.position: {pos} has no next token (the loss at a "
                                 f"position predicts the next; the last is {T - 2})",
                                 f"{tp}.position")
        for name, tok in zip(("target", "distractor"), t[2:] if kind != "kl" else ()):
            if not 0 <= tok < V:
                raise OutOfRange(f"{tp}.{name} = {tok} is out of range (token ids 0..{V - 1})",
                                 f"{tp}.{name}")
        out.append((t[0], t[1], pos) if kind == "kl" else (t[0], pos) + tuple(t[2:]))
    return out


def _row_terms(kind: str, terms: list[tuple], row: int, base_row: int) -> list[tuple]:
    """A pair's terms on batch row ``row`` (KL: run 0 = ``row``, run 1 = ``base_row``)."""
    if kind == "kl":
        return [(row if a == 0 else base_row, row if b == 0 else base_row, pos)
                for a, b, pos in terms]
    return [(row,) + t[1:] for t in terms]


class _Pair:
    __slots__ = ("i", "clean", "corrupted", "base", "other", "T", "terms", "spos", "rpos")


def _chunk_limit(rt) -> int:
    lim = int(getattr(rt.settings, "max_request_bytes", 0) or 0)
    return max(1 << 20, min(CHUNK_BYTES, lim // 4)) if lim else CHUNK_BYTES


def plan(rt, req: PathPatchRequest, items, *, binary: bool = False) -> Plan:
    """Pairs tokenized (equal lengths within a pair, else 422 naming both), metric terms and
    positions resolved per pair, the work grouped by length and chunked by the memory estimate,
    and the job."""
    p = parts(rt)
    L, Hn, D, M, V = p.n_layers, p.n_heads, p.d_model, p.d_mlp, p.d_vocab
    es = max(4, p.wte.element_size())
    bos = add_bos_of(rt, req)
    kind, reduce = req.metric.kind, req.metric.reduce
    base_side = "clean" if req.direction == "corrupted_to_clean" else "corrupted"
    other_side = "corrupted" if base_side == "clean" else "clean"
    hm_default = metric_of(rt, req.metric, "metric")
    pairs: list[_Pair] = []
    for i, pr in enumerate(req.pairs):
        x = _Pair()
        x.i = i
        x.clean, x.corrupted = _side(rt, pr, "clean", bos, i), _side(rt, pr, "corrupted", bos, i)
        T = len(x.clean)
        if len(x.corrupted) != T:
            field = "corrupted_tokens" if pr.corrupted_tokens is not None else "corrupted_text"
            raise InvalidRequest(
                f"pairs.{i}: the clean prompt has {n_tokens(T)} and the corrupted one "
                f"{len(x.corrupted)}; the two prompts of a pair need the same token count "
                "(position by position patching)", f"pairs.{i}.{field}")
        if T > p.n_ctx:
            raise ContextLengthExceeded(f"pairs.{i}: {n_tokens(T)}, the model's context is "
                                        f"{p.n_ctx}", f"pairs.{i}")
        x.T = T
        x.base, x.other = getattr(x, base_side), getattr(x, other_side)
        hm = hm_default if pr.metric is None else metric_of(rt, pr.metric, f"pairs.{i}.metric")
        x.terms = _terms(hm, kind, T, V, "metric" if pr.metric is None else f"pairs.{i}.metric")
        x.spos = _positions(req.sender_positions, T, "sender_positions", i)
        x.rpos = _positions(req.receiver_positions, T, "receiver_positions", i)
        pairs.append(x)
    groups: dict[int, list[_Pair]] = {}
    for x in pairs:
        groups.setdefault(x.T, []).append(x)

    # ---- the memory estimate (bytes of the model's dtype, float32 at least)
    kinds = list(req.grid_inputs)
    parallel, post = bool(getattr(p, "parallel", False)), _post_norm(p)
    nh = [_n_receiver_heads(p, k) for k in kinds]  # receiver heads of each grid input
    if req.grid:
        res_layers, mlp_layers = list(range(L - 1)), []
        pre_layers, mid_layers, final = list(range(1, L)), [], False
        n_split = 2  # a chunk of rows spans at most two inputs (rows are input-major)
    else:
        res_layers = sorted({s.layer for s in req.senders if s.kind == "head"})
        mlp_layers = sorted({s.layer for s in req.senders if s.kind == "mlp"})
        heads_r = [r for r in req.receivers if r.kind == "head"]
        # the head receivers' layers, and the layer the patched forward starts at
        pre_layers = sorted({r.layer for r in heads_r} | {min(
            (r.layer for r in req.receivers if r.kind != "logits"), default=L)} - {L})
        mid_layers = sorted({r.layer for r in req.receivers if r.kind == "mlp"})
        if parallel:  # the MLP reads ln2(hook_resid_pre): no hook_resid_mid
            pre_layers, mid_layers = sorted(set(pre_layers) | set(mid_layers)), []
        final = any(r.kind == "logits" for r in req.receivers)
        n_split = len({(r.layer, r.input) for r in heads_r})
    if post:  # each sender layer's attention output recomputed through ln1_post from z
        pre_layers = sorted(set(pre_layers) | set(res_layers))
    sender_heads: dict[int, list[int]] = {}
    for s_ in req.senders or []:
        if s_.kind == "head":
            sender_heads.setdefault(s_.layer, []).append(s_.head)
    limit = _chunk_limit(rt)
    n_terms = max(len(x.terms) for x in pairs)
    est, n_fwd, widest, flops = 0, 0, 0, 0.0
    sched = {}
    if req.grid:
        start_layers = list(range(1, L))
    else:
        start_layers = [min((r.layer for r in req.receivers if r.kind != "logits"), default=L)]
    for T, xs in groups.items():
        live = 3 * Hn * T * T + T * (8 * D + 2 * M)
        per_pair = es * (2 * live + 2 * T * Hn * D * len(res_layers) + T * Hn * D * len(res_layers)
                         + T * D * (2 * len(mlp_layers) + len(pre_layers) + len(mid_layers)
                                    + int(final)) + 2 * 3 * n_terms * V)
        if req.grid:
            per_pair += 8 * (L * Hn) ** 2 * len(kinds)  # the pair's cells, float64
        pc = max(1, min(len(xs), limit // max(per_pair, 1)))
        per_row = es * (live + 6 * T * Hn * D * max(n_split, 1) + 3 * T * D + 3 * n_terms * V)
        if req.grid:
            rows = [pc * lr * Hn * sum(nh) for lr in range(1, L)]
        else:
            rows = [pc]
        rc = max(1, min(max(rows), limit // max(per_row, 1)))
        sched[T] = (pc, rc)
        n_chunks = math.ceil(len(xs) / pc)
        n_fwd += n_chunks * (1 + sum(math.ceil(r / rc) for r in rows))
        if post:  # the senders' attention outputs: a forward from each sender layer
            att = [pc * Hn] * len(res_layers) if req.grid else [pc] * len(res_layers)
            n_fwd += n_chunks * sum(math.ceil(r / rc) for r in att)
        # device work: the base runs (2 rows a pair) and the patched rows from their start
        dims = dict(n_layers=L, d_model=D, d_mlp=M, logit_positions=1, d_vocab=V)
        flops += forward_flops(T, rows=2 * len(xs), **dims)
        per_pair_rows = [r // pc for r in rows]
        flops += sum(forward_flops(T, rows=len(xs) * r, layers=L - s, **dims)
                     for r, s in zip(per_pair_rows, start_layers))
        if post:
            flops += sum(forward_flops(T, rows=len(xs) * (Hn if req.grid else 1),
                                       layers=L - s, **dims) for s in res_layers)
        widest = max(widest, rc)
        est = max(est, pc * per_pair + rc * (per_row + (es * 2 * T * D if kind == "kl" else 0)))
    # the response: tokens of both sides, statistics, the grid's three arrays
    resp = sum(2 * 90 * x.T for x in pairs) + 3 * 24 * len(pairs) + 4096
    if req.grid:
        resp += 3 * 14 * (L * Hn) ** 2 * len(kinds)
    est += resp
    detail = (f", plus {n_fwd} hooked forwards (base runs and path-patched chunks of up to "
              f"{widest} rows)")

    def job(_forwards) -> dict:
        base_v = np.full(len(pairs), np.nan)
        other_v = np.full(len(pairs), np.nan)
        patched_v = np.full(len(pairs), np.nan)
        mom = A.Moments((L, Hn, L, Hn, len(kinds))) if req.grid else None
        n_done = 0
        progress(0, len(pairs))  # pairs done, after each chunk (a streamed response's lines)
        for T, xs in groups.items():
            pc, rc = sched[T]
            for a in range(0, len(xs), pc):
                checkpoint()  # between chunks of pairs: a cancelled request stops here
                chunk = xs[a:a + pc]
                got = _base_runs(p, chunk, kind, reduce, res_layers, mlp_layers, pre_layers,
                                 mid_layers, final, rc=rc, grid=req.grid,
                                 sender_heads=sender_heads)
                for k, x in enumerate(chunk):
                    base_v[x.i], other_v[x.i] = got["base"][k], got["other"][k]
                if not (np.isfinite(got["base"]).all() and np.isfinite(got["other"]).all()):
                    # the model's NaN, before it becomes a patched value
                    raise NonFiniteValues("the metric on the base or other run is not finite "
                                          "(NaN or inf in the forward)", "metric")
                if req.grid:
                    mom.add(_grid_cells(p, chunk, got, kind, reduce, kinds, rc, nh))
                else:
                    vals = _single(p, chunk, got, req, kind, reduce, rc)
                    for k, x in enumerate(chunk):
                        patched_v[x.i] = vals[k]
                n_done += len(chunk)
                progress(n_done, len(pairs))
        for name, v in (("base run", base_v), ("other run", other_v)):
            if not np.isfinite(v).all():
                raise NonFiniteValues(f"the metric on the {name} is not finite (NaN or inf in "
                                      "the forward)", "metric")

        def stat(v):
            n = len(v)
            return {"mean": _f(v.mean()), "std": _f(v.std(ddof=1)) if n > 1 else None, "n": n,
                    "values": [_f(t) for t in v] if req.per_pair else None}

        b_mean, o_mean = float(base_v.mean()), float(other_v.mean())
        body = {
            "model": rt.model_ref(), "add_bos": bool(bos and any(
                pr.clean_text is not None or pr.corrupted_text is not None for pr in req.pairs)),
            "direction": req.direction, "base_run": base_side, "other_run": other_side,
            "metric": kind, "reduce": reduce, "construction": construction(p),
            "senders": None if req.grid else [s.model_dump() for s in req.senders],
            "receivers": None if req.grid else [
                dict(r.model_dump(), heads=list(r.heads if r.heads is not None else range(
                    _n_receiver_heads(p, r.input))), head_axis=_head_axis(p, r.input))
                if r.kind == "head" else r.model_dump() for r in req.receivers],
            "pairs": [{"n_tokens": x.T, "clean_tokens": [t.as_dict() for t in x.clean.tokens],
                       "corrupted_tokens": [t.as_dict() for t in x.corrupted.tokens]}
                      for x in pairs],
            "base": stat(base_v), "other": stat(other_v),
            "patched": None, "normalized": None, "grid": None,
        }
        if req.grid:
            mean, std = mom.mean(), mom.std()
            lyr = np.arange(L)
            valid = ((lyr[None, :] > lyr[:, None])[:, None, :, None, None]  # receiver after sender
                     & (np.arange(Hn)[:, None] < np.array(nh)[None, :]))  # a head of the input
            if not np.isfinite(mean[np.broadcast_to(valid, mean.shape)]).all():
                raise NonFiniteValues("the grid's metric is not finite (NaN or inf in the "
                                      "forward)", "metric")
            raw, sd, nz = [], [], []
            for ls in range(L):
                r1, s1, n1 = [], [], []
                for hs in range(Hn):
                    r2, s2, n2 = [], [], []
                    for lr in range(L):
                        r3, s3, n3 = [], [], []
                        for hr in range(Hn):
                            cell = mean[ls, hs, lr, hr]
                            ok = valid[ls, 0, lr, hr]  # [input]
                            r3.append([_f(c) if o else None for c, o in zip(cell, ok)])
                            s3.append([_f(c) if o and std is not None else None
                                       for c, o in zip(std[ls, hs, lr, hr] if std is not None
                                                       else cell, ok)])
                            n3.append([None if not o or (z := A.normalized(
                                float(c), b_mean, o_mean)) is None else _f(z)
                                for c, o in zip(cell, ok)])
                        r2.append(r3), s2.append(s3), n2.append(n3)
                    r1.append(r2), s1.append(s2), n1.append(n2)
                raw.append(r1), sd.append(s1), nz.append(n1)
            body["grid"] = {"inputs": kinds, "raw": raw, "std": sd, "normalized": nz,
                            "receiver_heads": dict(zip(kinds, nh)),
                            "head_axes": {k: _head_axis(p, k) for k in kinds}}
        else:
            if not np.isfinite(patched_v).all():
                raise NonFiniteValues("the metric on the patched run is not finite (NaN or inf "
                                      "in the forward)", "metric")
            body["patched"] = stat(patched_v)
            z = A.normalized(float(patched_v.mean()), b_mean, o_mean)
            body["normalized"] = None if z is None else _f(z)
        return body

    return Plan([], job, int(est), detail=detail, device_flops=flops, device_param="pairs",
                progress="pairs")


# ------------------------------------------------------------------ the forwards
def _metric(kind: str, terms: list[tuple]):
    cls = {"logit_diff": H.LogitDiff, "prob": H.Prob, "logprob": H.LogProb, "loss": H.Loss,
           "kl": H.KL}[kind]
    return cls(terms=terms, reduce="sum")


def _values(res, rows_of_terms: list[int], n_rows: int, reduce: str) -> np.ndarray:
    return A.reduce_terms(res.metrics["m"].values, rows_of_terms, n_rows, reduce)


def _ids(prompts) -> torch.Tensor:
    return torch.tensor([list(t.input_ids) for t in prompts], dtype=torch.long)


def _keep(p: H.GPT2Parts, positions, T: int):
    if positions is None:
        return None
    k = torch.zeros(T, dtype=torch.bool, device=p.device)
    k[positions] = True
    return k


def _base_runs(p: H.GPT2Parts, chunk: list[_Pair], kind: str, reduce: str, res_layers,
               mlp_layers, pre_layers, mid_layers, final: bool, *, rc: int = 1,
               grid: bool = False, sender_heads: dict | None = None) -> dict:
    """One hooked forward of the chunk's base prompts (rows 0..n-1) and other prompts (rows
    n..2n-1): the metric on both, the senders' changes and the base run's residual streams.
    Post-attention-norm models (Gemma 2): the head senders' change is computed exactly per
    sender layer (:func:`_attn_out_change`; ``sender_heads`` {layer: heads} patched together,
    or with ``grid`` every head alone), in forwards of at most ``rc`` rows."""
    n, T, L = len(chunk), chunk[0].T, p.n_layers
    post = _post_norm(p)
    ids = torch.cat([_ids([x.base for x in chunk]), _ids([x.other for x in chunk])])
    base_rows = H.CacheSelect(prompts=list(range(n)))
    if post:
        cache = {f"blocks.{lyr}.attn.hook_z": H.CacheSelect(prompts=list(range(n, 2 * n)))
                 for lyr in res_layers}
        cache.update({f"blocks.{lyr}.hook_attn_out": base_rows for lyr in res_layers})
    else:
        cache = {f"blocks.{lyr}.attn.hook_result": None for lyr in res_layers}
    cache.update({f"blocks.{lyr}.hook_mlp_out": None for lyr in mlp_layers})
    cache.update({f"blocks.{lyr}.hook_resid_pre": base_rows for lyr in pre_layers})
    cache.update({f"blocks.{lyr}.hook_resid_mid": base_rows for lyr in mid_layers})
    if final:
        cache[f"blocks.{L - 1}.hook_resid_post"] = base_rows
    terms, rows = [], []
    for k, x in enumerate(chunk):
        for row in (k, n + k):
            t = _row_terms(kind, x.terms, row, k)
            terms += t
            rows += [row] * len(t)
    res = H.run(p, ids, cache=cache, logit_positions=[T - 1], metrics={"m": _metric(kind, terms)})
    v = _values(res, rows, 2 * n, reduce)
    keep = _keep(p, chunk[0].spos, T)
    out = {"base": v[:n], "other": v[n:], "ids": ids[:n], "T": T,
           "resid_pre": {lyr: res.cache[f"blocks.{lyr}.hook_resid_pre"] for lyr in pre_layers},
           "resid_mid": {lyr: res.cache[f"blocks.{lyr}.hook_resid_mid"] for lyr in mid_layers},
           "final": res.cache[f"blocks.{L - 1}.hook_resid_post"] if final else None,
           # [n, T, d_model] per MLP: other - base
           "mlp_delta": {lyr: A.sender_change(res.cache[f"blocks.{lyr}.hook_mlp_out"][n:],
                                              res.cache[f"blocks.{lyr}.hook_mlp_out"][:n], keep)
                         for lyr in mlp_layers}}
    if not post:  # [n, T, head, d_model] per layer: other - base, additive over heads
        out["head_delta"] = {lyr: A.sender_change(
            res.cache[f"blocks.{lyr}.attn.hook_result"][n:].transpose(1, 2),
            res.cache[f"blocks.{lyr}.attn.hook_result"][:n].transpose(1, 2), keep
        ).transpose(1, 2) for lyr in res_layers}
        return out
    Hn = p.n_heads
    pairs = list(range(n))
    if grid:  # every head alone: rows (pair, head), [n, T, head, d_model] per layer
        rows = [j for j in pairs for _ in range(Hn)]
        mask = torch.eye(Hn, dtype=torch.bool, device=p.device).repeat(n, 1)
        out["head_delta"] = {lyr: _attn_out_change(
            p, lyr, out, res.cache, rows, mask, chunk[0].spos, keep, rc
        ).view(n, Hn, T, -1).transpose(1, 2) for lyr in res_layers}
    else:  # the senders of each layer together: [n, T, d_model] per layer
        out["layer_delta"] = {}
        for lyr in res_layers:
            mask = torch.zeros(n, Hn, dtype=torch.bool, device=p.device)
            mask[:, list((sender_heads or {}).get(lyr, ()))] = True
            out["layer_delta"][lyr] = _attn_out_change(p, lyr, out, res.cache, pairs, mask,
                                                       chunk[0].spos, keep, rc)
    return out


def _attn_out_change(p, layer: int, got: dict, cache: dict, rows: list[int],
                     heads: torch.Tensor, spos, keep, rc: int) -> torch.Tensor:
    """The change of ``blocks.{layer}.hook_attn_out`` ``[rows, T, d_model]`` when, in the base
    run of pair ``rows[i]``, the heads where ``heads[i]`` ``[rows, head]`` (bool) is True take
    their ``attn.hook_z`` from the other run at the sender positions ``spos`` and every other
    head keeps its base-run z: the layer's attention output recomputed by the hooked forward
    (o_proj, then Gemma 2's ln1_post), minus the base run's, zero outside ``keep``. Exactly
    what a TransformerLens loop that freezes every other head's hook_result computes; not a
    sum over heads, because ln1_post normalises their sum."""
    T = got["T"]
    name = f"blocks.{layer}.hook_attn_out"
    z_other = cache[f"blocks.{layer}.attn.hook_z"]  # [n, T, head, d_head], the other run
    base_out = cache[name]  # [n, T, d_model], the base run
    parts_ = []
    for a in range(0, len(rows), rc):
        checkpoint()
        j = torch.as_tensor(rows[a:a + rc], device=p.device)
        z = z_other[j] if spos is None else z_other[j][:, spos]
        res = H.run(p, got["ids"][j.cpu()], start=layer, resid_pre=got["resid_pre"][layer][j],
                    interventions=[H.Set(hook=f"blocks.{layer}.attn.hook_z", positions=spos,
                                         value=z, mask=heads[a:a + rc, None, :])],
                    cache={name: None}, logit_positions=[T - 1])
        parts_.append(A.sender_change(res.cache[name], base_out[j], keep))
    return torch.cat(parts_)


def _with_base_rows(kind: str, chunk, pair_of_row: list[int], T: int, ids, resid):
    """Rows for the patched forward: the patched rows, plus (KL only) each pair's unpatched
    base row after them; returns (ids, resid_pre, terms, rows of terms, n patched rows)."""
    B = len(pair_of_row)
    uniq = sorted(set(pair_of_row)) if kind == "kl" else []
    slot = {k: B + u for u, k in enumerate(uniq)}
    terms, rows = [], []
    for row, k in enumerate(pair_of_row):
        t = _row_terms(kind, chunk[k].terms, row, slot.get(k, row))
        terms += t
        rows += [row] * len(t)
    sel = torch.tensor(pair_of_row + uniq, dtype=torch.long)
    return ids[sel], resid[sel.to(resid.device)], terms, rows, B


def _single(p: H.GPT2Parts, chunk, got, req, kind: str, reduce: str, rc: int) -> np.ndarray:
    """The senders -> receivers experiment on every pair of ``chunk`` (one row each)."""
    n, T, L, Hn = len(chunk), got["T"], p.n_layers, p.n_heads
    dS = 0
    for s in req.senders:
        if s.kind == "mlp":
            dS = dS + got["mlp_delta"][s.layer]
        elif "layer_delta" not in got:
            dS = dS + got["head_delta"][s.layer][:, :, s.head]
    for d in got.get("layer_delta", {}).values():  # post-norm: a layer's senders together
        dS = dS + d
    rpos = chunk[0].rpos
    recv = req.receivers
    if recv[0].kind == "logits":
        start, resid = L, got["final"] + A.sender_change(dS, 0 * dS, _keep(p, rpos, T))
    else:
        start = min(r.layer for r in recv)
        resid = got["resid_pre"][start]
    out = np.empty(n)
    for a in range(0, n, rc):
        checkpoint()
        ks = list(range(a, min(n, a + rc)))
        ids, rp, terms, rows, B = _with_base_rows(kind, chunk, ks, T, got["ids"], resid)
        sel = list(range(B)) if len(ids) > B else None
        kt = torch.tensor(ks, device=p.device)
        edits = []
        for r in recv:
            if r.kind == "logits":
                continue
            if r.kind == "head":
                heads = (list(r.heads) if r.heads is not None
                         else list(range(_n_receiver_heads(p, r.input))))
                v = got["resid_pre"][r.layer][kt] + dS[kt]
                v = v if rpos is None else v[:, rpos]
                edits.append(H.Set(hook=f"blocks.{r.layer}.hook_{r.input}_input", heads=heads,
                                   positions=rpos, prompts=sel,
                                   value=v[:, :, None].expand(-1, -1, len(heads), -1)))
            else:
                v = H.normalized(p, _mlp_input_base(p, got, r.layer)[kt] + dS[kt])
                edits.append(H.Set(hook=f"blocks.{r.layer}.ln2.hook_normalized",
                                   positions=rpos, prompts=sel,
                                   value=v if rpos is None else v[:, rpos]))
        res = H.run(p, ids, interventions=edits, logit_positions=[T - 1],
                    metrics={"m": _metric(kind, terms)}, start=start, resid_pre=rp)
        out[a:a + len(ks)] = _values(res, rows, len(ids), reduce)[:B]
    return out


def _mlp_input_base(p, got: dict, layer: int) -> torch.Tensor:
    """The base run's residual stream an MLP receiver reads ``[n, T, d_model]``:
    ``hook_resid_mid``, or ``hook_resid_pre`` under GPT-NeoX's parallel residual."""
    if getattr(p, "parallel", False):
        return got["resid_pre"][layer]
    return got["resid_mid"][layer]


def _grid_cells(p: H.GPT2Parts, chunk, got, kind: str, reduce: str, kinds: list[str],
                rc: int, nh: list[int] | None = None) -> np.ndarray:
    """Every (sender head, receiver head input of a later layer) cell for every pair of
    ``chunk``: ``[pair, sender_layer, sender_head, receiver_layer, receiver_head, input]``
    (NaN where the receiver is not after the sender, and past input k's ``nh[k]`` receiver
    heads: k and v receivers are the key/value heads under grouped-query attention)."""
    n, T, L, Hn = len(chunk), got["T"], p.n_layers, p.n_heads
    K = len(kinds)
    nh = list(nh) if nh is not None else [Hn] * K
    out = np.full((n, L, Hn, L, Hn, K), np.nan)
    rpos = chunk[0].rpos
    # [sender = layer * Hn + head, pair, T, d_model]
    deltas = torch.stack([got["head_delta"][lyr][:, :, h] for lyr in range(L - 1)
                          for h in range(Hn)])
    for lr in range(1, L):
        S = lr * Hn
        # the cells, input-major: (input, pair, sender, receiver head < nh[input])
        cells = [np.concatenate(c) for c in zip(*[
            (np.full(n * S * nh[k], k),) + np.unravel_index(np.arange(n * S * nh[k]),
                                                            (n, S, nh[k])) for k in range(K)])]
        total = len(cells[0])
        base = got["resid_pre"][lr]  # [n, T, d_model]
        for a in range(0, total, rc):
            checkpoint()  # between chunks of grid cells
            k_i, j_i, s_i, h_i = (c[a:a + rc] for c in cells)
            pair_of_row = j_i.tolist()
            ids, rp, terms, rows, B = _with_base_rows(kind, chunk, pair_of_row, T, got["ids"],
                                                      base)
            jt = torch.as_tensor(j_i, device=p.device)
            st = torch.as_tensor(s_i, device=p.device)
            v = base[jt] + deltas[st, jt]  # [B, T, d_model]: the receiver's patched input
            if rpos is not None:
                v = v[:, rpos]
            sel = list(range(B)) if len(ids) > B else None
            edits = []
            for k in sorted(set(k_i.tolist())):
                mask = torch.zeros(len(ids), 1, nh[k], dtype=torch.bool, device=p.device)
                r = np.nonzero(k_i == k)[0]
                mask[torch.as_tensor(r, device=p.device), 0,
                     torch.as_tensor(h_i[r], device=p.device)] = True
                edits.append(H.Set(hook=f"blocks.{lr}.hook_{kinds[k]}_input", positions=rpos,
                                   prompts=sel, value=v[:, :, None].expand(-1, -1, nh[k], -1),
                                   mask=mask))
            res = H.run(p, ids, interventions=edits, logit_positions=[T - 1],
                        metrics={"m": _metric(kind, terms)}, start=lr, resid_pre=rp)
            vals = _values(res, rows, len(ids), reduce)[:B]
            out[j_i, s_i // Hn, s_i % Hn, lr, h_i, k_i] = vals
    return out


ENDPOINTS = [
    Endpoint(
        path="/v1/path-patch", name="path_patch", request=PathPatchRequest,
        response=PathPatchResponse,
        summary="Path patching: senders' change carried only along the direct path to "
                "receivers (Wang et al. 2022)",
        description="""Path patching (Wang et al. 2022, IOI; Goldowsky-Dill et al. 2023) on the
resident causal LM, over one or many (clean, corrupted) pairs. ``direction``
'corrupted_to_clean' (default, the IOI paper's): the base run is the clean prompt and the
senders' outputs come from the corrupted one; 'clean_to_corrupted' the reverse. Senders:
heads (``attn.hook_result``, ``z_h W_O^h``) and MLPs (``hook_mlp_out``), patched together.
Receivers: heads' ``q``/``k``/``v`` inputs (TransformerLens ``use_split_qkv_input``; k and v
by key/value head under grouped-query attention, ``head_axis: kv_head``), MLPs' inputs
(GPT-NeoX's parallel residual: ``ln2`` of ``hook_resid_pre``), or the logits (alone). Gemma 2
head senders: the layer's attention output recomputed through ``ln1_post`` from the sender
heads' ``hook_z`` (exact; not additive over heads). Each receiver's input becomes the base run's plus the senders'
change ``sum_s (out_s_other - out_s_base)``: the residual stream with every other component
frozen at the base run (the direct path only); after the receivers the model runs normally.
``grid``: every sender head x every receiver head input of a later layer, batched. Metrics are
/v1/run's, reported raw on the base, other and patched runs (mean, sample std, n over the
pairs) and normalised ``(patched - base) / (other - base)`` of the means. Equal to a
hand-written TransformerLens 4.3 loop that freezes every other component (tests/
test_path_patch.py). Errors: 422 the prompts of a pair of different lengths, a sender not
before its receiver, an unknown component kind, a layer/head/position out of range, a metric
term naming another run; 429 over the memory budget.""",
        plan=plan, check=check, tokenize=False, streams=True,
        invalid="Invalid request: prompts of a pair of different lengths, a sender after its "
                "receiver, an unknown component, an index out of range, memory.",
        tags=("interventions",), order=93,
    ),
]
