"""phub.admin given several controls (``URL1,URL2``) against fake controls on
loopback: a port nothing listens on, a follower naming the leader in
``X-Phub-Leader``, one that never answers, one that answers 503 without a
leader; as the Rust client (``phub_http::Controls``) behaves."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from typing import Iterator, Optional

import pytest

from phub import admin


class _Fake:
    """A fake control on 127.0.0.1: ``part`` is "leader" (serves), or
    "follower" (503, naming ``leader`` when given); counts its requests."""

    def __init__(self, part: str, leader: Optional[str] = None) -> None:
        fake = self
        self.asked = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                fake.asked += 1
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                if part == "leader":
                    status, body = 200, ([] if self.command == "GET" else {"id": 3, "token": "00000000000000aa"})
                else:
                    where = f"; send writes to the leader at {leader}" if leader else ""
                    status, body = 503, {"error": f"a follower, etcd at 127.0.0.1:1 unreachable{where}"}
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if leader:
                    self.send_header(admin.LEADER_HEADER, leader)
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fakes() -> Iterator[list[_Fake]]:
    made: list[_Fake] = []
    yield made
    for f in made:
        f.close()


def _refused() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()
    return url


def test_a_refused_control_and_a_follower_lead_to_the_leader(fakes: list[_Fake]) -> None:
    leader = _Fake("leader")
    follower = _Fake("follower", leader=leader.url)
    fakes += [leader, follower]
    # The leader is not given: the follower's header names it.
    job, token = admin.admit(f"{_refused()}, {follower.url}/", {"name": "x"})
    assert (job, token) == (3, "00000000000000aa")
    assert (follower.asked, leader.asked) == (1, 1)
    assert admin.jobs(f"{_refused()},{leader.url}") == []


def test_a_write_that_left_unanswered_is_not_sent_again(fakes: list[_Fake]) -> None:
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    leader = _Fake("leader")
    fakes.append(leader)
    both = f"http://127.0.0.1:{silent.getsockname()[1]},{leader.url}"
    try:
        with pytest.raises(admin.AdminError, match="no answer came .* may have been carried out"):
            admin.admit(both, {"name": "x"}, timeout=0.3)
        assert leader.asked == 0
        # A read goes on to the next.
        assert admin.jobs(both, timeout=0.3) == []
        assert leader.asked == 1
    finally:
        silent.close()


def test_the_wait_is_bounded_and_the_error_names_every_control(fakes: list[_Fake]) -> None:
    a = _Fake("follower")
    fakes.append(a)
    dead = _refused()
    t0 = time.monotonic()
    with pytest.raises(admin.AdminError) as e:
        admin._call(f"{dead},{a.url}", ("POST", "/v1/jobs"), b"{}", "application/json", 1.0, None, wait=0.7)
    took = time.monotonic() - t0
    assert 0.7 <= took < 1.7, took
    text = str(e.value)
    assert text.startswith("no phub-control served POST /v1/jobs within 0."), text
    assert f"{dead} (no answer, " in text and f"{a.url} (503, " in text, text
    assert "etcd at 127.0.0.1:1 unreachable" in text, text
    assert e.value.status == 503
    assert a.asked >= 2


def test_one_control_s_refusal_is_the_answer_at_once() -> None:
    dead = _refused()
    t0 = time.monotonic()
    with pytest.raises(admin.AdminError, match=f"GET {dead}/v1/jobs failed: "):
        admin.jobs(dead)
    assert time.monotonic() - t0 < admin.PAUSE
