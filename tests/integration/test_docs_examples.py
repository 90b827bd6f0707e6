"""Every Python block of the tutorial and the how-to guides runs, as written.

The pages are read in order (the tutorial, then the how-tos by name) into one new
Django project, the way a reader would build it up:
- a block whose first line names a file (`# shop/tasks.py`) is that file of the
  project; its top folder becomes an installed app;
- a `# settings.py` block is added to the project's settings, where `[..., x]` means
  "the list you already have, plus x";
- any other block is run, in order, in one `manage.py shell`-like process per page;
- a `tests.py` block is run with pytest.

The project starts from the least a Django project has (auth, contenttypes, a database)
and gets django_skipqueue only from the tutorial's own settings block. It runs on a new
database of the test server, after `makemigrations` for the pages' apps and `migrate`.
The django.tasks guide is left out where Django has no django.tasks (5.2).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.processes import REPO_ROOT

DOCS = REPO_ROOT / "docs"
PAGES = [DOCS / "tutorial" / "first-job.md", *sorted((DOCS / "howto").glob("*.md"))]
NEEDS_DJANGO_TASKS = {"django-tasks.md"}
FILE_HEADER = re.compile(r"#\s+([\w/]+\.py)\b")

BASE_SETTINGS = """
import os

from django_skipqueue.embedded import database_from_url

DATABASES = {"default": database_from_url(os.environ["DATABASE_URL"])}
SECRET_KEY = "docs-examples"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = ["django.contrib.auth", "django.contrib.contenttypes"]
EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
PAYMENTS_URL = "http://127.0.0.1:9/charges"  # the idempotency guide's API (never called)


def _plus(existing, *more):
    return [*existing, *(item for item in more if item not in existing)]
"""

RUNNER = """
import sys

import django

django.setup()
namespace = {"__name__": "__docs__"}
for path in sys.argv[1:]:
    code = open(path).read()
    exec(compile(code, path, "exec"), namespace)
"""


@dataclass
class Block:
    page: Path
    line: int
    code: str

    @property
    def file(self) -> str | None:
        match = FILE_HEADER.match(self.code.splitlines()[0]) if self.code.strip() else None
        return match.group(1) if match else None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO_ROOT)}:{self.line}"


def python_blocks(page: Path) -> list[Block]:
    blocks, current, start = [], None, 0
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if current is None and line.strip() == "```python":
            current, start = [], number + 1
        elif current is not None and line.strip() == "```":
            blocks.append(Block(page, start, textwrap.dedent("\n".join(current)) + "\n"))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def pages_here() -> list[Path]:
    has_tasks = importlib.util.find_spec("django.tasks") is not None
    return [page for page in PAGES if has_tasks or page.name not in NEEDS_DJANGO_TASKS]


def settings_code(code: str) -> str:
    """`NAME = [..., x]` adds x to the NAME the settings already have (once), and
    `NAME = {..., "KEY": value}` adds KEY to the NAME dict the settings already have."""
    code = re.sub(r"^(\w+) = \[\.\.\.,\s*(.*)\]$", r"\1 = _plus(\1, \2)", code, flags=re.M)
    return re.sub(r"^(\w+) = \{\.\.\.,", r'\1 = {**globals().get("\1", {}),', code, flags=re.M)


def build_project(root: Path, pages: list[Path]) -> dict[Path, list[Block]]:
    """Write the pages' files and settings under `root`; return each page's snippets."""
    settings = [BASE_SETTINGS]
    apps: list[str] = []
    snippets: dict[Path, list[Block]] = {}
    for page in pages:
        for block in python_blocks(page):
            if block.file == "settings.py":
                settings.append(f"# {block.where}\n" + settings_code(block.code))
            elif block.file is not None:
                target = root / block.file
                target.parent.mkdir(parents=True, exist_ok=True)
                (target.parent / "__init__.py").touch()
                target.write_text(block.code)
                app = block.file.split("/")[0]
                if "/" in block.file and app not in apps:
                    apps.append(app)
            else:
                snippets.setdefault(page, []).append(block)
    settings.append(f"INSTALLED_APPS = _plus(INSTALLED_APPS, *{apps!r})\n")
    (root / "docs_settings.py").write_text("\n".join(settings))
    return snippets


def run(root: Path, database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(root),
        "DATABASE_URL": database_url,
        "DJANGO_SETTINGS_MODULE": "docs_settings",
        "PYTHONPATH": str(root),
    }
    return subprocess.run(
        [sys.executable, *args], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )


def check(result: subprocess.CompletedProcess[str], what: str) -> None:
    assert result.returncode == 0, f"{what} failed:\n{result.stdout}\n{result.stderr}"


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_every_python_block_of_the_tutorial_and_the_how_tos_runs(tmp_path, empty_database_url):
    pages = pages_here()
    snippets = build_project(tmp_path, pages)
    apps_with_models = sorted(path.parent.name for path in tmp_path.glob("*/models.py"))

    check(run(tmp_path, empty_database_url, "-m", "django", "check"), "manage.py check")
    if apps_with_models:
        made = run(tmp_path, empty_database_url, "-m", "django", "makemigrations",
                   *apps_with_models)  # fmt: skip
        check(made, "makemigrations")
    check(run(tmp_path, empty_database_url, "-m", "django", "migrate"), "migrate")
    (tmp_path / "run_blocks.py").write_text(RUNNER)
    ran = 0
    for page, blocks in snippets.items():
        paths = []
        for index, block in enumerate(blocks):
            path = tmp_path / "blocks" / f"{page.stem}-{index}-line{block.line}.py"
            path.parent.mkdir(exist_ok=True)
            path.write_text(block.code)
            paths.append(str(path))
        check(run(tmp_path, empty_database_url, "run_blocks.py", *paths), str(page.name))
        ran += len(blocks)
    for tests in sorted(tmp_path.glob("*/tests.py")):
        pytest_run = run(tmp_path, empty_database_url, "-m", "pytest", "-q", "-p", "no:randomly",
                         "-p", "no:cacheprovider", str(tests.relative_to(tmp_path)))  # fmt: skip
        check(pytest_run, f"pytest {tests.relative_to(tmp_path)}")
        assert " passed" in pytest_run.stdout

    files = sum(1 for page in pages for block in python_blocks(page) if block.file)
    assert ran + files == sum(len(python_blocks(page)) for page in pages)
    assert ran >= 5 and files >= 8  # the pages' blocks were all found and used


def test_the_block_reader_finds_files_settings_and_snippets(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Intro\n\n```python\n# app/tasks.py\nX = 1\n```\n\n```python\n# settings.py\n"
        "INSTALLED_APPS = [..., 'app']\n```\n\n```python\nprint(1)\n```\n\n```sh\nls\n```\n"
    )
    blocks = python_blocks(page)
    assert [block.file for block in blocks] == ["app/tasks.py", "settings.py", None]
    assert [block.line for block in blocks] == [4, 9, 14]
    assert (
        settings_code(blocks[1].code)
        == "# settings.py\nINSTALLED_APPS = _plus(INSTALLED_APPS, 'app')\n"
    )
