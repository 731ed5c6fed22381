"""The change feed (docs/DESIGN.md, "The change feed"): cursors, the long poll, resync after a
restart, and the paginated listing a resync reads; against a real controller process."""

from __future__ import annotations

import asyncio
from pathlib import Path

from controller_harness import (
    Controller,
    HeldRequest,
    cluster,
    federation,
    gpu_backend,
    poll,
    py,
    request,
    restart,
    start_controller,
    wait_terminal,
    write_config,
)

from iris.controller.app import MAX_FOLLOW_WAIT_S
from iris.controller.client import ControllerClient
from iris.controller.feed import ChangeFeed
from iris.controller.models import ChangeList
from iris.controller.models import ControllerJobState as S


async def _all_pages(c: ControllerClient, limit: int) -> tuple[list[str], str]:
    """Every job id, page by page, and the cursor read before the first page."""
    ids: list[str] = []
    page = await c.jobs_page(0, limit)
    assert page.cursor is not None
    cursor = page.cursor
    while True:
        ids += [j.job_id for j in page.jobs]
        if page.next_after is None:
            return ids, cursor
        page = await c.jobs_page(page.next_after, limit)


async def test_cursor_returns_each_change_once_in_order(open_controller: Controller) -> None:
    async with open_controller.client() as c:
        first = await c.changes(None)
        assert first.resync and not first.jobs, "no cursor: list every job first"
        _, cursor = await _all_pages(c, 1000)
        a = await c.launch(request(py("print('a')"), job_id="feed/a", gpus=1))
        b = await c.launch(request(py("import time; time.sleep(60)"), job_id="feed/b", gpus=1))
        assert a.epoch and a.version < b.version, "each change takes the next version"
        await wait_terminal(c, "feed/a")
        seen = await c.changes(cursor)
        assert not seen.resync and not seen.more
        # Each changed job once, as it is now (a: launched, started and ended; once, SUCCEEDED).
        ids = [j.job_id for j in seen.jobs if j.job_id.startswith("feed/")]
        assert sorted(ids) == ["feed/a", "feed/b"] and len(ids) == len(set(ids))
        latest = {j.job_id: j for j in seen.jobs}
        assert latest["feed/a"].state is S.SUCCEEDED
        # The cursor moved past them: nothing new now.
        again = await c.changes(seen.cursor)
        assert again.cursor == seen.cursor and again.jobs == []
        # A terminate is a change; the cursor carries on from the last reply.
        await c.terminate("feed/b")
        after = await c.changes(seen.cursor)
        assert [(j.job_id, j.state) for j in after.jobs] == [("feed/b", S.KILLED)]
        assert after.jobs[0].version > latest["feed/b"].version
        # A reply holds at most ``limit`` jobs, oldest change first; ``more`` asks for the rest.
        part = await c.changes(cursor, limit=1)
        assert part.more and len(part.jobs) == 1
        rest = await c.changes(part.cursor)
        assert {j.job_id for j in part.jobs + rest.jobs} >= {"feed/a", "feed/b"}
        assert not {j.job_id for j in part.jobs} & {j.job_id for j in rest.jobs}


async def test_long_poll_wakes_on_a_change(open_controller: Controller) -> None:
    async with open_controller.client() as c:
        _, cursor = await _all_pages(c, 1000)
        # No change: the poll answers empty after its wait, with the same cursor.
        quiet = await c.changes(cursor, wait_s=0.5)
        assert quiet.jobs == [] and quiet.cursor == cursor
        # A poll with the longest wait allowed, in the controller's hands before anything changes.
        held = await HeldRequest(
            open_controller, f"/v1/changes?since={cursor}&wait={MAX_FOLLOW_WAIT_S}"
        ).send()
        await poll(held.in_hands, bool, what="the controller to read the long poll")
        polling = asyncio.create_task(held.response())
        await c.launch(request(py("print('wake')"), job_id="feed/wake", gpus=1))
        await wait_terminal(c, "feed/wake")
        # The marker: a poll sent after the change, from the newest cursor, that nothing wakes for
        # half the first one's wait. Answered on the change, the first poll is done long before it;
        # left to run out its wait, it would still be waiting when the marker answers.
        _, latest = await _all_pages(c, 1000)
        marker = asyncio.create_task(c.changes(latest, wait_s=MAX_FOLLOW_WAIT_S / 2))
        done, _ = await asyncio.wait({polling, marker}, return_when=asyncio.FIRST_COMPLETED)
        assert polling in done, "the poll was not answered on the change"
        marker.cancel()
        status, body = await polling
        assert status == 200, body
        woke = ChangeList.model_validate_json(body)
        assert "feed/wake" in [j.job_id for j in woke.jobs]


async def test_a_cursor_from_before_a_restart_resyncs(tmp_path: Path) -> None:
    peer = cluster("peer", backends=[gpu_backend(slots=4)])
    cfg = write_config(tmp_path / "c.toml", federation(cluster("home"), peer))
    ctl = start_controller(cfg, "peer", tmp_path / "state", port=peer["port"])
    try:
        async with ctl.client() as c:
            for i in range(5):
                await c.launch(request(py(f"print({i})"), job_id=f"r/{i}", gpus=1))
            _, cursor = await _all_pages(c, 2)
            await wait_terminal(c, "r/4")
        ctl.kill9()
        ctl = restart(ctl)
        async with ctl.client() as c:
            stale = await c.changes(cursor, wait_s=5)
            assert stale.resync, "a cursor of the last start cannot be answered exactly"
            assert stale.jobs == []
            # The resync: every job, in pages, in launch order; then the feed from the listing on.
            ids, fresh = await _all_pages(c, 2)
            assert ids == [f"r/{i}" for i in range(5)]
            assert not (await c.changes(fresh)).resync
            await c.launch(request(py("print('new')"), job_id="r/new", gpus=1))
            assert [j.job_id for j in (await c.changes(fresh)).jobs] == ["r/new"]
            # A forged or future cursor resyncs too, never answers wrongly.
            for bad in ("nonsense", fresh.rsplit("-", 1)[0] + "-999999", "-1"):
                assert (await c.changes(bad)).resync
    finally:
        ctl.stop()


async def test_tombstones_and_the_resync_floor() -> None:
    feed = ChangeFeed(max_tombstones=2)
    for job in ("a", "b", "c", "d"):
        feed.touch(job)
    start = feed.cursor(0)
    feed.touch("a")  # a moves after d
    seen = feed.since(start, 10)
    assert seen.changed == ["b", "c", "d", "a"]
    mid = feed.cursor()
    feed.forget("b", "home")
    feed.forget("zz", "home")  # never known: no tombstone, no version
    gone = feed.since(mid, 10)
    assert gone.changed == [] and gone.removed == [("b", "home")]
    feed.forget("c", "home")
    feed.forget("d", "home")  # the tombstone of b is dropped: cursors before it resync
    assert feed.since(mid, 10).resync
    assert feed.since(feed.cursor(), 10).changed == []
    assert not feed.since(gone.cursor, 10).resync


async def test_a_stop_does_not_wait_for_open_long_polls(tmp_path: Path) -> None:
    peer = cluster("peer", backends=[gpu_backend(slots=4)])
    cfg = write_config(tmp_path / "c.toml", federation(cluster("home"), peer))
    ctl = start_controller(cfg, "peer", tmp_path / "state", port=peer["port"])
    try:
        async with ctl.client(timeout=60) as c:
            _, cursor = await _all_pages(c, 1000)
        polls = [await HeldRequest(ctl, f"/v1/changes?since={cursor}&wait=50").send() for _ in range(3)]
        for held in polls:
            await poll(held.in_hands, bool, what="the controller to read each long poll")
        await asyncio.to_thread(ctl.stop)
        answers = [await held.response() for held in polls]
        # The feed's close answers them, empty, as the stop begins. Without it the server would
        # wait out its 15 s graceful timeout, then cancel them: no answer, or a 500, for each.
        for status, body in answers:
            assert status == 200, body
            assert ChangeList.model_validate_json(body).jobs == []
    finally:
        ctl.stop()
