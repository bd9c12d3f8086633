"""The tiny default's warm start, with and without its CPU fast path, side by side in one process.

    python bench/sft_speed.py --envs shop:0 shop:1 terminal:1 --steps 40 --repeats 2

For each environment and level it plays the build's noisy demonstrations, trains the build's tokenizer, and runs
`envs.tiny.sft` for `--steps` steps from the same initial weights in two ways, alternating `--repeats` times:

- fast: as the build runs it (plain causal attention without the right-padding mask; docs/methods/grpo.md D15);
- masked: the forward as TRL's SFTTrainer makes it, with the padding mask.

It reports seconds per SFT step (the whole `sft` call, the trainer's set-up included, over its steps; median over
repeats), their ratio, and the largest difference between the two trained models' weights (float rounding).
Writes result.json and result.md in bench/results/sft_speed/ (or `--out`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import envs.tiny  # noqa: E402
from bench.record import RESULTS, write_result  # noqa: E402
from envs import environment_class  # noqa: E402
from envs.tiny import CHAT_TEMPLATE, TinySpec, build_model, build_tokenizer, demonstrations, sft  # noqa: E402


class _Masked(contextlib.nullcontext):
    """Stands in for `CausalWithoutMask`: the forward keeps its padding mask."""

    def __init__(self, model):
        super().__init__()


@contextlib.contextmanager
def masked_forward():
    """`envs.tiny.sft` as it was before its fast path: with the padding mask."""
    causal, envs.tiny.CausalWithoutMask = envs.tiny.CausalWithoutMask, _Masked
    try:
        yield
    finally:
        envs.tiny.CausalWithoutMask = causal


def timed_sft(spec: TinySpec, tokenizer, demos: list, masked: bool) -> tuple[float, dict]:
    model = build_model(spec, tokenizer)
    with tempfile.TemporaryDirectory() as tmp, masked_forward() if masked else contextlib.nullcontext():
        start = time.perf_counter()
        model = sft(model, tokenizer, demos, spec, output_dir=tmp)
        seconds = time.perf_counter() - start
    return seconds / spec.sft_steps, {k: v.detach().clone() for k, v in model.state_dict().items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--envs", nargs="+", default=["shop:0", "shop:1"], help="environment:level pairs")
    p.add_argument("--steps", type=int, default=40, help="SFT steps per timed run")
    p.add_argument("--repeats", type=int, default=2, help="timed runs of each way, alternating")
    p.add_argument("--num_demos", type=int, default=400, help="demonstrations played (the build plays 2000)")
    p.add_argument("--out", type=Path, default=RESULTS / "sft_speed")
    args = p.parse_args()

    rows = []
    for item in args.envs:
        env, _, level = item.partition(":")
        spec = TinySpec.parse(f"tiny:{env}", difficulty=int(level or 0), sft_steps=args.steps)
        demos = demonstrations(environment_class(env), args.num_demos, 0, spec.difficulty, spec.noise)
        texts = [CHAT_TEMPLATE] + ["user\nassistant\nsystem\ntool\n"] * 200 + [m["content"] for d in demos for m in d]
        tokenizer = build_tokenizer(texts, spec.vocab_size)
        times: dict[str, list[float]] = {"fast": [], "masked": []}
        weights = {}
        for _ in range(args.repeats):
            for way in ("fast", "masked"):
                seconds, weights[way] = timed_sft(spec, tokenizer, demos, masked=way == "masked")
                times[way].append(seconds)
                print(f"{item} {way}: {seconds:.3f} s/step", flush=True)
        fast, masked = statistics.median(times["fast"]), statistics.median(times["masked"])
        diff = max(float((weights["fast"][k] - weights["masked"][k]).abs().max()) for k in weights["fast"])
        rows.append(dict(env=env, difficulty=spec.difficulty, fast_s_per_step=fast, masked_s_per_step=masked,
                         speedup=masked / fast, max_weight_diff=diff, times=times))  # fmt: skip

    header = (
        f"{args.steps} SFT steps per run (batch {TinySpec.sft_batch_size}), {args.repeats} runs of each way "
        f"alternating, {args.num_demos} demonstrations, {torch.get_num_threads()} torch thread(s)\n\n"
        "| environment (level) | fast (s/step) | masked (s/step) | speed-up | largest weight difference |\n"
        "| --- | ---: | ---: | ---: | ---: |\n"
    )
    body = "".join(
        f"| {r['env']} ({r['difficulty']}) | {r['fast_s_per_step']:.3f} | {r['masked_s_per_step']:.3f} | "
        f"{r['speedup']:.2f}x | {r['max_weight_diff']:.1e} |\n"
        for r in rows
    )
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    write_result(args.out, "sft_speed", settings, {"rows": rows}, header + body)


if __name__ == "__main__":
    main()
