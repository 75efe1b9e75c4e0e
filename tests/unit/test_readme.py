"""Both README commands (the main job and the tests) are the ones CI runs; its flags, paths and
command blocks are checked with the docs' (test_docs.py)."""

import re

from conftest import REPO_ROOT

README = (REPO_ROOT / "README.md").read_text()


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
