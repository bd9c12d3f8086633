"""Write a model folder to stand in for your own: `python examples/local_model.py runs/my_model`.

Any folder with a transformers `config.json`, weights and a tokenizer (with a chat template) trains the same way:
`python train.py --config configs/quickstart.yaml --model_name_or_path runs/my_model --use_peft ...`. This one is the
quickstart's embedded tiny agent (built offline), saved as a plain folder, so the README's LoRA command runs on a CPU
without a download. A Hub id (`Qwen/Qwen3-0.6B`) works the same where the Hub is reachable.
"""

import sys
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer


def main(out: str) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's packages
    from envs.tiny import tiny_model

    source = tiny_model("tiny:shop")
    folder = Path(out)
    AutoModelForCausalLM.from_pretrained(source).save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    print(f"wrote {folder}")
    return folder


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python examples/local_model.py OUT_FOLDER")
    main(sys.argv[1])
