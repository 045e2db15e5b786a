"""What ranks send is data: text from a rank (a hostname, an op, a role, an alert's message) is
shown to a person with its control characters replaced, so none reaches a terminal as a control
sequence (an OSC 52 clipboard write, a screen clear, a window title). The TUI (tui/core.plain) and
`tracetop query`'s table use it; JSON output escapes them itself, CSV keeps them when written to a
file (it is data for a program) and replaces them on a terminal."""

from __future__ import annotations

import re

#: C0 and C1 control characters (ESC, BEL, CSI, OSC, ...) but tab and newline
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
#: the same with tab and newline: a one-line cell of a table
CONTROL_IN_LINE = re.compile("[\x00-\x1f\x7f-\x9f]")
#: what a control character is shown as
REPLACEMENT = "\ufffd"


def printable(text: str, *, one_line: bool = False) -> str:
    """``text`` with every control character (and, with one_line, tab and newline) as U+FFFD."""
    return (CONTROL_IN_LINE if one_line else CONTROL).sub(REPLACEMENT, text)
