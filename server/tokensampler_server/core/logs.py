"""Log output on stderr: `--log-format text` (a line for a person) or `json` (one object per line).

A JSON line holds timestamp (UTC, ISO 8601), level, logger, message, request_id while a request
is being served, every field passed with `extra=`, and the traceback as `exception`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from datetime import datetime, timezone

from tokensampler_server.core.request_context import current_request_id

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Attributes every LogRecord has; anything else on a record came from `extra=` (or the filter below).
_RECORD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class RequestIdFilter(logging.Filter):
    """Tags each record with the id of the request being served, where there is one."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            request_id = current_request_id.get()
            if request_id:
                record.request_id = request_id
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "timestamp": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update((key, value) for key, value in vars(record).items() if key not in _RECORD_ATTRIBUTES)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str)


class ClientNoiseFilter(logging.Filter):
    """grpc logs an ERROR with a traceback for things a client does, on which nothing on the server fails: an
    answer it cannot send because its caller has gone (cancelled, past its deadline, disconnected with answers
    unread), metadata whose bytes are not UTF-8 (which it then reads as Latin-1), and a call still open when the
    server stops, whose handler grpc cancels after the grace period (a stream waiting for its client's next message).
    Such records go to DEBUG, so that a client cannot fill the log with tracebacks; any other exception escaping a
    handler stays an ERROR."""

    PREFIXES = ("ExecuteBatchError raised in core by servicer method", "Invalid encoding on")
    CANCELLED_HANDLER = "Exception not handled by _handle_exceptions in servicer method"

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and isinstance(record.msg, str) and (
                record.msg.startswith(self.PREFIXES) or self._cancelled_handler(record)):
            record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True

    def _cancelled_handler(self, record: logging.LogRecord) -> bool:
        return (record.msg.startswith(self.CANCELLED_HANDLER) and record.exc_info is not None
                and isinstance(record.exc_info[1], asyncio.CancelledError))


def configure_logging(level: str, log_format: str) -> None:
    """Sends every log record to stderr at `level` and above, in `log_format` (text or json)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler])
    logging.captureWarnings(True)  # Python warnings too, so a JSON log stays all JSON
    # grpc's Cython layer logs every new connection at DEBUG: noise beside the per-request lines.
    logging.getLogger("grpc._cython").setLevel(max(logging.getLevelName(level), logging.INFO))
    logging.getLogger("grpc._cython.cygrpc").addFilter(ClientNoiseFilter())
