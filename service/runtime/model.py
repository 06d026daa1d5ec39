"""The model runtime: load once, tokenize (thread-safe), one recorded forward per input.

What a forward records (:class:`ForwardTensors`, one per text) is described in
service/runtime/results.py; loading (hub or local directory, device, revision) lives in
service/runtime/loading.py.

One forward path: for a causal LM (GPT-2, Llama, Mistral, Qwen2, Gemma, Gemma 2, GPT-NeoX)
:meth:`Runtime._forward_batch` runs the hooked forward (service/runtime/hooked.py ``record``,
the forward predictions, ablation, patching and ``/v1/run`` run, on the parts in
``memo["hooked_parts"]``), once per group of texts of one length, unpadded, writing each
text's tensors into its recording buffers (:meth:`Runtime._recording_buffers`) as they are
computed. Encoders (BERT) and the configurations the hooked forward does not implement
(:meth:`Runtime.hooked_parts`) record through Hugging Face's modules (:meth:`Runtime._forward_hf`)
in four steps: pad the batch (:meth:`Runtime._padded_inputs`), allocate the buffers, install
the per-call hooks (:class:`_Recorder`, service/runtime/inplace_attention.py) and run the
model, then unpad each text into its buffers (:meth:`Runtime._unpad`); there batches are
padded for the device and unpadded by attention mask, position ids derived from the mask, so
left or right padding give a text's own positions. Either way a text's numbers never depend
on its batch mates.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Sequence

import torch

from ..config import BUNDLED_MODEL_ID, Settings
from ..errors import ContextLengthExceeded, InvalidRequest, UnsupportedModelConfig, scrub_paths
from .adapters import ADAPTERS, Adapter, LayerHandles
from . import inplace_attention
from .cache import ByteLRU
from .loading import ModelLoadError, _load_pretrained
from .results import recorded_bytes
from .results import (
    ForwardResult,
    ForwardTensors,
    TokenInfo,
    TokenizedText,
)
from .tokens import bytelevel_label, is_partial, token_bytes, visible

__all__ = ["ForwardResult", "ForwardTensors", "ModelLoadError", "Runtime", "TokenInfo",
           "TokenizedText"]

log = logging.getLogger("attnscope.runtime")

#: Tokenized texts kept (a text analysed by several endpoints is tokenized once; ~2 ms at 128
#: tokens). Texts longer than TOKENIZE_CACHE_MAX_CHARS are not kept.
TOKENIZE_CACHE_ENTRIES = 128
TOKENIZE_CACHE_MAX_CHARS = 20_000


class Runtime:
    """Owns the model, the tokenizer and the forward cache. Not async: callers serialise
    forwards through :class:`attnscope.service.serving.core.slot.DeviceSlot`."""

    def __init__(self, model, tokenizer, adapter: Adapter, info: dict, settings: Settings):
        self.model = model
        self.tokenizer = tokenizer
        self.adapter = adapter
        self.info = info
        self.settings = settings
        self.device = next(model.parameters()).device
        self._handles = adapter.layers()
        self.scaling = tuple(h.scaling for h in self._handles)
        #: a text forwarded alone gets its patterns written straight into its buffer
        #: (service/runtime/inplace_attention.py); else they are copied there
        self.inplace_attention = inplace_attention.install(
            model, [h.attn for h in self._handles], softmax_float32=adapter.softmax_float32)
        if adapter.qkv_in_attention and not self.inplace_attention:
            raise ModelLoadError(
                f"{adapter.family}: q/k after rotary are recorded in the attention function, "
                "which could not be installed (the attention implementation must be 'eager' "
                "and the family's module must define eager_attention_forward)")
        #: per layer, the key window (None = full attention) and the logit soft-cap
        self.windows = tuple(h.window for h in self._handles)
        self.softcaps = tuple(h.softcap for h in self._handles)
        #: how token strings spell text: "bytelevel" (GPT-2's byte alphabet: GPT-2, Pythia,
        #: Llama 3, Qwen2), "sentencepiece" ('▁' for a space, <0xNN> byte fallback: Llama 2,
        #: Mistral, Gemma) or "plain" (WordPiece: encoders)
        self.piece_style = _piece_style(tokenizer, adapter.causal)
        self._tok_lock = threading.Lock()  # the tokenizer (not shared between threads)
        self._tok_cache_lock = threading.Lock()  # its LRU (also read on the event loop)
        self._tok_cache: OrderedDict[tuple[str, bool], TokenizedText] = OrderedDict()
        self._fwd_lock = threading.Lock()
        self.cache: ByteLRU[ForwardTensors] = ByteLRU(
            settings.cache_entries, settings.cache_bytes, lambda t: t.nbytes
        )
        self.forward_count = 0
        #: Derived data that depends only on the model and tokenizer (e.g. the induction probe
        #: of /v1/heads per probe options), computed once: key -> value. Bounded by its users.
        self.memo: dict = {}

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, settings: Settings) -> "Runtime":
        """Load the configured model (falling back to the bundled one for the default 'gpt2').

        Raises:
            ModelLoadError: the model cannot be loaded, is not a supported family, or its probe
                forward does not return one attention tensor per layer.
        """
        requested = settings.model
        fallback_reason = None
        try:
            model, tok, ident = _load_pretrained(requested, settings)
        except ModelLoadError as exc:
            if requested != "gpt2" or settings.strict_model:
                raise
            fallback_reason = str(exc)
            log.warning(
                "default model 'gpt2' unavailable (%s); starting on the bundled checkpoint %s",
                fallback_reason, BUNDLED_MODEL_ID,
            )
            model, tok, ident = _load_pretrained("bundled", settings)
        adapter = ADAPTERS[model.config.model_type](model)
        # clients see model ids, never local paths (issue 17); the log has the full path
        shown = requested
        if fallback_reason is None and requested not in ("bundled", BUNDLED_MODEL_ID) and \
                Path(requested).expanduser().is_dir():
            shown = ident["id"]
        info = {
            **ident,
            "requested": shown,
            "fallback": fallback_reason is not None,
            "fallback_reason": None if fallback_reason is None else scrub_paths(fallback_reason),
            "architecture": (model.config.architectures or [type(model).__name__])[0],
            "family": adapter.family,
            "causal": adapter.causal,
            "n_layers": adapter.n_layers,
            "n_heads": adapter.n_heads,
            "d_model": adapter.d_model,
            "d_head": adapter.d_head,
            "n_kv_heads": adapter.n_kv_heads,
            "attention": adapter.attention_facts(),
            "n_ctx": adapter.n_ctx,
            "vocab_size": int(model.config.vocab_size),
            "device": str(next(model.parameters()).device),
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "attn_implementation": getattr(model.config, "_attn_implementation", None) or "eager",
            "bos_token": tok.bos_token if adapter.causal else None,
            "add_bos_default": bool(adapter.causal and tok.bos_token_id is not None),
        }
        rt = cls(model, tok, adapter, info, settings)
        rt.probe()
        return rt

    def probe(self) -> None:
        """Run one short forward and check every layer's attention was returned."""
        tt = self.tokenize("attnscope probe: the cat sat on the mat.")
        try:
            base = self.adapter.base()
            ids = torch.tensor([tt.input_ids], device=self.device)
            with torch.inference_mode():
                out = base(input_ids=ids, output_attentions=True)
            attentions = [a for a in (out.attentions or ()) if a is not None]
        except Exception as exc:  # pragma: no cover - depends on the model
            raise ModelLoadError(f"probe forward failed: {type(exc).__name__}: {exc}") from exc
        if len(attentions) < self.adapter.n_layers:
            raise ModelLoadError(
                f"probe forward returned {len(attentions)} attention layers but the model has "
                f"{self.adapter.n_layers}; the attention implementation must be 'eager'"
            )
        self.forward_many([tt])
        self.cache.clear()

    # --------------------------------------------------------------- tokenizing
    @property
    def default_add_bos(self) -> bool:
        """The model's BOS convention, what a request's ``add_bos`` null means: True for a
        causal model whose tokenizer has a BOS token (TransformerLens' ``to_tokens`` prepends
        it; GPT-2 was trained with it between documents), False for encoders ([CLS] frames
        them)."""
        return bool(self.adapter.causal and self.tokenizer.bos_token_id is not None)

    def tokenize(self, text: str, add_bos: bool = False, param: str = "text",
                 cached_only: bool = False) -> TokenizedText | None:
        """Tokenize ``text`` as plain text (strings that spell special tokens stay text).

        Causal models: ``add_bos`` prepends the BOS token. Encoders: the tokenizer's own
        framing ([CLS] ... [SEP]); ``add_bos`` is rejected. ``cached_only``: return None
        instead of tokenizing when the text is not in the tokenize cache (cheap enough for the
        event loop; the checks above still run).

        Raises:
            InvalidRequest: text too long in characters, add_bos on an encoder or on a
                tokenizer without a BOS token.
            ContextLengthExceeded: more tokens than the model's context (n_ctx).
        """
        limit = self.settings.max_text_chars
        if len(text) > limit:
            raise InvalidRequest(
                f"{param} has {len(text)} characters; the limit is {limit} (max_text_chars)", param
            )
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate (JSON "\ud800"): not text
            raise InvalidRequest(
                f"{param} holds an unpaired surrogate ({text[exc.start]!r} at character "
                f"{exc.start}); text must be valid Unicode", param,
            ) from None
        causal = self.adapter.causal
        if add_bos and not causal:
            raise InvalidRequest(
                "add_bos applies to causal models only; this encoder always gets its own "
                "framing ([CLS] ... [SEP])", "add_bos",
            )
        if add_bos and self.tokenizer.bos_token_id is None:
            raise InvalidRequest(
                "add_bos: this model's tokenizer has no BOS token (bos_token is null; GET "
                "/v1/model says add_bos_default false); send add_bos false or null", "add_bos",
            )
        key = (text, add_bos)
        with self._tok_cache_lock:
            hit = self._tok_cache.get(key)
            if hit is not None:  # several analyses of one text tokenize it once
                self._tok_cache.move_to_end(key)
        if hit is not None or cached_only:  # (a hit passed the context check when it was made)
            return hit
        tt = self._tokenize(text, add_bos, param)
        if len(text) <= TOKENIZE_CACHE_MAX_CHARS:
            with self._tok_cache_lock:
                self._tok_cache[key] = tt
                while len(self._tok_cache) > TOKENIZE_CACHE_ENTRIES:
                    self._tok_cache.popitem(last=False)
        return tt

    def _tokenize(self, text: str, add_bos: bool, param: str) -> TokenizedText:
        causal = self.adapter.causal
        with self._tok_lock:
            enc = self.tokenizer(
                text,
                add_special_tokens=not causal,
                split_special_tokens=True,
                return_offsets_mapping=True,
                return_special_tokens_mask=True,
                return_attention_mask=False,
                verbose=False,
            )
            ids = list(enc["input_ids"])
            pieces = self.tokenizer.convert_ids_to_tokens(ids)
        offsets = list(enc["offset_mapping"])
        # with split_special_tokens, special_tokens_mask marks only the framing
        special = [bool(s) for s in enc["special_tokens_mask"]]
        if causal and add_bos:
            bos = self.tokenizer.bos_token_id
            ids = [bos] + ids
            pieces = [self.tokenizer.bos_token] + pieces
            offsets = [None] + offsets
            special = [True] + special
        self._check_context(len(ids), param)
        tokens = []
        for i, (tid, piece, off, sp) in enumerate(zip(ids, pieces, offsets, special)):
            start, end = (None, None) if sp or off is None else (int(off[0]), int(off[1]))
            tokens.append(TokenInfo(i, int(tid), self._label(piece, sp), start, end, sp,
                                    *self._bytes(piece, sp)))
        return TokenizedText(text, add_bos, tuple(ids), tuple(tokens))

    def _check_context(self, n_tokens: int, param: str) -> None:
        """Raise :class:`ContextLengthExceeded` when ``n_tokens`` > n_ctx (names both)."""
        n_ctx = self.adapter.n_ctx
        if n_tokens > n_ctx:
            raise ContextLengthExceeded(
                f"{param} has {n_tokens} tokens; the model's context is {n_ctx} tokens (n_ctx)",
                param,
            )

    def _label(self, piece: str, special: bool) -> str:
        """Readable label of one token string: special tokens by name; byte-level BPE pieces
        (causal models) decoded to their text; WordPiece pieces as they are; control
        characters escaped (``\\n``; service/runtime/tokens.py)."""
        if special:
            return piece
        if self.piece_style == "plain":
            return visible(piece)
        if self.piece_style == "sentencepiece":
            return visible(_sentencepiece_bytes(piece).decode("utf-8", errors="backslashreplace"))
        return bytelevel_label(piece)

    def _bytes(self, piece: str, special: bool) -> tuple[bytes, bool]:
        """``(raw bytes, partial)`` of one token string (:func:`.tokens.token_bytes`): the
        bytes a byte-level BPE piece (causal models) stands for; a special token's or a
        WordPiece piece's UTF-8, never partial; a SentencePiece piece's text ('▁' = a space)
        or its ``<0xNN>`` byte, partial when that is not a whole UTF-8 character."""
        if self.piece_style == "sentencepiece" and not special:
            raw = _sentencepiece_bytes(piece)
            return raw, is_partial(raw)
        return token_bytes(piece, self.piece_style == "bytelevel" and not special)

    def token_refs(self, ids: Sequence[int]) -> list[dict]:
        """``{"id", "label", "bytes", "partial"}`` of vocabulary ids (predicted tokens, metric
        tokens): labels and bytes as :meth:`tokenize` makes them."""
        ids = [int(i) for i in ids]
        with self._tok_lock:
            pieces = self.tokenizer.convert_ids_to_tokens(ids)
            special = set(self.tokenizer.all_special_ids)
        out = []
        for i, p in zip(ids, pieces):
            if p is None:  # an id of the model's (padded) vocabulary the tokenizer lacks
                out.append({"id": i, "label": f"<id {i}: not in the tokenizer>", "bytes": "",
                            "partial": False})
                continue
            raw, partial = self._bytes(p, i in special)
            out.append({"id": i, "label": self._label(p, i in special), "bytes": raw.hex(),
                        "partial": partial})
        return out

    def tokenized_from_ids(self, ids: list[int], param: str = "input_ids") -> TokenizedText:
        """A :class:`TokenizedText` for raw token ids (no tokenizer pass, no framing added),
        e.g. the induction probe of /v1/heads. Labels as :meth:`tokenize` makes them; tokens
        in the tokenizer's special ids are ``special``; offsets are null (there is no text);
        ``text`` is the tokenizer's decoding of the ids.

        Raises:
            InvalidRequest: no ids, or an id outside ``[0, len(tokenizer))``.
            ContextLengthExceeded: more ids than the model's context (n_ctx).
        """
        ids = [int(i) for i in ids]
        # an id the tokenizer knows but the embedding lacks (or the reverse) is not a token id
        n_vocab = min(len(self.tokenizer), int(self.model.config.vocab_size))
        if not ids:
            raise InvalidRequest(f"{param} holds no token ids", param)
        for i, tid in enumerate(ids):
            if not 0 <= tid < n_vocab:
                raise InvalidRequest(
                    f"{param}[{i}] = {tid} is not a token id (vocabulary 0..{n_vocab - 1})",
                    f"{param}.{i}",
                )
        self._check_context(len(ids), param)
        with self._tok_lock:
            pieces = self.tokenizer.convert_ids_to_tokens(ids)
            special_ids = set(self.tokenizer.all_special_ids)
            text = self.tokenizer.decode(ids)
        tokens = tuple(
            TokenInfo(i, tid, self._label(piece, tid in special_ids), None, None,
                      tid in special_ids, *self._bytes(piece, tid in special_ids))
            for i, (tid, piece) in enumerate(zip(ids, pieces))
        )
        return TokenizedText(text, False, tuple(ids), tokens)

    # ----------------------------------------------------------------- forward
    def cached_forwards(self, items: list[TokenizedText]) -> list[ForwardResult] | None:
        """Every item's forward from the cache, or None (nothing counted) unless all are
        there. Non-blocking: no forward runs, so the event loop may call it."""
        hits = self.cache.get_all([it.input_ids for it in items])
        if hits is None:
            return None
        return [self._result(it, t, cached=True) for it, t in zip(items, hits)]

    def _result(self, it: TokenizedText, t: ForwardTensors, cached: bool = False) -> ForwardResult:
        return ForwardResult(it, t, self.scaling, self.adapter.causal, cached=cached,
                             windows=self.windows, softcaps=self.softcaps)

    def forward_many(self, items: list[TokenizedText]) -> list[ForwardResult]:
        """Recorded forwards for several tokenized texts (cache first, then padded batches).

        Blocking; call off the event loop. Thread-safe (one forward on the device at a time).
        """
        results: list[ForwardResult | None] = [None] * len(items)
        todo: dict[tuple[int, ...], list[int]] = {}
        for i, it in enumerate(items):
            hit = self.cache.get(it.input_ids)
            if hit is not None:
                results[i] = self._result(it, hit, cached=True)
            else:
                todo.setdefault(it.input_ids, []).append(i)
        keys = list(todo)
        bs = self.settings.forward_batch_size
        for s in range(0, len(keys), bs):
            chunk = keys[s : s + bs]
            with self._fwd_lock:
                a = self.adapter
                es = next(self.model.parameters()).element_size()
                qkv_w = (a.n_heads + 2 * a.n_kv_heads) * a.d_head
                self.cache.reserve(sum(recorded_bytes(a.n_layers, a.n_heads, a.d_model, len(k), es,
                                                      qkv_width=qkv_w)
                                       for k in chunk), len(chunk))
                tensors = self._forward_batch(chunk)
            for key, t in zip(chunk, tensors):
                self.cache.put(key, t)
                for i in todo[key]:
                    results[i] = self._result(items[i], t)
        return results  # type: ignore[return-value]

    def hooked_parts(self):
        """The hooked forward's parts of the model (service/runtime/hooked.py: detached views
        of its parameters), made once and kept in ``memo["hooked_parts"]``, the entry every
        causal path reads (predictions, ablation, patching, ``/v1/run`` and the recorded
        forward: one forward path); None for an encoder (BERT) or a configuration the hooked
        forward does not implement (GPT-2's ``reorder_and_upcast_attn``, a GPT-2 without its
        LM head, dynamic RoPE, ...): those record through Hugging Face's modules."""
        if not self.adapter.causal or self.memo.get("hooked_unsupported"):
            return None
        p = self.memo.get("hooked_parts")
        if p is None:
            from . import hooked

            try:
                p = self.memo["hooked_parts"] = hooked.parts(self.model)
            except (UnsupportedModelConfig, AttributeError) as exc:
                log.info("recorded forward through Hugging Face's modules: %s", exc)
                self.memo["hooked_unsupported"] = str(exc)
                return None
        return p

    def _forward_batch(self, batch: list[tuple[int, ...]]) -> list[ForwardTensors]:
        """The recorded forwards of ``batch`` (token ids of B texts): one
        :class:`ForwardTensors` per text, in ``batch`` order (all on CPU). Causal LMs: the
        hooked forward (:meth:`_forward_hooked`), texts of one length together, unpadded;
        encoders (BERT) and configurations it does not implement: Hugging Face's modules
        (:meth:`_forward_hf`, one padded batch). Blocking; the caller holds ``_fwd_lock``."""
        p = self.hooked_parts()
        if p is not None:
            return self._forward_hooked(p, batch)
        return self._forward_hf(batch)

    def _forward_hooked(self, p, batch: list[tuple[int, ...]]) -> list[ForwardTensors]:
        """The recorded forward of a causal LM: service/runtime/hooked.py's forward (the one
        predictions, ablation, patching and ``/v1/run`` run), once per group of texts of one
        length (no padding, no mask: exact, a text's numbers never depend on another length's
        batch mates), every tensor written into each text's buffers
        (:meth:`_recording_buffers`) as it is computed (:func:`hooked.record`): a text alone
        gets its patterns straight from the softmax and every layer's scores in one buffer."""
        from . import hooked

        bufs = self._recording_buffers([len(x) for x in batch], True)
        groups: dict[int, list[int]] = {}
        for b, x in enumerate(batch):
            groups.setdefault(len(x), []).append(b)
        L = len(self._handles)
        names = p.names
        qkv_kinds = ("q", "k", "v") if self.adapter.qkv_in_attention else ("qkv",)
        for rows in groups.values():
            bs = [bufs[b] for b in rows]

            def tgt(get, bs=bs):  # one prompt: its buffer as [1, ...]; else one per row
                return get(bs[0]).unsqueeze(0) if len(bs) == 1 else [get(x) for x in bs]

            into = {f"blocks.0.{names['resid_pre']}": tgt(lambda x: x["hidden_states"][0])}
            for i in range(L):
                into[f"blocks.{i}.{names['pattern']}"] = tgt(lambda x, i=i: x["pattern"][i])
                into[f"blocks.{i}.{names['resid_post']}"] = tgt(
                    lambda x, i=i: x["hidden_states"][i + 1])
            layers_into = {
                kind: [tgt(lambda x, i=i, kind=kind: x[kind][i]) for i in range(L)]
                for kind in ("attn_input", "attn_output")}
            for j, kind in enumerate(qkv_kinds):
                layers_into[kind] = [tgt(lambda x, i=i, j=j: x["qkv"][j][i]) for i in range(L)]
            ids = torch.tensor([batch[b] for b in rows], dtype=torch.long, device=self.device)
            hooked.record(p, ids, into, layers_into, tgt(lambda x: x["final_state"]))
            self.forward_count += 1
        out = []
        for buf in bufs:
            if self.adapter.qkv_in_attention:
                q, k, v = buf["qkv"]
            else:
                q, k, v = self.adapter.split_qkv(buf["qkv"])  # each [layer, head, pos, d_head]
            out.append(ForwardTensors(buf["pattern"], buf["hidden_states"], q, k, v,
                                      buf["attn_input"], buf["attn_output"],
                                      final_state=buf["final_state"]))
        return out

    def _forward_hf(self, batch: list[tuple[int, ...]]) -> list[ForwardTensors]:
        """One padded forward of ``batch`` through Hugging Face's modules with every tensor
        recorded (:class:`_Recorder`, service/runtime/inplace_attention.py): encoders (BERT)
        and the configurations :meth:`hooked_parts` names; one :class:`ForwardTensors` per
        text, unpadded, in ``batch`` order (all on CPU)."""
        ids, mask, kwargs = self._padded_inputs(batch)
        final_norm = self.adapter.final_norm()
        bufs = self._recording_buffers([len(x) for x in batch], final_norm is not None)
        rec = _Recorder(self._handles, final_norm, bufs[0] if len(batch) == 1 else None)
        targets = {h.attn: bufs[0]["pattern"][i] for i, h in enumerate(self._handles)} \
            if self.inplace_attention and len(batch) == 1 else {}
        # rotary families: q/k/v as the attention function receives them (after rotary)
        slots = ({h.attn: rec.qkv[i] for i, h in enumerate(self._handles)}
                 if self.adapter.qkv_in_attention else None)
        try:
            rec.attach()
            with torch.inference_mode(), inplace_attention.recording(targets, slots):
                out = self.adapter.base()(**kwargs)
                self.forward_count += 1
                return [self._unpad(out, rec, b, mask[b], bufs[b]) for b in range(len(batch))]
        finally:
            rec.detach()

    def _padded_inputs(self, batch: list[tuple[int, ...]]):
        """``(ids [B, T], mask [B, T], kwargs)``: the batch padded to its longest text on the
        configured side (pad id: the tokenizer's, else eos, else 0), and the base model's
        keyword arguments on the device. With padding the mask and position ids from the mask
        are passed (a text keeps its own positions); without, the model's defaults."""
        B = len(batch)
        T = max(len(x) for x in batch)
        pad_id = self.tokenizer.pad_token_id
        if pad_id is None:
            pad_id = self.tokenizer.eos_token_id or 0
        ids = torch.full((B, T), pad_id, dtype=torch.long)
        mask = torch.zeros((B, T), dtype=torch.long)
        for b, x in enumerate(batch):
            n = len(x)
            sl = slice(0, n) if self.settings.padding_side == "right" else slice(T - n, T)
            ids[b, sl] = torch.tensor(x, dtype=torch.long)
            mask[b, sl] = 1
        kwargs = dict(
            input_ids=ids.to(self.device),
            output_attentions=True,
            output_hidden_states=True,
            use_cache=False,  # no key/value cache to build (a copy per layer)
        )
        if not bool(mask.all()):  # padding: mask it, positions from the mask (else the defaults)
            position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
            kwargs.update(attention_mask=mask.to(self.device),
                          position_ids=position_ids.to(self.device))
        if self.adapter.family == "bert":
            kwargs["token_type_ids"] = torch.zeros_like(ids).to(self.device)
        return ids, mask, kwargs

    def _recording_buffers(self, lengths: list[int], final_state: bool) -> list[dict]:
        """Per text of ``lengths[b]`` tokens, the empty CPU buffers its recorded tensors are
        stacked into, in the model's dtype: ``pattern [L, H, n, n]``, ``hidden_states
        [L+1, n, d_model]``, ``final_state [n, d_model]`` (None without a final LayerNorm),
        ``qkv``: one ``[L, n, width]`` per q/k/v module (one when fused), ``attn_input`` and
        ``attn_output [L, n, d_model]``.

        Allocated BEFORE the forward (so they sit apart from its transient tensors) and filled
        once it is done (a text forwarded alone: its patterns, q/k/v, attention inputs and
        outputs during it, see :class:`_Recorder`). Kept per layer, as Hugging Face returns
        them, a cached forward left ~100 small tensors between the holes of the freed transients: the heap's free memory
        grew with every cached forward (+10 MB each at T = 128) and, once trimmed, every
        forward faulted its memory in again (~15k pages). Evicting a text now frees blocks of
        exactly the sizes the next text of that length takes. Costs one copy (~38 MB at
        T = 128)."""
        L = len(self._handles)
        a = self.adapter
        dt = next(self.model.parameters()).dtype
        widths = [getattr(m, "out_features", None) or m.nf for m in self._handles[0].qkv]
        bufs = []
        for n in lengths:
            if a.qkv_in_attention:  # q [L, head, n, d_head]; k, v [L, kv_head, n, d_head]
                qkv = [torch.empty(L, hh, n, a.d_head, dtype=dt)
                       for hh in (a.n_heads, a.n_kv_heads, a.n_kv_heads)]
            else:  # the q/k/v modules' outputs [L, n, width]
                qkv = [torch.empty(L, n, w, dtype=dt) for w in widths]
            bufs.append(dict(
                pattern=torch.empty(L, a.n_heads, n, n, dtype=dt),
                hidden_states=torch.empty(L + 1, n, a.d_model, dtype=dt),
                final_state=torch.empty(n, a.d_model, dtype=dt) if final_state else None,
                qkv=qkv,
                attn_input=torch.empty(L, n, a.d_model, dtype=dt),
                attn_output=torch.empty(L, n, a.d_model, dtype=dt),
            ))
        return bufs

    def _fill(self, buf: torch.Tensor, parts) -> torch.Tensor:
        """Stack the per-layer ``parts`` into ``buf`` (a fresh tensor instead if their dtype
        or shape differs, so no value is ever cast). ``buf`` itself when every part already is
        its slice ``buf[i]`` (written there during the forward: :class:`_Recorder`, the
        in-place attention); a fresh stack when only some parts lie in ``buf``."""
        parts = [t.cpu() for t in parts] if self.device.type != "cpu" else list(parts)
        if any(t.dtype != buf.dtype or t.shape != buf.shape[1:] for t in parts):
            return torch.stack(parts)
        if all(t.data_ptr() == buf[i].data_ptr() for i, t in enumerate(parts)):
            return buf
        ptr = buf.untyped_storage().data_ptr()
        if any(t.untyped_storage().data_ptr() == ptr for t in parts):
            return torch.stack(parts)  # (a part in the buffer at another layer's place)
        return torch.stack(parts, out=buf)

    def _unpad(self, out, rec: "_Recorder", b: int, row_mask: torch.Tensor,
               buf: dict) -> ForwardTensors:
        """Text ``b`` of the batch's output ``out`` and recorded tensors ``rec``, its padding
        rows/columns dropped (``row_mask [T]``: 1 on its tokens), stacked into ``buf``
        (:meth:`_recording_buffers`); q, k, v are head-split views of the stacked q/k/v
        modules' outputs. Runs under ``torch.inference_mode``."""
        L = len(self._handles)
        fill = self._fill
        idx = row_mask.bool().nonzero().squeeze(-1).to(self.device)
        if len(idx) == row_mask.shape[0]:  # unpadded: no gathers
            def rows(x, dim):
                return x
            attn = [x[b] for x in out.attentions]
        else:
            def rows(x, dim):
                return x.index_select(dim, idx)
            attn = [x[b].index_select(-2, idx).index_select(-1, idx) for x in out.attentions]
        # the q/k/v modules' outputs, one [layer, pos, width] tensor each; q, k, v are views of
        # them split into heads (layer in the batch dimension)
        if self.adapter.qkv_in_attention:  # [batch, head | kv_head, pos, d_head] per layer
            q, k, v = (fill(qkv_buf, (rows(rec.qkv[i][j][b], 1) for i in range(L)))
                       for j, qkv_buf in enumerate(buf["qkv"]))
        else:
            raw = [fill(qkv_buf, (rows(rec.qkv[i][j][b], 0) for i in range(L)))
                   for j, qkv_buf in enumerate(buf["qkv"])]
            q, k, v = self.adapter.split_qkv(raw)  # each [layer, head, pos, d_head]
        # the L+1 residual-stream states: HF's hidden_states[0..L-1] are the embeddings and the
        # blocks' outputs; its last is ln_f's OUTPUT (GPT-2), so state L is ln_f's input, and
        # ln_f's output is kept apart
        states = list(out.hidden_states[:L])
        states.append(rec.last if rec.final_norm is not None else out.hidden_states[L])
        final = None
        if rec.final_norm is not None:
            fin = rows(out.hidden_states[L][b], 0)
            fb = buf["final_state"]
            final = (fb.copy_(fin) if fin.dtype == fb.dtype and fin.shape == fb.shape
                     else fin.cpu().clone())
        return ForwardTensors(
            fill(buf["pattern"], attn),
            fill(buf["hidden_states"], (rows(h[b], 0) for h in states)),
            q, k, v,
            fill(buf["attn_input"], (rows(x[b], 0) for x in rec.attn_in)),
            fill(buf["attn_output"], (rows(x[b], 0) for x in rec.attn_out)),
            final_state=final,
        )

    # ------------------------------------------------------------------- misc
    def model_ref(self) -> dict:
        return {"id": self.info["id"], "revision": self.info["revision"]}


_SP_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _sentencepiece_bytes(piece: str) -> bytes:
    """The bytes a SentencePiece-style token string stands for: ``<0xNN>`` (byte fallback) ->
    that byte; otherwise the text with '▁' (U+2581) as a space, in UTF-8."""
    m = _SP_BYTE.fullmatch(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    return piece.replace("\u2581", " ").encode("utf-8")


def _piece_style(tokenizer, causal: bool) -> str:
    """"plain" for encoders; for causal models "sentencepiece" when the fast tokenizer's
    decoder turns '▁' into spaces or has a byte fallback (Llama 2, Mistral, Gemma), else
    "bytelevel" (GPT-2's byte alphabet)."""
    if not causal:
        return "plain"
    try:
        state = tokenizer.backend_tokenizer.decoder.__getstate__()
        text = state.decode("utf-8") if isinstance(state, bytes) else str(state)
    except Exception:  # no backend decoder: GPT-2's convention
        return "bytelevel"
    if '"ByteLevel"' in text:
        return "bytelevel"
    if '"ByteFallback"' in text or '"Metaspace"' in text or "\u2581" in text \
            or "\\u2581" in text:  # '▁', raw or JSON-escaped
        return "sentencepiece"
    return "bytelevel"


class _Recorder:
    """The per-call hooks of one forward and what they saw: per layer the attention module's
    input ``attn_in[i]``, the q/k/v modules' outputs ``qkv[i][j]`` and the output projection's
    output ``attn_out[i]`` (each ``[batch, pos, width]``), and ``last``, the final LayerNorm's
    input (the last block's output; None without a final LayerNorm). References to the
    model's own tensors; with ``buf`` (a text forwarded alone: its
    :meth:`Runtime._recording_buffers`) each of the first three is copied into its slice of
    ``buf`` the moment the module gives it, while it is in the CPU's cache, and the forward
    goes on with that slice (the same values; the model's own tensor is freed at once): no
    stacking afterwards. :meth:`attach` registers the hooks, :meth:`detach` removes
    every one registered (also after a partial attach): nothing outlives the call."""

    def __init__(self, handles: list[LayerHandles], final_norm: torch.nn.Module | None,
                 buf: dict | None = None):
        L = len(handles)
        self.handles = handles
        self.final_norm = final_norm
        self.buf = buf
        self.attn_in: list = [None] * L
        # per layer [q, k, v] (hooked q/k/v modules' outputs; rotary families: filled by the
        # attention function, service/runtime/inplace_attention.py)
        self.qkv: list = [[None] * (len(h.qkv) or 3) for h in handles]
        self.attn_out: list = [None] * L
        self.last = None
        self._hooks: list = []

    def attach(self) -> None:
        def last_hook(module, args):
            self.last = args[0]

        buf = self.buf

        def into(x, target):  # the slice the forward goes on with, or None: left as it is
            if target is None or not isinstance(x, torch.Tensor) or x.device != target.device \
                    or x.dtype != target.dtype or x.shape != (1, *target.shape):
                return None
            target.copy_(x[0])
            return target.unsqueeze(0)

        def pre_hook(i):
            def fn(module, args, kwargs):
                x = args[0] if args else kwargs["hidden_states"]
                y = into(x, buf["attn_input"][i] if buf else None)
                self.attn_in[i] = x if y is None else y
                if y is None:
                    return None
                if args:
                    return (y, *args[1:]), kwargs
                return args, {**kwargs, "hidden_states": y}
            return fn

        def qkv_hook(i, j):
            def fn(module, args, output):
                y = into(output, buf["qkv"][j][i] if buf else None)
                self.qkv[i][j] = output if y is None else y
                return y
            return fn

        def out_hook(i):
            def fn(module, args, output):
                y = into(output, buf["attn_output"][i] if buf else None)
                self.attn_out[i] = output if y is None else y
                return y
            return fn

        hooks = self._hooks
        for i, h in enumerate(self.handles):
            hooks.append(h.attn.register_forward_pre_hook(pre_hook(i), with_kwargs=True))
            for j, m in enumerate(h.qkv):
                hooks.append(m.register_forward_hook(qkv_hook(i, j)))
            hooks.append(h.out_proj.register_forward_hook(out_hook(i)))
        if self.final_norm is not None:
            hooks.append(self.final_norm.register_forward_pre_hook(last_hook))

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
