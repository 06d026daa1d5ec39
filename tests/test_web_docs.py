"""/docs in headless Chromium: Swagger UI 5, served offline from the package, renders every
operation of the OpenAPI 3.1 document (Swagger UI 4 said "Unable to render this definition")."""

from __future__ import annotations

import httpx

from web_browser import browser, page, screenshot  # noqa: F401  (fixtures)


def test_docs_render_every_operation_offline(live_server, page):  # noqa: F811
    spec = httpx.get(live_server.url + "/openapi.json").json()
    assert spec["openapi"].startswith("3.1")
    ops = sorted((m.upper(), p) for p, item in spec["paths"].items() for m in item
                 if m in ("get", "post", "put", "delete", "patch"))
    assert len(ops) >= 10
    requested = []
    page.on("request", lambda r: requested.append(r.url))
    page.goto(live_server.url + "/docs")
    page.wait_for_selector(".opblock", timeout=30_000)
    page.wait_for_function(f"document.querySelectorAll('.opblock').length >= {len(ops)}",
                           timeout=30_000)
    shown = sorted(
        (b.locator(".opblock-summary-method").inner_text().strip(),
         b.locator(".opblock-summary-path").get_attribute("data-path"))
        for b in page.locator(".opblock").all())
    assert shown == ops
    body = page.inner_text("body")
    assert "Unable to render" not in body and "valid version field" not in body
    assert "attnscope" in page.inner_text(".info .title")
    # every request stayed on the service (no CDN, no validator.swagger.io)
    assert requested and all(u.startswith(live_server.url) for u in requested), requested
    # an operation opens with its documented fields
    page.locator(".opblock-post", has=page.locator("[data-path='/v1/attention']")).first.locator(
        ".opblock-summary").click()
    page.wait_for_selector(".opblock.is-open .opblock-description-wrapper, .opblock.is-open "
                           ".opblock-section", timeout=10_000)
    screenshot(page, "docs")


def test_docs_assets_are_only_what_docs_needs(live_server):
    for name, kind in (("swagger-ui-bundle.js", "javascript"), ("swagger-ui.css", "css"),
                       ("favicon-32x32.png", "png")):
        r = httpx.get(f"{live_server.url}/static/swagger-ui/{name}")
        assert r.status_code == 200 and kind in r.headers["content-type"], (name, r.headers)
    # the vendored bundle is Swagger UI 5 (reads OpenAPI 3.1)
    js = httpx.get(live_server.url + "/static/swagger-ui/swagger-ui-bundle.js").text
    assert "SwaggerUIBundle" in js and "3.1" in js
    for other in ("LICENSE", "index.html", "swagger-initializer.js", "../__init__.py"):
        assert httpx.get(f"{live_server.url}/static/swagger-ui/{other}").status_code == 404


def test_try_it_out_sends_the_example_and_gets_200(live_server, page):  # noqa: F811
    """A new user's first call: /v1/attention -> "Try it out" -> "Execute" starts from the
    schema's example body (one text; Swagger's generated body held both ``text`` and
    ``texts``, a 422) and the service answers 200."""
    spec = httpx.get(live_server.url + "/openapi.json").json()
    example = spec["components"]["schemas"]["AttentionRequest"]["examples"][0]
    page.goto(live_server.url + "/docs")
    op = page.locator(".opblock-post", has=page.locator("[data-path='/v1/attention']")).first
    op.wait_for(timeout=30_000)
    op.locator(".opblock-summary").click()
    op.locator("button.try-out__btn").click()
    area = op.locator("textarea.body-param__text")
    area.wait_for(timeout=10_000)
    import json

    assert json.loads(area.input_value()) == example
    op.locator("button.execute").click()
    status = op.locator(".live-responses-table tbody .response-col_status").first
    status.wait_for(timeout=60_000)
    assert status.inner_text().strip().startswith("200"), status.inner_text()
