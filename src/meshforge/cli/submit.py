"""`meshforge submit SCHEDULER CONFIG ...`: hand a job to Slurm, MPI or Kubernetes.

Each scheduler's command lives in its own module (submit_slurm, submit_mpi,
submit_k8s) and registers on `submit_app`; cli/__init__.py imports them after this
module, so none of them imports the other way round."""

from __future__ import annotations

import typer

from meshforge.cli.app import app

try:  # typer >= 0.22 vendors click; older releases use the click package
    from typer._click import exceptions as click_exc
    from typer.core import TyperGroup
except ImportError:  # pragma: no cover
    from click import exceptions as click_exc
    from typer.core import TyperGroup

SCHEDULERS = ("slurm", "mpi", "k8s")


class _SchedulerGroup(TyperGroup):
    """A group whose unknown subcommand reads as an unknown scheduler, in one line."""

    def resolve_command(self, ctx, args):
        if args and not args[0].startswith("-") and self.get_command(ctx, args[0]) is None:
            raise click_exc.UsageError(
                f"unknown scheduler {args[0]!r}: choose one of {', '.join(SCHEDULERS)}"
            )
        return super().resolve_command(ctx, args)


submit_app = typer.Typer(
    cls=_SchedulerGroup,
    help="Send a job to a scheduler: slurm (sbatch), mpi (mpirun) or k8s (Kubeflow PyTorchJob).",
    no_args_is_help=True,
)
app.add_typer(submit_app, name="submit", rich_help_panel="Cluster")
