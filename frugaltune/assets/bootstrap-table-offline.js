/* frugaltune: an offline stand-in for bootstrap-table, which no Python package ships.
 * Great Expectations' data-docs index builds its list of validations with
 * $(table).bootstrapTable({columns, data, rowStyle, rowAttributes, sortName, sortOrder, ...}).
 * This draws the same rows (cells are GX's own HTML), applies the row style/attribute callbacks GX names,
 * sorts once by sortName/sortOrder, and fires 'click-row.bs.table' so GX's row links work.
 * No interactive sorting, search, filters or pagination; method calls ('resetSearch', ...) are no-ops.
 * Tables that already hold their rows in HTML (data-toggle="table") are left as they are. */
(function ($) {
  "use strict";
  function named(fn) { return typeof fn === "string" ? window[fn] : fn; }
  $.fn.bootstrapTable = function (options) {
    if (typeof options !== "object" || options === null || !Array.isArray(options.data)) { return this; }
    return this.each(function () {
      var $table = $(this), columns = options.columns || [], rows = options.data.slice();
      if (options.sortName) {
        var column = columns.filter(function (c) { return c.field === options.sortName; })[0];
        var key = (column && column.sortName) || options.sortName, sign = options.sortOrder === "desc" ? -1 : 1;
        rows.sort(function (a, b) { return a[key] < b[key] ? -sign : a[key] > b[key] ? sign : 0; });
      }
      var $head = $("<tr>");
      columns.forEach(function (c) { $head.append($("<th>").text(c.title || c.field)); });
      var $body = $("<tbody>"), style = named(options.rowStyle), attrs = named(options.rowAttributes);
      rows.forEach(function (row, i) {
        var $tr = $("<tr>");
        if (style) { var s = style(row, i) || {}; if (s.css) { $tr.css(s.css); } if (s.classes) { $tr.addClass(s.classes); } }
        if (attrs) { $tr.attr(attrs(row, i) || {}); }
        columns.forEach(function (c) {
          var value = row[c.field];
          $tr.append($("<td>").html(value === undefined || value === null ? "" : String(value)).css("text-align", c.align || ""));
        });
        $tr.on("click", function () { $table.trigger("click-row.bs.table", [row, $tr]); });
        $body.append($tr);
      });
      $table.addClass("table table-hover").empty().append($("<thead>").append($head), $body);
    });
  };
})(jQuery);
