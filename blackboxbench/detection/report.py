"""Detection reports written after a config's runs, next to its leaderboard ``<board>.csv``:

* ``<board>_detection.csv``: one row per run x target detector (attack, surrogate, target, clean and adversarial
  mAP / AP_loc / CSR, their relative drops, detections per image, the attack's own success rate (``goal_rate``:
  EBAD's and CAA's victim relabelled, on that detector; ``goal_rate_clean``: the same on the clean image, the
  control), L2, Linf, SSIM, LPIPS, time per image, the
  harmonized score threshold and cap);
* ``<board>_transfer.png``: heatmap of the relative mAP drop, rows attack (surrogate), columns target detector;
* ``<board>_robustness.png``: heatmap of the adversarial mAP, rows target detector, columns attack (a white-box
  run, surrogate = target, is labelled by the attack alone): with fine-tuned detectors as targets this is the
  adversarial-training table (the od benchmark's Tables 6-7);
* ``<board>_examples.png``: for runs saved with ``save_adv``, the first images with the first target's boxes
  before and after each attack.
"""
import csv
from pathlib import Path

from ..leaderboard import SETTING_KEYS, cell, collect, label, run_labels
from ..plotting import heatmap

COLUMNS = ("attack", "name", "surrogate", "target", "n", "clean_map", "adv_map", "drop_map", "clean_ap_loc",
           "adv_ap_loc", "drop_ap_loc", "clean_csr", "adv_csr", "drop_csr", "clean_map_area",
           "adv_map_area", "clean_n_det", "adv_n_det", "det_ratio", "goal_rate", "goal_rate_clean",
           "mean_l2", "mean_linf", "mean_l2_255", "mean_linf_255", "mean_ssim", "mean_lpips",
           "time_per_image", "score_thr", "max_det", "run")


def rows_of(summaries):
    """One row per (run, target detector) of the detection summaries; ``label`` names the run in the heatmaps
    (:func:`~blackboxbench.leaderboard.run_labels`: runs of one surrogate never share a label)."""
    rows = []
    summaries = [s for s in summaries if s.get("family") == "detection"]
    labels = run_labels(summaries, within=lambda s: s.get("surrogates"),
                        keys=[k for k in SETTING_KEYS if k != "target_model"])
    for s, name in zip(summaries, labels):
        for target, p in (s.get("per_target") or {}).items():
            r = {k: s.get(k) for k in ("attack", "name", "n", "mean_l2", "mean_linf", "mean_ssim", "mean_lpips",
                                       "time_per_image", "run")}
            r.update({k: v for k, v in p.items()}, surrogate=s.get("surrogates"), target=target,
                     label=name)
            r["mean_l2_255"] = None if r["mean_l2"] is None else r["mean_l2"] * 255
            r["mean_linf_255"] = None if r["mean_linf"] is None else r["mean_linf"] * 255
            rows.append(r)
    return sorted(rows, key=lambda r: (str(r["label"]), str(r["surrogate"]), str(r["target"])))


def _matrix(rows, row_key, col_key, value):
    rlabels = list(dict.fromkeys(row_key(r) for r in rows))
    clabels = list(dict.fromkeys(col_key(r) for r in rows))
    m = [[float("nan")] * len(clabels) for _ in rlabels]
    for r in rows:
        v = value(r)
        if v is not None:
            m[rlabels.index(row_key(r))][clabels.index(col_key(r))] = v
    return rlabels, clabels, m


def transfer_matrix(rows):
    return _matrix(rows, lambda r: f"{r['label']} ({r['surrogate']})", lambda r: r["target"], lambda r: r["drop_map"])


def robustness_table(rows):
    """Rows target detector, columns attack, adversarial mAP; a first column ``clean`` with the clean mAP. A run
    crafted on a surrogate and evaluated on other detectors (the od benchmark's protocol: fixed adversarial test
    images from the base detector) is one column ``label (surrogate)``, its surrogate's own row included; a
    white-box run (surrogate = its only target) is labelled by its label alone."""
    transfer = {r["run"] for r in rows if r["surrogate"] != r["target"]}

    def col(r):
        return f"{r['label']} ({r['surrogate']})" if r["run"] in transfer else r["label"]

    rl, cl, m = _matrix(rows, lambda r: r["target"], col, lambda r: r["adv_map"])
    clean = {}
    for r in rows:
        clean.setdefault(r["target"], r["clean_map"])
    return rl, ["clean"] + cl, [[clean.get(t) if clean.get(t) is not None else float("nan")] + line
                                 for t, line in zip(rl, m)]


def write_reports(results_dirs, leaderboard):
    """Write the detection CSV and heatmaps for every finished detection run below ``results_dirs``; returns the
    paths written."""
    summaries, _ = collect(results_dirs)
    rows = rows_of(summaries)
    if not rows:
        return []
    board = Path(leaderboard)
    stem = board.with_suffix("")
    out = Path(f"{stem}_detection.csv")
    with open(out, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        w.writerows([cell(r.get(c)) for c in COLUMNS] for r in rows)
    paths = [out]
    paths.append(heatmap(Path(f"{stem}_transfer.png"), *transfer_matrix(rows),
                         "relative mAP drop (rows: attack (surrogate), columns: target)"))
    paths.append(heatmap(Path(f"{stem}_robustness.png"), *robustness_table(rows),
                         "mAP@0.5 under attack (rows: detector, columns: attack)", cmap="magma"))
    ex = examples(summaries, results_dirs, Path(f"{stem}_examples.png"))
    return paths + ([ex] if ex else [])


def _draw(ax, img, det, title):
    ax.imshow(img)
    for b, s in zip(det["boxes"].tolist(), det["scores"].tolist()):
        ax.add_patch(__import__("matplotlib.patches", fromlist=["Rectangle"]).Rectangle(
            (b[0], b[1]), b[2] - b[0], b[3] - b[1], fill=False, color="yellow", lw=1))
    ax.set_title(title, fontsize=7)
    ax.axis("off")


def examples(summaries, results_dirs, path, per_run=2, max_runs=8):
    """Clean and adversarial images with the first target's detections (score >= 0.5) for runs saved with
    ``save_adv``; None when no run saved its images."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    import torch
    import yaml
    from PIL import Image

    from ..prep.data import resolve_data_root
    from ..prep.models import build_model
    from ..registry import DATASET
    from .family import forward_dets

    runs = []
    for root in [Path(d) for d in ([results_dirs] if isinstance(results_dirs, (str, Path)) else results_dirs)]:
        for s in summaries:
            d = root / s["run"]
            if s.get("family") == "detection" and (d / "adv").is_dir() and d not in [r for r, _ in runs]:
                runs.append((d, s))
    runs = runs[:max_runs]
    if not runs:
        return None
    fig, axes = plt.subplots(len(runs), 2 * per_run, figsize=(2.2 * 2 * per_run, 2.3 * len(runs)), squeeze=False)
    for row, (d, s) in enumerate(runs):
        cfg = yaml.safe_load((d / "config.yaml").read_text())
        spec = dict(cfg["dataset"])
        root = cfg.get("data_root")
        data = DATASET.get(spec.pop("name"))(resolve_data_root(root) if root else None, **spec)
        model = build_model(cfg["targets"][0], data_root=root)
        model.harmonize(cfg["threat"].get("score_thr"), cfg["threat"].get("max_det"))
        files = sorted((d / "adv").glob("*.png"))[:per_run]
        idx = [int(f.stem) for f in files]
        x = data.x[idx]
        xa = torch.stack([torch.from_numpy(np.array(Image.open(f).convert("RGB"))).permute(2, 0, 1).float() / 255
                          for f in files])
        for k, (dc, da) in enumerate(zip(forward_dets(model, x, "target"), forward_dets(model, xa, "target"))):
            keep_c, keep_a = dc["scores"] >= 0.5, da["scores"] >= 0.5
            _draw(axes[row][2 * k], x[k].permute(1, 2, 0).numpy(), {k2: v[keep_c] for k2, v in dc.items()},
                  f"clean #{idx[k]}")
            _draw(axes[row][2 * k + 1], xa[k].permute(1, 2, 0).numpy(), {k2: v[keep_a] for k2, v in da.items()},
                  f"{label(s)} #{idx[k]}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
