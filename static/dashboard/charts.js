/* Hand-written SVG line charts and sparklines for the dashboard (no dependencies). */
(function () {
  "use strict";
  var SVG = "http://www.w3.org/2000/svg";

  function el(name, attrs, parent) {
    var node = document.createElementNS(SVG, name);
    Object.keys(attrs || {}).forEach(function (key) { node.setAttribute(key, attrs[key]); });
    if (parent) parent.appendChild(node);
    return node;
  }

  function format(value) {
    if (value === null || value === undefined || isNaN(value)) return "–";
    var size = Math.abs(value);
    if (size >= 1000) return Math.round(value).toLocaleString();
    if (size >= 10) return value.toFixed(0);
    if (size >= 1) return value.toFixed(1);
    return value.toPrecision(2);
  }

  function timeLabel(iso) {
    if (!iso) return "";
    var date = new Date(iso);
    return date.toISOString().substring(11, 16);
  }

  /* lineChart(figure, {title, unit, times, series: [{name, values, cls}], limit}) */
  function lineChart(figure, spec) {
    var width = 320, height = 170, left = 44, right = 8, top = 8, bottom = 22;
    figure.textContent = "";
    var caption = document.createElement("figcaption");
    caption.textContent = spec.title + (spec.unit ? " (" + spec.unit + ")" : "");
    figure.appendChild(caption);
    var svg = el("svg", { viewBox: "0 0 " + width + " " + height, role: "img",
                          "aria-label": spec.title, class: "linechart" }, figure);
    var values = [];
    spec.series.forEach(function (series) {
      series.values.forEach(function (value) { if (value !== null && value !== undefined) values.push(value); });
    });
    if (spec.limit !== null && spec.limit !== undefined) values.push(spec.limit);
    var count = spec.times.length;
    if (!count || !values.length) {
      el("text", { x: width / 2, y: height / 2, "text-anchor": "middle", class: "empty" }, svg)
        .textContent = "no data yet";
      figure.dataset.points = "0";
      return svg;
    }
    var low = Math.min(0, Math.min.apply(null, values));
    var high = Math.max.apply(null, values);
    if (high === low) high = low + 1;
    high = high * 1.08;
    var plotWidth = width - left - right, plotHeight = height - top - bottom;
    function x(index) { return left + (count === 1 ? plotWidth / 2 : index * plotWidth / (count - 1)); }
    function y(value) { return top + plotHeight - (value - low) / (high - low) * plotHeight; }
    [low, (low + high) / 2, high].forEach(function (tick) {
      el("line", { x1: left, x2: width - right, y1: y(tick), y2: y(tick), class: "grid" }, svg);
      el("text", { x: left - 4, y: y(tick) + 3, "text-anchor": "end", class: "tick" }, svg).textContent = format(tick);
    });
    el("text", { x: left, y: height - 6, class: "tick" }, svg).textContent = timeLabel(spec.times[0]);
    el("text", { x: width - right, y: height - 6, "text-anchor": "end", class: "tick" }, svg)
      .textContent = timeLabel(spec.times[count - 1]);
    if (spec.limit !== null && spec.limit !== undefined) {
      el("line", { x1: left, x2: width - right, y1: y(spec.limit), y2: y(spec.limit), class: "limit" }, svg);
    }
    spec.series.forEach(function (series, seriesIndex) {
      var points = [];
      series.values.forEach(function (value, index) {
        if (value !== null && value !== undefined) points.push(x(index).toFixed(1) + "," + y(value).toFixed(1));
      });
      var cls = "line " + (series.cls || "series-" + seriesIndex);
      el("polyline", { points: points.join(" "), class: cls, "data-series": series.name }, svg);
      if (points.length === 1) {
        var only = points[0].split(",");
        el("circle", { cx: only[0], cy: only[1], r: 3, class: cls }, svg);
      }
    });
    figure.dataset.points = String(count);
    return svg;
  }

  /* Redraw a server-drawn sparkline (<svg data-values>) after appending one value. */
  function sparkPush(svg, value, keep) {
    var values = JSON.parse(svg.getAttribute("data-values") || "[]");
    values.push(value);
    values = values.slice(-(keep || 60));
    svg.setAttribute("data-values", JSON.stringify(values));
    var width = 120, height = 24;
    var low = Math.min.apply(null, values), high = Math.max.apply(null, values);
    var span = (high - low) || 1;
    var step = width / Math.max(values.length - 1, 1);
    var points = values.map(function (v, i) {
      return (i * step).toFixed(1) + "," + (height - 2 - (v - low) / span * (height - 4)).toFixed(1);
    });
    var line = svg.querySelector("polyline");
    if (line) line.setAttribute("points", points.join(" "));
  }

  window.Charts = { lineChart: lineChart, sparkPush: sparkPush, format: format };
})();
