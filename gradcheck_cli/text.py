"""Text from outside (a scenario name, a config path, a call keyword, a message raised by user code, a report
read by ``merge``) made safe to show: every character that is not printable is written as its escape, the way
Python's ``repr`` writes it (ESC as the four characters ``\\x1b``, U+202E as ``\\u202e``). The reports for people
(the terminal, HTML, JUnit) pass their text through ``visible`` where they take it in; the JSON report keeps the
text exact (json escapes it) but for lone surrogates (``text_only``). Imports nothing."""
from __future__ import annotations


def visible(text: str) -> str:
    """``text`` with each character ``str.isprintable`` rejects escaped as ``repr`` escapes it: C0 controls
    (NUL, backspace, ESC, tab, newline, ...), DEL, the C1 controls 0x80-0x9f, the bidi controls (U+200E, U+200F,
    U+202A-U+202E, U+2066-U+2069) and every other format character, line and paragraph separators, lone
    surrogates, noncharacters and unassigned code points. What is left is printable, hence valid XML 1.0, never a
    terminal command, and never reorders what follows it. Backslashes are kept as they are (a path's ``\\`` stays
    one), so a literal ``\\x1b`` in the text reads the same as an escaped ESC."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def text_only(text: str) -> str:
    """``text`` exact but for lone surrogates (no text at all: UTF-8 cannot encode one and a JSON reader may refuse
    one; Python decodes a file name's byte that is not UTF-8 to one, and user code may raise one), each written as
    its escape, ``\\udcff``."""
    if not any(0xD800 <= ord(ch) <= 0xDFFF for ch in text):
        return text
    return "".join(repr(ch)[1:-1] if 0xD800 <= ord(ch) <= 0xDFFF else ch for ch in text)


def visible_all(value):
    """``value`` (a JSON report, or any part of one) with every string in it, keys included, passed through
    ``visible``; numbers, booleans and None unchanged."""
    if isinstance(value, str):
        return visible(value)
    if isinstance(value, dict):
        return {visible_all(k): visible_all(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(visible_all(v) for v in value)
    return value


def shell_word(word: str) -> str:
    """``word`` as one word of a POSIX shell command that stays visible: ``shlex.quote`` when it is printable,
    otherwise bash's and zsh's ANSI-C quoting (``$'dir\\x1b[2J/c.yaml'``), which types back to the exact text
    (a byte a file name held that is not UTF-8, decoded by Python as a surrogate escape, as that byte)."""
    import shlex
    if word.isprintable():
        return shlex.quote(word)
    out = []
    for ch in word:
        code = ord(ch)
        if ch in "\\'":
            out.append("\\" + ch)
        elif ch.isprintable():
            out.append(ch)
        elif code < 0x80 or 0xDC80 <= code <= 0xDCFF:  # ASCII, or an undecodable byte of a file name
            out.append(f"\\x{code & 0xFF:02x}")
        else:
            out.append(f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}")
    return "$'" + "".join(out) + "'"
