"""`lanes k8s watch`: Kueue workloads, JobSets and training jobs, pods and nodes on the timeline (lanes_k8s)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Annotated

import typer

from lanes_cli.console import EXIT_BAD_INPUT, err, fail, load_settings, require, run_async
from lanes_k8s.kubeconfig import KubeconfigError, resolve
from lanes_k8s.logs import PodLogs
from lanes_k8s.mapping import SOURCE
from lanes_k8s.watch import KubeApi, KubeWatch
from lanes_observe.outbox import Outbox, Sender
from lanes_runtime.service import stop_on_signals

CLUSTER_ROLE = "deploy/k8s/observer-clusterrole.yaml"
app = typer.Typer(
    help="Observe a Kubernetes cluster: Kueue workloads, their pods and nodes on the Lanes timeline.",
    no_args_is_help=True,
)


@app.command(
    epilog=(
        "Permissions: read only. The observer gets, lists and watches Kueue's workloads "
        "(kueue.x-k8s.io), pods, nodes and events, in every namespace or only in those given with "
        "--namespace; nodes are cluster-wide; --logs also reads pods/log. "
        f"The ClusterRole is {CLUSTER_ROLE} (bind it to the observer's service account with a "
        "ClusterRoleBinding, or with a RoleBinding per namespace for the namespaced kinds)."
    )
)
def watch(  # noqa: PLR0917 - typer passes each option as an argument
    namespace: Annotated[
        list[str] | None,
        typer.Option(
            "--namespace",
            "-n",
            help="Watch only this namespace (repeat for several); every namespace when not given. "
            "Nodes are always watched cluster-wide.",
        ),
    ] = None,
    kubeconfig: Annotated[
        Path | None,
        typer.Option(
            help="The kubeconfig to read (default: $KUBECONFIG, else ~/.kube/config; inside a pod, its "
            "service account). Tokens, client certificates and CAs are read; exec and auth-provider "
            "plugins are not run."
        ),
    ] = None,
    context: Annotated[str | None, typer.Option(help="The kubeconfig context (default: its current-context).")] = None,
    state_file: Annotated[
        Path,
        typer.Option(
            help="Where the resourceVersions and what was already published are kept: a restart resumes "
            "from it and publishes nothing twice."
        ),
    ] = Path("~/.cache/lanes/k8s/state.json"),
    outbox: Annotated[Path, typer.Option(help="Where events wait while Lanes is unreachable.")] = Path(
        "~/.cache/lanes/outbox/k8s.ndjson"
    ),
    logs: Annotated[
        bool,
        typer.Option(
            "--logs",
            help="Also follow each rank's pod log through the API (needs pods/log) and read it with the "
            "evidence parsers, at most --logs-rate lines per second per pod; skipped lines are counted as evidence.",
        ),
    ] = False,
    logs_rate: Annotated[float, typer.Option(min=0.1, max=100_000, help="Log lines read per second per pod.")] = 50.0,
) -> None:
    """List and watch the cluster; publish jobs, attempts, ranks, node states and evidence until Ctrl-C."""
    settings = load_settings()
    nats_url = require(settings.nats_url, "NATS_URL")
    try:
        access = resolve(kubeconfig.expanduser() if kubeconfig else None, context)
    except KubeconfigError as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    namespaces = tuple(dict.fromkeys(namespace or ()))

    async def observe() -> None:
        box = Outbox(outbox.expanduser())
        sender = Sender(box, nats_url, name=SOURCE)
        api = KubeApi(access)
        try:
            kube = KubeWatch(api, box, sender, namespaces=namespaces, state_file=state_file.expanduser())
        except ValueError as exc:
            fail(str(exc), EXIT_BAD_INPUT)
        scope = ", ".join(namespaces) if namespaces else "every namespace"
        err.print(f"watching {access.describe()} ({scope}); state in {state_file}", highlight=False)
        stop = stop_on_signals()
        try:
            if logs:
                await asyncio.gather(kube.run(stop), PodLogs(kube, lines_per_s=logs_rate).run(stop))
            else:
                await kube.run(stop)
        finally:
            with contextlib.suppress(asyncio.CancelledError):
                await sender.close()
                await api.close()

    try:
        run_async(observe)
    except KeyboardInterrupt:
        err.print("stopped")
