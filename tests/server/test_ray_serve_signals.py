"""`serve --replicas` and SIGINT/SIGTERM at each stage of its start (ray's calls faked: no cluster starts). A signal
while ray.init ran interrupted it and left Ray's agents running; SIGTERM while the application deployed ended the
process without taking anything down. Needs ray (pip install -e '.[ray]'); fast."""

from __future__ import annotations

import os
import signal
import time

import pytest

pytest.importorskip("ray.serve", reason="the Ray Serve tests need ray[serve]: pip install -e '.[ray]'")

from pagedserve.engine.arg_utils import EngineArgs  # noqa: E402
from pagedserve.entrypoints.openai.options import ServeOptions  # noqa: E402
from pagedserve.entrypoints.ray_serve import app  # noqa: E402
from pagedserve.entrypoints.ray_serve.args import ReplicaArgs  # noqa: E402


@pytest.fixture
def calls(monkeypatch):
    """Ray's calls that `run` makes, recorded; each test makes one of them send the signal."""
    made: list[str] = []
    for module, names in ((app.ray, ("init", "shutdown")), (app.serve, ("start", "run", "delete", "shutdown"))):
        for name in names:
            monkeypatch.setattr(module, name, lambda *a, _name=name, **k: made.append(_name))
    monkeypatch.setattr(app, "refusal", lambda replica_args: None)
    monkeypatch.setattr(app, "build_application", lambda *a, **k: None)
    return made


def signal_during(monkeypatch, calls, module, name: str, sig: int) -> None:
    def signalled(*args, **kwargs):
        calls.append(name)
        os.kill(os.getpid(), sig)
        time.sleep(0.5)  # where the signal is acted on at once, the handler's exception cuts this short
        calls.append(f"{name} returned")

    monkeypatch.setattr(module, name, signalled)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_ray_starts_takes_ray_down_once_it_has_started(monkeypatch, calls, sig):
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    signal_during(monkeypatch, calls, app.ray, "init", sig)
    assert app.run(EngineArgs(), ServeOptions(), ReplicaArgs()) == 0
    assert calls == ["init", "init returned", "shutdown", "shutdown"]  # serve's, then Ray's; nothing deployed
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_application_deploys_stops_it_and_takes_it_down(monkeypatch, calls, sig):
    signal_during(monkeypatch, calls, app.serve, "run", sig)
    assert app.run(EngineArgs(), ServeOptions(), ReplicaArgs()) == 0
    assert calls == ["init", "start", "run", "delete", "shutdown", "shutdown"]  # "run returned" never came
