// The page's line charts, drawn on canvas by hand (no charting library, no build step). Loaded before
// app.js, whose helpers (el, fmtNum) and palette (INK, PALETTE) it uses when it draws.
"use strict";

class LineChart {
  constructor(container, spec) {
    this.spec = spec;
    const figure = (this.figure = el("figure", "chart"));
    figure.dataset.chart = spec.id;
    const caption = el("figcaption");
    this.value = el("span", "chart-value");
    caption.append(spec.title, this.value);
    this.canvas = el("canvas");
    this.canvas.setAttribute("role", "img");
    this.canvas.setAttribute("aria-label", `${spec.title} over steps`);
    this.legend = el("div", "legend");
    figure.append(caption, this.canvas, this.legend);
    container.append(figure);
  }

  // series: [{name, color, points: [[step, value|null], ...]}]; a null breaks the line.
  draw(series) {
    const dpr = window.devicePixelRatio || 1;
    const [w, h] = [this.canvas.clientWidth, this.canvas.clientHeight];
    // Setting the size clears the canvas and reallocates it: only when the layout changed.
    if (this.canvas.width !== Math.round(w * dpr)) this.canvas.width = Math.round(w * dpr);
    if (this.canvas.height !== Math.round(h * dpr)) this.canvas.height = Math.round(h * dpr);
    const ctx = this.canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    ctx.font = "11px system-ui, sans-serif";
    this.figure.dataset.points = String(series[0].points.length); // what it shows, for tests and scripts

    const pts = series.flatMap((s) => s.points.filter((p) => Number.isFinite(p[1])));
    if (!pts.length) {
      ctx.fillStyle = INK.empty;
      this.figure.dataset.empty = this.spec.empty || "waiting for steps…";
      ctx.fillText(this.figure.dataset.empty, 12, h / 2);
      this.value.textContent = "";
      return;
    }
    delete this.figure.dataset.empty;
    const xs = pts.map((p) => p[0]);
    const ys = pts.map((p) => p[1]);
    let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
    if (x0 === x1) [x0, x1] = [x0 - 1, x1 + 1];
    const pad = y0 === y1 ? Math.abs(y0) * 0.1 || 1 : 0; // a flat line sits mid-chart
    [y0, y1] = [y0 - pad, y1 + pad];
    // Grid and labels: four bands are enough to read a trend, and cheap to redraw every second.
    const ticks = [0, 1, 2, 3, 4].map((i) => y0 + ((y1 - y0) * i) / 4);
    // The widest label sets the left margin: with a fixed one, a long negative tick ("-7.15e-5") was
    // drawn past the canvas's edge and lost its minus sign.
    const widest = Math.max(...ticks.map((y) => ctx.measureText(fmtNum(y)).width));
    const m = { left: Math.max(40, Math.ceil(widest) + 10), right: 10, top: 8, bottom: 20 };
    const sx = (x) => m.left + ((x - x0) / (x1 - x0)) * (w - m.left - m.right);
    const sy = (y) => h - m.bottom - ((y - y0) / (y1 - y0)) * (h - m.top - m.bottom);

    Object.assign(ctx, { strokeStyle: INK.grid, fillStyle: INK.axis, lineWidth: 1, textAlign: "right" });
    ctx.textBaseline = "middle";
    for (const y of ticks) {
      const py = Math.round(sy(y)) + 0.5;
      ctx.beginPath(), ctx.moveTo(m.left, py), ctx.lineTo(w - m.right, py), ctx.stroke();
      ctx.fillText(fmtNum(y), m.left - 6, py);
    }
    Object.assign(ctx, { textBaseline: "alphabetic", textAlign: "left" });
    ctx.fillText(`step ${Math.round(x0)}`, m.left, h - 5);
    ctx.textAlign = "right";
    ctx.fillText(`${Math.round(x1)}`, w - m.right, h - 5);

    Object.assign(ctx, { lineWidth: 1.5, lineJoin: "round" });
    for (const s of series) {
      ctx.strokeStyle = s.color;
      ctx.beginPath();
      let pen = false; // lifted over a gap (a value not measured, a worker on its initial weights)
      for (const [x, y] of s.points) {
        if (Number.isFinite(y)) ctx[pen ? "lineTo" : "moveTo"](sx(x), sy(y));
        pen = Number.isFinite(y);
      }
      ctx.stroke();
    }

    const last = series[0].points.filter((p) => Number.isFinite(p[1])).at(-1);
    this.value.textContent = last ? fmtNum(last[1]) : "";
    this.renderLegend(series);
  }

  renderLegend(series) {
    const key = series.map((s) => s.name).join(",");
    if (series.length < 2 || key === this.legendKey) return;
    this.legendKey = key;
    this.legend.replaceChildren(
      ...series.map((s) => {
        const item = el("span");
        item.append(Object.assign(el("i"), { style: `background: ${s.color}` }), s.name);
        return item;
      }),
    );
  }
}

function seriesFor(spec, rows) {
  if (!spec.versions) {
    const points = rows.map((r) => [r.step, r.metrics[spec.metric] ?? null]);
    return [{ name: spec.title, color: PALETTE[0], points }];
  }
  // One line for the learner, one per worker that ever appears in the window (a worker that joins late
  // has no points before it did; null = still on its initial weights).
  const workers = [...new Set(rows.flatMap((r) => Object.keys(r.worker_versions)))].sort();
  return [
    { name: "learner", color: PALETTE[0], points: rows.map((r) => [r.step, r.policy_version]) },
    ...workers.map((id, i) => ({
      name: id,
      color: PALETTE[(i + 1) % PALETTE.length],
      points: rows.map((r) => [r.step, r.worker_versions[id] ?? null]),
    })),
  ];
}
