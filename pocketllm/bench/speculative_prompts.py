"""The prompt sets of ``pocketllm bench latency --speculative-config``: work whose answer copies from the prompt
(summarise, edit, continue code) and open chat, where prompt lookup finds little to propose."""

from __future__ import annotations

_STORY = ("Maria opened the bakery at six every morning. She baked bread, croissants and a lemon cake that the "
          "whole street loved. One winter the oven broke, and for a week the neighbours brought her their own "
          "loaves so that the shop would not stay empty. When the new oven arrived, Maria baked a lemon cake for "
          "every family that had helped her.")

_EMAIL = ("Hi team, the quarterly review moves from Tuesday to Thursday at 10am in room 4B. Please send your "
          "slides to Priya by Wednesday noon. The budget section is now owned by Tom, and the hiring update by "
          "Aisha. Lunch will be provided after the meeting. Thanks, Daniel")

_CODE = '''def parse_line(line: str) -> dict[str, str]:
    """Split a "key=value; key=value" line into a dictionary."""
    result: dict[str, str] = {}
    for part in line.split(";"):
        part = part.strip()
        if not part:
            continue
        key, _, value = part.partition("=")
        result[key.strip()] = value.strip()
    return result


def parse_file(path: str) -> list[dict[str, str]]:
    """Parse every non-empty line of a file."""
'''

# Each entry is one user message (the chat template is applied).
EDITING: tuple[str, ...] = (
    f"Fix the spelling mistakes in this text and return the corrected text only:\n\n"
    f"{_STORY.replace('bakery', 'bakrey').replace('neighbours', 'nieghbours').replace('arrived', 'arived')}",
    f"Rewrite this email replacing Thursday with Friday, and change nothing else:\n\n{_EMAIL}",
    f"Summarise this story in three sentences, reusing its wording:\n\n{_STORY}",
    f"Add type hints and keep everything else the same. Return the full code:\n\n"
    f"{_CODE.replace(': str) -> dict[str, str]', ')').replace(': dict[str, str]', '')}",
    f"Continue this Python module: write parse_file's body in the same style.\n\n{_CODE}",
    f"Repeat this email exactly, then list its action items:\n\n{_EMAIL}",
)

CHAT: tuple[str, ...] = (
    "Write a short poem about the autumn wind.",
    "What are three good habits for learning a new language?",
    "Explain in a paragraph why the sky is blue.",
    "Give me an idea for a weekend trip near the mountains.",
    "What is the difference between a list and a tuple in Python?",
    "Tell me a short story about a robot who learns to paint.",
)

PROMPT_SETS: dict[str, tuple[str, ...]] = {"editing": EDITING, "chat": CHAT}
