"""Log lines without Ray: the bounded buffer, the logging handler, the stream tee, server log files,
the plain-text copies, and the run store's ``logs`` table with its cursor."""

from __future__ import annotations

import io
import logging
import sqlite3

import pytest

from refractor.telemetry.log_capture import (
    LogBuffer,
    LogLimits,
    LogLine,
    ProcessLogs,
    StreamTee,
    level_name,
)
from refractor.telemetry.log_files import FileFollower, LogFileCopies, line_level
from refractor.telemetry.query import RunReader
from refractor.telemetry.store import SCHEMA_VERSION, RunStore


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def line(message: str, component: str = "trainer", rank: int | None = 0, **kw) -> LogLine:
    fields = {"time": 1.0, "level": "INFO", "node": "10.0.0.1", "source": "stdout", "file": None, **kw}
    return LogLine(
        fields["time"],
        fields["level"],
        component,
        rank,
        fields["node"],
        fields["source"],
        message,
        fields["file"],
    )


def test_a_flood_is_cut_to_the_rate_and_the_buffer_and_the_rest_is_counted():
    clock = Clock()
    buffer = LogBuffer(LogLimits(lines_per_s=10, burst=20, max_lines=50, max_line_chars=8), clock)
    kept = sum(buffer.add(line(f"{i}")) for i in range(1_000))
    assert kept == 20  # the burst, then nothing until the bucket refills
    clock.now = 1.0
    kept = sum(buffer.add(line("x" * 100)) for _ in range(1_000))
    assert kept == 10  # one second at 10 lines/s
    batch = buffer.drain()
    assert len(batch.lines) == 30 and batch.dropped == 1_970
    assert batch.lines[-1].message == "xxxxxxxx [... 92 more characters cut]"
    assert buffer.drain().lines == [] and buffer.drain().dropped == 0  # the counter restarts
    # undrained, the buffer holds max_lines whatever the rate lets through
    clock.now = 1_000.0
    fast = LogBuffer(LogLimits(lines_per_s=1e9, burst=10**9, max_lines=50), clock)
    assert sum(fast.add(line("y")) for _ in range(200)) == 50 and fast.drain().dropped == 150


def test_undecodable_text_is_stored_with_replacement_characters(tmp_path):
    buffer = LogBuffer()
    smuggled = b"ok \xff\xfe bytes".decode("utf-8", "surrogateescape")  # lone surrogates
    buffer.add(line(smuggled))
    store = RunStore(tmp_path)
    store.log_lines(buffer.drain().lines)
    store.close()  # raises when a write failed
    with RunReader(tmp_path) as reader:
        (row,) = reader.logs()
    assert row["message"] == "ok \ufffd\ufffd bytes"


def test_the_handler_records_logging_by_component_and_never_recurses(monkeypatch):
    logs = ProcessLogs(
        "driver",
        None,
        "10.0.0.1",
        capture_streams=False,
        logger_components={"refractor.orchestrator": "orchestrator"},
    )
    try:
        logging.getLogger("refractor.orchestrator.lanes").info("lane %d freed", 3)
        logging.getLogger("refractor.train").warning("careful")
        logging.getLogger("refractor.orchestratorx").info("not the orchestrator")
        logging.getLogger("refractor.train").debug("below INFO: not kept")
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("refractor.telemetry.store").exception("a write failed")
    finally:
        logs.close()
    logging.getLogger("refractor.train").warning("after close: not kept")
    lines = logs.drain().lines
    assert [(x.component, x.level, x.source) for x in lines] == [
        ("orchestrator", "INFO", "log"),
        ("driver", "WARNING", "log"),
        ("driver", "INFO", "log"),
        ("driver", "ERROR", "log"),
    ]
    assert lines[0].message == "refractor.orchestrator.lanes: lane 3 freed" and lines[0].rank is None
    assert "ValueError: boom" in lines[3].message and lines[3].node == "10.0.0.1"
    assert [level_name(n) for n in (5, 25, 35, 60)] == ["DEBUG", "INFO", "WARNING", "CRITICAL"]


def test_the_tee_passes_output_through_and_keeps_whole_lines():
    original = io.StringIO()
    buffer = LogBuffer(LogLimits(max_line_chars=20))
    tee = StreamTee(original, buffer, "stdout", "INFO", "trainer", 1, "10.0.0.2")
    print("hello", "world", file=tee)
    print(file=tee)  # a blank line is not kept
    tee.write("\rloading 10%")
    tee.write("\rloading 100%\r\n")  # a progress bar: its final state
    tee.write("part")
    tee.write("ial\n:actor_name:TrainerActor\n")  # Ray's task marker is not output
    tee.write("unfinished")
    tee.write(" and far too long")
    assert (
        original.getvalue()
        == "hello world\n\n\rloading 10%\rloading 100%\r\npartial\n:actor_name:TrainerActor\n"
        "unfinished and far too long"
    )
    lines = buffer.drain().lines
    assert [x.message for x in lines] == [
        "hello world",
        "loading 100%",
        "partial",
        "unfinished and far t [... 7 more characters cut]",  # a line never ends: kept in pieces
    ]
    assert {(x.component, x.rank, x.source, x.level) for x in lines} == {("trainer", 1, "stdout", "INFO")}


def test_the_console_shows_what_it_showed_before(monkeypatch):
    import sys

    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.setattr(logging.root, "handlers", [])  # nothing configured logging (pytest did)
    library = logging.getLogger("some_library")
    monkeypatch.setattr(library, "handlers", [logging.StreamHandler(stderr)])  # prints its own
    logs = ProcessLogs("driver", None, "n", capture_streams=False)
    try:
        logging.getLogger("refractor.train").warning("a warning")
        logging.getLogger("refractor.train").info("an info line: recorded, not printed")
        library.warning("printed once")
    finally:
        logs.close()
    assert stderr.getvalue() == "a warning\nprinted once\n"
    assert len(logs.drain().lines) == 3 and logging.root.handlers == []


def test_a_flood_in_one_write_is_counted_not_split():
    buffer = LogBuffer(LogLimits(lines_per_s=1, burst=3), Clock())  # the clock stands still
    tee = StreamTee(io.StringIO(), buffer, "stdout", "INFO", "trainer", 0, "n")
    tee.write("".join(f"line {i}\n" for i in range(1_000_000)) + "partial")
    tee.write(" end\n")
    batch = buffer.drain()
    assert [x.message for x in batch.lines] == ["line 0", "line 1", "line 2"]
    assert batch.dropped == 1_000_000 - 3 + 1  # and "partial end": no room left for it


def test_captured_streams_are_given_back(capsys):
    import sys

    before = sys.stdout, sys.stderr
    logs = ProcessLogs("trainer", 0, "n", capture_streams=True)
    print("to stdout")
    print("to stderr", file=sys.stderr)
    logs.close()
    assert (sys.stdout, sys.stderr) == before
    assert [(x.source, x.level, x.message) for x in logs.drain().lines] == [
        ("stdout", "INFO", "to stdout"),
        ("stderr", "WARNING", "to stderr"),
    ]
    assert capsys.readouterr() == ("to stdout\n", "to stderr\n")


def test_a_server_log_file_is_followed_across_a_restart(tmp_path):
    buffer = LogBuffer()
    follower = FileFollower(buffer, "server", 0, "10.0.0.3")
    first = tmp_path / "server-0.log"
    first.write_bytes(b"from an earlier attempt\n")  # a resumed run appends: old lines are stored already
    follower.follow(first)
    follower.poll()  # nothing new
    with open(first, "ab") as f:
        f.write(
            b"INFO 11-25 19:08:01 [api.py:1] started\nshards 50%\rshards 100%\r\n"
            b"bad \xff byte\nno newline yet"
        )
    follower.poll()
    second = tmp_path / "server-0.restart1.log"
    follower.follow(second)  # the rest of the first file, its last line included
    follower.poll()  # not created yet
    second.write_bytes(b"2026-11-25 19:09:00,001 ERROR refractor.inference: died\n")
    follower.poll()
    lines = buffer.drain().lines
    assert [(x.level, x.message) for x in lines] == [
        ("INFO", "INFO 11-25 19:08:01 [api.py:1] started"),
        ("INFO", "shards 100%"),
        ("INFO", "bad \ufffd byte"),
        ("INFO", "no newline yet"),
        ("ERROR", "2026-11-25 19:09:00,001 ERROR refractor.inference: died"),
    ]
    assert {(x.component, x.rank, x.node, x.source) for x in lines} == {("server", 0, "10.0.0.3", "file")}
    # each line names the file it was read from: this batch holds lines of both
    assert [x.file for x in lines] == [str(first)] * 4 + [str(second)]
    # so the driver's copies, on a node sharing this file system, find both files there and copy nothing
    copies = LogFileCopies(tmp_path, local_node="10.0.0.1")
    copies.write(lines)
    copies.close()
    assert second.read_bytes() == b"2026-11-25 19:09:00,001 ERROR refractor.inference: died\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["server-0.log", "server-0.restart1.log"]
    assert line_level("WARN  something") == "WARNING" and line_level("Traceback (most recent call)") == "INFO"


def test_copies_are_written_per_component_and_a_server_file_only_when_it_is_elsewhere(tmp_path):
    copies = LogFileCopies(tmp_path / "logs")
    copies.write(
        [line("step 1 done", time=1_700_000_000.25), line("hi", component="driver", rank=None, source="log")]
    )
    local_server = tmp_path / "logs" / "server-0.log"
    local_server.write_text("the server's own line\n")
    copies.write([line("the server's own line", component="server", source="file", file=str(local_server))])
    remote = "/elsewhere/runs/x/logs/server-1.log"  # on another node
    copies.write([line("remote line", component="server", rank=1, source="file", file=remote)])
    copies.close()
    trainer = (tmp_path / "logs" / "trainer-0.log").read_text()
    assert trainer.endswith(".250 INFO    [stdout] step 1 done\n")
    assert (tmp_path / "logs" / "driver.log").read_text().endswith("[log] hi\n")
    assert local_server.read_text() == "the server's own line\n"  # not doubled
    assert (tmp_path / "logs" / "server-1.log").read_text() == "remote line\n"


def test_a_server_on_the_drivers_node_is_never_copied_even_before_its_file_exists(tmp_path):
    """A server on the driver's node writes its file there, also before it has created it (a restarted
    server's new file): a copy made then would land in the file the server appends to."""
    copies = LogFileCopies(tmp_path / "logs", local_node="10.0.0.1")
    new_file = tmp_path / "logs" / "server-0.restart1.log"
    copies.write([line("started", component="server", source="file", file=str(new_file))])
    assert not new_file.exists()
    new_file.write_text("the new server's line\n")
    copies.write([line("the new server's line", component="server", source="file", file=str(new_file))])
    elsewhere = "/elsewhere/runs/x/logs/server-1.log"  # another node: copied, as before
    copies.write(
        [line("remote line", component="server", rank=1, source="file", node="10.0.0.4", file=elsewhere)]
    )
    copies.close()
    assert new_file.read_text() == "the new server's line\n"
    assert (tmp_path / "logs" / "server-1.log").read_text() == "remote line\n"


@pytest.fixture
def store_with_lines(tmp_path):
    store = RunStore(tmp_path)
    rows = []
    for i in range(10):
        rows.append(line(f"trainer line {i}", level="INFO" if i % 3 else "WARNING"))
        rows.append(line(f"server 50%_done {i}", component="server", rank=i % 2, source="file"))
    store.log_lines(rows)
    store.close()
    return tmp_path


def test_the_reader_pages_logs_newest_last_with_an_id_cursor(store_with_lines):
    with RunReader(store_with_lines) as reader:
        newest = reader.logs(limit=3)
        assert [r["message"] for r in newest] == ["server 50%_done 8", "trainer line 9", "server 50%_done 9"]
        assert [r["id"] for r in newest] == [18, 19, 20]
        assert reader.logs(after_id=20) == []  # a live view polls with the last id it has seen
        follow = reader.logs(component="trainer", after_id=0, limit=4)
        assert [r["message"] for r in follow] == [f"trainer line {i}" for i in range(4)]
        rest = reader.logs(component="trainer", after_id=follow[-1]["id"], limit=100)
        assert [r["message"] for r in rest] == [f"trainer line {i}" for i in range(4, 10)]
        older = reader.logs(component="trainer", before_id=rest[0]["id"], limit=2)
        assert [r["message"] for r in older] == ["trainer line 2", "trainer line 3"]
        warnings = reader.logs(level="warning")
        assert [r["message"] for r in warnings] == [f"trainer line {i}" for i in (0, 3, 6, 9)]
        assert [r["rank"] for r in reader.logs(component="server", rank=1)] == [1] * 5
        assert len(reader.logs(text="50%_")) == 10 and reader.logs(text="50%x") == []
        assert [r["message"] for r in reader.logs(text="LINE 7")] == ["trainer line 7"]
        (row,) = reader.logs(limit=1)
        assert set(row) == {"id", "time", "level", "component", "rank", "node", "source", "message"}
        with pytest.raises(ValueError, match="unknown log level 'LOUD'"):
            reader.logs(level="LOUD")
        summary = [
            (r["component"], r["rank"], r["lines"], r["warnings"], r["last_id"]) for r in reader.log_summary()
        ]
        assert summary == [("server", 0, 5, 0, 18), ("server", 1, 5, 0, 20), ("trainer", 0, 10, 4, 19)]


def test_a_run_store_of_schema_3_reads_no_logs_and_gets_the_table_when_written_again(tmp_path):
    RunStore(tmp_path).close()
    conn = sqlite3.connect(tmp_path / "run.db")
    conn.execute("DROP TABLE logs")  # as version 3 wrote it
    conn.execute("UPDATE meta SET value = '3' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    with RunReader(tmp_path) as reader:
        assert reader.logs() == [] and reader.log_summary() == [] and reader.meta()["schema_version"] == 3
    store = RunStore(tmp_path)  # a resume
    store.log_lines([line("after the resume")])
    store.close()
    with RunReader(tmp_path) as reader:
        assert [r["message"] for r in reader.logs()] == ["after the resume"]
        assert reader.meta()["schema_version"] == SCHEMA_VERSION


def test_unwritable_log_files_are_one_warning_and_the_store_still_gets_every_line(tmp_path):
    import asyncio

    from refractor.runtime.log_collector import LogCollector

    stored = []
    events = []
    copies = LogFileCopies(tmp_path / "logs")
    (tmp_path / "logs").rmdir()
    (tmp_path / "logs").write_text("a file where the folder was")  # writing into it fails
    local = ProcessLogs("driver", None, "n", capture_streams=False)
    collector = LogCollector(local, stored.extend, copies, events.append)
    logging.getLogger("refractor.train").warning("one")
    asyncio.run(collector.collect())
    logging.getLogger("refractor.train").warning("two")
    asyncio.run(collector.collect())
    collector.close()
    messages = [x.message for x in stored]
    assert "refractor.train: one" in messages and "refractor.train: two" in messages
    assert [(e.name, e.attrs["source"]) for e in events] == [("log_files_failed", "files")]


def test_a_drain_that_answers_late_is_waited_for_again_and_its_lines_kept(tmp_path):
    import asyncio
    import time

    from refractor.runtime.log_collector import LogCollector
    from refractor.telemetry.log_capture import LogBatch

    stored, events, calls = [], [], []
    local = ProcessLogs("driver", None, "n", capture_streams=False)
    collector = LogCollector(
        local, stored.extend, LogFileCopies(tmp_path / "logs"), events.append, call_timeout_s=0.05
    )

    async def scenario() -> None:
        loop = asyncio.get_running_loop()

        def drain():  # the first call answers only after its collection gave up; later ones at once
            calls.append(loop.create_future())
            if len(calls) > 1:
                calls[-1].set_result(LogBatch([], 0))
            return calls[-1]

        collector.add_actor_source("trainer", 0, drain)
        await collector.collect()  # no answer within the timeout: recorded once, the call kept
        line = LogLine(time.time(), "INFO", "trainer", 0, "n", "stdout", "taken from the buffer")
        calls[0].set_result(LogBatch([line], 0))
        await collector.collect()  # waits for that same call: its lines reach the store
        await collector.collect()  # then a new call

    asyncio.run(scenario())
    collector.sources.clear()  # close() waits on Ray object refs; these calls are plain futures
    collector.close()
    assert [x.message for x in stored if x.component == "trainer"] == ["taken from the buffer"]
    assert len(calls) == 2  # the late call (waited for twice), then a new one
    assert [(e.name, e.attrs["source"]) for e in events] == [("log_collection_failed", "trainer-0")]
