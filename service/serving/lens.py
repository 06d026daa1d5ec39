"""/v1/logit-lens and /v1/logit-attribution: the residual stream through ln_final and the
unembedding, per state (logit lens) and per component (direct logit attribution), on the hooked
forward of /v1/run (service/runtime/hooked.py, TransformerLens 4.x hook names; each prompt its
own forward, so prompts may differ in length). The formulas are in service/analysis/lens.py."""

from __future__ import annotations

import numpy as np
import torch

from attnscope.schemas.lens import (
    WEIGHTS_DOC, LogitAttributionRequest, LogitAttributionResponse, LogitLensRequest,
    LogitLensResponse,
)
from ..analysis import lens as A
from ..errors import InvalidRequest, NonFiniteValues, OutOfRange, UnsupportedModelConfig
from ..runtime import hooked as H
from .core.cancel import checkpoint
from .core.engine import Plan
from .core.estimates import forward_flops, lens_flops, tokens_bytes
from .core.table import Endpoint
from .interventions import _single_token, check_lm
from .run import parts

#: the ``weights`` field on the RMSNorm families (no centring, no bias to apply)
RMS_WEIGHTS_DOC = (
    "The weights used: the checkpoint's own, unprocessed (no norm folding, b_V not folded into "
    "b_O): TransformerLens' enable_compatibility_mode(no_processing=True). The final RMSNorm's "
    "weight is therefore applied explicitly: norm(x) = x / scale * w (Gemma: * (1 + w)), "
    "scale = sqrt(mean(x^2) + eps) in float32, as Hugging Face computes it."
)

#: one top-k or target entry of a response (dict + JSON: id, label, bytes, partial, numbers)
ENTRY_BYTES = 650
#: /v1/logit-attribution over several prompts: the job's estimate as a multiple of the largest
#: prompt's (tests/estimate_peak.py, bundled model, 4 and 8 prompts of 238 tokens peaked 1.33x
#: and 1.31x the one-prompt estimate: heap fragmentation across prompts; 1 prompt 0.76x)
DLA_MANY_PROMPTS = 1.5



def _finite(res) -> None:
    """The one rule for non-finite values: NaN/inf in the forward (its logits or a cached
    state) is the documented 500 ``non_finite_values``, never a 200 with nulls."""
    bad = [n for n, t in res.cache.items() if not bool(torch.isfinite(t).all())]
    if not bool(torch.isfinite(res.logits).all()):
        bad.append("logits")
    if bad:
        raise NonFiniteValues(f"the forward produced NaN/inf ({bad[0]}); refusing to read "
                              "logits from it", bad[0])

def _f(x) -> float:
    """A float32 value as its shortest round-tripping decimal (as every endpoint sends them)."""
    return float(str(np.float32(float(x))))


def _refs(rt, ids: list[int]) -> list[dict]:
    """``rt.token_refs`` of vocabulary ids, also for ids past the tokenizer's vocabulary (a
    model whose embedding is padded beyond it, e.g. a vocab of 50304 for 50277 tokens): those
    get the label ``<id N: not in the tokenizer>`` and no bytes."""
    n = len(rt.tokenizer)
    known = rt.token_refs([i for i in ids if i < n])
    it = iter(known)
    return [next(it) if i < n else {"id": i, "label": f"<id {i}: not in the tokenizer>",
                                     "bytes": "", "partial": False} for i in ids]


def check(rt, req) -> None:
    """A causal LM the hooked forward runs: GPT-2, Llama, Mistral, Qwen2, Gemma, Gemma 2,
    GPT-NeoX (422 ``unsupported_model`` / ``unsupported_model_config``)."""
    check_lm(rt)
    parts(rt)


def _token(rt, ref, param: str, vocab: int) -> int:
    """A token id (checked against the vocabulary) or a text that is one token (422)."""
    if isinstance(ref, str):
        return int(_single_token(rt, ref, param))
    if not 0 <= int(ref) < vocab:
        raise OutOfRange(f"{param}: token id {ref} is out of range (0..{vocab - 1})", param)
    return int(ref)


def _positions(positions, T: int, default: list[int] | None, where: str) -> list[int]:
    """``positions`` resolved against a prompt of ``T`` tokens (negatives from the end), each
    once; ``default`` (None: every position) when not given."""
    if positions is None:
        return list(range(T)) if default is None else default
    out, seen = [], {}
    for i, q in enumerate(positions):
        if not -T <= q < T:
            raise OutOfRange(f"positions.{i} = {q} is out of range: {where} has {T} token"
                             f"{'s' if T != 1 else ''} (valid -{T}..{T - 1})", f"positions.{i}")
        r = q % T
        if r in seen:
            raise InvalidRequest(f"positions.{i} = {q} repeats positions.{seen[r]} (position "
                                 f"{r})", f"positions.{i}")
        seen[r] = i
        out.append(r)
    return out


def _where(req, i: int) -> str:
    many = req.texts is not None or req.token_lists is not None
    return f"prompt {i}" if many else "the prompt"


def _prompt_body(it) -> dict:
    return {"tokens": [t.as_dict() for t in it.tokens], "n_tokens": len(it)}


def _forward_bytes(p: H.GPT2Parts, T: int) -> int:
    """The hooked forward's live tensors for one prompt: one layer's scores, pattern and
    copy ``3 H T^2`` and per token ``20 d_model + 6 d_mlp`` (the residual stream, block
    intermediates, the MLP's gelu temporaries: measured by the VmHWM of the forward alone,
    1.9-2.4x the ``8 d_model + 2 d_mlp`` counted before at T = 64-256)."""
    es = p.wte.element_size()
    return es * (3 * p.n_heads * T * T + T * (20 * p.d_model + 6 * p.d_mlp) + 2 * p.d_vocab)


# ------------------------------------------------------------------------------ logit lens
def lens_plan(rt, req: LogitLensRequest, items) -> Plan:
    """Positions and the target checked per prompt (422), the estimate (the largest prompt's
    forward, its cached states and one state's lens logits with their log-softmax and
    probabilities in float32; every prompt's response entries), and the job: per prompt one
    hooked forward caching the residual states, then per state the lens logits and their
    statistics (service/analysis/lens.py)."""
    p = parts(rt)
    L, V, D = p.n_layers, p.d_vocab, p.d_model
    rms = getattr(p, "norm", "ln") != "ln"  # Llama, Mistral, Qwen2, Gemma, Gemma 2
    if req.incl_mid and getattr(p, "parallel", False):
        raise UnsupportedModelConfig(
            f"incl_mid: {p.family} with use_parallel_residual has no hook_resid_mid (attention "
            "and MLP both read hook_resid_pre; TransformerLens' bridge has none either)",
            "incl_mid")
    target = None if req.target is None else _token(rt, req.target, "target", V)
    n_states = L + 1 + (L if req.incl_mid else 0)
    per_prompt = []
    est_job, est_body, flops = 0, 0, 0.0
    for i, it in enumerate(items):
        T = len(it)
        pos = _positions(req.positions, T, None, _where(req, i))
        per_prompt.append(pos)
        flops += forward_flops(T, L, D, p.d_mlp, logit_positions=1, d_vocab=V) + \
            lens_flops(T, n_states, len(pos), D, V)
        # + the lens logits of one state and their statistics: ~6.3 [T, vocab] float32
        # arrays measured at T = 1,000 (GPT-2 small: 1.52 GB peak), 7 counted
        job = _forward_bytes(p, T) + p.wte.element_size() * n_states * T * D + 4 * 7 * T * V
        est_job = max(est_job, job)
        est_body += tokens_bytes(T) + n_states * (200 + len(pos) * (req.top_k + 1)
                                                  * ENTRY_BYTES)
    hooks = [f"blocks.{layer}.hook_resid_pre" for layer in range(L)]
    labels = [f"{layer}_pre" for layer in range(L)]
    if req.incl_mid:
        hooks = [h for layer in range(L) for h in (f"blocks.{layer}.hook_resid_pre",
                                                   f"blocks.{layer}.hook_resid_mid")]
        labels = [s for layer in range(L) for s in (f"{layer}_pre", f"{layer}_mid")]
    hooks.append(f"blocks.{L - 1}.hook_resid_post")
    labels.append("final_post")

    def job(_forwards) -> dict:
        prompts = []
        for it, pos in zip(items, per_prompt):
            checkpoint()  # between prompts: a cancelled request stops here
            ids = torch.tensor([list(it.input_ids)], dtype=torch.long)
            cache = {h: None for h in hooks}
            if req.ln == "final":
                cache["ln_final.hook_scale"] = None
            res = H.run(p, ids, cache=cache, logit_positions=[-1])
            _finite(res)
            scale = res.cache.get("ln_final.hook_scale")
            T = ids.shape[1]
            tid = ids[0]
            if target is not None:
                targets = torch.full((len(pos),), target, dtype=torch.long)
            else:
                targets = torch.tensor([int(tid[q + 1]) if q + 1 < T else -1 for q in pos],
                                       dtype=torch.long)
            states = []
            for hook, label in zip(hooks, labels):
                checkpoint()  # between states (layers)
                fs = None if scale is None else scale[0]
                if rms:
                    logits = A.rms_lens_logits(res.cache[hook][0], p.unembed, p.lnf_w, p.eps,
                                               req.ln, p.norm == "rms1p", p.final_softcap, fs)
                else:
                    logits = A.lens_logits(res.cache[hook][0], p.unembed, p.lnf_w, p.lnf_b,
                                           p.eps, req.ln, fs)
                st = A.lens_stats(logits, tid, pos, req.top_k, targets)
                del logits
                top_refs = _refs(rt, st.top_ids.reshape(-1).tolist())
                k = st.top_ids.shape[1]
                tgt_refs = _refs(rt, targets.clamp(min=0).tolist())
                rows = []
                # plain lists: no torch op per value (each is one call through the cancel
                # mode, service/serving/core/cancel.py); the same floats as float(tensor[i])
                probs, lgts = st.top_probs.tolist(), st.top_logits.tolist()
                tgts, lps = targets.tolist(), st.target_logprob.tolist()
                ranks = st.target_rank.tolist()
                for j, q in enumerate(pos):
                    top = [dict(top_refs[j * k + c], prob=_f(probs[j][c]),
                                logit=_f(lgts[j][c])) for c in range(k)]
                    tg = None
                    if int(tgts[j]) >= 0:
                        lp = float(lps[j])
                        tg = dict(tgt_refs[j], rank=int(ranks[j]), logprob=_f(lp),
                                  prob=_f(np.exp(lp)))
                    rows.append({"position": q, "top": top, "target": tg})
                states.append({"label": label, "hook": hook,
                               "loss": None if st.loss is None else _f(st.loss),
                               "positions": rows})
            prompts.append({**_prompt_body(it), "states": states})
        return {"model": rt.model_ref(), "add_bos": bool(req.add_bos), "ln": req.ln,
                "ln_description": (A.RMS_LN_DESCRIPTION if rms else A.LN_DESCRIPTION)[req.ln],
                "weights": RMS_WEIGHTS_DOC if rms else WEIGHTS_DOC, "prompts": prompts}

    return Plan([], job, int(est_job + est_body), device_flops=flops,
                device_param="texts" if len(items) > 1 else "text")


# ------------------------------------------------------------------ direct logit attribution
def _per_prompt(rt, ref, n: int, param: str, vocab: int) -> list[int] | None:
    """One token id per prompt from a token (every prompt) or a list of one per prompt."""
    if ref is None:
        return None
    if isinstance(ref, list):
        if len(ref) != n:
            raise InvalidRequest(f"{param}: {len(ref)} tokens given for {n} prompt"
                                 f"{'s' if n != 1 else ''} (one per prompt, or a single "
                                 "token for all)", param)
        return [_token(rt, r, f"{param}.{i}", vocab) for i, r in enumerate(ref)]
    return [_token(rt, ref, param, vocab)] * n


def dla_plan(rt, req: LogitAttributionRequest, items) -> Plan:
    """Targets, distractors (a distractor equal to its target is a 422) and positions checked
    per prompt, the estimate (the largest prompt's forward with its cached head results
    ``[pos, head, d_model]`` per layer and the float64 stack at the chosen positions; the
    response's numbers), and the job: per prompt one hooked forward caching the components at
    the chosen positions, their parts of the logit direction and the served logits there."""
    p = parts(rt)
    fam = getattr(p, "family", "gpt2")
    rms = getattr(p, "norm", "ln") != "ln"  # Llama, Mistral, Qwen2, Gemma, Gemma 2
    has_pos = fam == "gpt2"  # the rotary families have no hook_pos_embed
    has_bias = fam == "gpt2" or any(getattr(blk, "o_b", None) is not None for blk in p.blocks)
    post = any(getattr(blk, "lnpa_w", None) is not None for blk in p.blocks)  # Gemma 2
    cap = getattr(p, "final_softcap", None)
    L, Hn, D, V = p.n_layers, p.n_heads, p.d_model, p.d_vocab
    n = len(items)
    tgt = _per_prompt(rt, req.target, n, "target", V)
    dis = _per_prompt(rt, req.distractor, n, "distractor", V)
    if dis is not None:
        for i, (a, b) in enumerate(zip(tgt, dis)):
            if a == b:
                param = "distractor" if not isinstance(req.distractor, list) else f"distractor.{i}"
                raise InvalidRequest(f"{param}: the distractor is the target (token {a}); the "
                                     "logit difference would be 0", param)
    per_prompt = []
    est_job, est_body, flops = 0, 0, 0.0
    n_comp = 1 + has_pos + L * Hn + (L if has_bias else 0) + L
    es = p.wte.element_size()
    for i, it in enumerate(items):
        T = len(it)
        pos = _positions(req.positions, T, [T - 1], _where(req, i))
        per_prompt.append(pos)
        P = len(pos)
        flops += forward_flops(T, L, D, p.d_mlp, logit_positions=P, d_vocab=V) + \
            2.0 * n_comp * P * D * 2
        # the forward; its per-head results; the cached pieces at the positions, their
        # permuted copy and the concatenated stack [component, P, d_model]; three float64
        # copies in the attribution; the logits at the positions and their float64 copy
        job = _forward_bytes(p, T) + es * T * Hn * D + 3 * es * P * n_comp * D \
            + 8 * 3 * n_comp * P * D + 12 * P * V
        est_job = max(est_job, job)
        est_body += tokens_bytes(T) + P * (400 + 30 * n_comp)
    comps = {"hook_embed": None, "ln_final.hook_scale": None,
             "blocks.*.attn.hook_result": None, "blocks.*.hook_mlp_out": None}
    if has_pos:
        comps["hook_pos_embed"] = None
    if post:
        comps["blocks.*.ln1_post.hook_scale"] = None
    if cap is not None:
        comps["ln_final.hook_normalized"] = None
    # the final norm's effective weight: RMSNorm w (Gemma 1 + w); LayerNorm w (and b apart)
    w_eff = (1.0 + p.lnf_w.double()) if getattr(p, "norm", "ln") == "rms1p" else p.lnf_w

    def job(_forwards) -> dict:
        prompts = []
        b_O = torch.stack([blk.proj_b for blk in p.blocks]) if has_bias else None  # [layer, D]
        for i, (it, pos) in enumerate(zip(items, per_prompt)):
            checkpoint()
            ids = torch.tensor([list(it.input_ids)], dtype=torch.long)
            sel = H.CacheSelect(positions=pos)
            res = H.run(p, ids, cache={k: sel for k in comps}, logit_positions=pos)
            _finite(res)
            c = res.cache
            P = len(pos)
            heads = torch.stack([c[f"blocks.{layer}.attn.hook_result"][0] for layer in range(L)])
            if post:  # Gemma 2: each head's share of hook_attn_out, ln1_post's scale frozen
                heads = torch.stack([
                    heads[layer].double() / c[f"blocks.{layer}.ln1_post.hook_scale"][0][:, None]
                    .double() * (1.0 + p.blocks[layer].lnpa_w.double()) for layer in range(L)])
            dt = torch.float64 if post else heads.dtype
            # stack [component, P, d_model]: embed, (pos_embed), L x H heads, (L biases), L MLPs
            pieces = [c["hook_embed"][0][None].to(dt)]
            if has_pos:
                pieces.append(c["hook_pos_embed"][0][None].to(dt))
            pieces.append(heads.permute(0, 2, 1, 3).reshape(L * Hn, P, D))
            if has_bias:
                pieces.append(b_O[:, None, :].expand(L, P, D).to(dt))
            pieces.append(torch.stack([c[f"blocks.{layer}.hook_mlp_out"][0]
                                       for layer in range(L)]).to(dt))
            stack = torch.cat(pieces)
            t = torch.full((P,), tgt[i], dtype=torch.long)
            d = None if dis is None else torch.full((P,), dis[i], dtype=torch.long)
            direction = A.logit_direction(p.unembed, t, d)
            scale = c["ln_final.hook_scale"][0]  # [P, 1]
            if rms:
                parts_ = A.rms_direct_logit_attribution(stack, scale, w_eff, direction)
                bias = torch.zeros(P, dtype=torch.float64)
            else:
                parts_ = A.direct_logit_attribution(stack, scale, p.lnf_w, direction)  # [C, P]
                bias = A.ln_bias_term(p.lnf_b, direction)
            lg = res.logits[0].double()  # [P, vocab], the forward's own logits
            ar = torch.arange(P)
            served = lg[ar, t] - (0 if d is None else lg[ar, d])
            attributed = served
            if cap is not None:  # Gemma 2: the parts add up to the logits before the soft-cap
                # HF's GemmaRMSNorm from its normalised value: (h * (1 + w_f32)).to(dtype)
                h = (c["ln_final.hook_normalized"][0] * (1.0 + p.lnf_w.float())).to(p.dtype)
                pre = torch.nn.functional.linear(h, p.unembed).double()
                attributed = pre[ar, t] - (0 if d is None else pre[ar, d])
            rows = []
            o = 1 + has_pos  # first head's row
            ob = o + L * Hn  # first bias (or MLP) row
            om = ob + (L if has_bias else 0)
            for j, q in enumerate(pos):
                col = parts_[:, j]
                total = float(col.sum())
                rows.append({
                    "position": q, "target": tgt[i], "distractor": None if dis is None
                    else dis[i], "logit_diff": _f(served[j]),
                    "pre_softcap_logit_diff": None if cap is None else _f(attributed[j]),
                    "scale": _f(scale[j, 0]),
                    "embed": _f(col[0]), "pos_embed": _f(col[1]) if has_pos else None,
                    "heads": [[_f(v) for v in col[o + layer * Hn: o + (layer + 1) * Hn]]
                              for layer in range(L)],
                    "attn_bias": [_f(v) for v in col[ob:om]] if has_bias else None,
                    "mlp": [_f(v) for v in col[om:]],
                    "ln_final_bias": _f(bias[j]), "sum_of_parts": _f(total),
                    "residual_error": float(
                        f"{float(attributed[j]) - total - float(bias[j]):.3g}"),
                })
            prompts.append({**_prompt_body(it), "positions": rows})
        return {"model": rt.model_ref(), "add_bos": bool(req.add_bos),
                "method": A.RMS_DLA_DESCRIPTION if rms else A.DLA_DESCRIPTION,
                "weights": RMS_WEIGHTS_DOC if rms else WEIGHTS_DOC, "prompts": prompts}

    if n > 1:  # prompts one after another: the heap settles above one prompt's peak
        est_job *= DLA_MANY_PROMPTS
    return Plan([], job, int(est_job + est_body), device_flops=flops,
                device_param="texts" if len(items) > 1 else "text")


ENDPOINTS = [
    Endpoint(
        path="/v1/logit-lens", name="logit_lens", request=LogitLensRequest,
        response=LogitLensResponse,
        summary="Logit lens: every residual state through ln_final and the unembedding",
        description="""For each prompt (``text``, ``texts``, ``tokens``, ``token_lists``; BOS per
``add_bos``) and each residual state in forward order (``blocks.{l}.hook_resid_pre``,
optionally ``blocks.{l}.hook_resid_mid``, and the final ``blocks.{L-1}.hook_resid_post``;
TransformerLens' accumulated_resid labels ``{l}_pre``, ``{l}_mid``, ``final_post``), the lens
logits ``LN(x) W_U`` (nostalgebraist 2020) with ``ln``: ``"own"`` = ln_final with the state's
own statistics (TransformerLens 4.3 ``cache.accumulated_resid(apply_ln=True)``, which
recomputes the final norm per state) or ``"final"`` = the final LayerNorm's scale frozen from
the run (``apply_ln_to_stack`` semantics: centred, divided by ``ln_final.hook_scale``), then
ln_final's weight and bias (the unprocessed weights do not fold them into ``W_U``). Per state:
the mean next-token cross entropy (nats) over every position; per requested position the
top-k tokens (probability, logit) and the rank (tokens with a higher logit; 0 = top) and
log-prob of the actual next token or of ``target``. The ``final_post`` state is the model's own
prediction. Equal to TransformerLens 4.3 (``enable_compatibility_mode(no_processing=True)``)
to <= 1e-5 (tests/test_lens.py). RMSNorm families (Llama, Mistral, Qwen2, Gemma, Gemma 2):
the model's own final RMSNorm as Hugging Face computes it (float32 upcast, ``w * h`` or Gemma's
``1 + w``, no centring, no bias), then lm_head and Gemma 2's final soft-cap; ``"final"`` = ``x /
s * w'`` with ``s`` = ``ln_final.hook_scale`` = ``sqrt(mean(x_L^2) + eps)`` of the run's last
state (tests/test_lens_families.py: HF's own norm module, TL 4.3, <= 1e-5).
Errors: 422 a position out of range or repeated, a target that is not one token or not in the
vocabulary, too many tokens, ``incl_mid`` on GPT-NeoX's parallel residual (no
hook_resid_mid), a model the hooked forward does not run; 429 over the memory budget.""",
        plan=lens_plan, check=check,
        invalid="Invalid request: a position out of range or repeated, a target that is not one "
                "token, too many tokens, an unsupported model, memory.",
        tags=("lens",), order=130,
    ),
    Endpoint(
        path="/v1/logit-attribution", name="logit_attribution",
        request=LogitAttributionRequest, response=LogitAttributionResponse,
        summary="Direct logit attribution to heads, MLPs, embeddings and biases",
        description="""At each chosen position (default the last) of each prompt, the logit
direction ``d = W_U[:, target] - W_U[:, distractor]`` (or ``W_U[:, target]`` without a
distractor) attributed to every component of the final residual state through ln_final with
its scale frozen from the run (TransformerLens ``cache.apply_ln_to_stack``, which also centres
each component): ``part(c) = ((c - mean c) / s) . (w * d)``, ``s`` = ``ln_final.hook_scale``,
``w`` ln_final's weight, for ``hook_embed``, ``hook_pos_embed``, every head's
``blocks.{l}.attn.hook_result`` (without b_O; TransformerLens ``stack_head_results``), every
layer's attention output bias ``b_O`` and every ``blocks.{l}.hook_mlp_out``. The parts sum to
the served logit difference up to ln_final's bias term ``b . d``, which is reported
(``ln_final_bias``), and ``residual_error`` = served - parts - bias is float rounding only
(<= 1e-4, tests/test_lens.py). Raw weights: b_V stays inside each head's result (a processed
TransformerLens model folds it into b_O). Rotary families: no ``pos_embed`` (null),
``attn_bias`` null without a b_O; a final RMSNorm gives ``part(c) = (c / s) . (w' * d)`` (no
centring, ``w'`` = ``w`` or Gemma's ``1 + w``, ln_final_bias 0); Gemma 2's heads are their share
of ``hook_attn_out`` with the post-attention norm's scale frozen, and its parts sum to
``pre_softcap_logit_diff`` (the logit difference before the final soft-cap).
Errors: 422 a position out of range or repeated, a target or distractor that is not one token,
a distractor equal to the target, a per-prompt list of the wrong length; 429 over the memory
budget.""",
        plan=dla_plan, check=check,
        invalid="Invalid request: a position out of range or repeated, a target or distractor "
                "that is not one token (or equal), too many tokens, an unsupported model, "
                "memory.",
        tags=("lens",), order=131,
    ),
]
