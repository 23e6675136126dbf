"""CAA at its recipes' defaults on N shapes test images (default 32): crafted on shapes_fcos (weight 4) and
shapes_fcos_b (weight 1), evaluated on both (white-box) and on the unseen shapes_fcos_c (black-box).
``python benchmarks/detection_caa_audit.py caa_10 caa_30``; N=48 in the environment for 48 images. Prints per
target the CSR, AP_loc and mAP drops and the goal rate (with its clean control), and the seconds per image."""
import json
import os
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from blackboxbench.builder import build_attack, load_recipe  # noqa: E402
from blackboxbench.config import finish_threat  # noqa: E402
from blackboxbench.detection.context import detection_context  # noqa: E402
from blackboxbench.detection.data import shapes  # noqa: E402
from blackboxbench.family import RunInputs  # noqa: E402
from blackboxbench.prep.models import build_model  # noqa: E402
from blackboxbench.registry import FAMILY  # noqa: E402
from blackboxbench.rng import Streams  # noqa: E402
from blackboxbench.runner import schedule  # noqa: E402

n = int(os.environ.get("N", 32))
data = shapes(None, n=n)
sur = [build_model("shapes_fcos"), build_model("shapes_fcos_b")]
targets = {"fcos": sur[0], "fcos_b": sur[1], "fcos_c (bb)": build_model("shapes_fcos_c")}
tables = detection_context(None, "cpu")
fam = FAMILY.get("detection")
for name in sys.argv[1:]:
    recipe, src = load_recipe(name, "m")
    t = finish_threat({}, recipe, fam, "m")
    run = RunInputs(attack=build_attack(recipe, t, src), threat=t, data=data,
                    models={"surrogates": sur, "targets": list(targets.values())},
                    model_names={"surrogates": ["s0", "s1"], "targets": list(targets)},
                    streams=Streams(0, n, "cpu"), device=torch.device("cpu"), slots=16,
                    assets={"context": tables}, save_adv=True)
    recs = []
    t0 = time.time()
    schedule(fam.worker(run), range(n), recs.extend, lambda _: None)
    s = fam.summarize(recs)
    out = {k: {m: round(p[m], 4) for m in ("drop_csr", "drop_ap_loc", "drop_map", "goal_rate", "goal_rate_clean")}
           for k, p in s["per_target"].items()}
    print(name, json.dumps(out), "s/img %.2f" % s["time_per_image"], "wall %.0f s" % (time.time() - t0), flush=True)
    torch.save({r["index"]: r["_image"] for r in recs}, f"/tmp/caa/{os.environ.get('TAG', 'run')}_{name}.pt")
