"""Client methods (sync and async), CLI commands and plots of /v1/attention-norms and
/v1/rollout, against the real app in-process (the CLI's client is pointed at it)."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from attnscope.client import AsyncClient, Client, plots
from attnscope.client import cli as cli_mod

from conftest import SENTENCE

PNG = b"\x89PNG\r\n\x1a\n"
SHORT = "The cat sat on the mat."


@pytest.fixture(scope="module")
def api(client):
    return Client("http://testserver", http_client=client, max_retries=0)


def test_client_methods_return_models_with_numpy(api, client):
    res = api.attention_norms(SENTENCE, layers=[1])
    raw = client.post("/v1/attention-norms", json={"text": SENTENCE, "layers": [1]}).json()["norms"]
    np.testing.assert_array_equal(res.norms.summed.numpy(), np.asarray(raw["summed"], np.float32))
    assert res.norms.norms.numpy().shape == (1, 4, len(res.norms.tokens), len(res.norms.tokens))
    assert res.norms.value_norms.numpy().shape == (1, 4, len(res.norms.tokens))
    b = api.attention_norms(SENTENCE, layers=[1], binary=True)
    np.testing.assert_array_equal(b.norms.summed.numpy(), res.norms.summed.numpy())
    batch = api.attention_norms([SENTENCE, SHORT], per_head=False, encoding="base64")
    assert len(batch.results) == 2 and batch.results[0].norms is None
    ro = api.rollout(SHORT, flow=True, fusion="max")
    assert ro.fusion == "max" and ro.flow_max_tokens == 16
    np.testing.assert_allclose(ro.rollout.rollout.numpy().sum(-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(ro.rollout.flow.numpy().sum(-1), 1.0, atol=1e-5)
    with pytest.raises(Exception) as e:  # local validation before sending
        api.rollout(SHORT, fusion="median")
    assert "fusion" in str(e.value)


def test_async_client(gpt2_runtime):
    from test_client import _asgi_app

    app = _asgi_app(gpt2_runtime)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://app") as http:
            c = AsyncClient(http_client=http, max_retries=0)
            return await asyncio.gather(c.attention_norms(SHORT, layers=[0]),
                                        c.rollout(SHORT, sink="drop"))

    n, r = asyncio.run(go())
    assert n.norms.summed.numpy().shape[0] == 1
    assert r.sink == "drop" and (r.rollout.rollout.numpy()[:, 1:, 0] == 0).all()


def _run(capsys, monkeypatch, client, *args):
    monkeypatch.setattr(cli_mod, "_client",
                        lambda a: Client("http://testserver", http_client=client, max_retries=0))
    capsys.readouterr()
    rc = cli_mod.main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_norms_and_rollout(capsys, monkeypatch, client, api, tmp_path):
    rc, out, err = _run(capsys, monkeypatch, client, "norms", SHORT, "--layer", "1")
    assert rc == 0, err
    assert "layer 1, ||sum_h alpha f(x)||" in out
    summed = api.attention_norms(SHORT, layers=[1]).norms.summed.numpy()[0]
    first = [ln for ln in out.splitlines() if ln.strip().startswith("0:")][0]
    assert float(first.split()[-1]) == pytest.approx(summed[0, 0], abs=0.01)
    rc, out, err = _run(capsys, monkeypatch, client, "norms", SHORT, "--layer", "1", "--head", "2",
                        "--plot", str(tmp_path / "n.png"))
    assert rc == 0, err
    assert "head 2" in out and (tmp_path / "n.png").read_bytes()[:8] == PNG
    rc, out, err = _run(capsys, monkeypatch, client, "rollout", SHORT, "--flow", "--plot",
                        str(tmp_path / "r.png"))
    assert rc == 0, err
    assert "rollout at layer 1" in out and "attention flow at layer 1" in out
    assert (tmp_path / "r.png").stat().st_size > 5000
    rc, out, err = _run(capsys, monkeypatch, client, "rollout", SENTENCE * 2, "--flow")
    assert rc == 1 and "limited to 16 tokens" in err  # the server's 422, named
    rc, out, err = _run(capsys, monkeypatch, client, "norms", SHORT, "--layer", "7", "--layers", "0")
    assert rc == 2 and "--layer 7" in err


def test_plots_draw_the_data(api, tmp_path):
    norms = api.attention_norms(SENTENCE, layers=[1])
    att = api.attention(SENTENCE, layers=[1])
    fig = plots.norm_heatmap(norms, att, layer=1)
    weight_ax, norm_ax = fig.axes[0], fig.axes[1]
    np.testing.assert_allclose(weight_ax.images[0].get_array().data,
                               att.attention.pattern.numpy()[0].mean(0), atol=1e-6)
    np.testing.assert_allclose(norm_ax.images[0].get_array().data,
                               norms.norms.summed.numpy()[0], atol=1e-6)
    assert weight_ax.images[0].get_clim() == (0.0, 1.0)
    assert norm_ax.images[0].get_clim()[1] == pytest.approx(norms.norms.summed.numpy()[0].max())
    n = len(norms.norms.tokens)
    assert np.ma.getmaskarray(norm_ax.images[0].get_array())[0, n - 1]  # causal: blank
    fig.savefig(tmp_path / "n.png", dpi=80)
    assert (tmp_path / "n.png").read_bytes()[:8] == PNG
    fig = plots.norm_heatmap(norms, layer=1, head=3)  # norms alone, one head
    assert len(fig.axes) == 2  # the panel and its colour bar
    np.testing.assert_allclose(fig.axes[0].images[0].get_array().data,
                               norms.norms.norms.numpy()[0, 3], atol=1e-6)
    ro = api.rollout(SHORT, flow=True)
    fig = plots.rollout_heatmap(ro)
    np.testing.assert_allclose(fig.axes[0].images[0].get_array().data,
                               ro.rollout.rollout.numpy()[-1], atol=1e-6)
    assert fig.axes[0].images[0].get_clim() == (0.0, 1.0)
    fig = plots.rollout_heatmap(ro, flow=True)
    np.testing.assert_allclose(fig.axes[0].images[0].get_array().data,
                               ro.rollout.flow.numpy()[-1], atol=1e-6)
    with pytest.raises(ValueError, match="no flow"):
        plots.rollout_heatmap(api.rollout(SHORT), flow=True)
    with pytest.raises(ValueError, match="layer 0"):
        plots.norm_heatmap(norms, layer=0)
