"""The model-level analysis tools on the real CIFAR-10 data and models, checking the paper's readings of them in
direction (BlackboxBench Supp. I and Sec. IV):

* decision surface (Supp. I, after eq. I.12): the boundary is nearer along the attack's direction than along a
  random one, per image;
* FullGrad (Figs. 16, 30-32): a successful attack moves the model's attention more than a failed one (lower
  cosine between the clean and adversarial maps), and along its path (``save_path_every``: 6 stages);
* FSM (Fig. 25): adversarially trained models attend to other frequencies than normally trained ones (share of
  the spectrum's magnitude at low frequencies, radius <= 4 of the 32 x 32 DFT);
* dbViz (Fig. 10, Fig. 13): classes met on the plane of three test images, per model.

One markdown table per tool, printed as it finishes:

    PYTHONPATH=. BLACKBOXBENCH_DATA=../shared/data python benchmarks/analysis_tools.py --n 32 --threads 2

``--parts`` runs some of the tools only (``surface fullgrad path fsm dbviz``; the first three share the attack
run).
"""
import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from blackboxbench.analysis.boundary import dbviz, decision_surface
from blackboxbench.analysis.inputs import load_inputs
from blackboxbench.analysis.saliency import frequency_saliency, fullgrad, fullgrad_path
from blackboxbench.config import validate_experiment
from blackboxbench.registry import MODEL
from blackboxbench.runner import run_experiment

PARTS = ("surface", "fullgrad", "path", "fsm", "dbviz")
FSM_MODELS = ("cifar_resnet20", "cifar_resnet56", "oval_cifar_wide", "cifar_resnet4b_adv", "cifar_cnn_a_adv",
              "cifar_cnn_a_mix")


def attack_run(args, out):
    exp = validate_experiment({"dataset": {"name": "cifar10", "n": args.n}, "model": "cifar_resnet20",
                               "attack": "square_linf", "seed": 0, "save_adv": True, "output_dir": str(out),
                               "save_path_every": args.budget // 20,
                               "threat": {"norm": "linf", "eps": args.eps, "max_queries": args.budget}},
                              "analysis_tools.py")
    exp.update(_source="analysis_tools.py", _base_dir=".")
    return run_experiment(exp, progress=False)


def distinct_triples(y, k):
    """The first ``k`` triples of image indices with three distinct labels, taking images in order."""
    out, cur = [], []
    for i, label in enumerate(y.tolist()):
        if label not in [y[j] for j in cur]:
            cur.append(i)
        if len(cur) == 3:
            out, cur = out + [cur], []
        if len(out) == k:
            break
    return out


def mean(v):
    v = [x for x in v if not np.isnan(x)]
    return f"{statistics.fmean(v):.3f} (n={len(v)})" if v else "-"


def run_parts(args, tmp, t0):
    """The tools on the attack run's images (``--parts`` surface, fullgrad, path)."""
    run_dir, summary = attack_run(args, tmp)
    print(f"Square Linf {args.eps:.4f}, budget {args.budget}, ResNet-20, first {args.n} images: ASR "
          f"{summary['asr']:.3f} over {summary['n_attacked']} attacked ({time.time() - t0:.0f} s)\n")
    records = {r["index"]: r for r in map(json.loads, (run_dir / "records.jsonl").read_text().splitlines())}
    inputs = load_inputs(run=run_dir)
    success = [bool(records[i]["success"]) for i in inputs.index]

    if "surface" in args.parts:
        _, rows, _, _ = decision_surface(inputs, steps=41, scale=2.0, max_images=len(inputs.index))
        nearer = [r[4] < r[5] or (not np.isnan(r[4]) and np.isnan(r[5])) for r in rows]
        print("| decision surface | images | boundary nearer along the attack's direction | mean dist_adv | "
              "mean dist_random (nearer of +-beta) |\n|---|---|---|---|---|")
        print(f"| all attacked | {len(rows)} | {sum(nearer)} / {len(rows)} | {mean([r[4] for r in rows])} | "
              f"{mean([r[5] for r in rows])} |\n", flush=True)

    if "fullgrad" in args.parts:
        _, rows, _, _ = fullgrad(inputs, max_images=len(inputs.index))
        cos = {True: [r[4] for r, s in zip(rows, success) if s], False: [r[4] for r, s in zip(rows, success) if not s]}
        print("| FullGrad, clean vs adversarial map | images | mean cosine |\n|---|---|---|")
        for k, label in ((True, "successful attacks"), (False, "failed attacks")):
            print(f"| {label} | {len(cos[k])} | {mean(cos[k])} |")
        print(flush=True)

    if "path" in args.parts:
        _, rows, _, _ = fullgrad_path(inputs, max_images=len(inputs.index), stages=6)
        ok = dict(zip(inputs.index, success))
        print("| FullGrad along the path (up to 6 stages), cosine to the clean map | images | intermediate iterates "
              "| returned image |\n|---|---|---|---|")
        for k, label in ((True, "successful attacks"), (False, "failed attacks")):
            mine = {i: [r for r in rows if r[0] == i] for i in inputs.index if ok[i] == k}
            mid = [r[5] for path in mine.values() for r in path[1:-1]]
            print(f"| {label} | {len(mine)} | {mean(mid)} | {mean([p[-1][5] for p in mine.values()])} |")
        print(flush=True)

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=32, help="CIFAR-10 test images attacked (Square, ResNet-20)")
    ap.add_argument("--eps", type=float, default=2 / 255, help="Linf eps of the run (small: some attacks fail)")
    ap.add_argument("--budget", type=int, default=1000)
    ap.add_argument("--fsm-n", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        if {"surface", "fullgrad", "path"} & set(args.parts):
            run_parts(args, Path(tmp), t0)
        if "fsm" in args.parts:
            print("| FSM model | registry tag | clean acc on the images | low-frequency share (radius <= 4) | "
                  "radius of the peak |\n|---|---|---|---|---|")
            for name in FSM_MODELS:
                inp = load_inputs(model=name, dataset={"name": "cifar10", "n": args.fsm_n})
                _, prof, arrays, _ = frequency_saliency(inp)
                m = arrays["fsm"]
                h, w = m.shape
                yy, xx = np.indices(m.shape)
                low = float(m[np.hypot(yy - h // 2, xx - w // 2) <= 4].sum() / m.sum())
                with torch.no_grad():
                    acc = float((inp.model(inp.x).argmax(1) == inp.y).float().mean())
                tag = MODEL.get(name).registry_meta.get("defense") or "-"
                peak = int(np.argmax([p[1] for p in prof]))
                print(f"| `{name}` | {tag} | {acc:.2f} | {low:.3f} | {peak} |", flush=True)
            print()

        if "dbviz" in args.parts:
            triples = distinct_triples(load_inputs(model="cifar_resnet20", dataset={"name": "cifar10", "n": 40}).y, 4)
            print(f"dbViz planes through images {triples} (three distinct labels each, as the dbViz authors)\n")
            print("| dbViz model | planes | mean classes on a plane | mean share of the plane labelled as one of its "
                  "three images' labels |\n|---|---|---|---|")
            for name in ("cifar_resnet20", "cifar_resnet56", "cifar_resnet4b_adv"):
                inp = load_inputs(model=name, dataset={"name": "cifar10", "n": 40}, indices=sum(triples, []))
                _, rows, arrays, _ = dbviz(inp, resolution=50, planes=len(triples))
                own = [float(np.isin(arrays["labels"][q], inp.y[3 * q:3 * q + 3].tolist()).mean())
                       for q in range(len(triples))]
                print(f"| `{name}` | {len(triples)} | {statistics.fmean(r[4] for r in rows):.2f} | "
                      f"{statistics.fmean(own):.3f} |", flush=True)
            print("\nthe third image's position along v1 (c = <v1, v2> / <v1, v1>; outside [0, 1] it lies off a [0, 1] "
                  f"range): {[round(float(m[2][0]), 3) for m in arrays['marks']]}")
    print(f"\n{time.time() - t0:.0f} s in all")


if __name__ == "__main__":
    main()
