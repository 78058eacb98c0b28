// nbddp's live dashboard (an anywidget view): the header and the rank rows come from the
// kernel as HTML (the same HTML a finished cell keeps), the metric charts as inline SVG (a
// finished cell keeps the same SVG, as images); the folded log is drawn here, for
// every rank or for one, picked in the list or by clicking a row. A folded line's values
// (each rank's) show when it is pointed at, and below it when it is clicked; the tqdm
// bars running now come last, one per description, folded.

function ranges(set) {
  // "0-3,5" -> [[0, 3], [5, 5]]
  return set.split(",").map((part) => {
    const [a, b] = part.split("-");
    return [Number(a), b === undefined ? Number(a) : Number(b)];
  });
}

function holds(set, rank) {
  return ranges(set).some(([a, b]) => a <= rank && rank <= b);
}

function render({ model, el }) {
  const root = document.createElement("div");
  root.className = "nbddp-dashboard nbddp-live";
  const header = document.createElement("div");
  const rows = document.createElement("div");
  const charts = document.createElement("div");
  const controls = document.createElement("div");
  controls.style.cssText = "margin:4px 0;font-size:90%";
  const choose = document.createElement("select");
  choose.className = "nbddp-choose";
  controls.append("log: ", choose);
  const pane = document.createElement("div");
  pane.className = "nbddp-pane";
  pane.style.cssText = "max-height:320px;overflow-y:auto";
  const note = document.createElement("div");
  note.className = "nbddp-dropped";
  const pre = document.createElement("pre");
  pre.style.cssText = "margin:0;white-space:pre-wrap";
  const barsPre = document.createElement("pre"); // the bars running now, below the lines
  barsPre.className = "nbddp-bars";
  barsPre.style.cssText = "margin:0;white-space:pre-wrap";
  pane.append(note, pre, barsPre);
  root.append(header, rows, charts, controls, pane);
  el.append(root);

  let shown = null; // the rank whose lines the log shows; null: every rank, folded
  const opened = new Set(); // the folded lines whose values show below them (clicked)

  const drawChoices = () => {
    const options = [new Option("all ranks", "")];
    for (const rank of model.get("ranks")) options.push(new Option(`rank ${rank}`, String(rank)));
    choose.replaceChildren(...options);
    choose.value = shown === null ? "" : String(shown);
  };
  const drawTop = () => {
    header.innerHTML = model.get("header");
    rows.innerHTML = model.get("rows");
  };
  const drawCharts = () => {
    charts.innerHTML = model.get("charts");
  };
  const drawLines = (target, rows, live) => {
    // rows of [rank set, stream, text, values, (a running bar:) its identity]: a folded
    // line's values on hover, and below it once clicked
    const lines = document.createDocumentFragment();
    for (const [ranks, stream, text, values, tag] of rows) {
      if (shown !== null && !holds(ranks, shown)) continue;
      const line = document.createElement("span");
      line.className = values ? "nbddp-line nbddp-folded" : "nbddp-line";
      if (live) line.classList.add("nbddp-bar-live");
      if (stream === "stderr") line.classList.add("nbddp-stderr"); // coloured by _css
      line.textContent = `${shown === null ? `[${ranks}] ` : ""}${text}\n`;
      lines.append(line);
      if (!values) continue;
      line.title = values; // each rank's numbers, the extremes named first
      // a running bar's text changes: its key is the bar's identity (each bar its own)
      line.dataset.key = live ? `bar\n${tag}` : `${ranks}\n${text}`;
      if (!opened.has(line.dataset.key)) continue;
      const each = document.createElement("span");
      each.className = "nbddp-values";
      each.textContent = values.replace(/^/gm, "    ") + "\n";
      lines.append(each);
    }
    target.replaceChildren(lines);
  };
  const atEnd = () => pane.scrollHeight - pane.scrollTop - pane.clientHeight < 8;
  const drawBars = () => {
    const end = atEnd();
    drawLines(barsPre, model.get("bars"), true);
    if (end) pane.scrollTop = pane.scrollHeight;
  };
  const drawLog = () => {
    const end = atEnd();
    drawLines(pre, model.get("lines"), false);
    drawLines(barsPre, model.get("bars"), true);
    const hidden = model.get("hidden");
    note.textContent = hidden
      ? `… ${hidden} earlier lines not shown (more show when the cell ends)`
      : "";
    if (end) pane.scrollTop = pane.scrollHeight;
  };
  const show = (rank) => {
    shown = rank;
    choose.value = rank === null ? "" : String(rank);
    drawLog();
  };
  const focus = () => {
    const rank = model.get("focus");
    if (rank >= 0) show(rank);
  };

  choose.addEventListener("change", () => show(choose.value === "" ? null : Number(choose.value)));
  pane.addEventListener("click", (event) => {
    const line = event.target.closest(".nbddp-folded");
    if (!line) return;
    const key = line.dataset.key;
    if (!opened.delete(key)) opened.add(key);
    drawLog();
  });
  rows.addEventListener("click", (event) => {
    const row = event.target.closest("[data-rank]");
    if (row) show(Number(row.dataset.rank));
  });
  const handlers = [
    ["change:ranks", drawChoices],
    ["change:header", drawTop],
    ["change:rows", drawTop],
    ["change:charts", drawCharts],
    ["change:lines", drawLog],
    ["change:hidden", drawLog],
    ["change:bars", drawBars],
    ["change:focus", focus],
  ];
  for (const [name, handler] of handlers) model.on(name, handler);
  drawChoices();
  drawTop();
  drawCharts();
  drawLog();
  focus();
  return () => {
    for (const [name, handler] of handlers) model.off(name, handler);
  };
}

export default { render };
