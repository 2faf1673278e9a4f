/* A tenant's usage: stacked bars per bucket (minute, hour or day), one colour per model and
 * version; the baseline and canary of a rollout under way keep their roles' colours. */
(function () {
  "use strict";
  function draw() {
    var source = document.getElementById("usage-data");
    if (!source) return;
    var data = JSON.parse(source.textContent);
    document.querySelectorAll("#usage-charts figure[data-measure]").forEach(function (figure) {
      var measure = figure.getAttribute("data-measure");
      var unit = figure.getAttribute("data-unit");
      window.Charts.timeChart(figure, {
        title: figure.getAttribute("data-title"), unit: unit, kind: "bars",
        axisLabel: unit + " per " + data.granularity, times: data.times,
        stepSeconds: data.step_s, limit: null, syncKey: "usage",
        series: data.series.map(function (series) {
          var label = series.name + (series.role ? " (" + series.role + ")" : "");
          return { label: label, role: series.role, values: series[measure] };
        })
      });
    });
  }
  draw();
  document.addEventListener("live:fragment", draw);
})();
