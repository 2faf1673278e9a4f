/* The rollout page: four canary-vs-baseline charts over time, redrawn when the rollout changes. */
(function () {
  "use strict";
  var page = document.getElementById("rollout-page");
  if (!page) return;
  var rolloutId = page.getAttribute("data-rollout-id");
  var seriesUrl = page.getAttribute("data-series-url");

  function draw(data) {
    data.signals.forEach(function (signal) {
      var figure = page.querySelector('figure[data-signal="' + signal.key + '"]');
      if (!figure) return;
      window.Charts.timeChart(figure, {
        title: signal.title, unit: signal.unit, kind: "line", times: data.times,
        limit: signal.limit, syncKey: "rollout-" + rolloutId,
        series: [
          { label: "baseline " + data.versions.baseline, role: "baseline", values: signal.baseline },
          { label: "canary " + data.versions.canary, role: "canary", values: signal.canary }
        ]
      });
    });
    page.dataset.chartRuns = String(data.times.length);
  }

  var pending = false;
  function load() {
    if (pending) return;
    pending = true;
    fetch(seriesUrl, { credentials: "same-origin" })
      .then(function (response) { return response.json(); })
      .then(draw)
      .catch(function (error) { console.warn("series", error); })
      .finally(function () { pending = false; });
  }

  load();
  window.Live.on("rollout.*", function (payload) {
    if (String(payload.rollout_id) === rolloutId) load();
  });
})();
