// The head atlas's own script: clickable heatmaps, sortable and filterable tables, the
// search of the index page and the compare view. It reads window.HEADMECH_ATLAS
// (assets/atlas.js, written by headmech.publish.site) and needs no server.
(function () {
  "use strict";
  var A = window.HEADMECH_ATLAS || { models: [] };
  var VERDICT = ["below the threshold", "labelled", "at or above the threshold, not labelled",
    "borderline", "at or above the threshold, not labelled"];
  function model(name) { return A.models.filter(function (m) { return m.name === name; })[0]; }
  function headName(m, i) { return "L" + Math.floor(i / m.heads) + "H" + (i % m.heads); }
  function headIndex(m, name) {
    var x = /^L(\d+)H(\d+)$/i.exec(name || "");
    if (!x || +x[1] >= m.layers || +x[2] >= m.heads) return -1;
    return +x[1] * m.heads + +x[2];
  }
  function fmt(v) { return v === null || v === undefined ? "–" : v.toFixed(3); }
  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    for (var k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function root() { return document.body.dataset.root || "."; }
  function headHref(mname, head) { return root() + "/heads/" + mname + "/" + head + ".html"; }

  // clickable heatmaps: <div class="hmap" data-model data-type>, layers as rows, heads as columns
  function heatmap(div) {
    var m = model(div.dataset.model), t = m && m.types[div.dataset.type];
    if (!t) return;
    var max = 0;
    t.scores.forEach(function (v) { if (v !== null && Math.abs(v) > max) max = Math.abs(v); });
    var grid = el("div", { "class": "hmap-grid", role: "group",
      "aria-label": div.dataset.type + " score of every head of " + m.name +
        " (rows: layers, columns: heads; outlined: labelled)" });
    grid.style.gridTemplateColumns = "2.4em repeat(" + m.heads + ", minmax(9px, 16px))";
    var head = el("div", { "class": "hmap-row", "aria-hidden": "true" });
    head.appendChild(el("span", { "class": "hmap-lab" }, ""));
    for (var h = 0; h < m.heads; h++) head.appendChild(el("span", { "class": "hmap-lab" }, String(h)));
    grid.appendChild(head);
    for (var la = 0; la < m.layers; la++) {
      var row = el("div", { "class": "hmap-row" });
      row.appendChild(el("span", { "class": "hmap-lab", "aria-hidden": "true" }, "L" + la));
      for (h = 0; h < m.heads; h++) {
        var i = la * m.heads + h, v = t.scores[i], name = "L" + la + "H" + h;
        var label = name + ": " + fmt(v) + " (threshold " + t.threshold + "), " + VERDICT[t.verdicts[i]];
        var a = el("a", { href: headHref(m.name, name), title: label, "aria-label": label,
          "class": "hmap-cell v" + t.verdicts[i], "data-head": name });
        var s = v === null || !max ? 0 : Math.abs(v) / max;
        a.style.background = v === null ? "" : (v < 0 ? "rgba(214,39,40," : "rgba(31,119,180,") + (0.05 + 0.95 * s).toFixed(3) + ")";
        row.appendChild(a);
      }
      grid.appendChild(row);
    }
    div.appendChild(grid);
    div.appendChild(colourBar(max, t.scores.some(function (v) { return v !== null && v < 0; })));
  }

  // a heatmap's colour bar: blue for positive scores, red for negative, by size
  function colourBar(max, negative) {
    var bar = el("div", { "class": "hmap-bar", role: "img",
      "aria-label": "colour scale: " + (negative ? "red -" + fmt(max) + " to " : "") + "white 0 to blue " + fmt(max) });
    var grad = el("span", { "class": "hmap-grad" });
    grad.style.background = "linear-gradient(to right, " + (negative ? "rgba(214,39,40,1), rgba(214,39,40,0.05), " : "") +
      "rgba(31,119,180,0.05), rgba(31,119,180,1))";
    bar.appendChild(el("span", { "class": "hmap-lo" }, negative ? "-" + fmt(max) : "0"));
    bar.appendChild(grad);
    bar.appendChild(el("span", { "class": "hmap-hi" }, fmt(max)));
    return bar;
  }

  // sortable tables: click (or Enter on) a column header
  function sortable(table) {
    var ths = table.querySelectorAll("thead th");
    ths.forEach(function (th, c) {
      th.tabIndex = 0;
      th.setAttribute("aria-sort", "none");
      th.classList.add("sorter");
      function go() {
        var asc = th.getAttribute("aria-sort") !== "ascending";
        ths.forEach(function (o) { o.setAttribute("aria-sort", "none"); });
        th.setAttribute("aria-sort", asc ? "ascending" : "descending");
        var body = table.tBodies[0], rows = [].slice.call(body.rows);
        function key(r) {
          var cell = r.cells[c], x = cell ? (cell.dataset.sort || cell.textContent.trim()) : "";
          var n = parseFloat(x.replace(/^\[/, "").replace("–", ""));
          var lh = /^L(\d+)H(\d+)$/.exec(x);
          if (lh) return [0, +lh[1] * 1000 + +lh[2], x];
          return isNaN(n) ? [1, 0, x.toLowerCase()] : [0, n, x];
        }
        rows.sort(function (a, b) {
          var ka = key(a), kb = key(b), d = ka[0] - kb[0] || ka[1] - kb[1] ||
            (ka[2] < kb[2] ? -1 : ka[2] > kb[2] ? 1 : 0);
          return asc ? d : -d;
        });
        rows.forEach(function (r) { body.appendChild(r); });
      }
      th.addEventListener("click", go);
      th.addEventListener("keydown", function (e) { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); go(); } });
    });
  }
  // filter: <input class="filter" data-table="id">: rows that contain every word
  function filter(input) {
    var table = document.getElementById(input.dataset.table);
    input.addEventListener("input", function () {
      var words = input.value.toLowerCase().split(/\s+/).filter(Boolean);
      [].forEach.call(table.tBodies[0].rows, function (r) {
        var text = r.textContent.toLowerCase();
        r.hidden = !words.every(function (w) { return text.indexOf(w) >= 0; });
      });
    });
  }

  // search (index page): words naming a model, a head (L3H4) and/or a type
  var TYPES = {};
  A.models.forEach(function (m) { for (var t in m.types) TYPES[t] = 1; });
  function search(query) {
    var words = query.toLowerCase().split(/\s+/).filter(Boolean), out = [];
    var heads = [], models = [], types = [], rest = [];
    words.forEach(function (w) {
      if (/^l\d+(h\d*)?$/.test(w) || /^h\d+$/.test(w)) heads.push(w);
      else if (TYPES[w]) types.push(w);  // "induction" is a type before toy-induction
      else if (A.models.some(function (m) { return m.name.toLowerCase().indexOf(w) >= 0; })) models.push(w);
      else if (Object.keys(TYPES).some(function (t) { return t.indexOf(w) >= 0; })) types.push(w);
      else rest.push(w);
    });
    if (rest.length || !words.length) return out;
    A.models.forEach(function (m) {
      if (!models.every(function (w) { return m.name.toLowerCase().indexOf(w) >= 0; })) return;
      var ts = Object.keys(m.types).filter(function (t) {
        return types.every(function (w) { return TYPES[w] ? t === w : t.indexOf(w) >= 0; });
      });
      if (types.length && !ts.length) return;
      for (var i = 0; i < m.layers * m.heads; i++) {
        var name = headName(m, i), low = name.toLowerCase();
        if (!heads.every(function (w) {
          return w[0] === "h" ? low.split("h")[1] === w.slice(1) : (w.indexOf("h") > 0 ? low === w : low.split("h")[0] === w);
        })) continue;
        var labelled = Object.keys(m.types).filter(function (t) { return m.types[t].verdicts[i] === 1; });
        var hit = types.length ? ts.filter(function (t) { return labelled.indexOf(t) >= 0; }) : labelled;
        if (types.length && !hit.length && !heads.length) continue;  // a type alone: its labelled heads
        var best = ts.length === 1 ? m.types[ts[0]].scores[i] : null;
        out.push({ model: m.name, head: name, labelled: labelled, score: best, type: ts.length === 1 ? ts[0] : "" });
      }
    });
    return out;
  }
  function searchBox(input) {
    var body = document.querySelector("#results tbody"), count = document.getElementById("result-count");
    function run() {
      var found = search(input.value);
      body.textContent = "";
      found.slice(0, 300).forEach(function (r) {
        var tr = el("tr");
        tr.appendChild(el("td", {}, r.model));
        var td = el("td"); td.appendChild(el("a", { href: headHref(r.model, r.head) }, r.head)); tr.appendChild(td);
        tr.appendChild(el("td", {}, r.labelled.join(", ") || "–"));
        tr.appendChild(el("td", {}, r.type ? r.type + " " + fmt(r.score) : ""));
        var c = el("td"); c.appendChild(el("a", { href: "compare.html?a=" + r.model + "/" + r.head }, "compare")); tr.appendChild(c);
        body.appendChild(tr);
      });
      count.textContent = input.value.trim() ? found.length + " heads" + (found.length > 300 ? " (first 300 shown)" : "") : "";
    }
    // the address keeps the search (index.html#q=smollm2%20induction): a result list can be shared
    input.addEventListener("input", function () {
      run();
      if (window.history.replaceState) {
        history.replaceState(null, "", input.value.trim() ? "#q=" + encodeURIComponent(input.value) : location.pathname);
      }
    });
    if (/^#q=/.test(location.hash)) input.value = decodeURIComponent(location.hash.slice(3));
    if (input.value) run();
  }

  // compare view: compare.html?a=model/L3H4&b=model/L5H1
  function compare(box) {
    var q = new URLSearchParams(location.search);
    var sides = ["a", "b"].map(function (k) {
      var v = (q.get(k) || "").split("/");
      return { key: k, model: v[0] || (A.models[0] || {}).name, head: v[1] || "L0H0" };
    });
    var form = el("form", { "class": "compare-form" });
    sides.forEach(function (s) {
      var sel = el("select", { name: s.key + "m", "aria-label": "model of head " + s.key.toUpperCase() });
      A.models.forEach(function (m) {
        var o = el("option", { value: m.name }, m.name); if (m.name === s.model) o.selected = true; sel.appendChild(o);
      });
      var inp = el("input", { name: s.key + "h", value: s.head, size: "7", "aria-label": "head " + s.key.toUpperCase() + " (e.g. L3H4)" });
      var lab = el("label", {}, s.key.toUpperCase() + ": ");
      lab.appendChild(sel); lab.appendChild(inp); form.appendChild(lab);
    });
    form.appendChild(el("button", { type: "submit" }, "compare"));
    form.addEventListener("submit", function (e) {
      e.preventDefault();
      var f = form.elements;
      location.search = "?a=" + f.am.value + "/" + f.ah.value.toUpperCase() + "&b=" + f.bm.value + "/" + f.bh.value.toUpperCase();
    });
    box.appendChild(form);
    var ok = sides.every(function (s) { var m = model(s.model); return m && headIndex(m, s.head) >= 0; });
    if (!ok || !q.get("a")) {
      box.appendChild(el("p", { "class": "empty" }, q.get("a") ? "No such head: pick a model and a head (e.g. L3H4)." : "Pick two heads."));
      return;
    }
    var table = el("table", { "class": "heads sortable", id: "compare-table" });
    var thead = el("thead"), tr = el("tr");
    tr.appendChild(el("th", {}, "type"));
    sides.forEach(function (s) {
      var th = el("th"); th.appendChild(el("a", { href: headHref(s.model, s.head) }, s.model + " " + s.head));
      tr.appendChild(th); tr.appendChild(el("th", {}, "verdict"));
    });
    thead.appendChild(tr); table.appendChild(thead);
    var body = el("tbody");
    var types = {};
    sides.forEach(function (s) { for (var t in model(s.model).types) types[t] = 1; });
    Object.keys(types).sort().forEach(function (t) {
      var row = el("tr");
      row.appendChild(el("td", {}, t));
      sides.forEach(function (s) {
        var m = model(s.model), ty = m.types[t], i = headIndex(m, s.head);
        if (!ty) { row.appendChild(el("td", {}, "–")); row.appendChild(el("td", {}, "not classified")); return; }
        row.appendChild(el("td", { "class": "v" + ty.verdicts[i] }, fmt(ty.scores[i]) + " / " + ty.threshold));
        var why = ty.reasons[s.head];
        row.appendChild(el("td", {}, VERDICT[ty.verdicts[i]] + (why ? ": " + why : "")));
      });
      body.appendChild(row);
    });
    table.appendChild(body);
    var wrap = el("div", { "class": "scroll" });  // a narrow screen scrolls the table, not the page
    wrap.appendChild(table);
    box.appendChild(wrap);
    sortable(table);
    // the two heads' patterns side by side on the same text (an ordinary one both models
    // recorded), the last token pinned: each head page's own view, framed
    var probe = ["prose", "repeated_random"].filter(function (p) {
      return sides.every(function (s) { return (model(s.model).texts || []).some(function (t) { return t.probe === p; }); });
    })[0];
    if (!probe) return;
    box.appendChild(el("h2", {}, "On the same text: " + probe + " (the last token pinned)"));
    var pair = el("div", { "class": "compare-views" });
    sides.forEach(function (s) {
      var texts = model(s.model).texts, i = texts.map(function (t) { return t.probe; }).indexOf(probe);
      pair.appendChild(el("iframe", { src: headHref(s.model, s.head) + "#view-" + i + "=" + (texts[i].tokens - 1),
        title: s.model + " " + s.head + " on " + probe, "class": "compare-view", "data-side": s.key }));
    });
    box.appendChild(pair);
  }

  // layer view: every head of a layer on one text, for the query picked on the first line
  // the layer view: a select switches between the texts (one <script class="hm-data"> each)
  function layerView(box) {
    var scripts = [].slice.call(box.querySelectorAll("script.hm-data"));
    var view = el("div", { "class": "hm-lview" });
    if (scripts.length > 1) {
      var p = el("p", {}), label = el("label", {}, "text: ");
      var pick = el("select", { "class": "hm-text", "aria-label": "the text the heads are shown on" });
      scripts.forEach(function (sc, i) {
        var d = JSON.parse(sc.textContent);
        pick.appendChild(el("option", { value: String(i) }, d.probe + " (" + d.tokens.length + " tokens)"));
      });
      pick.addEventListener("change", function () { render(+pick.value); });
      label.appendChild(pick);
      p.appendChild(label);
      box.appendChild(p);
    }
    box.appendChild(view);
    function render(i) {
      while (view.firstChild) view.removeChild(view.firstChild);
      box.dataset.text = String(i);
      box.dataset.pinned = "-1";
      layerText(box, view, JSON.parse(scripts[i].textContent));
    }
    render(0);
  }

  function layerText(box, view, data) {
    var names = Object.keys(data.heads).sort(function (a, b) {
      return +a.split("H")[1] - +b.split("H")[1];
    });
    var shadeRgb = getComputedStyle(document.documentElement).getPropertyValue("--blue").trim() || "31, 119, 180";
    var strip = el("div", { "class": "hm-lrow hm-lquery" });
    strip.appendChild(el("span", { "class": "hm-lname" }, "query"));
    var qs = data.tokens.map(function (t, q) {
      var label = "query " + q + ": " + JSON.stringify(t);
      var s = el("span", { "class": "hm-ltok", tabindex: "0", role: "button", title: label, "aria-label": label }, t || "\u200b");
      strip.appendChild(s);
      return s;
    });
    view.appendChild(strip);
    var lines = names.map(function (name) {
      var row = el("div", { "class": "hm-lrow" });
      row.appendChild(el("a", { "class": "hm-lname", href: headHref(document.body.dataset.model, name) }, name));
      var labels = (data.labels || {})[name] || [];
      if (labels.length) row.appendChild(el("span", { "class": "hm-llab" }, labels.join(", ")));
      var cells = data.tokens.map(function (t) { var s = el("span", { "class": "hm-ltok" }, t || "\u200b"); row.appendChild(s); return s; });
      view.appendChild(row);
      return { name: name, cells: cells, rows: data.heads[name] };
    });
    var status = el("p", { "class": "small", role: "status" });
    view.appendChild(status);
    var pinned = -1;

    var ink = headmechInk;  // assets/site.js begins with INK_JS (headmech/publish/attention_view.py)
    function select(q) {
      qs.forEach(function (s, k) { s.classList.toggle("hm-query", k === q); });
      var best = [];
      lines.forEach(function (l) {
        var row = l.rows[q] || [], b = 0;
        l.cells.forEach(function (c, k) {
          var w = k < row.length ? row[k] / 1000 : null;
          c.style.background = w === null ? "" : "rgba(" + shadeRgb + "," + Math.min(1, w).toFixed(3) + ")";
          c.style.color = w === null ? "" : ink(w, shadeRgb);
          c.title = w === null ? "" : l.name + ": " + w.toFixed(3) + " on token " + k;
          c.dataset.w = w === null ? "" : w.toFixed(3);
          if (w !== null && w > row[b] / 1000) b = k;
        });
        best.push(l.name + " → " + b);
      });
      box.dataset.query = String(q);
      status.textContent = "query " + q + " " + JSON.stringify(data.tokens[q]) + "; most attended token per head: " + best.join(", ");
    }
    qs.forEach(function (s, q) {
      s.addEventListener("mouseenter", function () { if (pinned < 0) select(q); });
      s.addEventListener("focus", function () { if (pinned < 0) select(q); });
      function pin() { pinned = pinned === q ? -1 : q; box.dataset.pinned = String(pinned); select(q); }
      s.addEventListener("click", pin);
      s.addEventListener("keydown", function (e) { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); pin(); } });
    });
    select(data.tokens.length - 1);
  }

  // every head of a model along two metrics (HeadVis's configurable scatter):
  // <div class="scatter" data-model>; x and y from selects (relative depth or any type's
  // score), colour: the head's verdict on the y axis's type; a point links to its head
  var SVGNS = "http://www.w3.org/2000/svg";
  function svg(tag, attrs) {
    var e = document.createElementNS(SVGNS, tag);
    for (var k in attrs || {}) e.setAttribute(k, attrs[k]);
    return e;
  }
  function scatter(div) {
    var m = model(div.dataset.model);
    if (!m) return;
    var names = Object.keys(m.types).sort(), depth = "relative depth (layer / (layers - 1))";
    function values(metric) {
      var out = [];
      for (var i = 0; i < m.layers * m.heads; i++) {
        out.push(metric === depth ? Math.floor(i / m.heads) / Math.max(m.layers - 1, 1) : m.types[metric].scores[i]);
      }
      return out;
    }
    var first = names.filter(function (n) { return m.types[n].verdicts.indexOf(1) >= 0; })[0] || names[0];
    var controls = el("p", { "class": "scatter-axes" });
    var sel = {};
    ["x", "y"].forEach(function (axis) {
      var label = el("label", {}, axis + ": ");
      var s = el("select", { "data-axis": axis, "aria-label": axis + " axis" });
      [depth].concat(names).forEach(function (n) { s.appendChild(el("option", { value: n }, n)); });
      s.value = axis === "x" ? depth : first;
      s.addEventListener("change", draw);
      label.appendChild(s);
      controls.appendChild(label);
      controls.appendChild(document.createTextNode(" "));
      sel[axis] = s;
    });
    div.appendChild(controls);
    var W = 560, H = 340, P = 44;
    var plot = svg("svg", { viewBox: "0 0 " + W + " " + H, width: "100%", role: "group", "class": "scatter-plot" });
    div.appendChild(plot);
    function draw() {
      while (plot.firstChild) plot.removeChild(plot.firstChild);
      var xm = sel.x.value, ym = sel.y.value, xs = values(xm), ys = values(ym);
      var colour = ym === depth ? null : m.types[ym].verdicts;
      function range(v) {
        var lo = Infinity, hi = -Infinity;
        v.forEach(function (a) { if (a !== null) { lo = Math.min(lo, a); hi = Math.max(hi, a); } });
        if (!(hi > lo)) { lo -= 0.5; hi += 0.5; }
        return [lo, hi];
      }
      var rx = range(xs), ry = range(ys);
      function px(v) { return P + (v - rx[0]) / (rx[1] - rx[0]) * (W - 2 * P); }
      function py(v) { return H - P - (v - ry[0]) / (ry[1] - ry[0]) * (H - 2 * P); }
      plot.setAttribute("aria-label", m.name + ": every head, x " + xm + ", y " + ym);
      plot.appendChild(svg("rect", { x: P, y: P, width: W - 2 * P, height: H - 2 * P, "class": "scatter-frame" }));
      [[rx[0], P, H - P + 14, "start"], [rx[1], W - P, H - P + 14, "end"]].forEach(function (t) {
        var e = svg("text", { x: t[1], y: t[2], "text-anchor": t[3], "class": "scatter-tick" });
        e.textContent = t[0].toFixed(2);
        plot.appendChild(e);
      });
      [[ry[0], H - P], [ry[1], P + 4]].forEach(function (t) {
        var e = svg("text", { x: P - 4, y: t[1], "text-anchor": "end", "class": "scatter-tick" });
        e.textContent = t[0].toFixed(2);
        plot.appendChild(e);
      });
      var xl = svg("text", { x: W / 2, y: H - 8, "text-anchor": "middle", "class": "scatter-label" });
      xl.textContent = xm;
      plot.appendChild(xl);
      var yl = svg("text", { x: 12, y: H / 2, "text-anchor": "middle", transform: "rotate(-90 12 " + H / 2 + ")", "class": "scatter-label" });
      yl.textContent = ym;
      plot.appendChild(yl);
      for (var i = 0; i < xs.length; i++) {
        if (xs[i] === null || ys[i] === null) continue;
        var name = headName(m, i), v = colour ? colour[i] : 0;
        var a = svg("a", { href: headHref(m.name, name), "data-head": name });
        var c = svg("circle", { cx: px(xs[i]).toFixed(1), cy: py(ys[i]).toFixed(1), r: v === 1 ? 4.5 : 3, "class": "pt v" + v });
        var tip = svg("title", {});
        tip.textContent = name + ": " + xm + " " + fmt(xs[i]) + ", " + ym + " " + fmt(ys[i]) + (colour ? " (" + VERDICT[v] + ")" : "");
        c.appendChild(tip);
        a.appendChild(c);
        plot.appendChild(a);
      }
    }
    draw();
  }

  document.querySelectorAll(".hmap").forEach(heatmap);
  document.querySelectorAll(".scatter").forEach(scatter);
  document.querySelectorAll(".hm-layer").forEach(layerView);
  document.querySelectorAll("table.sortable").forEach(sortable);
  document.querySelectorAll("input.filter").forEach(filter);
  var s = document.getElementById("search");
  if (s) searchBox(s);
  var c = document.getElementById("compare");
  if (c) compare(c);
  window.headmechSearch = search;
})();
