"""``pocketllm run`` (one prompt) and ``pocketllm chat`` (a conversation in the terminal)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pocketllm.cli.engine_flags import (
    SAMPLING_FLAGS,
    add_engine_flags,
    add_sampling_flags,
    engine_args_from,
    sampling_params_from,
)
from pocketllm.cli.exits import usage_error
from pocketllm.cli.launched_ranks import launched_rank
from pocketllm.harness.lifecycle import display_name, say
from pocketllm.harness.line_input import read_line
from pocketllm.sampling_params import SamplingParams

CLEAR_COMMAND = "/clear"   # chat: forget the conversation so far (the system message stays)
HELP_COMMANDS = ("/help", "/?")
CHAT_COMMANDS = "/clear forgets the conversation, /exit (or /bye) leaves, /help lists these, Ctrl-C stops an answer"

if TYPE_CHECKING:   # (imported when a command runs: they import torch)
    from pocketllm.api import LLM
    from pocketllm.outputs import TokenEvent, Usage

# Sampling flags not given take the checkpoint's defaults (generation_config, else temperature 0.7 and top_p 0.9:
# pocketllm/loaders/generation_defaults.py); --temperature 0 is plain greedy.
CLI_SAMPLING_DEFAULTS = {"max_tokens": 512}


def add_run_parser(subparsers) -> None:
    parser = subparsers.add_parser("run", usage="%(prog)s [options] [PROMPT]",
                                   help="Generate an answer to one prompt, streamed to stdout.")
    parser.add_argument("prompt", nargs="?", default=None, metavar="PROMPT",
                        help="The user message (or the raw prompt with --raw); read from stdin when not given "
                             "and stdin is not a terminal.")
    parser.add_argument("--prompt", dest="prompt_option", default=None, metavar="PROMPT",
                        help="The same as PROMPT.")
    parser.add_argument("--system", default=None, help="A system message to put first.")
    parser.add_argument("--raw", action="store_true", help="Send the prompt as is, without the chat template.")
    parser.add_argument("--verbose", action="store_true", help="Log scheduling decisions at DEBUG.")
    add_sampling_flags(parser, CLI_SAMPLING_DEFAULTS)
    add_engine_flags(parser)
    parser.set_defaults(handler=run_command)


def add_chat_parser(subparsers) -> None:
    parser = subparsers.add_parser("chat", usage="%(prog)s [options]",
                                   help="Hold a conversation in the terminal (/clear to start over, /exit to leave).")
    parser.add_argument("--system", default=None, help="A system message to put first.")
    parser.add_argument("--verbose", action="store_true", help="Log scheduling decisions at DEBUG.")
    add_sampling_flags(parser, CLI_SAMPLING_DEFAULTS)
    add_engine_flags(parser)
    parser.set_defaults(handler=chat_command)


def _stream_to_stdout(events: Iterable[TokenEvent]) -> tuple[str, Usage | None, str | None]:
    """The answer to stdout as it streams (reasoning, when the model writes one, to stderr; parsed tool calls
    as one JSON object a line)."""
    text, usage, reason = [], None, None
    reasoning_open = False
    for event in events:
        if event.reasoning_content:
            sys.stderr.write(event.reasoning_content)
            sys.stderr.flush()
            reasoning_open = True
        if event.text:
            if reasoning_open:
                sys.stderr.write("\n")
                reasoning_open = False
            sys.stdout.write(event.text)
            sys.stdout.flush()
            text.append(event.text)
        for index, call in enumerate(event.tool_calls or ()):
            if reasoning_open:
                sys.stderr.write("\n")
                reasoning_open = False
            sys.stdout.write(("\n" if text or index else "") + json.dumps(call.to_openai(), ensure_ascii=False))
        if event.finished:
            usage, reason = event.usage, event.finish_reason
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(text), usage, reason


def _report(usage: Usage | None, reason: str | None) -> None:
    if usage is None:
        return
    decode_rate = (usage.completion_tokens - 1) / usage.decode_time_s if usage.decode_time_s > 0 else 0.0
    print(f"[{usage.completion_tokens} tokens, finish {reason}; prompt {usage.prompt_tokens} tokens, "
          f"prefill {usage.prefill_time_s * 1000:.1f} ms, decode {usage.decode_time_s * 1000:.1f} ms "
          f"({decode_rate:.1f} tok/s)]", file=sys.stderr)


def _messages(system: str | None, turns: list[dict[str, str]]) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + turns


def _prompt(args: argparse.Namespace) -> str:
    """PROMPT, --prompt, or else stdin when it is not a terminal (its final newline dropped)."""
    if args.prompt is not None and args.prompt_option is not None:
        usage_error("run", "give the prompt once: as PROMPT or as --prompt")
    prompt = args.prompt if args.prompt is not None else args.prompt_option
    if prompt is None:
        if sys.stdin is None or sys.stdin.isatty():
            usage_error("run", 'no prompt: pocketllm run "PROMPT" (or pipe it on stdin)')
        prompt = sys.stdin.read().removesuffix("\n")
    if not prompt.strip():
        usage_error("run", "the prompt is empty")
    return prompt


def _sampling(args: argparse.Namespace, llm: LLM) -> SamplingParams:
    """The sampling flags given, over the checkpoint's default sampling."""
    from pocketllm.loaders.generation_defaults import default_sampling_params

    flags = sampling_params_from(args)
    given = {name: getattr(flags, name) for name in SAMPLING_FLAGS if getattr(args, name, None) is not None}
    chosen = default_sampling_params(llm.generation_config, **given)
    return dataclasses.replace(flags, **{name: getattr(chosen, name) for name in SAMPLING_FLAGS})


def run_command(args: argparse.Namespace) -> int:
    sampling_params_from(args)   # a bad flag fails before the model loads
    engine_args = engine_args_from(args)
    if (status := launched_rank(engine_args)) is not None:   # a worker rank: no prompt of its own
        return status
    prompt = _prompt(args)
    say(f"loading {display_name(engine_args.model)}")
    from pocketllm.api import LLM

    with LLM(engine_args) as llm:
        params = _sampling(args, llm)
        if args.raw:
            events = llm.generate_stream(prompt, params)
        else:
            events = llm.chat_stream(_messages(args.system, [{"role": "user", "content": prompt}]), params)
        _, usage, reason = _stream_to_stdout(events)
        _report(usage, reason)
    return 0


def _chat_turn(llm: LLM, messages: list[dict[str, str]], params: SamplingParams) -> str:
    text, usage, reason = _stream_to_stdout(llm.chat_stream(messages, params))
    _report(usage, reason)
    return text


def chat_command(args: argparse.Namespace) -> int:
    sampling_params_from(args)   # a bad flag fails before the model loads
    engine_args = engine_args_from(args)
    if (status := launched_rank(engine_args)) is not None:
        return status
    say(f"loading {display_name(engine_args.model)}")
    from pocketllm.api import LLM

    with LLM(engine_args) as llm:
        params = _sampling(args, llm)
        llm.render_chat(_messages(args.system, [{"role": "user", "content": "hi"}]))  # fail early without template
        turns: list[dict[str, str]] = []
        print(f"Type a message; {CHAT_COMMANDS}.", file=sys.stderr)
        while True:
            line = read_line()
            if line is None:
                return 0
            command = line.strip()
            if not command:
                continue
            if command == CLEAR_COMMAND:
                turns.clear()
                print("[conversation cleared]", file=sys.stderr)
                continue
            if command in HELP_COMMANDS:
                print(f"[{CHAT_COMMANDS}]", file=sys.stderr)
                continue
            if command.startswith("/") and len(command.split()) == 1:   # a mistyped command is not a message
                print(f"[unknown command {command}: {CHAT_COMMANDS}]", file=sys.stderr)
                continue
            turns.append({"role": "user", "content": line})
            try:
                answer = _chat_turn(llm, _messages(args.system, turns), params)
            except KeyboardInterrupt:
                print("\n[interrupted]", file=sys.stderr)
                turns.pop()
                continue
            turns.append({"role": "assistant", "content": answer})
