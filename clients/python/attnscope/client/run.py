"""``client.run(...)``: one hooked forward on the server (``POST /v1/run``), its results as
numpy arrays under TransformerLens 4.x hook names, and builders for interventions and metrics.

    from attnscope.client import Client, run as R
    c = Client()
    out = c.run(texts=["The cat sat on the mat and the dog", "The dog sat on the mat and the cat"],
                cache=["blocks.*.hook_resid_post", R.cached("blocks.0.attn.hook_pattern", heads=[0])],
                interventions=[R.patch("blocks.1.attn.hook_z", source_prompt=0, prompts=[1], heads=[0])],
                metrics={"ld": R.logit_diff((-1, " the", " a"))})
    out.cache["blocks.0.hook_resid_post"]     # ndarray [batch, pos, d_model] (float32)
    out.metrics["ld"]                         # float: the mean over terms
    out.tokens                                # [batch][pos] token ids

Tensors come as one safetensors response by default (``binary=True``: arrays are read without
a JSON parse, zero-copy where the dtype allows); ``binary=False`` asks for base64 JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from . import wire


# ------------------------------------------------------------------ builders (plain dicts)
def _sel(prompts=None, heads=None, positions=None) -> dict:
    return {k: list(v) for k, v in (("prompts", prompts), ("heads", heads),
                                    ("positions", positions)) if v is not None}


def _tensor(x) -> Any:
    """An array-like as the request's base64 float32 form (exact), lists as they are."""
    if isinstance(x, (list, tuple)):
        return list(x)
    a = np.ascontiguousarray(np.asarray(x, dtype="<f4"))
    import base64

    return {"encoding": "base64", "dtype": "float32", "shape": list(a.shape),
            "data": base64.b64encode(a.tobytes()).decode()}


def cached(hook: str, *, layers=None, prompts=None, heads=None, positions=None) -> dict:
    """A cache entry with a selection (a plain hook name or pattern needs no builder)."""
    out = {"hook": hook, **_sel(prompts, heads, positions)}
    if layers is not None:
        out["layers"] = list(layers)
    return out


def zero(hook: str, **sel) -> dict:
    """Zero ablation of ``hook`` (``prompts``, ``heads``, ``positions`` select)."""
    return {"kind": "zero", "hook": hook, **_sel(**sel)}


def scale(hook: str, factor: float, **sel) -> dict:
    return {"kind": "scale", "hook": hook, "factor": float(factor), **_sel(**sel)}


def add(hook: str, vector, scale: float = 1.0, **sel) -> dict:
    """Steering: ``scale * vector`` added to every selected vector of ``hook``."""
    return {"kind": "add", "hook": hook, "vector": _tensor(vector), "scale": float(scale),
            **_sel(**sel)}


def mean(hook: str, over: str = "batch_pos", reference: Sequence[Sequence[int]] | None = None,
         reference_texts: Sequence[str] | None = None, **sel) -> dict:
    """Mean ablation: over 'pos', 'batch' or 'batch_pos' of this run, or over reference prompts
    (token ids or texts)."""
    out = {"kind": "mean", "hook": hook, "over": over, **_sel(**sel)}
    if reference is not None:
        out["reference"] = [list(map(int, r)) for r in reference]
    if reference_texts is not None:
        out["reference_texts"] = list(reference_texts)
    return out


def patch(hook: str, source_prompt: int, **sel) -> dict:
    """Activation patching in one call: ``hook``'s value of prompt ``source_prompt`` set into
    the selected prompts (``prompts=[...]``)."""
    return {"kind": "set", "hook": hook, "source_prompt": int(source_prompt), **_sel(**sel)}


def set_value(hook: str, value, **sel) -> dict:
    """``hook``'s selection replaced by ``value`` (shaped as one prompt's selection)."""
    return {"kind": "set", "hook": hook, "value": _tensor(value), **_sel(**sel)}


def _terms(keys: Sequence[str], terms) -> list[dict]:
    out = []
    for t in terms:
        if isinstance(t, Mapping):
            out.append(dict(t))
        else:
            t = tuple(t)
            if len(t) == len(keys) + 1:  # a leading prompt index
                out.append({"prompt": t[0], **dict(zip(keys, t[1:]))})
            else:
                out.append(dict(zip(keys, t)))
    return out


def _one(terms: tuple, fields: dict) -> tuple:
    """The terms, or one term given by keywords (``position=-1, target=" the"``)."""
    given = {k: v for k, v in fields.items() if v is not None}
    if given:
        if terms:
            raise TypeError("give terms as positional tuples/dicts or one term as keywords, "
                            "not both")
        return (given,)
    if not terms:
        raise TypeError("give at least one term")
    return terms


def logit_diff(*terms, position=None, target=None, distractor=None, prompt=None,
               reduce: str = "mean") -> dict:
    """Terms ``(position, target, distractor)`` or ``(prompt, position, target, distractor)``
    (or dicts), or one term by keywords; targets as ids or one-token strings."""
    terms = _one(terms, dict(prompt=prompt, position=position, target=target,
                             distractor=distractor))
    return {"kind": "logit_diff", "terms": _terms(("position", "target", "distractor"), terms),
            "reduce": reduce}


def prob(*terms, position=None, target=None, prompt=None, reduce: str = "mean") -> dict:
    """Terms ``(position, target)`` / ``(prompt, position, target)`` or one by keywords."""
    terms = _one(terms, dict(prompt=prompt, position=position, target=target))
    return {"kind": "prob", "terms": _terms(("position", "target"), terms), "reduce": reduce}


def logprob(*terms, position=None, target=None, prompt=None, reduce: str = "mean") -> dict:
    """Terms ``(position, target)`` / ``(prompt, position, target)`` or one by keywords."""
    terms = _one(terms, dict(prompt=prompt, position=position, target=target))
    return {"kind": "logprob", "terms": _terms(("position", "target"), terms), "reduce": reduce}


def loss(*positions, prompt: int | None = None, reduce: str = "mean") -> dict:
    return {"kind": "loss", "terms": [{"prompt": prompt, "position": p} for p in positions],
            "reduce": reduce}


def kl(*terms, prompt=None, reference_prompt=None, position=None, reduce: str = "mean") -> dict:
    """Terms ``(prompt, reference_prompt, position)`` (or dicts, or one by keywords):
    KL(P_prompt || P_reference)."""
    terms = _one(terms, dict(prompt=prompt, reference_prompt=reference_prompt,
                             position=position))
    return {"kind": "kl", "terms": _terms(("prompt", "reference_prompt", "position"), terms),
            "reduce": reduce}


# ------------------------------------------------------------------ the result
@dataclass
class RunOutput:
    """What ``client.run`` returns. ``cache`` / ``grads``: hook name -> ndarray (TL shapes,
    batch first); ``metrics``: name -> float (``metric_values``: name -> per-term list);
    ``logits``: ``[batch, position, vocab]`` when asked ``full``, ``top``: the top-k tokens;
    ``loss``: ``[batch, pos - 1]``; ``tokens``: the prompts' ids; ``body``: the response's
    JSON (tensors decoded)."""

    cache: dict[str, np.ndarray]
    metrics: dict[str, float]
    metric_values: dict[str, list[float]]
    grads: dict[str, np.ndarray]
    grad_value: float | None
    tokens: list[list[int]]
    add_bos: bool
    logits: np.ndarray | None = None
    logit_positions: list[int] | None = None
    top: list | None = None
    loss: np.ndarray | None = None
    selections: dict = field(default_factory=dict)
    body: dict = field(default_factory=dict, repr=False)

    def __getitem__(self, name: str) -> np.ndarray:
        """``out["blocks.0.attn.hook_z"]``: a cached activation (as TL's ``cache[name]``)."""
        return self.cache[name]

    def keys(self):
        return self.cache.keys()


def _arrays(x: Any, arrays) -> Any:
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, Mapping) and x.get("encoding") in ("base64", "binary", "tril", "sparse"):
        return wire.decode_tensor(dict(x), arrays)
    if isinstance(x, list):
        return wire.decode_tensor(x)
    return x


def run_output(body: dict, arrays=None) -> RunOutput:
    """A ``/v1/run`` response body (JSON, or a safetensors body's metadata with its arrays)
    -> :class:`RunOutput`."""
    lg = body.get("logits") or {}
    loss = body.get("loss") or {}
    return RunOutput(
        cache={k: _arrays(v, arrays) for k, v in body.get("cache", {}).items()},
        metrics={k: v["value"] for k, v in body.get("metrics", {}).items()},
        metric_values={k: v["values"] for k, v in body.get("metrics", {}).items()},
        grads={k: _arrays(v, arrays) for k, v in body.get("grads", {}).items()},
        grad_value=body.get("grad_value"),
        tokens=[[t["id"] for t in p["tokens"]] for p in body.get("prompts", [])],
        add_bos=bool(body.get("add_bos")),
        logits=None if lg.get("logits") is None else _arrays(lg["logits"], arrays),
        logit_positions=lg.get("positions"),
        top=lg.get("top"),
        loss=None if not loss else _arrays(loss["per_token"], arrays),
        selections=body.get("selections", {}),
        body=body,
    )
