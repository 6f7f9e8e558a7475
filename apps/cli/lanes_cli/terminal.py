r"""What the `lanes` command does to untrusted text before a terminal sees it.

Event text (an evidence summary, a `--reason`, a node name, a log line) is written by whoever published the
event, a node agent or a user's command. Printed raw, an escape sequence recolours or rewrites the terminal,
a newline or a carriage return forges a line that looks like another event, and a bidi override reorders
what a reader sees. Every piece of such text goes through `shown` on its way out: control and format
characters become visible escapes (`\x1b`, `\n`, `\u202e`), so one event stays one line and reads as
what was stored. JSON output stays exact instead: `print_json` writes it as ASCII, every such character
escaped inside its strings.
Pure: no I/O but the console handed in.
"""

from __future__ import annotations

import json
import unicodedata

from rich.console import Console
from rich.markup import escape

_NAMED = {"\n": "\\n", "\r": "\\r"}
_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})
"""Controls (C0, DEL, C1), format characters (bidi overrides and isolates, zero-width ones), line and
paragraph separators, and lone surrogates (which a terminal's encoder cannot even write)."""


def shown(text: str) -> str:
    """The text with every control and format character as a visible escape; a tab stays a tab."""
    if text.isprintable():  # nearly every string: nothing to do
        return text
    return "".join(_visible(char) for char in text)


def _visible(char: str) -> str:
    if char == "\t" or unicodedata.category(char) not in _ESCAPED_CATEGORIES:
        return char
    if named := _NAMED.get(char):
        return named
    code = ord(char)
    if code <= 0xFF:  # noqa: PLR2004 - the Latin-1 range: C0, DEL and C1 as \xNN
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"  # noqa: PLR2004 - the BMP


def markup(text: str) -> str:
    """Untrusted text for a rich markup string: escaped for the terminal, and `[red]` in it is not markup."""
    return escape(shown(text))


def print_line(console: Console, text: str) -> None:
    """One line of untrusted text, as it is: no markup, no `:emoji:` codes, no highlighting, never wrapped."""
    console.print(shown(text), markup=False, emoji=False, highlight=False, soft_wrap=True)


def print_json(console: Console, value: object) -> None:
    r"""A JSON document whose strings may hold untrusted text, every non-ASCII character \u-escaped.

    Exact: it parses back to the same value. `json.dumps` escapes C0 controls itself, but not C1 controls
    (U+009B opens an escape sequence on many terminals) nor bidi overrides, so ASCII is what reaches stdout.
    """
    console.print_json(json.dumps(value), ensure_ascii=True)
