/* The dashboard's charts, drawn by uPlot (static/vendor/uplot/), one look on every page.
 *
 * Charts.timeChart(figure, spec) draws a time chart into a <figure>:
 *   spec = {title, unit, kind: "line" | "bars", times: [ISO 8601], stepSeconds (bars: the
 *           bucket length), series: [{label, role, values}], limit (the SLO, or null),
 *           axisLabel (defaults to the unit), syncKey (charts sharing a hover cursor)}
 *   Time runs along x (UTC); y starts at 0 and is fitted to the data. The limit is drawn
 *   dashed when it lies within 1.5 times the data's peak, otherwise noted as off-scale
 *   under the chart. Bars are stacked, one bar per bucket; the legend shows each series'
 *   own value for the hovered time, or the latest one.
 *   Afterwards figure.uplot is the uPlot instance and figure.dataset holds points, yMax
 *   and limit ("drawn", "off-scale" or "none").
 * Charts.mountSparks(root) draws each fleet sparkline <div class="spark"> under root;
 * Charts.sparkPush(element, value) appends a live value at the current time.
 *
 * Colours: one per role (baseline, canary), defined once as CSS variables in
 * dashboard.css and read here; series without a role take the neutral palette in order.
 */
(function () {
  "use strict";
  var uPlot = window.uPlot;
  var LIMIT_HEADROOM = 1.5;  // a limit this far above the data's peak is left off the scale
  var PALETTE = ["--series-1", "--series-2", "--series-3", "--series-4"];
  var MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];
  var FONT = '11px system-ui, -apple-system, "Segoe UI", "DejaVu Sans", sans-serif';
  var SMALL_FONT = '9px system-ui, -apple-system, "Segoe UI", "DejaVu Sans", sans-serif';
  // Time axis steps (seconds), finer than uPlot's own between a minute and an hour.
  var TIME_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1200, 1800, 3600, 7200, 10800,
                    21600, 43200, 86400, 2 * 86400, 7 * 86400, 14 * 86400];
  var charts = [];  // every instance on the page, so that those of replaced fragments are freed

  function cssVar(name) {
    return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  }

  /* The colour of a role, or null: "baseline" and "canary" are the same on every page. */
  function roleColour(role) {
    return role === "baseline" || role === "canary" ? cssVar("--" + role) : null;
  }

  function format(value) {
    if (value === null || value === undefined || isNaN(value)) return "–";
    var size = Math.abs(value);
    if (size >= 1000) return Math.round(value).toLocaleString("en");
    if (size >= 10) return value.toFixed(0);
    if (size >= 1) return value.toFixed(1).replace(/\.0$/, "");
    if (size === 0) return "0";
    return String(Number(value.toPrecision(2)));
  }

  function withUnit(value, unit) {
    var text = format(value);
    if (text === "–" || !unit) return text;
    return unit === "%" ? text + "%" : text + " " + unit;
  }

  function toSeconds(iso) { return Date.parse(iso) / 1000; }

  function utc(seconds) { return uPlot.tzDate(new Date(seconds * 1000), "Etc/UTC"); }

  function day(date) { return MONTHS[date.getUTCMonth()] + " " + date.getUTCDate(); }

  function clock(date, withSeconds) {
    return date.toISOString().substring(11, withSeconds ? 19 : 16);
  }

  /* Time axis labels in UTC, 24-hour: the date under the first label and at each new day. */
  function timeTicks(u, splits, axisIndex, space, increment) {
    var previous = null;
    return splits.map(function (seconds) {
      var date = new Date(seconds * 1000);
      if (increment >= 86400) return day(date);
      var label = clock(date, increment < 60);
      if (day(date) !== previous) label += "\n" + day(date);
      previous = day(date);
      return label;
    });
  }

  /* Free the charts of fragments the live client replaced (their listeners stay otherwise). */
  function sweep() {
    charts = charts.filter(function (chart) {
      if (chart.root.isConnected) return true;
      chart.destroy();
      return false;
    });
  }

  /* An axis' labels also land on the element (data-x-ticks, data-y-ticks, joined by "|"):
   * the canvas has no text to read back. */
  function recorded(element, name, values) {
    return function (u, splits, axisIndex, space, increment) {
      var labels = values(u, splits, axisIndex, space, increment);
      element.dataset[name] = labels.join("|").replace(/\n/g, " ");
      return labels;
    };
  }

  function numberTicks(u, splits) { return splits.map(format); }

  function forget(figure) {
    if (figure.uplot) figure.uplot.root.remove();
    figure.uplot = null;
    sweep();
  }

  function remember(chart, container, height) {
    charts.push(chart);
    if (!window.ResizeObserver) return;
    var width = container.clientWidth;
    new ResizeObserver(function () {
      var now = container.clientWidth;
      if (chart.root.isConnected && Math.abs(now - width) > 1) {
        width = now;
        chart.setSize({ width: Math.max(now, 200), height: height });
      }
    }).observe(container);
  }

  /* Stacked bars: series i is drawn at the sum of itself and those after it, largest first. */
  function stacked(columns) {
    var sums = columns.map(function (values) { return values.slice(); });
    for (var i = sums.length - 2; i >= 0; i--) {
      sums[i] = sums[i].map(function (value, index) {
        var below = sums[i + 1][index];
        if (value === null) return below;
        return below === null ? value : value + below;
      });
    }
    return sums;
  }

  function peak(columns) {
    var high = null;
    columns.forEach(function (values) {
      values.forEach(function (value) { if (value !== null && (high === null || value > high)) high = value; });
    });
    return high;
  }

  function colours(series) {
    var used = {};
    var next = 0;
    return series.map(function (item) {
      var colour = roleColour(item.role);
      if (colour && !used[colour]) { used[colour] = true; return colour; }
      colour = cssVar(PALETTE[next % PALETTE.length]);
      next += 1;
      return colour;
    });
  }

  function limitNote(figure, spec, state) {
    if (state === "none") return;
    var note = document.createElement("p");
    note.className = "chart-note " + state;
    note.dataset.limit = state;
    var limit = withUnit(spec.limit, spec.unit);
    note.textContent = state === "drawn"
      ? "Dashed: the SLO limit, " + limit + "."
      : "The SLO limit, " + limit + ", is above this scale.";
    figure.appendChild(note);
  }

  function drawLimit(limit, text, colour) {
    return function (u) {
      var ctx = u.ctx, ratio = window.devicePixelRatio || 1;
      var y = Math.round(u.valToPos(limit, "y", true));
      ctx.save();
      ctx.strokeStyle = colour;
      ctx.fillStyle = colour;
      ctx.lineWidth = 1.5 * ratio;
      ctx.setLineDash([6 * ratio, 4 * ratio]);
      ctx.beginPath();
      ctx.moveTo(u.bbox.left, y);
      ctx.lineTo(u.bbox.left + u.bbox.width, y);
      ctx.stroke();
      ctx.font = (10 * ratio) + "px system-ui, sans-serif";
      ctx.textAlign = "right";
      ctx.fillText(text, u.bbox.left + u.bbox.width - 4 * ratio, y - 6 * ratio);
      ctx.restore();
    };
  }

  function timeChart(figure, spec) {
    forget(figure);
    figure.textContent = "";
    var caption = document.createElement("figcaption");
    var isUnitNamed = spec.unit && spec.unit !== spec.title.toLowerCase();  // not "Tokens (tokens)"
    caption.textContent = spec.title + (isUnitNamed ? " (" + spec.unit + ")" : "");
    figure.appendChild(caption);
    var isBars = spec.kind === "bars";
    var step = spec.stepSeconds || 0;
    var times = spec.times.map(toSeconds);
    var raw = spec.series.map(function (item) {
      return item.values.map(function (value) { return value === null || value === undefined ? null : Number(value); });
    });
    var plotted = isBars ? stacked(raw) : raw;
    var high = peak(plotted);
    figure.dataset.points = String(high === null ? 0 : times.length);
    if (high === null) {
      var empty = document.createElement("p");
      empty.className = "chart-empty";
      empty.textContent = "no data yet";
      figure.appendChild(empty);
      figure.dataset.limit = "none";
      delete figure.dataset.yMax;
      return null;
    }
    var limit = typeof spec.limit === "number" ? spec.limit : null;
    var state = limit === null ? "none" : limit <= Math.max(high, 0) * LIMIT_HEADROOM ? "drawn" : "off-scale";
    var top = Math.max(high, state === "drawn" ? limit : 0) * 1.1 || 1;
    // Bars stand at their bucket's middle so the cursor picks the bar under it.
    var xs = isBars ? times.map(function (seconds) { return seconds + step / 2; }) : times;
    var first = isBars ? times[0] : xs[0], last = isBars ? times[times.length - 1] + step : xs[xs.length - 1];
    if (last === first) { first -= 30; last += 30; }
    var latest = xs.length - 1;
    var ink = cssVar("--muted"), grid = cssVar("--line");
    var palette = colours(spec.series);
    var plot = document.createElement("div");
    plot.className = "chart-plot";
    figure.appendChild(plot);
    var height = spec.height || 210;
    var axis = { stroke: ink, font: FONT, labelFont: FONT, grid: { stroke: grid, width: 1 },
                 ticks: { stroke: grid, width: 1, size: 4 } };
    var options = {
      width: Math.max(plot.clientWidth, 200),
      height: height,
      tzDate: utc,
      cursor: { sync: spec.syncKey ? { key: spec.syncKey } : undefined, y: false, drag: { x: false, y: false } },
      // Bars have no outline (a zero would draw one), so legend markers take the colour here.
      legend: { markers: { stroke: function (u, index) { return palette[index - 1]; },
                           fill: function (u, index) { return palette[index - 1]; } } },
      select: { show: false },
      scales: {
        x: { time: true, range: function () { return [first, last]; } },
        y: { range: function () { return [0, top]; } }
      },
      axes: [
        Object.assign({}, axis, { label: "time (UTC)", labelSize: 16, size: 36, space: 64, incrs: TIME_STEPS,
                                  values: recorded(figure, "xTicks", timeTicks) }),
        Object.assign({}, axis, { label: spec.axisLabel || spec.unit, labelSize: 18, size: 46, space: 30,
                                  values: recorded(figure, "yTicks", numberTicks) })
      ],
      series: [{
        label: isBars ? "bucket" : "time",
        value: function (u, seconds, index, dataIndex) {
          var at = u.data[0][dataIndex === null || dataIndex === undefined ? latest : dataIndex];
          if (!isBars) return clock(new Date(at * 1000), true) + " " + day(new Date(at * 1000));
          var start = new Date((at - step / 2) * 1000);
          var end = new Date((at + step / 2) * 1000);
          if (step >= 86400) return day(start);
          return day(start) + " " + clock(start) + "–" + clock(end);
        }
      }].concat(spec.series.map(function (item, index) {
        return {
          label: item.label,
          class: item.role ? "role-" + item.role : "",
          stroke: palette[index],
          fill: isBars ? palette[index] : undefined,
          width: isBars ? 0 : 2,
          paths: isBars ? uPlot.paths.bars({ size: [0.8, 48], align: 0 }) : undefined,
          points: { show: !isBars, size: 6, fill: palette[index] },
          value: function (u, value, seriesIndex, dataIndex) {
            var at = dataIndex === null || dataIndex === undefined ? latest : dataIndex;
            return withUnit(raw[seriesIndex - 1][at], spec.unit);
          }
        };
      })),
      hooks: state === "drawn" ? { draw: [drawLimit(limit, "SLO " + withUnit(limit, spec.unit), cssVar("--slo"))] } : {}
    };
    var chart = new uPlot(options, [xs].concat(plotted), plot);
    figure.uplot = chart;
    figure.dataset.yMax = String(top);
    figure.dataset.limit = state;
    limitNote(figure, spec, state);
    remember(chart, plot, height);
    return chart;
  }

  /* Fleet sparklines: <div class="spark" data-label data-unit="percent|watts|requests"
   * data-window-s data-points="[[epoch seconds, value], ...]">. */
  var SPARK_UNITS = {
    percent: { format: function (v) { return Math.round(v * 100) + "%"; }, top: function () { return 1; } },
    watts: { format: function (v) { return format(v) + " W"; }, top: function (high) { return high * 1.15 || 1; } },
    requests: { format: function (v) { return format(v) + " req"; }, top: function (high) { return Math.max(Math.ceil(high * 1.2), 2); } }
  };

  function sparkData(points) {
    return [points.map(function (p) { return p[0]; }), points.map(function (p) { return p[1]; })];
  }

  function spark(element) {
    if (element.uplot && element.uplot.root.isConnected) return element.uplot;
    var unit = SPARK_UNITS[element.getAttribute("data-unit")] || SPARK_UNITS.requests;
    var windowSeconds = parseFloat(element.getAttribute("data-window-s") || "600");
    var points = JSON.parse(element.getAttribute("data-points") || "[]");
    var label = element.getAttribute("data-label") || "";
    var colour = cssVar("--accent"), ink = cssVar("--muted"), grid = cssVar("--line");
    var axis = { stroke: ink, font: SMALL_FONT, gap: 2, grid: { stroke: grid, width: 1 },
                 ticks: { stroke: grid, width: 1, size: 2 } };
    element.textContent = "";
    var chart = new uPlot({
      width: 150,
      height: 62,
      tzDate: utc,
      legend: { show: false },
      select: { show: false },
      cursor: { y: false, drag: { x: false, y: false }, points: { size: 5 } },
      padding: [8, 14, 0, 0],  // room for the top value and the last time label
      scales: {
        x: { time: true, range: function () { var now = Date.now() / 1000; return [now - windowSeconds, now]; } },
        y: { range: function (u, low, high) { return [0, unit.top(high || 0)]; } }
      },
      axes: [
        Object.assign({}, axis, { size: 16, splits: function (u) {
          // The window's start, middle and end: the span reads off the axis.
          var end = u.scales.x.max;
          return [end - windowSeconds, end - windowSeconds / 2, end];
        }, values: recorded(element, "xTicks", function (u, splits) {
          return splits.map(function (s) { return clock(new Date(s * 1000)); });
        }) }),
        Object.assign({}, axis, { size: 38, space: 14, values: recorded(element, "yTicks", function (u, splits) {
          return splits.map(unit.format);
        }) })
      ],
      series: [{}, { stroke: colour, width: 1.5, fill: colour + "22", points: { show: false } }],
      hooks: {
        setCursor: [function (u) {
          var index = u.cursor.idx;
          element.title = index === null || index === undefined ? element.dataset.summary || ""
            : label + ": " + unit.format(u.data[1][index]) + " at " + clock(new Date(u.data[0][index] * 1000), true) + " UTC";
        }]
      }
    }, sparkData(points), element);
    element.uplot = chart;
    element.dataset.summary = label + ", last " + Math.round(windowSeconds / 60) + " min (UTC)";
    element.title = element.dataset.summary;
    charts.push(chart);
    return chart;
  }

  function mountSparks(root) {
    sweep();
    (root || document).querySelectorAll("div.spark[data-points]").forEach(spark);
  }

  /* Append one live value at the current time; points older than the window drop off. */
  function sparkPush(element, value) {
    var chart = spark(element);
    var windowSeconds = parseFloat(element.getAttribute("data-window-s") || "600");
    var now = Date.now() / 1000;
    var points = JSON.parse(element.getAttribute("data-points") || "[]");
    points.push([now, value]);
    points = points.filter(function (p) { return p[0] >= now - windowSeconds; });
    element.setAttribute("data-points", JSON.stringify(points));
    chart.setData(sparkData(points));
  }

  window.Charts = { timeChart: timeChart, mountSparks: mountSparks, sparkPush: sparkPush,
                    format: format, roleColour: roleColour };
})();
