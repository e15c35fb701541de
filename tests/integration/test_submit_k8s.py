"""`meshforge submit k8s`: Kubeflow PyTorchJob manifests, their refusals, and the image.

No test contacts a cluster: `--apply` runs only with kubectl missing or with a stand-in
`kubectl` script on PATH."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from helpers import REPO, TINY_JOB, assert_one_line_error, merge, meshforge

# dp auto: 32 ranks x micro_batch 4 need a global batch of 128
OVERRIDES = ["--set", "train.global_batch=128", "--set", "train.steps=5"]
DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def write_job(tmp_path: Path, **extra) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(merge(TINY_JOB, extra)))
    return path


def submit(tmp_path: Path, *args: str, env: dict[str, str] | None = None, **job):
    config = write_job(tmp_path, **job)
    return meshforge(
        ["submit", "k8s", str(config), "--run-dir", str(tmp_path / "run"), *OVERRIDES, *args],
        env=env,
    )


def manifests(folder: Path) -> tuple[dict, dict]:
    """(ConfigMap, PyTorchJob), each file one YAML document."""
    docs = []
    for name in ("configmap.yaml", "pytorchjob.yaml"):
        found = list(yaml.safe_load_all((folder / name).read_text()))
        assert len(found) == 1, name
        docs.append(found[0])
    return docs[0], docs[1]


def replica_pods(job: dict) -> dict[str, dict]:
    return {
        kind: spec["template"]["spec"] for kind, spec in job["spec"]["pytorchReplicaSpecs"].items()
    }


def test_fixed_job_at_4_nodes_x_8_gpus_has_one_master_three_workers_and_32_ranks(tmp_path):
    proc = submit(tmp_path, "--nodes", "4", "--gpus-per-node", "8", "--image", "meshforge:0.1.0")
    assert proc.returncode == 0, proc.stderr
    folder = tmp_path / "run" / "k8s"
    config_map, job = manifests(folder)
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    assert "elasticPolicy" not in job["spec"]
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert {k: v["replicas"] for k, v in replicas.items()} == {"Master": 1, "Worker": 3}
    assert {v["restartPolicy"] for v in replicas.values()} == {"Never"}
    assert job["spec"]["nprocPerNode"] == "8"  # a string in the operator's v1 API
    assert job["metadata"]["name"] == "tiny" and DNS1035.fullmatch(job["metadata"]["name"])
    assert "32 rank(s)" in proc.stdout
    assert "kubectl apply -f" in proc.stdout and str(folder / "pytorchjob.yaml") in proc.stdout

    for pod in replica_pods(job).values():
        (container,) = pod["containers"]
        assert container["name"] == "pytorch"  # the operator finds its container by this name
        assert container["image"] == "meshforge:0.1.0"
        gpus = {"nvidia.com/gpu": 8}
        assert container["resources"] == {"limits": gpus, "requests": gpus}
        # the operator's PET_* variables carry nodes, rank and rendezvous: no launch flags
        command = ["meshforge", "train", "/etc/meshforge/job.yaml", "--run-dir"]
        assert container["command"] == [*command, str(tmp_path / "run")]
        (port,) = container["ports"]  # PET_MASTER_PORT comes from the port of this name
        assert (port["name"], port["containerPort"]) == ("pytorchjob-port", 23456)
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["NCCL_DEBUG"] == "WARN"
        assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0"
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert mounts["job-config"]["mountPath"] == "/etc/meshforge"
        assert mounts["job-config"]["readOnly"] is True
        assert volumes["job-config"]["configMap"]["name"] == config_map["metadata"]["name"]
        assert volumes["job-config"]["configMap"]["items"] == [
            {"key": "job.yaml", "path": "job.yaml"}
        ]
        assert mounts["dshm"]["mountPath"] == "/dev/shm"
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}


def test_configmap_holds_the_job_config_with_overrides(tmp_path):
    from meshforge.config import load_config

    proc = submit(tmp_path, "--nodes", "4", "--gpus-per-node", "8", "--image", "meshforge:0.1.0")
    assert proc.returncode == 0, proc.stderr
    config_map, _ = manifests(tmp_path / "run" / "k8s")
    shipped = yaml.safe_load(config_map["data"]["job.yaml"])
    expected = load_config(tmp_path / "job.yaml", ["train.global_batch=128", "train.steps=5"])
    assert shipped == expected.model_dump(mode="json")
    assert shipped["train"]["global_batch"] == 128 and shipped["train"]["steps"] == 5


def test_an_elastic_range_must_fit_every_size_in_it(tmp_path):
    """128 sequences split over 16 and 32 ranks, not over 24: refused before a node joins."""
    proc = submit(tmp_path, "--nodes", "2:4", "--gpus-per-node", "8", "--image", "mf:1")
    assert_one_line_error(proc, "at 24 ranks", "16..32", "global_batch")


def test_elastic_job_has_workers_only_and_a_c10d_elastic_policy(tmp_path):
    proc = submit(
        tmp_path,
        *("--nodes", "2:4", "--gpus-per-node", "8", "--image", "meshforge:0.1.0"),
        *("--max-restarts", "5", "--set", "train.global_batch=384"),  # fits 16, 24, 32 ranks
    )
    assert proc.returncode == 0, proc.stderr
    _, job = manifests(tmp_path / "run" / "k8s")
    assert job["spec"]["elasticPolicy"] == {
        "rdzvBackend": "c10d",
        "rdzvId": "tiny",
        "minReplicas": 2,
        "maxReplicas": 4,
        "maxRestarts": 5,
    }
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert list(replicas) == ["Worker"]  # the operator requires Worker-only with elasticPolicy
    assert replicas["Worker"]["replicas"] == 4
    assert replicas["Worker"]["restartPolicy"] == "OnFailure"  # a restarted pod rejoins c10d
    assert job["spec"]["nprocPerNode"] == "8"


def test_namespace_iface_output_pvc_and_a_dns_safe_name(tmp_path):
    out = tmp_path / "manifests"
    proc = submit(
        tmp_path,
        *("--nodes", "4", "--gpus-per-node", "8", "--image", "reg.example.com:5000/ml/mf:1.2"),
        *("--namespace", "ml-team", "--iface", "ens5", "--output", str(out)),
        *("--pvc", "shared-runs", "--shm-size", "32Gi"),
        name="My_GPT.v2_run",  # a plain name (config.py): no space
    )
    assert proc.returncode == 0, proc.stderr
    config_map, job = manifests(out)
    assert job["metadata"]["name"] == "my-gpt-v2-run"
    assert config_map["metadata"]["namespace"] == job["metadata"]["namespace"] == "ml-team"
    for pod in replica_pods(job).values():
        (container,) = pod["containers"]
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "ens5"
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["run-dir"]["persistentVolumeClaim"] == {"claimName": "shared-runs"}
        assert volumes["dshm"]["emptyDir"]["sizeLimit"] == "32Gi"
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["run-dir"] == str(tmp_path / "run")


def test_long_names_leave_room_for_the_pod_suffix(tmp_path):
    proc = submit(
        tmp_path, "--nodes", "4", "--gpus-per-node", "8", "--image", "mf:1", name="9" + "x" * 80
    )
    assert proc.returncode == 0, proc.stderr
    _, job = manifests(tmp_path / "run" / "k8s")
    name = job["metadata"]["name"]
    assert DNS1035.fullmatch(name) and len(f"{name}-worker-3") <= 63


def test_cpu_only_pods_ask_for_no_gpus(tmp_path):
    proc = submit(
        tmp_path,
        *("--nodes", "4", "--gpus-per-node", "0", "--nproc-per-node", "8", "--image", "mf:1"),
    )
    assert proc.returncode == 0, proc.stderr
    _, job = manifests(tmp_path / "run" / "k8s")
    assert job["spec"]["nprocPerNode"] == "8"
    for pod in replica_pods(job).values():
        (container,) = pod["containers"]
        assert "resources" not in container
        assert {e["name"] for e in container["env"]} == {"GLOO_SOCKET_IFNAME", "HOME"}


HOSTILE_IMAGES = ["mf;reboot", "mf:$(reboot)", "mf:`id`", "mf 1", "mf:'1'", 'mf"', "mf\nreboot"]
GOOD_LAYOUT = ["--gpus-per-node", "8", "--image", "mf:1"]

BAD = [
    ("zero-nodes", ["--nodes", "0", *GOOD_LAYOUT], {}, ["--nodes", "at least 1"]),
    ("negative-nodes", ["--nodes", "-2", *GOOD_LAYOUT], {}, ["--nodes", "at least 1"]),
    ("nodes-3:2", ["--nodes", "3:2", *GOOD_LAYOUT], {}, ["--nodes", "smaller than"]),
    ("nodes-text", ["--nodes", "four", *GOOD_LAYOUT], {}, ["--nodes", "four"]),
    (
        "negative-gpus",
        ["--nodes", "4", "--gpus-per-node", "-1", "--image", "mf:1"],
        {},
        ["--gpus-per-node"],
    ),
    *[
        (f"image-{i}", ["--nodes", "4", "--gpus-per-node", "8", "--image", image], {}, ["--image"])
        for i, image in enumerate(HOSTILE_IMAGES)
    ],
    (
        "image-grammar",
        ["--nodes", "4", "--gpus-per-node", "8", "--image", "Team/MF:1"],
        {},
        ["--image", "not a docker image reference"],
    ),
    (
        "image-empty-tag",
        ["--nodes", "4", "--gpus-per-node", "8", "--image", "mf:"],
        {},
        ["--image", "not a docker image reference"],
    ),
    ("namespace", ["--nodes", "4", *GOOD_LAYOUT, "--namespace", "ML_team"], {}, ["--namespace"]),
    (
        "namespace-too-long",
        ["--nodes", "4", *GOOD_LAYOUT, "--namespace", "n" * 64],
        {},
        ["--namespace", "DNS-1123"],
    ),
    (
        "layout-not-fitting-32-ranks",
        ["--nodes", "4", *GOOD_LAYOUT, "--set", "parallel.dp=3", "--set", "train.global_batch=12"],
        {},
        ["parallel.dp=3", "32"],
    ),
    (
        "restarts-without-elastic",
        ["--nodes", "4", *GOOD_LAYOUT, "--max-restarts", "2"],
        {},
        ["--max-restarts", "MIN:MAX"],
    ),
    ("iface", ["--nodes", "4", *GOOD_LAYOUT, "--iface", "eth0;id"], {}, ["--iface"]),
    (
        "procs-beyond-gpus",
        ["--nodes", "4", *GOOD_LAYOUT, "--nproc-per-node", "16"],
        {},
        ["--nproc-per-node", "one process per GPU"],
    ),
    ("shm-size", ["--nodes", "4", *GOOD_LAYOUT, "--shm-size", "lots"], {}, ["--shm-size"]),
    (
        "nccl-on-cpu-pods",
        ["--nodes", "4", "--gpus-per-node", "0", "--image", "mf:1"],
        {"runtime": {"backend": "nccl"}},
        ["runtime.backend=nccl", "--gpus-per-node"],
    ),
]


@pytest.mark.parametrize("args,job,words", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, args, job, words):
    proc = submit(tmp_path, *args, **job)
    assert_one_line_error(proc, *words)
    assert not (tmp_path / "run").exists()


def test_apply_without_kubectl_says_to_install_it_and_writes_nothing(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    proc = submit(tmp_path, "--nodes", "4", *GOOD_LAYOUT, "--apply", env={"PATH": str(empty)})
    assert_one_line_error(proc, "kubectl", "install")
    assert not (tmp_path / "run").exists()


def fake_kubectl(folder: Path, script: str) -> dict[str, str]:
    """A stand-in `kubectl` (a shell script) alone on PATH: nothing reaches a cluster."""
    folder.mkdir()
    kubectl = folder / "kubectl"
    kubectl.write_text(f"#!/bin/sh\n{script}\n")
    kubectl.chmod(0o755)
    return {"PATH": str(folder)}


def test_apply_runs_kubectl_apply_on_every_manifest_policy_before_pods(tmp_path):
    log = tmp_path / "kubectl.args"
    env = fake_kubectl(tmp_path / "bin", f'echo "$@" > {log}\necho "pytorchjob created"')
    proc = submit(tmp_path, "--nodes", "4", *GOOD_LAYOUT, "--apply", env=env)
    assert proc.returncode == 0, proc.stderr
    folder = tmp_path / "run" / "k8s"
    names = ["configmap.yaml", "networkpolicy.yaml", "pytorchjob.yaml"]
    expected = ["apply", *[arg for n in names for arg in ("-f", str(folder / n))]]
    assert log.read_text().split() == expected
    assert "pytorchjob created" in proc.stdout


def test_failed_apply_reports_kubectl_error_in_one_line_exit_1(tmp_path):
    error = 'error: resource mapping not found for name: "tiny": no matches for kind "PyTorchJob"'
    env = fake_kubectl(
        tmp_path / "bin", f"echo '{error}' >&2\necho 'ensure CRDs are installed first' >&2\nexit 1"
    )
    proc = submit(tmp_path, "--nodes", "4", *GOOD_LAYOUT, "--apply", env=env)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"meshforge: kubectl apply failed: {error}"]


# -- locked down (issue 26) -----------------------------------------------------------


def test_secrets_service_account_token_and_the_network_policy_from_the_command_line(tmp_path):
    proc = submit(
        tmp_path,
        *("--nodes", "2", *GOOD_LAYOUT, "--namespace", "ml"),
        *("--secret", "wandb-key", "--secret", "s3-reader", "--service-account-token"),
    )
    assert proc.returncode == 0, proc.stderr
    folder = tmp_path / "run" / "k8s"
    (policy,) = yaml.safe_load_all((folder / "networkpolicy.yaml").read_text())
    assert f"wrote {folder / 'networkpolicy.yaml'} (NetworkPolicy tiny-pods-only)" in proc.stdout
    _, job = manifests(folder)
    assert policy["metadata"]["namespace"] == "ml"
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": selector}}]}]
    for pod in replica_pods(job).values():
        (container,) = pod["containers"]
        assert selector.items() <= pod_labels(job, pod).items()
        assert container["envFrom"] == [
            {"secretRef": {"name": "wandb-key"}},
            {"secretRef": {"name": "s3-reader"}},
        ]
        assert pod["automountServiceAccountToken"] is True
        assert container["securityContext"]["readOnlyRootFilesystem"] is True


def pod_labels(job: dict, pod: dict) -> dict:
    for spec in job["spec"]["pytorchReplicaSpecs"].values():
        if spec["template"]["spec"] is pod:
            return spec["template"]["metadata"]["labels"]
    raise AssertionError("not a pod of the job")


def test_by_default_no_token_no_secret_and_no_root(tmp_path):
    proc = submit(tmp_path, "--nodes", "2", *GOOD_LAYOUT)
    assert proc.returncode == 0, proc.stderr
    _, job = manifests(tmp_path / "run" / "k8s")
    for pod in replica_pods(job).values():
        assert pod["automountServiceAccountToken"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert "envFrom" not in pod["containers"][0]


def test_a_credential_in_the_job_config_is_refused_and_not_echoed(tmp_path):
    proc = submit(
        tmp_path,
        *("--nodes", "2", *GOOD_LAYOUT),
        data={"source": "s3://AKIAEXAMPLE:s3cr3t-Pa55@bucket/shards"},
    )
    line = assert_one_line_error(proc, "data.source", "credential", "--secret")
    assert "s3cr3t-Pa55" not in line + proc.stdout
    assert not (tmp_path / "run").exists()


def test_a_secret_value_on_the_command_line_is_refused_and_not_echoed(tmp_path):
    proc = submit(tmp_path, "--nodes", "2", *GOOD_LAYOUT, "--secret", "WANDB_API_KEY=abc123xyz")
    line = assert_one_line_error(proc, "--secret", "name of a Kubernetes Secret")
    assert "abc123xyz" not in line + proc.stdout
    assert not (tmp_path / "run").exists()


# -- the container image -------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    rows = [line.strip() for line in text.splitlines()]
    return [
        (row.split(None, 1)[0].upper(), row.split(None, 1)[1])
        for row in rows
        if row and not row.startswith("#")
    ]


def test_dockerfile_builds_on_a_pinned_official_pytorch_cuda_image_and_installs_meshforge():
    instructions = dockerfile_instructions()
    froms = [arg for op, arg in instructions if op == "FROM"]
    assert len(froms) == 1
    base = re.fullmatch(
        r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda12\.\d+-cudnn\d+-runtime(@sha256:[0-9a-f]{64})?",
        froms[0],
    )
    assert base, f"not a pinned official PyTorch CUDA runtime image: {froms[0]}"
    runs = " ".join(arg for op, arg in instructions if op == "RUN")
    assert re.search(r"pip install --no-cache-dir \.(\s|$)", runs)
    assert ("ENTRYPOINT", '["meshforge"]') in instructions
    env = " ".join(arg for op, arg in instructions if op == "ENV")
    assert "PYTHONUNBUFFERED=1" in env


def test_the_image_runs_as_a_non_root_user_it_creates():
    instructions = dockerfile_instructions()
    users = [arg for op, arg in instructions if op == "USER"]
    assert users == ["1000:1000"]  # the last USER wins: jobs never run as root
    runs = " ".join(arg for op, arg in instructions if op == "RUN")
    assert re.search(r"useradd --uid 1000 --gid 1000 ", runs)
    assert [op for op, _ in instructions].index("USER") > max(
        i for i, (op, _) in enumerate(instructions) if op == "RUN"
    )  # installed as root, run as the user


def test_dockerignore_keeps_local_state_out_of_the_build_context():
    ignored = {
        line.strip() for line in (REPO / ".dockerignore").read_text().splitlines() if line.strip()
    }
    assert {".venv", ".git", "runs", "**/__pycache__", ".pytest_cache"} <= ignored


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_image_tags_the_build_with_the_package_version():
    import tomllib

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    dry = subprocess.run(
        ["make", "--no-print-directory", "-n", "image"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.strip() == f"docker build -t meshforge:{version} ."
