"""Pages of plain text for a PDF: lines wrapped and set in Courier, one content stream per page.

Courier is one of the 14 fonts every PDF reader has, so nothing is embedded; all its glyphs are
600/1000 of the font size wide, so a line is wrapped to the page exactly without font metrics.
Its encoding (WinAnsi, Windows-1252) covers Latin-1, curly quotes and dashes; any other character
is shown as "?" and counted, so that the page can say so.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

from pypdf.generic import DictionaryObject, NameObject

CHAR_WIDTH = 0.6  # of the font size: every Courier glyph
MARGIN = 54.0  # points: 3/4 inch
SIZES = {"title": 13.0, "heading": 11.0, "text": 9.0, "quote": 9.0}
FONTS = {"title": "/F2", "heading": "/F2", "text": "/F1", "quote": "/F3"}  # F1 Courier, F2 bold, F3 oblique


@dataclass(frozen=True)
class Line:
    """A paragraph to set: its text, its style (title, heading, text, quote) and its indent in characters."""

    text: str
    style: str = "text"
    indent: int = 0
    space_before: float = 0.0  # points of blank space above it


def font_resources() -> DictionaryObject:
    """The /Font resources the pages' streams name: Courier, Courier-Bold, Courier-Oblique."""
    def font(name: str) -> DictionaryObject:
        return DictionaryObject({NameObject("/Type"): NameObject("/Font"), NameObject("/Subtype"): NameObject("/Type1"),
                                 NameObject("/BaseFont"): NameObject(name),
                                 NameObject("/Encoding"): NameObject("/WinAnsiEncoding")})

    return DictionaryObject({NameObject("/F1"): font("/Courier"), NameObject("/F2"): font("/Courier-Bold"),
                             NameObject("/F3"): font("/Courier-Oblique")})


def encode(text: str) -> tuple[bytes, int]:
    """`text` in WinAnsi, and how many of its characters it cannot show (each made "?")."""
    out = bytearray()
    missing = 0
    for ch in text:
        try:
            out += ch.encode("cp1252")
        except UnicodeEncodeError:
            out += b"?"
            missing += 1
    return bytes(out), missing


def lay_out(lines: list[Line], width: float, height: float) -> tuple[list[bytes], int]:
    """The content streams of the pages the lines fill, and the number of characters shown as "?"."""
    pages: list[list[bytes]] = [[]]
    y = height - MARGIN
    missing = 0
    for line in lines:
        size = SIZES[line.style]
        leading = size * 1.3
        columns = max(20, int((width - 2 * MARGIN) / (size * CHAR_WIDTH)) - line.indent)
        wrapper = textwrap.TextWrapper(columns, subsequent_indent="  ", break_on_hyphens=False)
        wrapped = wrapper.wrap(line.text) or [""]
        y -= line.space_before
        for piece in wrapped:
            if y - leading < MARGIN:
                pages.append([])
                y = height - MARGIN
            y -= leading
            data, lost = encode(piece)
            missing += lost
            x = MARGIN + line.indent * size * CHAR_WIDTH
            pages[-1].append(b"BT %s %.1f Tf %.2f %.2f Td <%s> Tj ET" % (
                FONTS[line.style].encode(), size, x, y, data.hex().encode()))
    return [b"\n".join(ops) + b"\n" for ops in pages], missing
