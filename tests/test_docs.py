"""The commands the README and docs/ show are ones the command line takes: each names a
command that exists, and only options that command has (a renamed or missing option
otherwise lingers in the documentation)."""

import argparse
import re
import shlex
from pathlib import Path

from transduce.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def shown_commands(text: str) -> list[str]:
    """What follows `transduce` in the code blocks' command lines (continued lines
    joined, comments and pipes cut) and in inline code."""
    found = []
    for block in re.findall(r"```(?:sh|bash|console|shell)?\n(.*?)```", text, re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            for part in re.split(r"&&|\||;|\$\(", line):
                match = re.search(r"(?:^|\s)transduce\s+(.*)", part.split(" #")[0])
                if match:
                    found.append(match.group(1))
    found += re.findall(r"`transduce ([^`]+)`", text.replace("\n", " "))
    return found


def _subcommands(parser: argparse.ArgumentParser) -> dict:
    return next((action.choices for action in parser._actions
                 if isinstance(action, argparse._SubParsersAction)), {})


def unknown_options(words: list[str]) -> tuple[list[str], list[str]]:
    """(the command's names, the options given that it does not take)."""
    parser, names = build_parser(), []
    while words and words[0] in _subcommands(parser):
        parser = _subcommands(parser)[words[0]]
        names.append(words.pop(0))
    if _subcommands(parser):                  # a group named without its command
        return names, []
    known = {option for action in parser._actions for option in action.option_strings}
    return names, [word.split("=")[0] for word in words
                   if word.startswith("--") and word.split("=")[0] not in known]


def test_every_command_the_documentation_shows_takes_the_options_it_is_shown_with():
    checked, wrong = 0, []
    for document in DOCUMENTS:
        for command in shown_commands(document.read_text()):
            try:
                words = shlex.split(command.replace("&", " "))
            except ValueError:                # an unbalanced quote in prose
                continue
            names, unknown = unknown_options(words)
            checked += bool(names)
            if unknown:
                wrong.append(f"{document.name}: transduce {' '.join(names)} {unknown}")
    assert not wrong
    assert checked > 100


def test_an_option_a_command_lacks_is_found():
    assert unknown_options(shlex.split("serve --model m --kv-dtype int8 --beam 4")) == \
        (["serve"], ["--beam"])
    assert unknown_options(["export", "onnx", "--no-such"]) == (["export", "onnx"], ["--no-such"])
