"""The page's routes on an app with no engine (what a server serves while it starts): open to everyone, off with
--disable-web-ui, at the --root-path prefix whether or not the proxy strips it."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from pagedserve.engine.startup import StartupTracker
from pagedserve.entrypoints.openai.api_server import WEB_DIR, ServerState, build_app
from pagedserve.entrypoints.openai.options import ServeOptions


def client(enable_web_ui: bool = True, **kwargs) -> TestClient:
    return TestClient(build_app(ServerState(StartupTracker()), ServeOptions(disable_web_ui=not enable_web_ui, **kwargs)))


def test_page_and_assets_while_starting():
    app = client()
    page = app.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<base href="./">' in page.text  # no prefix: every URL relative to the page
    for asset in sorted(p.name for p in WEB_DIR.iterdir() if p.suffix in (".js", ".css")):
        assert f'href="web/{asset}"' in page.text or f'src="web/{asset}"' in page.text, asset
        assert app.get(f"/web/{asset}").status_code == 200, asset
    assert app.get("/web/../api_server.py").status_code == 404
    assert app.get("/health").status_code == 503
    # revalidated on every load (an upgraded server's page ran old scripts from the cache), not framed or sniffed
    for response in (page, app.get("/web/chat.js")):
        assert response.headers["cache-control"] == "no-cache"
        assert "frame-ancestors 'none'" in response.headers["content-security-policy"]
        assert response.headers["x-content-type-options"] == "nosniff"
    assert app.get("/web/index.html").status_code == 404  # its relative URLs missed there: the page is at /


def test_disable_web_ui():
    app = client(enable_web_ui=False)
    assert app.get("/").status_code == 404
    assert app.get("/web/app.js").status_code == 404


def test_api_key_guards_the_api_not_the_page():
    app = client(api_key="s3cret")
    page = app.get("/")
    assert page.status_code == 200 and "s3cret" not in page.text
    assert app.get("/web/chat.js").status_code == 200
    assert app.get("/v1/models").status_code == 401
    assert app.get("/server_info").status_code == 401
    assert app.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 503  # still starting
    assert client(api_key="s3cret", enable_web_ui=False).get("/").status_code == 401
    assert app.get("/ping").status_code == app.get("/health").status_code == 503  # health checks need no key
    assert app.post("/invocations", json={"prompt": "x"}).status_code == 401


@pytest.mark.parametrize("path", ["/llm/", "/llm"])
def test_root_path_unstripped(path):
    app = client(root_path="/llm", api_key="k")
    page = app.get(path)
    assert page.status_code == 200 and '<base href="/llm/">' in page.text
    assert str(page.url).endswith("/llm/")  # /llm redirects there
    assert app.get("/llm/web/app.js").status_code == 200
    assert app.get("/llm/health").status_code == 503  # open, and starting
    assert app.get("/llm/v1/models").status_code == 401


def test_root_path_stripped_by_the_proxy():
    app = client(root_path="/llm")
    assert '<base href="/llm/">' in app.get("/").text
    assert app.get("/web/app.js").status_code == 200


def test_health_never_says_ready_with_a_503():
    """The engine enters "ready" a moment before the serving layer exists: /health says warming_up until then
    (a client polling it saw 503 "ready" once in CI)."""
    state = ServerState(StartupTracker())
    for phase in ("starting", "warming_up", "ready"):
        state.startup.enter(phase)
    body = TestClient(build_app(state)).get("/health")
    assert body.status_code == 503 and body.json()["phase"] == "warming_up" and body.json()["status"] == "starting"
