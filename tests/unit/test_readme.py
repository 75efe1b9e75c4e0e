"""The README matches the code: every flag it names exists, every file it names is there, and
both of its commands (the main job and the tests) are the ones CI runs."""

import re

from conftest import REPO_ROOT

README = (REPO_ROOT / "README.md").read_text()
# Flags the README names that belong to others: argparse, pip, sbatch, and megatron-core's own
# context parallelism it compares against.
FOREIGN = {"--help", "--no-build-isolation", "--nodes", "--context-parallel-size",
           "--cp-comm-type"}


def _sources() -> str:
    files = [*REPO_ROOT.glob("*.py"), *REPO_ROOT.glob("megatron_ulysses/**/*.py"),
             *REPO_ROOT.glob("tools/*.py"), *REPO_ROOT.glob("examples/*.sh")]
    return "\n".join(path.read_text() for path in files)


def test_every_flag_in_the_readme_exists():
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9]", README)) - FOREIGN
    sources = _sources()
    missing = sorted(flag for flag in flags if f'"{flag}"' not in sources
                     and f"{flag} " not in sources)
    assert not missing, f"README names flags no parser or script defines: {missing}"


def test_every_path_in_the_readme_exists():
    paths = set(re.findall(r"(?:examples|tools|bench|tests|megatron_ulysses)/[\w./-]*\w", README))
    missing = sorted(path for path in paths if not (REPO_ROOT / path).exists())
    assert not missing, f"README names files that do not exist: {missing}"


def test_ci_runs_the_readme_test_command():
    command = re.search(r"```bash\n(pip install torch==2\.13\.0 && .*pytest.*)\n```", README)
    assert command, "README has no test command"
    assert command.group(1) in (REPO_ROOT / ".ci" / "run").read_text()


def test_ci_runs_the_readme_main_job_command():
    commands = re.findall(r"```bash\n(pip install torch==2\.13\.0 && [^\n]*)\n```", README)
    main_job = [c for c in commands if "quickstart_cpu.sh" in c]
    assert len(main_job) == 1, commands
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert f"'{main_job[0]}'" in ci  # run as one command, in its own virtual environment
    assert "python3 -m venv" in ci
