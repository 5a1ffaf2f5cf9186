"""The interactive prompt shared by ``pocketllm chat`` and ``pocketllm connect``."""

from __future__ import annotations

import sys

EXIT_COMMANDS = ("/exit", "/quit")


def read_line(prompt: str = "> ") -> str | None:
    """One line typed at ``prompt``; None when the user leaves (end of input, Ctrl-C, /exit or /quit)."""
    try:
        line = input(prompt)
    except (EOFError, KeyboardInterrupt):
        print(file=sys.stderr)
        return None
    return None if line.strip() in EXIT_COMMANDS else line
