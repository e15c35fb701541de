"""`meshforge submit k8s`'s manifests, built in-process: valid for Kubernetes' own schemas
(kubernetes-validate, strict: no unknown field) and for the Kubeflow training operator's
PyTorchJob CRD (tests/data/k8s), and locked down (issue 26): a non-root user, no privilege
escalation, no capabilities, a read-only root filesystem, no service-account token, a
NetworkPolicy that admits only the job's own pods, credentials only from Secrets."""

from __future__ import annotations

import copy
import functools
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers import REPO, TINY_JOB, merge
from meshforge.config import build_config
from meshforge.errors import ConfigError
from meshforge.launch import kubernetes as k8s

# the schema checks need the test extras; the checks of what the manifests say do not
SCHEMAS = all(importlib.util.find_spec(m) for m in ("kubernetes_validate", "jsonschema"))
needs_schemas = pytest.mark.skipif(
    not SCHEMAS, reason="kubernetes-validate and jsonschema (pip install -e '.[test]')"
)
if SCHEMAS:
    import jsonschema
    import kubernetes_validate

CRD = REPO / "tests" / "data" / "k8s" / "kubeflow.org_pytorchjobs.yaml"
# the oldest Kubernetes the manifests are meant for (seccompProfile and every field used
# here are GA there) and the newest schemas the package ships
K8S_VERSIONS = ["1.27.0", kubernetes_validate.utils.latest_version() if SCHEMAS else "latest"]
LAYOUTS = {
    "fixed-gpu": dict(nodes="4", gpus_per_node=8),
    "elastic-gpu": dict(nodes="2:4", gpus_per_node=8),
    "single-cpu": dict(nodes="1", gpus_per_node=0, nproc_per_node=2),
    "pvc-secrets": dict(
        nodes="2",
        gpus_per_node=8,
        pvc="shared-runs",
        secrets=["wandb", "s3-reader"],
        namespace="ml-team",
        service_account_token=True,
    ),  # fmt: skip
}


def cfg_of(**extra: Any):
    # 128 sequences split over 16, 24 and 32 ranks... and 2: micro_batch 4 x dp
    base = {"train": {"global_batch": 384, "steps": 5}}
    return build_config(merge(merge(TINY_JOB, base), extra))


def manifests(**options: Any) -> k8s.Manifests:
    options = {"image": "registry.example.com/ml/meshforge:0.1.0", "run_dir": "runs/tiny"} | (
        options
    )
    cfg = cfg_of()
    return k8s.build_manifests(cfg, k8s.make_job(cfg, **options))


def pods(job: dict[str, Any]) -> list[dict[str, Any]]:
    return [r["template"]["spec"] for r in job["spec"]["pytorchReplicaSpecs"].values()]


# -- schemas ---------------------------------------------------------------------------


@functools.cache
def pytorchjob_schema() -> dict[str, Any]:
    """The CRD's v1 openAPIV3Schema, made strict: an object that lists its properties
    admits no other (the API server would prune a misspelt field without a word)."""
    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])

    def strict(node: Any) -> None:
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                strict(value)
        elif isinstance(node, list):
            for value in node:
                strict(value)

    strict(schema)
    return schema


def test_the_stored_crd_names_its_source():
    head = CRD.read_text().splitlines()[:4]
    assert any("github.com/kubeflow/training-operator" in line for line in head)
    assert any("kubeflow.org_pytorchjobs.yaml" in line for line in head)
    assert any("commit" in line for line in head)


@needs_schemas
@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_pytorchjob_is_valid_for_the_operator_crd(layout):
    job = manifests(**LAYOUTS[layout]).pytorch_job
    jsonschema.Draft7Validator(pytorchjob_schema()).validate(job)


@needs_schemas
def test_the_strict_crd_schema_catches_a_misspelt_field():
    job = manifests(**LAYOUTS["fixed-gpu"]).pytorch_job
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    pod["automountServiceAcountToken"] = False
    with pytest.raises(jsonschema.ValidationError, match="automountServiceAcountToken"):
        jsonschema.Draft7Validator(pytorchjob_schema()).validate(job)


@needs_schemas
@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_configmap_networkpolicy_and_pod_templates_are_valid_kubernetes(layout, version):
    m = manifests(**LAYOUTS[layout])
    for doc in (m.config_map, m.network_policy):
        kubernetes_validate.validate(doc, version, strict=True)
    # the PyTorchJob's pod templates are core/v1 PodTemplateSpecs
    for replica in m.pytorch_job["spec"]["pytorchReplicaSpecs"].values():
        template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}}
        template["template"] = replica["template"]
        kubernetes_validate.validate(template, version, strict=True)


# -- what the pods may do --------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_pods_run_as_a_non_root_user_without_privileges(layout):
    for pod in pods(manifests(**LAYOUTS[layout]).pytorch_job):
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == k8s.RUN_AS_UID != 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        (container,) = pod["containers"]
        sc = container["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] == k8s.RUN_AS_UID
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["readOnlyRootFilesystem"] is True


def test_the_uid_is_the_dockerfiles_non_root_user():
    text = (REPO / "Dockerfile").read_text()
    assert f"--uid {k8s.RUN_AS_UID}" in text and f"USER {k8s.RUN_AS_UID}" in text
    assert f"--home-dir {k8s.HOME}" in text


def test_what_a_run_writes_is_a_writable_volume_under_a_read_only_root():
    for options, run_dir_volume in [
        (LAYOUTS["fixed-gpu"], {"emptyDir": {}}),
        (LAYOUTS["pvc-secrets"], {"persistentVolumeClaim": {"claimName": "shared-runs"}}),
    ]:
        for pod in pods(manifests(**options).pytorch_job):
            volumes = {v.pop("name"): v for v in copy.deepcopy(pod["volumes"])}
            (container,) = pod["containers"]
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            writable = {path: m["name"] for path, m in mounts.items() if not m.get("readOnly")}
            assert writable == {
                "/dev/shm": "dshm",
                "/tmp": "tmp",
                k8s.HOME: "home",
                "/workspace/runs/tiny": "run-dir",
            }
            assert volumes["tmp"] == volumes["home"] == {"emptyDir": {}}
            assert volumes["run-dir"] == run_dir_volume
            assert mounts["/etc/meshforge"]["readOnly"] is True
            assert {"name": "HOME", "value": k8s.HOME} in container["env"]


def test_no_service_account_token_unless_asked():
    for pod in pods(manifests(**LAYOUTS["fixed-gpu"]).pytorch_job):
        assert pod["automountServiceAccountToken"] is False
    for pod in pods(manifests(**LAYOUTS["pvc-secrets"]).pytorch_job):
        assert pod["automountServiceAccountToken"] is True


# -- who may reach them ------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_network_policy_admits_only_the_jobs_own_pods(layout):
    m = manifests(**LAYOUTS[layout])
    policy = m.network_policy
    assert policy["kind"] == "NetworkPolicy"
    assert policy["metadata"].get("namespace") == m.pytorch_job["metadata"].get("namespace")
    selector = policy["spec"]["podSelector"]["matchLabels"]
    for pod_labels in (
        r["template"]["metadata"]["labels"]
        for r in m.pytorch_job["spec"]["pytorchReplicaSpecs"].values()
    ):
        assert selector.items() <= pod_labels.items()  # it selects every pod of the job
    assert selector["app.kubernetes.io/instance"] == m.pytorch_job["metadata"]["name"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    # from the job's pods alone; every port of theirs (23456 and gloo's and NCCL's
    # ephemeral ones), since no option pins the collectives' ports
    assert rule == {"from": [{"podSelector": {"matchLabels": selector}}]}


def test_two_jobs_policies_select_disjoint_pods():
    cfg_a, cfg_b = cfg_of(name="alpha"), cfg_of(name="beta")
    options = dict(nodes="2", gpus_per_node=8, image="mf:1", run_dir="runs/x")
    a = k8s.build_manifests(cfg_a, k8s.make_job(cfg_a, **options)).network_policy
    b = k8s.build_manifests(cfg_b, k8s.make_job(cfg_b, **options)).network_policy
    assert a["spec"]["podSelector"] != b["spec"]["podSelector"]


# -- credentials ----------------------------------------------------------------------


def test_secrets_are_referenced_by_name_and_never_written():
    m = manifests(**LAYOUTS["pvc-secrets"])
    for pod in pods(m.pytorch_job):
        (container,) = pod["containers"]
        assert container["envFrom"] == [
            {"secretRef": {"name": "wandb"}},
            {"secretRef": {"name": "s3-reader"}},
        ]
        assert all("value" in e and "valueFrom" not in e for e in container["env"])
    assert "envFrom" not in pods(manifests(**LAYOUTS["fixed-gpu"]).pytorch_job)[0]["containers"][0]


@pytest.mark.parametrize(
    "value", ["WANDB_API_KEY=abc123", "abc123 def", "Secret_Name", "a" * 254, "-x", ""]
)
def test_a_secret_value_given_as_a_name_is_refused_without_echoing_it(value):
    cfg = cfg_of()
    with pytest.raises(ConfigError) as err:
        k8s.make_job(cfg, nodes="1", gpus_per_node=8, image="mf:1", run_dir="r", secrets=[value])
    assert "--secret" in str(err.value) and (not value or value not in str(err.value))


@pytest.mark.parametrize(
    "source",
    [
        "s3://AKIAEXAMPLE:s3cr3t@bucket/shards",
        "https://host/shards?token=s3cr3t",
        "https://b.s3.amazonaws.com/x.bin?X-Amz-Signature=s3cr3t",
    ],
)
def test_a_job_config_carrying_a_credential_is_refused(source):
    cfg = cfg_of(data={"source": source})
    with pytest.raises(ConfigError) as err:
        k8s.make_job(cfg, nodes="1", gpus_per_node=8, image="mf:1", run_dir="r")
    message = str(err.value)
    assert "data.source" in message and "--secret" in message and "s3cr3t" not in message


def test_no_manifest_holds_a_credential(tmp_path: Path):
    m = manifests(**LAYOUTS["pvc-secrets"])
    paths = k8s.write_manifests(m, tmp_path)
    assert [p.name for p in paths] == ["configmap.yaml", "networkpolicy.yaml", "pytorchjob.yaml"]
    text = "".join(p.read_text() for p in paths)
    assert "kind: Secret" not in text and "stringData" not in text
    assert "secretRef" in text
    assert "&id0" not in text  # plain YAML: no anchors and aliases for a reader to chase


@pytest.mark.parametrize("run_dir", ["/", "/tmp", "/etc/meshforge", "/home/meshforge/", "/dev/shm"])
def test_a_run_dir_on_another_mount_is_refused(run_dir):
    cfg = cfg_of()
    with pytest.raises(ConfigError, match="--run-dir"):
        k8s.make_job(cfg, nodes="1", gpus_per_node=8, image="mf:1", run_dir=run_dir)
