"use strict";
// Filters: a finding is shown when its risk is ticked and it has the chosen category; the marks
// of hidden findings in the contract's text fade, so the text shows what the list shows.
(function () {
  var form = document.querySelector("form.filters");
  if (!form) { return; }
  var findings = Array.prototype.slice.call(document.querySelectorAll("article.finding"));
  var groups = Array.prototype.slice.call(document.querySelectorAll("section.group"));
  var marks = Array.prototype.slice.call(document.querySelectorAll(".text mark, .text a.back"));
  var shown = form.querySelector("output.shown");

  function apply() {
    var risks = {};
    Array.prototype.forEach.call(form.querySelectorAll("input[name=risk]"), function (box) {
      risks[box.value] = box.checked;
    });
    var category = form.querySelector("select[name=category]").value;
    var visible = {};
    var count = 0;
    findings.forEach(function (f) {
      var on = risks[f.dataset.risk] !== false &&
        (!category || f.dataset.categories.split("|").indexOf(category) >= 0);
      f.hidden = !on;
      visible[f.id] = on;
      if (on) { count += 1; }
    });
    groups.forEach(function (g) {
      g.hidden = !g.querySelector("article.finding:not([hidden])");
    });
    marks.forEach(function (m) {
      var on = m.dataset.f.split(" ").some(function (id) { return visible[id]; });
      m.classList.toggle("off", !on);
    });
    shown.textContent = count === findings.length ? "" : count + " of " + findings.length + " shown";
  }

  form.addEventListener("change", apply);
  form.addEventListener("submit", function (event) { event.preventDefault(); });
  apply();
})();
