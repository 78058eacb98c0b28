"""The dashboard's colours and fonts, made from the front end's own theme.

Every colour is relative to what the page around it already is, so one HTML reads in
JupyterLab and Notebook 7 light and dark, in nbconvert's HTML (``--theme dark`` too),
and in a page that follows ``prefers-color-scheme`` with no JupyterLab variables:

- text keeps the theme's text colour (no colour is set);
- a state's colour (``running``, ``failed``, stderr) is its hue mixed half-and-half with
  the theme's text colour (``color-mix(.., currentColor)``): darker on a light page,
  lighter on a dark one; every hue here meets WCAG AA (4.5:1, at least 4.7 computed)
  against JupyterLab's light and dark backgrounds, also on a failed row's tint
  (tests/dashboard/test_browser_theme.py measures running, done, failed and stderr in the page);
- backgrounds are translucent tints over the theme's background, never a light colour
  of their own (a light pink under a dark theme's white text read at 1.2:1);
- a front end that drops a declaration it does not know (an old browser, a sanitizer)
  shows the theme's text colour instead: plain, still readable. JupyterLab's sanitizer
  (a saved notebook it does not trust) drops ``color-mix``, ``var()`` and the charts'
  filter (checked): its states are in the text colour, the failed row keeps its tint,
  the logs their plain ``monospace``.

The frozen charts are ``<img>`` of SVG, which cannot see the page's colours: they are
drawn with dark ink on a transparent background, each label on a halo of the paper's
colour, and a dark JupyterLab theme (``--jp-shadow-base-lightness``: 0 light, 32 dark)
inverts them (:data:`CHART_IMAGE_FILTER`). Without it (a sanitized page) the halos keep
the labels readable on any background.
"""

from __future__ import annotations

__all__ = [
    "CHART_IMAGE_FILTER",
    "CODE_FONT",
    "FAILED_ROW",
    "LIVE_CSS",
    "MUTED",
    "STDERR",
    "TRACK",
    "ink",
    "state_colour",
]

MIX = 55  # percent of the hue in a state's colour; the rest is the theme's text colour

STATE_HUES = {
    "queued": "#888888",
    "running": "#1f6fb4",
    "done": "#2a8a2a",
    "failed": "#c62828",
    "interrupted": "#d9822b",
    "freed": "#d9822b",
    "dead": "#a31515",
    "replaced": "#a31515",  # dead, and a new process took its place
    "missing": "#a31515",  # dead with its host, which was lost (a replacement host brings it)
    "waiting": "#b8860b",
    "debugging": "#7b1fa2",
}


def ink(hue: str) -> str:
    """``hue`` as text on this theme: mixed with the theme's own text colour."""
    return f"color-mix(in srgb,{hue} {MIX}%,currentColor)"


def state_colour(state_text: str) -> str:
    """The colour of a state as shown: ``waiting in all_reduce (3 s)``, ``dead: new process``."""
    return ink(STATE_HUES.get(state_text.split()[0].rstrip(":"), "#888888"))


FAILED_ROW = "rgba(198,40,40,0.15)"  # a failed rank's row: a red tint over the theme
MUTED = "color-mix(in srgb,currentColor 70%,transparent)"  # hosts, notes: the text, fainter
TRACK = "color-mix(in srgb,currentColor 15%,transparent)"  # a progress bar's empty part
BAR = ink("#1f6fb4")
STDERR = ink("#b71c1c")
# (no quoted family names: this goes inside style='...'). The plain first declaration is
# for a sanitized page (an untrusted notebook), whose sanitizer drops var(); others use
# the second, the theme's code font.
CODE_FONT = (
    "font-family:monospace;"
    "font-family:var(--jp-code-font-family,ui-monospace,Menlo,Consolas,monospace)"
)
_DARK = "var(--jp-shadow-base-lightness,0)/32"  # 0 in JupyterLab's light themes, 1 in dark
CHART_IMAGE_FILTER = f"invert(calc({_DARK})) hue-rotate(calc(180deg*{_DARK}))"

# the live widget's stylesheet (anywidget's ``_css``): what dashboard.js draws itself
LIVE_CSS = (
    f".nbddp-live .nbddp-stderr{{color:{STDERR}}}"
    f".nbddp-live .nbddp-dropped{{color:{MUTED}}}"
    f".nbddp-live .nbddp-pane pre{{{CODE_FONT}}}"
    f".nbddp-live .nbddp-folded{{cursor:pointer}}"
    f".nbddp-live .nbddp-values{{color:{MUTED}}}"
)
