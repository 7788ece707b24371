"""The glyphs of a PDF page and where they are on it.

pypdf walks the page's content stream (form XObjects included) and reports every operator to a
visitor with the current transformation matrix; this module keeps the text state the operators
set (font, size, spacing, text and line matrices, as PDF 32000-1 section 9.4 defines them) and
advances the pen by each glyph's width, so that every glyph gets its quadrilateral on the page.
Fonts are decoded and measured with pypdf's own font model, the one its text extraction uses, so
a glyph's text is the text that extraction gives for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pypdf import PageObject
from pypdf.generic import ArrayObject, DictionaryObject, NameObject, NumberObject, FloatObject

try:  # pypdf 7: the font model of its text extraction (widths, encodings, ToUnicode maps); pdf.py checks
    from pypdf.generic._font import Font
except ImportError:  # another pypdf, where it lives elsewhere (pyproject asks for 7)
    Font = None

IDENTITY = (1.0, 0.0, 0.0, 1.0, 0.0, 0.0)
_ASCENT, _DESCENT = 0.8, -0.2  # of the font size, where a font does not say (base fonts do)


@dataclass(frozen=True)
class Glyph:
    """One glyph shown on a page: its text and its quadrilateral in default user space."""

    text: str  # the Unicode text it stands for ("" where the font maps it to nothing)
    quad: tuple[float, ...]  # x1 y1 x2 y2 x3 y3 x4 y4: upper left, upper right, lower left, lower right
    line: int  # glyphs that share a baseline (in the order they were drawn) share a number
    size: float  # the font size on the page (user-space units), for gaps and tolerances
    measured: bool  # its width came from the font (not a default guess)

    @property
    def start(self) -> tuple[float, float]:
        """The glyph's origin side, at mid height."""
        q = self.quad
        return (q[0] + q[4]) / 2, (q[1] + q[5]) / 2

    @property
    def end(self) -> tuple[float, float]:
        q = self.quad
        return (q[2] + q[6]) / 2, (q[3] + q[7]) / 2


def mult(a: tuple[float, ...], b: tuple[float, ...]) -> tuple[float, ...]:
    """The product a x b of two PDF matrices [a b c d e f] (a applied first)."""
    return (a[0] * b[0] + a[1] * b[2], a[0] * b[1] + a[1] * b[3],
            a[2] * b[0] + a[3] * b[2], a[2] * b[1] + a[3] * b[3],
            a[4] * b[0] + a[5] * b[2] + b[4], a[4] * b[1] + a[5] * b[3] + b[5])


def apply(m: tuple[float, ...], x: float, y: float) -> tuple[float, float]:
    return x * m[0] + y * m[2] + m[4], x * m[1] + y * m[3] + m[5]


def _number(value, default: float = 0.0) -> float:
    return float(value) if isinstance(value, (int, float, NumberObject, FloatObject)) else default


def _matrix(values) -> tuple[float, ...] | None:
    try:
        m = tuple(float(v) for v in values[:6])
    except (TypeError, ValueError):
        return None
    return m if len(m) == 6 else None


@dataclass
class _TextState:
    font: object = None  # pypdf Font, or None before the first Tf
    size: float = 0.0
    char_spacing: float = 0.0
    word_spacing: float = 0.0
    scale: float = 1.0
    leading: float = 0.0
    rise: float = 0.0

    def copy(self) -> _TextState:
        return _TextState(self.font, self.size, self.char_spacing, self.word_spacing, self.scale, self.leading,
                          self.rise)


@dataclass
class _Frame:
    """A content stream being walked: the page's, or a form XObject's inside it."""

    resources: DictionaryObject
    matrix: tuple[float, ...]  # maps the stream's own user space (pypdf restarts its CTM at identity) to the page's
    saved: list = field(default_factory=list)  # text states saved by q
    outer_state: _TextState | None = None  # a form's: the text state at its Do, given back after it


class _Walker:
    def __init__(self, page: PageObject) -> None:
        self.glyphs: list[Glyph] = []
        self.fonts: dict[int, object] = {}
        self.frames = [_Frame(_resources(page), IDENTITY)]
        self.state = _TextState()
        self.tm = self.tlm = IDENTITY
        self.line = 0
        self.pen: tuple[float, float] | None = None  # where the last glyph ended (user space)
        self.direction: tuple[float, float] = (1.0, 0.0)
        self.forms: list[bool] = []  # per Do being walked: whether it pushed a frame (a form XObject)

    # -- the visitor --------------------------------------------------------------------------

    def before(self, op: bytes, operands: list, cm: list, tm: list) -> None:
        handler = self.HANDLERS.get(op)
        if handler is not None:
            handler(self, operands, tuple(float(v) for v in cm))

    def after(self, op: bytes, operands: list, cm: list, tm: list) -> None:
        if op == b"Do" and self.forms and self.forms.pop():
            self.state = self.frames.pop().outer_state

    # -- operators ----------------------------------------------------------------------------

    def _q(self, operands, cm) -> None:
        self.frames[-1].saved.append(self.state.copy())

    def _Q(self, operands, cm) -> None:
        if self.frames[-1].saved:
            self.state = self.frames[-1].saved.pop()

    def _bt(self, operands, cm) -> None:
        self.tm = self.tlm = IDENTITY

    def _tm(self, operands, cm) -> None:
        m = _matrix(operands)
        self.tm = self.tlm = m if m is not None else IDENTITY

    def _td(self, operands, cm) -> None:
        tx, ty = (_number(operands[0]), _number(operands[1])) if len(operands) >= 2 else (0.0, 0.0)
        self.tm = self.tlm = mult((1, 0, 0, 1, tx, ty), self.tlm)

    def _td_leading(self, operands, cm) -> None:
        if len(operands) >= 2:
            self.state.leading = -_number(operands[1], -self.state.leading)
        self._td(operands, cm)

    def _t_star(self, operands, cm) -> None:
        self._td([0, -self.state.leading], cm)

    def _tf(self, operands, cm) -> None:
        if len(operands) < 2:
            return
        fonts = self.frames[-1].resources.get("/Font")
        font_dict = fonts.get_object().get(operands[0]) if fonts is not None else None
        self.state.font = self._font(font_dict.get_object()) if font_dict is not None else None
        self.state.size = _number(operands[1], self.state.size)

    def _tc(self, operands, cm) -> None:
        self.state.char_spacing = _number(operands[0]) if operands else 0.0

    def _tw(self, operands, cm) -> None:
        self.state.word_spacing = _number(operands[0]) if operands else 0.0

    def _tz(self, operands, cm) -> None:
        self.state.scale = _number(operands[0], 100.0) / 100 if operands else 1.0

    def _tl(self, operands, cm) -> None:
        self.state.leading = _number(operands[0]) if operands else 0.0

    def _ts(self, operands, cm) -> None:
        self.state.rise = _number(operands[0]) if operands else 0.0

    def _tj(self, operands, cm) -> None:
        if operands:
            self._show(operands[0], cm)

    def _quote(self, operands, cm) -> None:
        self._t_star([], cm)
        self._tj(operands, cm)

    def _double_quote(self, operands, cm) -> None:
        if len(operands) >= 3:
            self.state.word_spacing = _number(operands[0])
            self.state.char_spacing = _number(operands[1])
            self._t_star([], cm)
            self._show(operands[2], cm)

    def _tj_array(self, operands, cm) -> None:
        if not operands or not isinstance(operands[0], ArrayObject):
            return
        for item in operands[0]:
            if isinstance(item, (int, float, NumberObject, FloatObject)):
                # a number moves the pen back by thousandths of the font size
                self.tm = mult((1, 0, 0, 1, -float(item) / 1000 * self.state.size * self.state.scale, 0), self.tm)
            elif isinstance(item, (str, bytes)) and not isinstance(item, NameObject):
                self._show(item, cm)

    def _do(self, operands, cm) -> None:
        frame = self.frames[-1]
        xobjects = frame.resources.get("/XObject")
        form = xobjects.get_object().get(operands[0]) if xobjects is not None and operands else None
        form = form.get_object() if form is not None else None
        if form is None or form.get("/Subtype") != "/Form":
            self.forms.append(False)
            return
        matrix = _matrix(form.get("/Matrix", IDENTITY)) or IDENTITY
        resources = form.get("/Resources")
        self.frames.append(_Frame(resources.get_object() if resources is not None else frame.resources,
                                  mult(matrix, mult(cm, frame.matrix)), outer_state=self.state))
        self.state = self.state.copy()
        self.forms.append(True)

    HANDLERS = {
        b"q": _q, b"Q": _Q, b"BT": _bt, b"Tm": _tm, b"Td": _td, b"TD": _td_leading, b"T*": _t_star,
        b"Tf": _tf, b"Tc": _tc, b"Tw": _tw, b"Tz": _tz, b"TL": _tl, b"Ts": _ts, b"Tj": _tj, b"'": _quote,
        b'"': _double_quote, b"TJ": _tj_array, b"Do": _do,
    }

    # -- glyphs -------------------------------------------------------------------------------

    def _font(self, font_dict: DictionaryObject):
        key = id(font_dict)
        if key not in self.fonts:
            try:
                self.fonts[key] = Font.from_font_resource(font_dict)
            except Exception:  # a damaged font: its glyphs cannot be measured
                self.fonts[key] = None
        return self.fonts[key]

    def _show(self, string, cm) -> None:
        state = self.state
        font = state.font
        if font is None:  # no font: the pen cannot be moved; nothing shown can be placed
            return
        raw = string.original_bytes if isinstance(string, str) and hasattr(string, "original_bytes") else string
        if isinstance(raw, str):
            raw = raw.encode("latin-1", "replace")
        descriptor = font.font_descriptor
        ascent = (descriptor.ascent / 1000) if getattr(descriptor, "ascent", 0) else _ASCENT
        descent = (descriptor.descent / 1000) if getattr(descriptor, "descent", 0) else _DESCENT
        if ascent - descent < 0.5:
            ascent, descent = _ASCENT, _DESCENT
        usable = font.sub_type != "Type3" and getattr(font, "interpretable", True)
        size, th = state.size, state.scale
        # m maps text space at the pen's start to the page; each glyph moves the pen along m's x axis
        m = mult(self.tm, mult(tuple(cm), self.frames[-1].matrix))
        ux, uy, vx, vy = m[0], m[1], m[2], m[3]
        low, high = descent * size + state.rise, ascent * size + state.rise
        on_page = abs(size * (vy if abs(vy) > abs(vx) else vx)) or size
        widths, default = font.character_widths, font.character_widths.get("default", 500)
        character_map, dict_encoding = font.character_map, isinstance(font.encoding, dict)
        pen = 0.0
        for code, char, single_space in _codes(raw, font):
            is_space = char == font.space_char
            width = font.space_width if is_space else widths.get(char, default)
            text = character_map.get(code if dict_encoding else char, code if dict_encoding else char)
            advance = width / 1000 * size * th
            x, y = m[4] + pen * ux, m[5] + pen * uy
            llx, lly, ulx, uly = x + low * vx, y + low * vy, x + high * vx, y + high * vy
            dx, dy = advance * ux, advance * uy
            self._place(text, (ulx, uly, ulx + dx, uly + dy, llx, lly, llx + dx, lly + dy), on_page,
                        usable and (is_space or char in widths))
            pen += advance + (state.char_spacing + (state.word_spacing if single_space else 0.0)) * th
        self.tm = mult((1, 0, 0, 1, pen, 0), self.tm)

    def _place(self, text: str, quad: tuple[float, ...], size: float, measured: bool) -> None:
        x, y = (quad[0] + quad[4]) / 2, (quad[1] + quad[5]) / 2
        if self.pen is not None:
            dx, dy = x - self.pen[0], y - self.pen[1]
            ux, uy = self.direction
            along, across = dx * ux + dy * uy, -dx * uy + dy * ux
            if abs(across) > 0.3 * size or along < -size:
                self.line += 1
        else:
            self.line += 1
        ex, ey = (quad[2] + quad[6]) / 2, (quad[3] + quad[7]) / 2
        length = ((ex - x) ** 2 + (ey - y) ** 2) ** 0.5
        if length > 1e-6:
            self.direction = ((ex - x) / length, (ey - y) / length)
        self.pen = (ex, ey)
        self.glyphs.append(Glyph(text, quad, self.line, size, measured))


def _codes(raw: bytes, font):
    """(code, the font's character for it, whether it is the single-byte space) per glyph, as pypdf's
    extraction decodes them."""
    if isinstance(font.encoding, str):
        try:
            text = raw.decode(font.encoding, "surrogatepass")
        except UnicodeDecodeError:
            text = raw.decode(font.encoding, "replace")
        single_byte = len(text) == len(raw)
        for ch in text:
            yield ch, ch, single_byte and ch == " "
    else:
        for byte in raw:
            mapped = font.encoding.get(byte, chr(byte))
            yield mapped, chr(byte), byte == 32


def _resources(page: PageObject) -> DictionaryObject:
    resources = page.get("/Resources")
    return resources.get_object() if resources is not None else DictionaryObject()


def page_glyphs(page: PageObject) -> list[Glyph]:
    """Every glyph the page shows, in content-stream order (the order pypdf extracts text in)."""
    if Font is None:
        return []
    walker = _Walker(page)
    page.extract_text(visitor_operand_before=walker.before, visitor_operand_after=walker.after)
    return walker.glyphs
