"""The Jenkinsfile: no Jenkins runs here, so its syntax is checked with npm-groovy-lint (CodeNarc's
Groovy parser and rules, on a JRE) and its ``sh`` steps against ci/.

npm-groovy-lint comes from npm (``.ci/run`` installs the pinned version, and a JRE if there is none).
Without it the lint test skips locally and fails under ``CI=true``, as the tests of the Debian
tools do (tests/deploy/tools.py).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
JENKINSFILE = REPO / "Jenkinsfile"

_BLOCK_COMMENT = re.compile(r"^\s*/\*.*?\*/", re.DOTALL | re.MULTILINE)  # from a line's start: '**/x' is a glob
_LINE_COMMENT = re.compile(r"^\s*//.*$", re.MULTILINE)
#: ``sh 'x'``, ``sh "x"``, ``sh '''x'''``, ``sh(script: 'x', ...)``, ``sh(returnStatus: true, script: '''x''')``
_SH = re.compile(r"""\bsh\b\s*\(?\s*(?:\w+\s*:\s*[^,'"()]+?\s*,\s*)*(?:script\s*:\s*)?('''|\"\"\"|'|")(.*?)\1""",
                 re.DOTALL)


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def code_of(text: str) -> str:
    """The Jenkinsfile without its comments (whole-line ``//``, and ``/* */`` starting a line)."""
    return _LINE_COMMENT.sub("", _BLOCK_COMMENT.sub("", text))


def sh_scripts(text: str) -> list[str]:
    """The shell text of every ``sh`` step, Groovy's ``\\\\``-newline continuations joined."""
    code = code_of(text)
    scripts = [m.group(2) for m in _SH.finditer(code)]
    assert len(scripts) == len(re.findall(r"\bsh\b", code)), "an sh step of a form this test does not read"
    return [re.sub(r"\\\\\n", " ", s).strip() for s in scripts]


def test_sh_scripts_parser_reads_each_form():
    text = """
    // sh 'not-a-step'
    /* sh 'nor this'
    */
    steps { sh 'ci/a --x "$Y"' }
    steps { sh(returnStatus: true, script: '''
        ci/b --one \\\\
            --two
    ''') }
    steps { sh script: "ci/c", label: 'c' }
    """
    assert sh_scripts(text) == ['ci/a --x "$Y"', "ci/b --one              --two", "ci/c"]


def test_every_sh_step_runs_an_executable_under_ci():
    scripts = sh_scripts(JENKINSFILE.read_text())
    assert scripts, "the Jenkinsfile runs no sh step"
    for script in scripts:
        assert not re.search(r"[;&|\n`]|\$\(", script), f"one command per sh step, not {script!r}"
        program = shlex.split(script)[0]
        assert program.startswith("ci/"), f"sh step runs {program!r}, not an entry point under ci/"
        path = REPO / program
        assert path.is_file() and os.access(path, os.X_OK), f"{program} is not an executable file"
    assert {shlex.split(s)[0] for s in scripts} == {"ci/run-pipeline", "ci/deploy"}


def test_jenkinsfile_pipeline_shape():
    code = code_of(JENKINSFILE.read_text())
    assert "changeRequest()" in code and "branch 'main'" in code
    assert "--stages-file" in code
    assert "junit(testResults: 'ci-artifacts/**/junit-*.xml'" in code
    assert "archiveArtifacts(artifacts: 'ci-artifacts/**'" in code
    assert "credentials('apiary-prefect-api-url')" in code


def test_jenkinsfile_passes_npm_groovy_lint():
    lint = shutil.which("npm-groovy-lint")
    if not lint:
        reason = ("npm-groovy-lint not found on PATH (npm install -g npm-groovy-lint, which needs a JRE; "
                  ".ci/run does this)")
        if in_ci():
            pytest.fail(f"CI=true but {reason}", pytrace=False)
        pytest.skip(reason)
    # --noserver: no CodeNarc server left running after the test; --failon error: warnings and infos
    # (style: nesting depth of declarative blocks, CompileStatic) do not fail. The JVM's quick JIT only
    # (TieredStopAtLevel=1) halves the run here: 8 s instead of 15 s on 2 loaded CPUs.
    proc = subprocess.run([lint, "--noserver", "--failon", "error", "--output", "json",
                           "--javaoptions=-Xmx1g,-XX:TieredStopAtLevel=1", str(JENKINSFILE)],
                          cwd=REPO, capture_output=True, text=True, timeout=180)
    out = proc.stdout
    try:
        result = json.loads(out[out.index("{"):])
    except ValueError:
        pytest.fail(f"npm-groovy-lint exit {proc.returncode}, no JSON: {out[-2000:]} {proc.stderr[-2000:]}")
    errors = [e for f in result.get("files", {}).values() for e in f.get("errors", []) if e["severity"] == "error"]
    assert not errors, json.dumps(errors, indent=2)
    assert result["summary"]["totalFilesLinted"] == 1
    assert proc.returncode == 0, proc.stderr[-2000:]
