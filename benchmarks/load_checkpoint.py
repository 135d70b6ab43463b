"""Checkpoint load time and peak memory: the engine's loader against transformers', same files.

Makes the `small` preset (181M parameters) in two layouts: bf16 with transformers' names,
and DeepSeek's published layout (its names, FP8 projections with 128x128 ue8m0 block
scales, FP4 routed experts, 4 shards). Each load runs in a fresh process that resets its
peak-RSS counter just before loading, so the peak is the load's alone; the ratio is
(peak RSS - RSS before the load) / bytes of the loaded weights. Both sides load to the
checkpoint's dtype (bf16) on the CPU; transformers dequantizes FP8 on the CPU as well.

    python benchmarks/load_checkpoint.py [--preset small] [--rounds 3]
    python benchmarks/load_checkpoint.py --measure engine|transformers PATH   # one load, as JSON
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(loader: str, path: Path) -> dict:
    """One load in this process: seconds, RSS growth at its peak, bytes of the loaded weights.

    torch imports its symbolic-shape machinery the first time a model is built on the meta
    device (~190 MB, seconds without cached bytecode): imported before, for both loaders.
    transformers maps the files and reads a page when it is first used, so the time and the
    peak include touching every page of the weights once, for both loaders."""
    import torch
    import torch._dynamo
    import torch.fx.experimental.symbolic_shapes

    if loader == "transformers":
        import transformers
        from transformers import DeepseekV4ForCausalLM

        transformers.logging.set_verbosity_error()
    else:
        from engine.checkpoint.loader import load_model
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM, the peak RSS, to the current RSS
    start = time.perf_counter()
    if loader == "transformers":
        model = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    else:
        model = load_model(path)
    weights = 0
    for tensor in model.state_dict().values():
        tensor.reshape(-1).view(torch.uint8)[::4096].sum()
        weights += tensor.numel() * tensor.element_size()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_growth": _status("VmHWM") - before, "weights": weights}


def _child(loader: str, path: Path) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--measure", loader, str(path)], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--measure", nargs=2, metavar=("LOADER", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure[0], Path(args.measure[1]))))
        return

    from engine.checkpoint.make_model import preset_config, write_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        config = preset_config(args.preset, torch_dtype="bfloat16")
        checkpoints = {
            "bf16, transformers names": write_checkpoint(Path(tmp, "bf16"), config, 0),
            "fp8 + fp4 experts, DeepSeek names, 4 shards": write_checkpoint(
                Path(tmp, "fp8-fp4"), config, 0, layout="deepseek", quant="fp8-fp4", shards=4
            ),
        }
        print(f"{args.preset} preset, {args.rounds} rounds, medians; peak = RSS growth at its peak / loaded weights")
        print(f"{'checkpoint':<46}{'loader':<14}{'weights':>10}{'load s':>9}{'peak':>8}")
        for label, path in checkpoints.items():
            times = {}
            for loader in ("transformers", "engine"):
                runs = [_child(loader, path) for _ in range(args.rounds)]
                times[loader] = statistics.median(r["seconds"] for r in runs)
                peak = statistics.median(r["peak_growth"] / r["weights"] for r in runs)
                weights = runs[0]["weights"] / 2**20
                print(f"{label:<46}{loader:<14}{weights:>8.0f}MB{times[loader]:>9.2f}{peak:>7.2f}x")
            print(f"{'':<46}engine load time / transformers: {times['engine'] / times['transformers']:.2f}x")


if __name__ == "__main__":
    main()
