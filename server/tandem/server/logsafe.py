"""Log lines a client cannot forge, shared by the engine's and the proxy's CLIs.

A request's path reaches the log decoded: ``GET /v1/models%0aFAKE LINE`` would otherwise
write a second line of the client's choosing, with no key needed (issue 26). Every control
character (C0, DEL, C1, the Unicode line and paragraph separators) in a formatted message is
written as its escape (``\\x0a``, ``\\u2028``), so one record is always one line.
"""

from __future__ import annotations

import argparse
import logging
import re

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape_controls(text: str) -> str:
    """``text`` with every control character escaped: safe inside one log line."""
    return _CONTROL.sub(_escape, text)


class EscapeControls(logging.Filter):
    """A handler filter: the record's message formatted once and escaped, whatever logger
    and arguments it came from (a traceback, formatted by the handler, keeps its lines)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        escaped = escape_controls(message)
        if escaped != message:
            record.msg, record.args = escaped, ()
        return True


def configure_logging(level: str) -> None:
    """``logging.basicConfig`` for a server process, with ``EscapeControls`` on its handler."""
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, EscapeControls) for f in handler.filters):
            handler.addFilter(EscapeControls())


def add_log_level_argument(parser: argparse.ArgumentParser) -> None:
    """``--log-level``, the one ``configure_logging`` reads (serve, proxy and epp alike)."""
    parser.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="the least severe log records written",
    )
