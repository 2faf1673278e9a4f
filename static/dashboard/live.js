/* The dashboard's live client: one websocket (/ws/live/, authenticated by the session
 * cookie) and a small dispatcher.
 *
 * - Elements with data-live-fragment="<name>" and data-live-events="rollout.*,agent.state"
 *   are refetched from "<this page>?fragment=<name>" when a matching event arrives
 *   (optionally only when data-live-match="key=value" matches the event's payload).
 * - Scripts register handlers with Live.on("fleet.figures", function (payload) {...}).
 * - Reconnects with backoff; document.body.dataset.live is "open" while connected.
 */
(function () {
  "use strict";
  var handlers = [];
  var socket = null;
  var retryMs = 500;
  var status = document.getElementById("live-status");

  function setState(state) {
    document.body.dataset.live = state;
    if (status) {
      status.className = "live-dot " + state;
      status.textContent = state === "open" ? "live" : state;
    }
  }

  function matches(pattern, type) {
    pattern = pattern.trim();
    if (!pattern) return false;
    if (pattern === "*") return true;
    if (pattern.slice(-1) === "*") return type.indexOf(pattern.slice(0, -1)) === 0;
    return pattern === type;
  }

  function payloadMatches(element, payload) {
    var rule = element.getAttribute("data-live-match");
    if (!rule) return true;
    var parts = rule.split("=");
    return String((payload || {})[parts[0]]) === parts.slice(1).join("=");
  }

  function fragmentUrl(name) {
    var params = new URLSearchParams(window.location.search);
    params.set("fragment", name);
    return window.location.pathname + "?" + params.toString();
  }

  function refresh(element) {
    var minInterval = parseInt(element.getAttribute("data-live-min-interval") || "0", 10);
    var now = Date.now();
    var last = parseInt(element.dataset.liveFetchedAt || "0", 10);
    if (element.dataset.livePending === "1") return;
    var wait = Math.max(100, last + minInterval - now);
    element.dataset.livePending = "1";
    window.setTimeout(function () {
      fetch(fragmentUrl(element.getAttribute("data-live-fragment")), {
        credentials: "same-origin",
        headers: { "X-Requested-With": "live" }
      }).then(function (response) {
        if (!response.ok) throw new Error("fragment " + response.status);
        return response.text();
      }).then(function (html) {
        if (element.querySelector("dialog[open]")) return;  // do not yank a form being filled
        element.innerHTML = html;
        element.dataset.liveFetchedAt = String(Date.now());
        document.dispatchEvent(new CustomEvent("live:fragment", { detail: { element: element } }));
      }).catch(function (error) {
        console.warn("live refresh failed", error);
      }).finally(function () {
        element.dataset.livePending = "0";
      });
    }, wait);
  }

  function dispatch(message) {
    var type = message.type || "";
    var payload = message.payload || {};
    document.querySelectorAll("[data-live-fragment][data-live-events]").forEach(function (element) {
      var patterns = element.getAttribute("data-live-events").split(",");
      if (patterns.some(function (pattern) { return matches(pattern, type); }) &&
          payloadMatches(element, payload)) {
        refresh(element);
      }
    });
    handlers.forEach(function (handler) {
      if (matches(handler.pattern, type)) handler.fn(payload, type);
    });
    document.body.dataset.liveLastEvent = type;
  }

  function connect() {
    var scheme = window.location.protocol === "https:" ? "wss://" : "ws://";
    setState("connecting");
    socket = new WebSocket(scheme + window.location.host + "/ws/live/");
    socket.onopen = function () { retryMs = 500; setState("open"); };
    socket.onmessage = function (event) {
      try { dispatch(JSON.parse(event.data)); } catch (error) { console.warn(error); }
    };
    socket.onclose = function (event) {
      setState(event.code === 4401 ? "signed-out" : "offline");
      if (event.code === 4401) return;
      window.setTimeout(connect, retryMs);
      retryMs = Math.min(retryMs * 2, 10000);
    };
  }

  /* Confirmation dialogs: <button data-open-dialog="id">, <button data-close-dialog>. */
  document.addEventListener("click", function (event) {
    var opener = event.target.closest("[data-open-dialog]");
    if (opener) {
      var dialog = document.getElementById(opener.getAttribute("data-open-dialog"));
      if (dialog && dialog.showModal) dialog.showModal();
      var field = dialog && dialog.querySelector("textarea, input[type=text], select");
      if (field) field.focus();
      return;
    }
    var closer = event.target.closest("[data-close-dialog]");
    if (closer) {
      var open = closer.closest("dialog");
      if (open) open.close();
    }
  });

  window.Live = {
    on: function (pattern, fn) { handlers.push({ pattern: pattern, fn: fn }); },
    refresh: refresh,
    dispatch: dispatch
  };
  if (document.body.dataset.live !== "off") connect();
})();
