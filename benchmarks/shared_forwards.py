"""Several query attacks on one target model, run one after the other and then at once sharing its forwards
(``share_forwards``, ``blackboxbench/shared.py``): wall time, model calls and images forwarded, and each attack's
ASR and mean queries in both modes. One markdown row per mode as it finishes.

    PYTHONPATH=. BLACKBOXBENCH_DATA=../shared/data python benchmarks/shared_forwards.py --threads 2 \
        --attacks square_linf,nes,simba_dct,signhunter --n 100 --device cpu

Records are equal in the two modes wherever the model's forward is batch-invariant (tests/test_shared.py); a
float32 CNN's logits may move with the batch a row is computed in, so ASR and queries may differ slightly.
"""
import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from blackboxbench.config import validate_experiment
from blackboxbench.malloc import keep_freed_memory
from blackboxbench.runner import Runner, Session, run_all


def experiments(args, out):
    exps = []
    for attack in args.attacks.split(","):
        exp = validate_experiment({"dataset": {"name": "cifar10", "n": args.n}, "model": args.model,
                                   "attack": attack, "device": args.device, "seed": 0,
                                   "batch_size": args.slots, "output_dir": str(out),
                                   "threat": {"norm": "linf", "eps": args.eps, "max_queries": args.budget}},
                                  "shared_forwards.py")
        exp.update(_source="shared_forwards.py", _base_dir=".")
        exps.append(exp)
    return exps


def measure(args, share):
    out = Path(tempfile.mkdtemp(prefix="bbb_shared_"))
    try:
        runners = [Runner(e, progress=False) for e in experiments(args, out)]
        session = Session()
        for r in runners:
            r.session = session
        calls, images = [0], [0]

        def count(module, inputs):
            calls[0] += 1
            images[0] += inputs[0].shape[0]

        hooks = []
        for inp in [r.inputs() for r in runners]:  # builds the models once (the session caches them)
            model = inp.models["model"][0]
            if not any(h[0] is model for h in hooks):
                hooks.append((model, model.register_forward_pre_hook(count)))
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        summaries = run_all(runners, session, share)
        if args.device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        for _, h in hooks:
            h.remove()
        return wall, calls[0], images[0], summaries
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--attacks", default="square_linf,nes,simba_dct,signhunter")
    ap.add_argument("--model", default="cifar_resnet20")
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--eps", default="8/255")
    ap.add_argument("--budget", type=int, default=10_000)
    ap.add_argument("--slots", type=int, default=100)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="alternating sequential / shared measurements")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as `blackboxbench run` does
    print(f"{args.model}, {args.n} CIFAR-10 images, Linf {args.eps}, budget {args.budget}, {args.slots} slots, "
          f"{args.device}, {args.threads} thread(s); attacks {args.attacks}\n")
    print("| mode | wall s | model calls | images forwarded | per attack: ASR / mean queries |")
    print("|---|---|---|---|---|")
    for _ in range(args.repeats):
        for share in (False, True):
            wall, calls, images, summaries = measure(args, share)
            per = "; ".join(f"{s['attack']} {s['asr']:.3f} / {s['aqn']:.0f}" for s in summaries)
            print(f"| {'shared' if share else 'one after the other'} | {wall:.1f} | {calls:,} | {images:,} | {per} |",
                  flush=True)


if __name__ == "__main__":
    main()
