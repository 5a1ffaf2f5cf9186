"""The interactive prompt shared by ``pocketllm chat`` and ``pocketllm connect``."""

from __future__ import annotations

import sys

EXIT_COMMANDS = ("/exit", "/quit", "/bye")


def read_line(prompt: str = "> ") -> str | None:
    """One line typed at ``prompt``; None when the user leaves (end of input, /exit, /quit or /bye).

    Ctrl-C is not swallowed here: it leaves the command, with the exit status of an interrupt."""
    try:
        line = input(prompt)
    except EOFError:
        print(file=sys.stderr)   # end the prompt's line
        return None
    return None if line.strip() in EXIT_COMMANDS else line
