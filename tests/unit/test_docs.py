"""README.md and docs/*.md match the code: every path they name exists, every flag they name is
taken or refused by name by pretrain_gpt.py's parser (or belongs to a tool or another program),
every flag of ours has its row in docs/training.md, every command block parses, every message of
docs/errors.md is in the source; and no tracked file speaks of the development environment."""

import functools
import re
import shlex
import subprocess

import pytest
from conftest import REPO_ROOT

DOCS = sorted((REPO_ROOT / "docs").glob("*.md"))
PAGES = [REPO_ROOT / "README.md", REPO_ROOT / "tests" / "README.md", *DOCS]
# Pages whose paths are checked too (their flags are the benchmarks' own).
PATH_PAGES = [*PAGES, REPO_ROOT / "bench" / "RESULTS.md", REPO_ROOT / "tests" / "gpu" / "LAST_RUN.md"]
# Flags of other programs: argparse, pip, torchrun, sbatch, pytest.
FOREIGN = {"--help", "--no-build-isolation", "--nproc-per-node", "--nproc_per_node", "--standalone",
           "--nodes", "--shutdown-timeout", "--signal", "--ignore"}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9]")
PATH = re.compile(r"(?<![\w./-])(?:examples|tools|bench|tests|megatron_ulysses|docs)/[\w./-]*\w/?")
LINK = re.compile(r"\]\(([^)#\s]+)\)")


def _text(path) -> str:
    return path.read_text()


def _rel(path) -> str:
    return str(path.relative_to(REPO_ROOT))


@functools.lru_cache(maxsize=None)
def _parser(model_flags_required: bool = True):
    from megatron_ulysses.training.arguments import build_parser

    return build_parser(model_flags_required)


def _options() -> set:
    return set(_parser().option_strings())


def _megatron_lm_flags() -> set:
    lines = (REPO_ROOT / "tests" / "helpers" / "megatron_lm_flags.txt").read_text().splitlines()
    return {line.split()[0] for line in lines if line.strip() and not line.startswith("#")}


def _ours() -> set:
    """The flags this package defines: the parser's, less Megatron-LM's own."""
    return _options() - _megatron_lm_flags() - {"-h", "--help"}


@functools.lru_cache(maxsize=None)
def _tool_sources() -> str:
    files = [*REPO_ROOT.glob("tools/*.py"), *REPO_ROOT.glob("bench/*.py"),
             *REPO_ROOT.glob("examples/*.sh"), *REPO_ROOT.glob("bench/*.sh"),
             *REPO_ROOT.glob("tests/gpu/*.sh")]
    return "\n".join(path.read_text() for path in files)


@functools.lru_cache(maxsize=None)
def _package_sources() -> str:
    files = [REPO_ROOT / "pretrain_gpt.py", *REPO_ROOT.glob("megatron_ulysses/**/*.py"),
             *REPO_ROOT.glob("tools/*.py")]
    return "\n".join(path.read_text() for path in files)


def _is_known(flag: str) -> bool:
    return (flag in FOREIGN or flag in _options() or flag in _megatron_lm_flags()
            or f'"{flag}"' in _tool_sources() or f"{flag} " in _tool_sources())


@pytest.mark.parametrize("page", PATH_PAGES, ids=_rel)
def test_every_path_named_exists(page):
    text = _text(page)
    paths = set(PATH.findall(text))
    links = {link for link in LINK.findall(text) if "://" not in link}
    missing = sorted(p for p in paths if not (REPO_ROOT / p).exists())
    missing += sorted(link for link in links if not (page.parent / link).exists())
    assert not missing, f"{_rel(page)} names files that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_flag_named_exists(page):
    flags = set(FLAG.findall(_text(page)))
    missing = sorted(flag for flag in flags if not _is_known(flag))
    assert not missing, f"{_rel(page)} names flags nothing defines: {missing}"


def test_every_flag_of_ours_has_its_row_in_training_md():
    rows = [line for line in _text(REPO_ROOT / "docs" / "training.md").splitlines()
            if line.startswith("|")]
    ours = _ours()
    assert "--ulysses-sp-size" in ours and "--tiled-mlp-shards" in ours, sorted(ours)
    missing = sorted(flag for flag in ours
                     if not any(re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", row)
                                for row in rows))
    assert not missing, f"docs/training.md has no table row for: {missing}"


def _commands(text: str):
    """The shell commands of the page's ```bash blocks: continuation lines joined, comments and
    `&&` chains split, environment assignments dropped."""
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if not line or line.startswith("#"):
                continue
            for part in line.split("&&"):
                words = shlex.split(part)
                while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
                    words = words[1:]
                if words:
                    yield words


def _pretrain_argv(words):
    for i, word in enumerate(words):
        if word.endswith("pretrain_gpt.py"):
            return words[i + 1:]
    return None


def _check_command(words) -> list:
    """Problems with one command."""
    argv = _pretrain_argv(words)
    if argv is not None:
        if "..." in argv:  # a fragment: each flag must be the parser's
            return [w for w in argv if w.startswith("--") and w.split("=")[0] not in _options()]
        parser = _parser("--use-checkpoint-args" not in argv)
        try:
            parser.parse_all(argv)
        except SystemExit as error:
            return [f"pretrain_gpt.py {' '.join(argv)}: exit {error.code}"]
        return []
    program = words[0]
    if program in ("python", "python3") and len(words) > 1 and words[1].endswith(".py"):
        script = REPO_ROOT / words[1]
        if not script.exists():
            return [f"{words[1]} does not exist"]
        source = script.read_text() + _package_sources()  # tools share the package's parsers
        return [f"{words[1]} {w}" for w in words[2:]
                if w.startswith("--") and f'"{w.split("=")[0]}"' not in source]
    if program in ("bash", "sbatch"):
        scripts = [w for w in words[1:] if w.endswith(".sh")]
        return [f"{s} does not exist" for s in scripts if not (REPO_ROOT / s).exists()]
    if program == "torchrun":
        return ["torchrun runs neither pretrain_gpt.py nor a tool"] if not any(
            w.endswith(".py") and (REPO_ROOT / w).exists() for w in words) else []
    return []  # pip, export, pytest: other programs


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_command_block_parses(page):
    problems = [problem for words in _commands(_text(page)) for problem in _check_command(words)]
    assert not problems, f"{_rel(page)}: {problems}"


def test_torchrun_tool_commands_take_the_tools_flags():
    """`torchrun ... tools/eval_passkey.py FLAGS`: the tool's flags are pretrain_gpt.py's."""
    for page in PAGES:
        for words in _commands(_text(page)):
            tools = [i for i, w in enumerate(words) if w.startswith("tools/")]
            if words[0] == "torchrun" and tools:
                argv = words[tools[0] + 1:]
                unknown = [w for w in argv if w.startswith("--") and w not in _options()
                           and f'"{w}"' not in (REPO_ROOT / words[tools[0]]).read_text()]
                assert not unknown, (page, unknown)


def test_every_message_in_errors_md_is_in_the_source():
    rows = [line for line in _text(REPO_ROOT / "docs" / "errors.md").splitlines()
            if line.startswith("| `")]
    assert len(rows) >= 20, rows
    sources = _package_sources()
    missing = [message for row in rows
               for message in re.findall(r"`([^`]+)`", row.split(" | ")[0])
               if message not in sources]
    assert not missing, f"docs/errors.md quotes messages the code does not print: {missing}"


# --- no word of the development environment -------------------------------------------------

DEV_WORDS = re.compile(r"\bissue \d|\bstops? \d|\bthis stop\b|\bstop's\b|\blent\b|\.\./shared"
                       r"|\bshared/device\b|\bworkplace\b|\brefused (?:starts|tries)\b"
                       r"|\bdevice calls?\b|\bsessions?\b", re.I)
# Legitimate uses: a POSIX session (torchrun's workers start one) and pytest's session scope.
ALLOWED = re.compile(r"own session|new session|its session|start_new_session|leads_own_session"
                     r"|scope=\"session\"|Session fixtures|once per session")


def _tracked_text_files():
    names = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    for name in names:
        path = REPO_ROOT / name
        if not path.is_file():
            continue
        try:
            yield name, path.read_text()
        except UnicodeDecodeError:
            continue


def test_no_tracked_file_speaks_of_the_development_environment():
    hits = []
    for name, text in _tracked_text_files():
        if name == "tests/unit/test_docs.py":  # defines the words
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if DEV_WORDS.search(line) and not ALLOWED.search(line):
                hits.append(f"{name}:{number}: {line.strip()[:120]}")
    assert not hits, "\n".join(hits)


@pytest.mark.parametrize("page", [*PAGES, REPO_ROOT / "bench" / "RESULTS.md"], ids=_rel)
def test_pages_are_short_lined(page):
    long = [n for n, line in enumerate(_text(page).splitlines(), 1)
            if len(line) > 100 and not line.startswith("|") and "pip install torch" not in line]
    assert not long, f"{_rel(page)}: lines over 100 characters: {long}"


def test_readme_and_results_stay_short():
    assert len(_text(REPO_ROOT / "README.md").splitlines()) <= 200
    assert len(_text(REPO_ROOT / "bench" / "RESULTS.md").splitlines()) <= 350
