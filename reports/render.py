"""One document model, two renderings: self-contained HTML and GitHub Markdown.

A report is a list of blocks (headings, text, tables, footnotes, code, images, collapsed
sections). The HTML embeds its CSS and links its images as the PNG files beside it (``plots/``),
as the Markdown does: the report folder reads offline, with no script and no network, and
neither page carries megabytes of base64. Both open with a table of contents; wide tables
scroll sideways instead of being clipped; a :class:`Details` block is a ``<details>`` element
in both (GitHub renders it collapsed). Table cells may carry a tooltip (HTML ``title``), a CSS
class and a footnote number; the footnote is visible in both renderings, the tooltip only in
HTML.

Inline markup in text: ``code`` spans only, written with backticks.
"""

from __future__ import annotations

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


@dataclasses.dataclass(frozen=True)
class Details:
  """A collapsed section: ``label`` (bold) and ``summary`` are always visible, ``blocks``
  open on a click."""

  summary: str
  blocks: tuple["Block", ...]
  label: str = ""


Block = Union[Heading, Text, Table, Notes, Code, Image, Facts, Details]


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
th{background:#f3f5f7}
div.scroll{overflow-x:auto;max-width:100%;margin:8px 0 14px} div.scroll>table{margin:0}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
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
.muted{color:#6e7781}
nav.toc{font-size:13px;background:#f6f8fa;border:1px solid #d0d7de;padding:6px 14px;
 display:inline-block} nav.toc ul{margin:2px 0;padding-left:18px}
details{border:1px solid #d0d7de;border-radius:4px;margin:6px 0;padding:2px 10px}
details>summary{cursor:pointer;padding:3px 0} details[open]>summary{margin-bottom:4px}
td.sev-silent-wrong-value,td.sev-unlisted-failures{background:#ffd7d5;font-weight:600}
td.sev-invalid-input-accepted,td.sev-valid-input-rejected{background:#ffe4c2}
td.sev-non-finite-policy,td.sev-unclassified,td.sev-listed-but-passed{background:#fff1c2}
td.sev-rounding-level{background:#f0f6e8} td.zero{color:#9aa3ab} td.nowrap{white-space:nowrap}
"""


def _inline_html(text: str) -> str:
  """Escaped text with Markdown's inline code and relative links (`x`, [text](path))."""
  text = re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))
  return re.sub(r"\[([^\]]+)\]\(([^)\s:]+)\)", r'<a href="\2">\1</a>', text)


def _summary_html(block: "Details") -> str:
  label = f"<strong>{_inline_html(block.label)}</strong> " if block.label else ""
  return label + _inline_html(block.summary)


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
    return (f'<div class="scroll"><table{css}><thead><tr>{head}</tr></thead><tbody>\n{body}\n'
            "</tbody></table></div>")
  if isinstance(block, Notes):
    items = "\n".join(f'<li id="{block.prefix}-{n}" value="{n}">{_inline_html(t)}</li>'
                      for n, t in block.items)
    return f'<ol class="notes">\n{items}\n</ol>'
  if isinstance(block, Code):
    return f"<pre><code>{html.escape(block.text)}</code></pre>"
  if isinstance(block, Image):
    title = html.escape(block.plot.title)
    return (f'<figure><a href="{image_path(block.plot)}"><img alt="{title}" '
            f'src="{image_path(block.plot)}" loading="lazy"></a>'
            f"<figcaption>{title}</figcaption></figure>")
  if isinstance(block, Details):
    inner = "\n".join(_html_block(b) for b in block.blocks)
    return f"<details><summary>{_summary_html(block)}</summary>\n{inner}\n</details>"
  if isinstance(block, Facts):
    items = "".join(f"<dt>{_inline_html(k)}</dt><dd>{_inline_html(v)}</dd>"
                    for k, v in block.items)
    return f'<dl class="facts">{items}</dl>'
  raise TypeError(f"block: unknown block type {type(block).__name__}")


def contents(doc: Document) -> list[tuple[Heading, list[Heading]]]:
  """The table of contents: each anchored level-2 heading with its anchored level-3 ones."""
  toc: list[tuple[Heading, list[Heading]]] = []
  for block in doc.blocks:
    if isinstance(block, Heading) and block.anchor and block.level == 2:
      toc.append((block, []))
    elif isinstance(block, Heading) and block.anchor and block.level == 3 and toc:
      toc[-1][1].append(block)
  return toc


def _html_toc(doc: Document) -> str:
  def link(h: Heading) -> str:
    return f'<a href="#{html.escape(h.anchor)}">{_inline_html(h.text)}</a>'

  items = []
  for top, subs in contents(doc):
    inner = ("<ul>" + "".join(f"<li>{link(h)}</li>" for h in subs) + "</ul>") if subs else ""
    items.append(f"<li>{link(top)}{inner}</li>")
  return "<ul>" + "".join(items) + "</ul>"


def to_html(doc: Document) -> str:
  nav = _html_toc(doc)
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
  if isinstance(block, Details):
    # GitHub renders Markdown inside <details> when blank lines separate it from the tags.
    inner = "\n\n".join(_md_block(b) for b in block.blocks)
    return f"<details><summary>{_summary_html(block)}</summary>\n\n{inner}\n\n</details>"
  raise TypeError(f"block: unknown block type {type(block).__name__}")


def _md_toc(doc: Document) -> str:
  lines = []
  for top, subs in contents(doc):
    lines.append(f"- [{top.text}](#{top.anchor})")
    lines += [f"  - [{h.text}](#{h.anchor})" for h in subs]
  return "\n".join(lines)


def to_markdown(doc: Document) -> str:
  toc = _md_toc(doc)
  parts = [f"# {doc.title}", *([f"**Contents**\n\n{toc}"] if toc else []),
           *(_md_block(b) for b in doc.blocks)]
  return "\n\n".join(parts) + "\n"


def _all_blocks(blocks: Sequence[Block]) -> list[Block]:
  out: list[Block] = []
  for block in blocks:
    out.append(block)
    if isinstance(block, Details):
      out += _all_blocks(block.blocks)
  return out


def plots_of(doc: Document) -> Sequence[Plot]:
  return [b.plot for b in _all_blocks(doc.blocks) if isinstance(b, Image)]
