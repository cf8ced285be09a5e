/* report.html's script (parity/comparing/html_report.py inlines it): a hover readout over the static SVG charts.
   Pointing at (or focusing and pressing ← →) a step shows every run's loss, grad norm and parameter norm there,
   and for each run but the baseline its relative difference from the baseline and its bound; pointing at a cell of a
   tensor verdict's heatmap, that tensor's norms, step, phase and deviation ÷ bound. Nothing is fetched:
   the numbers are the page's own JSON (#report-data). Without this script the charts and tables read as they are. */
(function () {
  "use strict";
  var node = document.getElementById("report-data");
  var readout = document.getElementById("readout");
  if (!node || !readout) { return; }
  var data = JSON.parse(node.textContent);
  var n = data.num_steps;
  var base = data.runs[0];
  var SVGNS = "http://www.w3.org/2000/svg";
  var panels = Array.prototype.slice.call(document.querySelectorAll("svg.panel"));
  var current = null;

  function fmt(x) {
    if (x === null || x === undefined) { return "–"; }
    return Number(x).toPrecision(8);
  }
  function sci(x) {
    if (x === null || x === undefined) { return "–"; }
    return Number(x).toExponential(3);
  }
  function cell(tag, text, attrs) {
    var el = document.createElement(tag);
    el.textContent = text;
    Object.keys(attrs || {}).forEach(function (k) { el.setAttribute(k, attrs[k]); });
    return el;
  }

  function show(step) {
    step = Math.max(0, Math.min(n - 1, step));
    current = step;
    var table = document.createElement("table");
    var caption = cell("caption", "Step " + step, {"data-step": String(step)});
    table.appendChild(caption);
    var head = document.createElement("tr");
    head.appendChild(cell("th", "run", {scope: "col"}));
    data.quantities.forEach(function (q) {
      head.appendChild(cell("th", data.nouns[q[0]], {scope: "col"}));
      head.appendChild(cell("th", "relative diff / bound", {scope: "col"}));
    });
    var thead = document.createElement("thead");
    thead.appendChild(head);
    table.appendChild(thead);
    var tbody = document.createElement("tbody");
    data.runs.forEach(function (run, i) {
      var tr = document.createElement("tr");
      tr.appendChild(cell("th", run.label + (i === 0 ? " (baseline)" : ""), {scope: "row"}));
      data.quantities.forEach(function (q) {
        var key = q[0];
        var value = (run.series[key] || [])[step];
        tr.appendChild(cell("td", fmt(value), {"data-run": run.name, "data-q": key, "data-kind": "value"}));
        if (i === 0) {
          tr.appendChild(cell("td", "–"));
          return;
        }
        var b = base.series[key][step];
        var rel = (value === null || b === null || b === 0) ? null : (value - b) / Math.abs(b);
        var bound = run.bounds && run.bounds[key] ? run.bounds[key][step] : null;
        var outside = rel !== null && bound !== null && Math.abs(rel) > bound;
        var td = cell("td", sci(rel) + " / " + sci(bound) + (outside ? " ✗ outside" : ""),
                      {"data-run": run.name, "data-q": key, "data-kind": "bound"});
        if (outside) { td.className = "differs"; }
        tr.appendChild(td);
      });
      tbody.appendChild(tr);
    });
    table.appendChild(tbody);
    readout.replaceChildren(table);
    readout.hidden = false;
    panels.forEach(function (svg) {
      var left = +svg.dataset.left, right = +svg.dataset.right;
      var x = left + (right - left) * (n > 1 ? step / (n - 1) : 0);
      var line = svg.querySelector("line.cursor");
      if (!line) {
        line = document.createElementNS(SVGNS, "line");
        line.setAttribute("class", "cursor");
        line.setAttribute("y1", svg.dataset.top);
        line.setAttribute("y2", svg.dataset.bottom);
        svg.appendChild(line);
      }
      line.setAttribute("x1", x);
      line.setAttribute("x2", x);
    });
  }

  function stepAt(svg, clientX) {
    var rect = svg.getBoundingClientRect();
    var width = svg.viewBox.baseVal.width;
    var x = (clientX - rect.left) * width / rect.width;
    var left = +svg.dataset.left, right = +svg.dataset.right;
    return Math.round((x - left) / (right - left) * (n - 1));
  }

  // The tensor verdict's heatmaps: pointing at a cell (its x and y are its column and row) shows the JSON's values.
  function showCell(svg, rect) {
    var found = (data.tensors || {})[svg.dataset.run];
    if (!found) { return; }
    var m = found.matrix, row = +rect.getAttribute("y"), col = +rect.getAttribute("x");
    var at = m.at[row][col], span = m.columns[col];
    var table = document.createElement("table");
    table.appendChild(cell("caption", m.tensors[row] + ", step " + at[0] + (span[1] > span[0] ?
      " (largest of steps " + span[0] + "–" + span[1] + ")" : "") + ", " + m.phases[at[1]],
      {"data-tensor": m.tensors[row], "data-step": String(at[0]), "data-phase": m.phases[at[1]]}));
    var tbody = document.createElement("tbody");
    [[found.label, at[2], "value"], [base.label + " (baseline)", at[3], "reference"],
     ["deviation ÷ bound", m.ratio[row][col], "ratio"]].forEach(function (r) {
      var tr = document.createElement("tr");
      tr.appendChild(cell("th", r[0], {scope: "row"}));
      var td = cell("td", r[2] === "ratio" ? Number(r[1]).toPrecision(3) + (r[1] > 1 ? " ✗ outside" : "") :
                    fmt(r[1]), {"data-kind": r[2]});
      if (r[2] === "ratio" && r[1] > 1) { td.className = "differs"; }
      tr.appendChild(td);
      tbody.appendChild(tr);
    });
    table.appendChild(tbody);
    readout.replaceChildren(table);
    readout.hidden = false;
  }
  Array.prototype.forEach.call(document.querySelectorAll("svg.tensor-map"), function (svg) {
    svg.addEventListener("mouseover", function (e) {
      var rect = e.target.closest ? e.target.closest(".cells rect") : null;
      if (rect) { showCell(svg, rect); }
    });
  });

  panels.forEach(function (svg) {
    svg.setAttribute("tabindex", "0");
    svg.addEventListener("mousemove", function (e) { show(stepAt(svg, e.clientX)); });
    svg.addEventListener("focus", function () { show(current === null ? 0 : current); });
    svg.addEventListener("keydown", function (e) {
      if (e.key === "ArrowRight") { show((current || 0) + 1); e.preventDefault(); }
      if (e.key === "ArrowLeft") { show((current || 0) - 1); e.preventDefault(); }
    });
  });
}());
