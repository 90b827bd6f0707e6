"""The overview's small charts, drawn as SVG on the server (no JavaScript, no library):
stacked bars and lines, each with a scale (0, half, the peak, in its unit), the time
at both ends and the middle, a legend, and each value in a tooltip."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from django.utils.functional import Promise
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

WIDTH, HEIGHT = 340, 150  # four abreast at 1920 px, two at 1280 px
LEFT, RIGHT, TOP, BOTTOM = 60, 8, 10, 22  # room for the scale and the time labels
Label = str | Promise  # a text, translated or not
Series = tuple[Label, str, Sequence[float | None]]  # label, colour, one value per bar
#: The tops a scale of seconds takes (the first at or above its peak): the top and its
#: half read as round numbers ("104.4 s" and "52.2 s" were the ticks of a 104.4 s peak).
NICE_SECONDS: tuple[float, ...] = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60)
NICE_SECONDS += (120, 240, 600, 1200, 1800, 3600, 7200, 14400, 28800, 86400)


def _scale(peak: float, unit: Callable[[float], str]) -> tuple[float, SafeString]:
    top = peak if peak > 0 else 1.0
    if unit is count:  # whole numbers at 0, half and the top: an even top, at least 2
        top = float(max(2, math.ceil(top / 2) * 2))
    elif unit is duration:
        top = float(next((nice for nice in NICE_SECONDS if nice >= top), top))
    plot = HEIGHT - TOP - BOTTOM
    ticks = format_html_join(
        "",
        '<line x1="{}" x2="{}" y1="{}" y2="{}" stroke="#d1d5db"/>'
        '<text class="tick-label" x="{}" y="{}" font-size="11" text-anchor="end">{}</text>',
        (
            (LEFT, WIDTH - RIGHT, y, y, LEFT - 5, y + 4, unit(top * share))
            for share in (0.0, 0.5, 1.0)
            for y in [round(TOP + plot * (1 - share))]
        ),
    )
    return top, ticks


def _times(labels: Sequence[Label], count: int) -> SafeString:
    step = (WIDTH - LEFT - RIGHT) / max(count, 1)
    picks = sorted({0, count // 2, count - 1}) if count else []
    return format_html_join(
        "",
        '<text x="{}" y="{}" font-size="11" text-anchor="middle">{}</text>',
        ((round(LEFT + step * (i + 0.5)), HEIGHT - 6, labels[i]) for i in picks),
    )


def _legend(series: Sequence[Series]) -> SafeString:
    return format_html_join(
        " ",
        '<span class="skipqueue-legend"><svg width="10" height="10" aria-hidden="true">'
        '<rect width="10" height="10" fill="{}"/></svg> {}</span>',
        ((colour, label) for label, colour, _values in series),
    )


def _frame(title: Label, series: Sequence[Series], body: SafeString, ticks: SafeString,
           times: SafeString) -> SafeString:  # fmt: skip
    return format_html(
        '<figure class="skipqueue-chart"><figcaption><b>{}</b> {}</figcaption>'
        '<svg width="{}" height="{}" viewBox="0 0 {} {}" role="img" aria-label="{}">'
        "{}{}{}</svg></figure>",
        title,
        _legend(series),
        WIDTH,
        HEIGHT,
        WIDTH,
        HEIGHT,
        title,
        ticks,
        body,
        times,
    )


def bar_chart(
    title: Label, series: Sequence[Series], labels: Sequence[Label], unit: Callable[[float], str]
) -> SafeString:
    """Stacked bars: one bar per label, one colour per series."""
    count = len(labels)
    totals = [sum(values[i] or 0 for _l, _c, values in series) for i in range(count)]
    top, ticks = _scale(max(totals, default=0), unit)
    plot = HEIGHT - TOP - BOTTOM
    step = (WIDTH - LEFT - RIGHT) / max(count, 1)
    rects = []
    for i in range(count):
        base = float(TOP + plot)
        for label, colour, values in series:
            value = values[i] or 0
            height = plot * value / top
            if value:
                rects.append(
                    format_html(
                        '<rect x="{}" y="{}" width="{}" height="{}" fill="{}">'
                        "<title>{}: {} {}</title></rect>",
                        round(LEFT + step * i + 1, 1),
                        round(base - height, 1),
                        round(max(step - 2, 1), 1),
                        round(height, 1),
                        colour,
                        labels[i],
                        unit(value),
                        label,
                    )
                )
            base -= height
    return _frame(title, series, mark_safe("".join(rects)), ticks, _times(labels, count))  # noqa: S308  (built by format_html)


def line_chart(
    title: Label, series: Sequence[Series], labels: Sequence[Label], unit: Callable[[float], str]
) -> SafeString:
    """Lines, one per series; a bar without a value (None) breaks its line."""
    count = len(labels)
    peak = max((v for _l, _c, values in series for v in values if v is not None), default=0.0)
    top, ticks = _scale(peak, unit)
    plot = HEIGHT - TOP - BOTTOM
    step = (WIDTH - LEFT - RIGHT) / max(count, 1)
    parts = []
    for label, colour, values in series:
        points: list[str] = []
        runs: list[list[str]] = [points]
        for i, value in enumerate(values):
            if value is None:
                points = []
                runs.append(points)
                continue
            x, y = round(LEFT + step * (i + 0.5), 1), round(TOP + plot * (1 - value / top), 1)
            points.append(f"{x},{y}")
            parts.append(
                format_html(
                    '<circle cx="{}" cy="{}" r="2" fill="{}"><title>{}: {} {}</title></circle>',
                    x,
                    y,
                    colour,
                    labels[i],
                    unit(value),
                    label,
                )
            )
        for run in runs:
            if len(run) > 1:
                parts.append(
                    format_html(
                        '<polyline points="{}" fill="none" stroke="{}" stroke-width="2"/>',
                        " ".join(run),
                        colour,
                    )
                )
    return _frame(title, series, mark_safe("".join(parts)), ticks, _times(labels, count))  # noqa: S308  (built by format_html)


def count(value: float) -> str:
    """A count that fits the scale's margin: 950, 12.5k, 3.2M."""
    if value >= 1_000_000:
        return f"{value / 1_000_000:.1f}M"
    if value >= 10_000:
        return f"{value / 1000:.1f}k"
    return f"{value:,.0f}"


def percent(value: float) -> str:
    return f"{value:.0%}"


def duration(value: float) -> str:
    """Seconds in the unit a person reads: 850 ms, 4.2 s, 3 min, 2.5 h."""
    if value == 0:
        return "0 s"
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 120:
        return f"{value:.1f}".removesuffix(".0") + " s"
    if value < 7200:
        return f"{value / 60:.0f} min"
    return f"{value / 3600:.1f}".removesuffix(".0") + " h"
