"""A reward backend that asks an HTTP server for the scores (standard library only)."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from rlhf_lightning.interfaces import ConfigError, RewardModel, require, require_number
from rlhf_lightning.registry import register

BODY_PREVIEW_CHARS = 200  # how much of an unexpected response body an error message quotes


class _RetryableError(Exception):
    """One failed attempt worth repeating (server unreachable, too slow, or HTTP 5xx)."""

    def __init__(self, description: str, error_type: type[Exception]) -> None:
        super().__init__(description)
        self.description = description
        self.error_type = error_type  # raised once every attempt has failed


def _preview(body: bytes) -> str:
    return repr(body.decode("utf-8", errors="replace")[:BODY_PREVIEW_CHARS])


@register("reward_model", "remote", description="scores from an HTTP server: POST JSON prompts/responses, get scores")
class RemoteReward(RewardModel):
    """Score = whatever a remote HTTP service returns for each (prompt, response) pair.

    Protocol: for every chunk of at most ``batch_size`` pairs the backend sends::

        POST <url>
        Content-Type: application/json; charset=utf-8

        {"prompts": ["...", ...], "responses": ["...", ...]}

    and expects HTTP 2xx with a JSON object holding one number per pair, in order::

        {"scores": [0.7, -1.2, ...]}

    (the key is ``scores_key``). Unreachable servers, timeouts, broken answers and HTTP 5xx are retried up to
    ``max_retries`` times, waiting ``min(backoff * 2**attempt, max_backoff)`` seconds before
    retry ``attempt + 1``; HTTP 4xx, bodies that are not such an object, a wrong number of
    scores or scores that are not numbers fail at once, since repeating would not help.

    Args:
        url: ``http://`` or ``https://`` address the batches are POSTed to (required).
        scores_key: key of the score list in the JSON answer.
        timeout: seconds allowed for each request as a whole (connecting, the headers and the
            whole body): a server that keeps trickling bytes is cut off at the deadline.
        max_retries: extra attempts after the first failed one (0: no retry).
        backoff: base of the exponential wait between attempts, in seconds.
        max_backoff: cap on one wait, in seconds.
        batch_size: most pairs per request; larger batches are split into several requests.
        headers: extra HTTP headers (e.g. ``Authorization``), sent with every request.
    """

    def __init__(
        self,
        url: Optional[str] = None,
        scores_key: str = "scores",
        timeout: float = 30.0,
        max_retries: int = 3,
        backoff: float = 0.5,
        max_backoff: float = 30.0,
        batch_size: int = 64,
        headers: Optional[dict[str, str]] = None,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        parts = urllib.parse.urlsplit(url) if isinstance(url, str) else None
        web_address = parts is not None and parts.scheme in ("http", "https") and bool(parts.netloc)
        # Optional in the signature only so that a missing url is this message, not the parser's
        # "Does not validate against any of the Union subtypes".
        require(web_address, "reward_model.url", "the scoring server's http:// or https:// address (http://host:port/path)", url)
        require_number("reward_model.timeout", timeout, above=0)
        require_number("reward_model.max_retries", max_retries, integer=True, at_least=0)
        require_number("reward_model.backoff", backoff, at_least=0)
        require_number("reward_model.max_backoff", max_backoff, at_least=0)
        require_number("reward_model.batch_size", batch_size, integer=True, at_least=1)
        require(isinstance(scores_key, str) and bool(scores_key), "reward_model.scores_key", "a non-empty string", scores_key)
        headers = dict(headers or {})
        string_headers = all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items())
        require(string_headers, "reward_model.headers", "a mapping of header names to string values", headers)
        self.url, self.scores_key = url, scores_key
        self.timeout, self.max_retries = float(timeout), max_retries
        self.backoff, self.max_backoff = float(backoff), float(max_backoff)
        self.batch_size, self.headers = batch_size, headers

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> Tensor:
        scores: list[float] = []
        for start in range(0, len(responses), self.batch_size):
            chunk = slice(start, start + self.batch_size)
            scores += self._score_chunk(list(prompts[chunk]), list(responses[chunk]))
        return torch.tensor(scores, dtype=torch.float64)

    def _score_chunk(self, prompts: list[str], responses: list[str]) -> list[float]:
        body = self._post_with_retries({"prompts": prompts, "responses": responses})
        try:
            answer = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ConfigError(f"reward_model 'remote': {self.url} did not return JSON ({err}); received {_preview(body)}") from None
        if not isinstance(answer, dict) or self.scores_key not in answer:
            got = f"an object with keys {sorted(answer)}" if isinstance(answer, dict) else f"a JSON {type(answer).__name__}"
            raise ConfigError(
                f"reward_model 'remote': expected a JSON object with key {self.scores_key!r} "
                f"(reward_model.scores_key) from {self.url}, got {got}: {_preview(body)}"
            )
        scores = answer[self.scores_key]
        if not isinstance(scores, list):
            raise ConfigError(
                f"reward_model 'remote': {self.scores_key!r} from {self.url} must be a list of numbers, "
                f"got {type(scores).__name__}: {_preview(body)}"
            )
        if len(scores) != len(responses):
            raise ConfigError(
                f"reward_model 'remote': {self.url} returned the wrong number of scores: "
                f"expected {len(responses)} (one per response), got {len(scores)}"
            )
        bad = [(i, s) for i, s in enumerate(scores) if not _is_number(s)]
        if bad:
            shown = ", ".join(f"[{i}] = {s!r} ({type(s).__name__})" for i, s in bad[:5])
            raise ConfigError(f"reward_model 'remote': non-numeric scores from {self.url}: {shown}")
        return [float(s) for s in scores]

    def _post_with_retries(self, payload: dict[str, list[str]]) -> bytes:
        data = json.dumps(payload, ensure_ascii=False).encode("utf-8")
        headers = {"Content-Type": "application/json; charset=utf-8", "Accept": "application/json", **self.headers}
        attempts = self.max_retries + 1
        for attempt in range(attempts):
            if attempt:
                time.sleep(min(self.backoff * 2 ** (attempt - 1), self.max_backoff))
            request = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
            try:
                return self._post_once(request)
            except _RetryableError as err:
                last = err
        raise last.error_type(
            f"reward_model 'remote': POST {self.url} failed after {attempts} attempt(s) "
            f"(max_retries={self.max_retries}); last error: {last.description}"
        )

    def _post_once(self, request: urllib.request.Request) -> bytes:
        """The response body of one POST, all of it within ``timeout`` seconds; raises
        _RetryableError for failures worth repeating, telling a server that cannot be reached
        (ConnectionError) from one that answers too slowly (TimeoutError) or breaks off its
        answer (RuntimeError)."""
        deadline = _Deadline(self.timeout)
        # A fresh opener per request picks up the current proxy environment and keeps the
        # backend picklable (no sockets or handlers stored on it).
        opener = urllib.request.build_opener(_DeadlineHTTPHandler(deadline), _DeadlineHTTPSHandler(deadline))
        try:
            with deadline, opener.open(request, timeout=self.timeout) as response:
                body = response.read()
            if not deadline.expired:
                return body
        except urllib.error.HTTPError as err:
            body = _read_quietly(err)
            status = f"HTTP {err.code} {err.reason}"
            if err.code >= 500:
                raise _RetryableError(f"{status}; body: {_preview(body)}", RuntimeError) from None
            raise RuntimeError(
                f"reward_model 'remote': {self.url} answered {status} (client errors are not retried); body: {_preview(body)}"
            ) from None
        except (OSError, http.client.HTTPException) as err:  # URLError and TimeoutError are OSErrors
            reason = err.reason if isinstance(err, urllib.error.URLError) else err
            if not deadline.connected:
                raise _RetryableError(f"cannot connect ({reason!r})", ConnectionError) from None
            if not (deadline.expired or isinstance(reason, TimeoutError)):
                raise _RetryableError(f"connected, but the answer broke off ({reason!r})", RuntimeError) from None
        raise _RetryableError(f"connected, but no complete answer within timeout={self.timeout}s", TimeoutError)


class _Deadline:
    """Bounds one request as a whole. The socket timeout bounds each read, so a server sending a
    byte every few seconds would never time out; at the deadline a timer shuts the request's
    socket down, which ends any read blocked on it, whatever stage the request is in."""

    def __init__(self, seconds: float) -> None:
        self.sockets: list[socket.socket] = []
        self.expired = False
        self.lock = threading.Lock()
        self.timer = threading.Timer(seconds, self._expire)
        self.timer.daemon = True

    @property
    def connected(self) -> bool:
        return bool(self.sockets)

    def watch(self, sock: socket.socket) -> None:
        with self.lock:
            self.sockets.append(sock)
            if self.expired:  # connected just as the deadline passed
                self._shut(sock)

    def _expire(self) -> None:
        with self.lock:
            self.expired = True
            for sock in self.sockets:
                self._shut(sock)

    @staticmethod
    def _shut(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)

    def connection(self, base: type[http.client.HTTPConnection]) -> type[http.client.HTTPConnection]:
        """``base`` with its socket handed to this deadline as soon as it is connected."""
        deadline = self

        class Connection(base):
            def connect(self) -> None:
                super().connect()
                deadline.watch(self.sock)

        return Connection

    def __enter__(self) -> _Deadline:
        self.timer.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.timer.cancel()


class _DeadlineHTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline) -> None:
        super().__init__()
        self.deadline = deadline

    def http_open(self, req):
        return self.do_open(self.deadline.connection(http.client.HTTPConnection), req)


class _DeadlineHTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline) -> None:
        super().__init__()
        self.deadline = deadline

    def https_open(self, req):
        return self.do_open(self.deadline.connection(http.client.HTTPSConnection), req, context=self._context)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _read_quietly(err: urllib.error.HTTPError) -> bytes:
    try:
        return err.read()
    except Exception:  # the error body is only for the message
        return b""
