"""The libraries speak in their own words: models/, samplers/, rewards/ and the method package (train/algorithm/)
describe their arguments, not the trainer's config keys (``model.compile``, ``update.*``) or their callers
(train/loop/step.py, "the trainer"), in their docstrings and comments. The keys belong in the config classes,
which ALLOWED names, and in docs/ (CONTRIBUTING.md, Layout)."""

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

from train.cli.help_text import field_docs

ROOT = Path(__file__).resolve().parents[2]
LIBRARIES = ("models", "samplers", "rewards", "train/algorithm")
# the config classes: each names its own keys (and the keys of the groups its rules read)
ALLOWED = {
    "models/model_config.py",
    "samplers/sampler_config.py",
    "rewards/reward_config.py",
    "train/algorithm/grpo_config.py",
    "train/algorithm/update_config.py",
}


# every dotted key below the groups, and each group inside a group: model.compile, model.lora, model.lora.rank, ...
KEYS = {".".join(key.split(".")[:n]) for key in field_docs() for n in range(2, key.count(".") + 2)}
GROUPS = sorted({key.split(".")[0] for key in KEYS})
# a group's name, not an attribute of something else (``self.model.dtype``), then a field or ``*``
KEY = re.compile(rf"(?<![\w.])(?:{'|'.join(GROUPS)})\.(?:\*|\w+)")
# a module of the trainer outside ``own`` (a path or a dotted name), or the trainer itself (Trainer, trainer's)
CALLER = r"(?<![\w.])train[/.](?!{own}\b)[a-z_]\w*|\bstep\.py\b|\btrainer\b"


def prose(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of each comment and each bare string (docstrings, attribute docstrings) of ``source``."""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            yield node.lineno, node.value.value


def trainer_words(source: str, package: str) -> list[str]:
    """The config keys and the callers that ``source``, a module of ``package``, names in its prose."""
    own = package.split("/")[1] if package.startswith("train/") else "(?!)"
    caller = re.compile(CALLER.format(own=own), re.IGNORECASE)
    found = []
    for line, text in prose(source):
        keys = [m for m in KEY.findall(text) if m.endswith(".*") or m in KEYS]
        found += [f"{line}: {word}" for word in keys + caller.findall(text)]
    return found


def test_libraries_name_no_trainer_key_or_caller():
    assert all((ROOT / path).is_file() for path in ALLOWED), "a config module was renamed: update ALLOWED"
    named = []
    for package in LIBRARIES:
        paths = sorted((ROOT / package).rglob("*.py"))
        assert paths, f"{package}/ has no modules"
        for path in paths:
            name = path.relative_to(ROOT).as_posix()
            if name not in ALLOWED:
                named += [f"{name}:{word}" for word in trainer_words(path.read_text(), package)]
    assert named == []


def test_the_check_reads_prose_not_code():
    assert {"model.compile", "update.mode", "reward.components", "model.lora.rank"} <= KEYS
    source = '''"""Compiled when ``model.compile`` is set, by train/loop/step.py."""
x = 1  # self.model.dtype is the trainer's dtype; update.* keys, batch.traj
def f(update):
    """Reads the ``routing`` of ``update``; logs train/<metric> (train.algorithm.jagg)."""
    return update.routing
'''
    assert trainer_words(source, "models") == [
        "2: update.*",
        "2: trainer",
        "1: model.compile",
        "1: train/loop",
        "1: step.py",
        "4: train.algorithm",
    ]
    # the method package may name its own modules, not the trainer's
    assert trainer_words(source, "train/algorithm") == [
        "2: update.*",
        "2: trainer",
        "1: model.compile",
        "1: train/loop",
        "1: step.py",
    ]
