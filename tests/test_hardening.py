"""No silent wrong numbers and runs that cannot collide or escape their folder: NaN models, an audit of every
recorded success against the oracle's own answers, corrupt or edited records, two processes on one run, run
names, class counts, target labels, cumulative wall time."""
import json
import time

import pytest
import torch
from torch import nn

from blackboxbench.cli import main
from blackboxbench.errors import BenchError
from blackboxbench.family import check_outputs
from blackboxbench.oracle import Oracle
from blackboxbench.prep.data import Dataset, digits
from blackboxbench.prep.models import _digits_model
from blackboxbench.registry import DATASET, MODEL

from attack_utils import run_query


class NaNAfter(nn.Module):
    """Finite logits for the first ``k`` forwards, NaN afterwards (a model that breaks mid-run)."""

    def __init__(self, model, k):
        super().__init__()
        self.model, self.k, self.calls = model, k, 0

    def forward(self, x):
        self.calls += 1
        out = self.model(x)
        return out if self.calls <= self.k else torch.full_like(out, float("nan"))


@MODEL.register("test_nan_after_3", dataset="digits")
def nan_after_3(data_root=None):
    return NaNAfter(_digits_model("digits_mlp", True), 3)


@MODEL.register("test_all_nan", dataset="digits")
def all_nan(data_root=None):
    return NaNAfter(_digits_model("digits_mlp", True), 0)


@DATASET.register("test_three_classes", source="test")
def three_classes(data_root=None, *, n=None):
    d = digits(n=n)
    keep = d.y < 3
    return Dataset("test_three_classes", d.x[keep], d.y[keep], 3)


def config(tmp_path, text, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(text.replace("OUT2", str(tmp_path / "out2")).replace("OUT", str(tmp_path / "out")))
    return path


RUN = """
dataset: {name: digits, n: 16}
model: digits_mlp
attack: square_linf
threat: {norm: linf, eps: 0.2, max_queries: 100}
device: cpu
batch_size: 8
output_dir: OUT
"""


def one_line_error(capsys, path, *phrases):
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert all(p in err for p in (str(path), *phrases)), err
    return err


@pytest.mark.parametrize("model", ["test_nan_after_3", "test_all_nan"])
def test_nan_logits_are_refused_never_read_as_class_zero(tmp_path, capsys, model):
    path = config(tmp_path, RUN.replace("model: digits_mlp", f"model: {model}").replace("square_linf", "hsja_linf"))
    assert main(["run", str(path), "--quiet"]) == 2
    one_line_error(capsys, "non-finite logits", "NaN is never read as a class")
    assert not list((tmp_path / "out").rglob("summary.json"))


def test_nan_images_fail_the_output_guard():
    x = torch.full((2, 1, 2, 2), 128 / 255)
    bad = x.clone()
    bad[1, 0, 0, 0] = float("nan")
    with pytest.raises(BenchError, match="non-finite"):
        check_outputs(bad, x, 0.1, "linf", "t")
    check_outputs(x, x, 0.1, "linf", "t")


AUDIT = [("rays", "linf", 0.2, 50), ("simba_pixel", "l2", 1.5, 50), ("nes", "linf", 0.2, 50),
         ("square_linf", "linf", 0.2, 20), ("square_l2", "l2", 1.5, 20), ("simba_dct", "linf", 0.2, 50),
         ("hsja_linf", "linf", 0.2, 50), ("hsja_l2", "l2", 1.5, 50), ("hsja_linf", "linf", 0.2, 300),
         ("rays", "linf", 0.2, 300)]


@pytest.mark.parametrize("name,norm,eps,budget", AUDIT, ids=[f"{a[0]}-{a[1]}-{a[3]}" for a in AUDIT])
def test_every_success_is_an_oracle_answer_on_the_returned_image(monkeypatch, name, norm, eps, budget):
    """A logging oracle records every image it answers and the answer; each recorded success must be the returned
    image itself, answered adversarial for that sample, within its budget (the issue found 4 of 328 audited
    successes the oracle never saw, confirming queries refused at the exact budget)."""
    seen = {}
    ask = Oracle._ask

    def logging(self, x, idx, distinct):
        answer, ok = ask(self, x, idx, distinct)
        for row in ok.nonzero().squeeze(1).tolist():
            seen.setdefault(int(idx[row]), []).append((x[row].clone(), answer[row].clone()))
        return answer, ok

    monkeypatch.setattr(Oracle, "_ask", logging)
    ds = digits(n=40)
    model = _digits_model("digits_mlp", True)
    problem, res = run_query(name, model, ds.x, ds.y, eps, norm, budget=budget)
    wins = res.success.nonzero().squeeze(1).tolist()
    assert res.success.any() or budget <= 50
    for i in wins:
        answers = [a for img, a in seen.get(i, []) if torch.equal(img, res.x_adv[i])]
        assert answers, f"sample {i}: success never answered by the oracle on the returned image"
        labels = torch.stack([a.argmax() if a.dtype.is_floating_point else a for a in answers])
        assert bool((labels != ds.y[i]).any()), f"sample {i}: the oracle never saw the returned image adversarial"
    assert (res.queries <= budget).all()


def _run_dir(tmp_path):
    return next((tmp_path / "out").glob("*/records.jsonl")).parent


def _lines(run_dir):
    return (run_dir / "records.jsonl").read_text().splitlines()


@pytest.mark.parametrize("corrupt,phrase", [
    (lambda lines: lines[:2] + [lines[2].replace('"success": true', '"success": false')] + lines[3:], "checksum"),
    (lambda lines: lines + ["[1, 2]"], "not a record of this run"),
    (lambda lines: lines + ['{"foo": 1}'], "not a record of this run"),
    (lambda lines: lines + [lines[0].replace('"queries": ', '"queries": 1')], "checksum"),
], ids=["flipped-success", "list-line", "foreign-object", "edited-duplicate"])
def test_corrupt_records_are_refused_with_the_line(tmp_path, capsys, corrupt, phrase):
    path = config(tmp_path, RUN)
    assert main(["run", str(path), "--quiet"]) == 0
    run_dir = _run_dir(tmp_path)
    lines = _lines(run_dir)
    flipped = next(i for i, line in enumerate(lines) if '"success": true' in line)
    lines[2], lines[flipped] = lines[flipped], lines[2]  # a success on line 3 for the flip case
    (run_dir / "records.jsonl").write_text("\n".join(corrupt(lines)) + "\n")
    capsys.readouterr()
    assert main(["run", str(path), "--quiet"]) == 2
    one_line_error(capsys, "records.jsonl:", phrase)


def test_a_conflicting_duplicate_is_refused(tmp_path, capsys):
    from blackboxbench.runner import read_records, record_check

    path = tmp_path / "records.jsonl"
    rec = {"index": 0, "label": 1, "target": None, "clean_correct": True, "attacked": True, "l2": 0.0,
           "linf": 0.0, "time": 0.0}
    a, b = dict(rec), dict(rec, l2=1.0)
    a["check"], b["check"] = record_check(a, "h"), record_check(b, "h")
    path.write_text(json.dumps(a) + "\n" + json.dumps(a) + "\n")
    assert len(read_records(path, {"index": (int,)}, "h")) == 1  # an identical duplicate is harmless
    path.write_text(json.dumps(a) + "\n" + json.dumps(b) + "\n")
    with pytest.raises(BenchError, match="second, different record"):
        read_records(path, {"index": (int,)}, "h")
    with pytest.raises(BenchError, match="checksum"):
        read_records(path, {"index": (int,)}, "another run")


def test_two_processes_on_one_run(tmp_path, capsys):
    """A second process on the same run folder gets a one-line error naming the holder; the first finishes with
    every sample recorded once. The first run holds after its first records (:class:`held_run.HeldRun`) until the
    second has failed, so it holds the lock then on any machine: a plain digits run, polled, could end before the
    second started on a fast machine, and one whose model slept 20 ms a call only made that less likely."""
    from held_run import HeldRun

    path = config(tmp_path, RUN)
    with HeldRun(path, tmp_path / "out", at=1) as first:
        first.wait_held()
        assert main(["run", str(path), "--quiet"]) == 2
        one_line_error(capsys, "is in use by pid")
        assert first.release() == 0
    indices = [json.loads(line)["index"] for line in _lines(_run_dir(tmp_path))]
    assert sorted(indices) == list(range(16))


def test_rerun_keeps_the_cumulative_wall_time(tmp_path, monkeypatch):
    """The summary's wall time is the run's, kept by a rerun that adds only its own. Bounds from this test's clock
    around each run, not fixed margins (a fast machine ran the 16 samples in under the 0.05 s once asserted; a loaded
    one's fsync could stretch the rerun past the 1 s once allowed): the first run's record writer sleeps 60 ms once,
    so its wall time exceeds 0.05 s on any machine."""
    from blackboxbench.runner import RecordWriter

    write, slept = RecordWriter.write, []

    def write_slowly(self, records):
        if records and not slept:
            slept.append(time.sleep(0.06))
        write(self, records)

    monkeypatch.setattr(RecordWriter, "write", write_slowly)
    path = config(tmp_path, RUN)
    start = time.perf_counter()
    assert main(["run", str(path), "--quiet"]) == 0
    took = time.perf_counter() - start
    summary = _run_dir(tmp_path) / "summary.json"
    first = json.loads(summary.read_text())["wall_time"]
    # the summary reports the wall time the rerun will start from (else a rerun could report less)
    assert json.loads((summary.parent / "progress.json").read_text())["wall_time"] == first
    assert slept and 0.05 < first <= took
    start = time.perf_counter()
    assert main(["run", str(path), "--quiet"]) == 0
    took = time.perf_counter() - start
    again = json.loads(summary.read_text())["wall_time"]
    assert first <= again <= first + took + 1e-6  # 1e-6: the float sums of the wall time's own arithmetic


@pytest.mark.parametrize("name", ["../../escape", "a/b", "x\ny", "..", "."])
def test_run_names_cannot_escape_output_dir(tmp_path, capsys, name):
    path = config(tmp_path, RUN.replace("n: 16", "n: 4") + f"name: {json.dumps(name)}\n")
    assert main(["run", str(path), "--quiet"]) == 2
    one_line_error(capsys, ":name:", "must be a plain name")
    assert not (tmp_path / "out").exists() and not (tmp_path / "escape").exists()


def test_odd_run_names_are_sanitized_inside_output_dir(tmp_path):
    path = config(tmp_path, RUN.replace("n: 16", "n: 4") + 'name: "my run: v1 (*)"\n')
    assert main(["run", str(path), "--quiet"]) == 0
    runs = [p for p in (tmp_path / "out").iterdir()]
    assert len(runs) == 1 and runs[0].name.startswith("my_run__v1____") and (runs[0] / "summary.json").exists()


def test_class_counts_must_agree(tmp_path, capsys):
    path = config(tmp_path, RUN.replace("name: digits, n: 16", "name: test_three_classes, n: 50"))
    assert main(["run", str(path), "--quiet"]) == 2
    one_line_error(capsys, ":model:", "outputs 10 classes but dataset test_three_classes has 3")
    assert not (tmp_path / "out").exists()


def test_specified_target_out_of_range_fails_before_anything_is_created(tmp_path, capsys):
    text = RUN.replace("max_queries: 100", "max_queries: 100, targeted: true, "
                                           "target_label: {name: specified, label: 10}")
    path = config(tmp_path, text)
    assert main(["run", str(path), "--quiet"]) == 2
    one_line_error(capsys, "threat.target_label", "[0, 10)")
    assert not (tmp_path / "out").exists()


def test_imagefolder_class_subset_takes_the_class_count_from_the_model(tmp_path, capsys):
    """Two folders of digits ('3' and '8') mapped to their true class ids: the run uses the model's 10 classes and
    the true labels; an id the model does not have is a one-line error before anything is created."""
    from PIL import Image

    d = digits(n=60)
    for c in (3, 8):
        folder = tmp_path / "imgs" / str(c)
        folder.mkdir(parents=True)
        for k, i in enumerate((d.y == c).nonzero().squeeze(1)[:3].tolist()):
            Image.fromarray((d.x[i, 0] * 255).round().byte().numpy()).save(folder / f"{k}.png")
    base = RUN.replace("dataset: {name: digits, n: 16}", "dataset: {name: imagefolder, path: imgs, grayscale: true, "
                                                          "classes: {'3': 3, '8': MAPPED}}") + "data_root: ROOT\n"
    path = config(tmp_path, base.replace("MAPPED", "8").replace("ROOT", str(tmp_path)))
    assert main(["run", str(path), "--quiet"]) == 0
    labels = sorted(json.loads(line)["label"] for line in _lines(_run_dir(tmp_path)))
    assert labels == [3, 3, 3, 8, 8, 8]
    path = config(tmp_path, base.replace("MAPPED", "12").replace("ROOT", str(tmp_path)).replace("OUT", "OUT2"),
                  "bad.yaml")
    capsys.readouterr()
    assert main(["run", str(path), "--quiet"]) == 2
    one_line_error(capsys, ":dataset:", "class ids in [0, 10)")
    assert not (tmp_path / "out2").exists()


def test_images_the_model_cannot_take_are_a_one_line_error(tmp_path, capsys):
    """8x8 grayscale digits into a CIFAR ResNet (3 channels): one line naming the model key, nothing created."""
    text = RUN.replace("model: digits_mlp", "model: {name: cifar_resnet20, pretrained: false}")
    path = config(tmp_path, text)
    assert main(["run", str(path), "--quiet"]) == 2
    one_line_error(capsys, ":model:", "cannot take the images of dataset digits")
    assert not (tmp_path / "out").exists()
