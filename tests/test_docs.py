"""The README and docs/ as a reader meets them: every relative link and anchor resolves, every file
path named exists, every metric the code logs is documented, and every ``rlhf-lightning fit`` command
shown in a code block parses (``--print_config``, its plugin names resolving), so a page cannot
quietly go stale when code or configs move."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

RUN_COMMAND = "bash tools/setup.sh && .venv/bin/rlhf-lightning fit --config configs/quickstart.yaml"
TEST_COMMAND = (
    "bash tools/setup.sh && .venv/bin/ruff check . && .venv/bin/ruff format --check . && "
    '.venv/bin/python -m pytest -n 2 -m "not slow and not convergence" -q'
)


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def fenced_blocks(text: str) -> list[str]:
    """The contents of the fenced code blocks and of the indented (4-space) code blocks."""
    blocks, fence, buf, indented, previous_blank = [], None, [], [], True
    for line in text.split("\n"):
        if fence is None:
            opening = re.match(r"^\s*(```|~~~)", line)
            if opening:
                fence, buf = opening.group(1), []
                continue
            if line.startswith("    ") and (indented or previous_blank):
                indented.append(line[4:])
            elif indented and line.strip():
                blocks.append("\n".join(indented))
                indented = []
            previous_blank = not line.strip()
        elif line.strip().startswith(fence):
            blocks.append("\n".join(buf))
            fence = None
        else:
            buf.append(line)
    if indented:
        blocks.append("\n".join(indented))
    return blocks


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans (links there are not links)."""
    text = re.sub(r"^\s*(```|~~~).*?^\s*\1", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup and punctuation dropped, lower case, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays
    text = text.strip().lower()
    kept = "".join(ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    in_fence = None
    for line in path.read_text().split("\n"):
        fence = re.match(r"^\s*(```|~~~)", line)
        if fence:
            in_fence = None if in_fence == fence.group(1) else in_fence or fence.group(1)
            continue
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if in_fence is None and heading:
            slug = github_slug(heading.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            result.add(slug if n == 0 else f"{slug}-{n}")
    return result


def links(path: Path) -> list[str]:
    return re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose(path.read_text()))


def test_the_pages_exist_and_the_readme_is_short():
    assert (ROOT / "docs" / "metrics.md").is_file() and (ROOT / "docs" / "results.md").is_file()
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 300, f"README.md has {lines} lines; move detail into docs/"


def test_the_readme_shows_the_two_commands_exactly():
    blocks = fenced_blocks((ROOT / "README.md").read_text())
    assert RUN_COMMAND in [b.strip() for b in blocks]
    assert TEST_COMMAND in [b.strip() for b in blocks]
    readme = (ROOT / "README.md").read_text()
    assert '.venv/bin/python -m pytest -n 2 -m "convergence and not slow" -q' in readme
    assert "[Metrics](docs/metrics.md)" in readme


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_relative_link_resolves(page: Path):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("//"):
            continue  # http(s), mailto: not checked here (no network in the tests)
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {rel(dest)}")
    assert not broken, f"{rel(page)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_file_named_exists(page: Path):
    named = re.findall(r"(?<![\w./-])((?:configs|tools|rlhf_lightning|plugins|tests|docs)/[\w./-]*\w)", page.read_text())
    missing = sorted({p for p in named if "*" not in p and not (ROOT / p).exists()})
    assert not missing, f"{rel(page)} names files that do not exist: {missing}"


def test_every_shipped_config_is_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    missing = [rel(c) for c in sorted((ROOT / "configs").glob("*.yaml")) if rel(c) not in readme and c.name not in readme]
    assert not missing, f"configs the README does not name: {missing}"


def test_every_logged_metric_is_documented():
    metrics_page = (ROOT / "docs" / "metrics.md").read_text()
    pattern = re.compile(
        r"[\"']((?:objective|policy|value|response|timing|system|val|memory|reference|kl_tokens|off_policy|env)/[\w@/]+)[\"']"
    )
    names = set()
    for source in [*(ROOT / "rlhf_lightning").rglob("*.py"), *(ROOT / "plugins").rglob("*.py")]:
        names.update(pattern.findall(source.read_text()))
    assert len(names) >= 20, f"found only {sorted(names)}: has the logging moved?"
    missing = sorted(name for name in names if f"`{name}`" not in metrics_page)
    assert not missing, f"metrics logged but not explained in docs/metrics.md: {missing}"


def shown_commands() -> dict[str, str]:
    """Every ``rlhf-lightning ...`` command of a code block in the README and docs/, and of the
    usage lines in the configs' headers (``#   rlhf-lightning ...``), continuation lines joined,
    environment settings and comments dropped, deduplicated: command -> the first file showing it."""
    sources = [(page, fenced_blocks(page.read_text())) for page in PAGES]
    for config in sorted((ROOT / "configs").glob("*.yaml")):
        header = [line[1:] for line in config.read_text().split("\n") if line.startswith("#")]
        sources.append((config, ["\n".join(header)]))
    commands: dict[str, str] = {}
    for path, blocks in sources:
        for block in blocks:
            for line in re.sub(r"\\\n\s*", " ", block).split("\n"):
                line = re.sub(r"\s+#.*$", "", line.strip())
                found = re.search(r"(?:^|&& )(?:[A-Z_]+=\S*\s+)*((?:\.venv/bin/)?rlhf-lightning\s.*)$", line)
                if found:
                    commands.setdefault(re.sub(r"^\.venv/bin/", "", found.group(1)).strip(), rel(path))
    return commands


# A hang guard, not a speed test: the driver below parses every shown command in about 30 s alone on a
# 2-core machine (77 s at a load average of 4); 1800 s is 60 times that, room for a machine other jobs share.
HANG_GUARD_S = 1800

# A command that needs what a test machine has not got: skipped with the reason.
NEEDS = {
    "clipped_k1": "needs the example plugin installed (tests/test_cli.py and tests/test_examples.py run it)",
}

# Runs each command's arguments through the CLI in one process (one import instead of one per
# command): its exit status, and the plugin names in the printed config that do not resolve.
DRIVER = r"""
import contextlib, io, json, shlex, sys
import yaml
from rlhf_lightning.cli import main
from rlhf_lightning.registry import REGISTRIES
KINDS = {**{kind: kind for kind in REGISTRIES}, "gold_reward_model": "reward_model", "entropy_controller": "beta_controller"}
results = []
for line in json.load(sys.stdin):
    out, err, code = io.StringIO(), io.StringIO(), 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main(shlex.split(line))
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    except Exception as error:
        code, err = 1, io.StringIO(repr(error))
    unknown = []
    if code == 0:
        model = (yaml.safe_load(out.getvalue()) or {}).get("model") or {}
        for field, kind in KINDS.items():
            value = model.get(field)
            if isinstance(value, str) and value not in REGISTRIES[kind]:
                unknown.append(f"model.{field}: {value!r} is no registered {kind}")
    results.append({"command": line, "code": code, "stderr": err.getvalue()[-1500:], "unknown": unknown})
print("RESULTS" + json.dumps(results))
"""


def test_every_command_shown_parses():
    commands = shown_commands()
    assert any(c.startswith("rlhf-lightning fit --config configs/quickstart.yaml") for c in commands), commands
    to_run, skipped = [], []
    for command, page in commands.items():
        reason = next((why for needle, why in NEEDS.items() if needle in command), None)
        args = command.split(None, 1)[1]
        if reason:
            skipped.append(f"{page}: {command}: {reason}")
        elif re.match(r"fit --config configs/", args):
            configs = re.findall(r"--config[= ](\S+)", args)
            missing = [c for c in configs if not (ROOT / c).is_file()]
            assert not missing, f"{page}: {command}: no config {missing}"
            to_run.append(args if "--print_config" in args.split() else args + " --print_config")
    assert to_run
    env = {**os.environ, "RLHF_LIGHTNING_TRACEBACK": "0"}
    done = subprocess.run(
        [sys.executable, "-c", DRIVER], input=json.dumps(to_run), capture_output=True, text=True, cwd=ROOT, env=env, timeout=HANG_GUARD_S
    )
    assert done.returncode == 0 and "RESULTS" in done.stdout, done.stderr[-3000:]
    results = json.loads(done.stdout.split("RESULTS", 1)[1])
    failed = [
        f"rlhf-lightning {r['command']}: exit {r['code']} {r['unknown']}\n{r['stderr']}" for r in results if r["code"] != 0 or r["unknown"]
    ]
    assert not failed, "\n\n".join(failed)
    if skipped:
        print("not run:\n" + "\n".join(skipped))


def test_the_async_page_opens_with_a_command_that_runs():
    """docs/async.md's first code block is a run of the tiny config with the sampler ahead, as a newcomer types it
    (tests/test_examples.py runs it, one iteration, from a copy of the configs)."""
    first = fenced_blocks((ROOT / "docs" / "async.md").read_text())[0].strip()
    assert re.fullmatch(r"rlhf-lightning fit --config configs/tiny\.yaml \S.*--model\.off_policy\.max_staleness=1\b.*", first), first
