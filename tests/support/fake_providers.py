"""Local fakes of the notification providers, on 127.0.0.1 (http.server in a thread).

* :class:`FakeTwilio`: Twilio's REST API as far as :mod:`apiary.response.channels` uses it:
  ``POST /2010-04-01/Accounts/{sid}/Messages.json`` (``To``, ``From``, ``Body``) and
  ``.../Calls.json`` (``To``, ``From``, ``Twiml`` or ``Url``), form-encoded, HTTP basic auth
  ``account_sid:auth_token``. Answers 201 with ``{"sid": "SM..." | "CA...", ...}``; 401 (code
  20003) for bad credentials, 400 (code 21211 and friends) for a missing or malformed field, as
  Twilio does. It is a fake written from Twilio's documentation, not Twilio: the channels are
  tested against it, never against the real service.
* :class:`FakeWebhook`: a Slack- or Teams-style incoming webhook that records the JSON posted.

Both record every request (:class:`Request`, ``status`` the answer given) and can be told to fail
the next N requests (:meth:`fail_next`). The handler records a request before it answers, so once
the client has its answer the record is there: no polling needed.
"""

from __future__ import annotations

import base64
import itertools
import json
import re
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs

ACCOUNT_SID = "AC" + "0123456789abcdef" * 2
AUTH_TOKEN = "fake-auth-token"
_E164 = re.compile(r"^\+[1-9]\d{1,14}$")
_PATH = re.compile(r"^/2010-04-01/Accounts/(?P<sid>[^/]+)/(?P<resource>Messages|Calls)\.json$")


@dataclass
class Request:
    """One request a fake received."""

    path: str
    headers: dict[str, str]  # names in lower case
    body: Any  # the form (dict of str, one value per field) for Twilio; the JSON for webhooks
    status: int  # the status the fake answered


@dataclass
class _Failures:
    """Planned failures: the next ``count`` requests get ``status`` with ``body``."""

    count: int = 0
    status: int = 500
    body: str = ""
    path_contains: str | None = None  # only requests whose path contains this


class _Fake:
    """A ThreadingHTTPServer on 127.0.0.1 whose POSTs go to :meth:`_handle`."""

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._failures = _Failures()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, ctype, body = fake._dispatch(self.path, {k.lower(): v for k, v in self.headers.items()}, raw)
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        # a short poll interval: shutdown() waits up to one interval, and every test closes a fake
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02},
                                        name=type(self).__name__, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> _Fake:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def fail_next(self, count: int, status: int = 500, body: str | None = None, *,
                  path_contains: str | None = None) -> None:
        """Answer the next ``count`` requests (those whose path contains ``path_contains``, if
        given: ``"Messages"``) with ``status`` and ``body`` (default a provider-shaped error)."""
        with self._lock:
            self._failures = _Failures(count, status, self._error_body(status) if body is None else body,
                                       path_contains)

    def _error_body(self, status: int) -> str:
        return f"HTTP {status}"

    def _dispatch(self, path: str, headers: dict[str, str], raw: bytes) -> tuple[int, str, str]:
        with self._lock:
            f = self._failures
            planned = f.count > 0 and (f.path_contains is None or f.path_contains in path)
            if planned:
                self._failures.count -= 1
                status, body = self._failures.status, self._failures.body
                ctype = "application/json" if body.startswith("{") else "text/plain"
            else:
                status, ctype, body = self._handle(path, headers, raw)
            self.requests.append(Request(path, headers, self._parse(raw), status))
        return status, ctype, body

    def _parse(self, raw: bytes) -> Any:
        return raw

    def _handle(self, path: str, headers: dict[str, str], raw: bytes) -> tuple[int, str, str]:
        raise NotImplementedError


class FakeTwilio(_Fake):
    """Twilio's Messages and Calls APIs (see the module docstring). ``base_url`` for the channels
    is :attr:`url`. :attr:`messages` and :attr:`calls` are the forms it accepted (201)."""

    def __init__(self, account_sid: str = ACCOUNT_SID, auth_token: str = AUTH_TOKEN) -> None:
        super().__init__()
        self.account_sid, self.auth_token = account_sid, auth_token
        self._ids = itertools.count(1)

    @property
    def messages(self) -> list[dict[str, str]]:
        return [r.body for r in self.requests if r.status == 201 and r.path.endswith("/Messages.json")]

    @property
    def calls(self) -> list[dict[str, str]]:
        return [r.body for r in self.requests if r.status == 201 and r.path.endswith("/Calls.json")]

    def _error_body(self, status: int) -> str:
        code, message = {400: (21211, "The 'To' number is not a valid phone number."),
                         401: (20003, "Authenticate"), 429: (20429, "Too Many Requests")}.get(
            status, (20500, "Internal Server Error"))
        return json.dumps({"code": code, "message": message, "status": status})

    def _parse(self, raw: bytes) -> dict[str, str]:
        return {k: v[0] for k, v in parse_qs(raw.decode(), keep_blank_values=True).items()}

    def _error(self, status: int, code: int, message: str) -> tuple[int, str, str]:
        return status, "application/json", json.dumps({"code": code, "message": message, "status": status})

    def _handle(self, path: str, headers: dict[str, str], raw: bytes) -> tuple[int, str, str]:
        match = _PATH.match(path)
        if not match:
            return self._error(404, 20404, "The requested resource was not found")
        expected = "Basic " + base64.b64encode(f"{self.account_sid}:{self.auth_token}".encode()).decode()
        if headers.get("authorization") != expected or match["sid"] != self.account_sid:
            return self._error(401, 20003, "Authenticate")
        if not headers.get("content-type", "").startswith("application/x-www-form-urlencoded"):
            return self._error(400, 21000, "form-encoded body expected")
        form = self._parse(raw)
        resource = match["resource"]
        needed = ("To", "From", "Body") if resource == "Messages" else ("To", "From")
        for name in needed:
            if not form.get(name):
                return self._error(400, 21604 if name == "To" else 21603, f"A '{name}' parameter is required.")
        if resource == "Calls" and not (form.get("Twiml") or form.get("Url")):
            return self._error(400, 21205, "Url or Twiml parameter is required.")
        if not _E164.match(form["To"]):
            return self._error(400, 21211, f"The 'To' number {form['To']} is not a valid phone number.")
        if not _E164.match(form["From"]):
            return self._error(400, 21212, f"The 'From' number {form['From']} is not a valid phone number.")
        if len(form.get("Body", "")) > 1600:
            return self._error(400, 21617, "The concatenated message body exceeds the 1600 character limit.")
        sid = ("SM" if resource == "Messages" else "CA") + f"{next(self._ids):032x}"
        answer = {"sid": sid, "account_sid": self.account_sid, "to": form["To"], "from": form["From"],
                  "status": "queued"}
        if resource == "Messages":
            answer["body"] = form["Body"]
        return 201, "application/json", json.dumps(answer)


class FakeWebhook(_Fake):
    """A chat incoming webhook: records each JSON post (:attr:`posts`, those answered 2xx) and
    answers ``ok_status`` with ``ok_body`` (Slack: ``200 ok``; Teams' legacy connectors: ``200 1``).
    A body that is not JSON gets 400 ``invalid_payload``, as Slack answers."""

    def __init__(self, ok_status: int = 200, ok_body: str = "ok") -> None:
        super().__init__()
        self.ok_status, self.ok_body = ok_status, ok_body

    @property
    def posts(self) -> list[Any]:
        return [r.body for r in self.requests if 200 <= r.status < 300]

    def _error_body(self, status: int) -> str:
        return {400: "invalid_payload", 404: "no_service", 410: "channel_is_archived",
                429: "rate_limited"}.get(status, "internal_error")

    def _parse(self, raw: bytes) -> Any:
        try:
            return json.loads(raw)
        except ValueError:
            return raw

    def _handle(self, path: str, headers: dict[str, str], raw: bytes) -> tuple[int, str, str]:
        if not headers.get("content-type", "").startswith("application/json") or isinstance(self._parse(raw), bytes):
            return 400, "text/plain", "invalid_payload"
        return self.ok_status, "text/plain", self.ok_body

