"""A run directory is data, possibly someone else's: reading it never imports the code its
config.yaml names unless the user says so (--trust-model-code), every path its records
name stays inside it, `--fresh` removes only what meshforge recorded writing (never
through a symlink), and a job's name cannot choose a directory outside runs/.

All in-process, no process started (the CLI's exit code and one line: tests/integration/
test_received_run_dir.py)."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from meshforge.config import build_config, save_config
from meshforge.errors import ConfigError, DataError
from meshforge.rundir.checkpoints import (
    MANIFEST,
    committed_checkpoints,
    is_committed,
    step_dir_name,
    verify,
    write_manifest,
)
from meshforge.rundir.files import earlier_run, remove_earlier_run
from meshforge.rundir.outputs import (
    LOCK_FILE,
    OUTPUTS_FILE,
    claim,
    claim_all,
    claim_dir,
    recorded_outputs,
)
from meshforge.rundir.paths import confined

EVIL = "evil_factory_unit"
EXAMPLES = (
    Path(__file__).resolve().parents[2] / "examples"
)  # a module that, imported, writes a marker file


@pytest.fixture
def received(tmp_path, monkeypatch):
    """A run directory someone sent: its config.yaml names a factory whose module, on
    the import path, would write MARKER when imported."""
    code = tmp_path / "code"
    code.mkdir()
    marker = tmp_path / "marker"
    (code / f"{EVIL}.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "def build(**kwargs):\n    raise SystemExit('factory called')\n"
    )
    monkeypatch.syspath_prepend(str(code))
    monkeypatch.chdir(code)  # import_object adds the working directory to sys.path too
    run_dir = tmp_path / "received"
    run_dir.mkdir()
    save_config(build_config({"model": {"name": f"{EVIL}:build"}}), run_dir / "config.yaml")
    (run_dir / "report.json").write_text(
        json.dumps(
            {
                "status": "completed",
                "steps": 4,
                "world_size": 2,
                "wall_time_s": 3600.0,
                "step_time_s": 900.0,
            }
        )
    )
    yield run_dir, marker
    assert not marker.exists(), "the run directory's code was imported"
    assert EVIL not in sys.modules


# -- the job's name -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["../..", "/abs/path", "..", ".", "a/b", "runs/../x", ""])
def test_a_job_name_that_is_not_a_plain_name_is_refused_in_one_line(name):
    with pytest.raises(ConfigError) as caught:
        build_config({"name": name})
    message = str(caught.value)
    assert "\n" not in message and "not a plain name" in message and repr(name) in message


@pytest.mark.parametrize("name", ["gpt-tiny", "job", "run_1.v2", "A-b.C_9"])
def test_a_plain_job_name_is_accepted(name):
    assert build_config({"name": name}).name == name


# -- code a run directory names -----------------------------------------------------


def test_export_refuses_a_received_factory_without_trust_naming_it_and_the_flag(received):
    from meshforge.train.run_export import export_run

    run_dir, _ = received
    for fmt in ("torch", "safetensors"):
        with pytest.raises(ConfigError) as caught:
            export_run(run_dir, fmt)
        line = str(caught.value)
        assert "\n" not in line
        assert f"model.name={EVIL}:build" in line and "--trust-model-code" in line


def test_sample_never_builds_a_received_factory(received):
    from meshforge.cli.sample import sample

    run_dir, _ = received
    with pytest.raises(ConfigError, match=f"{EVIL}:build is a user's factory"):
        sample(run_dir, prompt="def ", tokens=1, temperature=0.0, top_k=0, seed=0, step=None,
               tokenizer_file=None)  # fmt: skip


def test_load_saved_refuses_a_factory_without_trust(received):
    from meshforge.train.saved_run import load_saved, run_config

    run_dir, _ = received
    checkpoint = run_dir / "checkpoints" / step_dir_name(4)
    with pytest.raises(ConfigError, match="--trust-model-code"):
        load_saved(run_config(run_dir), 4, checkpoint)


def test_the_viewers_read_a_received_run_without_its_code(received, tmp_path):
    from meshforge.cost.cluster import load_cluster
    from meshforge.cost.run import run_cost_from_report
    from meshforge.cost.tco import tco
    from meshforge.health.diagnose import diagnose_run
    from meshforge.report.html import build_html
    from meshforge.report.top import check_run_dir, render_frame

    run_dir, _ = received
    assert EVIL in build_html([run_dir])  # its config is shown, as text
    assert diagnose_run(run_dir)["run_dir"]
    assert "completed" in render_frame(check_run_dir(run_dir))
    costs = tco(load_cluster(EXAMPLES / "cluster.yaml"))
    assert run_cost_from_report(run_dir, costs).gpu_hours > 0


def test_resuming_with_your_own_job_never_imports_the_run_directorys_factory(received):
    from meshforge.launch.train import prepare_job

    run_dir, _ = received
    job = run_dir.parent / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "mine", "train": {"steps": 4}}))
    with pytest.raises(ConfigError, match=f"another model .*model.name '{EVIL}:build' -> 'gpt'"):
        prepare_job(job, [], nproc_per_node=1, run_dir=run_dir)


# -- paths a run directory names ----------------------------------------------------


def _checkpoint(run_dir: Path, step: int = 10) -> Path:
    directory = run_dir / "checkpoints" / step_dir_name(step)
    directory.mkdir(parents=True)
    (directory / "__0_0.distcp").write_bytes(b"shard")
    write_manifest(directory, step)
    return directory


@pytest.mark.parametrize("name", ["../../secret", "/etc/hostname", "a/../../secret", "out"])
def test_a_manifest_naming_a_path_out_of_its_checkpoint_is_a_one_line_data_error(tmp_path, name):
    secret = tmp_path / "secret"
    secret.write_bytes(b"secret")
    run_dir = tmp_path / "run"
    directory = _checkpoint(run_dir)
    if name == "out":  # a symlink in the checkpoint, to a file outside it
        (directory / "out").symlink_to(secret)
    manifest = json.loads((directory / MANIFEST).read_text())
    manifest["files"][name] = {"sha256": "0" * 64, "bytes": 6}
    (directory / MANIFEST).write_text(json.dumps(manifest))
    for check in (verify, is_committed):
        with pytest.raises(DataError) as caught:
            check(directory)
        assert "\n" not in str(caught.value) and repr(name) in str(caught.value)
    with pytest.raises(DataError):
        committed_checkpoints(run_dir)
    with pytest.raises(DataError):  # a launch into it: exit 2 before anything is written
        earlier_run(run_dir)
    assert secret.read_bytes() == b"secret"


def test_confined_keeps_paths_inside_and_names_what_leaves(tmp_path):
    (tmp_path / "sub").mkdir()
    assert confined(tmp_path, "sub/file", "a record") == tmp_path / "sub" / "file"
    (tmp_path / "link").symlink_to(tmp_path.parent)
    for name, problem in [("../x", "out of its directory"), ("/x", "absolute"),
                          ("link/x", "symlink"), (7, "not a relative path")]:  # fmt: skip
        with pytest.raises(DataError, match=problem):
            confined(tmp_path, name, "a record")


# -- --fresh removes what meshforge recorded writing --------------------------------


def _outside(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A folder outside the run directory (another project's), with files named as
    meshforge's own would be."""
    home = tmp_path / "home"
    files = {"run-1/files/a.txt": "theirs", "latest-run": "theirs", "step-00000001/x": "theirs",
             "meshforge-run-id": "theirs", "debug.log": "theirs"}  # fmt: skip
    for name, text in files.items():
        (home / name).parent.mkdir(parents=True, exist_ok=True)
        (home / name).write_text(text)
    return home, files


def test_fresh_removes_what_meshforge_recorded_and_keeps_the_rest_and_every_symlink(tmp_path):
    home, files = _outside(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_FILE).write_text("")
    # there before meshforge: a file named as meshforge's, folders of yours, symlinks
    (run_dir / "trace.json").write_text("mine")
    (run_dir / "notes").mkdir()
    (run_dir / "wandb").symlink_to(home)
    (run_dir / "tensorboard").symlink_to(home)
    claim_all(run_dir, ["config.yaml", "metrics.jsonl", "logs", "checkpoints", "trace.json",
                        "system"])  # fmt: skip
    for link in ("wandb", "tensorboard"):  # never written through: the launch is refused
        with pytest.raises(ConfigError, match=f"{link} is a symbolic link"):
            claim(run_dir, link)
    assert recorded_outputs(run_dir) == {"config.yaml", "metrics.jsonl", "logs", "checkpoints",
                                         "system"}  # fmt: skip
    (run_dir / "config.yaml").write_text("name: x\nmodel: {}\ndata: {}\ntrain: {}\n")
    (run_dir / "metrics.jsonl").write_text("{}\n")
    _checkpoint(run_dir, 10)
    (run_dir / "checkpoints" / "step-00000020").symlink_to(home / "step-00000001")
    claim_dir(run_dir, "logs")
    (run_dir / "logs" / "rank-0.log").write_text("x")
    (run_dir / "logs" / "mine.txt").write_text("mine")

    line = remove_earlier_run(run_dir)

    assert line is not None and "\n" not in line
    assert line.startswith(f"meshforge: --fresh: removed the earlier run in {run_dir} ")
    for kept in ("trace.json", "notes", "wandb (a symlink, not followed)",
                 "tensorboard (a symlink, not followed)", "logs/mine.txt",
                 "checkpoints/step-00000020"):  # fmt: skip
        assert kept in line, (kept, line)
    assert all((home / name).read_text() == text for name, text in files.items())
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(
        [LOCK_FILE, OUTPUTS_FILE, "trace.json", "notes", "wandb", "tensorboard", "logs",
         "checkpoints"])  # fmt: skip
    assert (run_dir / "trace.json").read_text() == "mine"
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["mine.txt"]
    assert (run_dir / "wandb").is_symlink() and (
        run_dir / "checkpoints" / "step-00000020"
    ).is_symlink()
    assert recorded_outputs(run_dir) == {"logs", "checkpoints"}  # what stays of meshforge's
    assert "no record" not in line


def test_fresh_in_an_older_run_directory_follows_no_symlink_and_says_so(tmp_path):
    home, files = _outside(tmp_path)
    run_dir = tmp_path / "run"
    _checkpoint(run_dir, 10)
    (run_dir / "metrics.jsonl").write_text("{}\n")
    (run_dir / "config.yaml").write_text("name: x\nmodel: {}\ndata: {}\ntrain: {}\n")
    (run_dir / "wandb").symlink_to(home)  # a wandb folder pointing at a home directory
    (run_dir / "system").symlink_to(home)

    line = remove_earlier_run(run_dir)

    assert line is not None and "kept no record of what meshforge wrote" in line
    assert "wandb (a symlink, not followed)" in line and "system (a symlink" in line
    assert all((home / name).read_text() == text for name, text in files.items())
    assert sorted(p.name for p in run_dir.iterdir()) == ["system", "wandb"]
    assert recorded_outputs(run_dir) is None


def test_a_claim_records_only_what_is_not_there_and_adopts_an_older_runs_entries(tmp_path):
    run_dir = tmp_path / "run"
    _checkpoint(run_dir, 10)  # an older meshforge's run: no record
    (run_dir / "metrics.jsonl").write_text("{}\n")
    (run_dir / "notes.txt").write_text("mine")
    (run_dir / "logs").symlink_to(tmp_path)
    assert claim(run_dir, "config.yaml") is True  # not there: meshforge's from now on
    assert claim(run_dir, "notes.txt") is False  # yours, there before
    with pytest.raises(ConfigError, match="logs is a symbolic link"):
        claim(run_dir, "logs")  # a symlink is never meshforge's, never written through
    assert recorded_outputs(run_dir) == {"checkpoints", "metrics.jsonl", "config.yaml"}
    with pytest.raises(ValueError):
        claim(run_dir, "../elsewhere")
    assert earlier_run(run_dir) is not None and earlier_run(run_dir).checkpoints == [10]


def test_dcp_metadata_naming_a_shard_file_out_of_its_checkpoint_is_refused(tmp_path):
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp

    from meshforge.train.checkpoint import read_dcp

    checkpoint = tmp_path / "step"
    with warnings.catch_warnings():  # DCP warns that it runs without a process group
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(3)}, checkpoint_id=str(checkpoint))
    (tmp_path / "secret").write_bytes(b"secret")
    metadata = pickle.loads((checkpoint / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../secret"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    state = {"w": torch.zeros(3)}
    with pytest.raises(DataError, match="'../secret', a path out of its directory"):
        read_dcp(state, checkpoint)
    assert torch.equal(state["w"], torch.zeros(3))


def test_fresh_keeps_folders_of_yours_in_checkpoints_that_are_not_named_as_steps(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    claim_all(run_dir, ["config.yaml", "checkpoints"])
    (run_dir / "config.yaml").write_text("name: x\nmodel: {}\ndata: {}\ntrain: {}\n")
    _checkpoint(run_dir, 10)
    (run_dir / "checkpoints" / "step-mine").mkdir()
    (run_dir / "checkpoints" / "step-mine" / "w.txt").write_text("mine")

    line = remove_earlier_run(run_dir)

    assert line is not None and "checkpoints/step-mine" in line
    assert (run_dir / "checkpoints" / "step-mine" / "w.txt").read_text() == "mine"
    assert not (run_dir / "checkpoints" / "step-00000010").exists()


def test_fresh_in_a_folder_that_never_held_a_meshforge_run_removes_nothing(tmp_path):
    folder = tmp_path / "project"
    folder.mkdir()
    mine = {"config.yaml": "kind: Pod\n", "metrics.jsonl": "{}\n", "report.html": "<p>"}
    for name, text in mine.items():
        (folder / name).write_text(text)
    (folder / "logs").mkdir()
    (folder / "logs" / "rank-0.log").write_text("mine")

    with pytest.raises(ConfigError, match="is not a meshforge run") as err:
        remove_earlier_run(folder)

    assert "\n" not in str(err.value) and "nothing removed" in str(err.value)
    assert all((folder / name).read_text() == text for name, text in mine.items())
    assert (folder / "logs" / "rank-0.log").read_text() == "mine"
