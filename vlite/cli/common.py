"""Options and helpers shared by the CLI commands."""

from __future__ import annotations

import functools
import inspect
import sys
import typing
from collections.abc import Callable

import typer
from rich.console import Console
from typer.core import TyperCommand

from vlite.engine import DEFAULT_MODEL, EngineArgs, EngineConfig


def make_console(stderr: bool = False) -> Console:
    """A Rich console; when the output is not a terminal (CI logs, pipes, ``make run > file``)
    tables are 160 columns wide instead of Rich's 80 and text lines are never folded: a verdict
    or trend line stays one line that grep and log readers can take whole."""
    stream = sys.stderr if stderr else sys.stdout
    tty = stream.isatty()
    return Console(stderr=stderr, width=None if tty else 160, soft_wrap=not tty)


err_console = make_console(stderr=True)

ModelOpt = typer.Option(DEFAULT_MODEL, "--model", "-m",
                        help="Local HF directory, .gguf file, or the default model's name.")


def engine_args_options(*, include_faults: bool = False, help_extra: dict[str, str] | None = None,
                        panel: str | None = None) -> Callable[[Callable], Callable]:
    """Give a Typer command every ``EngineArgs`` option (vLLM's flag names and defaults).

    The decorated command declares one parameter ``engine_args: EngineArgs``; in the
    signature Typer sees, that parameter is replaced by one option per ``EngineArgs`` field
    that has ``flags`` metadata (``--model``, ``--block-size``, ``-tp``, ...), and the command
    is called with an ``EngineArgs`` built from them. ``--inject-fault`` is added only with
    ``include_faults``. A field whose name the command declares itself (``generate``'s
    per-request ``--seed``, ``leak-check``'s workload-dependent ``--max-num-batched-tokens``)
    keeps the command's option, and the command sets that ``EngineArgs`` field itself.
    ``help_extra`` maps a field name to a sentence this command adds to the option's help (where
    the command changes what the option's default means). ``panel``: the help section of these
    options (Typer's ``rich_help_panel``; ``PanelledCommand`` shows it). Turn the result into a
    config with ``create_engine_config``.
    """

    def decorate(func: Callable) -> Callable:
        sig = inspect.signature(func)
        if "engine_args" not in sig.parameters:
            raise TypeError(f"{func.__name__} must declare an 'engine_args: EngineArgs' parameter")
        hints = typing.get_type_hints(func)
        own = set(sig.parameters) - {"engine_args"}
        engine_hints = typing.get_type_hints(EngineArgs)
        added: list[inspect.Parameter] = []
        for f in EngineArgs.cli_fields():
            if f.name in own or (f.name == "inject_faults" and not include_faults):
                continue
            annotation = engine_hints[f.name]
            default = f.default
            if f.name == "inject_faults":
                annotation, default = list[str], []
            option = typer.Option(default, *f.metadata["flags"], rich_help_panel=panel,
                                  help=" ".join(filter(None, (f.metadata["help"], (help_extra or {}).get(f.name)))))
            added.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                           annotation=annotation))
        names = [p.name for p in added]
        params: list[inspect.Parameter] = []
        for p in sig.parameters.values():
            if p.name == "engine_args":
                params += added
            else:
                params.append(p.replace(annotation=hints.get(p.name, p.annotation),
                                        kind=inspect.Parameter.KEYWORD_ONLY))

        @functools.wraps(func)
        def command(**kwargs):
            values = {n: kwargs.pop(n) for n in names}
            if "inject_faults" in values:
                values["inject_faults"] = tuple(values["inject_faults"] or ())
            return func(engine_args=EngineArgs(**values), **kwargs)

        del command.__wrapped__  # Typer must read the new signature, not the original one
        command.__signature__ = sig.replace(parameters=params)
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate


class PanelledCommand(TyperCommand):
    """A Typer command whose plain ``--help`` (main.py turns Rich help off: its boxes cut long
    option names at 80 columns) lists the options in sections, one per ``rich_help_panel``, in
    the order each panel first appears; options without a panel (``--help``) come last under
    "Options". ``panel_order`` (set by ``panelled``) puts the panels it names first, in its
    order. Use as ``app.command(name, cls=panelled(order))``."""

    panel_order: tuple[str, ...] = ()

    def format_options(self, ctx, formatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None and param.param_type_name == "option":
                sections.setdefault(getattr(param, "rich_help_panel", None) or "Options", []).append(record)
        order = {title: i for i, title in enumerate(self.panel_order)}
        for title, rows in sorted(sections.items(), key=lambda kv: (kv[0] == "Options", order.get(kv[0], len(order)))):
            with formatter.section(title):
                formatter.write_dl(rows)


def panelled(panel_order: tuple[str, ...]) -> type[PanelledCommand]:
    """A ``PanelledCommand`` class that lists the panels of ``panel_order`` first, in that order."""
    return type("PanelledCommand", (PanelledCommand,), {"panel_order": tuple(panel_order)})


def create_engine_config(engine_args: EngineArgs) -> EngineConfig:
    """``engine_args.create_engine_config()``, or exit 2 with its one-line message when invalid."""
    try:
        return engine_args.create_engine_config()
    except ValueError as exc:
        fail(flag_words(str(exc)))


def flag_words(message: str) -> str:
    """An engine-config message in the command line's words: ``block_size must be ...`` becomes
    ``--block-size must be ...`` (a field name with an underscore anywhere, any other at the start)."""
    import re

    for f in EngineArgs.cli_fields():
        flag = next((x for x in f.metadata["flags"] if x.startswith("--")), None)
        if flag is None:
            continue
        flag = flag.split("/")[0]
        if "_" in f.name:
            message = re.sub(rf"(?<![\w-]){f.name}\b", flag, message)
        elif message.startswith(f.name + " "):
            message = flag + message[len(f.name):]
    return message


def check_before_load(config: EngineConfig):
    """Every check that needs the model's config and tokenizer but not its weights (seconds, not
    the minute a load can take): device and dtype, tensor-parallel size, ``--max-model-len``
    against the model, and whether ``--num-blocks`` / ``--kv-cache-memory-bytes`` fit in memory.
    Exit 2 with one line when one fails; else return the checkpoint without weights (config and
    tokenizer) for prompt checks."""
    from vlite.engine import ModelNotFoundError, check_engine_config

    try:
        with err_console.status(f"Checking {config.model} ..."):
            return check_engine_config(config)
    except (ModelNotFoundError, ValueError) as exc:
        fail(str(exc))


def load_engine(config: EngineConfig, *, checked: bool = False):
    """Start an LLMEngine, turning load errors into a clear message and exit code 2. Runs
    ``check_before_load`` first unless the caller did (``checked``)."""
    from vlite.engine import LLMEngine, ModelNotFoundError

    if not checked:
        check_before_load(config)
    try:
        with err_console.status(f"Loading {config.model} ..."):
            return LLMEngine(config)
    except (ModelNotFoundError, ValueError) as exc:
        fail(str(exc))


def plural(count: int, noun: str, plural_form: str | None = None) -> str:
    """``count`` and ``noun``, pluralised: "1 request", "2 requests", "0 requests"."""
    return f"{count} {noun if count == 1 else plural_form or noun + 's'}"


def seconds(value: float | None) -> str:
    """A duration for the terminal: "12.3 s", or "n/a" where it was not measured."""
    return "n/a" if value is None else f"{value:.1f} s"


def warn(message: str) -> None:
    """One "warning:" line on stderr (never folded); the command carries on."""
    from rich.markup import escape

    err_console.print(f"[bold yellow]warning:[/] {escape(message)}", highlight=False, soft_wrap=True)


def fail(message: str, code: int = 2) -> None:
    from rich.markup import escape

    # escaped: a message quoting JSON ([1, 2]) or a range ([0, 100]) is printed as it is
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)  # one line
    sys.exit(code)
