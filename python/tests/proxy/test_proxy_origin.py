"""The proxy refuses other sites' browser requests (DNS rebinding, cross-site POSTs): the
rule itself, then ``plimsoll serve`` for real, with raw headers and with the SDK clients."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest
from serve_process import Served, tiny_policy

from plimsoll.web.local_origin import HostRule, host_name

MSG = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize(("value", "name"), [
    ("127.0.0.1:8080", "127.0.0.1"), ("LocalHost:1", "localhost"), ("[::1]:8080", "::1"),
    ("::1", "::1"), ("example.com.", "example.com"), ("box", "box")])
def test_host_name_drops_the_port_and_the_case(value, name):
    assert host_name(value) == name


def test_the_rule_takes_loopback_the_bind_address_and_the_allowed_names():
    rule = HostRule("127.0.0.1")
    for ok in ("127.0.0.1:8080", "localhost:8080", "[::1]:8080", "127.8.9.10", None):
        assert rule.refusal(ok, None) is None, ok
    for ok in ("http://127.0.0.1:8080", "http://localhost:3000", "https://[::1]"):
        assert rule.refusal("127.0.0.1", ok) is None, ok
    code, message = rule.refusal("attacker.example:8080", None)
    assert code == "host_not_allowed" and "--allowed-host attacker.example" in message
    assert rule.refusal("192.168.1.5", None)[0] == "host_not_allowed"  # not the bind address
    for bad in ("http://attacker.example", "null", "file://", "chrome-extension://abc"):
        assert rule.refusal("127.0.0.1", bad)[0] == "origin_not_allowed", bad
    named = HostRule("192.168.1.5", ["Box.Local"])
    assert named.refusal("192.168.1.5:80", "http://box.local:8080") is None
    assert named.refusal("box.local", None) is None
    everywhere = HostRule("0.0.0.0")  # a wildcard bind: any address, still no foreign name
    assert everywhere.refusal("10.0.0.7:8080", "http://10.0.0.7:8080") is None
    assert everywhere.refusal("attacker.example", None)[0] == "host_not_allowed"
    assert HostRule("127.0.0.1", ["*"]).refusal("anything", "null") is None


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("origin")
    s = Served(["--policy", str(tiny_policy(tmp / "policy.json", tiny_model)),
                "--allowed-host", "plimsoll.lan"], tmp / "serve.log",
               {"PLIMSOLL_CACHE": str(tmp / "cache")})
    yield s
    assert s.stop() == 0


def test_a_rebound_host_gets_403_that_says_what_to_configure(served):
    for path in ("/health", "/running", "/v1/models", "/metrics", "/"):
        r = httpx.get(served.url + path, headers={"Host": "attacker.example"})
        assert r.status_code == 403, path
        err = r.json()["error"]
        assert err["code"] == "host_not_allowed", path
        assert "DNS rebinding" in err["message"]
        assert "--allowed-host attacker.example" in err["message"]
    r = httpx.post(served.url + "/v1/chat/completions", headers={"Host": "attacker.example"},
                   json={"model": "tiny", "messages": MSG, "max_tokens": 1})
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"


def test_a_cross_site_origin_gets_403_in_the_routes_protocol(served):
    r = httpx.post(served.url + "/v1/chat/completions",
                   headers={"Origin": "https://attacker.example", "content-type": "text/plain"},
                   content=b'{"model": "tiny", "messages": [], "max_tokens": 1}')
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    r = httpx.post(served.url + "/v1/messages", headers={"Origin": "null"},
                   json={"model": "tiny", "max_tokens": 1, "messages": MSG})
    body = r.json()
    assert r.status_code == 403 and body["type"] == "error"  # Anthropic's shape
    assert body["error"]["type"] == "permission_error"
    assert body["error"]["code"] == "origin_not_allowed"


def test_loopback_and_allowed_names_pass(served):
    for host, origin in (("localhost", None), ("127.0.0.1", f"http://127.0.0.1:{served.port}"),
                         ("plimsoll.lan", "http://plimsoll.lan:8080"), ("[::1]", None)):
        headers = {"Host": f"{host}:{served.port}"} | ({"Origin": origin} if origin else {})
        assert httpx.get(served.url + "/health", headers=headers).status_code == 200, host


def test_the_sdk_clients_pass(served):
    oa = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=180)
    out = oa.chat.completions.create(model="tiny", messages=MSG, max_tokens=2)
    assert out.choices[0].finish_reason in ("stop", "length")
    an = anthropic.Anthropic(base_url=served.url, api_key="none", max_retries=0, timeout=180)
    msg = an.messages.create(model="tiny", max_tokens=2, messages=MSG)
    assert msg.stop_reason in ("end_turn", "max_tokens")
