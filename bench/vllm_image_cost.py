"""What vLLM itself spends on an image given as embeddings, against text of the same length (bench process).

``bench/front.py``'s phase ``e`` compares a request whose image the encoder holds with a text-only
request of the same prompt length, through the whole stack. Part of what the image adds is vLLM's
own: rendering the multimodal prompt (its processor lays out the placeholders), then, in the step,
gathering the item's rows, splitting off Qwen3-VL's deepstack levels and merging both into the
prompt's embeddings. Any path that gives vLLM an image pays it; vLLM's own EPD pays more, since
its prefill instance renders the image itself. This script measures that part alone, with nothing
of epd-cache in the way.

One ``vllm.LLM`` in this process (the engine in-process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) of
``bench/front.py``'s checkpoint (a Qwen3-VL-2B-width tower beside a tiny language model of the same
hidden size, 2048; written into ``--workdir`` unless it is there) with ``enable_mm_embeds``, the
engine flags ``bench/front.py`` gives its vLLMs (``--enforce-eager``, float32). Two kinds of
request, one at a time, one token each (``max_tokens=1``: time to first token, no decode):

- ``image_embeds``: a prompt with one image given as its embeddings (random rows of the width the
  tower outputs, ``out_hidden * (1 + deepstack levels)``, for a ``--grid`` x ``--grid`` patch
  grid: 16 is the 64 tokens of phase e's 224 px images), each with a ``uuid`` of its own, so vLLM
  neither hashes the rows nor finds them cached;
- ``text``: new random token ids, as many as the image prompt has.

The kinds alternate in sets of ``--requests``, ``--rounds`` times each; the time of each call to
``LLM.generate`` (render, schedule, the prefill step, the sample). The last line of stdout is one
JSON object: each kind's p50 and p99 (ms), the p50 an image adds, per round and over all.
Usage: ``python bench/vllm_image_cost.py [--workdir DIR] [--requests 30] [--rounds 3] [--core 1]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.front_load import summary  # noqa: E402
from bench.front_stack import checkpoints  # noqa: E402

IMAGE_PROMPT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is in the picture? "
                "Answer briefly.<|im_end|>\n<|im_start|>assistant\n")
KV_CACHE_BYTES = 256 << 20


def measure(checkpoint: Path, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from vllm import LLM, SamplingParams

    llm = LLM(str(checkpoint), enforce_eager=True, dtype="float32", max_model_len=4096, max_num_seqs=16,
              enable_mm_embeds=True, skip_mm_profiling=True, kv_cache_memory_bytes=KV_CACHE_BYTES,
              limit_mm_per_prompt={"image": 1, "video": 0})
    config = json.loads((checkpoint / "config.json").read_text())
    vision = config["vision_config"]
    width = vision["out_hidden_size"] * (1 + len(vision.get("deepstack_visual_indexes", [])))
    merge = vision["spatial_merge_size"]
    tokens = args.grid * args.grid // (merge * merge)
    vocab = config["text_config"]["vocab_size"]
    params = SamplingParams(max_tokens=1, temperature=0)
    serial = iter(range(10**9))

    def image() -> dict[str, Any]:
        n = next(serial)
        rows = torch.randn(tokens, width, generator=torch.Generator().manual_seed(n)) * 0.02
        return {"prompt": IMAGE_PROMPT,
                "multi_modal_data": {"image": {"image_embeds": rows,
                                               "image_grid_thw": torch.tensor([[1, args.grid, args.grid]])}},
                "multi_modal_uuids": {"image": [f"bench-image-{n:09d}"]}}

    def text(length: int) -> dict[str, Any]:
        ids = torch.randint(16, vocab - 16, (length,), generator=torch.Generator().manual_seed(next(serial)))
        return {"prompt_token_ids": ids.tolist()}

    def timed(request: dict[str, Any]) -> tuple[float, int]:
        started = time.perf_counter()
        out = llm.generate([request], params, use_tqdm=False)
        return (time.perf_counter() - started) * 1e3, len(out[0].prompt_token_ids)

    _, length = timed(image())  # first calls: one-off costs of each kind
    timed(text(length))
    for _ in range(5):
        timed(image())
        timed(text(length))
    got: dict[str, list[float]] = {"image_embeds": [], "text": []}
    rounds = []
    for rnd in range(args.rounds):
        order = ["image_embeds", "text"] if rnd % 2 == 0 else ["text", "image_embeds"]
        this: dict[str, list[float]] = {}
        for kind in order:
            this[kind] = [timed(image() if kind == "image_embeds" else text(length))[0] for _ in range(args.requests)]
            got[kind] += this[kind]
        rounds.append({kind: round(statistics.median(v), 2) for kind, v in this.items()}
                      | {"added_p50_ms": round(statistics.median(this["image_embeds"]) - statistics.median(this["text"]), 2)})
        print(f"round {rnd}: {json.dumps(rounds[-1])}", file=sys.stderr)
    return {"prompt_tokens": length, "image_tokens": tokens, "row_width": width,
            "image_embeds": summary(got["image_embeds"]), "text_same_length": summary(got["text"]),
            "image_added_p50_ms": round(statistics.median(got["image_embeds"]) - statistics.median(got["text"]), 2),
            "rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", help="bench/front.py's checkpoints (reused when there; default: a temporary folder)")
    parser.add_argument("--requests", type=int, default=30, help="requests per set")
    parser.add_argument("--rounds", type=int, default=3, help="sets per kind, alternating")
    parser.add_argument("--grid", type=int, default=16, help="patches a side of the image (16: 64 tokens)")
    parser.add_argument("--core", type=int, help="the core the engine binds its OpenMP threads to (VLLM_CPU_OMP_THREADS_BIND; "
                        "bench/front.py's consumer engine: 1; default: vLLM's choice)")
    args = parser.parse_args()
    if args.core is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(args.core)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="epd-image-cost-") as tmp:
        real, _ = checkpoints(Path(args.workdir or tmp))
        result = measure(real, args)
    result["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    result["settings"] = vars(args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
