"""Where the API server is and how to authenticate: a kubeconfig file, or the pod's service account.

Supported: the server with its CA (file or inline data) or `insecure-skip-tls-verify`, a bearer token
(inline or `tokenFile`), client certificates (files or inline data), basic auth. Not supported: `exec` and
`auth-provider` credential plugins (cloud logins); the error says so and what to use instead (a service
account token, which is what an observer running in the cluster has anyway).
"""

from __future__ import annotations

import base64
import os
import ssl
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubeconfigError(ValueError):
    """The kubeconfig cannot be used: missing, malformed, or asking for what the observer does not support."""


@dataclass(frozen=True)
class ApiAccess:
    """The API server's address and what to send it."""

    server: str
    headers: Mapping[str, str] = field(default_factory=dict)
    ssl_context: ssl.SSLContext | None = None
    """None: plain HTTP (a test server) or the default verification."""
    context: str = ""

    def describe(self) -> str:
        """Where it points, for logs (never the credentials)."""
        return f"{self.server} (context {self.context})" if self.context else self.server


def _named(entries: Any, name: str, what: str) -> Mapping[str, Any]:
    for entry in entries or ():
        if isinstance(entry, Mapping) and entry.get("name") == name:
            body = entry.get(what)
            return body if isinstance(body, Mapping) else {}
    raise KubeconfigError(f"no {what} named {name!r} in the kubeconfig")


def _material(config_dir: Path, body: Mapping[str, Any], key: str) -> Path | None:
    """A file the SSL context can load: the path given, or the inline `<key>-data` written to a private file."""
    inline = body.get(f"{key}-data")
    if isinstance(inline, str) and inline:
        handle = tempfile.NamedTemporaryFile(prefix="lanes-k8s-", suffix=".pem", delete=False)  # noqa: SIM115 - kept for the SSL context
        with handle:
            handle.write(base64.b64decode(inline))
        return Path(handle.name)
    path = body.get(key)
    if isinstance(path, str) and path:
        resolved = Path(path).expanduser()
        return resolved if resolved.is_absolute() else config_dir / resolved
    return None


def from_kubeconfig(path: Path | None = None, context: str | None = None) -> ApiAccess:  # noqa: PLR0912 - one branch per kubeconfig field, in the file's order
    """Read a kubeconfig ($KUBECONFIG's first file or ~/.kube/config by default) for one context."""
    if path is None:
        first = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
        path = Path(first) if first else Path("~/.kube/config").expanduser()
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise KubeconfigError(f"cannot read the kubeconfig {path}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise KubeconfigError(f"the kubeconfig {path} is not YAML: {exc}") from exc
    if not isinstance(config, Mapping):
        raise KubeconfigError(f"the kubeconfig {path} is not a mapping")
    name = context or config.get("current-context")
    if not isinstance(name, str) or not name:
        raise KubeconfigError(f"no context: pass --context or set current-context in {path}")
    ctx = _named(config.get("contexts"), name, "context")
    cluster = _named(config.get("clusters"), str(ctx.get("cluster") or ""), "cluster")
    user = _named(config.get("users"), str(ctx.get("user") or ""), "user") if ctx.get("user") else {}
    server = cluster.get("server")
    if not isinstance(server, str) or not server:
        raise KubeconfigError(f"cluster of context {name!r} has no server")
    for plugin in ("exec", "auth-provider"):
        if plugin in user:
            raise KubeconfigError(
                f"context {name!r} logs in through an {plugin} plugin, which the observer does not run: "
                "give it a kubeconfig with a token (e.g. a service account bound to the lanes-observer ClusterRole)"
            )
    headers: dict[str, str] = {}
    config_dir = path.parent
    token = user.get("token")
    token_file = user.get("tokenFile")
    if isinstance(token_file, str) and token_file:
        token = (config_dir / Path(token_file).expanduser()).read_text(encoding="utf-8").strip()
    if isinstance(token, str) and token:
        headers["Authorization"] = f"Bearer {token}"
    elif user.get("username"):
        basic = base64.b64encode(f"{user['username']}:{user.get('password') or ''}".encode()).decode()
        headers["Authorization"] = f"Basic {basic}"
    ssl_context: ssl.SSLContext | None = None
    if server.startswith("https://"):
        ca = _material(config_dir, cluster, "certificate-authority")
        ssl_context = ssl.create_default_context(cafile=str(ca) if ca else None)
        if cluster.get("insecure-skip-tls-verify"):
            ssl_context.check_hostname = False
            ssl_context.verify_mode = ssl.CERT_NONE
        cert, key = _material(config_dir, user, "client-certificate"), _material(config_dir, user, "client-key")
        if cert is not None:
            ssl_context.load_cert_chain(str(cert), str(key) if key else None)
    return ApiAccess(server=server.rstrip("/"), headers=headers, ssl_context=ssl_context, context=name)


def in_cluster() -> ApiAccess | None:
    """The pod's service account, when running in a pod (KUBERNETES_SERVICE_HOST set and a token mounted)."""
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    token = SERVICE_ACCOUNT / "token"
    if not host or not token.exists():
        return None
    ssl_context = ssl.create_default_context(cafile=str(SERVICE_ACCOUNT / "ca.crt"))
    server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
    headers = {"Authorization": f"Bearer {token.read_text(encoding='utf-8').strip()}"}
    return ApiAccess(server=server, headers=headers, ssl_context=ssl_context, context="in-cluster")


def resolve(kubeconfig: Path | None, context: str | None) -> ApiAccess:
    """`--kubeconfig`/`--context` when given, else the service account in a pod, else the default kubeconfig."""
    if kubeconfig is None and context is None:
        found = in_cluster()
        if found is not None:
            return found
    return from_kubeconfig(kubeconfig, context)
