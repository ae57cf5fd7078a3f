"""A griffe extension for the API reference: Hugging Face docstring syntax, rendered by mkdocstrings.

The docstrings follow transformers' and TRL's conventions, which their own doc-builder renders and mkdocstrings does
not. Before mkdocstrings parses a docstring, this extension rewrites:

- `` [`~transformers.PreTrainedModel`] `` and `` [`RLLossGRPOConfig`] `` (HF cross-references): a link to the entry
  when it is hf_rlloss's (`` [`RLLossGRPOConfig`][hf_rlloss.RLLossGRPOConfig] ``), the name in code otherwise (the
  build is offline: no inventory of other projects' sites);
- argument types `` (`str`, *optional*, defaults to `"x"`) ``: the type alone (`str`); mkdocstrings shows the
  default from the code, and a default the code does not state ("defaults to the name of `output_dir`") moves to the
  end of the description;
- `docs/<page>.md` (a page of this site named in a docstring): a link to that page.

Registered in mkdocs.yml (`extensions:` of the Python handler). Kept out of the site by `exclude_docs`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import griffe

_PACKAGE_INIT = Path(__file__).resolve().parents[2] / "hf_rlloss" / "__init__.py"
# `[`~a.b.C`]` or `[`C`]`, not already a Markdown link `[...](...)` or reference `[...][...]`
_HF_REF = re.compile(r"\[`(~?)([A-Za-z_][\w.]*)`\](?![\[(])")
# an argument line of an Args/Attributes section: `    name (type): description`
_ARG = re.compile(r"^(?P<indent>\s+)(?P<name>\*{0,2}\w+(?:, \w+)*) \((?P<type>.+?)\):(?P<desc>.*)$")
_DEFAULTS = re.compile(r",?\s*defaults to (?P<value>.+)$")
_PAGE = re.compile(r"(?<![\w/.\[])`?docs/(?P<page>[\w/]+)\.md(?P<anchor>#[\w-]+)?`?")


def _public_names() -> set[str]:
    tree = ast.parse(_PACKAGE_INIT.read_text(encoding="utf8"))
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "__all__")
    return {element.value for element in node.value.elts}


PUBLIC = _public_names()


def _reference(match: re.Match, link: bool) -> str:
    tilde, target = match.group(1), match.group(2)
    shown = target.rsplit(".", 1)[-1] if tilde else target
    if not link:
        return shown
    if target.startswith("hf_rlloss."):
        return f"[`{shown}`][{target}]"
    if target in PUBLIC:
        return f"[`{shown}`][hf_rlloss.{target}]"
    return f"`{shown}`"


def _argument_type(text: str) -> tuple[str, str | None]:
    """An HF argument type without its markup, and the default it names when the code cannot show it."""
    default = None
    found = _DEFAULTS.search(text)
    if found:
        value = found.group("value").strip()
        text = text[: found.start()]
        if not re.fullmatch(r"`[^`]*`", value):  # a literal is shown from the code; a phrase is kept
            default = value
    text = _HF_REF.sub(lambda m: _reference(m, link=False), text)
    text = re.sub(r",?\s*\*optional\*", "", text).replace("`", "").strip(" ,")
    return text or "Any", default  # griffe warns about an argument without a type


def rewrite(docstring: str) -> str:
    """The docstring with HF syntax turned into what mkdocstrings renders (see the module docstring)."""
    lines = docstring.splitlines()
    out, pending_default = [], None
    for i, line in enumerate(lines):
        arg = _ARG.match(line)
        if arg:
            kind, default = _argument_type(arg.group("type"))
            line = f"{arg.group('indent')}{arg.group('name')} ({kind}):{arg.group('desc')}"
            pending_default = (len(arg.group("indent")), default) if default else None
        out.append(line)
        if pending_default:  # the description ends at the next line indented no deeper than the argument
            following = lines[i + 1] if i + 1 < len(lines) else ""
            depth = len(following) - len(following.lstrip())
            if not following.strip() or depth <= pending_default[0]:
                out[-1] = f"{out[-1].rstrip()} Defaults to {pending_default[1]}."
                pending_default = None
    text = "\n".join(out)
    text = _HF_REF.sub(lambda m: _reference(m, link=True), text)
    return _PAGE.sub(_page_link, text)


def _page_link(match: re.Match) -> str:
    page, anchor = match.group("page"), match.group("anchor") or ""
    return f"[`docs/{page}.md`](../{page}.md{anchor})"  # relative to docs/api/, where the reference pages are


class HFDocstrings(griffe.Extension):
    """Rewrites each object's docstring (see the module docstring) before mkdocstrings parses it."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)
