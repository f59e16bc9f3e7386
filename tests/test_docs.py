"""The README and docs/ stay true to the checkout: links resolve, every training command
composes under Hydra, and every script, module and path they name exists. No training runs."""
from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TRAIN_SCRIPT = "scripts/train.py"
PLACEHOLDER = re.compile(r"<[^>]*>|\.\.\.")  # runs/<exp>/<time>, init_from=...
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```(\w*)\s*$")
# project paths the pages name in backticks: these folders are tracked, so each must exist
TRACKED = ("unnorm/", "plugins/", "configs/", "scripts/", "analysis/", "tests/", "results/")
PROJECT_PACKAGES = ("unnorm", "plugins", "analysis")


def relative(page: Path) -> str:
    return str(page.relative_to(ROOT))


def prose_and_blocks(page: Path) -> tuple[list[str], list[tuple[str, int, str]]]:
    """The page's lines outside code fences, and its fenced lines as (language, line number,
    text)."""
    prose, blocks, language = [], [], None
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        fence = FENCE.match(line)
        if fence:
            language = None if language is not None else fence.group(1)
        elif language is None:
            prose.append(line)
        else:
            blocks.append((language, number, line))
    return prose, blocks


def bash_commands(page: Path) -> list[tuple[int, str]]:
    """Each command of the page's ```bash blocks, continuation lines joined, with the number
    of its first line."""
    commands, pending, start = [], "", 0
    for language, number, line in prose_and_blocks(page)[1]:
        if language != "bash":
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        commands.append((start, pending + line))
        pending = ""
    return commands


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {github_anchor(line.lstrip("#")) for line in prose_and_blocks(page)[0]
            if re.match(r"#{1,6} ", line)}


def train_commands() -> list:
    cases = []
    for page in PAGES:
        for number, command in bash_commands(page):
            words = shlex.split(command, comments=True)
            if TRAIN_SCRIPT in words:
                location = f"{relative(page)}:{number}"
                cases.append(pytest.param(location, words[words.index(TRAIN_SCRIPT) + 1:],
                                          id=location))
    return cases


def composable(words: list[str]) -> list[str]:
    """The Hydra overrides of a documented command that compose here: flags (``-m``), the
    launcher and ``hydra.*`` settings and placeholder values dropped; of a multirun list
    (``seed=0,1,2``) the first value."""
    kept = [word for word in words if not word.startswith(("-", "hydra/", "hydra."))
            and not PLACEHOLDER.search(word.partition("=")[2])]
    return [first_point(override) for override in kept]


def first_point(override: str) -> str:
    """``key=a,b,c`` -> ``key=a``, by Hydra's own sweep parser; anything else unchanged."""
    parsed = OverridesParser.create().parse_overrides([override])[0]
    if not parsed.is_sweep_override():
        return override
    return f"{parsed.get_key_element()}={next(iter(parsed.sweep_string_iterator()))}"


def test_pages_exist():
    assert (ROOT / "README.md").exists() and len(PAGES) > 1, "README.md and docs/*.md expected"


@pytest.mark.parametrize("page", PAGES + sorted((ROOT / "results").glob("*.md")), ids=relative)
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            broken.append(f"{target}: no heading #{fragment} in {linked.name}")
    assert not broken, f"{relative(page)}: broken links: {broken}"


@pytest.mark.parametrize("location, words", train_commands())
def test_train_command_composes(location, words):
    """The command's overrides compose with configs/ as scripts/train.py composes them; a
    sweep config's grid (``+sweep=...``) composes at its first point too."""
    overrides = composable(words)
    try:
        with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
            cfg = compose("train", overrides=overrides, return_hydra_config=True)
            grid = cfg.hydra.sweeper.get("params") or {}
            points = [first_point(f"{key}={values}") for key, values in grid.items()]
            if points:
                compose("train", overrides=overrides + points)
    except Exception as error:  # Hydra and OmegaConf raise several kinds
        pytest.fail(f"{location}: `{' '.join(words)}` does not compose "
                    f"({type(error).__name__}: {error})")


def test_commands_found():
    """Guards the parser: the README's quick start and the docs' blocks hold train commands."""
    assert len(train_commands()) >= 20


@pytest.mark.parametrize("page", PAGES, ids=relative)
def test_named_scripts_modules_and_paths_exist(page):
    text = page.read_text()
    missing = [script for script in re.findall(r"\bscripts/[\w.-]+\.(?:py|sh)\b", text)
               if not (ROOT / script).is_file()]
    for module in re.findall(r"python\s+-m\s+([\w.]+)", text):
        if module.split(".")[0] in PROJECT_PACKAGES:
            as_path = ROOT / module.replace(".", "/")
            if not (as_path.with_suffix(".py").is_file() or (as_path / "__init__.py").is_file()):
                missing.append(f"-m {module}")
    for path in re.findall(r"`([^`\s]+)`", text):
        if path.startswith(TRACKED) and not re.search(r"[<>*{}]|\.\.\.", path) \
                and not (ROOT / path.rstrip("/")).exists():
            missing.append(path)
    assert not missing, f"{relative(page)} names what this checkout lacks: {missing}"


def python_without_the_project() -> str:
    """The Python .venv/ was made from, which lacks the project's packages (skip if it has
    them)."""
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}"
    if importlib.util.find_spec("hydra") is None or not base.exists():
        pytest.skip("this suite does not run in the project's .venv/")
    has = subprocess.run([base, "-c", "import hydra"], capture_output=True).returncode == 0
    if has:
        pytest.skip(f"{base} has the project's packages: no Python without them to try")
    return str(base)


def test_the_readmes_python_commands_work_without_activating_the_venv(tmp_path):
    """`python scripts/...` as the README writes it, started by a Python without the project's
    packages, runs under .venv/'s; without a .venv/ it says how to make one."""
    python = python_without_the_project()
    done = subprocess.run([python, "scripts/train.py", "+exp=swin_t_uun", "scale=cpu"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode != 0 and "Closest: swin_t_un" in done.stderr, done.stderr[-2000:]
    (tmp_path / "scripts").mkdir()
    for name in ("project_env.py", "make_tables.py"):
        shutil.copy(ROOT / "scripts" / name, tmp_path / "scripts" / name)
    done = subprocess.run([python, "scripts/make_tables.py", "--help"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert done.returncode == 1 and "run `make run`" in done.stderr, done.stderr
