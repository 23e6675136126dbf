"""Resume and crash safety beyond the kill -9 tests of test_runner / test_engine / test_detection_attacks: a run cut
inside a batch's write (a torn line, the rest of the batch missing, its images already saved) in every family and
setting, ``--fresh`` against a run still holding the lock, and inputs changed under the same config."""
import json
from pathlib import Path

import pytest
import torch

from blackboxbench.errors import BenchError
from blackboxbench.prep.data import digits
from blackboxbench.prep.models import _digits_model
from blackboxbench.registry import DATASET, MODEL
from blackboxbench.runner import RunLock, Session, run_experiment

from test_engine import _exp, _records

SHIFT = {"weights": 0.0, "images": 0}  # what the test inputs below change between a killed run and its rerun


@MODEL.register("test_resume_mlp", dataset="digits")
def resume_mlp(data_root=None):
    """The digits MLP, its weights moved by ``SHIFT["weights"]`` (a weights file replaced under one config)."""
    model = _digits_model("digits_mlp", True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(SHIFT["weights"])
    return model


@DATASET.register("test_resume_digits", ranges={"n": "int [1, inf)"})
def resume_digits(data_root=None, *, n=None):
    """The digits test images, rolled by ``SHIFT["images"]`` samples (another data root under one config)."""
    ds = digits(data_root, n=None)
    ds.x, ds.y = ds.x.roll(SHIFT["images"], 0)[:n], ds.y.roll(SHIFT["images"], 0)[:n]
    return ds


def _run(tmp_path, **kw):
    run_dir, _ = run_experiment(_exp(tmp_path, **kw), progress=False, session=Session())
    return Path(run_dir)


def _images(run_dir):
    return {p.name: p.read_bytes() for p in sorted((run_dir / "adv").glob("*.png"))}


def _cut(run_dir, keep):
    """The state a kill -9 inside a write leaves: ``keep`` complete lines, half of the next, the later samples'
    images (saved before their lines) on disk."""
    lines = (run_dir / "records.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "records.jsonl").write_text("".join(lines[:keep]) + lines[keep][: len(lines[keep]) // 2])


QUERY = {"model": "digits_mlp", "attack": "square_linf", "batch_size": 4, "save_adv": True,
         "threat": {"norm": "linf", "eps": 0.2, "max_queries": 150}, "dataset": {"name": "digits", "n": 12}}
TRANSFER = {"attack": {"recipe": "mi_fgsm", "hyper": {"iterations": 5}}, "surrogates": ["digits_cnn"],
            "targets": ["digits_mlp", {"name": "digits_cnn", "defense": {"name": "rnd", "sigma": 0.05}}],
            "batch_size": 5, "save_adv": True, "threat": {"norm": "linf", "eps": 0.2},
            "dataset": {"name": "digits", "n": 12}}
CASES = {
    "score": QUERY,
    "decision": dict(QUERY, attack="hsja_linf", threat={"norm": "linf", "eps": 0.2, "max_queries": 200}),
    "score-rnd": dict(QUERY, defense={"name": "rnd", "sigma": 0.05}),
    "score-rnd-fixed-batch": dict(QUERY, defense={"name": "rnd", "sigma": 0.05}, fixed_batch=3),
    "score-aaa": dict(QUERY, defense={"name": "aaa_linear", "iterations": 20}),
    "transfer": TRANSFER,
    "transfer-fixed-batch": dict(TRANSFER, fixed_batch=2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_run_cut_inside_a_batch_resumes_to_the_uninterrupted_records_and_images(tmp_path, case):
    """Cut inside the second batch's write (a transfer batch half written), the rerun redoes exactly the missing
    samples: every field of every record (queries, confirmation, per-target results) and every saved image equal
    the uninterrupted run's, with no sample lost or duplicated."""
    run_dir = _run(tmp_path, **CASES[case])
    want, images = _records(run_dir), _images(run_dir)
    assert images and len(want) == 12
    _cut(run_dir, 6)
    assert _run(tmp_path, **CASES[case]) == run_dir
    lines = [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines()]
    assert sorted(r["index"] for r in lines) == list(range(12))
    assert _records(run_dir) == want and _images(run_dir) == images


def test_fresh_does_not_clear_a_run_another_process_holds(tmp_path):
    """``--fresh`` on a run folder another process holds is the lock's one-line error, and the holder's records stay:
    it used to delete the folder first, and then run beside the holder, which went on writing to a deleted file."""
    run_dir = _run(tmp_path, **QUERY)
    want = _records(run_dir)
    with RunLock(run_dir):  # another process's run on the folder (flock: a second open file conflicts)
        with pytest.raises(BenchError, match="is in use by pid"):
            run_experiment(_exp(tmp_path, **QUERY), progress=False, session=Session(), fresh=True)
    assert _records(run_dir) == want and _images(run_dir)
    _run(tmp_path, **QUERY)
    (run_dir / "stale.txt").write_text("x")
    run_experiment(_exp(tmp_path, **QUERY), progress=False, session=Session(), fresh=True)  # free: it clears
    assert not (run_dir / "stale.txt").exists() and _records(run_dir) == want


@pytest.mark.parametrize("changed,key", [("weights", "model"), ("images", "dataset")])
def test_a_resume_on_other_inputs_under_the_same_config_is_refused(tmp_path, changed, key):
    """A run killed, then rerun after its weights file or data root changed (same config, same run folder): a
    one-line error naming inputs.json and what changed, never records of two models or datasets mixed in one run;
    ``--fresh`` starts over on the new inputs."""
    exp = dict(QUERY, model="test_resume_mlp", dataset={"name": "test_resume_digits", "n": 12})
    try:
        run_dir = _run(tmp_path, **exp)
        _cut(run_dir, 6)
        killed = (run_dir / "records.jsonl").read_text()
        SHIFT[changed] = 0.01 if changed == "weights" else 3
        with pytest.raises(BenchError, match=rf"inputs.json: {key} differs .* 6 records"):
            _run(tmp_path, **exp)
        assert (run_dir / "records.jsonl").read_text() == killed  # left as the killed run left it
        run_experiment(_exp(tmp_path, **exp), progress=False, session=Session(), fresh=True)
        _cut(run_dir, 6)
        assert _run(tmp_path, **exp) == run_dir and len(_records(run_dir)) == 12  # same inputs: it resumes
    finally:
        SHIFT.update(weights=0.0, images=0)


def test_images_and_paths_are_on_disk_before_their_records(tmp_path, monkeypatch):
    """A power loss must never leave a record whose image or path file is missing or torn (resume would keep the
    record and never write the image again): every adv PNG and path npz is fsync'ed, with its folder, before its
    record's line is written, and rewrites of the run's files (records on resume, inputs.json, progress.json) are
    fsync'ed before their rename."""
    import os

    import blackboxbench.runner as runner

    synced, real = [], os.fsync

    def fsync(fd):
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if path.suffix in (".png", ".npz"):
            rec = path.parents[1] / "records.jsonl"
            index = int(path.name.split(".")[0])
            done = {json.loads(line)["index"] for line in rec.read_text().splitlines()} if rec.exists() else set()
            assert index not in done, f"{path} synced after its record"
        synced.append(path)
        real(fd)

    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd to name the files fsync'ed")
    monkeypatch.setattr(runner.os, "fsync", fsync)
    run_dir = _run(tmp_path, **dict(QUERY, save_path_every=50))
    images = sorted((run_dir / "adv").glob("*.png"))
    paths = [p.with_suffix(".tmp.npz") for p in sorted((run_dir / "path").glob("*.npz"))]  # synced, then renamed
    assert images and paths and all(p in synced for p in images + paths)
    assert {run_dir / "adv", run_dir / "path", run_dir} <= set(synced)  # the new entries' folders
    assert run_dir / "inputs.json.tmp" in synced  # fsync'ed before the rename
    _cut(run_dir, 6)
    synced.clear()
    _run(tmp_path, **dict(QUERY, save_path_every=50))
    assert run_dir / "records.jsonl.tmp" in synced


def test_input_digests_cover_assets_and_lpips_and_note_the_torch_version(tmp_path):
    """inputs.json lists each asset's content and the LPIPS weights beside the data and the models: an asset file
    replaced under one config is refused on resume like a weights file; an inputs.json written before these were
    listed resumes; another torch version is a warning, not a refusal."""
    from blackboxbench.runner import check_input_digests, input_digests

    data = digits(None, n=4)
    model = _digits_model("digits_mlp", True)
    asset = {"basis": torch.ones(3)}
    lpips = torch.nn.Linear(2, 2)
    before = input_digests(data, {"m": model}, {"b": asset}, lpips)
    assert set(before) == {"dataset", "m", "asset:b", "lpips", "torch"} and before["torch"] == torch.__version__
    path = tmp_path / "inputs.json"
    path.write_text(json.dumps(before))
    check_input_digests(path, input_digests(data, {"m": model}, {"b": {"basis": torch.ones(3)}}, lpips), 5)
    with pytest.raises(BenchError, match=r"inputs.json: asset:b differs .* 5 records"):
        check_input_digests(path, input_digests(data, {"m": model}, {"b": {"basis": torch.zeros(3)}}, lpips), 5)
    with torch.no_grad():
        other = torch.nn.Linear(2, 2)
    with pytest.raises(BenchError, match=r"inputs.json: lpips differs"):
        check_input_digests(path, input_digests(data, {"m": model}, {"b": asset}, other), 5)
    path.write_text(json.dumps({k: before[k] for k in ("dataset", "m")}))  # an older run's file
    check_input_digests(path, before, 5)
    path.write_text(json.dumps(dict(before, torch="1.0")))
    with pytest.warns(UserWarning, match=r"computed with torch 1.0; this is torch"):
        check_input_digests(path, before, 5)


def test_a_written_record_is_in_the_file_at_once(tmp_path, monkeypatch):
    """RecordWriter.write hands each record line to the file at once (flushed), not when a later fsync or the close
    comes: a run killed between two fsyncs keeps every record written before the kill. Read back from the file by
    the resume's own reader while the writer is still open, with fsyncs far apart."""
    import blackboxbench.runner as runner
    from blackboxbench.runner import RecordWriter, read_records

    monkeypatch.setattr(runner, "FSYNC_EVERY_S", 1e9)
    writer = RecordWriter(tmp_path, 0.0, "salt")
    try:
        writer.write([{"index": 0, "v": 1}, {"index": 1, "v": 2}])
        on_disk = read_records(tmp_path / "records.jsonl", {"index": (int,), "v": (int,)}, "salt")
        assert {i: r["v"] for i, r in on_disk.items()} == {0: 1, 1: 2}
    finally:
        writer.close()
