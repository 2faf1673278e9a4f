/* A tenant's usage charts: one line per model and version for each measure. */
(function () {
  "use strict";
  function draw() {
    var source = document.getElementById("usage-data");
    if (!source) return;
    var data = JSON.parse(source.textContent);
    document.querySelectorAll("#usage-charts figure[data-measure]").forEach(function (figure) {
      var measure = figure.getAttribute("data-measure");
      window.Charts.lineChart(figure, {
        title: figure.getAttribute("data-title"), unit: "", times: data.times, limit: null,
        series: data.series.map(function (series, index) {
          return { name: series.name, values: series[measure], cls: "series-" + (index % 6) };
        })
      });
    });
    var legend = document.getElementById("usage-legend");
    if (!legend) {
      legend = document.createElement("p");
      legend.id = "usage-legend";
      legend.className = "legend";
      document.getElementById("usage-charts").after(legend);
    }
    legend.textContent = "";
    data.series.forEach(function (series, index) {
      var item = document.createElement("span");
      item.innerHTML = '<span class="swatch series-' + (index % 6) + '"></span>';
      item.appendChild(document.createTextNode(series.name + " "));
      legend.appendChild(item);
    });
  }
  draw();
  document.addEventListener("live:fragment", draw);
})();
