"""The shell commands that README.md and docs/**/*.md show, read out of their fenced code blocks.

A command is one logical line of a ``bash``/``sh``/``shell``/``console`` block: backslash
continuations and quotes that span lines are joined, a ``$ `` prompt is dropped, and a trailing
``# comment`` is kept apart. The comment states what the command should give: a verdict word
(``CLEAN``, ``LEAK``, ...) and/or ``exit N``. With neither, the command should exit 0.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

RUN_LANGS = {"bash", "sh", "shell", "console"}
VERDICTS = ("HOST-LEAK", "EMPTY-OUTPUT", "OUTPUT-DRIFT", "ENGINE-ERROR", "INCONCLUSIVE", "INTERRUPTED",
            "ZOMBIE", "WEDGED", "CLEAN", "LEAK")
_FENCE = re.compile(r"^\s*```\s*([\w+-]*)")
_EXIT = re.compile(r"\bexit (\d+)\b")


@dataclass(frozen=True)
class DocCommand:
    """One documented command.

    Attributes:
        path: the doc file, relative to the repository root.
        line: the 1-based line where the command starts.
        block: the index of its code block within the file (commands of one block share servers).
        text: the command, without its trailing comment (continuation lines joined with spaces).
        comment: the trailing comment's text ("" if none).
    """

    path: str
    line: int
    block: int
    text: str
    comment: str

    @property
    def background(self) -> bool:
        """The command ends in ``&``: it starts a process that the block's later commands use."""
        return self.text.rstrip().endswith("&") and not self.text.rstrip().endswith("&&")

    @property
    def verdict(self) -> str | None:
        """The verdict the comment claims: the first verdict word it starts with, else None."""
        head = self.comment.strip().strip('"').lstrip("(")
        for word in VERDICTS:
            if head.startswith(word) and not head[len(word):len(word) + 1].isalnum():
                return word
        return None

    @property
    def exit_code(self) -> int:
        """The exit code the comment claims (``exit N``), else the verdict's, else 0."""
        m = _EXIT.search(self.comment)
        if m:
            return int(m.group(1))
        return {None: 0, "CLEAN": 0, "INCONCLUSIVE": 3, "INTERRUPTED": 130}.get(self.verdict, 1)

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def split_comment(line: str) -> tuple[str, str]:
    """``line`` split at its first ``#`` that stands outside quotes after a blank (shell's rule)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
            elif ch == "\\" and quote == '"':
                continue
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


def _complete(text: str) -> bool:
    try:
        shlex.split(text, comments=False)
    except ValueError:  # a quote still open: the command goes on on the next line
        return False
    return True


def commands_in(path: Path, root: Path) -> list[DocCommand]:
    """Every command in ``path``'s runnable code blocks, in order."""
    out: list[DocCommand] = []
    lines = path.read_text().splitlines()
    in_block, lang, block = False, "", -1
    pending: list[str] = []
    start = 0
    for no, raw in enumerate(lines, 1):
        fence = _FENCE.match(raw)
        if fence:
            in_block = not in_block
            lang = fence.group(1).lower() if in_block else ""
            block += in_block
            pending = []
            continue
        if not in_block or lang not in RUN_LANGS:
            continue
        line = raw.strip()
        if not pending:
            if lang == "console":
                if not line.startswith("$ "):
                    continue  # output shown in the block
                line = line[2:]
            if not line or line.startswith("#"):
                continue
            start = no
        body, comment = split_comment(line)
        if body.endswith("\\"):
            pending.append(body[:-1].rstrip())
            continue
        pending.append(body)
        text = " ".join(p for p in pending if p)
        if not _complete(text):
            pending[-1] = line  # the '#' sat inside an open quote: keep the line whole
            continue
        out.append(DocCommand(str(path.relative_to(root)), start, block, text, comment))
        pending = []
    return out


def documented_commands(root: Path) -> list[DocCommand]:
    """The commands of README.md and docs/**/*.md under ``root``, file by file."""
    files = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    return [c for f in files if f.is_file() for c in commands_in(f, root)]
