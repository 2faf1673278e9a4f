/* The fleet page: heartbeat figures arrive about once a second as "fleet.figures"; the
 * cells show the latest and each sparkline gains a point. */
(function () {
  "use strict";
  var SPARK_FIGURES = {
    kv_cache_usage_max: "kv_cache_usage",
    running_max: "running",
    waiting_max: "waiting",
    power_watts_max: "power_watts"
  };

  function show(cell, value) {
    var format = cell.getAttribute("data-format");
    if (value === null || value === undefined) { cell.textContent = "–"; return; }
    if (format === "percent") cell.textContent = Math.round(value * 100) + "%";
    else if (format === "watts") cell.textContent = Math.round(value) + " W";
    else cell.textContent = String(value);
  }

  window.Charts.mountSparks(document);
  document.addEventListener("live:fragment", function (event) {
    window.Charts.mountSparks(event.detail.element);
  });

  window.Live.on("fleet.figures", function (payload) {
    var agents = payload.agents || {};
    Object.keys(agents).forEach(function (name) {
      var row = document.querySelector('tr[data-agent="' + CSS.escape(name) + '"]');
      if (!row) return;
      var figures = agents[name];
      row.querySelectorAll("[data-figure]").forEach(function (cell) {
        show(cell, figures[cell.getAttribute("data-figure")]);
      });
      row.querySelectorAll("div.spark[data-spark-key]").forEach(function (spark) {
        var figure = SPARK_FIGURES[spark.getAttribute("data-spark-key")];
        var value = figure && figures[figure];
        if (typeof value === "number") window.Charts.sparkPush(spark, value);
      });
      row.dataset.updatedAt = String(Date.now());
    });
  });
})();
