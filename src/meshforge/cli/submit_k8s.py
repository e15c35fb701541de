"""`meshforge submit k8s`: manifests for the Kubeflow training operator (PyTorchJob)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from meshforge.cli.submit import submit_app
from meshforge.rundir.outputs import claim


@submit_app.command("k8s")
def submit_k8s(
    config: Annotated[Path, typer.Argument(help="Job config (YAML).")],
    nodes: Annotated[
        str,
        typer.Option("--nodes", help="Pods: N (master + N-1 workers), or MIN:MAX for elastic."),
    ],
    gpus_per_node: Annotated[
        int, typer.Option("--gpus-per-node", help="GPUs per pod, one process each; 0: CPU only.")
    ],
    image: Annotated[str, typer.Option("--image", help="Container image (pin a digest).")],
    namespace: Annotated[
        str | None, typer.Option("--namespace", help="Namespace (default: kubectl's).")
    ] = None,
    output: Annotated[
        Path | None, typer.Option("--output", help="Manifest folder (default RUN_DIR/k8s).")
    ] = None,
    apply: Annotated[bool, typer.Option("--apply", help="Run `kubectl apply -f` on them.")] = False,
    run_dir: Annotated[
        Path | None,
        typer.Option("--run-dir", help="Run directory in the pods (relative: under /workspace)."),
    ] = None,
    overrides: Annotated[
        list[str] | None, typer.Option("--set", help="Override a config key: KEY.PATH=VALUE.")
    ] = None,
    iface: Annotated[
        str, typer.Option("--iface", help="NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME.")
    ] = "eth0",
    nproc_per_node: Annotated[
        int | None, typer.Option("--nproc-per-node", help="Processes per CPU-only pod.")
    ] = None,
    shm_size: Annotated[
        str | None, typer.Option("--shm-size", help="/dev/shm cap (default 1Gi per process).")
    ] = None,
    max_restarts: Annotated[
        int | None, typer.Option("--max-restarts", help="Elastic jobs: restarts (default 3).")
    ] = None,
    pvc: Annotated[
        str | None, typer.Option("--pvc", help="PersistentVolumeClaim mounted at the run dir.")
    ] = None,
    secrets: Annotated[
        list[str] | None,
        typer.Option(
            "--secret",
            help="A Kubernetes Secret (its name) whose keys become the pods' environment "
            "(WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, ...); repeatable.",
        ),
    ] = None,
    service_account_token: Annotated[
        bool,
        typer.Option(
            "--service-account-token",
            help="Mount the service account's API token in the pods (off: they need none).",
        ),
    ] = False,
) -> None:
    """Write a ConfigMap and a Kubeflow PyTorchJob for CONFIG; apply them with --apply."""
    from meshforge.config import load_config
    from meshforge.launch import kubernetes as k8s

    cfg = load_config(config, overrides or [])
    run_dir = run_dir or Path("runs") / cfg.name
    job = k8s.make_job(
        cfg,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        image=image,
        run_dir=run_dir.as_posix(),
        namespace=namespace,
        iface=iface,
        nproc_per_node=nproc_per_node,
        shm_size=shm_size,
        max_restarts=max_restarts,
        pvc=pvc,
        secrets=secrets,
        service_account_token=service_account_token,
    )
    if apply:
        k8s.require_kubectl()  # before anything is written
    manifests = k8s.build_manifests(cfg, job)
    if output is None:  # RUN_DIR/k8s is meshforge's, for --fresh (rundir/outputs.py)
        claim(run_dir, "k8s")
    paths = k8s.write_manifests(manifests, output or run_dir / "k8s")
    name = manifests.pytorch_job["metadata"]["name"]
    for path, doc in zip(paths, manifests.files().values(), strict=True):
        what = f": {k8s.describe(job)}" if doc is manifests.pytorch_job else ""
        print(f"meshforge: wrote {path} ({doc['kind']} {doc['metadata']['name']}{what})")
    if not apply:
        print(f"meshforge: submit with: {k8s.shell_line(k8s.apply_command(paths))}")
        return
    try:
        sys.stdout.write(k8s.kubectl_apply(paths))
    except k8s.ApplyFailed as exc:
        print(f"meshforge: kubectl apply failed: {exc}", file=sys.stderr)
        raise typer.Exit(1) from None
    ns = f" -n {namespace}" if namespace else ""
    print(f"meshforge: submitted PyTorchJob {name}; follow it: kubectl get pytorchjob {name}{ns}")
