"""README.md and docs/*.md say only what is true: their commands run, and the paths, links and
modules they name exist (issue 32).

Which shell blocks run. A block is fenced ```bash, ```sh or ```console (in a console block the
lines that start with `$ ` are the commands, the rest is output); each is a test case named
`file:line`, so a skipped block shows up with its reason. A block runs when:
- every command in it is a help request (`pagedserve ... --help`, `python -m pagedserve... --help`,
  or `-h`);
- the line right before it is `<!-- test: run -->`: it runs with `bash -e -o pipefail` from the
  repository root and must exit 0 within a minute;
- the line right before it is `<!-- test: with-server -->`: it runs the same way while the server
  of the one block marked `<!-- test: serve -->` is up. That block is a single command (no shell),
  started once, polled on `/health`, then stopped with SIGTERM: it must exit 0 (graceful
  shutdown) and leave no process behind. In the serve block and the blocks that talk to it the
  documented port 8000 is replaced by a free one, so the test never meets another server.
Every other block is skipped, by rule: an unmarked block is an install (pip, docker), needs a
GPU, a network or hub download, several machines or a model that is not in the repository, or
runs for minutes. A marked block may not be one of those (`test_marked_blocks_are_cheap`).

The path check: a repository path is a backticked token like `frontend/llm.py`,
`kernels/attention/` or `worker/model_runner.py::set_cpu_threads`, or any word in the text like
tests/gpu/device_run.sh (a path with a file extension), outside URLs and not under `~`, `/`, `$`
or `..`; each must exist from the repository root. Relative markdown links must reach a file
(and a heading, for `#anchor`), and every `python -m pagedserve.x.y` must name a module that
`importlib.util.find_spec` finds.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import signal
import socket
import subprocess
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from proctools import descendants, wait_gone

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SETUP_COMMANDS = [  # CI (.ci/run) and newcomers rely on README's first block being exactly these
    "pip install torch==2.13.0 -e . && pagedserve launch"
    "                # install, then serve the embedded model on :8000",
    "bash tests/setup.sh && python -m pytest -q"
    "                         # install what the tests need (apt, pip), then run them",
]
SHELLS = {"bash", "sh", "console"}
DOC_PORT = "8000"
HELP = re.compile(
    r"(pagedserve|python3? -m pagedserve(\.\w+)+)( [\w-]+)* (--help|-h)( \| head( -n ?\d+)?)?"
)
EXPENSIVE = re.compile(r"pip install|docker |kubectl|--device cuda|STEPS=|--nnodes|https?://")
FENCE = re.compile(r"^```(\S*)\s*$")
MARK = re.compile(r"^<!-- test: (run|serve|with-server) -->$")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    mark: str | None  # run | serve | with-server

    def commands(self) -> list[str]:
        """Logical command lines: backslash continuations joined, comments and output dropped."""
        lines = self.text.splitlines()
        if self.lang == "console":
            lines = [ln[2:] for ln in lines if ln.startswith("$ ")]
        joined = "\n".join(lines).replace("\\\n", " ")
        out = [ln.split(" #")[0].strip() for ln in joined.splitlines()]
        return [ln for ln in out if ln and not ln.startswith("#")]

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def _blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        mark = MARK.match(lines[i - 1]) if i else None
        rel = str(page.relative_to(ROOT))
        text = "\n".join(lines[i + 1 : end])
        blocks.append(Block(rel, i + 1, m.group(1), text, mark.group(1) if mark else None))
        i = end + 1
    return blocks


ALL_BLOCKS = [b for page in PAGES for b in _blocks(page)]
SHELL_BLOCKS = [b for b in ALL_BLOCKS if b.lang in SHELLS]


def _is_help(block: Block) -> bool:
    cmds = block.commands()
    return bool(cmds) and all(HELP.fullmatch(c) for c in cmds)


def _skip_reason(block: Block) -> str:
    text = block.text
    why = (
        "an install or a container" if re.search(r"pip install|docker|kubectl", text)
        else "a GPU or several machines" if re.search(r"STEPS=|--nnodes|--tp [2-9]|cuda", text)
        else "a hub download" if re.search(r"serve \w[\w.-]*/", text)
        else "minutes, peers or models outside the repository"
    )  # fmt: skip
    return f"{block}: not marked and not --help; it needs {why}"


def _run(script: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def docs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """The server of the `serve` block, on a free port; stopped by SIGTERM, which must end it
    with exit code 0 and take every process it started with it."""
    (serve,) = [b for b in SHELL_BLOCKS if b.mark == "serve"]
    (command,) = serve.commands()
    port = _free_port()
    argv = shlex.split(command.replace(DOC_PORT, str(port)))
    log = tmp_path_factory.mktemp("docs_server") / "server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not _health(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{serve}: `{command}` did not serve:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    children = descendants(proc.pid)
    yield port
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"{serve}: no exit within 60 s of SIGTERM:\n{log.read_text()[-3000:]}")
    assert rc == 0, f"{serve}: exit code {rc} after SIGTERM:\n{log.read_text()[-3000:]}"
    assert wait_gone(children, 10) == [], f"{serve}: processes outlived `{command}`"


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=str)
def test_shell_block(block: Block, request: pytest.FixtureRequest) -> None:
    if block.mark == "serve":
        request.getfixturevalue("docs_server")  # starting it is the test
        return
    script = block.text if block.lang != "console" else "\n".join(block.commands())
    if block.mark == "with-server":
        port = request.getfixturevalue("docs_server")
        script = script.replace(DOC_PORT, str(port))
    elif block.mark != "run" and not _is_help(block):
        pytest.skip(_skip_reason(block))
    try:
        res = _run(script)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block}: still running after 60 s")
    assert res.returncode == 0, f"{block} exited {res.returncode}:\n{res.stdout}\n{res.stderr}"


def test_marked_blocks_are_cheap() -> None:
    """Marks are for quick, local blocks; and the docs keep enough of them to test something."""
    marked = [b for b in ALL_BLOCKS if b.mark]
    assert all(b.lang in SHELLS for b in marked), [str(b) for b in marked if b.lang not in SHELLS]
    assert [str(b) for b in marked if EXPENSIVE.search(b.text)] == []
    assert len([b for b in marked if b.mark == "serve"]) == 1
    assert len([b for b in SHELL_BLOCKS if b.mark or _is_help(b)]) >= 5


def test_readme_starts_with_the_two_setup_commands() -> None:
    first = _blocks(ROOT / "README.md")[0]
    assert first.lang == "bash"
    assert first.text.splitlines() == SETUP_COMMANDS
    test_command = first.commands()[1]  # CI runs exactly README's test command, last
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == test_command, f".ci/run must end with README's `{test_command}`"


# --- paths, links and modules -----------------------------------------------------------------

URL = re.compile(r"\w+://\S+")
SPAN = re.compile(r"`([^`]+)`")
SPAN_PATH = re.compile(r"[\w-][\w.-]*(/[\w.-]+)*/?(::\w+)?")
WORD_PATH = re.compile(
    r"(?<![\w./~$-])((?:[\w-][\w.-]*/)+[\w.-]+\.(?:py|sh|json|md|cpp|ya?ml|toml|txt|js|template))\b"
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
MODULE = re.compile(r"python3? -m\s+(pagedserve(?:\.\w+)*)")
HEADING = re.compile(r"^#{1,6} (.+)$")


def _prose(text: str) -> str:
    """The text outside fenced blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def named_paths(text: str) -> set[str]:
    text = URL.sub("", text)
    found = {m.group(1) for m in WORD_PATH.finditer(text)}
    for span in SPAN.findall(_prose(text)):
        if "/" in span and SPAN_PATH.fullmatch(span) and not span.startswith("."):
            found.add(span.split("::")[0])
    return found


def _slugs(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes, -N repeats."""
    slugs: set[str] = set()
    seen: Counter[str] = Counter()
    for m in (HEADING.match(ln) for ln in _prose(page.read_text()).splitlines()):
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            slugs.add(slug if seen[slug] == 0 else f"{slug}-{seen[slug]}")
            seen[slug] += 1
    return slugs


def _bad_link(page: Path, target: str) -> str | None:
    if re.match(r"[a-z]+:", target):
        return None  # http(s), mailto
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    if not dest.exists():
        return f"{target}: no such file"
    if anchor and dest.suffix == ".md" and anchor not in _slugs(dest):
        return f"{target}: no heading #{anchor}"
    return None


def test_named_paths_links_and_modules_exist() -> None:
    stale = []
    for page in PAGES:
        text, rel = page.read_text(), page.relative_to(ROOT)
        stale += [f"{rel}: {p}" for p in sorted(named_paths(text)) if not (ROOT / p).exists()]
        stale += [f"{rel}: {why}" for t in LINK.findall(text) if (why := _bad_link(page, t))]
        mods = sorted(set(MODULE.findall(text)))
        stale += [f"{rel}: python -m {m}" for m in mods if importlib.util.find_spec(m) is None]
    assert stale == [], "\n".join(stale)


def test_path_rules() -> None:
    """The path rules catch what they should and leave URLs, home paths and peers alone."""
    text = (
        "`frontend/llm.py`, `kernels/attention/`, `worker/a.py::f`, tests/gpu/x.sh and\n"
        "`~/.cache/p/`, `/v1/models`, ../shared/gpu/README.md, http://h/a/b.py, `json/*.py`\n"
        "```bash\nbash tests/cpu.sh\n```\n"
    )
    assert named_paths(text) == {
        "frontend/llm.py", "kernels/attention/", "worker/a.py", "tests/gpu/x.sh", "tests/cpu.sh",
    }  # fmt: skip
    assert MODULE.findall("`python -m pagedserve.benchmarks.x --sweep`") == [
        "pagedserve.benchmarks.x"
    ]
    readme = ROOT / "README.md"
    assert _bad_link(readme, "docs/nope.md") == "docs/nope.md: no such file"
    assert _bad_link(readme, "#no-such-heading") == "#no-such-heading: no heading #no-such-heading"
    assert _bad_link(readme, "https://example.com/x") is None
