"""A report as a person sees it: rendered in headless Chromium, checked, and photographed.

At each window width the page is checked for what makes a report unreadable (`report_probe.js`
in the package data does the measuring, in the browser, after layout):

- the page scrolls sideways (the document is wider than the window), or a table or chart ends
  past the window's right edge;
- a chart (an SVG with data marks, class "data") draws fewer than two distinct x positions: an
  axis around a single point reads as a broken chart;
- a text of a chart is clipped by the chart's box.

Closed <details> are opened first: a table behind a toggle must fit too. A full-page screenshot
is taken at each width, of the page as it opens (toggles closed).

The driver is the Chromium binary alone, no WebDriver or DevTools client to install: the probe
is injected into a copy of the page and writes its findings into the DOM, which `--dump-dom`
prints after the load event; `--screenshot` takes the picture. Each run gets a fresh profile.

    python scripts/report_browser.py runs/<time>/report.html [--widths 1200,800] [--height H]

writes runs/<time>/screenshots/report-<width>.png (`--shots DIR`: there), prints the findings,
exits 1 on a problem (2: no Chromium, or a bad argument).
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from specdecode.errors import SpecDecodeError

WIDTHS = (1200, 800)
# a bare machine's Chromium: no sandbox (root in a container), no GPU, no network of its own
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars")
INSTALL = "bash scripts/install_chromium.sh (Debian: apt-get install -y chromium fonts-liberation)"
CHROMIUM_ENV = "SPECDECODE_CHROMIUM"  # a Chromium binary to use instead of the one on PATH
PROBE_ID = "specdecode-probe"
MAX_SHOT_HEIGHT = 30000  # px: Chromium's screenshots fail beyond about 2^15


@dataclass
class PageCheck:
    """What the probe found at one window width; `screenshot`: the picture, if taken."""

    width: int
    document_width: int
    height: int
    charts: int
    tables: int
    texts: int
    problems: list[str] = field(default_factory=list)
    screenshot: Path | None = None

    def render(self) -> str:
        head = (f"{self.width} px: page {self.document_width} px wide, {self.height} px tall; "
                f"{self.tables} tables, {self.charts} charts, {self.texts} chart texts checked; "
                + (f"{len(self.problems)} problem(s)" if self.problems else "no problem"))
        shot = [f"  screenshot: {self.screenshot}"] if self.screenshot else []
        return "\n".join([head, *(f"  - {p}" for p in self.problems), *shot])


def find_chromium() -> str | None:
    """The Chromium binary: $SPECDECODE_CHROMIUM (None when it is not an executable), else
    chromium (Debian) or chromium-browser or google-chrome on PATH; None when there is none."""
    if os.environ.get(CHROMIUM_ENV):
        return shutil.which(os.environ[CHROMIUM_ENV])
    return next((path for name in ("chromium", "chromium-browser", "google-chrome")
                 if (path := shutil.which(name))), None)


def _chromium(binary: str, args: list[str], timeout: float) -> str:
    with tempfile.TemporaryDirectory(prefix="specdecode-chromium-") as profile:
        try:
            proc = subprocess.run([binary, *FLAGS, f"--user-data-dir={profile}", *args],
                                  capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise SpecDecodeError(f"{binary} took more than {timeout:.0f} s on "
                                  f"{args[-1]}") from None
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise SpecDecodeError(f"{binary} failed (exit {proc.returncode}) on {args[-1]}: {tail}")
    return proc.stdout


def probed_copy(page: str) -> str:
    """The page with the probe script appended to its body."""
    probe = resources.files("specdecode").joinpath("data/report_probe.js").read_text("utf-8")
    script = f"<script>\n{probe}</script>\n"
    if "</body>" not in page:
        raise SpecDecodeError("the page has no </body>: not a report")
    head, _, tail = page.rpartition("</body>")
    return head + script + "</body>" + tail


def probe(html_text: str, width: int, binary: str, timeout: float = 60.0) -> dict[str, Any]:
    """The probe's findings on `html_text` in a window `width` px wide."""
    with tempfile.TemporaryDirectory(prefix="specdecode-probe-") as tmp:
        copy = Path(tmp) / "page.html"
        copy.write_text(probed_copy(html_text), encoding="utf-8")
        dom = _chromium(binary, [f"--window-size={width},900", "--dump-dom", copy.as_uri()],
                        timeout)
    found = re.findall(rf'<pre id="{PROBE_ID}">(.*?)</pre>', dom, re.S)
    if not found:
        raise SpecDecodeError(f"the probe wrote no result at {width} px (did the page's "
                              "scripts run?)")
    data: dict[str, Any] = json.loads(html.unescape(found[-1]))  # the last: the probe's own
    return data


def screenshot(page: Path, out: Path, width: int, height: int, binary: str,
               timeout: float = 60.0) -> Path:
    """A picture of the page `width` px wide and `height` px tall (its full length)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    _chromium(binary, [f"--window-size={width},{min(max(height, 1), MAX_SHOT_HEIGHT)}",
                       f"--screenshot={out.resolve()}", page.resolve().as_uri()], timeout)
    if not out.exists():
        raise SpecDecodeError(f"{binary} wrote no screenshot {out}")
    return out


def check_report(page: str | Path, widths: tuple[int, ...] = WIDTHS,
                 shots: str | Path | None = None, binary: str | None = None,
                 shot_height: int | None = None) -> list[PageCheck]:
    """Check the report at each width; with `shots` (a folder), a screenshot per width there,
    report-<width>.png, of the full page (or its top `shot_height` px)."""
    path = Path(page)
    chromium = binary or find_chromium()
    if chromium is None:
        raise SpecDecodeError(f"no Chromium found: {INSTALL}")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecDecodeError(f"{path}: {exc.strerror or exc}") from None
    checks = []
    for width in widths:
        data = probe(text, width, chromium)
        check = PageCheck(width=width, document_width=int(data["width"]),
                          height=int(data["height"]), charts=int(data["charts"]),
                          tables=int(data["tables"]), texts=int(data["texts"]),
                          problems=[str(p) for p in data["problems"]])
        if shots is not None:
            check.screenshot = screenshot(path, Path(shots) / f"report-{width}.png", width,
                                          shot_height or check.height, chromium)
        checks.append(check)
    return checks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/report_browser.py",
                                description="Check a bench report.html in headless Chromium "
                                            "and take full-page screenshots.")
    p.add_argument("report", type=Path, help="a report.html")
    p.add_argument("--widths", default=",".join(str(w) for w in WIDTHS),
                   help="window widths in px (default 1200,800)")
    p.add_argument("--shots", type=Path, default=None,
                   help="screenshot folder (default: screenshots/ beside the report)")
    p.add_argument("--height", type=int, default=None,
                   help="screenshot only the page's top HEIGHT px (default: the full page)")
    args = p.parse_args(argv)
    try:
        widths = tuple(int(w) for w in args.widths.split(","))
        if not widths or min(widths) < 100 or (args.height is not None and args.height < 100):
            raise ValueError
    except ValueError:
        print(f"error: --widths and --height must be pixels >= 100, got {args.widths}"
              f"{'' if args.height is None else f' and {args.height}'}", file=sys.stderr)
        return 2
    try:
        checks = check_report(args.report, widths,
                              args.shots or args.report.parent / "screenshots",
                              shot_height=args.height)
    except SpecDecodeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(c.render() for c in checks))
    return 1 if any(c.problems for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
