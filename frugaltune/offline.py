"""HTML reports that render with no network: the JavaScript and CSS they need, from installed packages.

`dvc plots show` and Great Expectations' data docs load Vega, Bootstrap, jQuery and Font Awesome from CDNs, so
on the machines this product is for (offline by design) they open blank or unstyled. This module puts local copies
beside them, taken from PyPI packages pinned in pyproject.toml (vl-convert-python's Vega bundle, the XStatic
packages), never downloaded at run time:

    python -m frugaltune.offline dvc-template    # .dvc/plots_template.html, which .dvc/config names (make install)
    python -m frugaltune.offline data-docs DIR   # rewrite DIR/**/*.html to DIR/static/vendor/ (validate stage)

The one library no package ships is bootstrap-table, which GX's index page needs to draw its list of validations;
`assets/bootstrap-table-offline.js` stands in for it (rows, row links, row styles; no sorting or filtering).
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from functools import cache
from pathlib import Path

from frugaltune.io import write_text

ASSETS = Path(__file__).parent / "assets"
VEGA_LITE_VERSION = "5.20"  # DVC's templates declare Vega-Lite v5 schemas; GX loads vega-lite@5
DVC_TEMPLATE = Path(".dvc") / "plots_template.html"  # .dvc/config: plots.html_template = plots_template.html


@cache
def vega_bundle() -> str:
    """Vega, Vega-Lite and vega-embed in one classic script that sets window.vega / vegaLite / vegaEmbed."""
    import vl_convert

    return vl_convert.javascript_bundle(vl_version=VEGA_LITE_VERSION)


def dvc_plots_template() -> str:
    """A `dvc plots show` page template with Vega inlined.

    It has no `{scripts}` placeholder on purpose: that is where dvc-render puts its CDN <script> tags.
    """
    # A "</script" inside the bundle would end the inline script early; the bundle is minified JS, escape it anyway.
    bundle = vega_bundle().replace("</script", "<\\/script")
    return ("<!DOCTYPE html>\n<html>\n<head>\n    {refresh_tag}\n    <meta charset=\"utf-8\">\n"
            "    <title>DVC Plot (offline)</title>\n    <script type=\"text/javascript\">\n" + bundle +
            "\n    </script>\n    <style>\n        table { border-spacing: 15px; }\n    </style>\n</head>\n"
            "<body>\n    {plot_divs}\n</body>\n</html>\n")


def write_dvc_template(path: Path = DVC_TEMPLATE) -> Path:
    write_text(path, dvc_plots_template())
    return path


def _xstatic(module: str, *parts: str) -> Path:
    """A file inside an XStatic package (`xstatic.pkg.<module>`), named in the error when the package is missing."""
    try:
        pkg = __import__(f"xstatic.pkg.{module}", fromlist=["BASE_DIR"])
    except ImportError as exc:
        raise FileNotFoundError(f"the offline assets need the XStatic package xstatic.pkg.{module} (run `make "
                                f"install`; it is pinned in pyproject.toml)") from exc
    return Path(pkg.BASE_DIR, *parts)


# CDN URL (a regex on the src/href value) -> the vendored file under static/vendor/, or None to drop the tag.
# Bootstrap 4.5 stands in for GX's 4.3 (same major, same classes); bootstrap.bundle includes Popper, so Popper's own
# tag goes; the Vega bundle replaces vega, vega-lite and vega-embed (the first of the three tags loads it).
DATA_DOCS_ASSETS: list[tuple[str, str | None]] = [
    (r"https://code\.jquery\.com/jquery-[\d.]+(\.min)?\.js", "jquery.min.js"),
    (r"https://[^\"']*bootstrap/4\.[\d.]+/css/bootstrap(\.min)?\.css", "bootstrap/css/bootstrap.min.css"),
    (r"https://[^\"']*bootstrap/4\.[\d.]+/js/bootstrap(\.min)?\.js", "bootstrap/js/bootstrap.bundle.min.js"),
    (r"https://[^\"']*popper\.js/[\d.]+/umd/popper(\.min)?\.js", None),
    (r"https://[^\"']*font-awesome/[\d.]+/css/all(\.min)?\.css", "font-awesome/css/all.min.css"),
    (r"https://[^\"']*bootstrap-datepicker/[\d.]+/js/bootstrap-datepicker(\.min)?\.js", "bootstrap-datepicker.js"),
    (r"https://[^\"']*bootstrap-datepicker/[\d.]+/css/bootstrap-datepicker(\.min)?\.css",
     "bootstrap-datepicker.css"),
    (r"https://[^\"']*bootstrap-table@[\d.]+/dist/bootstrap-table(\.min)?\.js", "bootstrap-table-offline.js"),
    (r"https://[^\"']*bootstrap-table@[\d.]+/dist/[^\"']*\.(css|js)", None),  # filter-control, the table CSS
    (r"https://[^\"']*bootstrap-dark@[\d.]+/[^\"']*\.css", None),  # a dark theme: the default one is enough
    (r"https://cdn\.jsdelivr\.net/npm/vega@\d[\d.]*", "vega-bundle.js"),
    (r"https://cdn\.jsdelivr\.net/npm/vega-(lite|embed)@\d[\d.]*", None),
    # GX's logo from S3: the same image ships in the site's own static/images
    (r"https://great-expectations-web-assets\.s3[^\"']*/logo-long\.png[^\"']*", "../images/logo-long.png"),
]


def vendor_files(vendor: Path) -> None:
    """Copy every asset the data docs need into `vendor` (idempotent; a few MB, mostly Font Awesome's fonts)."""
    vendor.mkdir(parents=True, exist_ok=True)
    shutil.copy2(_xstatic("jquery", "jquery.min.js"), vendor / "jquery.min.js")
    for sub, name in (("css", "bootstrap.min.css"), ("js", "bootstrap.bundle.min.js")):
        (vendor / "bootstrap" / sub).mkdir(parents=True, exist_ok=True)
        shutil.copy2(_xstatic("bootstrap", sub, name), vendor / "bootstrap" / sub / name)
    fa = vendor / "font-awesome"
    (fa / "css").mkdir(parents=True, exist_ok=True)
    shutil.copy2(_xstatic("font_awesome", "css", "all.min.css"), fa / "css" / "all.min.css")
    shutil.copytree(_xstatic("font_awesome", "webfonts"), fa / "webfonts", dirs_exist_ok=True)
    shutil.copy2(_xstatic("bootstrap_datepicker", "bootstrap-datepicker.js"), vendor / "bootstrap-datepicker.js")
    shutil.copy2(_xstatic("bootstrap_datepicker", "bootstrap-datepicker3.standalone.css"),
                 vendor / "bootstrap-datepicker.css")
    shutil.copy2(ASSETS / "bootstrap-table-offline.js", vendor / "bootstrap-table-offline.js")
    write_text(vendor / "vega-bundle.js", vega_bundle())


_TAG = re.compile(r"<(script|link)\b[^>]*?(?:src|href)=[\"'](https://[^\"']+)[\"'][^>]*>(\s*</script>)?", re.S)
_IMG = re.compile(r"(<img\b[^>]*?src=[\"'])(https://[^\"']+)([\"'])")


def rewrite_html(html: str, prefix: str) -> str:
    """Point every known CDN tag of one page at `prefix` + the vendored file (prefix: the page's way to vendor/).

    A tag whose library is replaced by another (Popper, the other two Vega scripts) is removed; an unknown CDN URL
    is left as it is (the check in `remote_urls` names it).
    """
    def local(url: str) -> str | None | bool:
        for pattern, target in DATA_DOCS_ASSETS:
            if re.fullmatch(pattern, url):
                return target
        return False  # not ours to touch

    def tag(match: re.Match) -> str:
        target = local(match.group(2))
        if target is False:
            return match.group(0)
        if target is None:
            return ""
        return match.group(0).replace(match.group(2), prefix + target)

    def img(match: re.Match) -> str:
        target = local(match.group(2))
        return match.group(0) if not target else match.group(1) + prefix + target + match.group(3)

    return _IMG.sub(img, _TAG.sub(tag, html))


def remote_urls(html: str) -> list[str]:
    """URLs a page would still fetch to render (scripts, stylesheets, images); links a user clicks do not count."""
    loads = re.findall(r"<(?:script|img)\b[^>]*?src=[\"'](https?://[^\"']+)", html)
    for link in re.findall(r"<link\b[^>]*>", html):
        href = re.search(r"href=[\"'](https?://[^\"']+)", link)
        if href and "stylesheet" in link:
            loads.append(href.group(1))
    return loads


def vendor_data_docs(site: Path) -> list[str]:
    """Make a GX data-docs site render offline. Returns the remote URLs left (empty when it is fully offline)."""
    vendor = site / "static" / "vendor"
    vendor_files(vendor)
    left: list[str] = []
    for page in sorted(site.rglob("*.html")):
        depth = len(page.relative_to(site).parts) - 1
        prefix = "../" * depth + "static/vendor/"
        html = page.read_text(encoding="utf-8")
        new = rewrite_html(html, prefix)
        if new != html:
            write_text(page, new)
        left += [f"{page.relative_to(site)}: {url}" for url in remote_urls(new)]
    return left


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m frugaltune.offline", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("dvc-template", help=f"write {DVC_TEMPLATE} (Vega inlined) for `dvc plots show`")
    docs = sub.add_parser("data-docs", help="vendor a GX data-docs site's CDN assets")
    docs.add_argument("site", type=Path)
    args = parser.parse_args(argv)
    if args.what == "dvc-template":
        print(f"offline: wrote {write_dvc_template()}")
        return 0
    left = vendor_data_docs(args.site)
    for url in left:
        print(f"offline: still remote: {url}", file=sys.stderr)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
