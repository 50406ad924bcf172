"""The category shards of the terminal report (:mod:`memsched.report.text`): one colour and one letter per
memory category, a stacked bar of bytes by category and the legend that names them, as rich renderables (which
key to draw depends on the console: colour, or letters without it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.text import Text

from memsched.report.console import plain
from tracer.categories import ALL_CATEGORIES, MODEL_DATA

# One colour per category, shared by the terminal report and the PNG export (memsched.report.exports.png).
CATEGORY_COLORS: dict[str, str] = {
    "parameter": "#4e79a7",
    "buffer": "#76b7b2",
    "gradient": "#f28e2c",
    "optimizer_state": "#e15759",
    "activation": "#59a14f",
    "temporary": "#edc949",
    "other": "#bab0ab",
}
# One letter per category, for output without colour: the bars are drawn with them and the legends name them.
CATEGORY_SYMBOLS: dict[str, str] = {
    "parameter": "P",
    "buffer": "B",
    "gradient": "G",
    "optimizer_state": "S",
    "activation": "A",
    "temporary": "T",
    "other": "X",
}
# Model data first (the bottom of each stacked bar), then non-model data.
CATEGORY_ORDER: tuple[str, ...] = tuple(c.value for c in ALL_CATEGORIES if c in MODEL_DATA) + tuple(
    c.value for c in ALL_CATEGORIES if c not in MODEL_DATA
)
BAR = "█"
ABOVE = "░"  # the part of a bar between the live bytes at its sample and the highest point of its bucket


class StackedBar:
    """One horizontal bar, one coloured run per category, scaled so that ``scale`` bytes fill the width; then,
    when ``high_bytes`` is given, ``░`` up to it (the highest point between samples).

    A rich renderable: it takes whatever width its table column gives it. Without colour each category's run
    is drawn with its letter (:data:`CATEGORY_SYMBOLS`).
    """

    def __init__(self, by_category: Mapping[str, int], scale: int, *, high_bytes: int = 0) -> None:
        self.by_category = by_category
        self.scale = max(1, scale)
        self.high_bytes = high_bytes

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement(8, options.max_width)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        letters = plain(console)
        text = Text(no_wrap=True, overflow="crop")
        cum, drawn = 0, 0
        for c in CATEGORY_ORDER:
            cum += max(0, self.by_category.get(c, 0))
            # Round cumulative edges, not each run, so runs never add up to more than the bar.
            edge = min(width, round(cum / self.scale * width))
            if edge > drawn:
                key = CATEGORY_SYMBOLS[c] if letters else BAR
                text.append(key * (edge - drawn), style=CATEGORY_COLORS[c])
                drawn = edge
        edge = min(width, round(self.high_bytes / self.scale * width))
        if edge > drawn:
            text.append(ABOVE * (edge - drawn), style="dim")
        yield text


class CategoryLegend:
    """Category keys and labels on one line: ``■ parameter`` in the category's colour, or ``P parameter``
    without colour, where the bars are drawn with the letters (``key_extra``: then also ``░ peak``).

    A rich renderable, because which key to show depends on the console it is printed to.
    """

    def __init__(self, items: Sequence[tuple[str, str]], *, prefix: Text | None = None,
                 key_extra: bool = False) -> None:
        self.items = list(items)
        self.prefix = prefix
        self.key_extra = key_extra

    def text(self, console: Console) -> Text:
        letters = plain(console)
        text = self.prefix.copy() if self.prefix is not None else Text()
        for i, (c, label) in enumerate(self.items):
            if i:
                text.append("  ")
            text.append(CATEGORY_SYMBOLS[c] if letters else "■", style=CATEGORY_COLORS[c])
            text.append(f" {label}")
        if self.key_extra:
            text.append(f"  {ABOVE} peak")
        return text

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement.get(console, options, self.text(console))

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.text(console)
