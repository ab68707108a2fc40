// The report as a person sees it: injected into a copy of report.html by scripts/report_browser.py,
// run after layout in headless Chromium; writes its findings as JSON into a pre element appended
// to the body (id specdecode-probe).
(function () {
  "use strict";
  const TOLERANCE = 0.5; // px: sub-pixel rounding is not clipping
  const de = document.documentElement;
  const viewport = de.clientWidth;
  const result = { viewport: viewport, height: de.scrollHeight, problems: [], charts: 0,
                   tables: 0, texts: 0 };
  // the tables behind a toggle count too: a person opens them
  for (const d of document.querySelectorAll("details")) d.open = true;
  const headings = Array.from(document.querySelectorAll("h2, h3"));
  function where(el) {
    let last = "the page's top";
    for (const h of headings) {
      if (h.compareDocumentPosition(el) & Node.DOCUMENT_POSITION_FOLLOWING) last = h.textContent.trim();
    }
    return '"' + last + '"';
  }
  const px = (x) => Math.round(x * 10) / 10;

  result.width = de.scrollWidth;
  if (de.scrollWidth > viewport) {
    result.problems.push("the page scrolls sideways: " + de.scrollWidth + " px of content in a " +
                         viewport + " px window");
  }
  for (const t of document.querySelectorAll("table")) {
    result.tables += 1;
    const r = t.getBoundingClientRect();
    if (r.right > viewport + TOLERANCE) {
      result.problems.push("a table under " + where(t) + " ends at " + px(r.right) +
                           " px, past the " + viewport + " px window");
    }
  }
  for (const svg of document.querySelectorAll("svg")) {
    const title = '"' + (svg.getAttribute("aria-label") || "untitled") + '"';
    const box = svg.getBoundingClientRect();
    if (box.right > viewport + TOLERANCE) {
      result.problems.push("chart " + title + " ends at " + px(box.right) + " px, past the " +
                           viewport + " px window");
    }
    const marks = svg.querySelectorAll(".data");
    if (marks.length) {
      result.charts += 1;
      const xs = new Set();
      for (const m of marks) {
        const tag = m.tagName.toLowerCase();
        if (tag === "polyline" || tag === "polygon") {
          for (const p of Array.from(m.points)) xs.add(Math.round(p.x * 2) / 2);
        } else if (tag === "circle") {
          xs.add(Math.round(m.cx.baseVal.value * 2) / 2);
        } else if (tag === "rect") {
          xs.add(Math.round(m.x.baseVal.value * 2) / 2);
          xs.add(Math.round((m.x.baseVal.value + m.width.baseVal.value) * 2) / 2);
        }
      }
      if (xs.size < 2) {
        result.problems.push("chart " + title + " draws " + xs.size + " x value" +
                             (xs.size === 1 ? "" : "s") + ": a chart needs at least two");
      }
    }
    for (const text of svg.querySelectorAll("text")) {
      const r = text.getBoundingClientRect();
      if (!r.width) continue;
      result.texts += 1;
      if (r.left < box.left - TOLERANCE || r.right > box.right + TOLERANCE ||
          r.top < box.top - TOLERANCE || r.bottom > box.bottom + TOLERANCE) {
        result.problems.push('text "' + text.textContent + '" of chart ' + title +
                             " is clipped by its box (text " + px(r.left - box.left) + " to " +
                             px(r.right - box.left) + " px across a " + px(box.width) +
                             " px chart)");
      }
    }
  }
  const pre = document.createElement("pre");
  pre.id = "specdecode-probe";
  pre.textContent = JSON.stringify(result);
  document.body.appendChild(pre);
})();
