"""`meshforge submit slurm`: one sbatch script per job, one elastic agent per node.

The job lives in its run directory, which every node must see (shared storage):

    RUN_DIR/slurm/job.yaml        the validated job config the agents read
    RUN_DIR/slurm/job.sbatch      the batch script: #SBATCH lines, then one `srun`
    RUN_DIR/slurm/node.sh         what srun runs on every node (one task per node)
    RUN_DIR/slurm/slurm-JOBID.out Slurm's log of the batch script and every node

The batch script runs on the job's first node. It finds that node's address as Slurm
has it (`NodeAddr` from `scontrol show node`, never by resolving a node name, which
need not resolve) and starts one task per node with srun. Each task looks up its own
node's address the same way and runs `meshforge train` with torchrun's flags: c10d
rendezvous at FIRST_NODE_ADDR:PORT, rendezvous id = the Slurm job id, `is_host=1` only
on the first node (it serves the store), `--local-addr` = its own address.

Quoting: every value placed in a shell line goes through `shlex.quote`; values in
#SBATCH lines (which bash reads as comments and sbatch parses with its own rules) are
validated against what Slurm accepts, and the one free-form value there, the log path,
is escaped for sbatch's parser. A line break is refused everywhere, since it would end
a comment and start a command.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from meshforge.errors import ConfigError, MeshforgeError

CLIENT_TOOLS = "install Slurm's client tools (Debian: apt-get install slurm-client)"

# What Slurm accepts, and nothing that a shell or sbatch's directive parser would read
# as anything but a word.
_NAME = r"[A-Za-z0-9_.\-]+"
_PARTITION = re.compile(rf"{_NAME}(,{_NAME})*")  # sbatch takes a comma-separated list
_ACCOUNT = re.compile(_NAME)
# minutes, M:S, H:M:S, D-H, D-H:M, D-H:M:S, or no limit
_TIME = re.compile(r"(\d+-\d+(:\d+){0,2}|\d+(:\d+){0,2}|UNLIMITED|INFINITE)", re.IGNORECASE)
_IFACE = re.compile(r"[A-Za-z0-9_.:\-]{1,15}")  # a Linux interface name

# Slurm job states after which nothing more happens (scontrol's JobState).
FINAL_STATES = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
    "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT", "REVOKED",
}  # fmt: skip


class SlurmError(MeshforgeError):
    """Slurm is missing or refused the job (exit code 2, one line)."""


@dataclass(frozen=True)
class SlurmRequest:
    """What the user asked Slurm for (the #SBATCH lines) and how each node launches."""

    nodes: int
    nproc_per_node: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int | None = None
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    iface: str | None = None
    port: int | None = None  # None: 29500 + SLURM_JOB_ID % 10000, so jobs sharing a node differ
    python: str = sys.executable

    def check(self) -> None:
        """Refuse, naming the option, any value Slurm cannot take."""
        if self.nodes < 1:
            raise ConfigError(f"--nodes must be at least 1 (got {self.nodes})")
        if self.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node must be at least 1 (got {self.nproc_per_node})")
        if self.gpus_per_node < 0:
            raise ConfigError(f"--gpus-per-node cannot be negative (got {self.gpus_per_node})")
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            raise ConfigError(f"--cpus-per-task must be at least 1 (got {self.cpus_per_task})")
        if self.port is not None and not 1 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 1..65535 (got {self.port})")
        for option, value, pattern, what in (
            (
                "--partition",
                self.partition,
                _PARTITION,
                "a list of partition names (letters, digits, _ . -)",
            ),
            ("--account", self.account, _ACCOUNT, "an account name (letters, digits, _ . -)"),
            ("--time", self.time, _TIME, "MINUTES, H:M:S, D-H:M:S or UNLIMITED"),
            ("--iface", self.iface, _IFACE, "a network interface name"),
        ):
            if value is not None and not pattern.fullmatch(value):
                raise ConfigError(f"{option} {value!r} is not {what}")
        if not self.python or any(c in self.python for c in "\n\r\0"):
            raise ConfigError(f"--python {self.python!r} is not a usable path")


@dataclass(frozen=True)
class SlurmJobFiles:
    run_dir: Path
    config: Path
    sbatch: Path
    node_script: Path

    def log(self, job_id: str = "%j") -> Path:  # %j: Slurm's pattern for the job id
        return self.run_dir / "slurm" / f"slurm-{job_id}.out"


def job_files(run_dir: Path) -> SlurmJobFiles:
    run_dir = Path(run_dir).absolute()
    _check_path_for_slurm(run_dir)
    slurm = run_dir / "slurm"
    return SlurmJobFiles(run_dir, slurm / "job.yaml", slurm / "job.sbatch", slurm / "node.sh")


def _check_path_for_slurm(path: Path) -> None:
    text = str(path)
    if any(c in text for c in "\n\r\0"):
        raise ConfigError(f"--run-dir {text!r}: a path for Slurm cannot contain a line break")
    # Slurm reads % in a file name as a pattern (%j: the job id) and a backslash as
    # "no patterns"; `%%` did not come back as a plain % under Slurm 22.05.
    for char in "%\\":
        if char in text:
            raise ConfigError(f"--run-dir {text!r}: a path for Slurm cannot contain {char!r}")


def _directive_value(text: str) -> str:
    """A value for an #SBATCH line, in double quotes: sbatch's parser ends a bare value
    at white space or '#', and inside double quotes reads backslash-quote as a quote."""
    return '"' + text.replace('"', '\\"') + '"'


def job_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.\-]", "-", name)[:64] or "meshforge"


def render_sbatch(req: SlurmRequest, files: SlurmJobFiles, name: str) -> str:
    """The batch script: resources as #SBATCH lines, then one srun over every node."""
    directives = [
        f"--job-name={job_name(name)}",
        f"--nodes={req.nodes}",
        "--ntasks-per-node=1",
        f"--output={_directive_value(str(files.log()))}",
    ]
    if req.cpus_per_task is not None:
        directives.append(f"--cpus-per-task={req.cpus_per_task}")
    if req.gpus_per_node > 0:
        directives.append(f"--gres=gpu:{req.gpus_per_node}")
    for option, value in (
        ("--partition", req.partition),
        ("--time", req.time),
        ("--account", req.account),
    ):
        if value is not None:
            directives.append(f"{option}={value}")
    srun = ["srun", '--nodes="$SLURM_JOB_NUM_NODES"', "--ntasks-per-node=1"]
    if req.cpus_per_task is not None:  # since Slurm 22.05 srun does not inherit it
        srun.append(f"--cpus-per-task={req.cpus_per_task}")
    srun += ["--kill-on-bad-exit=1", "--label"]
    node = ["bash", shlex.quote(str(files.node_script)), '"$head_node"', '"$head_addr"', '"$port"']
    lines = [
        "#!/usr/bin/env bash",
        *(f"#SBATCH {d}" for d in directives),
        "# Written by `meshforge submit slurm`: one elastic agent per node, c10d rendezvous",
        "# on the first node. Runs on the first node of the allocation.",
        "set -eu",
        "",
        "# The rendezvous host is the first node, at the address Slurm has for it",
        "# (NodeAddr): node names need not resolve.",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        f"head_addr=$({_NODE_ADDR.format(node='$head_node')})",
        'if [ -z "$head_addr" ]; then',
        '  echo "meshforge: Slurm has no NodeAddr for node $head_node" >&2',
        "  exit 1",
        "fi",
        _port_line(req),
        'echo "meshforge: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST;'
        ' rendezvous at $head_addr:$port"',
        "",
        "# One task per node: node.sh starts that node's elastic agent.",
        " ".join(srun) + " \\",
        "  " + " ".join(node),
        "",
    ]
    return "\n".join(lines)


def _port_line(req: SlurmRequest) -> str:
    """The rendezvous port: the one asked for, else one derived from the job id, so
    two jobs whose first node is the same do not collide."""
    if req.port is not None:
        return f"port={req.port}"
    return "port=$((29500 + SLURM_JOB_ID % 10000))  # --port fixes it"


# This node's address as Slurm has it, from `scontrol show node` (one line with -o).
_NODE_ADDR = """scontrol -o show node "{node}" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p'"""


def render_node_script(req: SlurmRequest, files: SlurmJobFiles) -> str:
    """What srun runs on every node: look up this node's address, start its agent."""
    q = shlex.quote
    train = [
        q(req.python), "-m", "meshforge", "train", q(str(files.config)),
        "--run-dir", q(str(files.run_dir)),
        "--nnodes", str(req.nodes), "--nproc-per-node", str(req.nproc_per_node),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", '"$head_addr:$port"',
        "--rdzv-id", '"$SLURM_JOB_ID"', "--rdzv-conf", '"is_host=$is_host"',
        "--local-addr", '"$node_addr"',
    ]  # fmt: skip
    if req.iface is not None:
        train += ["--iface", q(req.iface)]
    lines = [
        "#!/usr/bin/env bash",
        "# One node of a `meshforge submit slurm` job, started by srun from job.sbatch",
        "# (one task per node): starts this node's elastic agent.",
        "set -eu",
        "head_node=$1",
        "head_addr=$2",
        "port=$3",
        f"node_addr=$({_NODE_ADDR.format(node='$SLURMD_NODENAME')})",
        'if [ -z "$node_addr" ]; then',
        '  echo "meshforge: Slurm has no NodeAddr for node $SLURMD_NODENAME" >&2',
        "  exit 1",
        "fi",
        "# The first node serves the c10d rendezvous store.",
        'is_host=0; if [ "$SLURMD_NODENAME" = "$head_node" ]; then is_host=1; fi',
        "export PYTHONUNBUFFERED=1  # the log follows the run",
    ]
    if req.iface is not None:
        iface = q(req.iface)
        lines.append(f"export GLOO_SOCKET_IFNAME={iface} NCCL_SOCKET_IFNAME={iface}")
    lines.append("exec " + " \\\n  ".join(_chunks(train, 4)))
    return "\n".join(lines) + "\n"


def _chunks(words: list[str], first: int) -> list[str]:
    """`python -m meshforge train CONFIG`, then the flags two words a line."""
    rows = [" ".join(words[: first + 1])]
    rest = words[first + 1 :]
    rows += [" ".join(rest[i : i + 2]) for i in range(0, len(rest), 2)]
    return rows


def write_scripts(req: SlurmRequest, files: SlurmJobFiles, name: str) -> tuple[str, str]:
    """Write job.sbatch and node.sh (the config is written by prepare_job)."""
    sbatch, node = render_sbatch(req, files, name), render_node_script(req, files)
    files.sbatch.parent.mkdir(parents=True, exist_ok=True)
    files.sbatch.write_text(sbatch)
    files.node_script.write_text(node)
    for script in (files.sbatch, files.node_script):  # executable where readable: the umask's
        mode = script.stat().st_mode
        script.chmod(mode | (mode & 0o444) >> 2)
    return sbatch, node


# --- talking to Slurm ----------------------------------------------------------------


def _slurm_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SlurmError(f"{name} not found: {CLIENT_TOOLS}")
    return path


def require_client_tools(wait: bool) -> None:
    """sbatch to submit, scontrol to follow the job: checked before anything is written."""
    _slurm_tool("sbatch")
    if wait:
        _slurm_tool("scontrol")


def _slurm_error(tool: str, proc: subprocess.CompletedProcess) -> SlurmError:
    """Slurm's own complaint in one line: its most specific `error:` line."""
    lines = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error:" in ln] or lines
    detail = errors[0] if errors else f"exit code {proc.returncode}"
    detail = re.sub(rf"^{tool}: error: ", "", detail)
    return SlurmError(f"{tool} refused the job: {detail}")


def submit(script: Path, timeout_s: float = 60) -> str:
    """`sbatch --parsable SCRIPT`; the job id."""
    argv = [_slurm_tool("sbatch"), "--parsable", str(script)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"sbatch did not answer within {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        raise _slurm_error("sbatch", proc)
    job_id = proc.stdout.strip().split(";")[0]  # "ID" or "ID;CLUSTER"
    if not job_id.isdigit():
        raise SlurmError(f"sbatch answered {proc.stdout.strip()!r}, not a job id")
    return job_id


@dataclass(frozen=True)
class JobStatus:
    state: str  # scontrol's JobState, e.g. RUNNING, COMPLETED, FAILED
    exit_code: str  # "STATUS:SIGNAL"

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES


def job_status(job_id: str, timeout_s: float = 30) -> JobStatus | None:
    """The job's state from `scontrol show job`; None when Slurm does not answer."""
    argv = [_slurm_tool("scontrol"), "-o", "show", "job", job_id]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None
    if proc.returncode != 0:
        return None
    fields = dict(w.split("=", 1) for w in proc.stdout.split() if "=" in w)
    if "JobState" not in fields:
        return None
    return JobStatus(fields["JobState"], fields.get("ExitCode", "?"))


def wait_for_job(
    job_id: str,
    poll_s: float = 1.0,
    give_up_after_s: float = 120,
    on_change: Callable[[JobStatus], None] | None = None,
) -> JobStatus:
    """Poll every `poll_s` until the job reaches a final state (sbatch --wait polls
    only every ~10 s). Gives up when Slurm has not answered for `give_up_after_s`."""
    last: JobStatus | None = None
    silent_since = time.monotonic()
    while True:
        status = job_status(job_id)
        if status is None:
            if time.monotonic() - silent_since > give_up_after_s:
                raise SlurmError(
                    f"lost track of Slurm job {job_id}: scontrol gave no state for "
                    f"{give_up_after_s:.0f} s (see squeue -j {job_id})"
                )
        else:
            silent_since = time.monotonic()
            if on_change is not None and status != last:
                on_change(status)
            last = status
            if status.final:
                return status
        time.sleep(poll_s)
