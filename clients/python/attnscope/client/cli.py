"""The ``attnscope`` command line: the client's subcommands, and ``serve`` for the service.

    attnscope model                                   # the resident model
    attnscope attention "Then I tried" --layers 0 --head-mean [--plot attn.png]
    attnscope links "Then I tried to find"            # query --> key  weight
    attnscope heads "..." ; attnscope trajectories "..." --plot paths.png ; attnscope verify "..."
    attnscope predict "The cat sat on the"            # top-k next tokens, loss, rank, entropy
    attnscope ablate "..." --heads 1:0,1:1 ; attnscope ablate "..." --scan --plot grid.png
    attnscope patch "clean ..." "corrupted ..." --target " m" --distractor " r"
    attnscope logit-lens "The cat sat on the" --positions -2,-1   # top token per layer, position
    attnscope logit-attribution "..." --target " mat" --distractor " dog"   # per head and MLP
    attnscope circuits [--top 10]                     # copying scores, strongest compositions
    attnscope path-patch "clean ..." "corrupted ..." --senders 0:1 --receivers 1:k [--grid]
    attnscope batch in.jsonl -o out.jsonl -a attention -a trajectories
    attnscope serve --model bundled --port 8000       # needs the service installed

Server: ``--url`` or ``ATTNSCOPE_BASE_URL`` (the client's variable too; ``ATTNSCOPE_URL`` is
a deprecated alias), default ``http://127.0.0.1:8000``; API key ``--api-key`` or
``ATTNSCOPE_API_KEY``. TEXT ``-`` reads standard input. ``--json`` prints the response as
JSON; ``-o``/``--output FILE`` writes it to FILE (in every command, ``batch`` included);
``--option key=JSON`` passes any request option (e.g. ``--option 'layers=[0,1]'``).

``serve`` runs the service's own command line (``python -m attnscope.service.cli``) in place of
this process: the client never imports the service, so it installs and runs without torch.

Exit codes: 0 success; 1 the service answered with an error (the envelope's type and
message are printed); 2 usage error (bad arguments or options, checked before sending);
3 connection failure or timeout (the service could not be reached); 4 the work ran but
its result is negative (``verify`` did not pass; ``batch`` recorded failed items).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

import pydantic

EXIT_OK, EXIT_SERVER, EXIT_USAGE, EXIT_CONNECTION, EXIT_NEGATIVE = 0, 1, 2, 3, 4
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as shells report it
URL_ENV = "ATTNSCOPE_BASE_URL"  # the one variable, shared with the Python client


class UsageError(Exception):
    """Bad command-line input (exit 2)."""


def _warn(msg: str) -> None:
    print(f"attnscope: warning: {msg}", file=sys.stderr)


def default_url() -> str:
    """``ATTNSCOPE_BASE_URL`` (``ATTNSCOPE_URL`` accepted with a warning), else the default."""
    from ._client import DEFAULT_BASE_URL, resolve_base_url

    return resolve_base_url(None, warn=_warn) or DEFAULT_BASE_URL


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("connection")
    g.add_argument("--url", default=None,
                   help=f"service URL (env {URL_ENV}; default http://127.0.0.1:8000)")
    g.add_argument("--api-key", default=None, help="API key (env ATTNSCOPE_API_KEY)")
    g.add_argument("--timeout", type=float, default=60.0, help="seconds per request (60)")
    g.add_argument("--max-retries", type=int, default=2, help="retries on transient errors (2)")
    p.add_argument("--json", action="store_true", help="print the response as JSON")


def _output_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", metavar="FILE", default=None,
                   help="also write the response as JSON to FILE")


def _text_args(p: argparse.ArgumentParser, plot: bool = True) -> None:
    p.add_argument("text", nargs="?", default=None,
                   help="the text to analyse ('-' = standard input); or --tokens")
    p.add_argument("--tokens", type=_ints, default=None, metavar="ID,ID,...",
                   help="token ids instead of TEXT, used exactly as given (no BOS added), "
                        "e.g. --tokens 50256,464,3797")
    p.add_argument("--add-bos", action=argparse.BooleanOptionalAction, default=None,
                   help="texts: prepend the BOS token (default: the model's convention, BOS "
                        "for GPT-2; --no-add-bos = the text's own tokens)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=JSON",
                   help="any request option, value as JSON (e.g. --option 'layers=[0]'); "
                        "repeatable")
    _output_arg(p)
    if plot:
        p.add_argument("--plot", metavar="FILE", default=None,
                       help="save the figure to FILE (.png/.svg/.pdf; needs matplotlib)")


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}")


def _heads(s: str) -> list[list[int]]:
    try:
        out = []
        for part in s.replace(" ", "").split(","):
            if part:
                layer, head = part.split(":")
                out.append([int(layer), int(head)])
        return out
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LAYER:HEAD pairs, comma-separated, got {s!r}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="attnscope",
        description="attnscope: attention as a service. Client commands talk to a running "
                    "service; 'serve' starts one.",
        epilog="exit codes: 0 ok, 1 server error, 2 usage error, 3 connection failure, "
               "4 negative result (verify failed / batch items failed)",
    )
    # the connection flags also before the command (attnscope --url URL model), as after it
    ap.add_argument("--url", dest="global_url", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--api-key", dest="global_api_key", default=None, help=argparse.SUPPRESS)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    sub.add_parser("serve", help="start the HTTP service (attnscope serve --help)", add_help=False)

    p = sub.add_parser("model", help="the resident model")
    _common(p)
    _output_arg(p)

    p = sub.add_parser("tokenize", help="tokens as the analyses see them")
    _common(p)
    _text_args(p, plot=False)

    p = sub.add_parser("attention", help="attention patterns (matrix per layer/head)")
    _common(p)
    _text_args(p)
    p.add_argument("--layers", type=_ints, help="layer indices, e.g. 0,1 (default all)")
    p.add_argument("--heads", type=_ints, help="head indices (default all)")
    p.add_argument("--head-mean", action="store_true", default=None, help="average the heads")
    p.add_argument("--scores", action="store_true", help="also return pre-softmax scores")
    p.add_argument("--round", type=int, default=None, help="decimals in JSON")
    p.add_argument("--kind", choices=["heatmap", "layers", "heads"], default="heatmap",
                   help="figure for --plot: one heat map (--layer/--head), the layer grid, or "
                        "the head grid of --layer")
    p.add_argument("--layer", type=int, default=None, help="layer of the heat map / head grid")
    p.add_argument("--head", type=int, default=None, help="head of the heat map (default mean)")

    p = sub.add_parser("trajectories", help="hidden-state paths in PCA space, distances")
    _common(p)
    _text_args(p)
    p.add_argument("--positions", type=_ints, help="token positions (default all)")
    p.add_argument("--include-final", action="store_true", default=None,
                   help="keep the final hidden state")
    p.add_argument("--kind", choices=["paths", "distances"], default="paths",
                   help="figure for --plot")

    p = sub.add_parser("verify", help="attention recomputed from scratch vs the model's")
    _common(p)
    _text_args(p, plot=False)
    p.add_argument("--layers", type=_ints, help="layer indices (default all)")
    p.add_argument("--tolerance", type=float, default=None, help="largest difference that passes")
    p.add_argument("--mode", choices=["from_scratch", "recorded_qkv"], default=None,
                   help="from_scratch (default): the whole forward in float64 from the weights; "
                   "recorded_qkv: the attention step from the recorded q/k/v")
    p.add_argument("--projections", action="store_true", default=None,
                   help="recorded_qkv (implied): also recompute q/k/v from the attention input")

    p = sub.add_parser("heads", help="classify every head (previous-token, induction, sink, ...)")
    _common(p)
    _text_args(p)
    p.add_argument("--exclude-bos", action="store_true", default=None,
                   help="zero attention to position 0 before scoring")
    p.add_argument("--no-probe", action="store_true", help="skip the induction probe")

    p = sub.add_parser("links", help="each token's strongest earlier token: query --> key  weight")
    _common(p)
    _text_args(p, plot=False)
    p.add_argument("--layer", type=int, default=0, help="layer (default 0)")
    p.add_argument("--head", type=int, default=None, help="head (default: mean of the heads)")
    p.add_argument("--top-k", type=int, default=None, help="links per query (1)")
    p.add_argument("--include-self", action="store_true", help="allow a token to link to itself")
    p.add_argument("--ignore", type=_ints, default=None,
                   help="key positions never chosen, e.g. 0 for the first-token sink")

    p = sub.add_parser("predict", help="next-token predictions: top-k, loss, rank, entropy")
    _common(p)
    _text_args(p, plot=False)
    p.add_argument("--top-k", type=int, default=None, help="next tokens per position (5)")
    p.add_argument("--positions", type=_ints, default=None, help="positions to report (all)")

    p = sub.add_parser("ablate", help="ablate heads (or --scan every head) and see what changes")
    _common(p)
    _text_args(p)
    p.add_argument("--heads", type=_heads, default=None,
                   help="heads to ablate together as LAYER:HEAD, comma-separated (e.g. 1:0,1:1)")
    p.add_argument("--method", choices=["zero", "mean", "resample"], default=None,
                   help="zero (default) / mean / resample")
    p.add_argument("--resample-text", default=None, help="method resample: the other text")
    p.add_argument("--positions", type=_ints, default=None, help="positions to report/score")
    p.add_argument("--top-k", type=int, default=None, help="top next tokens before/after (5)")
    p.add_argument("--target", default=None, help="logit difference: target token")
    p.add_argument("--distractor", default=None, help="logit difference: distractor token")
    p.add_argument("--mlp", type=_ints, default=None,
                   help="whole MLP layers to ablate (hook_mlp_out), e.g. 0,1")
    p.add_argument("--attn", type=_ints, default=None,
                   help="whole attention layers to ablate (hook_attn_out), e.g. 1")
    p.add_argument("--neurons", type=_heads, default=None,
                   help="MLP neurons (mlp.hook_post) as LAYER:NEURON, comma-separated (0:17,1:3)")
    p.add_argument("--scan", action="store_true", default=None, help="every head alone: effect grid")
    p.add_argument("--metric", choices=["loss", "kl", "logit_diff"], default=None,
                   help="scan metric (loss)")
    _dataset_arg(p, "texts: one a line, a JSON string, a list of token ids or {\"text\": ...} "
                 "/ {\"tokens\": [...]} (\"id\" ignored); method mean then takes its means "
                 "over the whole dataset")

    p = sub.add_parser("patch", help="activation patching clean -> corrupted: [layer, head] grid")
    _common(p)
    p.add_argument("clean_text", nargs="?", default=None, help="the clean prompt (or --dataset)")
    p.add_argument("corrupted_text", nargs="?", default=None,
                   help="the corrupted prompt (same token count)")
    _dataset_arg(p, "pairs: one a line, {\"clean_text\", \"corrupted_text\"} (or "
                 "clean_tokens / corrupted_tokens, or \"clean\"/\"corrupted\" as text or ids, "
                 "or a [clean, corrupted] list; optional \"metric\", \"id\" ignored)")
    p.add_argument("--add-bos", action=argparse.BooleanOptionalAction, default=None,
                   help="prepend the BOS token (default: the model's convention)")
    p.add_argument("--target", default=None, help="logit difference: target token")
    p.add_argument("--distractor", default=None, help="logit difference: distractor token")
    p.add_argument("--metric", choices=["logit_diff", "loss"], default=None, help="(logit_diff)")
    p.add_argument("--method", choices=["exact", "attribution"], default=None, help="(exact)")
    p.add_argument("--residual", action="store_true", default=None, help="also [layer, pos]")
    p.add_argument("--hook", choices=["z", "q", "k", "v", "pattern", "resid_pre", "resid_mid",
                                      "resid_post", "attn_out", "mlp_out"], default=None,
                   help="patch at this hook instead (TL get_act_patch_* grid)")
    p.add_argument("--by-position", action="store_true", default=None,
                   help="--hook z/q/k/v/pattern: one (position, head) cell at a time")
    p.add_argument("--patch-layers", type=_ints, default=None, help="--hook: layers computed")
    p.add_argument("--patch-heads", type=_ints, default=None, help="--hook: heads computed")
    p.add_argument("--patch-positions", type=_ints, default=None,
                   help="--hook: positions computed (all-position head patches: patched together)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=JSON",
                   help="any request option, value as JSON; repeatable")
    _output_arg(p)
    p.add_argument("--plot", metavar="FILE", default=None, help="save the effect grid figure")
    _progress_arg(p)
    p = sub.add_parser("norms", help="contribution norms ||alpha f(x)|| (Kobayashi et al. 2020)")
    _common(p)
    _text_args(p)
    p.add_argument("--layers", type=_ints, help="layer indices (default all)")
    p.add_argument("--heads", type=_ints, help="head indices (default all)")
    p.add_argument("--round", type=int, default=None, help="decimals in JSON")
    p.add_argument("--layer", type=int, default=None, help="layer printed / plotted (default: first)")
    p.add_argument("--head", type=int, default=None,
                   help="head printed / plotted (default: the sum over heads)")

    p = sub.add_parser("rollout", help="attention rollout / flow over layers (Abnar & Zuidema 2020)")
    _common(p)
    _text_args(p)
    p.add_argument("--fusion", choices=["mean", "max", "min"], default=None, help="head fusion (mean)")
    p.add_argument("--residual", type=float, default=None, help="residual weight (0.5)")
    p.add_argument("--discard", type=float, default=None, help="fraction of weights to drop, [0, 1)")
    p.add_argument("--drop-sink", action="store_true", help="drop the first token as a key")
    p.add_argument("--flow", action="store_true", help="also compute attention flow (<= 16 tokens)")
    p.add_argument("--round", type=int, default=None, help="decimals in JSON")

    _why_parsers(sub)

    from . import batch as _batch

    p = sub.add_parser("run", help="one hooked forward: cache activations by TransformerLens "
                       "hook name, interventions, metrics (POST /v1/run)")
    _common(p)
    p.add_argument("texts", nargs="*", help="prompts as texts (same token count), or none "
                   "with --tokens / --request")
    p.add_argument("--tokens", action="append", type=_ints, default=None, metavar="IDS",
                   help="a prompt as comma-separated token ids (repeatable)")
    p.add_argument("--cache", action="append", default=None, metavar="HOOK",
                   help="a hook name or pattern to return, e.g. 'blocks.*.hook_resid_post' "
                        "(repeatable)")
    p.add_argument("--request", metavar="FILE", default=None,
                   help="the whole request as JSON (file, or - for stdin): interventions, "
                        "metrics, grad, logits; the flags above add to it")
    p.add_argument("--add-bos", action=argparse.BooleanOptionalAction, default=None,
                   help="texts: prepend BOS (default: the model's convention)")
    p.add_argument("--save", metavar="FILE.safetensors", default=None,
                   help="write the cached activations (and grads as grad.<hook>) to a "
                        "safetensors file, by hook name")
    p.add_argument("--hooks", action="store_true", help="list the model's hook points and exit")

    p = sub.add_parser("batch", help="run analyses over a JSONL corpus (resumable)",
                       description=_batch.__doc__.replace("``", "'"),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(p)
    _batch.add_arguments(p)
    return ap


# -- helpers -------------------------------------------------------------------------------

def _read_text(s: str | None) -> str | None:
    """TEXT ('-' = standard input); None where --tokens gives the input instead."""
    return sys.stdin.read() if s == "-" else s


#: request fields a command takes as its positional arguments (and their names in --help)
_POSITIONAL = {
    "ablate": {"text": "the TEXT argument", "heads": "--heads"},
    "patch": {"clean_text": "the CLEAN_TEXT argument",
              "corrupted_text": "the CORRUPTED_TEXT argument"},
    **{c: {"text": "the TEXT argument", "texts": "one TEXT per command (or attnscope batch)"}
       for c in ("tokenize", "attention", "trajectories", "verify", "heads", "links", "predict",
                 "norms", "rollout", "logit-lens", "logit-attribution")},
    "path-patch": {"pairs": "--request FILE (a dataset) or CLEAN_TEXT CORRUPTED_TEXT",
                   "senders": "--senders", "receivers": "--receivers", "metric": "--metric"},
}


def _parse_option(item: str) -> tuple[str, Any]:
    """``--option KEY=JSON`` as ``(key, value)``: the JSON value, else the bare string. Raises
    UsageError without ``=`` or key, and for a value meant as JSON (``[``, ``{``, ``"``) that
    does not parse."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise UsageError(f"--option expects KEY=JSON, got {item!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError as exc:
        if raw.lstrip()[:1] in ("[", "{", '"'):  # meant as JSON: say where it breaks
            raise UsageError(f"--option {key}={raw}: not valid JSON ({exc.msg} at "
                             f"character {exc.pos})")
        return key, raw  # a bare string


def _option_value(args, key: str) -> Any:
    """The value ``--option KEY=...`` gives ``key`` (the last one), or None."""
    val = None
    for item in getattr(args, "option", []) or []:
        k, v = _parse_option(item)
        if k == key:
            val = v
    return val


def _options(args, names: dict[str, str]) -> dict[str, Any]:
    """Request options from dedicated flags (``names``: attr -> field) and ``-o key=JSON``."""
    out: dict[str, Any] = {}
    for attr, field in names.items():
        v = getattr(args, attr, None)
        if v is not None and v is not False:
            out[field] = v
    if getattr(args, "add_bos", None) is not None:
        out["add_bos"] = args.add_bos
    if getattr(args, "tokens", None) is not None:
        out["tokens"] = args.tokens
    for item in getattr(args, "option", []) or []:  # (checked by _check_args before this)
        key, value = _parse_option(item)
        out[key] = value
    return out


def _client(args):
    from . import Client

    return Client(args.url or default_url(), api_key=args.api_key, timeout=args.timeout,
                  max_retries=args.max_retries)


def _dump(model) -> str:
    return (model.model_dump_json(indent=None) if hasattr(model, "model_dump_json")
            else json.dumps(model))


def _print_json(model) -> None:
    print(_dump(model))


def _write_output(args, model) -> None:
    """``-o FILE``: the response as JSON in FILE (the same text ``--json`` prints)."""
    path = getattr(args, "output", None)
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(_dump(model) + "\n")
    except OSError as exc:
        raise UsageError(f"cannot write --output {path}: {exc.strerror or exc}")
    print(f"response saved to {path}", file=sys.stderr)


_OLD_OPTION = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def _check_args(args) -> None:
    """Usage errors found before anything is sent (exit 2 with a message naming the flags)."""
    out = getattr(args, "output", None)
    if args.cmd != "batch" and out and _OLD_OPTION.match(out):
        raise UsageError(f"-o is --output FILE (the response as JSON); request options are "
                         f"--option KEY=JSON: use --option {out!r}")
    if args.cmd == "attention":
        if args.layer is not None or args.head is not None or args.kind != "heatmap":
            if not args.plot:
                raise UsageError("--layer, --head and --kind choose the figure and need "
                                 "--plot FILE; to choose what is computed use --layers/--heads")
        if args.layers is not None and args.layer is not None and args.layer not in args.layers:
            raise UsageError(f"--layer {args.layer} is not among --layers "
                             f"{','.join(map(str, args.layers))}: the figure can only show a "
                             "requested layer")
        if args.heads is not None and args.head is not None and args.head not in args.heads:
            raise UsageError(f"--head {args.head} is not among --heads "
                             f"{','.join(map(str, args.heads))}: the figure can only show a "
                             "requested head")
        if args.head_mean and (args.head is not None or args.kind == "heads"):
            raise UsageError("--head-mean averages the heads away: a figure of one head "
                             "(--head, --kind heads) needs a request without --head-mean")
    if args.cmd == "trajectories" and args.kind != "paths" and not args.plot:
        raise UsageError("--kind chooses the figure and needs --plot FILE")
    if args.cmd != "batch" and getattr(args, "output", None) == "-":
        raise UsageError("--output - : to print the response on standard output use --json")
    for flag in ("plot", "output"):  # a file the answer is written to: its folder must exist
        path = getattr(args, flag, None)
        if path and args.cmd != "batch":
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder):
                raise UsageError(f"--{flag} {path}: the folder {folder} does not exist")
    for item in getattr(args, "option", []) or []:  # fields the command's own arguments give
        key = item.partition("=")[0]
        if key in _POSITIONAL.get(args.cmd, {}):
            raise UsageError(f"--option {key}: give it as {_POSITIONAL[args.cmd][key]}, not "
                             "through --option")
    if args.cmd == "ablate":
        if not args.scan and args.heads is None and not _option_value(args, "scan") and not (
                args.mlp or args.attn or args.neurons or _option_value(args, "components")):
            raise UsageError("give --heads L:H[,L:H ...] (the heads ablated together), --mlp / "
                             "--attn / --neurons, or --scan (every head alone)")
        if args.plot and not args.scan and not _option_value(args, "scan"):
            raise UsageError("--plot draws the scan's effect grid: add --scan")
    if args.cmd in ("patch", "ablate") and getattr(args, "dataset", None) is not None:
        one = ("the CLEAN_TEXT CORRUPTED_TEXT arguments" if args.cmd == "patch" else
               "TEXT / --tokens")
        if (args.cmd == "patch" and (args.clean_text is not None
                                     or args.corrupted_text is not None)) or (
                args.cmd == "ablate" and (args.text is not None or args.tokens is not None)):
            raise UsageError(f"--dataset {args.dataset}: the prompts are given twice (also as "
                             f"{one}); give one or the other")
        if args.plot:
            raise UsageError("--plot draws one request's grid; with --dataset save the "
                             "response with --output and plot its mean grid")
    elif args.cmd == "patch" and (args.clean_text is None or args.corrupted_text is None):
        raise UsageError("give CLEAN_TEXT and CORRUPTED_TEXT (same token count), or --dataset "
                         "FILE of pairs")
    if args.cmd == "patch":
        given = {o.partition("=")[0] for o in args.option or []}
        metric = args.metric or _option_value(args, "metric") or "logit_diff"
        if metric == "logit_diff" and args.target is None \
                and args.distractor is None and "logit_diff" not in given:
            raise UsageError("the logit_diff metric (the default) needs --target and "
                             "--distractor (one token each, e.g. ' Mary' ' John'), or give "
                             "--metric loss")


def _check_in(value, present: list[int], what: str, flag: str) -> None:
    if value is not None and value not in present:
        raise UsageError(f"{flag} {value}: the response holds {what}s "
                         f"{', '.join(map(str, present))} (the model's, or those requested)")


def _save(fig, path: str) -> None:
    fig.savefig(path, dpi=110)
    print(f"figure saved to {path}", file=sys.stderr)


def _plots():
    try:
        from . import plots
    except ImportError as exc:
        raise UsageError(f"--plot needs matplotlib ({exc}); pip install matplotlib (the 'plot' extra of attnscope or attnscope-client)")
    return plots


def _label(t) -> str:
    return repr(t.label)


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    lines = [fmt.format(*header), fmt.format(*["-" * w for w in widths])]
    lines += [fmt.format(*[str(x) for x in r]) for r in rows]
    return "\n".join(x.rstrip() for x in lines)


# -- commands ------------------------------------------------------------------------------

def cmd_model(args) -> int:
    with _client(args) as c:
        info = c.model()
    _write_output(args, info)
    if args.json:
        _print_json(info)
        return EXIT_OK
    rows = {k: v for k, v in info.model_dump().items() if v is not None}
    w = max(map(len, rows), default=0)
    for k, v in rows.items():
        print(f"{k:<{w}}  {v}")
    return EXIT_OK


def cmd_tokenize(args) -> int:
    with _client(args) as c:
        res = c.tokenize(_read_text(args.text), **_options(args, {}))
    _write_output(args, res)
    if args.json:
        _print_json(res)
        return EXIT_OK
    rows = [[t.position, t.id, _label(t), "" if t.start is None else f"{t.start}-{t.end}",
             "yes" if t.special else ""] for t in res.tokens.tokens]
    print(_table(rows, ["pos", "id", "label", "chars", "special"]))
    return EXIT_OK


def _matrix(m, labels: list[str], causal: bool) -> str:
    """The matrix with row labels, 2 decimals; a causal model's masked cells left blank."""
    w = max(len(x) for x in labels)
    head = " " * (w + 1) + " ".join(f"{j:>5}" for j in range(m.shape[1]))
    lines = [head]
    for i, row in enumerate(m):
        cells = ["     " if (causal and j > i) else f"{v:5.2f}"
                 for j, v in enumerate(row)]
        lines.append((f"{labels[i]:>{w}} " + " ".join(cells)).rstrip())
    return "\n".join(lines)


def cmd_attention(args) -> int:
    opts = _options(args, {"layers": "layers", "heads": "heads", "head_mean": "head_mean",
                           "scores": "include_scores", "round": "round"})
    with _client(args) as c:
        res = c.attention(_read_text(args.text), **opts)
    r = res.attention
    _write_output(args, res)
    if args.plot:  # the figure's layer/head must be in the response: say so before printing
        _check_in(args.layer, list(r.layers), "layer", "--layer")
        if not r.head_mean:
            _check_in(args.head, list(r.heads), "head", "--head")
    if args.json:
        _print_json(res)
    else:
        import numpy as np

        p = r.pattern.numpy()
        labels = [f"{t.position}:{_label(t)}" for t in r.tokens]
        causal = bool(p.shape[-1] > 1 and np.all(np.triu(p, 1) == 0))
        print(f"model {res.model.id}  tokens {len(r.tokens)}  pattern {list(p.shape)} "
              f"[layer, {'' if r.head_mean else 'head, '}query_pos, key_pos]")
        for li, layer in enumerate(r.layers):
            if r.head_mean:
                print(f"\nlayer {layer}, mean of heads {r.heads}")
                print(_matrix(p[li], labels, causal))
            else:
                for hi, head in enumerate(r.heads):
                    print(f"\nlayer {layer}, head {head}")
                    print(_matrix(p[li, hi], labels, causal))
    if args.plot:
        plots = _plots()
        if args.kind == "layers":
            fig = plots.layer_grid(res, head=args.head)
        elif args.kind == "heads":
            fig = plots.head_grid(res, layer=args.layer)
        else:
            fig = plots.attention_heatmap(res, layer=args.layer, head=args.head)
        _save(fig, args.plot)
    return EXIT_OK


def cmd_trajectories(args) -> int:
    opts = _options(args, {"positions": "positions", "include_final": "include_final"})
    with _client(args) as c:
        res = c.trajectories(_read_text(args.text), **opts)
    r = res.trajectories
    _write_output(args, res)
    if args.json:
        _print_json(res)
    else:
        ev = ", ".join(f"{x:.3f}" for x in r.explained_variance_ratio)
        print(f"model {res.model.id}  states {r.states}  explained variance ratio [{ev}]")
        rows = []
        for k, pos in enumerate(r.positions):
            cos = r.cosine_first_last[k]
            rows.append([pos, _label(r.tokens[pos]), f"{r.distance_projected[k]:.3f}",
                         f"{r.distance_full[k]:.3f}", "" if cos is None else f"{cos:.3f}"])
        print(_table(rows, ["pos", "token", "moved (PCA)", "moved (full)", "cos(first,last)"]))
    if args.plot:
        plots = _plots()
        fig = plots.distance_bars(res) if args.kind == "distances" else plots.trajectory_plot(res)
        _save(fig, args.plot)
    return EXIT_OK


def cmd_verify(args) -> int:
    opts = _options(args, {"layers": "layers", "tolerance": "tolerance",
                           "projections": "projections", "mode": "mode"})
    if opts.get("projections"):  # the q/k/v projections are a check of mode recorded_qkv
        opts.setdefault("mode", "recorded_qkv")
    with _client(args) as c:
        res = c.verify(_read_text(args.text), **opts)
    v = res.verification
    _write_output(args, res)
    if args.json:
        _print_json(res)
    else:
        qkv = bool(getattr(v, "projections", False))
        rows = [[l.layer, _fmt(l.pattern_max_abs_diff), _fmt(l.output_max_abs_diff),
                 *([_fmt(l.qkv_max_abs_diff)] if qkv else []),
                 "pass" if l.passed else "FAIL"] for l in v.layers]
        print(_table(rows, ["layer", "pattern max|diff|", "output max|diff|",
                            *(["q/k/v max|diff|"] if qkv else []), "result"]))
        print(_verdict(v))
    return EXIT_OK if v.passed else EXIT_NEGATIVE


def _verdict(v) -> str:
    """``PASSED: <the server's message>`` / ``FAILED: ...``, the message's own leading
    verdict word dropped (no "PASSED: passed"); without a message, the max difference and the
    tolerance."""
    word = "PASSED" if v.passed else "FAILED"
    msg = (getattr(v, "message", "") or "").strip()
    msg = re.sub(r"^(passed|failed|pass|fail|ok)\b[.:;,]?\s*", "", msg, flags=re.I)
    if msg:
        return f"{word}: {msg}"
    mx, tol = getattr(v, "max_abs_diff", None), getattr(v, "tolerance", None)
    if tol is None:
        return word
    return f"{word}: max |diff| {_fmt(mx)} {'<=' if v.passed else '>'} tolerance {_fmt(tol)}"


def cmd_heads(args) -> int:
    opts = _options(args, {"exclude_bos": "exclude_bos"})
    if args.no_probe:
        opts["probe"] = {"enabled": False}
    with _client(args) as c:
        res = c.heads(_read_text(args.text), **opts)
    _write_output(args, res)
    if args.json:
        _print_json(res)
    else:
        cols = ["previous_token", "duplicate_token", "induction", "induction_probe", "self",
                "sink", "entropy_normalized"]
        rows = []
        for h in res.heads:
            sc = h.scores.model_dump()
            rows.append([h.layer, h.head, h.label] + [_fmt(sc.get(k), blank=True) for k in cols])
        print(f"model {res.model.id}  texts {res.n_texts}  tokens {res.n_tokens}")
        print(_table(rows, ["layer", "head", "label", "prev", "dup", "induct", "probe", "self",
                            "sink", "entropy_norm"]))
    if args.plot:
        _save(_plots().head_classification_grid(res), args.plot)
    return EXIT_OK


def cmd_links(args) -> int:
    opts = _options(args, {"head": "head", "top_k": "top_k", "ignore": "ignore"})
    if args.include_self:
        opts["exclude_self"] = False
    with _client(args) as c:
        res = c.links(_read_text(args.text), layer=args.layer, **opts)
    _write_output(args, res)
    if args.json:
        _print_json(res)
        return EXIT_OK
    r = res.links
    where = f"layer {res.layer}, " + ("head mean" if res.head is None else f"head {res.head}")
    print(f"model {res.model.id}  {where}")
    lines = []
    for q in r.links:
        for t in q.links:
            lines.append((f"{q.query_pos}:{q.query!r}", f"{t.key_pos}:{t.key!r}", t.weight))
    w = max((len(a) for a, _, _ in lines), default=0)
    wk = max((len(b) for _, b, _ in lines), default=0)
    for a, b, wt in lines:
        print(f"{a:>{w}} --> {b:<{wk}}  {wt:.3f}")
    if r.skipped:
        print(f"(no eligible key: positions {r.skipped})")
    return EXIT_OK


def _ld(args) -> dict | None:
    if args.target is None and args.distractor is None:
        return None
    if args.target is None or args.distractor is None:
        raise UsageError("--target and --distractor go together")
    return {"target": args.target, "distractor": args.distractor}


def _grid_table(grid, fmt="{:+.3f}") -> str:
    rows = [[layer] + ["" if v is None else fmt.format(v) for v in row] for layer, row in enumerate(grid)]
    return _table(rows, ["layer"] + [f"H{h}" for h in range(len(grid[0]) if grid else 0)])


def cmd_predict(args) -> int:
    opts = _options(args, {"top_k": "top_k", "positions": "positions"})
    with _client(args) as c:
        res = c.predictions(_read_text(args.text), **opts)
    _write_output(args, res)
    if args.json:
        _print_json(res)
        return EXIT_OK
    r = res.predictions
    rows = []
    for p in r.positions:
        top = " ".join(f"{t.label!r}:{t.prob:.2f}" for t in p.top)
        rows.append([p.position, repr(p.token), "" if p.next_token is None else repr(p.next_token.label),
                     _fmt(p.loss, blank=True), "" if p.next_rank is None else p.next_rank,
                     _fmt(p.entropy), top])
    print(f"model {res.model.id}  mean loss {_fmt(r.mean_loss)} nats over {r.n_loss_tokens} tokens")
    print(_table(rows, ["pos", "token", "next", "loss", "rank", "entropy", "top (prob)"]))
    return EXIT_OK


def cmd_ablate(args) -> int:
    opts = _options(args, {"method": "method", "resample_text": "resample_text",
                           "positions": "positions", "top_k": "top_k", "scan": "scan",
                           "metric": "scan_metric"})
    if _ld(args):
        opts["logit_diff"] = _ld(args)
    comps = ([{"kind": "mlp", "layer": lyr} for lyr in args.mlp or []]
             + [{"kind": "attn", "layer": lyr} for lyr in args.attn or []])
    by_layer: dict[int, list[int]] = {}
    for lyr, n in args.neurons or []:
        by_layer.setdefault(lyr, []).append(n)
    comps += [{"kind": "neuron", "layer": lyr, "neurons": ns} for lyr, ns in by_layer.items()]
    if comps:
        opts["components"] = opts.get("components", []) + comps
    text = _read_text(args.text)
    if args.dataset is not None:
        field, items = _read_dataset(args.dataset, "ablate")
        opts[field] = items
        text = None
    with _client(args) as c:
        res = c.ablate(text, heads=args.heads, **opts)
    _write_output(args, res)
    if args.json:
        _print_json(res)
    elif getattr(res, "dataset", None) is not None and res.scan is None:
        heads = ", ".join(f"L{l}H{h}" for l, h in res.heads or [])
        if res.components:
            heads = ", ".join(_component_label(c) for c in res.components)
        ds = res.dataset
        print(f"model {res.model.id}  ablated {heads} ({res.method})  over {ds.n_texts} texts"
              + (f"  (means over the {ds.mean_over.replace('_', ' ')})" if ds.mean_over else ""))
        rows = [[name, _fmt(st.mean), _fmt(st.std, blank=True), _fmt(st.sem, blank=True), st.n]
                for name, st in ds.stats.items()]
        print(_table(rows, ["statistic", "mean", "std", "sem", "n"]))
    elif res.scan is not None:
        s = res.scan
        print(f"model {res.model.id}  method {res.method}  scan metric {s.metric}  clean {_fmt(s.clean)}")
        print("effect of ablating each head alone (metric - clean):")
        print(_grid_table(s.effect))
    else:
        heads = ", ".join(f"L{l}H{h}" for l, h in res.heads or [])
        if res.components:
            heads = ", ".join(_component_label(c) for c in res.components)
        print(f"model {res.model.id}  ablated {heads} ({res.method})  mean loss "
              f"{_fmt(res.mean_loss_clean)} -> {_fmt(res.mean_loss_ablated)} nats  mean KL {_fmt(res.mean_kl)}")
        rows = [[p.position, repr(p.token), _fmt(p.loss_clean, blank=True),
                 _fmt(p.loss_ablated, blank=True), _fmt(p.delta_loss, blank=True), _fmt(p.kl),
                 repr(p.top_clean[0].label), repr(p.top_ablated[0].label)] for p in res.positions]
        print(_table(rows, ["pos", "token", "loss", "ablated", "delta", "KL", "top", "top after"]))
        if res.logit_diff is not None:
            ld = res.logit_diff
            print(f"logit diff {ld.target.label!r} - {ld.distractor.label!r} at {ld.position}: "
                  f"{_fmt(ld.clean)} -> {_fmt(ld.ablated)}")
    if args.plot:
        if res.scan is None:
            raise UsageError("--plot draws the scan's effect grid: add --scan")
        _save(_plots().effect_grid(res.scan.effect, title=f"{res.model.id}: ablating each head "
                                   f"({res.method}), change of {res.scan.metric}",
                                   label=f"{res.scan.metric} change" if res.scan.metric != "kl"
                                   else "KL(clean ‖ ablated), nats", text=text), args.plot)
    return EXIT_OK


def _component_label(c: dict) -> str:
    k = c.get("kind")
    if k == "head":
        return f"L{c['layer']}H{c['head']}"
    if k in ("mlp", "attn"):
        return f"{k.upper()}{c['layer']}"
    if k == "neuron":
        return f"L{c['layer']}N{','.join(map(str, c['neurons']))}"
    return f"direction@{c.get('hook')}"


def cmd_patch(args) -> int:
    opts = _options(args, {"metric": "metric", "method": "method", "residual": "residual",
                           "hook": "hook", "by_position": "by_position",
                           "patch_layers": "patch_layers", "patch_heads": "patch_heads",
                           "patch_positions": "patch_positions"})
    if _ld(args):
        opts["logit_diff"] = _ld(args)
    if args.dataset is not None:
        opts["pairs"] = _read_dataset(args.dataset, "patch")[1]
    with _client(args) as c:
        res = c.patch(args.clean_text, args.corrupted_text,
                      on_progress=_progress(args, "patch"), **opts)
    _write_output(args, res)
    if args.json:
        _print_json(res)
    else:
        ds = getattr(res, "dataset", None)
        if ds is not None:
            print(f"dataset: {ds.n_pairs} pairs; the values below are means over the pairs "
                  f"(clean sem {_fmt(ds.clean.sem, blank=True)}, corrupted sem "
                  f"{_fmt(ds.corrupted.sem, blank=True)}; spread in --output's dataset.grid)")
        print(f"model {res.model.id}  metric {res.metric}  method {res.method}  clean "
              f"{_fmt(res.clean_value)}  corrupted {_fmt(res.corrupted_value)}")
        if res.approximation:
            print(f"note: {res.approximation}")
        g = res.grid
        if g is not None:
            print(f"{g.function}: {g.hook_name}, axes {g.axes}, normalised metric (patched - "
                  "corrupted) / (clean - corrupted):")
            if len(g.axes) == 2:
                print(_grid_table(g.normalized))
            else:
                for layer, sub in enumerate(g.normalized):
                    print(f"layer {layer} [{', '.join(g.axes[1:])}]:")
                    print(_grid_table(sub))
        else:
            print("normalised metric (patched - corrupted) / (clean - corrupted), one head patched:")
            print(_grid_table(res.heads))
        if res.residual is not None:
            print("residual stream [layer, pos]:")
            print(_grid_table(res.residual))
    if args.plot:
        if res.clean_value == res.corrupted_value:  # 0 / 0 in every cell: no all-blank figure
            raise UsageError(f"--plot: the clean and corrupted runs give the same {res.metric} "
                             f"({res.clean_value!r}), so the normalised effect (patched - corrupted) / "
                             "(clean - corrupted) has no value anywhere; choose a corrupted text that "
                             "changes the metric")
        grid = res.heads if res.grid is None else res.grid.normalized
        if res.grid is not None and len(res.grid.axes) != 2:
            raise UsageError(f"--plot draws a two-axis grid; {res.grid.axes} has three (print "
                             "it, or save --output and plot one layer with attnscope.client.plots)")
        _save(_plots().effect_grid(grid, title=f"{res.model.id}: activation patching "
                                   f"({res.method}, {res.grid.hook if res.grid else 'z'}), {res.metric}",
                                   label="(patched - corrupted) / (clean - corrupted)",
                                   text=f"{args.clean_text!r} -> {args.corrupted_text!r}"), args.plot)
    return EXIT_OK


def cmd_norms(args) -> int:
    opts = _options(args, {"layers": "layers", "heads": "heads", "round": "round"})
    opts.setdefault("value_norms", False)
    with _client(args) as c:
        res = c.attention_norms(_read_text(args.text), **opts)
    _write_output(args, res)
    if args.json:
        _print_json(res)
        return EXIT_OK
    r = res.norms
    layers, heads = list(r.layers), list(r.heads)
    layer = args.layer if args.layer is not None else layers[0]
    if layer not in layers:
        raise UsageError(f"--layer {layer} is not among the returned layers {layers}")
    li = layers.index(layer)
    labels = [f"{t.position}:{_label(t)}" for t in r.tokens]
    if args.head is None:
        m, what = r.summed.numpy()[li], f"||sum_h alpha f(x)|| over heads {heads}"
    else:
        if args.head not in heads:
            raise UsageError(f"--head {args.head} is not among the returned heads {heads}")
        m, what = r.norms.numpy()[li, heads.index(args.head)], f"head {args.head}: ||alpha f(x)||"
    import numpy as np

    causal = bool(m.shape[-1] > 1 and np.all(np.triu(m, 1) == 0))
    print(f"model {res.model.id}  tokens {len(r.tokens)}  layer {layer}, {what} "
          f"(value_bias {res.value_bias}, output_bias {res.output_bias})")
    print(_matrix(m, labels, causal))
    if args.plot:
        with _client(args) as c:
            att = c.attention(_read_text(args.text), layers=[layer],
                              **({"add_bos": True} if opts.get("add_bos") else {}))
        _save(_plots().norm_heatmap(res, att, layer=layer, head=args.head), args.plot)
    return EXIT_OK


def cmd_rollout(args) -> int:
    opts = _options(args, {"fusion": "fusion", "residual": "residual", "discard": "discard",
                           "flow": "flow", "round": "round"})
    if args.drop_sink:
        opts["sink"] = "drop"
    with _client(args) as c:
        res = c.rollout(_read_text(args.text), **opts)
    _write_output(args, res)
    if args.json:
        _print_json(res)
        return EXIT_OK
    r = res.rollout
    labels = [f"{t.position}:{_label(t)}" for t in r.tokens]
    R = r.rollout.numpy()
    import numpy as np

    causal = bool(R.shape[-1] > 1 and np.all(np.triu(R[-1], 1) == 0))
    print(f"model {res.model.id}  tokens {len(r.tokens)}  rollout at layer {r.layers[-1]} "
          f"(fusion {res.fusion}, residual {res.residual}, discard {res.discard}, sink {res.sink})")
    print(_matrix(R[-1], labels, causal))
    if r.flow is not None:
        print(f"\nattention flow at layer {r.flow_layers[-1]}")
        print(_matrix(r.flow.numpy()[-1], labels, causal))
    if args.plot:
        # with --flow the figure is the flow (what was asked for), else the rollout
        _save(_plots().rollout_heatmap(res, flow=r.flow is not None), args.plot)
    return EXIT_OK


def cmd_run(args) -> int:
    with _client(args) as c:
        if args.hooks:
            res = c.hooks()
            if args.json:
                _print_json(res)
                return EXIT_OK
            rows = [[h.name, "[" + ", ".join(h.axes) + "]",
                     "[" + ", ".join("?" if n is None else str(n) for n in h.shape) + "]"]
                    for h in res.hooks]
            print(_table(rows, ["hook", "axes", "shape"]))
            return EXIT_OK
        body = _request_body(args.request)
        if args.texts:
            body["texts"] = list(args.texts)
        if args.tokens:
            body["token_lists"] = [list(t) for t in args.tokens]
        if args.cache:
            body["cache"] = list(body.get("cache", [])) + list(args.cache)
        if args.add_bos is not None:
            body["add_bos"] = args.add_bos
        if "texts" not in body and "token_lists" not in body:
            raise UsageError("run: give prompts as TEXT arguments, --tokens or in --request "
                             "(texts or token_lists)")
        tokens = body.pop("token_lists", None)
        out = c.run(tokens, **body)
    if args.save:
        from safetensors.numpy import save_file

        import numpy as np

        arrays = {k: np.ascontiguousarray(v) for k, v in out.cache.items()}
        arrays.update({f"grad.{k}": np.ascontiguousarray(v) for k, v in out.grads.items()})
        try:
            save_file(arrays, args.save)
        except OSError as exc:
            raise UsageError(f"cannot write --save {args.save}: {exc.strerror or exc}")
        print(f"{len(arrays)} tensors saved to {args.save}", file=sys.stderr)
    if args.json:
        print(json.dumps({"tokens": out.tokens, "add_bos": out.add_bos,
                          "cache": {k: {"shape": list(v.shape), "dtype": str(v.dtype)}
                                    for k, v in out.cache.items()},
                          "metrics": out.metrics, "metric_values": out.metric_values,
                          "grad_value": out.grad_value, "top": out.top}))
        return EXIT_OK
    print(f"{len(out.tokens)} prompts x {len(out.tokens[0])} tokens (add_bos {out.add_bos})")
    rows = [[k, "[" + ", ".join(map(str, v.shape)) + "]", str(v.dtype), _fmt(float(v.min())),
             _fmt(float(v.max()))] for k, v in out.cache.items()]
    if rows:
        print(_table(rows, ["hook", "shape", "dtype", "min", "max"]))
    for name, v in out.metrics.items():
        print(f"metric {name} = {_fmt(v)}  ({', '.join(_fmt(x) for x in out.metric_values[name])})")
    for name, g in out.grads.items():
        print(f"grad {name} [{', '.join(map(str, g.shape))}] max |g| {_fmt(float(abs(g).max()))}")
    return EXIT_OK


# -- why the model says what it says: logit lens, logit attribution, circuits, path patching

def _why_parsers(sub) -> None:
    """The subcommands of ``/v1/logit-lens``, ``/v1/logit-attribution``, ``/v1/circuits`` and
    ``/v1/path-patch``."""
    p = sub.add_parser("logit-lens", help="logit lens: every residual state through ln_final "
                       "and the unembedding, top tokens per layer and position "
                       "(POST /v1/logit-lens)")
    _common(p)
    _text_args(p)
    p.add_argument("--ln", choices=["own", "final"], default=None,
                   help="own (default): each state normalised with its own statistics (TL "
                        "accumulated_resid(apply_ln=True)); final: the final state's scale")
    p.add_argument("--mid", action="store_true", default=None,
                   help="also each block's hook_resid_mid (incl_mid)")
    p.add_argument("--top-k", type=int, default=None, help="top tokens per state and position (5)")
    p.add_argument("--positions", type=_ints, default=None,
                   help="positions shown, e.g. -3,-2,-1 (default all; the loss is always over all)")
    p.add_argument("--target", default=None,
                   help="a token (text, one token) whose rank is shown instead of the next token's")
    p.add_argument("--target-id", type=int, default=None, help="the target as a token id")

    p = sub.add_parser("logit-attribution", help="direct logit attribution of target (minus "
                       "distractor) to every head, MLP, embedding and bias "
                       "(POST /v1/logit-attribution)")
    _common(p)
    _text_args(p)
    p.add_argument("--target", default=None, help="the target token (a text that is one token)")
    p.add_argument("--distractor", default=None,
                   help="the distractor token: the direction is target minus distractor")
    p.add_argument("--target-id", type=int, default=None, help="the target as a token id")
    p.add_argument("--distractor-id", type=int, default=None, help="the distractor as a token id")
    p.add_argument("--positions", type=_ints, default=None,
                   help="positions attributed (default: the last)")
    p.add_argument("--top", type=int, default=10, help="largest parts listed (10)")

    p = sub.add_parser("circuits", help="weights only: every head's OV/QK circuit summaries and "
                       "the Q/K/V composition scores (POST /v1/circuits)")
    _common(p)
    _output_arg(p)
    p.add_argument("--top-k", type=int, default=None,
                   help="singular values per head and circuit in the response (8)")
    p.add_argument("--no-composition", action="store_true",
                   help="leave the composition scores out")
    p.add_argument("--top", type=int, default=10,
                   help="strongest composition pairs listed per kind (10)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=JSON",
                   help="any request option, value as JSON; repeatable")
    p.add_argument("--plot", metavar="FILE", default=None,
                   help="save the composition graph to FILE (needs matplotlib)")

    p = sub.add_parser("path-patch", help="path patching (Wang et al. 2022): senders' change "
                       "reaches receivers only along the direct path (POST /v1/path-patch)",
                       epilog="components: a head is LAYER:HEAD (senders) or LAYER:q|k|v / "
                              "LAYER:HEAD:q|k|v (receivers: every head of the layer / one "
                              "head); an MLP is mlpLAYER (e.g. mlp0); the logits 'logits'.")
    _common(p)
    p.add_argument("clean_text", nargs="?", default=None, help="the clean prompt")
    p.add_argument("corrupted_text", nargs="?", default=None,
                   help="the corrupted prompt (same token count)")
    p.add_argument("--clean-tokens", type=_ints, default=None, metavar="IDS",
                   help="the clean prompt as token ids (used as given)")
    p.add_argument("--corrupted-tokens", type=_ints, default=None, metavar="IDS",
                   help="the corrupted prompt as token ids (used as given)")
    p.add_argument("--senders", type=_components, default=None, metavar="L:H,mlpL,...",
                   help="the senders, patched together")
    p.add_argument("--receivers", type=_components, default=None, metavar="L:q,L:H:k,mlpL,logits",
                   help="the receivers, patched together")
    p.add_argument("--grid", action="store_true", default=None,
                   help="every sender head x receiver head input (q, k, v) of a later layer")
    p.add_argument("--metric", choices=["loss", "logit_diff", "prob", "logprob", "kl"],
                   default=None, help="the metric (loss); kl = KL(patched || base)")
    p.add_argument("--target", default=None, help="logit_diff / prob / logprob: target token")
    p.add_argument("--distractor", default=None, help="logit_diff: distractor token")
    p.add_argument("--positions", type=_ints, default=None,
                   help="positions whose next-token distribution is measured, negative from "
                        "the end (loss: -2, the last with a next token; others: -1)")
    p.add_argument("--direction", choices=["corrupted_to_clean", "clean_to_corrupted"],
                   default=None, help="corrupted_to_clean (default): base run clean, senders "
                                      "from the corrupted run")
    p.add_argument("--add-bos", action=argparse.BooleanOptionalAction, default=None,
                   help="texts: prepend BOS (default: the model's convention)")
    p.add_argument("--request", metavar="FILE", default=None,
                   help="the whole request as JSON (file, or - for stdin), e.g. a dataset of "
                        "pairs; the flags above add to it")
    p.add_argument("--top", type=int, default=10, help="grid: strongest cells listed per input (10)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=JSON",
                   help="any request option, value as JSON; repeatable")
    _output_arg(p)
    _progress_arg(p)


def _dataset_arg(p, what: str) -> None:
    p.add_argument("--dataset", metavar="FILE", default=None,
                   help=f"a dataset of prompts ('-' = stdin): a JSON list, a JSON object with "
                        f"the list under its field, or JSONL; {what}")


#: the fields of one dataset item (``--dataset``), per command
_PAIR_KEYS = {"clean_text", "corrupted_text", "clean_tokens", "corrupted_tokens", "metric",
              "clean", "corrupted", "id"}


def _read_dataset(path: str, cmd: str) -> tuple[str, list]:
    """``--dataset FILE`` (``-``: stdin) as ``(field, items)``: for ``patch`` ``("pairs",
    [pair dicts])``, for ``ablate`` ``("texts", [str])`` or ``("token_lists", [[int]])``.
    The file is a JSON list, a JSON object holding the list under ``pairs`` / ``texts`` /
    ``token_lists``, or JSONL (one item a line, blank lines skipped; the batch pipeline's
    ``{"id", "text"}`` lines read as texts). Raises UsageError naming the item (line) at fault."""
    where = "standard input" if path == "-" else path
    try:
        raw = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
    except OSError as exc:
        raise UsageError(f"--dataset {path}: cannot read it ({exc.strerror})")
    items, label = None, "item {}"
    head = raw.lstrip()[:1]
    if head in ("[", "{"):
        try:
            whole = json.loads(raw)
        except json.JSONDecodeError:
            whole = None  # JSONL of objects
        if isinstance(whole, list):
            items = whole
        elif isinstance(whole, dict):
            keys = [k for k in ("pairs", "texts", "token_lists") if k in whole]
            if keys:
                items = whole[keys[0]]
                label = f"{keys[0]}[{{}}]"
            # else one object: a JSONL file of one line
    if items is None:
        items, label = [], "line {}"
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                items.append((n, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise UsageError(f"--dataset {where}: line {n} is not valid JSON ({exc.msg} at "
                                 f"character {exc.pos})")
    else:
        if not isinstance(items, list):
            raise UsageError(f"--dataset {where}: a list of items is expected")
        items = list(enumerate(items))
    if not items:
        raise UsageError(f"--dataset {where}: no items")

    def ids(v):
        return isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool)
                                                 for x in v)
    out = []
    if cmd == "patch":
        for n, it in items:
            at = f"--dataset {where}: {label.format(n)}"
            if isinstance(it, list) and len(it) == 2:
                it = {"clean": it[0], "corrupted": it[1]}
            if not isinstance(it, dict):
                raise UsageError(f"{at}: a pair is an object {{\"clean_text\", "
                                 f"\"corrupted_text\"}} or a [clean, corrupted] list")
            bad = sorted(set(it) - _PAIR_KEYS)
            if bad:
                raise UsageError(f"{at}: unknown field {bad[0]!r} (a pair has "
                                 f"{', '.join(sorted(_PAIR_KEYS - {'id'}))})")
            pair = {k: v for k, v in it.items() if k not in ("clean", "corrupted", "id")}
            for side in ("clean", "corrupted"):
                if side in it:
                    v = it[side]
                    if isinstance(v, str):
                        pair[f"{side}_text"] = v
                    elif ids(v):
                        pair[f"{side}_tokens"] = v
                    else:
                        raise UsageError(f"{at}: {side!r} is a text or a list of token ids")
            out.append(pair)
        return "pairs", out
    kinds = set()
    for n, it in items:
        at = f"--dataset {where}: {label.format(n)}"
        if isinstance(it, dict):
            bad = sorted(set(it) - {"text", "tokens", "id"})
            if bad or ("text" in it) == ("tokens" in it):
                raise UsageError(f"{at}: an object with one of \"text\" and \"tokens\" (and "
                                 "optionally \"id\")")
            it = it.get("text", it.get("tokens"))
        if isinstance(it, str):
            kinds.add("texts")
        elif ids(it):
            kinds.add("token_lists")
        else:
            raise UsageError(f"{at}: a text, a list of token ids, or {{\"text\": ...}}")
        out.append(it)
    if len(kinds) > 1:
        raise UsageError(f"--dataset {where}: texts and token id lists mixed; give all as "
                         "texts or all as token ids")
    return kinds.pop(), out


def _progress_arg(p) -> None:
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress line on stderr while the job runs (streamed progress; "
                        "default: when stdout is a terminal)")


def _progress(args, what: str):
    """The ``on_progress`` of ``patch`` / ``path-patch``: one line on stderr, rewritten in
    place (``\r``), ended with a newline at the total; None when not asked (--no-progress,
    or stdout not a terminal without --progress)."""
    on = args.progress if getattr(args, "progress", None) is not None else sys.stdout.isatty()
    if not on:
        return None

    def show(done: int, total: int, unit: str) -> None:
        pct = 100.0 * done / total if total else 100.0
        end = "\n" if done >= total else ""
        sys.stderr.write(f"\r{what}: {done}/{total} {unit} ({pct:.0f}%){end}")
        sys.stderr.flush()
    return show


def _components(s: str) -> list:
    """``L:H,mlpL,L:q,L:H:k,logits`` -> [(L, H) | L (an MLP) | (L, 'q') | (L, H, 'k') |
    'logits'] (the client's path_patch forms)."""
    out: list = []
    for part in s.replace(" ", "").split(","):
        if not part:
            continue
        try:
            if part == "logits":
                out.append("logits")
            elif part.lower().startswith("mlp"):
                out.append(int(part[3:].lstrip(":")))
            else:
                bits = part.split(":")
                if len(bits) == 2 and bits[1] in ("q", "k", "v"):
                    out.append((int(bits[0]), bits[1]))
                elif len(bits) == 2:
                    out.append((int(bits[0]), int(bits[1])))
                elif len(bits) == 3 and bits[2] in ("q", "k", "v"):
                    out.append((int(bits[0]), int(bits[1]), bits[2]))
                else:
                    raise ValueError
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{part!r}: expected LAYER:HEAD, LAYER:q|k|v, LAYER:HEAD:q|k|v, mlpLAYER or "
                "logits") from None
    return out


def _token_arg(args, name: str):
    """``--NAME`` (a text that is one token) or ``--NAME-id`` (an id), or None; both: 2."""
    text, ident = getattr(args, name, None), getattr(args, f"{name}_id", None)
    if text is not None and ident is not None:
        raise UsageError(f"give --{name} or --{name}-id, not both")
    return ident if ident is not None else text


def _cell_token(t) -> str:
    return f"{t.label!r} {t.prob:.2f}"


def cmd_logit_lens(args) -> int:
    opts = _options(args, {"ln": "ln", "mid": "incl_mid", "top_k": "top_k",
                           "positions": "positions"})
    target = _token_arg(args, "target")
    if target is not None:
        opts["target"] = target
    text = _read_text(args.text)
    with _client(args) as c:
        res = c.logit_lens(text, **opts)
    _write_output(args, res)
    if args.json:
        _print_json(res)
    else:
        what = "the target" if target is not None else "the next token"
        print(f"model {res.model.id}  ln {res.ln}  add_bos {res.add_bos}")
        for i, pr in enumerate(res.prompts):
            if len(res.prompts) > 1:
                print(f"\nprompt {i}")
            toks = {t.position: t for t in pr.tokens}
            pos = [x.position for x in pr.states[0].positions] if pr.states else []
            head = ["state", "loss"] + [f"{q}:{toks[q].label!r}" for q in pos]
            print(f"{pr.n_tokens} tokens; top token (probability) per residual state and position:")
            rows = [[s.label, _fmt(s.loss, blank=True)]
                    + [_cell_token(x.top[0]) if x.top else "" for x in s.positions]
                    for s in pr.states]
            print(_table(rows, head))
            print(f"\nrank of {what} (0 = the top token) and its probability:")
            rows = [[s.label, _fmt(s.loss, blank=True)]
                    + ["" if x.target is None else f"{x.target.rank} ({x.target.prob:.2f})"
                       for x in s.positions] for s in pr.states]
            print(_table(rows, head))
    if args.plot:
        _save(_plots().logit_lens(res), args.plot)
    return EXIT_OK


def cmd_logit_attribution(args) -> int:
    target, distractor = _token_arg(args, "target"), _token_arg(args, "distractor")
    if target is None and _option_value(args, "target") is None:
        raise UsageError("give --target TOKEN (or --target-id ID); --distractor makes it a "
                         "logit difference")
    opts = _options(args, {"positions": "positions"})
    if target is not None:
        opts["target"] = target
    if distractor is not None:
        opts["distractor"] = distractor
    text = _read_text(args.text)
    with _client(args) as c:
        res = c.logit_attribution(text, **opts)
    _write_output(args, res)
    if args.json:
        _print_json(res)
    else:
        print(f"model {res.model.id}  add_bos {res.add_bos}")
        for i, pr in enumerate(res.prompts):
            toks = {t.position: t for t in pr.tokens}
            for d in pr.positions:
                tl = _label_of(res, pr, d.target)
                what = f"logit[{tl}]" + ("" if d.distractor is None
                                         else f" - logit[{_label_of(res, pr, d.distractor)}]")
                print(f"\n{'prompt ' + str(i) + ', ' if len(res.prompts) > 1 else ''}position "
                      f"{d.position} {toks[d.position].label!r}: {what} = {_fmt(d.logit_diff)}"
                      f"  (parts {_fmt(d.sum_of_parts)} + ln_final bias {_fmt(d.ln_final_bias)},"
                      f" error {_fmt(d.residual_error)}; frozen scale {_fmt(d.scale)})")
                n_heads = len(d.heads[0]) if d.heads else 0
                bias = getattr(d, "attn_bias", None)  # null: a model without b_O (rotary families)
                rows = [[layer] + [f"{v:+.3f}" for v in d.heads[layer]]
                        + ([] if bias is None else [f"{bias[layer]:+.3f}"])
                        + [f"{d.mlp[layer]:+.3f}"] for layer in range(len(d.heads))]
                print(_table(rows, ["layer"] + [f"H{h}" for h in range(n_heads)]
                             + ([] if bias is None else ["b_O"]) + ["MLP"]))
                parts = [("embed", d.embed), ("pos_embed", getattr(d, "pos_embed", None))]
                parts += [(f"L{la}H{h}", v) for la, row in enumerate(d.heads)
                          for h, v in enumerate(row)]
                parts += [(f"MLP{la}", v) for la, v in enumerate(d.mlp)]
                parts += [(f"b_O{la}", v) for la, v in enumerate(bias or [])]
                parts = [(n, v) for n, v in parts if v is not None]
                top = sorted(parts, key=lambda x: -abs(x[1]))[:max(0, args.top)]
                print("largest parts: " + ", ".join(f"{n} {v:+.3f}" for n, v in top))
    if args.plot:
        _save(_plots().logit_attribution(res), args.plot)
    return EXIT_OK


def _label_of(res, prompt, ident: int) -> str:
    """A token id as the prompt shows it (its label when the prompt holds it), else the id."""
    for t in prompt.tokens:
        if t.id == ident:
            return repr(t.label)
    return f"id {ident}"


def cmd_circuits(args) -> int:
    opts = _options(args, {"top_k": "top_k"})
    if args.no_composition:
        opts["composition"] = False
    with _client(args) as c:
        res = c.circuits(**opts)
    _write_output(args, res)
    if args.json:
        _print_json(res)
    else:
        print(f"model {res.model.id}  {res.n_layers} layers x {res.n_heads} heads, d_head "
              f"{res.d_head} (weights only, unprocessed)")
        rows = [[h.layer, h.head, f"{h.copying_score:+.3f}", f"{h.positive_eigenvalue_share:.3f}",
                 _fmt(h.ov_frobenius), _fmt(h.qk_frobenius),
                 " ".join(_fmt(v) for v in h.ov_singular_values[:3]),
                 " ".join(_fmt(v) for v in h.qk_singular_values[:3])] for h in res.heads]
        print(_table(rows, ["layer", "head", "copying", "pos. share", "|W_OV|_F", "|W_QK|_F",
                            "OV top sv", "QK top sv"]))
        if res.composition is not None:
            for kind in ("q", "k", "v"):
                grid = getattr(res.composition, kind)
                cells = [(grid[la][ha][lb][hb], la, ha, lb, hb)
                         for la in range(res.n_layers) for ha in range(res.n_heads)
                         for lb in range(la + 1, res.n_layers) for hb in range(res.n_heads)]
                cells.sort(reverse=True)
                top = cells[:max(0, args.top)]
                if top:
                    print(f"\n{kind.upper()}-composition, strongest pairs (earlier head -> later "
                          f"head's {'queries' if kind == 'q' else 'keys' if kind == 'k' else 'values'}):")
                    print(_table([[f"L{la}H{ha}", f"L{lb}H{hb}", f"{s:.3f}"]
                                  for s, la, ha, lb, hb in top], ["from", "to", "score"]))
    if args.plot:
        if res.composition is None:
            raise UsageError("--plot draws the composition graph: drop --no-composition")
        _save(_plots().composition(res), args.plot)
    return EXIT_OK


def _pp_metric(args) -> dict | None:
    """The path-patch metric from --metric/--target/--distractor/--positions (None: none of
    them given, the --request file's metric is used)."""
    kind = args.metric
    if kind is None and args.target is None and args.distractor is None \
            and args.positions is None:
        return None
    kind = kind or ("logit_diff" if args.distractor is not None else
                    "logprob" if args.target is not None else "loss")
    positions = args.positions or ([-2] if kind == "loss" else [-1])
    needs = {"logit_diff": ("target", "distractor"), "prob": ("target",),
             "logprob": ("target",), "loss": (), "kl": ()}[kind]
    for name in ("target", "distractor"):
        given = getattr(args, name) is not None
        if name in needs and not given:
            raise UsageError(f"--metric {kind} needs --{name} (one token, e.g. ' Mary')")
        if name not in needs and given:
            raise UsageError(f"--{name} is not used by --metric {kind}")
    if kind == "kl":  # run 0 = the run measured, run 1 = the base run
        terms = [{"prompt": 0, "reference_prompt": 1, "position": q} for q in positions]
    else:
        terms = [{"position": q, **{n: getattr(args, n) for n in needs}} for q in positions]
    return {"kind": kind, "terms": terms}


def cmd_path_patch(args) -> int:
    body = _request_body(args.request)
    clean = args.clean_tokens if args.clean_tokens is not None else args.clean_text
    corrupted = args.corrupted_tokens if args.corrupted_tokens is not None else args.corrupted_text
    if (args.clean_tokens is not None and args.clean_text is not None) or (
            args.corrupted_tokens is not None and args.corrupted_text is not None):
        raise UsageError("give each prompt once: as text or as --clean-tokens/--corrupted-tokens")
    if (clean is None) != (corrupted is None):
        raise UsageError("give both prompts: CLEAN_TEXT CORRUPTED_TEXT (or --clean-tokens and "
                         "--corrupted-tokens)")
    if clean is None and "pairs" not in body:
        raise UsageError("give the prompts (CLEAN_TEXT CORRUPTED_TEXT, --clean-tokens/"
                         "--corrupted-tokens) or pairs in --request FILE")
    if clean is not None and "pairs" in body:
        raise UsageError("the prompts are given twice: as arguments and as pairs in --request")
    metric = _pp_metric(args)
    if metric is not None:
        body["metric"] = metric
    body.setdefault("metric", {"kind": "loss", "terms": [{"position": -2}]})
    for attr, field in (("grid", "grid"), ("direction", "direction"), ("add_bos", "add_bos")):
        if getattr(args, attr) is not None:
            body[field] = getattr(args, attr)
    for item in args.option or []:
        key, value = _parse_option(item)
        body[key] = value
    if not body.get("grid") and args.senders is None and "senders" not in body:
        raise UsageError("give --senders and --receivers (e.g. --senders 0:1 --receivers 1:k), "
                         "or --grid")
    pairs = body.pop("pairs", None)
    senders = body.pop("senders", None) if args.senders is None else args.senders
    receivers = body.pop("receivers", None) if args.receivers is None else args.receivers
    with _client(args) as c:
        res = c.path_patch(pairs, clean=clean, corrupted=corrupted, senders=senders,
                           receivers=receivers, metric=body.pop("metric"),
                           on_progress=_progress(args, "path-patch"), **body)
    _write_output(args, res)
    if args.json:
        _print_json(res)
        return EXIT_OK
    n = res.base.n
    print(f"model {res.model.id}  {n} pair{'s' if n != 1 else ''}  metric {res.metric} "
          f"({res.reduce})  base run {res.base_run}, senders from the {res.other_run} run")

    def stat(s) -> str:
        return _fmt(s.mean) + ("" if s.std is None else f" ± {_fmt(s.std)} (std)")

    rows = [["base (" + res.base_run + ")", stat(res.base)],
            ["other (" + res.other_run + ")", stat(res.other)]]
    if res.patched is not None:
        rows.append(["path-patched", stat(res.patched)])
    print(_table(rows, ["run", res.metric]))
    if res.grid is None:
        snd = ", ".join(_component(s) for s in res.senders or [])
        rcv = ", ".join(_component(r) for r in res.receivers or [])
        norm = "undefined (other = base)" if res.normalized is None else f"{res.normalized:+.3g}"
        print(f"senders {snd} -> receivers {rcv}: normalised (patched - base) / (other - base) "
              f"= {norm}")
        return EXIT_OK
    g = res.grid
    for k, inp in enumerate(g.inputs):
        cells = []
        for ls, row in enumerate(g.normalized):
            for hs, recv in enumerate(row):
                for lr, heads in enumerate(recv):
                    for hr, vals in enumerate(heads):
                        v = vals[k]
                        if v is not None:
                            cells.append((abs(v), v, ls, hs, lr, hr, g.raw[ls][hs][lr][hr][k]))
        cells.sort(reverse=True)
        print(f"\nreceiver input {inp}: strongest cells by |normalised| (of {len(cells)})")
        print(_table([[f"L{ls}H{hs}", f"L{lr}H{hr}.{inp}", f"{v:+.3g}", _fmt(raw)]
                      for _, v, ls, hs, lr, hr, raw in cells[:max(0, args.top)]],
                     ["sender", "receiver", "normalised", res.metric]))
    return EXIT_OK


def _component(c: dict) -> str:
    kind = c.get("kind")
    if kind == "head" and "head" in c:
        return f"L{c['layer']}H{c['head']}"
    if kind == "head":
        heads = c.get("heads")
        who = f"L{c['layer']}" + ("" if heads is None else "H" + "/".join(map(str, heads)))
        return f"{who}.{c.get('input')}"
    if kind == "mlp":
        return f"MLP{c['layer']}"
    return str(kind)


def _request_body(request: str | None) -> dict[str, Any]:
    """``--request FILE`` (``-``: stdin): a JSON object, the request's other fields; ``{}``
    without it. UsageError naming the flag for invalid JSON or a non-object."""
    if not request:
        return {}
    raw = sys.stdin.read() if request == "-" else _read_file(request)
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--request {request}: not valid JSON ({exc.msg} at "
                         f"character {exc.pos})")
    if not isinstance(body, dict):
        raise UsageError(f"--request {request}: a JSON object is expected")
    return body


def _read_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}")


def _fmt(x, blank: bool = False) -> str:
    if x is None and blank:
        return ""
    return "NaN" if x is None else f"{x:.3g}"


COMMANDS = {"model": cmd_model, "tokenize": cmd_tokenize, "attention": cmd_attention,
            "trajectories": cmd_trajectories, "verify": cmd_verify, "heads": cmd_heads,
            "links": cmd_links, "norms": cmd_norms, "rollout": cmd_rollout,
            "predict": cmd_predict, "ablate": cmd_ablate, "patch": cmd_patch, "run": cmd_run,
            "logit-lens": cmd_logit_lens, "logit-attribution": cmd_logit_attribution,
            "circuits": cmd_circuits, "path-patch": cmd_path_patch}


SERVICE_CLI = "attnscope.service.cli"


def _serve(argv: list[str]) -> int:
    """``attnscope serve ...``: run the service's command line in place of this process.

    The client never imports the service (the layer rule; the client installs without torch):
    this looks the module up without importing it, then execs ``python -m
    attnscope.service.cli serve ...`` in the same environment, so the server is the process
    that was started (signals such as SIGTERM from a container reach uvicorn directly) and
    its exit code is the command's. Where exec is not available (Windows) it runs as a child.
    """
    import importlib.util

    try:
        spec = importlib.util.find_spec(SERVICE_CLI)
    except ImportError:  # attnscope.service missing altogether
        spec = None
    if spec is None:
        print("attnscope serve: the service is not installed in this environment. Install "
              "the service (from the attnscope repository: pip install -e .) to run a server; "
              "this client talks to one with --url.", file=sys.stderr)
        return EXIT_USAGE
    cmd = [sys.executable, "-m", SERVICE_CLI, *argv]
    sys.stdout.flush()
    sys.stderr.flush()
    if os.name == "posix":
        os.execv(sys.executable, cmd)
    import subprocess

    return subprocess.call(cmd)


_NEGATIVE_LIST = re.compile(r"^-\d+\s*(,\s*-?\d+\s*)+,?$")


def _glued(argv: list[str]) -> list[str]:
    """``--positions -3,-2,-1`` as ``--positions=-3,-2,-1``: argparse takes a value that starts
    with '-' and is not one number for an option (a lone ``-1`` it reads as a value)."""
    out: list[str] = []
    for a in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and _NEGATIVE_LIST.match(a):
            out[-1] = f"{out[-1]}={a}"
        else:
            out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``attnscope`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        return _serve(argv)
    from ._errors import (
        APIConnectionError, APIResponseValidationError, APIStatusError, RequestValidationError)

    ap = build_parser()
    try:
        args = ap.parse_args(_glued(argv))
    except SystemExit as exc:  # argparse: 2 on usage errors, 0 on --help
        return int(exc.code or 0)
    args.argv = argv  # batch's resume hint repeats the command
    for name in ("url", "api_key"):  # given before the command: used unless given after it
        if getattr(args, name, None) is None and getattr(args, f"global_{name}", None) is not None:
            setattr(args, name, getattr(args, f"global_{name}"))
    try:
        _check_args(args)
        if args.cmd == "batch":
            from . import batch as _batch

            return _batch.run_cli(args)
        return COMMANDS[args.cmd](args)
    except UsageError as exc:
        print(f"attnscope {args.cmd}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except RequestValidationError as exc:  # the request's schema refused it before sending
        print(f"attnscope {args.cmd}: {exc.message}", file=sys.stderr)
        return EXIT_USAGE
    except pydantic.ValidationError as exc:
        errs = "; ".join(f"{'.'.join(str(x) for x in e['loc']) or 'request'}: {e['msg']}"
                         for e in exc.errors())
        print(f"attnscope {args.cmd}: invalid request: {errs}", file=sys.stderr)
        return EXIT_USAGE
    except APIConnectionError as exc:
        print(f"attnscope {args.cmd}: connection failure: {exc.message} (is the service "
              f"running? --url / {URL_ENV})", file=sys.stderr)
        return EXIT_CONNECTION
    except APIStatusError as exc:
        print(f"attnscope {args.cmd}: server error {exc.status_code} {exc.type}: {exc.message}"
              + (f" (param {exc.param})" if exc.param else ""), file=sys.stderr)
        return EXIT_SERVER
    except APIResponseValidationError as exc:
        print(f"attnscope {args.cmd}: unexpected answer: {exc.message}", file=sys.stderr)
        return EXIT_SERVER
    except BrokenPipeError:  # e.g. `attnscope model | head -2`: the reader left, not an error
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return EXIT_OK
    except OSError as exc:  # a file that cannot be read or written (--plot, --output, input)
        where = f" {exc.filename}" if getattr(exc, "filename", None) else ""
        print(f"attnscope {args.cmd}: cannot use{where}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"attnscope {args.cmd}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ValueError as exc:  # e.g. a figure that does not fit the result
        print(f"attnscope {args.cmd}: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
