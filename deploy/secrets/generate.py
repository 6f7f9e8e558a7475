"""Generate the compose stack's secrets: TLS for NATS, one NATS user per identity, one signing key each.

    uv run python deploy/secrets/generate.py deploy/secrets/out [--nodes node-1,node-2] [--hosts h1,h2,h3]

Writes into the output directory (created 0700; every file 0600):

* `ca.pem`, `nats-cert.pem`, `nats-key.pem`: a private CA and the certificate every NATS node presents,
  to clients and on the cluster routes (SAN nats-1, nats-2, nats-3, localhost, 127.0.0.1);
* `auth.conf`: the `authorization` block and `max_payload` that `deploy/nats/nats.conf` includes, from the
  same identities table and stream limits as embedded mode (`lanes_contract.identities`, `.streams`);
* `<identity>.env`: `NATS_URL` (tls://, that identity's user, all three nodes), `LANES_SIGNING_KEY_FILE`
  and `SSL_CERT_FILE` (the CA) for the container that runs as that identity;
* `<identity>.key` and `keyring.json`: each identity's Ed25519 signing key and the public keyring.

Re-running makes new secrets; restart the stack after it. Keep the directory out of version control.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import json
import secrets
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from lanes_contract.identities import ADMIN, authorization_users, identities
from lanes_contract.signing import EventSigner, Keyring
from lanes_contract.streams import MAX_PAYLOAD_BYTES

NATS_NODES = ("nats-1", "nats-2", "nats-3")
IN_CONTAINER = Path("/run/lanes-secrets")
"""Where the compose file mounts this directory in every container."""
_VALID_DAYS = 825


def _write(path: Path, text: str | bytes) -> None:
    path.touch(mode=0o600)
    path.chmod(0o600)
    if isinstance(text, str):
        path.write_text(text)
    else:
        path.write_bytes(text)


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def tls_files(hosts: tuple[str, ...]) -> dict[str, bytes]:
    """A CA and one certificate for the NATS nodes (server and client use: routes verify each other)."""
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("lanes-nats-ca"))
        .issuer_name(_name("lanes-nats-ca"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=_VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName(host) for host in (*hosts, "localhost")]
    names.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("lanes-nats"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=_VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return {
        "ca.pem": ca.public_bytes(Encoding.PEM),
        "nats-cert.pem": cert.public_bytes(Encoding.PEM),
        "nats-key.pem": key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()),
    }


def generate(out: Path, nodes: tuple[str, ...] = (), *, hosts: tuple[str, ...] = NATS_NODES) -> None:
    """Write every secret of the stack into `out` (see the module docstring)."""
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    for name, content in tls_files(hosts).items():
        _write(out / name, content)
    names = [ADMIN, *(identity.name for identity in identities(nodes))]
    passwords = {name: secrets.token_urlsafe(24) for name in names}
    users = authorization_users(passwords, nodes)
    # The largest message any stream takes (a dead letter): bigger ones are refused before JetStream sees them.
    settings = f"max_payload: {MAX_PAYLOAD_BYTES}\n"
    _write(out / "auth.conf", f"{settings}authorization: {json.dumps({'users': users}, indent=2)}\n")
    keyring = Keyring({})
    for name in names:
        signer = EventSigner.generate(name)
        keyring = keyring.with_key(signer)
        _write(out / f"{name}.key", signer.dump())
        url = ",".join(f"tls://{name}:{passwords[name]}@{host}:4222" for host in hosts)
        env = {
            "NATS_URL": url,
            "LANES_SIGNING_KEY_FILE": str(IN_CONTAINER / f"{name}.key"),
            "SSL_CERT_FILE": str(IN_CONTAINER / "ca.pem"),
            "LANES_KEYRING": str(IN_CONTAINER / "keyring.json"),
        }
        _write(out / f"{name}.env", "".join(f"{key}={value}\n" for key, value in env.items()))
    _write(out / "keyring.json", keyring.dump())


def main() -> None:
    """Command line: the output directory and the node agents to make identities for."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--nodes", default="", help="comma-separated node ids that get an agent identity")
    parser.add_argument(
        "--hosts",
        default=",".join(NATS_NODES),
        help="comma-separated NATS node host names, for the certificate and NATS_URL (Kubernetes: "
        "nats-0.nats-headless,nats-1.nats-headless,nats-2.nats-headless)",
    )
    args = parser.parse_args()
    nodes = tuple(node for node in args.nodes.split(",") if node)
    hosts = tuple(host for host in args.hosts.split(",") if host)
    generate(args.out, nodes, hosts=hosts)
    print(f"wrote the stack's secrets to {args.out}")  # noqa: T201


if __name__ == "__main__":
    main()
