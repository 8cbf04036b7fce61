"""Log formats of dilocox-node (daemon/logs.py): text as before, or one strict JSON object per line."""

from __future__ import annotations

import io
import json
import logging
import os
import re
from contextlib import contextmanager
from pathlib import Path

import pytest
from dilocox.daemon.logs import TEXT_FORMAT, configure_logging, status_context
from dilocox.daemon.status import State, StatusBoard

ISO_MS_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
log = logging.getLogger("tests.logs")


def _reject_constant(name):
    raise ValueError(f"not strict JSON: {name}")


def _lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line, parse_constant=_reject_constant) for line in stream.getvalue().splitlines()]


@pytest.fixture
def stream():
    """A fresh stream, with the root logger's handlers and level restored afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    out = io.StringIO()
    yield out
    for h in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(h)
    root.setLevel(level)


@contextmanager
def _alone(handler: logging.Handler):
    """Only ``handler`` on the root logger: pytest's capture handler re-raises what ours must survive."""
    root = logging.getLogger()
    others = [h for h in root.handlers if h is not handler]
    for h in others:
        root.removeHandler(h)
    try:
        yield
    finally:
        for h in others:
            root.addHandler(h)


def test_json_lines_have_the_required_keys_and_context(stream):
    configure_logging("info", "json", lambda: {"outer_step": 12, "round": 12, "peer_id": "QmX"}, stream=stream)
    log.info("hello %s, %d rounds", "world", 3)
    log.debug("not shown at info")
    log.warning("careful", extra={"phase": "allreduce"})
    first, second = _lines(stream)
    assert ISO_MS_UTC.match(first["time"]), first["time"]
    assert first["level"] == "INFO" and first["logger"] == "tests.logs"
    assert first["message"] == "hello world, 3 rounds"
    assert (first["outer_step"], first["round"], first["peer_id"]) == (12, 12, "QmX")
    assert second["level"] == "WARNING" and second["phase"] == "allreduce"
    assert "exc_info" not in first


def test_odd_messages_never_raise(stream):
    handler = configure_logging("debug", "json", lambda: {"loss": float("nan"), "where": Path("/tmp/x"),
                                                          "ids": {1, 2}}, stream=stream)
    with _alone(handler):
        log.info("%d steps", "many")  # args that do not fit the format
        log.info({"a": 1})  # not a string
        log.info("line one\nline two \u00e9", extra={"obj": object(), "inf": float("inf")})
    records = _lines(stream)
    assert len(records) == 3 and len(stream.getvalue().splitlines()) == 3  # one line each, newlines escaped
    assert "%d steps" in records[0]["message"] and "many" in records[0]["message"]
    assert records[1]["message"] == "{'a': 1}"
    assert records[2]["message"] == "line one\nline two \u00e9"
    assert records[2]["loss"] == "NaN" and records[2]["inf"] == "Infinity"
    assert records[2]["where"] == "/tmp/x" and records[2]["obj"].startswith("<object")
    assert isinstance(records[2]["ids"], str)


def test_raising_context_keeps_the_record(stream):
    def broken():
        raise RuntimeError("board gone")

    configure_logging("info", "json", broken, stream=stream)
    log.info("still here")
    (record,) = _lines(stream)
    assert record["message"] == "still here"
    assert record["context_error"] == "RuntimeError: board gone"


def test_exception_is_captured(stream):
    configure_logging("info", "json", None, stream=stream)
    try:
        1 / 0
    except ZeroDivisionError:
        log.exception("round failed")
    (record,) = _lines(stream)
    assert record["message"] == "round failed" and record["level"] == "ERROR"
    assert record["exc_info"].startswith("Traceback") and "ZeroDivisionError: division by zero" in record["exc_info"]


def test_text_format_is_unchanged(stream):
    assert TEXT_FORMAT == "%(asctime)s %(levelname)s %(name)s: %(message)s"  # daemon/cli.py's format until now
    configure_logging("warning", "text", lambda: {"ignored": 1}, stream=stream)
    log.info("not shown")
    log.warning("drain took %.0fs", 12.3)
    (line,) = stream.getvalue().splitlines()
    # WARN: hivemind renames WARNING once it is imported (by an earlier test, or the node)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} WARN(ING)? tests\.logs: drain took 12s", line), line


def test_second_call_replaces_the_handler(stream):
    configure_logging("info", "text", None, stream=io.StringIO())
    configure_logging("info", "json", None, stream=stream)
    log.info("once")
    assert len(_lines(stream)) == 1


@pytest.mark.parametrize("level, fmt", [("info", "xml"), ("verbose", "json")])
def test_bad_level_or_format(level, fmt):
    with pytest.raises(ValueError, match="log (level|format)"):
        configure_logging(level, fmt, None)


def test_status_context_reads_the_board(stream):
    board = StatusBoard(run_id="r")
    configure_logging("info", "json", status_context(board), stream=stream)
    log.info("joining")
    board.update(peer_id="QmPeer", state=State.TRAINING, outer_step=5, inner_step=17)
    log.info("training")
    before, after = _lines(stream)
    assert before["state"] == "JOINING" and before["outer_step"] == 0 and "peer_id" not in before
    assert (after["peer_id"], after["state"], after["outer_step"], after["inner_step"]) == ("QmPeer", "TRAINING", 5, 17)


@pytest.mark.integration
def test_status_context_is_empty_in_a_forked_child():
    """hivemind forks its children: the board's lock there may be a held copy, so the context must not touch it."""
    context = status_context(StatusBoard(peer_id="QmPeer"))
    assert context()["peer_id"] == "QmPeer"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report what the context returns, then leave without pytest's cleanup
        try:
            os.write(write, json.dumps(context()).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        child = f.read()
    os.waitpid(pid, 0)
    assert json.loads(child) == {}
