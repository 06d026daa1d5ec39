"""The client methods (sync, async), the CLI commands (predict, ablate, patch) and the effect
grid figure for the intervention endpoints, against the real app (in-process and a real
uvicorn)."""

from __future__ import annotations

import asyncio
import json
import sys

import httpx
import numpy as np
import pytest

from attnscope.client import AsyncClient, Client

from conftest import SENTENCE

CLEAN = "The cat sat on the mat. The cat sat on the"
CORRUPTED = "The dog sat on the rug. The cat sat on the"


@pytest.fixture(scope="module")
def api(client):
    return Client("http://testserver", http_client=client, max_retries=0)


def test_client_methods(api):
    p = api.predictions(SENTENCE, top_k=2)
    assert len(p.predictions.positions) == len(p.predictions.tokens)
    assert p.predictions.positions[0].top[0].prob > 0
    many = api.predictions([SENTENCE, "a b"], positions=[0])
    assert len(many.results) == 2
    # prose on its own tokens (add_bos=False): ablating the heads raises the loss
    a = api.ablate(SENTENCE, heads=[(0, 1), (1, 0)], include_patterns=True, encoding="base64",
                   add_bos=False)
    assert a.add_bos is False and a.patterns.numpy().shape[:2] == (2, 4)
    assert a.mean_loss_ablated > a.mean_loss_clean
    s = api.ablate(SENTENCE, scan=True, scan_metric="kl")
    assert np.array(s.scan.grid).shape == (2, 4)
    r = api.patch(CLEAN, CORRUPTED, logit_diff={"target": " m", "distractor": " ru"})
    assert np.array(r.heads).shape == (2, 4) and r.approximation is None


def test_client_errors_are_typed(api):
    from attnscope.client import APIStatusError

    with pytest.raises(APIStatusError) as ei:
        api.patch("The cat sat on the mat.", "The man sat on the mat.",
                  logit_diff={"target": " m", "distractor": " ru"})
    assert ei.value.status_code == 422 and ei.value.param == "corrupted_text"


def test_async_client(gpt2_runtime):
    from test_client import _asgi_app

    app = _asgi_app(gpt2_runtime)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as http:
            c = AsyncClient(http_client=http, max_retries=0)
            return await asyncio.gather(
                c.predictions(SENTENCE), c.ablate(SENTENCE, heads=[[1, 1]]),
                c.patch(CLEAN, CORRUPTED, logit_diff={"target": " m", "distractor": " ru"},
                        method="attribution"))

    p, a, r = asyncio.run(go())
    assert p.predictions.mean_loss > 0 and a.heads == [[1, 1]]
    assert "linear approximation" in r.approximation


def test_effect_grid_figure(api, tmp_path):
    from attnscope.client import plots

    r = api.patch(CLEAN, CORRUPTED, logit_diff={"target": " m", "distractor": " ru"})
    fig = plots.effect_grid(r, title="activation patching", label="normalised logit diff",
                            text=CLEAN)
    ax, cax = fig.axes
    assert cax.get_ylabel() == "normalised logit diff"
    assert ax.get_xlabel() == "head" and ax.get_ylabel() == "layer"
    assert "attnscope-tiny-gpt2" in ax.get_title() and "activation patching" in ax.get_title()
    im = ax.images[0]
    vmax = np.nanmax(np.abs(np.array(r.heads, dtype=float)))
    assert im.norm.vmin == pytest.approx(-vmax) and im.norm.vmax == pytest.approx(vmax)
    assert im.norm(0.0) == pytest.approx(0.5)  # centred on 0
    fig.savefig(tmp_path / "g.png", dpi=80)
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"
    # None (no scale) is drawn blank, not as a colour
    fig = plots.effect_grid([[None, 1.0], [-2.0, 0.5]])
    assert np.ma.is_masked(fig.axes[0].images[0].get_array()[0, 0])
    with pytest.raises(ValueError):
        plots.effect_grid([1.0, 2.0])


def _run(capsys, monkeypatch, url, *args):
    from attnscope.client.cli import main

    monkeypatch.setenv("ATTNSCOPE_URL", url)
    capsys.readouterr()
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_predict_ablate_patch(live_server, tmp_path, capsys, monkeypatch):
    url = live_server.url
    rc, out, err = _run(capsys, monkeypatch, url, "predict", "The cat sat on the mat.", "--top-k", "2")
    assert rc == 0, err
    assert "mean loss" in out and out.splitlines()[1].split()[:3] == ["pos", "token", "next"]
    rc, out, err = _run(capsys, monkeypatch, url, "predict", "The cat sat.", "--json")
    assert rc == 0 and json.loads(out)["predictions"]["n_loss_tokens"] > 0

    rc, out, err = _run(capsys, monkeypatch, url, "ablate", SENTENCE, "--heads", "0:1,1:0",
                        "--target", " m", "--distractor", " the")
    assert rc == 0, err
    assert "ablated L0H1, L1H0 (zero)" in out and "logit diff" in out
    rc, out, err = _run(capsys, monkeypatch, url, "ablate", SENTENCE, "--scan", "--metric", "loss",
                        "--plot", str(tmp_path / "scan.png"))
    assert rc == 0, err
    assert "H3" in out and (tmp_path / "scan.png").stat().st_size > 5000
    rc, out, err = _run(capsys, monkeypatch, url, "ablate", SENTENCE, "--heads", "9:0")
    assert rc == 1 and "out_of_range" in err
    rc, out, err = _run(capsys, monkeypatch, url, "ablate", SENTENCE, "--heads", "x")
    assert rc == 2

    rc, out, err = _run(capsys, monkeypatch, url, "patch", CLEAN, CORRUPTED, "--target", " m",
                        "--distractor", " ru", "--residual", "--plot", str(tmp_path / "p.png"))
    assert rc == 0, err
    assert "normalised metric" in out and "residual stream" in out
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    rc, out, err = _run(capsys, monkeypatch, url, "patch", CLEAN, CORRUPTED, "--target", " m",
                        "--distractor", " ru", "--method", "attribution", "--json")
    assert rc == 0 and "linear approximation" in json.loads(out)["approximation"]
    rc, out, err = _run(capsys, monkeypatch, url, "patch", CLEAN, CORRUPTED, "--target", " m")
    assert rc == 2


def test_readme_worked_example(client, tmp_path, monkeypatch):
    """README.md's worked example (between the worked-example markers) runs against the real
    app (in-process: the snippet's ``Client()`` talks to it) and its assertions hold; the
    figure is written."""
    import contextlib
    import functools
    import io
    import re

    import attnscope.client

    from conftest import ROOT

    monkeypatch.setattr(attnscope.client, "Client",
                        functools.partial(Client, "http://testserver", http_client=client))

    text = (ROOT / "README.md").read_text()
    section = text.split("<!-- worked-example: begin -->")[1].split("<!-- worked-example: end -->")[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md worked example", "exec"), {"__name__": "__readme__"})
    assert "all layer-1 heads" in out.getvalue()
    assert (tmp_path / "induction_scan.png").read_bytes()[:4] == b"\x89PNG"
