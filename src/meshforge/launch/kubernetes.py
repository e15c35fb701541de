"""Manifests for the Kubeflow training operator: a ConfigMap and a kubeflow.org/v1 PyTorchJob.

The ConfigMap holds the job config (after `--set`) as `job.yaml`; every pod mounts it
read-only at /etc/meshforge/job.yaml and runs `meshforge train /etc/meshforge/job.yaml
--run-dir RUN_DIR` with no launch flags, because the operator sets torchrun's own `PET_*`
variables, which `meshforge train` reads exactly as torchrun does:

- fixed size (`--nodes N`): one Master replica and N-1 Worker replicas; the operator sets
  PET_NNODES=N, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR=<job>-master-0 and
  PET_MASTER_PORT=23456 (the container port named `pytorchjob-port`).
- elastic (`--nodes MIN:MAX`): Worker replicas only (MAX of them), as the operator requires
  with an `elasticPolicy`; it sets PET_NNODES=MIN:MAX, PET_RDZV_BACKEND=c10d,
  PET_RDZV_ENDPOINT=<job>-worker-0:23456, PET_RDZV_ID and PET_MAX_RESTARTS.

Field names follow the operator's v1 API (pkg/apis/kubeflow.org/v1/pytorch_types.go):
`nprocPerNode` is a string on the job spec, the container must be named `pytorch`, a
Master has exactly one replica, and the job name must be a DNS-1035 label.

Locked down by default (issue 26): every pod runs as the image's non-root user
(uid/gid 1000) with no privilege escalation, no capabilities, the RuntimeDefault seccomp
profile and a read-only root filesystem (what must be written gets an emptyDir: /tmp, the
user's home for caches, the run directory unless a PVC holds it); no service-account
token is mounted unless asked; a NetworkPolicy admits to the job's pods only the job's own
pods; credentials come from Kubernetes Secrets named on the command line (`envFrom`), never
from the manifests, and a job config that carries one (a URL with a password or a token) is
refused, because a ConfigMap is not a secret.

Building the manifests is pure; writing them and `kubectl apply` are the only side effects.
"""

from __future__ import annotations

import posixpath
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from meshforge.config import JobConfig, dump_config
from meshforge.errors import ConfigError
from meshforge.redact import credential_fields

API_VERSION = "kubeflow.org/v1"
CONTAINER_NAME = "pytorch"  # the operator looks for a container of this name
PORT_NAME = "pytorchjob-port"  # ... and this port: PET_MASTER_PORT / the rendezvous port
PORT = 23456  # the operator's default for that port
CONFIG_DIR = "/etc/meshforge"
CONFIG_KEY = "job.yaml"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_KEY}"
WORKDIR = "/workspace"  # relative run directories live under the image's working directory
DEFAULT_MAX_RESTARTS = 3  # elastic jobs only: worker-group restarts before the job fails
SHM_GI_PER_PROCESS = 1  # /dev/shm cap: NCCL's shared-memory transport needs far less
APPLY_TIMEOUT_S = 120.0
MAX_LABEL = 63
RUN_AS_UID = 1000  # the Dockerfile's `meshforge` user and group: a non-root uid the image has
HOME = "/home/meshforge"  # its home: caches (meshforge's data cache, torch, W&B) land here

_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")
_IFACE = re.compile(r"[A-Za-z0-9_.:@-]{1,15}")  # Linux IFNAMSIZ: 15 characters and a NUL

# The docker reference grammar (github.com/distribution/reference, regexp.go).
_ALNUM = r"[a-z0-9]+"
_PATH_COMPONENT = rf"{_ALNUM}(?:(?:[._]|__|-+){_ALNUM})*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?"
_NAME = rf"(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
_REFERENCE = re.compile(rf"(?P<name>{_NAME})(?::{_TAG})?(?:@{_DIGEST})?", re.ASCII)
_RESERVED_MOUNTS = frozenset({"/", CONFIG_DIR, "/dev/shm", "/tmp", HOME})
_SHELL_META = (";", "&", "|", "$", "`", "(", ")", "<", ">", "'", '"', "\\", "*", "?", "!", "#")


class ApplyFailed(Exception):
    """`kubectl apply` ran and failed (exit 1): the cluster, not the input, said no."""


@dataclass(frozen=True)
class K8sJob:
    """Where and how the job runs: pods, processes and GPUs per pod, image, namespace."""

    min_nodes: int
    max_nodes: int
    elastic: bool
    gpus_per_node: int
    nproc_per_node: int
    image: str
    run_dir: str  # inside the pods
    namespace: str | None = None
    iface: str = "eth0"
    shm_size: str = "1Gi"
    max_restarts: int | None = None
    pvc: str | None = None
    secrets: tuple[str, ...] = ()  # Kubernetes Secrets whose keys become the container's env
    service_account_token: bool = False  # mount the service account's API token


# -- validation ------------------------------------------------------------------


def parse_nodes(text: str) -> tuple[int, int, bool]:
    """`N` (fixed size) or `MIN:MAX` (elastic, as torchrun's --nnodes) -> (min, max, elastic)."""
    parts = text.strip().split(":")
    if len(parts) > 2 or not all(p.strip().lstrip("-").isdigit() for p in parts):
        raise ConfigError(f"--nodes expects N or MIN:MAX, got {text!r}")
    low, high = int(parts[0]), int(parts[-1])
    if low < 1:
        raise ConfigError(f"--nodes must be at least 1, got {text!r}")
    if high < low:
        raise ConfigError(f"--nodes {text}: MAX={high} is smaller than MIN={low}")
    return low, high, len(parts) == 2


def check_image(image: str) -> None:
    """A docker image reference, and nothing a shell or a YAML reader could misread."""
    bad = next((c for c in image if c.isspace() or c in _SHELL_META), None)
    if bad is not None:
        raise ConfigError(
            f"--image {image!r} contains {bad!r}: an image reference cannot hold shell "
            "metacharacters, quotes or spaces"
        )
    match = _REFERENCE.fullmatch(image)
    if match is None or len(match["name"]) > 255:
        raise ConfigError(
            f"--image {image!r} is not a docker image reference "
            "([REGISTRY[:PORT]/]lowercase/path[:TAG][@sha256:DIGEST])"
        )


def check_namespace(namespace: str) -> None:
    if len(namespace) > MAX_LABEL or not _DNS1123_LABEL.fullmatch(namespace):
        raise ConfigError(
            f"--namespace {namespace!r} is not a DNS-1123 label (lowercase letters, digits "
            f"and '-', starting and ending with a letter or digit, at most {MAX_LABEL})"
        )


def check_iface(iface: str) -> None:
    if not _IFACE.fullmatch(iface):
        raise ConfigError(f"--iface {iface!r} is not a network interface name (e.g. eth0)")


def check_quantity(value: str, option: str) -> None:
    if not _QUANTITY.fullmatch(value):
        raise ConfigError(f"{option} {value!r} is not a Kubernetes quantity (e.g. 16Gi)")


def job_name(config_name: str, max_nodes: int) -> str:
    """config `name` as a DNS-1035 label (the operator's rule for a PyTorchJob name), short
    enough that every pod and service name `<job>-worker-<i>` fits in 63 characters."""
    name = re.sub(r"[^a-z0-9]+", "-", config_name.lower()).strip("-") or "job"
    if not name[0].isalpha():
        name = f"job-{name}"
    room = MAX_LABEL - len(f"-worker-{max(max_nodes - 1, 0)}")
    return name[:room].rstrip("-")


def check_secret_name(name: str) -> None:
    """A Secret's name (DNS-1123 subdomain); a value given by mistake is refused, not
    echoed: the message names the option, never what was passed."""
    if len(name) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(name):
        raise ConfigError(
            "--secret takes the name of a Kubernetes Secret (a DNS-1123 name such as "
            "training-credentials), never a credential itself: create the Secret with "
            "kubectl create secret generic NAME --from-env-file=FILE"
        )


def check_no_credentials(cfg: JobConfig) -> None:
    """The job config goes into a ConfigMap, which anyone who can read the namespace
    reads: a credential in it (a URL's password or token) is refused."""
    fields = credential_fields(cfg.model_dump(mode="json"))
    if fields:
        raise ConfigError(
            f"{', '.join(fields)} carries a credential (a URL's password or token), and the "
            "job config becomes a ConfigMap that is not secret: put the credential in a "
            "Kubernetes Secret (e.g. AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
            "WANDB_API_KEY), pass --secret NAME, and give the URL without it"
        )


def check_layout(cfg: JobConfig, worlds: list[int]) -> None:
    """The layout must fit every world size the job can run at (launch/train.py,
    check_worlds). A shard directory in `data.source` names storage inside the pods, so
    only built-in corpora are checked here."""
    from meshforge.data.corpus import BUILTIN_PREFIX, check_source
    from meshforge.launch.train import check_worlds

    if cfg.data.source.startswith(BUILTIN_PREFIX):
        check_source(cfg.data.source)
    check_worlds(cfg, worlds)


def make_job(
    cfg: JobConfig,
    *,
    nodes: str,
    gpus_per_node: int,
    image: str,
    run_dir: str,
    namespace: str | None = None,
    iface: str = "eth0",
    nproc_per_node: int | None = None,
    shm_size: str | None = None,
    max_restarts: int | None = None,
    pvc: str | None = None,
    secrets: list[str] | None = None,
    service_account_token: bool = False,
) -> K8sJob:
    """Check every command-line value and the layout; each problem is one ConfigError."""
    min_nodes, max_nodes, elastic = parse_nodes(nodes)
    for name in secrets or []:
        check_secret_name(name)
    check_no_credentials(cfg)
    if gpus_per_node < 0:
        raise ConfigError(f"--gpus-per-node must be 0 (CPU-only pods) or more, got {gpus_per_node}")
    if gpus_per_node == 0:
        nproc = 1 if nproc_per_node is None else nproc_per_node
        if nproc < 1:
            raise ConfigError(f"--nproc-per-node must be at least 1, got {nproc}")
        if cfg.runtime.device == "cuda" or cfg.runtime.backend == "nccl":
            raise ConfigError(
                f"runtime.device={cfg.runtime.device} runtime.backend={cfg.runtime.backend} "
                "needs GPUs, but --gpus-per-node is 0"
            )
    else:
        if nproc_per_node not in (None, gpus_per_node):
            raise ConfigError(
                f"--nproc-per-node {nproc_per_node} with --gpus-per-node {gpus_per_node}: "
                "GPU pods run one process per GPU (--nproc-per-node is for CPU-only pods)"
            )
        nproc = gpus_per_node
    check_image(image)
    if namespace is not None:
        check_namespace(namespace)
    check_iface(iface)
    shm_size = shm_size or f"{SHM_GI_PER_PROCESS * nproc}Gi"
    check_quantity(shm_size, "--shm-size")
    if max_restarts is not None and not elastic:
        raise ConfigError("--max-restarts needs an elastic job (--nodes MIN:MAX)")
    if max_restarts is not None and max_restarts < 0:
        raise ConfigError(f"--max-restarts must be 0 or more, got {max_restarts}")
    if elastic and max_restarts is None:
        max_restarts = DEFAULT_MAX_RESTARTS
    if pvc is not None and (len(pvc) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(pvc)):
        raise ConfigError(f"--pvc {pvc!r} is not a PersistentVolumeClaim name (DNS-1123)")
    if "\n" in run_dir or not run_dir.strip():
        raise ConfigError(f"--run-dir {run_dir!r} cannot be a path inside the pods")
    if posixpath.normpath(posixpath.join(WORKDIR, run_dir)) in _RESERVED_MOUNTS:
        raise ConfigError(
            f"--run-dir {run_dir!r} is where the pods mount something else "
            f"({', '.join(sorted(_RESERVED_MOUNTS))}): name a folder of its own"
        )
    try:
        check_layout(cfg, [n * nproc for n in range(max_nodes, min_nodes - 1, -1)])
    except ConfigError as exc:
        raise ConfigError(f"{exc} (--nodes {nodes} x {nproc} process(es) per pod)") from None
    return K8sJob(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        elastic=elastic,
        gpus_per_node=gpus_per_node,
        nproc_per_node=nproc,
        image=image,
        run_dir=run_dir,
        namespace=namespace,
        iface=iface,
        shm_size=shm_size,
        max_restarts=max_restarts,
        pvc=pvc,
        secrets=tuple(dict.fromkeys(secrets or [])),
        service_account_token=service_account_token,
    )


# -- manifests (pure) --------------------------------------------------------------


def _labels(instance: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "meshforge", "app.kubernetes.io/instance": instance}


def _metadata(name: str, job: K8sJob, instance: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if job.namespace is not None:
        meta["namespace"] = job.namespace
    meta["labels"] = _labels(instance)
    return meta


def _container(job: K8sJob) -> dict[str, Any]:
    env = [{"name": "GLOO_SOCKET_IFNAME", "value": job.iface}]
    if job.gpus_per_node:
        env = [
            {"name": "NCCL_DEBUG", "value": "WARN"},  # INFO to see rings, transports, interfaces
            {"name": "NCCL_SOCKET_IFNAME", "value": job.iface},
            *env,
        ]
    env.append({"name": "HOME", "value": HOME})  # whatever the image says: the writable one
    mounts = [
        {"name": "job-config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
        # the root filesystem is read-only: these are what a run writes outside its run dir
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "home", "mountPath": HOME},
        {"name": "run-dir", "mountPath": posixpath.join(WORKDIR, job.run_dir)},
    ]
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": job.image,
        "imagePullPolicy": "IfNotPresent",
        # no launch flags: the operator's PET_* variables say nodes, rank and rendezvous
        "command": ["meshforge", "train", CONFIG_PATH, "--run-dir", job.run_dir],
        "workingDir": WORKDIR,
        "env": env,
        "ports": [{"name": PORT_NAME, "containerPort": PORT, "protocol": "TCP"}],
        "volumeMounts": mounts,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_UID,
            "runAsGroup": RUN_AS_UID,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
        },
    }
    if job.secrets:  # every key of each Secret becomes a variable; no value is written here
        container["envFrom"] = [{"secretRef": {"name": name}} for name in job.secrets]
    if job.gpus_per_node:
        gpus = {"nvidia.com/gpu": job.gpus_per_node}
        container["resources"] = {"limits": dict(gpus), "requests": dict(gpus)}
    return container


def _replica(job: K8sJob, name: str, replicas: int, config_map: str) -> dict[str, Any]:
    volumes: list[dict[str, Any]] = [
        {
            "name": "job-config",
            "configMap": {"name": config_map, "items": [{"key": CONFIG_KEY, "path": CONFIG_KEY}]},
        },
        # memory-backed: the container runtime's default /dev/shm (64 MiB) is too small for NCCL
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": job.shm_size}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "home", "emptyDir": {}},
        # without a PVC the run directory lives (and dies) with the pod, as before
        {"name": "run-dir", "persistentVolumeClaim": {"claimName": job.pvc}}
        if job.pvc is not None
        else {"name": "run-dir", "emptyDir": {}},
    ]
    pod: dict[str, Any] = {
        # no API token in the pods unless the job needs one (--service-account-token)
        "automountServiceAccountToken": job.service_account_token,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_UID,
            "runAsGroup": RUN_AS_UID,
            "fsGroup": RUN_AS_UID,  # the volumes (a PVC too) are writable by that group
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [_container(job)],
        "volumes": volumes,
    }
    return {
        "replicas": replicas,
        # a restarted pod can rejoin a c10d rendezvous, not a static one
        "restartPolicy": "OnFailure" if job.elastic else "Never",
        "template": {"metadata": {"labels": _labels(name)}, "spec": pod},
    }


def network_policy(job: K8sJob, name: str) -> dict[str, Any]:
    """Ingress to the job's pods from the job's own pods only (by their labels), on any
    port: the rendezvous port (23456) and the ports gloo and NCCL open for their
    connections, which they pick at random from the ephemeral range (no option pins them).
    Egress is left open (storage, W&B, DNS). It takes effect where the cluster's network
    plugin enforces NetworkPolicies (Calico, Cilium, ...)."""
    pods = {"matchLabels": _labels(name)}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(f"{name}-pods-only", job, name),
        "spec": {
            "podSelector": pods,
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": pods}]}],
        },
    }


@dataclass(frozen=True)
class Manifests:
    config_map: dict[str, Any]
    pytorch_job: dict[str, Any]
    network_policy: dict[str, Any]

    def files(self) -> dict[str, dict[str, Any]]:
        """{file name: document}, in the order kubectl should apply them."""
        return {
            "configmap.yaml": self.config_map,
            "networkpolicy.yaml": self.network_policy,  # before any pod exists
            "pytorchjob.yaml": self.pytorch_job,
        }


def build_manifests(cfg: JobConfig, job: K8sJob) -> Manifests:
    """ConfigMap, PyTorchJob and NetworkPolicy for `cfg` on `job`'s pods."""
    name = job_name(cfg.name, job.max_nodes)
    config_map_name = f"{name}-config"
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(config_map_name, job, name),
        "data": {CONFIG_KEY: dump_config(cfg)},
    }
    spec: dict[str, Any] = {
        "nprocPerNode": str(job.nproc_per_node),  # a string in the v1 API (int, gpu, cpu, auto)
        "runPolicy": {"cleanPodPolicy": "None"},  # keep finished pods for `kubectl logs`
    }
    if job.elastic:
        spec["elasticPolicy"] = {
            "rdzvBackend": "c10d",
            "rdzvId": name,
            "minReplicas": job.min_nodes,
            "maxReplicas": job.max_nodes,
            "maxRestarts": job.max_restarts,
        }
        spec["pytorchReplicaSpecs"] = {
            "Worker": _replica(job, name, job.max_nodes, config_map_name)
        }
    else:
        replicas = {"Master": _replica(job, name, 1, config_map_name)}
        if job.max_nodes > 1:  # the operator refuses a Worker spec with zero replicas
            replicas["Worker"] = _replica(job, name, job.max_nodes - 1, config_map_name)
        spec["pytorchReplicaSpecs"] = replicas
    pytorch_job = {
        "apiVersion": API_VERSION,
        "kind": "PyTorchJob",
        "metadata": _metadata(name, job, name),
        "spec": spec,
    }
    return Manifests(config_map, pytorch_job, network_policy(job, name))


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the job config) as readable literal blocks; a value used twice
    is written twice, not as a YAML anchor and alias."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(doc: dict[str, Any]) -> str:
    return yaml.dump(doc, Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def describe(job: K8sJob) -> str:
    """One line: the pods, processes and GPUs the job asks for."""
    per = f"{job.gpus_per_node} GPU(s)" if job.gpus_per_node else "CPU only"
    procs = f"{job.nproc_per_node} process(es) per pod, {per}"
    if job.elastic:
        return (
            f"elastic {job.min_nodes}-{job.max_nodes} worker pod(s) (c10d rendezvous, "
            f"max {job.max_restarts} restarts), {procs}"
        )
    workers = f" + {job.max_nodes - 1} worker" if job.max_nodes > 1 else ""
    ranks = job.max_nodes * job.nproc_per_node
    return f"1 master{workers} pod(s), {procs}: {ranks} rank(s)"


# -- side effects -------------------------------------------------------------------


def write_manifests(manifests: Manifests, output: Path) -> list[Path]:
    paths = []
    try:
        output.mkdir(parents=True, exist_ok=True)
        for file_name, doc in manifests.files().items():
            paths.append(output / file_name)
            paths[-1].write_text(to_yaml(doc))
    except OSError as exc:
        raise ConfigError(f"cannot write manifests to {output}: {exc.strerror}") from None
    return paths


def apply_command(paths: list[Path]) -> list[str]:
    return ["kubectl", "apply", *[arg for p in paths for arg in ("-f", str(p))]]


def shell_line(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)


def require_kubectl() -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise ConfigError(
            "--apply needs kubectl, which is not on PATH: install kubectl "
            "(https://kubernetes.io/docs/tasks/tools/) or apply the manifests yourself"
        )
    return kubectl


def _meaningful_line(stderr: str) -> str:
    """kubectl's first error line (the later ones are hints), else its first line."""
    lines = [" ".join(line.split()) for line in stderr.splitlines() if line.strip()]
    for line in lines:
        if line.lower().startswith(("error", "the connection")):
            return line[:400]
    return lines[0][:400] if lines else "no message"


def kubectl_apply(paths: list[Path], timeout_s: float = APPLY_TIMEOUT_S) -> str:
    """Run `kubectl apply -f ...`; its stdout on success, ApplyFailed with one line if not."""
    argv = apply_command(paths)
    argv[0] = require_kubectl()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ApplyFailed(f"kubectl apply did not answer within {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        raise ApplyFailed(_meaningful_line(proc.stderr or proc.stdout))
    return proc.stdout
