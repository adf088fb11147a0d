"""The subcommands' help: ``--help`` one line per option (their help cut to the line, the engine
options as a list of flags) so that it fits a screen; ``--help-all`` every option's whole help."""

from __future__ import annotations

import re

from vlite.cli import common
from vlite.cli.leak_check import options as o
from vlite.cli.leak_check.group import OneLineErrors
from vlite.cli.leak_check.options import PANEL_ENGINE

PANEL_ORDER = (o.PANEL_WORKLOAD, o.PANEL_INPROC, o.PANEL_SERVER, o.PANEL_MODE, o.PANEL_ENGINE, "Options")


class LeakCheckCommand(OneLineErrors, common.PanelledCommand):
    """A ``leak-check`` subcommand: compact ``--help``, whole ``--help-all``, one-line usage errors."""

    def format_options(self, ctx, formatter) -> None:
        args = [p.get_help_record(ctx) for p in self.get_params(ctx) if p.param_type_name == "argument"]
        if args:
            with formatter.section("Arguments"):
                formatter.write_dl([(name.split(" <")[0], text.replace("  [required]", "")) for name, text in args])
        if ctx.meta.get("help_all"):
            return super().format_options(ctx, formatter)
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None and param.param_type_name == "option":
                name = record[0].split(" <")[0]  # the flags without their metavar
                sections.setdefault(getattr(param, "rich_help_panel", None) or "Options", []).append((name, record[1]))
        rank = {title: i for i, title in enumerate(PANEL_ORDER)}
        for title, rows in sorted(sections.items(), key=lambda kv: rank.get(kv[0], len(rank))):
            with formatter.section(title):
                if title == PANEL_ENGINE:  # vLLM's engine flags: their names say what they are
                    for line in _flag_lines([name for name, _ in rows], formatter.width - formatter.current_indent):
                        formatter.write(f"{'':>{formatter.current_indent}}{line}\n")
                    continue
                first = max(len(name) for name, _ in rows)
                room = formatter.width - formatter.current_indent - first - 2
                formatter.write_dl([(name, _cut(text, room)) for name, text in rows], col_max=first + 2)


def _flag_lines(flags: list[str], width: int) -> list[str]:
    """``flags`` joined by commas into lines of at most ``width`` characters, never split inside a flag."""
    lines = [""]
    for flag in flags:
        piece = f"{flag}, " if flag != flags[-1] else flag
        if lines[-1] and len(lines[-1]) + len(piece.rstrip()) > width:
            lines.append("")
        lines[-1] += piece
    return [line.rstrip() for line in lines]


def _cut(text: str, room: int) -> str:
    """``text`` up to its first sentence's end, cut to ``room`` characters."""
    text = text.split(" [default")[0].split(" [x")[0]
    text = re.split(r"(?<!\be\.g)(?<!\bi\.e)\. ", text)[0].rstrip(".")
    return text if len(text) <= room else text[:room - 3].rstrip() + "..."
