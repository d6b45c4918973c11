"""One document model, two renderings: self-contained HTML and GitHub Markdown.

A report is a list of blocks (headings, text, tables, footnotes, code, images). The HTML
embeds its CSS and images (base64 PNG): it reads offline, with no script and no network. The
Markdown carries the same text; images are linked as files beside it, because GitHub does not
show ``data:`` images. Table cells may carry a tooltip (HTML ``title``), a CSS class and a
footnote number; the footnote is visible in both renderings, the tooltip only in HTML.

Inline markup in text: ``code`` spans only, written with backticks.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import re
from typing import Sequence, Union

from clipbench.reports.plots import Plot


@dataclasses.dataclass(frozen=True)
class Cell:
  text: str
  title: str = ""
  css: str = ""
  note: int | None = None  # footnote number in the table's ``notes`` namespace


@dataclasses.dataclass(frozen=True)
class Heading:
  text: str
  level: int = 2
  anchor: str = ""


@dataclasses.dataclass(frozen=True)
class Text:
  text: str
  css: str = ""


@dataclasses.dataclass(frozen=True)
class Table:
  columns: tuple[Union[Cell, str], ...]
  rows: tuple[tuple[Union[Cell, str], ...], ...]
  notes: str = ""  # anchor prefix of the Notes block its cells refer to
  css: str = ""


@dataclasses.dataclass(frozen=True)
class Notes:
  items: tuple[tuple[int, str], ...]
  prefix: str


@dataclasses.dataclass(frozen=True)
class Code:
  text: str
  language: str = "python"


@dataclasses.dataclass(frozen=True)
class Image:
  plot: Plot


@dataclasses.dataclass(frozen=True)
class Facts:
  """A two-column list of labels and values (machine description, inputs)."""

  items: tuple[tuple[str, str], ...]


Block = Union[Heading, Text, Table, Notes, Code, Image, Facts]


@dataclasses.dataclass(frozen=True)
class Document:
  title: str
  blocks: tuple[Block, ...]


def image_path(plot: Plot) -> str:
  """Where the Markdown rendering expects the PNG, relative to REPORT.md."""
  return f"plots/{plot.name}.png"


def _as_cell(cell: Union[Cell, str]) -> Cell:
  return cell if isinstance(cell, Cell) else Cell(str(cell))


# --- HTML ------------------------------------------------------------------------------------

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0 auto;
 max-width:1500px;padding:16px 28px;color:#1b1f24}
h1{font-size:26px;margin-bottom:4px} h2{border-bottom:1px solid #d0d7de;padding-bottom:4px;
 margin-top:34px} h3{margin-top:22px} h4{margin:18px 0 4px}
table{border-collapse:collapse;margin:8px 0 14px;font-size:13px}
th,td{border:1px solid #d0d7de;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f3f5f7;position:sticky;top:0}
td.num{text-align:right;font-variant-numeric:tabular-nums}
td.st-pass{background:#dafbe1} td.st-deviation{background:#fff1c2}
td.st-fail{background:#ffd7d5;font-weight:600} td.st-na{background:#eef0f2;color:#6e7781}
td.best{font-weight:600}
sup a{text-decoration:none}
code,pre{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px}
pre{background:#f6f8fa;border:1px solid #d0d7de;padding:8px;overflow-x:auto;max-width:100%}
ol.notes{font-size:12.5px;color:#333} ol.notes li{margin:2px 0}
dl.facts{display:grid;grid-template-columns:max-content auto;gap:2px 14px}
dl.facts dt{font-weight:600} dl.facts dd{margin:0}
img{max-width:100%;border:1px solid #eee} figure{margin:10px 0 20px}
figcaption{font-size:12.5px;color:#555}
.muted{color:#6e7781} nav.toc{font-size:13px}
"""


def _inline_html(text: str) -> str:
  return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


def _html_cell(cell: Cell, tag: str, notes: str) -> str:
  attrs = ""
  if cell.css:
    attrs += f' class="{html.escape(cell.css)}"'
  if cell.title:
    attrs += f' title="{html.escape(cell.title)}"'
  body = _inline_html(cell.text)
  if cell.note is not None:
    body += f'<sup><a href="#{notes}-{cell.note}">[{cell.note}]</a></sup>'
  return f"<{tag}{attrs}>{body}</{tag}>"


def _html_block(block: Block) -> str:
  if isinstance(block, Heading):
    anchor = f' id="{html.escape(block.anchor)}"' if block.anchor else ""
    return f"<h{block.level}{anchor}>{_inline_html(block.text)}</h{block.level}>"
  if isinstance(block, Text):
    css = f' class="{html.escape(block.css)}"' if block.css else ""
    return f"<p{css}>{_inline_html(block.text)}</p>"
  if isinstance(block, Table):
    head = "".join(_html_cell(_as_cell(c), "th", block.notes) for c in block.columns)
    body = "\n".join(
        "<tr>" + "".join(_html_cell(_as_cell(c), "td", block.notes) for c in row) + "</tr>"
        for row in block.rows)
    css = f' class="{html.escape(block.css)}"' if block.css else ""
    return f"<table{css}><thead><tr>{head}</tr></thead><tbody>\n{body}\n</tbody></table>"
  if isinstance(block, Notes):
    items = "\n".join(f'<li id="{block.prefix}-{n}" value="{n}">{_inline_html(t)}</li>'
                      for n, t in block.items)
    return f'<ol class="notes">\n{items}\n</ol>'
  if isinstance(block, Code):
    return f"<pre><code>{html.escape(block.text)}</code></pre>"
  if isinstance(block, Image):
    data = base64.b64encode(block.plot.png).decode("ascii")
    title = html.escape(block.plot.title)
    return (f'<figure><img alt="{title}" src="data:image/png;base64,{data}">'
            f"<figcaption>{title}</figcaption></figure>")
  if isinstance(block, Facts):
    items = "".join(f"<dt>{_inline_html(k)}</dt><dd>{_inline_html(v)}</dd>"
                    for k, v in block.items)
    return f'<dl class="facts">{items}</dl>'
  raise TypeError(f"block: unknown block type {type(block).__name__}")


def to_html(doc: Document) -> str:
  toc = [b for b in doc.blocks if isinstance(b, Heading) and b.level == 2 and b.anchor]
  nav = " · ".join(f'<a href="#{html.escape(h.anchor)}">{html.escape(h.text)}</a>' for h in toc)
  body = "\n".join(_html_block(b) for b in doc.blocks)
  return (
      "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
      "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
      f"<title>{html.escape(doc.title)}</title><style>{_CSS}</style></head>\n<body>\n"
      f"<h1>{html.escape(doc.title)}</h1>\n<nav class=\"toc\">{nav}</nav>\n{body}\n"
      "</body></html>\n")


# --- Markdown --------------------------------------------------------------------------------

def _md_cell(cell: Cell) -> str:
  text = cell.text + (f" [{cell.note}]" if cell.note is not None else "")
  return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _md_block(block: Block) -> str:
  if isinstance(block, Heading):
    anchor = f'<a id="{block.anchor}"></a>\n' if block.anchor else ""
    return f"{anchor}{'#' * block.level} {block.text}"
  if isinstance(block, Text):
    return block.text
  if isinstance(block, Table):
    head = "| " + " | ".join(_md_cell(_as_cell(c)) for c in block.columns) + " |"
    rule = "|" + "|".join("---" for _ in block.columns) + "|"
    rows = ["| " + " | ".join(_md_cell(_as_cell(c)) for c in row) + " |" for row in block.rows]
    return "\n".join([head, rule, *rows])
  if isinstance(block, Notes):
    return "\n".join(f"- <a id=\"{block.prefix}-{n}\"></a>**[{n}]** {t}" for n, t in block.items)
  if isinstance(block, Code):
    fence = "````" if "```" in block.text else "```"
    return f"{fence}{block.language}\n{block.text.rstrip()}\n{fence}"
  if isinstance(block, Image):
    return f"![{block.plot.title}]({image_path(block.plot)})"
  if isinstance(block, Facts):
    return "\n".join(f"- **{k}**: {v}" for k, v in block.items)
  raise TypeError(f"block: unknown block type {type(block).__name__}")


def to_markdown(doc: Document) -> str:
  return f"# {doc.title}\n\n" + "\n\n".join(_md_block(b) for b in doc.blocks) + "\n"


def plots_of(doc: Document) -> Sequence[Plot]:
  return [b.plot for b in doc.blocks if isinstance(b, Image)]
