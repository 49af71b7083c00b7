"""``GET /v1/pool/events`` and the pages' routes on real servers (docs/web.md): the pages open and
the event stream behind the API key; a snapshot, then deltas no more often than the interval,
showing a chat's pages, its parks and resumes, and never its prompt; one snapshot per interval for
the engine however many viewers; a viewer that leaves is let go; ``--no-web`` (here as its
variable) serves no page and keeps the event stream; a drain ends every viewer.
"""

from __future__ import annotations

import itertools
import signal
import time
from collections.abc import Iterator

import pytest

from support.pool_events import PoolViewer
from support.servers import Server, launch_server, start_server, stop_server, wait_healthy

KEY = "pool-events-key"
PROMPT = "Say something about a zebra, marmalade and quantum tunnelling."
INTERVAL_S = 0.25


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[Server, Server]]:
    keyed = launch_server("--kv-cells", "1024", api_key=KEY, environ={"KVPARK_PREEMPT_EVERY": "8"})
    no_web = launch_server(environ={"KVPARK_NO_WEB": "1"})
    try:
        yield wait_healthy(keyed), wait_healthy(no_web)
    finally:
        stop_server(keyed, no_web)


def chat(server: Server, max_tokens: int = 40) -> str:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    with server.client() as client:
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return str(response.json()["id"])


def test_the_pages_are_open_and_the_event_stream_wants_the_key(
    servers: tuple[Server, Server],
) -> None:
    keyed, _ = servers
    with keyed.client() as client:
        client.headers.pop("Authorization")
        for path, kind in (
            ("/", "text/html"),
            ("/pool", "text/html"),
            ("/web/api.js", "text/javascript"),
            ("/web/chat.css", "text/css"),
            ("/web/icon.svg", "image/svg+xml"),
        ):
            response = client.get(path)
            assert response.status_code == 200 and response.headers["content-type"].startswith(kind)
            policy = response.headers["content-security-policy"]
            assert "script-src 'self'" in policy and "connect-src 'self'" in policy
        assert '<meta name="kvpark-auth" content="key">' in client.get("/").text
        assert client.get("/web/chat.html").status_code == 404  # pages at their own paths only
        assert client.get("/web/nothing.js").status_code == 404
        assert client.get("/v1/pool/events").status_code == 401
        assert client.get("/slots").status_code == 401


def test_a_viewer_sees_a_chat_take_pages_park_resume_and_give_them_back(
    servers: tuple[Server, Server],
) -> None:
    keyed, _ = servers
    viewer = PoolViewer(keyed).start()
    try:
        name, first = viewer.events[0]
        assert name == "snapshot" and first["interval"] == INTERVAL_S
        assert sum(count for _, count, _ in first["pages"]) == first["pool"]["pages"] == 64
        assert {"pool", "preempt", "requests", "counts", "timeline", "time"} <= set(first)
        # past the interval that the first snapshot opened, so that the chat's first step is
        # drawn at once: a 40-token chat can start and end within one interval on a fast CPU,
        # and the next delta would then find its pages already given back
        time.sleep(2 * INTERVAL_S)
        chat_id = chat(keyed)
        viewer.wait_for("the chat's pages given back", lambda: all(o <= 0 for o in viewer.owners))
    finally:
        viewer.close()
    deltas = viewer.deltas()
    records = [r for d in deltas for r in d.get("requests", []) if r["id"] == chat_id]
    assert records, "no delta named the chat"
    key = records[0]["key"]
    assert any(r["pages"] > 0 and r["prompt_tokens"] > 0 for r in records)
    seen_owners = {o for _, _, o in (run for d in deltas for run in d.get("pages", []))}
    assert key in seen_owners, "the chat's pages were never drawn as its own"
    timeline = [t for d in deltas for t in d.get("timeline", []) if t.get("request") == chat_id]
    kinds = [(t["kind"], t.get("mode")) for t in timeline]
    assert ("park", "swap") in kinds and ("resume", "swap") in kinds, kinds
    assert b"zebra" not in viewer.raw and b"marmalade" not in viewer.raw  # never prompt text
    times = [d["time"] for d in deltas]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert gaps and min(gaps) >= INTERVAL_S * 0.9, gaps  # a few a second at most


def test_many_viewers_cost_the_engine_one_snapshot_per_interval_and_leave_cleanly(
    servers: tuple[Server, Server],
) -> None:
    keyed, _ = servers
    before = keyed.metrics()
    viewers = [PoolViewer(keyed).start() for _ in range(6)]
    try:
        assert keyed.metric("kvpark_pool_viewers") == 6
        started = time.monotonic()
        chat(keyed, max_tokens=48)
        elapsed = time.monotonic() - started
        viewers[0].wait_for("the chat's end", lambda: all(o <= 0 for o in viewers[0].owners))
        time.sleep(2 * INTERVAL_S)
        taken = keyed.metric("kvpark_pool_snapshots_total") - before["kvpark_pool_snapshots_total"]
    finally:
        for viewer in viewers:
            viewer.close()
    # one snapshot per interval at most, for all six (each viewer's own would be six times that)
    assert 2 <= taken <= (elapsed + 3 * INTERVAL_S + 3) / INTERVAL_S, (taken, elapsed)
    seen = [[d["time"] for d in v.deltas()] for v in viewers]
    assert all(s == seen[0] for s in seen) and len(seen[0]) >= 2  # the same frames for each
    deadline = time.monotonic() + 10
    while keyed.metric("kvpark_pool_viewers") != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert keyed.metric("kvpark_pool_viewers") == 0, "a viewer that left is still counted"
    assert keyed.metric("kvpark_pool_viewer_skips_total") == 0


def test_no_web_serves_no_page_and_keeps_the_event_stream(servers: tuple[Server, Server]) -> None:
    _, no_web = servers
    with no_web.client() as client:
        for path in ("/", "/pool", "/web/api.js"):
            response = client.get(path)
            assert response.status_code == 404 and response.json()["error"]["code"] == 404
        assert client.get("/health").status_code == 200
    viewer = PoolViewer(no_web).start()
    viewer.close()
    assert viewer.status == 200 and viewer.events[0][0] == "snapshot"


def test_a_drain_ends_every_viewer_at_once() -> None:
    """SIGTERM: a viewer is no running request; its stream ends within a second and the server
    exits 0 without waiting out --shutdown-timeout for it."""
    server = start_server()
    try:
        viewer = PoolViewer(server).start()
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        assert viewer.ended.wait(5), "the viewer's stream outlived the drain"
        assert server.process.wait(20) == 0
        assert time.monotonic() - started < 10  # --shutdown-timeout is 30 s
        viewer.close()
    finally:
        stop_server(server)
