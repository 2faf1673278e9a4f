/* The version page's "Start a rollout" form: add and remove stage rows. Without this
 * script the form still works: it has the plan's rows and two blank spare ones. The
 * server reads rows in the order of their numbers, so a new row takes the next number. */
(function () {
  "use strict";
  var form = document.querySelector("form.rollout-start");
  if (!form) return;
  var body = form.querySelector("[data-stage-rows]");
  var template = document.getElementById("stage-row-template");
  var addButton = form.querySelector("[data-add-stage]");
  var nextNumber = 0;

  function isBlank(row) {
    var fields = row.querySelectorAll("input");
    for (var i = 0; i < fields.length; i++) {
      if (fields[i].type === "checkbox" ? fields[i].checked : fields[i].value) return false;
    }
    return true;
  }

  function rowNumber(row) {
    var input = row.querySelector("input[name^='stages-']");
    return input ? parseInt(input.name.split("-")[1], 10) : -1;
  }

  function enable(row) {
    var remove = row.querySelector("[data-remove-stage]");
    remove.hidden = false;
    remove.addEventListener("click", function () { row.remove(); });
  }

  body.querySelectorAll("tr[data-stage-row]").forEach(function (row) {
    nextNumber = Math.max(nextNumber, rowNumber(row) + 1);
    if (row.hasAttribute("data-spare") && isBlank(row)) row.remove();
    else enable(row);
  });

  addButton.hidden = false;
  addButton.addEventListener("click", function () {
    var html = template.innerHTML.replace(/__index__/g, String(nextNumber));
    nextNumber += 1;
    var holder = document.createElement("tbody");
    holder.innerHTML = html.trim();
    var row = holder.querySelector("tr");
    body.appendChild(row);
    enable(row);
    row.querySelector("input").focus();
  });
})();
