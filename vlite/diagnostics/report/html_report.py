"""``report.html``: the Markdown report as one self-contained HTML file, every PNG plot embedded
as a ``data:image/png;base64`` URI, so that one file can be attached to an incident ticket.

Markdown is rendered with markdown-it-py (CommonMark, tables on), which Rich already depends on.
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

from vlite.diagnostics.report.atomic import atomic_write_text

_STYLE = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;font-size:13px;margin:0.5em 0}td,th{border:1px solid #ccc;padding:2px 6px}
th{background:#f3f3f3}pre,code{background:#f6f6f6;font-size:12px}pre{padding:0.6em;overflow-x:auto}
img{max-width:100%;border:1px solid #eee;margin:0.5em 0}"""


def render_html(markdown_text: str, out_dir: Path, title: str) -> str:
    """The HTML page of ``markdown_text``; images named relative to ``out_dir`` are inlined.

    Raises:
        OSError: a referenced PNG cannot be read.
    """
    from markdown_it import MarkdownIt

    body = MarkdownIt("commonmark", {"html": False}).enable("table").render(markdown_text)

    def inline(m: re.Match) -> str:
        src = html.unescape(m.group(1))
        path = Path(out_dir) / src
        if "/" in src or not src.endswith(".png") or not path.is_file():
            return m.group(0)
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        return f'src="data:image/png;base64,{data}"'

    body = re.sub(r'src="([^"]+)"', inline, body)
    return (f"<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body>\n{body}</body></html>\n")


def write_html(out_dir: Path, markdown_text: str, title: str = "vlite leak-check report") -> Path:
    """Write ``out_dir/report.html`` from the report's Markdown (plots embedded); returns its path."""
    path = Path(out_dir) / "report.html"
    atomic_write_text(path, render_html(markdown_text, out_dir, title))
    return path
