"""Reading and writing cluster topology in the formats clusters already have.

- Slurm `topology.conf`: the tree plugin (`SwitchName=`, `Switches=`, `Nodes=` with hostlist expressions such
  as `gpu[001-128]`) and the block plugin (`BlockName=`, `Nodes=`, `BlockSizes=`). Leaf switches (those that
  list nodes) become leaves, their parents spines; blocks become NVLink domains.
- Kubernetes node labels as ordered topology levels (Kueue's `Topology` object, broadest level first) plus
  the nodes (`kubectl get nodes -o yaml`). `nvidia.com/gpu.clique` is the NVLink domain; of the other
  levels (hostname excluded), the narrowest is the leaf and the next one the spine.
- `nvidia-smi topo -m`: one node's GPU-to-GPU links (NVLink islands) and GPU-to-NIC affinity.
- The native inventory: `lanes_contract.topology.Cluster` as YAML or JSON.

Every parse error names the line and what was expected there. Every input is bounded (`lanes_cli.limits`):
hosts are counted before a hostlist is expanded, and YAML's depth and aliases are checked before it is built.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from lanes_cli.limits import MAX_HOSTLIST_DIGITS, MAX_HOSTS, InputLimitError, check_yaml_shape, excerpt
from lanes_contract.errors import LanesError
from lanes_contract.ids import is_valid_token
from lanes_contract.topology import Cluster, Node


class TopologyFormatError(LanesError, ValueError):
    """A topology file that cannot be read; the message starts with `line N:`."""

    def __init__(self, line: int | None, message: str) -> None:
        super().__init__(f"line {line}: {message}" if line is not None else message)
        self.line = line


# --- hostlists ---------------------------------------------------------------------------------------

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


_Piece = tuple[str, str, list[tuple[str, str]]] | str
"""A hostlist part: a plain name, or (prefix, suffix, [(low, high), ...]) with the numbers as written."""


def expand_hostlist(expression: str, *, line: int | None = None) -> list[str]:
    """`gpu[001-003,007],cpu1` -> gpu001 gpu002 gpu003 gpu007 cpu1 (zero padding kept).

    The hosts are counted first: an expression naming more than MAX_HOSTS is refused before any is built.
    """
    pieces, count = _hostlist_pieces(expression, line)
    if count > MAX_HOSTS:
        raise TopologyFormatError(
            line, f"hostlist {excerpt(expression)} names {count} hosts, more than the limit of {MAX_HOSTS}"
        )
    hosts: list[str] = []
    for piece in pieces:
        if isinstance(piece, str):
            hosts.append(piece)
            continue
        prefix, suffix, bounds_of = piece
        for low, high in bounds_of:
            width = len(low) if low.startswith("0") else 0
            hosts.extend(f"{prefix}{str(i).zfill(width)}{suffix}" for i in range(int(low), int(high) + 1))
    return hosts


def hostlist_size(expression: str, *, line: int | None = None) -> int:
    """How many names `expand_hostlist` would give, without building them (errors as it raises them)."""
    return _hostlist_pieces(expression, line)[1]


def _hostlist_pieces(expression: str, line: int | None) -> tuple[list[_Piece], int]:
    pieces: list[_Piece] = []
    count = 0
    for part in _split_top_level(expression, line):
        match = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\]([^\[\]]*)", part)
        if match is None:
            if "[" in part or "]" in part or not part:
                raise TopologyFormatError(line, f"bad hostlist {excerpt(part)}: expected name or prefix[a-b,c]")
            pieces.append(part)
            count += 1
            continue
        prefix, ranges, suffix = match.groups()
        bounds_of = []
        for item in ranges.split(","):
            bounds = _RANGE.match(item.strip())
            if bounds is None:
                raise TopologyFormatError(line, f"bad range {excerpt(item)} in {excerpt(part)}: expected N or N-M")
            low, high = bounds.group(1), bounds.group(2) or bounds.group(1)
            if max(len(low), len(high)) > MAX_HOSTLIST_DIGITS:
                raise TopologyFormatError(
                    line, f"range {excerpt(item)}: numbers longer than the limit of {MAX_HOSTLIST_DIGITS} digits"
                )
            if int(high) < int(low):
                raise TopologyFormatError(line, f"range {item!r} in {part!r} runs backwards")
            count += int(high) - int(low) + 1
            bounds_of.append((low, high))
        pieces.append((prefix, suffix, bounds_of))
    return pieces, count


def _split_top_level(expression: str, line: int | None) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in expression.strip():
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise TopologyFormatError(line, f"unbalanced ']' in hostlist {expression!r}")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if depth:
        raise TopologyFormatError(line, f"unclosed '[' in hostlist {expression!r}")
    parts.append(current)
    return [p.strip() for p in parts]


def compress_hostlist(hosts: Iterable[str]) -> str:
    """The inverse of `expand_hostlist` for names ending in digits: gpu001 gpu002 gpu003 -> gpu[001-003]."""
    groups: dict[tuple[str, int], list[int]] = {}
    plain: list[str] = []
    for host in sorted(set(hosts)):
        match = re.fullmatch(r"(.*?)(\d+)", host)
        if match is None:
            plain.append(host)
            continue
        prefix, digits = match.groups()
        groups.setdefault((prefix, len(digits)), []).append(int(digits))
    parts = list(plain)
    for (prefix, width), numbers in sorted(groups.items()):
        if len(numbers) == 1:
            parts.append(f"{prefix}{str(numbers[0]).zfill(width)}")
            continue
        runs: list[str] = []
        start = prev = numbers[0]
        for n in [*numbers[1:], None]:
            if n is not None and n == prev + 1:
                prev = n
                continue
            a, b = str(start).zfill(width), str(prev).zfill(width)
            runs.append(a if start == prev else f"{a}-{b}")
            if n is not None:
                start = prev = n
        parts.append(f"{prefix}[{','.join(runs)}]")
    return ",".join(parts)


# --- Slurm topology.conf -----------------------------------------------------------------------------


def _slurm_lines(text: str) -> list[tuple[int, dict[str, str]]]:
    r"""Logical lines (comments dropped, `\\` continuations joined) as key=value dicts with their line numbers."""
    out: list[tuple[int, dict[str, str]]] = []
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), start=1):
        content = raw.split("#", 1)[0].rstrip()
        if not pending:
            start = number
        if content.endswith("\\"):
            pending += content[:-1] + " "
            continue
        logical = (pending + content).strip()
        pending = ""
        if not logical:
            continue
        fields: dict[str, str] = {}
        for token in logical.split():
            key, sep, value = token.partition("=")
            if not sep or not value:
                raise TopologyFormatError(start, f"expected Key=Value, got {token!r}")
            fields[key.lower()] = value
        out.append((start, fields))
    if pending:
        raise TopologyFormatError(start, "line continuation '\\' at the end of the file")
    return out


_TREE_KEYS = {"switchname", "switches", "nodes", "linkspeed"}
_BLOCK_KEYS = {"blockname", "nodes", "blocksizes"}


def parse_slurm(  # noqa: PLR0912 - one branch per kind of line keeps the grammar in one place
    text: str, *, defaults: Mapping[str, Any] | None = None
) -> Cluster:
    """A Slurm topology.conf (tree or block plugin) as a cluster; `defaults` fill node GPU fields."""
    lines = _slurm_lines(text)
    if not lines:
        raise TopologyFormatError(1, "empty topology.conf: expected SwitchName=... or BlockName=... lines")
    leaf_of: dict[str, tuple[str, int]] = {}
    block_of: dict[str, tuple[str, int]] = {}
    parent_of: dict[str, str] = {}
    switches: dict[str, int] = {}
    children: dict[str, tuple[list[str], int]] = {}
    budget = _NameBudget()
    for number, fields in lines:
        if "switchname" in fields:
            unknown = set(fields) - _TREE_KEYS
            if unknown:
                raise TopologyFormatError(number, f"unknown key {min(unknown)!r} for a switch")
            name = _token(fields["switchname"], number, "switch name")
            if name in switches:
                raise TopologyFormatError(number, f"switch {name} is already defined on line {switches[name]}")
            switches[name] = number
            if "nodes" in fields:
                for host in budget.expand(fields["nodes"], number):
                    if host in leaf_of:
                        other, where = leaf_of[host]
                        raise TopologyFormatError(number, f"node {host} is already under switch {other} (line {where})")
                    leaf_of[_token(host, number, "node name")] = (name, number)
            elif "switches" in fields:
                children[name] = (budget.expand(fields["switches"], number), number)
            else:
                raise TopologyFormatError(number, f"switch {name}: expected Nodes= or Switches=")
        elif "blockname" in fields:
            unknown = set(fields) - _BLOCK_KEYS
            if unknown:
                raise TopologyFormatError(number, f"unknown key {min(unknown)!r} for a block")
            name = _token(fields["blockname"], number, "block name")
            if "nodes" not in fields:
                raise TopologyFormatError(number, f"block {name}: expected Nodes=")
            for host in budget.expand(fields["nodes"], number):
                if host in block_of:
                    raise TopologyFormatError(number, f"node {host} is already in block {block_of[host][0]}")
                block_of[_token(host, number, "node name")] = (name, number)
        elif set(fields) == {"blocksizes"}:
            for size in fields["blocksizes"].split(","):
                if not size.isdigit():
                    raise TopologyFormatError(number, f"BlockSizes: expected comma-separated integers, got {size!r}")
        else:
            raise TopologyFormatError(
                number, f"expected SwitchName=, BlockName= or BlockSizes=, got {next(iter(fields))}="
            )
    for parent, (kids, number) in children.items():
        for kid in kids:
            if kid not in switches:
                raise TopologyFormatError(number, f"switch {parent} lists unknown switch {kid}")
            parent_of[kid] = parent
    return Cluster(
        nodes=tuple(
            _slurm_node(host, leaf_of, block_of, parent_of, defaults) for host in sorted(set(leaf_of) | set(block_of))
        )
    )


def _slurm_node(
    host: str,
    leaf_of: Mapping[str, tuple[str, int]],
    block_of: Mapping[str, tuple[str, int]],
    parent_of: Mapping[str, str],
    defaults: Mapping[str, Any] | None,
) -> Node:
    leaf = leaf_of[host][0] if host in leaf_of else None
    fields: dict[str, Any] = dict(defaults or {}) | {
        "node_id": host,
        "leaf": leaf,
        "spine": parent_of.get(leaf) if leaf else None,
        "nvlink_domain": block_of[host][0] if host in block_of else None,
    }
    return _node(fields, (leaf_of.get(host) or block_of[host])[1])


def _node(fields: Mapping[str, Any], line: int | None) -> Node:
    """A node from a file's fields and the command's defaults; a value out of range is a format error."""
    try:
        return Node.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise TopologyFormatError(line, f"node {fields.get('node_id')}: {where}: {first['msg']}") from exc


class _NameBudget:
    """The names all the hostlists of one file expand to: together at most MAX_HOSTS."""

    def __init__(self) -> None:
        self.used = 0

    def expand(self, expression: str, line: int) -> list[str]:
        self.used += hostlist_size(expression, line=line)
        if self.used > MAX_HOSTS:
            raise TopologyFormatError(
                line, f"the file's hostlists name more than the limit of {MAX_HOSTS} hosts and switches"
            )
        return expand_hostlist(expression, line=line)


def _token(value: str, line: int, what: str) -> str:
    if not is_valid_token(value):
        raise TopologyFormatError(line, f"{what} {value!r}: expected letters, digits, '_' or '-'")
    return value


def export_slurm(cluster: Cluster, *, block: bool = False) -> str:
    """A topology.conf for the cluster: the tree (leaves and spines) or, with `block`, NVLink domains as blocks."""
    lines = ["# Generated by `lanes topology export`"]
    if block:
        domains: dict[str, list[str]] = {}
        for node in cluster.nodes:
            if node.nvlink_domain:
                domains.setdefault(node.nvlink_domain, []).append(node.node_id)
        lines += [f"BlockName={name} Nodes={compress_hostlist(hosts)}" for name, hosts in sorted(domains.items())]
        sizes = sorted({len(h) for h in domains.values()})
        if sizes:
            lines.append(f"BlockSizes={','.join(map(str, sizes))}")
        return "\n".join(lines) + "\n"
    leaves: dict[str, list[str]] = {}
    spines: dict[str, set[str]] = {}
    for node in cluster.nodes:
        if node.leaf:
            leaves.setdefault(node.leaf, []).append(node.node_id)
            if node.spine:
                spines.setdefault(node.spine, set()).add(node.leaf)
    lines += [f"SwitchName={name} Nodes={compress_hostlist(hosts)}" for name, hosts in sorted(leaves.items())]
    lines += [f"SwitchName={name} Switches={','.join(sorted(kids))}" for name, kids in sorted(spines.items())]
    return "\n".join(lines) + "\n"


# --- YAML with line numbers --------------------------------------------------------------------------


class _LineLoader(yaml.SafeLoader):
    """A safe loader that remembers the line of every mapping under the key `__line__`."""


def _mapping_with_line(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    mapping = loader.construct_mapping(node, deep=True)
    mapping["__line__"] = node.start_mark.line + 1
    mapping["__lines__"] = {loader.construct_object(k): k.start_mark.line + 1 for k, _ in node.value}
    return mapping


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_with_line)


def _load_yaml_documents(text: str) -> list[Any]:
    try:
        check_yaml_shape(text)
    except InputLimitError as exc:
        raise TopologyFormatError(None, str(exc)) from exc
    try:
        return [doc for doc in yaml.load_all(text, Loader=_LineLoader) if doc is not None]
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        raise TopologyFormatError(mark.line + 1 if mark else None, f"not valid YAML: {exc.problem}") from exc
    except yaml.YAMLError as exc:  # a reader error: a character YAML does not allow
        raise TopologyFormatError(None, f"not valid YAML: {' '.join(str(exc).split())}") from exc


def _strip_lines(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_lines(v) for k, v in value.items() if k not in {"__line__", "__lines__"}}
    if isinstance(value, list):
        return [_strip_lines(v) for v in value]
    return value


def _line_at(value: Any, loc: Sequence[int | str]) -> int | None:
    line = value.get("__line__") if isinstance(value, dict) else None
    for key in loc:
        if isinstance(value, dict):
            line = value.get("__lines__", {}).get(key, line)
        try:
            value = value[key]
        except (KeyError, IndexError, TypeError):
            break
        if isinstance(value, dict):
            line = value.get("__line__", line)
    return line


# --- native inventory --------------------------------------------------------------------------------


def parse_native(text: str) -> Cluster:
    """A `Cluster` written as YAML or JSON (JSON is YAML); errors name the line of the offending entry."""
    docs = _load_yaml_documents(text)
    if len(docs) != 1 or not isinstance(docs[0], dict):
        raise TopologyFormatError(1, "expected one mapping with `nodes:` (and optionally `policy:`)")
    raw = docs[0]
    try:
        return Cluster.model_validate(_strip_lines(raw))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise TopologyFormatError(_line_at(raw, first["loc"]), f"{where}: {first['msg']}") from exc


# --- Kubernetes labels -------------------------------------------------------------------------------

HOSTNAME_LABEL = "kubernetes.io/hostname"
NVLINK_LABEL = "nvidia.com/gpu.clique"
GPU_RESOURCE = "nvidia.com/gpu"


def parse_k8s_labels(text: str) -> Cluster:
    """A Kueue `Topology` (ordered levels) plus Kubernetes nodes (a `List`/`NodeList` or `Node` documents)."""
    docs = _load_yaml_documents(text)
    levels: list[str] | None = None
    node_docs: list[dict[str, Any]] = []
    for doc in docs:
        if not isinstance(doc, dict):
            raise TopologyFormatError(None, "expected Kubernetes objects (mappings with `kind:`)")
        kind = doc.get("kind")
        if kind == "Topology":
            levels = _topology_levels(doc)
        elif kind in {"List", "NodeList"}:
            items = doc.get("items") or []
            if not isinstance(items, list):
                raise TopologyFormatError(_line_at(doc, ["items"]), f"{kind}: expected `items:` as a list of nodes")
            node_docs.extend(item for item in items if isinstance(item, dict))
        elif kind == "Node":
            node_docs.append(doc)
        else:
            raise TopologyFormatError(
                doc.get("__line__"), f"expected kind Topology, Node, NodeList or List, got {kind!r}"
            )
    if levels is None:
        raise TopologyFormatError(1, "no Topology object: expected `kind: Topology` with spec.levels")
    if not node_docs:
        raise TopologyFormatError(1, "no nodes: expected a NodeList / List of nodes or Node documents")
    placement = [label for label in levels if label not in {HOSTNAME_LABEL, NVLINK_LABEL}]
    leaf_label = placement[-1] if placement else None
    spine_label = placement[-2] if len(placement) > 1 else None
    nodes = [_k8s_node(doc, leaf_label, spine_label, NVLINK_LABEL in levels) for doc in node_docs]
    try:
        return Cluster(nodes=tuple(nodes))
    except ValidationError as exc:
        raise TopologyFormatError(None, str(exc.errors()[0]["msg"])) from exc


def _topology_levels(doc: dict[str, Any]) -> list[str]:
    """The node labels of a Kueue `Topology`, broadest first."""
    spec_levels = _mapping(doc, "spec").get("levels")
    if not isinstance(spec_levels, list) or not spec_levels:
        raise TopologyFormatError(doc["__line__"], "Topology: expected spec.levels with nodeLabel entries")
    levels = []
    for level in spec_levels:
        label = level.get("nodeLabel") if isinstance(level, dict) else None
        if not isinstance(label, str):
            raise TopologyFormatError(_line_at(doc, ["spec"]), "Topology level: expected `nodeLabel: <label>`")
        levels.append(label)
    return levels


def _mapping(parent: dict[str, Any], key: str) -> dict[str, Any]:
    """`parent[key]` when it is a mapping, {} when absent; else a format error naming its line."""
    value = parent.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TopologyFormatError(_line_at(parent, [key]), f"{key}: expected a mapping, got {type(value).__name__}")
    return value


def _k8s_node(doc: dict[str, Any], leaf_label: str | None, spine_label: str | None, nvlink: bool) -> Node:
    line = doc.get("__line__")
    metadata = doc.get("metadata")
    if not isinstance(metadata, dict) or not isinstance(metadata.get("name"), str):
        raise TopologyFormatError(line, "Node: expected metadata.name")
    labels = {k: str(v) for k, v in _mapping(metadata, "labels").items() if k not in {"__line__", "__lines__"}}
    status = _mapping(doc, "status")
    capacity = _mapping(status, "capacity") or _mapping(status, "allocatable")
    gpus_raw = capacity.get(GPU_RESOURCE, "0")
    memory_mib = labels.get("nvidia.com/gpu.memory", "0")
    if not str(gpus_raw).isdigit() or not memory_mib.isdigit():
        where = ["status", "capacity" if "capacity" in status else "allocatable", GPU_RESOURCE]
        if not memory_mib.isdigit():
            where = ["metadata", "labels", "nvidia.com/gpu.memory"]
        raise TopologyFormatError(
            _line_at(doc, where), f"Node {metadata['name']}: expected integer {GPU_RESOURCE} and gpu.memory"
        )

    def domain(label: str | None) -> str | None:
        value = labels.get(label) if label else None
        return re.sub(r"[^A-Za-z0-9_-]", "-", value) if value else None

    try:
        return Node(
            node_id=re.sub(r"[^A-Za-z0-9_-]", "-", metadata["name"]),
            gpu_model=labels.get("nvidia.com/gpu.product", "unknown"),
            gpus=int(gpus_raw),
            gpu_memory_gib=int(memory_mib) // 1024,
            leaf=domain(leaf_label),
            spine=domain(spine_label),
            nvlink_domain=domain(NVLINK_LABEL) if nvlink else None,
            labels=labels,
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        raise TopologyFormatError(line, f"Node {metadata['name']}: {first['loc'][0]}: {first['msg']}") from exc


# --- nvidia-smi topo -m ------------------------------------------------------------------------------

_NVLINK = re.compile(r"^NV\d+$")
_LINK_KINDS = {"X", "SYS", "NODE", "PHB", "PXB", "PIX", "NV#"}


class GpuMatrix(BaseModel):
    """One node's `nvidia-smi topo -m`: links between GPUs and from GPUs to NICs."""

    model_config = ConfigDict(frozen=True)

    gpus: int
    links: dict[str, str]
    """`"GPU0-GPU1": "NV18"` for every GPU pair (and GPU-NIC pair)."""
    nvlink_islands: tuple[tuple[int, ...], ...]
    nic_affinity: dict[str, tuple[int, ...]]
    """NIC name -> GPUs behind the same PCIe switch (PIX/PXB)."""


def parse_nvidia_smi(text: str) -> GpuMatrix:
    """Parse the matrix printed by `nvidia-smi topo -m` (legends and trailing notes are ignored)."""
    rows = text.splitlines()
    header_at = next((i for i, r in enumerate(rows) if re.match(r"^\s+GPU0\b", r)), None)
    if header_at is None:
        raise TopologyFormatError(1, "expected a header row starting with GPU0 (output of `nvidia-smi topo -m`)")
    columns = [c for c in re.split(r"\t+|\s{2,}", rows[header_at].strip()) if c]
    devices = [c for c in columns if re.fullmatch(r"(GPU|NIC)\d+|mlx\d+_\d+", c)]
    if not devices or devices[0] != "GPU0":
        raise TopologyFormatError(header_at + 1, "expected device columns GPU0, GPU1, ... in the header")
    gpus = [d for d in devices if d.startswith("GPU")]
    links: dict[str, str] = {}
    seen_rows: list[str] = []
    for offset, row in enumerate(rows[header_at + 1 :], start=header_at + 2):
        cells = row.split()
        if not cells or cells[0] not in devices:
            if seen_rows:
                break
            continue
        name = cells[0]
        values = cells[1 : 1 + len(devices)]
        if len(values) < len(devices):
            raise TopologyFormatError(offset, f"row {name}: expected {len(devices)} link entries, got {len(values)}")
        for column, value in zip(devices, values, strict=True):
            if value not in _LINK_KINDS and not _NVLINK.match(value):
                raise TopologyFormatError(
                    offset, f"row {name}, column {column}: expected X, NV<n>, PIX, PXB, PHB, NODE or SYS, got {value!r}"
                )
            if column != name:
                links[f"{name}-{column}"] = value
        seen_rows.append(name)
    missing = [g for g in gpus if g not in seen_rows]
    if missing:
        raise TopologyFormatError(header_at + 1, f"expected a row for every GPU; missing {', '.join(missing)}")
    islands: list[set[int]] = []
    for i in range(len(gpus)):
        island = {i} | {j for j in range(len(gpus)) if _NVLINK.match(links.get(f"GPU{i}-GPU{j}", ""))}
        merged = [s for s in islands if s & island]
        for s in merged:
            islands.remove(s)
            island |= s
        islands.append(island)
    nics = [d for d in devices if not d.startswith("GPU")]
    affinity = {nic: tuple(i for i in range(len(gpus)) if links.get(f"GPU{i}-{nic}") in {"PIX", "PXB"}) for nic in nics}
    return GpuMatrix(
        gpus=len(gpus),
        links=links,
        nvlink_islands=tuple(sorted(tuple(sorted(s)) for s in islands)),
        nic_affinity=affinity,
    )


def node_from_matrix(node_id: str, matrix: GpuMatrix, **fields: Any) -> Node:
    """A node whose GPU count and NVLink islands come from its `nvidia-smi topo -m`."""
    islands = ";".join(",".join(map(str, island)) for island in matrix.nvlink_islands)
    labels = {"lanes.io/nvlink-islands": islands} | {
        f"lanes.io/nic-{nic}": ",".join(map(str, gpus)) for nic, gpus in matrix.nic_affinity.items()
    }
    return _node({"gpu_model": "unknown", **fields, "node_id": node_id, "gpus": matrix.gpus, "labels": labels}, None)


FORMATS = ("slurm", "labels", "nvidia-smi", "lanes")
