"""The model runtime: load once, tokenize (thread-safe), one recorded forward per input.

A forward result holds, for one tokenized text of T tokens (DESIGN.md, "The runtime"):
attention patterns ``[layer, head, query_pos, key_pos]`` (post-softmax, exactly Hugging Face's
``output_attentions``), the L+1 residual-stream hidden states ``[layer+1, pos, d_model]``
(index 0 = embedding output, index i = block i-1's output; the last is the last block's output
BEFORE any final LayerNorm), the post-final-LayerNorm state ``final_state [pos, d_model]``
(GPT-2's ``ln_f`` output = Hugging Face's last ``hidden_states`` entry; None for BERT, which has
no final LayerNorm: there Hugging Face's last entry is ``hidden_states[-1]``),
q, k, v ``[layer, head, pos, d_head]``, the attention input ``[layer, pos, d_model]`` (what the
attention module received) and the attention output after the output projection
``[layer, pos, d_model]`` (before dropout and the residual add). Pre-softmax scores are
computed on demand from q and k with the model's own scaling (saving T^2 memory per layer).

Batches are padded for the device and unpadded by attention mask before anything else sees
them; position ids are derived from the mask, so left or right padding give a text's own
positions and a text's numbers never depend on its batch mates.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from attnscope.service.config import BUNDLED_MODEL_DIR, BUNDLED_MODEL_ID, Settings
from attnscope.service.errors import ContextLengthExceeded, InvalidRequest, scrub_paths
from attnscope.service.runtime.adapters import ADAPTERS, CAUSAL_TYPES, Adapter
from attnscope.service.runtime.cache import ByteLRU
from attnscope.service.runtime.memory import recorded_bytes
from attnscope.service.runtime.tokens import bytelevel_label

log = logging.getLogger("attnscope.runtime")

#: Tokenized texts kept (a text analysed by several endpoints is tokenized once; ~2 ms at 128
#: tokens). Texts longer than TOKENIZE_CACHE_MAX_CHARS are not kept.
TOKENIZE_CACHE_ENTRIES = 128
TOKENIZE_CACHE_MAX_CHARS = 20_000

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelLoadError(RuntimeError):
    """The model could not be loaded or fails the start-up probe (a start-up error)."""


@dataclass(frozen=True)
class TokenInfo:
    position: int
    id: int
    label: str
    start: int | None
    end: int | None
    special: bool

    def as_dict(self) -> dict:
        return {
            "position": self.position, "id": self.id, "label": self.label,
            "start": self.start, "end": self.end, "special": self.special,
        }


@dataclass(frozen=True)
class TokenizedText:
    text: str
    add_bos: bool
    input_ids: tuple[int, ...]
    tokens: tuple[TokenInfo, ...]

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass(eq=False)
class ForwardTensors:
    """The tensors of one forward (cached, shared read-only between requests). The runtime
    gives each as one buffer; q, k, v are head-split views of the q/k/v modules' stacked
    outputs (see ``Runtime._forward_batch``)."""

    pattern: torch.Tensor  # [layer, head, query_pos, key_pos]
    hidden_states: torch.Tensor  # [layer+1, pos, d_model]: embeddings, each block's output (pre-ln_f)
    q: torch.Tensor  # [layer, head, pos, d_head]
    k: torch.Tensor  # [layer, head, pos, d_head]
    v: torch.Tensor  # [layer, head, pos, d_head]
    attn_input: torch.Tensor  # [layer, pos, d_model]
    attn_output: torch.Tensor  # [layer, pos, d_model], after the output projection
    #: [pos, d_model]: the final LayerNorm's output (GPT-2 ln_f; = HF's last hidden_states
    #: entry); None where the model has no final LayerNorm (BERT)
    final_state: torch.Tensor | None = None

    _NAMES: ClassVar[tuple[str, ...]] = ("hidden_states", "q", "k", "v", "attn_input",
                                         "attn_output")

    def __post_init__(self):
        self.nbytes = sum(getattr(self, n).numel() * getattr(self, n).element_size()
                          for n in ("pattern", *self._NAMES))
        if self.final_state is not None:
            self.nbytes += self.final_state.numel() * self.final_state.element_size()

    @property
    def final_hidden_state(self) -> torch.Tensor:
        """``[pos, d_model]``: Hugging Face's last ``hidden_states`` entry (after GPT-2's
        ln_f; BERT's last block output)."""
        return self.final_state if self.final_state is not None else self.hidden_states[-1]

    def replace(self, **changes: torch.Tensor) -> "ForwardTensors":
        """A copy with some tensors replaced (by field name), e.g. an altered pattern."""
        return dataclasses.replace(self, **changes)


@dataclass
class ForwardResult:
    """One text's recorded forward: its tokens and its tensors (all on CPU, no autograd)."""

    tokens: TokenizedText
    tensors: ForwardTensors
    scaling: tuple[float, ...]  # per layer, the q.k multiplier the model used
    causal: bool
    cached: bool = False

    @property
    def pattern(self) -> torch.Tensor:
        return self.tensors.pattern

    @property
    def hidden_states(self) -> torch.Tensor:
        return self.tensors.hidden_states

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def mask(self) -> torch.Tensor:
        """Boolean ``[query_pos, key_pos]``: True where a key is visible to a query."""
        T = self.n_tokens
        if self.causal:
            return torch.ones(T, T, dtype=torch.bool).tril()
        return torch.ones(T, T, dtype=torch.bool)

    def scores(self, layers: list[int] | None = None) -> torch.Tensor:
        """Pre-softmax attention scores ``[layer, head, query_pos, key_pos]``.

        ``scores = (q @ k^T) * scaling`` with the model's own scaling per layer (GPT-2:
        1/sqrt(d_head), and 1/(layer+1) under ``scale_attn_by_inverse_layer_idx``), the same
        operation as Hugging Face's eager attention. Masked entries (future keys in causal
        models) are ``-inf``: softmax over a row gives the pattern.
        """
        layers = list(range(self.tensors.q.shape[0])) if layers is None else layers
        out = []
        for layer in layers:
            s = torch.matmul(self.tensors.q[layer], self.tensors.k[layer].transpose(-1, -2))
            out.append(s * self.scaling[layer])
        scores = torch.stack(out)
        if self.causal:
            scores = scores.masked_fill(~self.mask(), float("-inf"))
        return scores


def choose_device(setting: str) -> torch.device:
    """cuda, then mps, then cpu (source 001_92e9928af52718c3.txt), or the configured device."""
    if setting != "auto":
        return torch.device(setting)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


#: Files of a local checkpoint that change the numbers it serves (the revision hashes them):
#: the weights, the config (scales, activation, eps, ...), the tokenizer (ids, framing) and
#: the generation config. README, model card and other files are not hashed.
REVISION_FILES = ("*.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                  "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "vocab.json",
                  "merges.txt", "added_tokens.json")


def _weights_revision(path: Path) -> str:
    """``sha256:<12 hex>`` over every file of a local checkpoint that changes the numbers
    (:data:`REVISION_FILES`: weights, config, tokenizer files), each hashed with its name, in
    name order; ``"unknown"`` when the directory has no weights."""
    if not any(path.glob("*.safetensors")):
        return "unknown"
    files = sorted({f for pat in REVISION_FILES for f in path.glob(pat) if f.is_file()},
                   key=lambda f: f.name)
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        h.update(b"\0")
    return "sha256:" + h.hexdigest()[:12]


class Runtime:
    """Owns the model, the tokenizer and the forward cache. Not async: callers serialise
    forwards through :class:`attnscope.service.runtime.slot.DeviceSlot`."""

    def __init__(self, model, tokenizer, adapter: Adapter, info: dict, settings: Settings):
        self.model = model
        self.tokenizer = tokenizer
        self.adapter = adapter
        self.info = info
        self.settings = settings
        self.device = next(model.parameters()).device
        self._handles = adapter.layers()
        self.scaling = tuple(h.scaling for h in self._handles)
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
            "n_ctx": adapter.n_ctx,
            "vocab_size": int(model.config.vocab_size),
            "device": str(next(model.parameters()).device),
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "attn_implementation": getattr(model.config, "_attn_implementation", None) or "eager",
            "bos_token": tok.bos_token if adapter.causal else None,
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
    def tokenize(self, text: str, add_bos: bool = False, param: str = "text",
                 cached_only: bool = False) -> TokenizedText | None:
        """Tokenize ``text`` as plain text (strings that spell special tokens stay text).

        Causal models: ``add_bos`` prepends the BOS token. Encoders: the tokenizer's own
        framing ([CLS] ... [SEP]); ``add_bos`` is rejected. ``cached_only``: return None
        instead of tokenizing when the text is not in the tokenize cache (cheap enough for the
        event loop; the checks above still run).

        Raises:
            InvalidRequest: text too long in characters, or add_bos on an encoder.
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
            tokens.append(TokenInfo(i, int(tid), self._label(piece, sp), start, end, sp))
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
        (causal models) decoded to their text; WordPiece pieces as they are."""
        if special or not self.adapter.causal:
            return piece
        return bytelevel_label(piece)

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
        n_vocab = len(self.tokenizer)
        if not ids:
            raise InvalidRequest(f"{param} holds no token ids", param)
        for i, tid in enumerate(ids):
            if not 0 <= tid < n_vocab:
                raise InvalidRequest(
                    f"{param}[{i}] = {tid} is not a token id (vocabulary 0..{n_vocab - 1})", param
                )
        self._check_context(len(ids), param)
        with self._tok_lock:
            pieces = self.tokenizer.convert_ids_to_tokens(ids)
            special_ids = set(self.tokenizer.all_special_ids)
            text = self.tokenizer.decode(ids)
        tokens = tuple(
            TokenInfo(i, tid, self._label(piece, tid in special_ids), None, None, tid in special_ids)
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
        return [ForwardResult(it, t, self.scaling, self.adapter.causal, cached=True)
                for it, t in zip(items, hits)]

    def forward_many(self, items: list[TokenizedText]) -> list[ForwardResult]:
        """Recorded forwards for several tokenized texts (cache first, then padded batches).

        Blocking; call off the event loop. Thread-safe (one forward on the device at a time).
        """
        results: list[ForwardResult | None] = [None] * len(items)
        todo: dict[tuple[int, ...], list[int]] = {}
        for i, it in enumerate(items):
            hit = self.cache.get(it.input_ids)
            if hit is not None:
                results[i] = ForwardResult(it, hit, self.scaling, self.adapter.causal, cached=True)
            else:
                todo.setdefault(it.input_ids, []).append(i)
        keys = list(todo)
        bs = self.settings.forward_batch_size
        for s in range(0, len(keys), bs):
            chunk = keys[s : s + bs]
            with self._fwd_lock:
                a = self.adapter
                es = next(self.model.parameters()).element_size()
                self.cache.reserve(sum(recorded_bytes(a.n_layers, a.n_heads, a.d_model, len(k), es)
                                       for k in chunk), len(chunk))
                tensors = self._forward_batch(chunk)
            for key, t in zip(chunk, tensors):
                self.cache.put(key, t)
                for i in todo[key]:
                    results[i] = ForwardResult(items[i], t, self.scaling, self.adapter.causal)
        return results  # type: ignore[return-value]

    def _forward_batch(self, batch: list[tuple[int, ...]]) -> list[ForwardTensors]:
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

        L = len(self._handles)
        a = self.adapter
        # Each text's recorded tensors go into a few contiguous buffers allocated BEFORE the
        # forward (so they sit apart from its transient tensors) and filled once it is done.
        # Kept per layer, as Hugging Face returns them, a cached forward left ~100 small
        # tensors between the holes of the freed transients: the heap's free memory grew with
        # every cached forward (+10 MB each at T = 128) and, once trimmed, every forward faulted
        # its memory in again (~15k pages). Evicting a text now frees blocks of exactly the
        # sizes the next text of that length takes. Costs one copy (~38 MB at T = 128).
        dt = next(self.model.parameters()).dtype
        final_norm = self.adapter.final_norm()
        widths = [getattr(m, "out_features", None) or m.nf for m in self._handles[0].qkv]
        bufs = []
        for x in batch:
            n = len(x)
            bufs.append(dict(
                pattern=torch.empty(L, a.n_heads, n, n, dtype=dt),
                hidden_states=torch.empty(L + 1, n, a.d_model, dtype=dt),
                final_state=torch.empty(n, a.d_model, dtype=dt) if final_norm is not None else None,
                qkv=[torch.empty(L, n, w, dtype=dt) for w in widths],  # the q/k/v modules' outputs
                attn_input=torch.empty(L, n, a.d_model, dtype=dt),
                attn_output=torch.empty(L, n, a.d_model, dtype=dt),
            ))
        cap_in: list = [None] * L
        cap_qkv: list = [[None] * len(h.qkv) for h in self._handles]
        cap_out: list = [None] * L
        cap_last: list = [None]  # the final LayerNorm's input: the last block's output
        hooks = []

        def last_hook(module, args):
            cap_last[0] = args[0]

        def pre_hook(i):
            def fn(module, args, kwargs):
                cap_in[i] = args[0] if args else kwargs["hidden_states"]
            return fn

        def qkv_hook(i, j):
            def fn(module, args, output):
                cap_qkv[i][j] = output
            return fn

        def out_hook(i):
            def fn(module, args, output):
                cap_out[i] = output
            return fn

        def fill(buf: torch.Tensor, parts) -> torch.Tensor:
            """Stack the per-layer ``parts`` into ``buf`` (a fresh tensor instead if their dtype
            or shape differs, so no value is ever cast)."""
            parts = [t.cpu() for t in parts] if self.device.type != "cpu" else list(parts)
            if any(t.dtype != buf.dtype or t.shape != buf.shape[1:] for t in parts):
                return torch.stack(parts)
            return torch.stack(parts, out=buf)

        try:
            for i, h in enumerate(self._handles):
                hooks.append(h.attn.register_forward_pre_hook(pre_hook(i), with_kwargs=True))
                for j, m in enumerate(h.qkv):
                    hooks.append(m.register_forward_hook(qkv_hook(i, j)))
                hooks.append(h.out_proj.register_forward_hook(out_hook(i)))
            if final_norm is not None:
                hooks.append(final_norm.register_forward_pre_hook(last_hook))
            with torch.inference_mode():
                out = self.adapter.base()(**kwargs)
                self.forward_count += 1
                results = []
                for b in range(B):
                    idx = mask[b].bool().nonzero().squeeze(-1).to(self.device)
                    if len(idx) == T:  # unpadded: no gathers
                        def rows(x, dim):
                            return x
                        attn = [x[b] for x in out.attentions]
                    else:
                        def rows(x, dim):
                            return x.index_select(dim, idx)
                        attn = [x[b].index_select(-2, idx).index_select(-1, idx)
                                for x in out.attentions]
                    buf = bufs[b]
                    # the q/k/v modules' outputs, one [layer, pos, width] tensor each; q, k, v
                    # are views of them split into heads (layer in the batch dimension)
                    raw = [fill(buf["qkv"][j], (rows(cap_qkv[i][j][b], 0) for i in range(L)))
                           for j in range(len(widths))]
                    q, k, v = self.adapter.split_qkv(raw)  # each [layer, head, pos, d_head]
                    # the L+1 residual-stream states: HF's hidden_states[0..L-1] are the
                    # embeddings and the blocks' outputs; its last is ln_f's OUTPUT (GPT-2),
                    # so state L is ln_f's input, and ln_f's output is kept apart
                    states = list(out.hidden_states[:L])
                    states.append(cap_last[0] if final_norm is not None else out.hidden_states[L])
                    final = None
                    if final_norm is not None:
                        fin = rows(out.hidden_states[L][b], 0)
                        fb = buf["final_state"]
                        final = (fb.copy_(fin) if fin.dtype == fb.dtype and fin.shape == fb.shape
                                 else fin.cpu().clone())
                    results.append(ForwardTensors(
                        fill(buf["pattern"], attn),
                        fill(buf["hidden_states"], (rows(h[b], 0) for h in states)),
                        q, k, v,
                        fill(buf["attn_input"], (rows(x[b], 0) for x in cap_in)),
                        fill(buf["attn_output"], (rows(x[b], 0) for x in cap_out)),
                        final_state=final,
                    ))
        finally:
            for h in hooks:
                h.remove()
        return results

    # ------------------------------------------------------------------- misc
    def model_ref(self) -> dict:
        return {"id": self.info["id"], "revision": self.info["revision"]}


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers at all (DNS + TCP), so an offline machine falls back
    at once instead of waiting through huggingface_hub's retries."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def _load_pretrained(name: str, settings: Settings):
    """Load (model, tokenizer, identity) by hub id or local directory. Safetensors only,
    eager attention, never remote code."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    if name in ("bundled", BUNDLED_MODEL_ID):
        path, model_id = BUNDLED_MODEL_DIR, BUNDLED_MODEL_ID
        if not (path / "model.safetensors").exists():
            raise ModelLoadError(
                f"bundled checkpoint missing at {path}: run training/train_bundled_gpt2.py"
            )
    else:
        path, model_id = Path(name).expanduser(), name
    local = path.is_dir()
    source = str(path) if local else name
    kw: dict = {"trust_remote_code": False}
    if not local:
        kw["revision"] = settings.revision
        os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "5")
        os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "10")
    elif name not in ("bundled", BUNDLED_MODEL_ID):
        # the directory's name (not its full path); a generic name keeps its parent's
        resolved = path.resolve()
        model_id = resolved.name
        if model_id in ("model", "models", "checkpoint", "snapshot") and resolved.parent.name:
            model_id = f"{resolved.parent.name}/{model_id}"
    try:
        try:
            config = AutoConfig.from_pretrained(source, local_files_only=True, **kw)
        except Exception as exc:
            if local:
                raise
            if not _hub_reachable():
                raise ModelLoadError(
                    f"could not load model {name!r}: not in the local Hugging Face cache and the "
                    "hub is unreachable (offline)"
                ) from exc
            config = AutoConfig.from_pretrained(source, **kw)
        if config.model_type not in ADAPTERS:
            raise ModelLoadError(
                f"model {name!r} has model_type {config.model_type!r}; supported: "
                f"{sorted(ADAPTERS)}"
            )
        cls = AutoModelForCausalLM if config.model_type in CAUSAL_TYPES else AutoModel
        common = dict(kw, attn_implementation="eager", use_safetensors=True,
                      dtype=DTYPES[settings.dtype])
        try:
            model = cls.from_pretrained(source, local_files_only=True, **common)
            tok = AutoTokenizer.from_pretrained(source, local_files_only=True, **kw)
        except Exception:
            if local:
                raise
            model = cls.from_pretrained(source, **common)
            tok = AutoTokenizer.from_pretrained(source, **kw)
    except ModelLoadError:
        raise
    except Exception as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"could not load model {name!r}: {type(exc).__name__}: {msg}") from exc
    if not getattr(tok, "is_fast", False):
        raise ModelLoadError(f"model {name!r}: a fast tokenizer is required (character offsets)")
    device = choose_device(settings.device)
    model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    revision = getattr(config, "_commit_hash", None) if not local else None
    if not revision:
        revision = _weights_revision(path) if local else "unknown"
    return model, tok, {"id": model_id, "revision": revision}
