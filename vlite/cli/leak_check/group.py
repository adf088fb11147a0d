"""``vlite leak-check`` as a click group: one subcommand per mode, and the older spelling (mode
flags on one command: ``--url U --blackbox``, ``--from-log F``, ``--scenario all``) routed to the
subcommand it names. A flag of another mode is one line naming the subcommand it belongs to, and a
bad value (out of range, not a number, a missing option) is one line instead of click's usage block.
"""

from __future__ import annotations

import difflib

from typer._click import exceptions as click_exc
from typer.core import TyperGroup

from vlite.cli import common

# Older spelling: the flag that picked a mode, the subcommand it picks now, and whether the flag
# takes a value (a positional of the subcommand where ``positional``).
MODE_FLAGS = {"--blackbox": ("blackbox", False), "--watch": ("watch", False), "--prometheus": ("prometheus", True),
              "--from-log": ("log", True), "--scenario": ("scenario", True), "--replica": ("fleet", True)}
POSITIONAL = {"--from-log", "--scenario"}  # their value is the subcommand's argument now
# Why a flag does not apply, for the flags users most often carry over from another mode.
REASONS = {
    "--storm-requests": "--storm-requests and --wedge-timeout-s apply to a server's replay (add --url)",
    "--wedge-timeout-s": "--storm-requests and --wedge-timeout-s apply to a server's replay (add --url)",
    "--trace-allocations": "--trace-allocations traces this process's allocations: it applies to the in-process "
                           "replay only",
    "--cache-probe-requests": "--cache-probe-requests applies to the in-process replay only",
    "--trace-gpu-allocations": "--trace-gpu-allocations reads the CUDA allocator of this process or of a vlite "
                               "serve's engine (--url to it, with --enable-debug-endpoints)",
    "--server-log": "--server-log follows a live server's log during --watch (read a log after the fact with "
                    "`vlite leak-check log FILE`)",
    "--router-metrics": "--router-metrics applies to a fleet: add --replica URL (one per replica)",
    "--inject-fault": "--inject-fault plants a fault in this process's engine; pass it to `vlite serve` instead",
    "--url": "--url names a live server",
}
for _flag in ("--duration", "--interval", "--stuck-after", "--job", "--since", "--instance", "--instance-label"):
    REASONS[_flag] = f"{_flag} applies to --watch or --prometheus"


def _name(token: str) -> str:
    return token.split("=", 1)[0]


def route(args: list[str]) -> list[str]:
    """The older one-command spelling as ``[subcommand, *args]``: the mode flag picks the
    subcommand (none: ``replay``; two: one line, exit 2)."""
    modes = {}
    for token in args:
        if token == "--":
            break
        if _name(token) in MODE_FLAGS:
            modes.setdefault(MODE_FLAGS[_name(token)][0], _name(token))
    if len(modes) > 1:
        flags = list(modes.values())
        common.fail(f"{' and '.join(flags)} cannot be combined: "
                    + ", ".join(f"{f} runs `vlite leak-check {m}`" for m, f in modes.items()) + "; pick one")
    if not modes:
        return ["url" if any(_name(t) == "--url" for t in args) else "replay", *args]
    (mode, flag), = modes.items()
    out, positional, i = [], [], 0
    while i < len(args):
        token = args[i]
        if _name(token) != flag:
            out.append(token)
        elif flag in POSITIONAL:
            if "=" in token:
                positional.append(token.split("=", 1)[1])
            elif i + 1 < len(args):
                positional.append(args[i + 1])
                i += 1
        elif not MODE_FLAGS[flag][1]:
            pass  # a switch: the subcommand is the mode
        else:
            out.append(token)
        i += 1
    return [mode, *positional, *out]


def owners(group, flag: str) -> list[str]:
    """The subcommands of ``group`` that take ``flag``."""
    return [name for name, cmd in group.commands.items()
            if any(flag in p.opts or flag in p.secondary_opts for p in cmd.params)]


def check_flags(group, name: str, args: list[str]) -> None:
    """One line (exit 2) for the first flag in ``args`` that subcommand ``name`` does not take but
    another subcommand does (unknown flags are left to click)."""
    cmd = group.commands[name]
    known = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
    for token in args:
        if token == "--":
            return
        flag = _name(token)
        if not flag.startswith("-") or flag in known or len(flag) < 2 or flag[1].isdigit():
            continue
        where = owners(group, flag)
        if where:
            names = [f"`vlite leak-check {where[0]}`", *(f"`{w}`" for w in where[1:])]
            subs = ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]
            why = REASONS.get(flag, f"{flag} belongs to another mode")
            common.fail(f"{why}: it is an option of {subs}, not of `{name}`")


def _given(args: list[str], opts: list[str]) -> str | None:
    """The value given on the command line to the option named ``opts`` (the last one), if any."""
    value = None
    for k, token in enumerate(args):
        if token in opts and k + 1 < len(args):
            value = args[k + 1]
        elif token.split("=", 1)[0] in opts and "=" in token:
            value = token.split("=", 1)[1]
    return value


def one_line(cmd_path: str, exc: click_exc.UsageError, args: list[str]) -> None:
    """A click usage error as one line on stderr, exit 2: the option, what was wrong, what is allowed."""
    param = getattr(exc, "param", None)
    if isinstance(exc, click_exc.MissingParameter) and param is not None:
        name = (param.metavar or param.name.upper()) if param.param_type_name == "argument" else param.opts[0]
        words = (getattr(param, "help", None) or "").rstrip(".")
        what = f": {words[:1].lower()}{words[1:]}" if words else ""
        common.fail(f"missing {name}{what} (usage: `{cmd_path} {name}`, or `{cmd_path} --help`)")
    if isinstance(exc, click_exc.BadParameter) and param is not None and getattr(param, "opts", None):
        lo, hi = getattr(param, "min", None), getattr(param, "max", None)
        allowed = (f"between {lo} and {hi}" if lo is not None and hi is not None
                   else f">= {lo}" if lo is not None else f"<= {hi}" if hi is not None else None)
        given = _given(args, param.opts)
        if allowed is None or "valid" in exc.message:
            common.fail(f"{param.opts[0]} {given!r}: {exc.message.rstrip('.')}" if given is not None
                        else f"{param.opts[0]}: {exc.message}")
        common.fail(f"{param.opts[0]} {given} is out of range: it must be {allowed}")
    common.fail(f"{exc.format_message()} (see `{cmd_path} --help`)")


class LeakCheckGroup(TyperGroup):
    """The ``leak-check`` group: routes the older spelling, refuses another mode's flags in one
    line, and runs ``replay`` when no subcommand is named."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        args = list(args)
        if args and not args[0].startswith("-") and args[0] not in self.commands:
            near = difflib.get_close_matches(args[0], list(self.commands), n=1)
            common.fail(f"no subcommand {args[0]!r}{f'; did you mean {near[0]}?' if near else ''} "
                        f"(subcommands: {', '.join(self.commands)})")
        if not args or (args[0] not in self.commands and args[0] not in ("--help", "-h")):
            args = route(args)
        if args[0] in self.commands:
            check_flags(self, args[0], args[1:])
        return super().parse_args(ctx, args)

    def list_commands(self, ctx) -> list[str]:
        return list(self.commands)  # in the order registered, not sorted


class OneLineErrors:
    """Mixin for a subcommand: a usage error (a value out of range, a missing option) is one line."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        given = list(args)  # click's parser consumes the list
        try:
            return super().parse_args(ctx, args)
        except click_exc.UsageError as exc:
            one_line(ctx.command_path, exc, given)
