"""PhantomSponges and DAG at their recipes' defaults on 16 shapes test images, white-box on shapes_fcos (DAG also on
shapes_frcnn); the target is the surrogate. ``python benchmarks/detection_ps_dag.py ps dag_fcos dag_frcnn``; the
environment variable ASSET_N sets PhantomSponges' number of shapes train images (default: the asset's, 320)."""
import json
import os
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_detection_attacks import run_recipe  # noqa: E402  (and the imports below)
from blackboxbench.builder import build_attack, load_recipe
from blackboxbench.config import finish_threat
from blackboxbench.detection.data import shapes, detection_images
from blackboxbench.family import RunInputs
from blackboxbench.prep.models import build_model
from blackboxbench.registry import FAMILY
from blackboxbench.rng import Streams
from blackboxbench.runner import schedule

which = sys.argv[1:]
data = shapes(None, n=16)
out = {}
for w in which:
    t0 = time.time()
    if w == "ps":
        model = build_model("shapes_fcos")
        recipe, src = load_recipe("phantom_sponges", "m")
        fam = FAMILY.get("detection")
        t = finish_threat({}, recipe, fam, "m")
        train = detection_images(None, "cpu", spec={"n": int(os.environ["ASSET_N"])} if "ASSET_N" in os.environ else None)
        run = RunInputs(attack=build_attack(recipe, t, src), threat=t, data=data, models={"surrogates": [model], "targets": [model]},
                        model_names={"surrogates": ["m"], "targets": ["m"]}, streams=Streams(0, 16, "cpu"),
                        device=torch.device("cpu"), slots=16, assets={"train": train}, save_adv=True)
        recs = []
        schedule(fam.worker(run), range(16), recs.extend, lambda _: None)
        p = fam.summarize(recs)["per_target"]["m"]
        uap = next(iter(train.cache.values()))
        res = {k: p[k] for k in ("clean_map", "adv_map", "drop_map", "clean_n_det", "adv_n_det", "det_ratio")}
        res["uap_l2"] = float(uap.flatten().norm()); res["max_l2"] = max(r["l2"] for r in recs)
    else:
        model = build_model("shapes_fcos" if w == "dag_fcos" else "shapes_frcnn")
        recs, s, t = run_recipe("dag", model, data, slots=16)
        p = s["per_target"]["m"]
        res = {k: p[k] for k in ("clean_map", "adv_map", "drop_map", "clean_csr", "adv_csr", "drop_csr", "clean_n_det", "adv_n_det")}
        res["max_linf_255"] = 255 * max(r["linf"] for r in recs)
        res["mean_linf_255"] = 255 * sum(r["linf"] for r in recs) / len(recs)
    res["seconds"] = round(time.time() - t0, 1)
    out[w] = res
    print(w, json.dumps(res), flush=True)
