"""Images: how fast the vision tower encodes them, and what a cached image saves a request's TTFT.

Encoding: images per second through VisionEncoder.span_rows (pixels to the rows of the image's
span of the prompt: ViT, downsampling, aligner), for images of two sizes as deepseek-recipe
resizes them, with the tiny preset's tower (what CI serves) and a tower of the published
geometry (32 blocks of width 1024; random weights, the model's hidden width for the aligner).
The baseline for the ratios is the tiny tower on the small image, in the same run.

TTFT: the embedded mesh (`deepmesh serve`'s: gateway, tokenizer, encoder, prefill, decode over
the in-process bus) serving the tiny-v41 preset; streamed chat requests with one image, one at
a time, time to the first chunk, three kinds in alternating rounds:
- cold: an image never seen (its rows encoded, nothing cached);
- image cached: an image sent before, behind another text (its rows come from the cache, no
  prefix is shared: the text before it differs);
- repeat: the same image and text again (the rows and the prompt's prefix come from the cache).
Medians, and ratios against cold in the same run.

    python benchmarks/images.py [--rounds 5] [--published] [--model PATH]
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import openai
import torch
from PIL import Image

from engine import load_vision_encoder
from engine.checkpoint.make_model import make_model
from engine.model.vision import VisionConfig, VisionEncoder
from tokenizer_svc.images import ImagePolicy, ImageResolver

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, as chaos_soak.py
MODEL_NAME = "deepmesh-tiny"
SIZES = {"small (64x48 -> 630x476)": (64, 48), "large (1000x800 -> 1008x812)": (1000, 800)}


def png(width: int, height: int, seed: int) -> bytes:
    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def resized_pixels(width: int, height: int) -> torch.Tensor:
    """An image as the encoder gets it: resized by deepseek-recipe, decoded from its WebP."""
    data = "data:image/png;base64," + base64.b64encode(png(width, height, 0)).decode()
    import deepseek_recipe as recipe

    (image,) = ImageResolver(ImagePolicy(), 14, 3).resolve([recipe.DataUrlImageSource(data)])
    return torch.from_numpy(np.asarray(Image.open(io.BytesIO(image.data)).convert("RGB")).copy())


def images_per_second(encoder: VisionEncoder, pixels: torch.Tensor, seconds: float = 3.0) -> float:
    encoder.span_rows(pixels)  # warm
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds or done < 2:
        encoder.span_rows(pixels)
        done += 1
    return done / (time.perf_counter() - started)


def encoding(model: Path, published: bool) -> None:
    towers = {"tiny-v41 tower": load_vision_encoder(model)}
    if published:
        torch.manual_seed(0)
        big = VisionEncoder(VisionConfig(), 4096)
        for parameter in big.parameters():
            torch.nn.init.normal_(parameter, std=0.02)
        towers["published geometry (32 x 1024)"] = big
    rows: list[tuple[str, str, float]] = []
    for name, tower in towers.items():
        if tower is None:
            raise SystemExit(f"{model} has no vision tower: make one with `deepmesh make-model D --preset tiny-v41`")
        for size, (width, height) in SIZES.items():
            rows.append((name, size, images_per_second(tower, resized_pixels(width, height))))
            print(f"  {name:<32} {size:<30} {rows[-1][2]:8.2f} images/s", flush=True)
    print("\n| tower | image | images/s | vs tiny tower, small image |\n| --- | --- | ---: | ---: |")
    for name, size, rate in rows:
        print(f"| {name} | {size} | {rate:.2f} | {rate / rows[0][2]:.3f}x |")


def ttft(model: Path, rounds: int) -> None:
    from tests.support.behaviour import served_embedded

    with tempfile.TemporaryDirectory() as scratch, served_embedded(model, Path(scratch)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        times: dict[str, list[float]] = {"cold": [], "image cached": [], "repeat": []}
        seed = 100
        for round_ in range(rounds + 1):  # the first round warms up and is not counted
            seed += 1
            image = png(1000, 800, seed)
            kinds = [("cold", f"Round {round_}: what is in it?", image)]
            kinds.append(("image cached", f"Another question, round {round_}: describe it.", image))
            kinds.append(("repeat", f"Round {round_}: what is in it?", image))
            for kind, text, data in kinds:
                elapsed = first_chunk(client, text, data)
                if round_:
                    times[kind].append(elapsed)
    cold = statistics.median(times["cold"])
    print("\n| image request | TTFT median (ms) | vs cold |\n| --- | ---: | ---: |")
    for kind, values in times.items():
        print(f"| {kind} | {statistics.median(values) * 1000:.1f} | {statistics.median(values) / cold:.3f}x |")


def first_chunk(client: openai.OpenAI, text: str, image: bytes) -> float:
    from tests.support.behaviour import seconds_to_first_chunk

    url = "data:image/png;base64," + base64.b64encode(image).decode()
    # the text before the image: a different text, a different prefix
    return seconds_to_first_chunk(
        client, [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="a V4.1 checkpoint with a vision tower")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--published", action="store_true", help="also a tower of the published geometry")
    args = parser.parse_args()
    model = args.model
    if model is None:
        model = Path(".cache/models/tiny-v41-vision")
        if not (model / "config.json").is_file():
            make_model(model, "tiny-v41", seed=0)
    print(f"torch threads: {torch.get_num_threads()}; model {model}")
    print("encoding:")
    encoding(model, args.published)
    print("\nTTFT of a request with one 1000x800 image (502 of its positions), one at a time:")
    ttft(model, args.rounds)


if __name__ == "__main__":
    main()
