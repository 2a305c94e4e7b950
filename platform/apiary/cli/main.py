"""``apiary``: run the embedded platform and work with jobs and nodes.

The platform is found through ``APIARY_API_URL`` or the URL ``apiary up`` recorded in
``APIARY_HOME`` (default ``~/.apiary``). Errors print the server's message and exit 1
(2 for usage errors, as typer does).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from apiary.cli.aiops import aiops_app
from apiary.cli.ca import ca_app
from apiary.cli.chaos import chaos_app
from apiary.cli.ci import ci_app
from apiary.cli.common import api_client, err, fail, settings, setup_logging
from apiary.cli.deploy import deploy_app
from apiary.cli.hollow import hollow_nodes
from apiary.cli.hosts import hosts_app
from apiary.cli.identity import add_identity_commands
from apiary.cli.image import image_app
from apiary.cli.incident import incident_app, oncall_command
from apiary.cli.jobopen import add_job_open_command
from apiary.cli.jobssh import add_job_ssh_command
from apiary.cli.join import agent_join, bootstrap_token_app
from apiary.cli.load import load_app
from apiary.cli.model import model_app
from apiary.cli.rollout import add_rollout_commands
from apiary.cli.sim import sim_app
from apiary.cli.storage import storage_app
from apiary.cli.tables import COMPACT, folded, print_rows, uncut, when, word
from apiary.cli.template import template_app
from apiary.errors import ApiaryError, PortInUseError
from apiary.procutil import use_private_umask

if TYPE_CHECKING:
    from apiary.client import ApiaryClient
    from apiary.settings import Settings

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Apiary: multi-tenant GPU cluster platform.")
job_app = typer.Typer(no_args_is_help=True, help="Submit and watch jobs (OpenPAI job protocol v2).")
node_app = typer.Typer(no_args_is_help=True, help="Nodes and their agents.")
cluster_app = typer.Typer(no_args_is_help=True, help="Cluster and virtual-cluster status.")
demo_app = typer.Typer(no_args_is_help=True, help="Demonstrations on a fresh embedded platform.")
app.add_typer(job_app, name="job")
app.add_typer(node_app, name="node")
node_app.add_typer(bootstrap_token_app, name="bootstrap-token")
app.add_typer(cluster_app, name="cluster")
app.add_typer(demo_app, name="demo")
app.add_typer(sim_app, name="sim")
add_rollout_commands(deploy_app)  # `apiary deploy rollback` (apiary.ci.rollout)
app.add_typer(deploy_app, name="deploy")
app.add_typer(image_app, name="image")
app.add_typer(chaos_app, name="chaos")
app.add_typer(load_app, name="load")
app.add_typer(ci_app, name="ci")
app.add_typer(incident_app, name="incident")
app.add_typer(aiops_app, name="aiops")
app.add_typer(hosts_app, name="hosts")
app.add_typer(ca_app, name="ca")
app.add_typer(storage_app, name="storage")
app.add_typer(model_app, name="model")
app.add_typer(template_app, name="template")
app.command("hollow-nodes")(hollow_nodes)
app.command("oncall")(oncall_command)
add_identity_commands(app, lambda token=None: _client(token), lambda e: _fail(e))
add_job_ssh_command(job_app, lambda: _client(), lambda e: _fail(e), lambda: _settings().home_dir)
add_job_open_command(job_app, lambda: _client(), lambda: _settings().resolved_token(), lambda e: _fail(e))
console = Console()


def _settings() -> Settings:
    return settings()


def _client(token: str | None = None) -> ApiaryClient:
    """The platform's client (:func:`apiary.cli.common.api_client`); tests replace it here."""
    return api_client(token)


def _logging(verbose: bool = False) -> None:
    setup_logging(verbose)


def _fail(e: ApiaryError) -> None:
    fail(e)


# ---------------------------------------------------------------------- platform
@app.command()
def up(
    cluster: Path | None = typer.Option(None, "--cluster", help="HiveD cluster config (bare or OpenPAI-wrapped)."),
    port: int = typer.Option(8470, help="Control-plane API port on 127.0.0.1."),
    prefect: bool = typer.Option(True, "--prefect/--no-prefect", help="Start a Prefect server, UI and bridge."),
    monitoring: bool = typer.Option(
        False, "--monitoring", help="Also start Prometheus and Alertmanager with deploy/'s config (if installed)."
    ),
    runtime: str = typer.Option(
        "process", help="Task runtime: process, or docker (starts dockerd if needed and a registry on loopback)."
    ),
    prefect_port: int | None = typer.Option(
        None, "--prefect-port", min=1, max=65535,
        help="Prefect server and UI port on 127.0.0.1 (default: the one this APIARY_HOME used before, "
             "else a free one, remembered).",
    ),
    simulated_gpus: bool = typer.Option(
        False, "--simulated-gpus",
        help="Simulate every node's GPUs even where NVML answers (default: this host's node uses its real "
             "GPUs when NVML sees at least the cluster config's count).",
    ),
) -> None:
    """Start the embedded platform and keep it up until Ctrl-C (one per APIARY_HOME)."""
    from apiary.embedded import Embedded, HomeInUseError

    use_private_umask()  # the home holds the jobs' secrets: 0700, its files 0600
    _logging()
    settings = _settings()
    if cluster is None and not settings.cluster_path.exists():
        cluster = Path(__file__).resolve().parents[3] / "examples/lab6/hived-config-two-vcs.yaml"
    platform = Embedded(home=settings.home_dir, cluster=cluster, api_port=port, prefect=prefect, monitoring=monitoring,
                        runtime=runtime, drill_schedules=True, prefect_port=prefect_port,
                        simulated_gpus=True if simulated_gpus else None, mlflow=True)
    stopping = {"flag": False}

    def _term(*_):
        stopping["flag"] = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    try:
        platform.start()
        console.print(f"Apiary API:  {platform.api_url}   (docs: {platform.api_url}/docs)")
        if platform.ui_url:
            console.print(f"Prefect UI:  {platform.ui_url}   (jobs are flow runs of flow 'apiary-job'; it asks "
                          f"for the password in {settings.home_dir / 'credentials' / 'prefect-auth'})")
        if platform.registry is not None:
            console.print(f"Registry:    {platform.registry.url}   (apiary image build-base; apiary image build mnist; "
                          f"image map: {settings.home_dir / 'image-map.yaml'})")
        if platform.mlflow_server is not None:
            console.print(f"MLflow:      {platform.mlflow_server.url}   (the model registry: apiary model list; "
                          f"its UI and API take an Apiary token as Authorization: Bearer)")
        else:
            console.print("MLflow:      not installed (make setup makes .venv-mlflow); no model registry")
        if platform.prometheus_url:
            console.print(f"Prometheus:  {platform.prometheus_url}   Alertmanager: {platform.alertmanager_url}")
        console.print(f"GPUs:        {platform.gpu_note}", markup=False, highlight=False)
        console.print(f"Admin token: {settings.token_path}   (the CLI uses it; apiary user / group / token)")
        console.print(f"State:       {settings.home_dir}   Ctrl-C stops.")
        platform.supervise()
    except HomeInUseError as e:
        err.print(f"[red]error[/red]: {e.message}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    except PortInUseError as e:
        flag = "--prefect-port" if prefect_port is not None and e.port == prefect_port else "--port"
        err.print(f"[red]error[/red]: {e.message}; use {flag} N", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    except ApiaryError as e:
        platform.stop()
        _fail(e)
    except KeyboardInterrupt:
        console.print("stopping...")
    finally:
        platform.stop()


@app.command("control-plane")
def control_plane(port: int = typer.Option(8470), host: str = typer.Option(
        "127.0.0.1", help="Address to listen on (the host's own address, or 0.0.0.0, on many machines).")) -> None:
    """Run a control-plane replica (apiary up starts one; on many machines, one per control-plane host: README,
    "Running on many machines"). HTTPS with APIARY_TLS_CERT and APIARY_TLS_KEY."""
    from apiary.wiring import serve

    use_private_umask()  # the store, its WAL and the task logs hold the jobs' secrets
    _logging()
    serve(_settings(), host=host, port=port)


agent_app = typer.Typer(
    invoke_without_command=True, no_args_is_help=False,
    help="Run node agents (apiary agent --api URL --node NODE), or join a node first (apiary agent join).")
agent_app.command("join")(agent_join)
app.add_typer(agent_app, name="agent")


@agent_app.callback()
def agent(
    ctx: typer.Context,
    api: str | None = typer.Option(
        None, help="Control-plane URL; several replicas comma-separated (https://cp1:8470,https://cp2:8470)."),
    node: list[str] = typer.Option([], help="Node(s) this process is the agent of."),
    all_nodes: bool = typer.Option(False, "--all-nodes", help="Be the agent of every node in the cluster config."),
    simulated_gpus: bool = typer.Option(False, "--simulated-gpus", help="Advertise the config's GPUs (no driver)."),
    nvml_node: list[str] = typer.Option(
        [], "--nvml-node", help="With --simulated-gpus: node(s) that read their real GPUs through NVML all the same."
    ),
    state_dir: Path = typer.Option(Path("~/.apiary/agents")),
    credentials: Path | None = typer.Option(
        None, help="Directory of the nodes' agent-<node>.token files (default APIARY_HOME/credentials; "
                   "apiary agent join writes them)."
    ),
    ca_cert: Path | None = typer.Option(
        None, "--ca-cert", help="The platform CA (PEM) the control plane's HTTPS is verified against "
                                "(default APIARY_CA_CERT)."),
    workdir: str | None = typer.Option(None, help="Working directory of tasks (process backend)."),
    metrics_ports: str | None = typer.Option(
        None, help='Serve each node\'s /metrics: JSON {"node": port} (0 = any free port), or "auto".'
    ),
    runtime: str = typer.Option("process", help="Task runtime: process, docker or kubernetes."),
    image_map: Path | None = typer.Option(
        None, help="YAML public image name -> registry image (docker runtime; default: the shipped map)."
    ),
    registry: str | None = typer.Option(None, help="The platform registry's host:port ({registry} in the map)."),
    metrics_host: str = typer.Option("127.0.0.1", help="Address /metrics binds to (0.0.0.0 in a pod)."),
    metrics_cert: Path | None = typer.Option(
        None, "--metrics-cert", help="This node's serving certificate (PEM; apiary agent join writes node.crt): "
                                     "/metrics and /healthz over HTTPS only. Needs --metrics-key."),
    metrics_key: Path | None = typer.Option(
        None, "--metrics-key", help="The key of --metrics-cert (PEM, 0600; node.key)."),
    self_fence: bool | None = typer.Option(
        None, "--self-fence/--no-self-fence",
        help="Stop this node's tasks when no control plane answered for most of the node-lost grace "
             "(default: on unless every --api URL is loopback)."),
) -> None:
    """Run node agents (apiary up starts them; on other hosts, after apiary agent join).
    SIGTERM stops them and their tasks."""
    if ctx.invoked_subcommand is not None:
        return
    if not api:
        err.print("--api is required: the control plane's URL (several replicas comma-separated).")
        raise typer.Exit(2)
    if (metrics_cert is None) != (metrics_key is None):
        err.print("--metrics-cert and --metrics-key go together: the serving certificate and its key.")
        raise typer.Exit(2)
    metrics_tls = (metrics_cert.expanduser(), metrics_key.expanduser()) if metrics_cert and metrics_key else None
    import time

    from apiary.auth.bootstrap import read_token
    from apiary.client import ApiaryClient, http_verify
    from apiary.runtime.agent import metrics_ssl_context, run_agents

    if metrics_tls is not None:
        try:
            metrics_ssl_context(*metrics_tls)  # a missing or mismatched file fails before anything starts
        except ApiaryError as e:
            err.print(f"[red]error[/red] ({e.status_code}): {e.message}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from e

    use_private_umask()  # launch records, scripts and task output hold the jobs' secrets
    _logging()
    creds = (credentials or _settings().credentials_dir).expanduser()
    ca = ca_cert or _settings().ca_cert
    tokens = {p.name[len("agent-"):-len(".token")]: read_token(p) or "" for p in creds.glob("agent-*.token")}
    any_token = next(iter(tokens.values()), "")
    inventory = {}
    try:
        client = ApiaryClient(api, timeout=5, token=any_token or None, ca_cert=ca)
    except ApiaryError as e:  # a token over plain HTTP off loopback, a malformed URL
        err.print(f"[red]error[/red] ({e.status_code}): {e.message}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from e
    for _ in range(100):
        try:
            inventory = {n["name"]: n["gpus"] for n in client.nodes()}
            break
        except ApiaryError:
            time.sleep(0.2)
    client.close()
    unknown = sorted(set(node) - set(inventory))
    if unknown and inventory:
        err.print(f"node(s) {', '.join(unknown)} are not in the control plane's cluster config")
        raise typer.Exit(1)
    nodes = inventory if all_nodes else {n: inventory[n] for n in node if n in inventory}
    images = None
    if runtime == "docker":
        from apiary.images import imagemap

        images = imagemap.load(image_map.expanduser() if image_map else None, registry)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        ports = None
        if metrics_ports == "auto":
            ports = dict.fromkeys(nodes, 0)
        elif metrics_ports:
            ports = json.loads(metrics_ports)
        real = {n: g for n, g in nodes.items() if not simulated_gpus or n in nvml_node}
        groups = [(real, False), ({n: g for n, g in nodes.items() if n not in real}, True)]
        await asyncio.gather(*(
            run_agents(
                api, group, state_dir.expanduser(), simulated_gpus=simulated, workdir=workdir, stop=stop,
                kill_tasks_on_exit=True, metrics_ports=ports, tokens=tokens, runtime=runtime, image_map=images,
                metrics_host=metrics_host, verify=http_verify(ca), self_fence=self_fence,
                node_lost_after_s=_settings().node_lost_after_s, metrics_tls=metrics_tls,
                heartbeat_s=_settings().agent_heartbeat_s, long_poll_s=_settings().agent_long_poll_s,
            )
            for group, simulated in groups if group
        ))

    asyncio.run(main())


@app.command("prefect-bridge", hidden=True)
def prefect_bridge(
    api: str = typer.Option(...),
    prefect_api: str = typer.Option(...),
    state: Path = typer.Option(...),
    concurrency: int = typer.Option(2, min=1, max=64, help="Jobs written to Prefect at once."),
    catch_up_concurrency: int | None = typer.Option(
        None, min=1, max=64, help="Jobs written at once while behind (default: --concurrency)."),
) -> None:
    """Mirror Apiary's jobs into Prefect flow runs (started by apiary up)."""
    from apiary.tracking.bridge import run_bridge

    use_private_umask()
    _logging()
    asyncio.run(run_bridge(api, prefect_api, state, concurrency=concurrency, catch_up_concurrency=catch_up_concurrency))


# ---------------------------------------------------------------------- jobs
@job_app.command("submit")
def job_submit(
    file: Path = typer.Argument(..., exists=True, dir_okay=False, help="OpenPAI job protocol v2 YAML."),
) -> None:
    """Submit a job as the logged-in user (apiary login); prints its id, user~name."""
    try:
        job = _client().submit(file.read_text())
    except ApiaryError as e:
        _fail(e)
    print(job["id"])  # plain: scripts read it, and rich would fold an id longer than the terminal


@job_app.command("get")
def job_get(job_id: str, as_json: bool = typer.Option(False, "--json", help="Print the job as JSON.")) -> None:
    """Show one job."""
    try:
        job = _client().get(job_id)
    except ApiaryError as e:
        _fail(e)
    if as_json:
        print(json.dumps(job, indent=2))
        return
    print_job(job)


def retries_text(details: dict | None) -> str:
    """A job's ``retryDetails`` ({"user": 1, "platform": 2}) as ``user 1, platform 2``; ``-`` when absent."""
    return ", ".join(f"{k} {v}" for k, v in (details or {}).items()) or "-"


def print_job(job: dict) -> None:
    """One job (``GET /api/v2/jobs/{id}``) in the terminal's width, in the tables' style
    (:func:`~apiary.cli.tables.print_rows`): the job's row (the id never cut, the waiting reason
    beside it or under it), then its tasks; a node of simulated GPUs is marked so."""
    print_rows(console, ("id", "state", "vc", "priority", "retries"),
               [(job["id"], job["state"], job["virtualCluster"], job["priorityClass"],
                 retries_text(job.get("retryDetails")))],
               sentence="waiting reason", sentences=[job.get("waitingReason") or ""])
    tasks = job.get("tasks") or []
    if not tasks:
        return
    rows = []
    for task in tasks:
        code = task["exitCode"]
        node = (task["node"] or "-") + (" (simulated GPUs)" if task.get("simulatedGpus") else "")
        rows.append((f"{task['taskRole']}/{task['index']}", task["state"], node,
                     ",".join(map(str, task["gpus"])) or "-", "-" if code is None else str(code)))
    console.print()
    print_rows(console, ("task", "state", "node", "gpus", "exit code"), rows)
    mounts = job.get("storage") or []
    if mounts or job.get("storageError"):
        # Where the tasks' outputs go: the storage they mount (apiary storage ls CONFIG:PATH lists it).
        console.print()
        if mounts:
            print_rows(console, ("storage", "mounted at", "server:path", "permission"),
                       [(m["config"], m["mountPoint"], f"{m['server']}:{m['path'] or '/'}", m["permission"])
                        for m in mounts])
        if job.get("storageError"):
            console.print(f"storage: {job['storageError']}", markup=False, highlight=False)
    runs = job.get("mlflowRuns") or []
    if runs:  # its MLflow runs (apiary model get NAME/VERSION shows a model's run and job)
        console.print()
        print_rows(console, ("mlflow run", "status", "task", "metrics", "link"),
                   [(r["runId"], r.get("status") or "-", (r.get("tags") or {}).get("apiary.task", "-"),
                     " ".join(f"{k}={v:.4g}" for k, v in sorted((r.get("metrics") or {}).items())[:4]) or "-",
                     r.get("url") or "-") for r in runs])


@job_app.command("list")
def job_list(
    as_json: bool = typer.Option(False, "--json", help="Print the jobs as JSON."),
    user: str | None = typer.Option(None, "--user", help="Only this user's jobs."),
    vc: str | None = typer.Option(None, "--vc", help="Only jobs in this virtual cluster."),
    state: str | None = typer.Option(None, "--state", help="Only jobs in this state (WAITING, RUNNING, ...)."),
) -> None:
    """List jobs."""
    try:
        jobs = _client().list(username=user, virtualCluster=vc, state=state)
    except ApiaryError as e:
        _fail(e)
    if as_json:
        print(json.dumps(jobs, indent=2))
        return
    print_rows(console, ("id", "state", "vc", "priority", "retries"),
               [(j["id"], j["state"], j["virtualCluster"], j["priorityClass"], str(j["retries"])) for j in jobs],
               sentence="waiting reason", sentences=[j["waitingReason"] or "" for j in jobs])


@job_app.command("logs")
def job_logs(
    job_id: str,
    task: str | None = typer.Option(None, "--task", help="ROLE/INDEX, default the first role's instance 0."),
    stream: str = typer.Option("stdout", "--stream", help="stdout, stderr or all."),
    attempt: int | None = typer.Option(None, "--attempt", help="Only this attempt (default: all, oldest first)."),
) -> None:
    """Print a task instance's log."""
    role, index = None, 0
    if task:
        role, _, idx = task.partition("/")
        index = int(idx or 0)
    try:
        sys.stdout.write(_client().logs(job_id, role, index, stream, attempt))
    except ApiaryError as e:
        _fail(e)


@job_app.command("stop")
def job_stop(job_id: str) -> None:
    """Stop a job (OpenPAI executionType STOP)."""
    try:
        job = _client().stop(job_id)
    except ApiaryError as e:
        _fail(e)
    console.print(f"{job['id']} {job['state']} (stop requested)")


@job_app.command("wait")
def job_wait(job_id: str, timeout: float | None = typer.Option(None, "--timeout", help="Seconds.")) -> None:
    """Wait for a job to finish; exit 0 only if it SUCCEEDED."""
    try:
        job = _client().wait(job_id, timeout=timeout)
    except TimeoutError as e:
        err.print(str(e))
        raise typer.Exit(2) from e
    except ApiaryError as e:
        _fail(e)
    console.print(f"{job['id']} {job['state']} exitCode={job['exitCode']}")
    raise typer.Exit(0 if job["state"] == "SUCCEEDED" else 1)


# ---------------------------------------------------------------------- nodes / cluster
@node_app.command("list")
def node_list(as_json: bool = typer.Option(False, "--json", help="Print the nodes as JSON.")) -> None:
    """List nodes; simulated GPUs are marked, and the cordoned column names who holds a cordon on each."""
    try:
        nodes = _client().nodes()
    except ApiaryError as e:
        _fail(e)
    if as_json:
        print(json.dumps(nodes, indent=2))
        return
    print_rows(console, ("name", "gpus", "used", "simulated GPUs", "healthy", "sku"),
               [(n["name"], str(n["gpus"]), str(n["gpusUsed"]), _simulated(n), str(n["healthy"]), n["skuType"])
                for n in nodes],
               sentence="cordoned", sentences=[cordon_sources(n) for n in nodes])


def _simulated(n: dict) -> str:  # the header says what "yes" means; "-": the agent has not said
    return "yes" if n["simulatedGpus"] else ("no" if n["simulatedGpus"] is False else "-")


def cordon_sources(node: dict) -> str:
    """Who holds a cordon on ``node`` (a ``GET /api/v2/nodes`` entry): ``admin, drill:stress``;
    ``no`` when none (``yes`` from a server that lists no sources)."""
    sources = [c["source"] for c in node.get("cordons") or []]
    return ", ".join(sources) or ("yes" if node.get("cordoned") else "no")


@node_app.command("get")
def node_get(node: str, as_json: bool = typer.Option(False, "--json", help="Print the node as JSON.")) -> None:
    """Show one node and each of its cordons: who set it, when, by whom and why."""
    try:
        n = _client().node(node)
    except ApiaryError as e:
        _fail(e)
    if as_json:
        print(json.dumps(n, indent=2))
        return
    print_rows(console, ("name", "gpus", "used", "simulated GPUs", "healthy", "schedulable", "sku"),
               [(n["name"], str(n["gpus"]), str(n["gpusUsed"]), _simulated(n), str(n["healthy"]),
                 str(n["schedulable"]), n["skuType"])])
    cordons = n.get("cordons") or []
    console.print()
    if not cordons:
        console.print(Text("not cordoned"))
        return
    print_rows(console, ("cordon", "since", "by"), [(c["source"], when(c["at"]), c["by"] or "-") for c in cordons],
               sentence="reason", sentences=[c["reason"] or "-" for c in cordons])


@node_app.command("fault")
def node_fault(
    node: str,
    gpu: int = typer.Option(..., "--gpu", help="GPU index on the node."),
    ecc_dbe: int | None = typer.Option(None, "--ecc-dbe", help="Add N double-bit ECC errors."),
    xid: int | None = typer.Option(None, "--xid", help="Raise XID error CODE."),
    temp: float | None = typer.Option(None, "--temp", help="Force the temperature (Celsius)."),
    row_remap_failure: bool = typer.Option(False, "--row-remap-failure", help="Fail the row remapper (no spare row)."),
    row_remap_pending: bool = typer.Option(False, "--row-remap-pending", help="Leave a row remap pending a reset."),
    retired_pages: int | None = typer.Option(None, "--retired-pages", help="Retire N more pages (DBE)."),
    throttle: str | None = typer.Option(None, "--throttle", help="Throttle the clocks: thermal, power or hw_slowdown."),
    pcie_gen: int | None = typer.Option(None, "--pcie-gen", help="Train the PCIe link at generation N."),
    pcie_width: int | None = typer.Option(None, "--pcie-width", help="Train the PCIe link at N lanes."),
    clear: bool = typer.Option(False, "--clear", help="Clear the GPU's injected faults."),
) -> None:
    """Inject a fault into a node's simulated GPU, like DCGM's error injection. The control plane
    checks the values (a 400 names the bad one); the node's agent applies the fault."""
    body = {"gpu": gpu, "eccDbe": ecc_dbe, "xid": xid, "temp": temp, "retiredPages": retired_pages,
            "throttle": throttle, "pcieGen": pcie_gen, "pcieWidth": pcie_width, "clear": clear,
            # flags: only when given, so that a fault of another kind does not unset them
            "rowRemapFailure": True if row_remap_failure else None,
            "rowRemapPending": True if row_remap_pending else None}
    try:
        fault = _client()._call("POST", f"/api/v2/nodes/{node}/faults", json=body).json()
    except ApiaryError as e:
        _fail(e)
    console.print(f"fault queued for {node}: {fault}")


@node_app.command("cordon")
def node_cordon(node: str, reason: str = typer.Option("", "--reason", help="Why (shown by node get).")) -> None:
    """Stop placing new tasks on NODE; running tasks keep going (like kubectl cordon). The cordon
    is the admin's: an alert's, an incident's or a drill's uncordon leaves it."""
    try:
        n = _client().cordon(node, True, reason=reason or None)
    except ApiaryError as e:
        _fail(e)
    console.print(Text(f"{n['name']} cordoned by {cordon_sources(n)}"))


@node_app.command("uncordon")
def node_uncordon(
    node: str,
    source: str = typer.Option("admin", "--source",
                               help="Whose cordon to remove: admin, alert:<name>, incident:<id>, drill:stress, ..."),
    every: bool = typer.Option(False, "--all", help="Remove every cordon, whoever set it."),
) -> None:
    """Remove the admin's cordon from NODE (or the --source's, or with --all every cordon); the node
    is schedulable again once no cordon is left."""
    try:
        n = _client().cordon(node, False, source=source, all=every)
    except ApiaryError as e:
        _fail(e)
    left = cordon_sources(n)
    console.print(Text(f"{n['name']} uncordoned" if left == "no" else f"{n['name']} still cordoned by {left}"))


@cluster_app.command("status")
def cluster_status(
    vc: str | None = typer.Option(None, "--vc", help="Only this virtual cluster."),
    as_json: bool = typer.Option(False, "--json", help="Print the whole view as JSON (with nodes and placements)."),
) -> None:
    """Scheduler view: virtual clusters' cells and the reservations held for preemptors.

    Per virtual cluster: quota, used, free, reserved, opportunistic, bad and doomed leaf cells.
    """
    try:
        status = _client().cluster_status(vc)
    except ApiaryError as e:
        _fail(e)
    if as_json:
        print(json.dumps(status, indent=2))
        return
    counts = ("quota", "used", "free", "reserved", "opportunisticUsed", "badCells", "doomedBadCells")
    print_rows(console, ("virtual cluster", "quota", "used", "free", "reserved", "opportunistic", "bad", "doomed"),
               [(name, *(str(v.get(k, "")) for k in counts)) for name, v in status["virtualClusters"].items()],
               title="Virtual clusters (leaf cells)")
    reservations = status.get("reservations") or {}
    if not reservations:
        console.print("No reservations.")
        return
    console.print("\nReservations (cells held for a preemptor)")
    r = Table(uncut("reserved for", list(reservations), console), word("priority"), folded("victims"),
              folded("cells"), **COMPACT)
    for group, res in reservations.items():
        r.add_row(group, str(res["priority"]), ", ".join(res["victims"]), ", ".join(res["cells"]))
    console.print(r)


@cluster_app.command("apply")
def cluster_apply(file: Path = typer.Argument(..., exists=True, dir_okay=False, help="HiveD config YAML.")) -> None:
    """Apply a changed cluster config with jobs running.

    Jobs that still fit keep running; the rest are retried, each with the reason.
    """
    try:
        result = _client().apply_cluster_config(file.read_text())
    except ApiaryError as e:
        _fail(e)
    print(json.dumps(result, indent=2))


# ---------------------------------------------------------------------- demo
@demo_app.command("lab6")
def demo_lab6(
    prefect: bool = typer.Option(True, "--prefect/--no-prefect", help="Also run Prefect and mirror the jobs."),
    sleep_s: int = typer.Option(4, "--sleep", help="Seconds that replace the jobs' 'sleep 5m' (documented override)."),
    keep: bool = typer.Option(False, "--keep", help="Keep the demo's state directory."),
    runtime: str = typer.Option("process", help="Task runtime: process, or docker (tasks as containers)."),
) -> None:
    """Run the AI-System Lab 6 scenarios on a fresh embedded platform; exit 0 only if all pass."""
    from apiary.demo.lab6 import run_demo

    logging.basicConfig(level=logging.WARNING)
    ok = run_demo(console, prefect=prefect, sleep_s=sleep_s, keep=keep, runtime=runtime)
    raise typer.Exit(0 if ok else 1)


if __name__ == "__main__":
    app()
