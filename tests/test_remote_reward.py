"""The 'remote' reward backend against real HTTP servers on 127.0.0.1 (ephemeral ports)."""

from __future__ import annotations

import contextlib
import socket
import threading
import types
from collections.abc import Callable

import pytest
import torch

from rlhf_lightning.registry import registry
from rlhf_lightning_plugins.rewards import remote as remote_reward
from rlhf_lightning_plugins.rewards.remote import RemoteReward

from helpers import Server, length_scores

FAST = dict(backoff=0.01, max_backoff=0.05)  # keeps retries quick


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch):
    """urllib honours *_proxy variables; requests to 127.0.0.1 must not go through one."""
    for name in ("http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)


@pytest.fixture
def serve():
    servers: list[Server] = []

    def start(respond: Callable[[int, dict], tuple] = length_scores) -> Server:
        servers.append(Server(respond))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


@pytest.fixture
def closed_port_url():
    # Bind to get a free port, then close it: nothing listens there, so connecting is refused.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/score"


# ---------------------------------------------------------------------------------------------
# A correct server


def test_scores_are_the_servers_in_order_and_batches_are_split(serve):
    server = serve()
    rm = RemoteReward(url=server.url, batch_size=2, **FAST)
    prompts = ["p0", "p1", "p2", "p3", "p4"]
    responses = ["", "a", "héllo ✓", "four", "x" * 10]
    raw, scores = rm(prompts, responses, torch.ones(5, dtype=torch.bool))
    # lengths in characters (not UTF-8 bytes): 0, 1, 7 ('héllo ✓'), 4, 10
    assert raw.tolist() == [0.0, 1.0, 7.0, 4.0, 10.0]
    assert scores.tolist() == raw.tolist() and raw.dtype == torch.float32
    # 5 pairs with batch_size=2 -> 3 requests of 2, 2 and 1 pairs, prompts travelling with them
    assert server.count == 3
    assert [p["prompts"] for p in server.payloads] == [["p0", "p1"], ["p2", "p3"], ["p4"]]
    assert [p["responses"] for p in server.payloads] == [["", "a"], ["héllo ✓", "four"], ["x" * 10]]


def test_headers_and_scores_key_are_used(serve):
    server = serve(lambda n, payload: (200, {"rewards": [2.5] * len(payload["responses"]), "scores": "ignored"}))
    rm = RemoteReward(url=server.url, scores_key="rewards", headers={"Authorization": "Bearer t0k"}, **FAST)
    assert rm.score(["p"], ["r"]).tolist() == [2.5]
    assert server.headers[0]["Authorization"] == "Bearer t0k"
    assert server.headers[0]["Content-Type"].startswith("application/json")


def test_empty_batch_sends_nothing(serve):
    server = serve()
    assert RemoteReward(url=server.url).score([], []).tolist() == []
    assert server.count == 0


# ---------------------------------------------------------------------------------------------
# Slow and failing servers: retried with backoff


def test_server_slower_than_timeout_fails_after_every_attempt(serve):
    server = serve(lambda n, payload: (*length_scores(n, payload), 2.0))
    rm = RemoteReward(url=server.url, timeout=0.2, max_retries=1, **FAST)
    with pytest.raises(TimeoutError) as info:
        rm.score(["p"], ["abc"])
    message = str(info.value)
    assert server.url in message and "after 2 attempt(s)" in message and "timeout=0.2s" in message
    assert server.count == 2


def test_server_slow_only_the_first_time_succeeds_on_retry(serve):
    server = serve(lambda n, payload: (*length_scores(n, payload), 2.0 if n == 0 else 0.0))
    rm = RemoteReward(url=server.url, timeout=0.2, max_retries=2, **FAST)
    assert rm.score(["p", "q"], ["abc", "de"]).tolist() == [3.0, 2.0]
    assert server.count == 2


def test_two_500s_then_ok_succeeds(serve):
    server = serve(lambda n, payload: (500, "busy") if n < 2 else length_scores(n, payload))
    rm = RemoteReward(url=server.url, max_retries=2, **FAST)
    assert rm.score(["p"], ["abcd"]).tolist() == [4.0]
    assert server.count == 3


def test_always_500_names_the_status_after_max_retries_plus_one_attempts(serve):
    server = serve(lambda n, payload: (500, "model crashed"))
    rm = RemoteReward(url=server.url, max_retries=2, **FAST)
    with pytest.raises(RuntimeError) as info:
        rm.score(["p"], ["r"])
    message = str(info.value)
    assert server.url in message and "after 3 attempt(s)" in message
    assert "HTTP 500" in message and "model crashed" in message
    assert server.count == 3


def test_waits_grow_exponentially_up_to_the_cap(serve, monkeypatch):
    waits: list[float] = []
    monkeypatch.setattr(remote_reward, "time", types.SimpleNamespace(sleep=waits.append))
    server = serve(lambda n, payload: (503, ""))
    rm = RemoteReward(url=server.url, max_retries=4, backoff=0.01, max_backoff=0.03)
    with pytest.raises(RuntimeError, match="HTTP 503"):
        rm.score(["p"], ["r"])
    assert waits == [0.01, 0.02, 0.03, 0.03]  # 0.01 * 2**k, capped at 0.03
    assert server.count == 5


def test_closed_port_is_a_connection_error_naming_url_and_attempts(closed_port_url):
    rm = RemoteReward(url=closed_port_url, max_retries=1, **FAST)
    with pytest.raises(ConnectionError) as info:
        rm.score(["p"], ["r"])
    message = str(info.value)
    assert closed_port_url in message and "after 2 attempt(s)" in message and "cannot connect" in message


class RawServer:
    """A TCP server that reads one request per connection and then runs ``answer(conn)``: for
    answers no well-behaved HTTP server gives (bytes trickled forever, a connection cut mid-body)."""

    def __init__(self, answer: Callable[[socket.socket], None]) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/score"
        self.stop = threading.Event()
        self.connections = 0

        def serve() -> None:
            while not self.stop.is_set():
                try:
                    conn, _ = self.sock.accept()
                except OSError:
                    return
                self.connections += 1
                with conn:
                    conn.recv(65536)
                    with contextlib.suppress(OSError):  # the client hung up
                        answer(conn, self.stop)

        threading.Thread(target=serve, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


@pytest.fixture
def raw_serve():
    servers: list[RawServer] = []
    yield lambda answer: servers.append(RawServer(answer)) or servers[-1]
    for server in servers:
        server.close()


def trickle(prefix: bytes):
    """Send ``prefix`` then one more byte every 0.05 s until stopped: each read gets data well
    within any socket timeout, so only a deadline on the whole request ends it."""

    def answer(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(prefix)
        while not stop.wait(0.05):
            conn.sendall(b"x")

    return answer


@pytest.mark.parametrize(
    "prefix",
    [b"HTTP/1.1 200 OK\r\nX-Slow: ", b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n"],
    ids=["headers", "body"],
)
def test_a_server_that_trickles_bytes_forever_is_cut_off_at_the_timeout(raw_serve, prefix):
    import time

    server = raw_serve(trickle(prefix))
    rm = RemoteReward(url=server.url, timeout=0.5, max_retries=1, **FAST)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"connected, but no complete answer within timeout=0.5s") as info:
        rm.score(["p"], ["r"])
    elapsed = time.monotonic() - start
    # two attempts of 0.5 s each plus one backoff wait of 0.01 s; a per-read timeout would never end
    assert 1.0 <= elapsed < 30.0, elapsed  # the upper bound only guards against a hang (about 1.01 s idle)
    assert "after 2 attempt(s)" in str(info.value) and server.connections == 2


def test_an_answer_cut_off_mid_body_is_a_broken_answer_not_a_connection_failure(raw_serve):
    def cut(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(b'HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n{"scores": [')

    server = raw_serve(cut)
    rm = RemoteReward(url=server.url, timeout=5.0, max_retries=1, **FAST)
    with pytest.raises(RuntimeError, match=r"after 2 attempt\(s\).*connected, but the answer broke off"):
        rm.score(["p"], ["r"])


# ---------------------------------------------------------------------------------------------
# Client errors and malformed answers: not retried


def test_400_is_not_retried_and_quotes_the_start_of_the_body(serve):
    body = "bad field 'responses': " + "x" * 500
    server = serve(lambda n, payload: (400, body))
    rm = RemoteReward(url=server.url, max_retries=3, **FAST)
    with pytest.raises(RuntimeError) as info:
        rm.score(["p"], ["r"])
    message = str(info.value)
    assert "HTTP 400" in message and server.url in message
    assert repr(body[:200]) in message and body[:201] not in message
    assert server.count == 1


@pytest.mark.parametrize(
    "answer, match",
    [
        ("<html>oops</html>", r"did not return JSON .*received '<html>oops</html>'"),
        ({"score": [1.0, 2.0]}, r"expected a JSON object with key 'scores' .*got an object with keys \['score'\]"),
        ([1.0, 2.0], r"expected a JSON object with key 'scores' .*got a JSON list"),
        ({"scores": [1.0]}, r"wrong number of scores: expected 2 \(one per response\), got 1"),
        ({"scores": [1.0, 2.0, 3.0]}, r"expected 2 \(one per response\), got 3"),
        ({"scores": ["1.0", None]}, r"non-numeric scores .*\[0\] = '1.0' \(str\), \[1\] = None \(NoneType\)"),
        ({"scores": [True, 1]}, r"non-numeric scores .*\[0\] = True \(bool\)"),
        ({"scores": 3.0}, r"'scores' from .* must be a list of numbers, got float"),
    ],
    ids=["not-json", "wrong-key", "not-an-object", "too-few", "too-many", "strings", "bool", "not-a-list"],
)
def test_garbage_answers_are_clear_value_errors(serve, answer, match):
    server = serve(lambda n, payload: (200, answer))
    rm = RemoteReward(url=server.url, max_retries=3, **FAST)
    with pytest.raises(ValueError, match=match) as info:
        rm.score(["p", "q"], ["a", "b"])
    assert server.url in str(info.value)
    assert server.count == 1


# ---------------------------------------------------------------------------------------------
# Construction


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"url": "ftp://example.com/score"}, "url"),
        ({"url": "localhost:8000/score"}, "url"),
        ({"url": "http://"}, "url"),
        ({"timeout": 0}, "timeout"),
        ({"timeout": -1.0}, "timeout"),
        ({"max_retries": -1}, "max_retries"),
        ({"max_retries": 1.5}, "max_retries"),
        ({"backoff": -0.1}, "backoff"),
        ({"batch_size": 0}, "batch_size"),
        ({"headers": {"X-Retries": 3}}, "headers"),
    ],
)
def test_invalid_settings_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"reward_model\.{field} "):
        RemoteReward(**{"url": "http://127.0.0.1:1/score", **kwargs})


def test_registered_as_remote():
    assert registry("reward_model").get("remote") is RemoteReward
    assert RemoteReward(url="https://rm.example.com/v1/score").url == "https://rm.example.com/v1/score"
