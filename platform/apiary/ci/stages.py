"""What each ``platform-ci`` stage does (the table is in :mod:`apiary.ci.pipeline`).

The stage code is this process's (the CI runner's Apiary); what it runs comes from the commit under
test: its Makefile, tests, Dockerfiles, Locust profiles, chaos experiments and benchmark
thresholds. The workspace's ``platform/`` goes first on ``PYTHONPATH`` of every command run there,
and the unit stage checks that ``import apiary`` really resolves to the workspace.

Every stage writes its commands' output to ``<artifacts>/<stage>.log``; a verdict failure raises
:class:`~apiary.ci.pipeline.StageFailed` with one line saying why (the failing tests, the missed
gate, the stopped container's last log lines).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from apiary.ci import paired
from apiary.ci.pipeline import CiContext, PipelineReport, Stage, StageFailed

SHA_RE = re.compile(r"^[0-9a-f]{7,40}$")
#: The workspace's files are 0644 and its directories 0755, as a clone's anywhere else.
CHECKOUT_UMASK = 0o022
#: Bounds on each stage's commands (seconds): a hung command fails its stage, not the pipeline.
TIMEOUTS = {"checkout": 300, "unit": 1800, "integration": 900, "regression": 900}
#: The staging platform's cluster: Lab 6's two-VC config (the integration suite's scenarios 1-3 need it).
STAGING_CLUSTER = "examples/lab6/hived-config-two-vcs.yaml"


def _run(ctx: CiContext, stage: str, argv: Sequence[object], *, cwd: Path | None = None,
         env: dict[str, str] | None = None, timeout: float = 600,
         umask: int = -1) -> subprocess.CompletedProcess[str]:
    """Run ``argv``, append its output to ``<artifacts>/<stage>.log`` and the stage's log; a
    timeout is a :class:`StageFailed`. ``umask``: the command's (-1: this process's). Returns the
    completed process (the caller judges the code)."""
    cmd = [str(a) for a in argv]
    ctx.log.info("$ %s", " ".join(cmd))
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, umask=umask)
    except subprocess.TimeoutExpired as exc:
        raise StageFailed(f"{cmd[0]} did not finish within {timeout:g} s") from exc
    with (ctx.artifacts / f"{stage}.log").open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}\n[exit {proc.returncode}]\n")
    tail = (proc.stdout + proc.stderr)[-3000:]
    ctx.log.info("exit %d; output ends:\n%s", proc.returncode, tail)
    return proc


def workspace_env(ctx: CiContext, root: Path | None = None, **more: str) -> dict[str, str]:
    """The environment of commands run in the workspace (or in the checkout ``root``): its
    ``platform/`` and root first on PYTHONPATH, the CI runner's virtualenv on PATH, no inherited
    Apiary credentials."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("APIARY_TOKEN", "APIARY_CI_"))}
    venv = Path(ctx.config.venv)
    tree = root or ctx.workspace
    env.update(PYTHONPATH=f"{tree / 'platform'}{os.pathsep}{tree}",
               PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv),
               DO_NOT_TRACK="1", PREFECT_SERVER_ANALYTICS_ENABLED="false", PYTHONDONTWRITEBYTECODE="1", **more)
    return env


# -- checkout -----------------------------------------------------------------------------------


def checkout(ctx: CiContext) -> str:
    """Clone the repository (``APIARY_CI_REPO_URL`` or the webhook's ``clone_url``) into a clean
    workspace and check out the commit's sha (fetching ``refs/pull/<n>/head`` when the sha is only
    on the pull request's ref). Fails when the sha cannot be found. The checkout is made with umask
    022 as any clone is, though the platform runs with 077: it is code, not secrets, and the images
    built from it run their tasks as uids of their own, which must read it."""
    sha = ctx.commit.sha.lower()
    if not SHA_RE.fullmatch(sha):
        raise StageFailed(f"not a commit sha: {ctx.commit.sha!r}")
    url = ctx.config.repo_url or ctx.commit.clone_url
    if not url or url.startswith("-"):
        raise StageFailed(f"no usable repository URL: {url!r}")
    ws = ctx.workspace
    shutil.rmtree(ws, ignore_errors=True)
    ws.parent.mkdir(parents=True, exist_ok=True)
    proc = _run(ctx, "checkout", ["git", "clone", "--quiet", "--no-checkout", "--", url, ws],
                timeout=TIMEOUTS["checkout"], umask=CHECKOUT_UMASK)
    if proc.returncode != 0:
        raise StageFailed(f"git clone {url} failed: {proc.stderr.strip()[-300:]}")
    git: list[object] = ["git", "-C", ws, "-c", "advice.detachedHead=false"]
    if _run(ctx, "checkout", [*git, "checkout", "--quiet", sha], umask=CHECKOUT_UMASK).returncode != 0:
        refs = [f"+refs/pull/{ctx.commit.pr_number}/head"] if ctx.commit.pr_number is not None else []
        for ref in [*refs, sha]:
            if _run(ctx, "checkout", [*git, "fetch", "--quiet", "origin", ref], umask=CHECKOUT_UMASK).returncode == 0:
                break
        if _run(ctx, "checkout", [*git, "checkout", "--quiet", sha], umask=CHECKOUT_UMASK).returncode != 0:
            raise StageFailed(f"commit {sha} is not in {url}")
    head = _run(ctx, "checkout", [*git, "rev-parse", "HEAD"]).stdout.strip()
    if not head.startswith(sha):
        raise StageFailed(f"checked out {head}, not {sha}")
    ctx.data["head"] = head
    return f"{head[:12]} from {url}"


# -- unit ---------------------------------------------------------------------------------------


def junit_summary(path: Path, limit: int = 3) -> tuple[dict[str, int], list[str]]:
    """``({"tests", "failures", "errors", "skipped"}, [first failing test ids])`` from a JUnit XML
    file (pytest's ``--junitxml``); zeros when it is missing or unreadable."""
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failing: list[str] = []
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return counts, failing
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    for suite in suites:
        for key in counts:
            counts[key] += int(suite.get(key, 0) or 0)
        for case in suite.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                if len(failing) < limit:
                    failing.append(f"{case.get('classname', '')}::{case.get('name', '')}")
    return counts, failing


def unit(ctx: CiContext) -> str:
    """``make lint test-fast`` in the workspace with the runner's virtualenv (``SETUP=``: no venv of
    its own) and ``--junitxml``; the reduced profile gives pytest only ``config.unit_paths``.
    Fails naming the first failing tests (or lint's last lines)."""
    ws, junit = ctx.workspace, ctx.artifacts / "junit-unit.xml"
    env = workspace_env(ctx)
    which = _run(ctx, "unit", [Path(ctx.config.venv) / "bin" / "python", "-c",
                               "import apiary, sys; sys.stdout.write(apiary.__file__)"], cwd=ws, env=env)
    if not which.stdout.startswith(str(ws)):
        raise StageFailed(f"import apiary resolves to {which.stdout or which.stderr[-200:]}, not the workspace")
    pytest_args = [f"--junitxml={junit}", "-p", "no:cacheprovider"]
    if ctx.config.reduced:
        pytest_args += list(ctx.config.unit_paths)
    argv = ["make", "-C", ws, "--no-print-directory", f"VENV={ctx.config.venv}", "SETUP=",
            f"PYTEST_ARGS={' '.join(pytest_args)}", "lint", "test-fast"]
    proc = _run(ctx, "unit", argv, cwd=ws, env=env, timeout=TIMEOUTS["unit"])
    counts, failing = junit_summary(junit)
    ctx.data["unit"] = counts
    if proc.returncode != 0:
        if not junit.exists():
            last = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()][-3:]
            raise StageFailed(f"make lint failed: {' / '.join(last)}"[:1000], {"exit": proc.returncode})
        raise StageFailed(f"{counts['failures'] + counts['errors']} of {counts['tests']} unit tests failed: "
                          f"{', '.join(failing) or 'see unit.log'}"[:1000], {"counts": counts})
    return (f"lint clean; {counts['tests']} tests, {counts['skipped']} skipped"
            f"{' (reduced profile: ' + ', '.join(ctx.config.unit_paths) + ')' if ctx.config.reduced else ''}")


# -- image --------------------------------------------------------------------------------------


def docker() -> Any:
    from apiary.images.daemons import docker_client

    return docker_client()


def image(ctx: CiContext) -> str:
    """Apiary's images from the workspace (``apiary/{python,control-plane,agent,prefect}``), tagged
    with the sha's first 12 digits, pushed to ``config.registry``."""
    from apiary.ci.containers import PlatformImages
    from apiary.images.build import BASE_IMAGE, build_base, build_platform

    registry = ctx.config.registry
    if not registry:
        raise StageFailed("no registry configured (APIARY_CI_REGISTRY)")
    client = docker()
    try:
        client.images.get(BASE_IMAGE)
    except Exception:  # docker.errors.ImageNotFound: build the local base once per machine
        ctx.log.info("building %s with debootstrap (once per machine)", BASE_IMAGE)
        build_base(client)
    tag = ctx.commit.sha[:12]
    built = build_platform(client, registry, tag, repo=ctx.workspace)
    ctx.data["images"] = PlatformImages.from_registry(registry, tag)
    (ctx.artifacts / "images.json").write_text(json.dumps(built, indent=1))
    return f"pushed {', '.join(b.rsplit('/', 1)[-1] for b in built)} to {registry}"


# -- staging ------------------------------------------------------------------------------------


def staging(ctx: CiContext) -> str:
    """A staging platform from the commit's images: control plane + agent containers, Lab 6's
    two-VC cluster, its own port and home (hence its own SQLite store and tokens), torn down after
    the last stage whatever happened. Fails when a health gate (``/healthz``, every node ready)
    is not met, naming it and the container's last log lines."""
    from apiary.ci.containers import ContainerPlatform
    from apiary.tracking.prefect_server import free_port

    images = ctx.data.get("images")
    if images is None:
        raise StageFailed("no images from the image stage")
    name = f"staging-{ctx.commit.short}-{os.getpid()}"
    home = Path(ctx.config.workdir) / name
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    platform = ContainerPlatform(docker(), name, home, free_port(),
                                 cluster_config=ctx.workspace / STAGING_CLUSTER)
    ctx.defer(f"staging platform {name} torn down", lambda: _teardown(ctx, platform, home))
    try:
        platform.start(images)
    except Exception as exc:  # a component that does not start: the gates below say which and why
        ctx.log.warning("staging start raised %s: %s", type(exc).__name__, exc)
    for gate in (platform.gate_healthz(120), platform.gate_agents(120)):
        ctx.log.info("gate %s ok=%s %s", gate.gate, gate.ok, gate.detail[:500])
        if not gate.ok:
            raise StageFailed(f"staging {gate.gate} gate failed: {gate.detail}"[:1500])
    ctx.data["staging"] = platform
    return f"{name} up at {platform.url} ({images.control_plane.rsplit('/', 1)[-1]})"


def _teardown(ctx: CiContext, platform: Any, home: Path) -> None:
    for component in ("control-plane", "agent"):
        try:
            (ctx.artifacts / f"staging-{component}.log").write_text(platform.logs(component, 2000))
        except Exception:  # the container may never have started
            pass
    platform.teardown()
    shutil.rmtree(home, ignore_errors=True)


def _staging(ctx: CiContext) -> Any:
    platform = ctx.data.get("staging")
    if platform is None:
        raise StageFailed("no staging platform")
    return platform


# -- integration --------------------------------------------------------------------------------


def integration(ctx: CiContext) -> str:
    """The workspace's end-to-end suite for a running platform (``tests/staging``: health, tokens,
    a Lab 6 job and its logs, Lab 6 scenarios 1-3) pointed at staging through
    ``APIARY_STAGING_URL`` / ``APIARY_STAGING_TOKEN``; JUnit XML kept."""
    platform = _staging(ctx)
    junit = ctx.artifacts / "junit-integration.xml"
    env = workspace_env(ctx, APIARY_STAGING_URL=platform.url, APIARY_STAGING_TOKEN=platform.admin_token())
    argv = [Path(ctx.config.venv) / "bin" / "python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
            "tests/staging", f"--junitxml={junit}"]
    proc = _run(ctx, "integration", argv, cwd=ctx.workspace, env=env, timeout=TIMEOUTS["integration"])
    counts, failing = junit_summary(junit)
    if proc.returncode != 0 or counts["tests"] == 0:
        raise StageFailed(f"{counts['failures'] + counts['errors']} of {counts['tests']} integration tests failed: "
                          f"{', '.join(failing) or (proc.stdout + proc.stderr)[-300:]}"[:1000], {"counts": counts})
    return f"{counts['tests']} integration tests passed against {platform.url}"


# -- load ---------------------------------------------------------------------------------------


def load(ctx: CiContext) -> str:
    """The workspace's Locust smoke profile (``loadtests/smoke.py``) and its gates against staging."""
    from apiary.load.runner import run_load

    platform = _staging(ctx)
    result = run_load(platform.url, platform.admin_token(), profile="smoke", out_dir=ctx.artifacts / "load",
                      plots=False, loadtests_dir=ctx.workspace / "loadtests")
    rows = [r.to_dict() for r in result.rows]
    (ctx.artifacts / "load-gates.json").write_text(json.dumps(rows, indent=1, default=str))
    failed = [r for r in result.rows if not r.passed]
    if failed:
        raise StageFailed("load gates missed: " + "; ".join(f"{r.endpoint} {r.metric} {r.measured} (want {r.threshold})"
                                                            for r in failed[:3]))
    return f"smoke profile: {len(result.rows)} gates met, {result.users} users, {result.duration_s:g} s"


# -- chaos --------------------------------------------------------------------------------------


def chaos(ctx: CiContext) -> str:
    """The chaos experiments for CI (``config.chaos``, files in the workspace's ``chaos/``) against
    staging, each judged from its journal (:func:`apiary.chaos.runner.run_experiment`). The
    experiments' home is the staging platform's (its probes check that the URL answers as that
    platform's cluster), never the CI runner's own ``APIARY_HOME``."""
    from apiary.chaos.runner import run_experiment

    platform = _staging(ctx)
    verdicts = []
    for name in ctx.config.chaos:
        v = run_experiment(ctx.workspace / "chaos" / f"{name}.json", api_url=platform.url,
                           token=platform.admin_token(), home=platform.home, journal_dir=ctx.artifacts / "chaos",
                           timeout_s=420)
        ctx.log.info("chaos %s passed=%s %s", name, v.passed, "; ".join(v.reasons))
        verdicts.append(v)
    bad = [v for v in verdicts if not v.passed]
    if bad:
        raise StageFailed("; ".join(f"{v.name}: {', '.join(v.reasons)[:300]}" for v in bad))
    return f"{len(verdicts)} experiment(s) held: {', '.join(v.name for v in verdicts)}"


# -- regression ---------------------------------------------------------------------------------


def base_commit(ctx: CiContext) -> str | None:
    """The commit the change is compared with, in the workspace's repository: for a pull request
    with a ``base_ref``, the merge base of HEAD and that branch (fetched from origin); otherwise,
    or when that fails, HEAD's first parent. None for a root commit."""
    git: list[object] = ["git", "-C", ctx.workspace]
    if ctx.commit.base_ref and not ctx.commit.base_ref.startswith("-"):
        if _run(ctx, "regression", [*git, "fetch", "--quiet", "origin", "--", ctx.commit.base_ref]).returncode == 0:
            proc = _run(ctx, "regression", [*git, "merge-base", "HEAD", "FETCH_HEAD"])
            if proc.returncode == 0 and SHA_RE.fullmatch(proc.stdout.strip()):
                return proc.stdout.strip()
    proc = _run(ctx, "regression", [*git, "rev-parse", "--verify", "--quiet", "HEAD^"])
    head = proc.stdout.strip()
    return head if proc.returncode == 0 and SHA_RE.fullmatch(head) else None


def bench_once(ctx: CiContext, tree: Path, out: Path) -> dict[str, Any]:
    """``bench/run.py --quick --only scheduler`` in the checkout ``tree`` (no thresholds: the
    stage judges the pair); its results document. Raises RuntimeError when it cannot run."""
    empty = ctx.artifacts / "no-thresholds.yaml"
    empty.write_text("{}\n")
    argv = [Path(ctx.config.venv) / "bin" / "python", "bench/run.py", "--quick", "--only", "scheduler",
            "--out", out, "--thresholds", empty]
    proc = _run(ctx, "regression", argv, cwd=tree, env=workspace_env(ctx, root=tree), timeout=TIMEOUTS["regression"])
    if proc.returncode != 0 or not out.is_file():
        lines = (proc.stdout + proc.stderr).splitlines()
        raise RuntimeError(f"bench/run.py in {tree.name} could not run (exit {proc.returncode}): "
                           f"{' / '.join(lines[-3:])}")
    return dict(json.loads(out.read_text()))


def regression(ctx: CiContext) -> str:
    """The quick scheduler benchmark of the change against its base commit (:func:`base_commit`),
    both measured here, interleaved, and judged by the ratio of their medians
    (:mod:`apiary.ci.paired`), not against absolute targets: a busy machine slows both alike. The
    base is checked out beside the workspace (a git worktree, removed at the end); the results
    go to ``<artifacts>/bench-paired.json``. A change more than :data:`apiary.ci.paired.TOLERANCE`
    times worse fails the stage, naming the metrics. Passes, saying so, when there is no base
    commit or the base has no benchmark to run."""
    base = base_commit(ctx)
    if base is None:
        return "no base commit to compare with: the benchmark was not judged"
    tree = ctx.workspace.parent / f"{ctx.workspace.name}-base"
    shutil.rmtree(tree, ignore_errors=True)
    git: list[object] = ["git", "-C", ctx.workspace]
    if _run(ctx, "regression", [*git, "worktree", "add", "--detach", "--force", tree, base]).returncode != 0:
        raise RuntimeError(f"cannot check out the base commit {base[:12]}")
    try:
        if not (tree / "bench" / "run.py").is_file():
            return f"the base commit {base[:12]} has no bench/run.py: the benchmark was not judged"
        counter = {"base": 0, "change": 0}

        def measure(side: str, root: Path) -> dict[str, Any]:
            counter[side] += 1
            return bench_once(ctx, root, ctx.artifacts / f"bench-{side}-{counter[side]}.json")

        base_runs, change_runs = paired.measure_interleaved(lambda: measure("base", tree),
                                                            lambda: measure("change", ctx.workspace))
    finally:
        _run(ctx, "regression", [*git, "worktree", "remove", "--force", tree])
        shutil.rmtree(tree, ignore_errors=True)
    verdict = paired.judge(base_runs, change_runs)
    (ctx.artifacts / "bench-paired.json").write_text(
        json.dumps({"base": base, "change": ctx.data.get("head", ctx.commit.sha), **verdict.to_dict()}, indent=1))
    if not verdict.comparisons:
        raise StageFailed(f"benchmark: no metric measured on both the change and base {base[:8]}")
    if not verdict.ok:
        raise StageFailed(f"benchmark regression against base {base[:8]}: {verdict.summary()}")
    return f"no regression against base {base[:8]}: {verdict.summary()}"


# -- report -------------------------------------------------------------------------------------


def commit_status(report: PipelineReport, context: str) -> dict[str, Any]:
    """GitHub's status-API body: ``state`` (success/failure/error), ``context``, ``description``,
    ``target_url`` (the flow run's page). Source: docs.github.com "Create a commit status"."""
    return {"state": report.result, "context": context, "description": report.description(),
            "target_url": report.target_url}


def post_status(config: Any, repo: str, sha: str, body: dict[str, Any]) -> int | None:
    """POST ``body`` to ``config.status_url`` (``{repo}``, ``{sha}`` filled in); the HTTP status,
    None when no URL is configured. Raises httpx.HTTPError when the receiver cannot be reached."""
    if not config.status_url:
        return None
    url = config.status_url.format(repo=repo, sha=sha)
    headers = {"Accept": "application/vnd.github+json"}
    if config.status_token:
        headers["Authorization"] = f"Bearer {config.status_token}"
    resp = httpx.post(url, json=body, headers=headers, timeout=30)
    return resp.status_code


def report(ctx: CiContext) -> str:
    """``report.md`` / ``report.json`` in the artifacts and the commit status posted."""
    rep: PipelineReport = ctx.data["report"]
    (ctx.artifacts / "report.md").write_text(rep.markdown())
    (ctx.artifacts / "report.json").write_text(json.dumps(rep.to_dict(), indent=1, default=str))
    body = commit_status(rep, ctx.config.context)
    (ctx.artifacts / "status.json").write_text(json.dumps(body, indent=1))
    code = post_status(ctx.config, ctx.commit.repo, ctx.commit.sha, body)
    if code is not None and code >= 300:
        raise RuntimeError(f"the commit status was refused: HTTP {code}")
    posted = f"status {body['state']} posted (HTTP {code})" if code else "no status URL configured"
    return f"{rep.result}: {rep.description()}; {posted}"


#: The implementations, by stage name.
STAGE_FUNCS: dict[str, Stage] = {
    "checkout": checkout, "unit": unit, "image": image, "staging": staging, "integration": integration,
    "load": load, "chaos": chaos, "regression": regression, "report": report,
}
