"""Logging set-up for dilocox-node: today's text lines, or one JSON object per line for log shippers.

``configure_logging("info", "json", status_context(board))`` makes every record a line such as
``{"time": "YYYY-MM-DDTHH:MM:SS.mmmZ", "level": "INFO", "logger": "dilocox.daemon.node", "message": "...",
"peer_id": "Qm...", "state": "TRAINING", "outer_step": 12, "inner_step": 40}``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from datetime import datetime, timezone
from typing import Callable, TextIO

from dilocox.daemon.status import StatusBoard

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LEVELS = {10: "DEBUG", 20: "INFO", 30: "WARNING", 40: "ERROR", 50: "CRITICAL"}
FORMATS = ("text", "json")

# attributes every LogRecord has: anything else on a record came from ``extra=`` and is emitted as a key
_RECORD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (ISO 8601 UTC, ms), level, logger, message, the context's keys, the
    record's ``extra=`` keys, and exc_info / stack_info text when present. Never raises: a message whose args do
    not fit its format is emitted as the raw format and args, values json cannot encode become strings, and
    non-finite floats become the strings "NaN" / "Infinity" / "-Infinity" (the output stays strict JSON)."""

    def __init__(self, context: Callable[[], dict] | None = None):
        super().__init__()
        self.context = context

    def format(self, record: logging.LogRecord) -> str:
        try:
            message = record.getMessage()
        except Exception:  # e.g. logger.info("%d", "x"): keep the record rather than lose it
            message = f"{record.msg} {record.args!r}"
        out = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            # by number: hivemind renames WARNING to WARN process-wide when imported
            "level": LEVELS.get(record.levelno, record.levelname),
            "logger": record.name,
            "message": message,
        }
        if self.context is not None:
            try:
                extra = self.context()
                for k, v in extra.items():
                    out.setdefault(str(k), v)  # the record's own keys win over the context's
            except Exception as e:  # a broken context must not cost the record
                out["context_error"] = f"{type(e).__name__}: {e}"
        for k, v in vars(record).items():
            if k not in _RECORD_ATTRS and not k.startswith("_"):
                out.setdefault(k, v)
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc_info"] = record.exc_text
        if record.stack_info:
            out["stack_info"] = self.formatStack(record.stack_info)
        return _dumps(out)


def _dumps(obj: dict) -> str:
    try:
        return json.dumps(obj, default=str, allow_nan=False)
    except ValueError:  # a NaN or infinity somewhere (loss before the first step): spell them as strings
        return json.dumps(_finite(obj), default=str, allow_nan=False)


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class _Handler(logging.StreamHandler):
    """Marks the handler configure_logging installed, so a second call replaces it instead of adding one."""


def configure_logging(level: str, fmt: str, context: Callable[[], dict] | None = None,
                      stream: TextIO | None = None) -> logging.Handler:
    """Log records at ``level`` (debug, info, warning, error) and above to ``stream`` (default: stderr) as
    ``fmt``: "text" (TEXT_FORMAT, as before) or "json" (JsonFormatter). ``context`` (json only) is called once per
    record, from the logging thread, and must be cheap and never block; its keys are added to the line, and if it
    raises the line is emitted without them. Replaces a handler an earlier call installed; leaves other root
    handlers alone. Returns the installed handler. Raises ValueError for an unknown level or format."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: expected one of {', '.join(FORMATS)}")
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"log level {level!r}: expected debug, info, warning or error")
    handler = _Handler(sys.stderr if stream is None else stream)
    handler.setFormatter(JsonFormatter(context) if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
    return handler


def status_context(board: StatusBoard) -> Callable[[], dict]:
    """A context for configure_logging: the node's peer_id (once known), state, outer_step and inner_step, read
    from one board snapshot per record (a copy under the board's lock, microseconds). In a process forked from
    this one (hivemind's DHT and averager children) it returns {}: the board there is a stale copy, and its lock
    may have been copied while held, which would hang the child's first log record."""
    owner = os.getpid()

    def context() -> dict:
        if os.getpid() != owner:
            return {}
        s = board.snapshot()
        fields = {"state": s.state.value, "outer_step": s.outer_step, "inner_step": s.inner_step}
        if s.peer_id:
            fields["peer_id"] = s.peer_id
        return fields

    return context


def route_hivemind_logs() -> None:
    """Send hivemind's records through the root logger (and so through our format) instead of hivemind's own
    colored handler. Imports hivemind: call it after the node's modules are loaded."""
    from hivemind.utils.logging import use_hivemind_log_handler

    use_hivemind_log_handler("nowhere")
