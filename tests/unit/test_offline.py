"""Offline HTML (frugaltune/offline.py) and numbers-only metrics files (frugaltune.io.write_metrics)."""

from __future__ import annotations

import json

import pytest

from frugaltune import offline
from frugaltune.io import write_metrics

GX_HEAD = """<html><head>
<link rel="stylesheet" href="https://maxcdn.bootstrapcdn.com/bootstrap/4.3.1/css/bootstrap.min.css"/>
<link rel="stylesheet" href="https://cdnjs.cloudflare.com/ajax/libs/font-awesome/6.6.0/css/all.min.css"/>
<link rel="stylesheet" href="https://unpkg.com/bootstrap-table@1.19.1/dist/bootstrap-table.min.css">
<link rel="stylesheet" href="https://cdn.jsdelivr.net/npm/@forevolve/bootstrap-dark@1.1.0/dist/css/bootstrap-prefers-dark.css"/>
<script src="https://code.jquery.com/jquery-3.7.1.min.js"></script>
<script src="https://cdnjs.cloudflare.com/ajax/libs/popper.js/1.12.9/umd/popper.min.js"></script>
<script src="https://stackpath.bootstrapcdn.com/bootstrap/4.3.1/js/bootstrap.min.js"></script>
<script src="https://unpkg.com/bootstrap-table@1.19.1/dist/bootstrap-table.min.js"></script>
<script src="https://cdn.jsdelivr.net/npm/vega@5"></script>
<script src="https://cdn.jsdelivr.net/npm/vega-lite@5"></script>
<script src="https://cdn.jsdelivr.net/npm/vega-embed@6"></script>
</head><body><a href="https://greatexpectations.io">GX</a>
<img src="https://great-expectations-web-assets.s3.us-east-2.amazonaws.com/logo-long.png?d=1"/></body></html>"""


def test_gx_pages_point_at_vendored_files_and_load_nothing_remote():
    assert len(offline.remote_urls(GX_HEAD)) == 12
    html = offline.rewrite_html(GX_HEAD, "../static/vendor/")
    assert offline.remote_urls(html) == []
    assert '<script src="../static/vendor/jquery.min.js">' in html
    assert "../static/vendor/bootstrap/js/bootstrap.bundle.min.js" in html  # Popper is inside the bundle
    assert html.count("vega-bundle.js") == 1 and "popper" not in html
    assert 'href="https://greatexpectations.io"' in html  # a link the reader clicks is not a load


def test_vendored_files_exist(tmp_path):
    offline.vendor_files(tmp_path)
    for _, target in offline.DATA_DOCS_ASSETS:
        if target and not target.startswith(".."):
            assert (tmp_path / target).is_file(), target
    assert "window.vegaEmbed" in (tmp_path / "vega-bundle.js").read_text()
    assert list((tmp_path / "font-awesome/webfonts").glob("*.woff2"))


def test_dvc_template_inlines_vega_and_leaves_out_the_cdn_placeholder(tmp_path):
    path = offline.write_dvc_template(tmp_path / "plots_template.html")
    text = path.read_text()
    assert "{plot_divs}" in text and "{scripts}" not in text  # dvc-render puts its CDN tags in {scripts}
    assert "window.vegaEmbed" in text and "https://cdn" not in text


def test_metrics_files_hold_numbers_only(tmp_path):
    write_metrics(tmp_path / "m.json", {"macro_f1": 0.73, "steps": 178})
    assert json.loads((tmp_path / "m.json").read_text()) == {"macro_f1": 0.73, "steps": 178}
    for bad in ({"reason": "fp32 measured"}, {"plan": {"eta": 3}}, {"promoted": True}):
        with pytest.raises(TypeError, match=f"metric '{next(iter(bad))}'.*numbers only"):
            write_metrics(tmp_path / "bad.json", bad)
    assert not (tmp_path / "bad.json").exists()
