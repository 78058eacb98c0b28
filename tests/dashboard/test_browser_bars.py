"""The live dashboard's tqdm bars in a real browser, without a kernel: dashboard.js drawn
from a model the test sets. Each running bar has its own toggle (its ranks' positions,
opened by a click), also two bars of one description. Skipped as test_browser.py is."""

from __future__ import annotations

from pathlib import Path

from browser_kit import SKIPS

pytestmark = SKIPS

JS = Path(__file__).parents[2] / "src" / "nbddp" / "dashboard" / "dashboard.js"

MOUNT = """async (source) => {
  const url = URL.createObjectURL(new Blob([source], {type: "text/javascript"}));
  const widget = (await import(url)).default;
  const state = {ranks: [0, 1], header: "", rows: "", charts: "", lines: [], hidden: 0,
                 bars: [], focus: -1};
  const handlers = {};
  window.model = {
    get: (name) => state[name],
    on: (name, f) => { (handlers[name] ||= []).push(f); },
    off: () => {},
    set: (name, value) => {
      state[name] = value;
      (handlers["change:" + name] || []).forEach((f) => f());
    },
  };
  const el = document.createElement("div");
  document.body.append(el);
  widget.render({model: window.model, el});
}"""


def test_two_running_bars_of_one_description_each_open_on_their_own(page):
    """Two ``tqdm(desc="train")`` bars (two occurrences): a click opens the positions of the
    one clicked, not the other's; the opened bar stays open as its text changes."""
    page.set_content("<body></body>")
    page.evaluate(MOUNT, JS.read_text())
    first = ["0-1", "progress", "train: 50%", "rank 0: 5/10\nrank 1: 9/10", "stderr 0 -1 train"]
    second = ["0", "progress", "train: 10%", "rank 0: 1/10\nrank 1: 0/10", "stderr 1 -1 train"]
    page.evaluate("(bars) => window.model.set('bars', bars)", [first, second])
    bars = page.locator(".nbddp-bar-live")
    bars.nth(0).click()
    values = page.locator(".nbddp-values")
    assert values.count() == 1
    assert "rank 0: 5/10" in values.first.text_content()
    first[2], first[3] = "train: 60%", "rank 0: 6/10\nrank 1: 9/10"
    page.evaluate("(bars) => window.model.set('bars', bars)", [first, second])
    assert values.count() == 1  # still open, and only the first bar's
    assert "rank 0: 6/10" in values.first.text_content()
