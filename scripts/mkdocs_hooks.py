"""mkdocs hook: the magics reference is generated from the magics' own argument parsers."""

from __future__ import annotations

MARKER = "<!-- nbddp: magics help -->"


def magics_help() -> str:
    from nbddp.notebook import magics

    parts = []
    for title, parser in magics.PARSERS.items():  # every magic with options
        text = parser.parser.format_help().replace("usage: ", "usage: %", 1)
        parts.append(f"### `{title}`\n\n```text\n{text.rstrip()}\n```\n")
    commands = ", ".join(f"`{c}`" for c in magics.SUBCOMMANDS)
    parts.append(
        f"`%ddp` commands: {commands} (`status`, `stacks`, `restart`, "
        "`stop` and `interrupt` take no options).\n"
    )
    return "\n".join(parts)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, magics_help())
    return markdown
