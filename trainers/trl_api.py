"""The TRL boundary: the one module that reaches into TRL's and transformers' private API (TRL 1.16.0, transformers
5.24).

Everything else in the project uses TRL and transformers through their public API and through the names defined
here, so that an upgrade that renames or reshapes a private name breaks this file and its test
(`tests/test_trl_api.py`), nowhere else. `PRIVATE` lists every private name used below; the test pins the signature
of each one against the installed packages and checks that no other file of the project (tests aside) uses them.

What it holds:

1. `TRLSeams(GRPOTrainer)`: TRL's private trainer methods re-exposed as overridable public methods of the project.
   Each private method TRL calls is forwarded to a public one (`_generate_and_score_completions` ->
   `generate_and_score`, ...), whose default is TRL's own; a subclass overrides the public name and calls `super()`.
   TRL's private trainer state is read through properties (`micro_step`, `log_metric`, `logged_metrics`,
   `checkpoint_folder`).
2. `cpu_fast_paths()`: the two CPU switches, made only while a trainer is in one of its passes and undone after
   (docs/methods/grpo.md D12, D14): TRL's fused log-prob head scores only the labelled positions on CPU too, and
   `sdpa` attention reads grouped key/value heads in place on CPU. Nothing is switched at import time.
3. `growing_cache(model)`: the agent loop's KV cache, a transformers `DynamicCache` whose layers write each decode
   step in place (a subclass of its `DynamicLayer`).
4. TRL helpers that TRL does not export at its top level (`use_adapter`, `unwrap_model_for_generation`, the chunked
   divergence kernel, ...), re-exported, and two private config attributes read through functions.

Decision ids (`Dn`) without a page are docs/methods/grpo.md's.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import trl.trainer.utils as trl_utils
from transformers.cache_utils import DynamicLayer
from transformers.integrations import sdpa_attention
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer
from trl.models import unwrap_model_for_generation
from trl.trainer import disable_dropout_in_model
from trl.trainer.utils import add_fused_lm_head, create_model_from_path, get_config_model_id, use_adapter

__all__ = [
    "PRIVATE",
    "TRLSeams",
    "add_fused_lm_head",
    "attn_implementation",
    "chunked_divergence",
    "cpu_fast_paths",
    "create_model_from_path",
    "generation_batch",
    "disable_dropout_in_model",
    "get_config_model_id",
    "GrowingLayer",
    "growing_cache",
    "name_or_path",
    "per_position_cache",
    "unwrap_model_for_generation",
    "use_adapter",
    "weights_sharded",
]

# Every private or unexported name this module uses, by owner. tests/test_trl_api.py pins each one and checks that
# no other project file uses any private name of TRL's or transformers' trainer, config or cache.
PRIVATE = {
    "trl.GRPOTrainer": [
        "_generate_and_score_completions",
        "_calculate_rewards",
        "_compute_loss",
        "_get_per_token_logps_and_entropies",
        "_get_train_sampler",
        "_metrics",
        "_step",
    ],
    "transformers.Trainer": ["_save_checkpoint", "_load_from_checkpoint", "_get_output_dir"],
    "transformers.PretrainedConfig": ["_attn_implementation", "_name_or_path"],
    "trl.trainer.utils": [
        "_use_triton",
        "add_fused_lm_head",
        "create_model_from_path",
        "get_config_model_id",
        "use_adapter",
        "disable_dropout_in_model",
    ],
    "trl.models": ["unwrap_model_for_generation"],
    "trl.kernels.chunked_divergence": ["ChunkedDivergenceFunction"],
    "transformers.integrations.sdpa_attention": ["use_gqa_in_sdpa"],
    "transformers.cache_utils": ["DynamicLayer"],
    "transformers.trainer_utils": ["PREFIX_CHECKPOINT_DIR"],
    "transformers.distributed.fsdp": ["is_fsdp_managed_module"],
    "transformers.integrations.deepspeed": ["is_deepspeed_zero3_enabled"],
}


# --------------------------------------------------------------------------------------------------------------------
# 1. TRL's private trainer methods as the project's public ones


class TRLSeams(GRPOTrainer):
    """`GRPOTrainer` with its private seams renamed. TRL calls the private name; it lands on the public one below,
    which a subclass overrides (calling `super()` for TRL's behaviour). The methods and their TRL 1.16 parameters:

    * `generate_and_score(inputs)`: `_generate_and_score_completions`, one generation batch from dataset rows.
    * `calculate_rewards(inputs, prompts, completions, completion_ids_list)`: `_calculate_rewards`, the (N, F)
      rewards per function, gathered over processes.
    * `micro_batch_loss(model, inputs)`: `_compute_loss`, the loss of one micro-batch; `trl_loss` is TRL's own.
    * `token_logps(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
      **multimodal)`: `_get_per_token_logps_and_entropies`, TRL's log-prob forward (logps, entropies, aux loss).
    * `train_sampler(dataset)`: `_get_train_sampler`.
    * `save_checkpoint(model, trial)` / `load_checkpoint(path, model)`: transformers' `_save_checkpoint` /
      `_load_from_checkpoint`.
    """

    # -- TRL calls these; they forward to the public names --------------------------------------------------------
    def _generate_and_score_completions(self, inputs):
        return self.generate_and_score(inputs)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        return self.calculate_rewards(inputs, prompts, completions, completion_ids_list)

    def _compute_loss(self, model, inputs):
        return self.micro_batch_loss(model, inputs)

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        return self.token_logps(
            model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
            **multimodal,
        )  # fmt: skip

    def _get_train_sampler(self, dataset=None):
        return self.train_sampler(dataset)

    def _save_checkpoint(self, model, trial):
        return self.save_checkpoint(model, trial)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        return self.load_checkpoint(resume_from_checkpoint, model)

    # -- the public names: TRL's behaviour by default --------------------------------------------------------------
    def generate_and_score(self, inputs: list[dict]) -> dict:
        return GRPOTrainer._generate_and_score_completions(self, inputs)

    def calculate_rewards(self, inputs, prompts, completions, completion_ids_list) -> torch.Tensor:
        return GRPOTrainer._calculate_rewards(self, inputs, prompts, completions, completion_ids_list)

    def micro_batch_loss(self, model, inputs: dict) -> torch.Tensor:
        return self.trl_loss(model, inputs)

    def trl_loss(self, model, inputs: dict) -> torch.Tensor:
        """TRL's own GRPO loss of one micro-batch (ratio, clipping, KL, aggregation), whatever a subclass overrides."""
        return GRPOTrainer._compute_loss(self, model, inputs)

    def token_logps(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        return GRPOTrainer._get_per_token_logps_and_entropies(
            self, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
            **multimodal,
        )  # fmt: skip

    def train_sampler(self, dataset=None):
        return GRPOTrainer._get_train_sampler(self, dataset)

    def save_checkpoint(self, model, trial) -> None:
        GRPOTrainer._save_checkpoint(self, model, trial)

    def load_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        GRPOTrainer._load_from_checkpoint(self, resume_from_checkpoint, model)

    # -- TRL's private state ---------------------------------------------------------------------------------------
    @property
    def micro_step(self) -> int:
        """Micro-steps (`training_step` calls) so far: TRL's `_step`."""
        return self._step

    def log_metric(self, name: str, value: float) -> None:
        """Add `value` to metric `name` of this logging window (TRL averages a window's values when it logs)."""
        mode = "train" if self.model.training else "eval"
        self._metrics[mode][name].append(float(value))

    def logged_metrics(self, mode: str = "train") -> dict[str, list[float]]:
        """The values of each metric in the current logging window, TRL's and the project's (read only)."""
        return self._metrics[mode]

    def checkpoint_folder(self, trial=None) -> str:
        """The folder transformers' `_save_checkpoint` writes the checkpoint of the current global step into."""
        return os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")


def generation_batch(trainer: GRPOTrainer, rows: list[dict]) -> dict:
    """One generation batch of any `GRPOTrainer`, TRL's own or the project's, from dataset rows (each prompt's rows
    repeated `num_generations` times): TRL's `_generate_and_score_completions`, under `cpu_fast_paths` so that both
    kinds run with the same CPU switches (benchmarks compare them side by side)."""
    with cpu_fast_paths():
        return trainer._generate_and_score_completions(rows)


# --------------------------------------------------------------------------------------------------------------------
# 2. The CPU switches, made only while a trainer's pass runs


def _compact_on_cpu(use_triton):
    """TRL's `_use_triton(device)`, True on CPU too (docs/methods/grpo.md D12).

    `trl.trainer.utils.add_fused_lm_head` asks `_use_triton(device)` whether to project only the labelled positions
    through the LM head: elsewhere it scores every position, so that the tile shapes stay fixed on backends that
    compile per shape. A CPU compiles nothing, so there the compact path does the same arithmetic on fewer rows. The
    kernel's own choice of Triton or torch tiles is a separate lookup in `trl.kernels.chunked_logprob` and stays."""

    @functools.wraps(use_triton)  # `__wrapped__`: TRL's own choice
    def use_compact_path(device: torch.device) -> bool:
        return device.type == "cpu" or use_triton(device)

    return use_compact_path


def _gqa_on_cpu(use_gqa_in_sdpa):
    """transformers' `use_gqa_in_sdpa(attention_mask, key, value)`, True for CPU tensors (docs/methods/grpo.md D14).

    A model whose query heads share key/value heads (grouped-query attention, as the tiny default's 4 query heads
    share 2) reaches `torch.nn.functional.scaled_dot_product_attention` through transformers' `sdpa_attention_forward`.
    With an attention mask, it passes `enable_gqa` only where `use_gqa_in_sdpa` allows, which excludes the CPU, and
    otherwise copies every key and value head once per query head it serves (`repeat_kv`) before each call. PyTorch's
    CPU kernels take `enable_gqa` with a mask and give the same result up to float rounding (tested), so on CPU tensors
    the copy is skipped; other devices keep transformers' own choice (on CUDA a mask with `enable_gqa` would fall back
    to the slow math kernel)."""

    @functools.wraps(use_gqa_in_sdpa)  # `__wrapped__`: transformers' own choice
    def use_gqa(attention_mask, key: torch.Tensor, value: torch.Tensor) -> bool:
        return key.device.type == "cpu" or use_gqa_in_sdpa(attention_mask, key, value)

    return use_gqa


_switch_lock = threading.Lock()
_switch_depth = 0
_switched: list[tuple[object, str, object]] = []  # (module, name, original) while the switches are on


@contextmanager
def cpu_fast_paths() -> Iterator[None]:
    """While open, TRL's fused log-prob head scores only labelled positions on CPU (D12) and `sdpa` attention reads
    grouped key/value heads in place on CPU (D14); other devices are unchanged. Blocks nest: the switches are made by
    the outermost block and undone when it closes, whatever happened inside. The trainer opens one around `train`,
    each generation batch and each log-prob forward; code that plays episodes outside a trainer (held-out evaluation)
    opens its own."""
    global _switch_depth
    with _switch_lock:
        if _switch_depth == 0:
            for module, name, wrap in (
                (trl_utils, "_use_triton", _compact_on_cpu),
                (sdpa_attention, "use_gqa_in_sdpa", _gqa_on_cpu),
            ):
                original = getattr(module, name)
                _switched.append((module, name, original))
                setattr(module, name, wrap(original))
        _switch_depth += 1
    try:
        yield
    finally:
        with _switch_lock:
            _switch_depth -= 1
            if _switch_depth == 0:
                while _switched:
                    module, name, original = _switched.pop()
                    setattr(module, name, original)


# --------------------------------------------------------------------------------------------------------------------
# 3. The agent loop's KV cache


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are views into buffers with room to spare, so that a decode step writes
    its position in place where `DynamicLayer` copies the whole cache (`torch.cat`; about a quarter of a decode step of
    the tiny default at 300 cached positions). The buffers double when full. `narrow` / `widen` let the agent loop go
    on with some rows of a batch and come back to all of them (trainers/agent_loop.py)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.key_buffer = self.value_buffer = None
        self.length = 0
        self.full = None  # (keys, values) of the whole batch while `narrow`ed
        self.synced = 0  # positions [0, synced) of the decoded rows are in `full`

    def _views(self) -> None:
        self.keys, self.values = self.key_buffer[:, :, : self.length], self.value_buffer[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, q = self.length, key_states.shape[-2]
        if self.key_buffer is None or n + q > self.key_buffer.shape[-2]:
            room = 2 * (n + q)
            keys = key_states.new_empty((*key_states.shape[:2], room, key_states.shape[-1]))
            values = value_states.new_empty((*value_states.shape[:2], room, value_states.shape[-1]))
            if n:
                keys[:, :, :n], values[:, :, :n] = self.keys, self.values
            self.key_buffer, self.value_buffer = keys, values
        self.key_buffer[:, :, n : n + q] = key_states
        self.value_buffer[:, :, n : n + q] = value_states
        self.length = n + q
        self._views()
        return self.keys, self.values

    def narrow(self, rows: torch.Tensor, keep: torch.Tensor, n: int, capacity: int) -> None:
        """Go on with the rows `rows[keep]` only (`rows` (W,): the batch rows this layer's buffers hold, in order, out
        of `n`). The whole batch is kept aside, zeros after each row's written positions, with room for `capacity`."""
        if self.full is None:
            k, v = self.key_buffer, self.value_buffer
            self.full = [
                k.new_zeros((n, k.shape[1], capacity, k.shape[3])),
                v.new_zeros((n, v.shape[1], capacity, v.shape[3])),
            ]
            self.synced = 0  # nothing written back yet
        self._write_back(rows)
        self.key_buffer, self.value_buffer = self.full[0][rows[keep]], self.full[1][rows[keep]]
        self._views()

    def widen(self, rows: torch.Tensor) -> None:
        """After `narrow`: the whole batch again, the rows `rows` with everything written since."""
        if self.full is not None:
            self._write_back(rows)
            self.key_buffer, self.value_buffer = self.full
            self.full = None
            self._views()

    def _write_back(self, rows: torch.Tensor) -> None:
        span = slice(self.synced, self.length)
        self.full[0][rows, :, span] = self.key_buffer[:, :, span]
        self.full[1][rows, :, span] = self.value_buffer[:, :, span]
        self.synced = self.length

    def get_seq_length(self) -> int:
        """The cached positions: `length`, a plain int, where `DynamicLayer` reads the keys' shape. The two agree; the
        int keeps a compiled forward (torch_compile, docs/methods/grpo.md D16) from taking the key view and its buffer
        as two aliased graph inputs, which inductor cannot compile with dynamic shapes."""
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove < 0 and self.is_initialized and self.length:
            self.length = max(0, self.length + tokens_to_remove)
            self._views()
        else:
            super().crop(tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0:
            self.key_buffer = self.key_buffer.repeat_interleave(repeats, dim=0)
            self.value_buffer = self.value_buffer.repeat_interleave(repeats, dim=0)
            self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0:
            self.key_buffer, self.value_buffer = self.key_buffer[indices], self.value_buffer[indices]
            self._views()


def growing_cache(model):
    """An empty `DynamicCache` for `model` with `GrowingLayer`s, or None when the model's cache is not one plain
    per-position cache per layer (sliding-window, linear-attention or encoder-decoder models: `generate` handles
    those)."""
    from transformers import DynamicCache

    config = model.config
    if config.is_encoder_decoder or not getattr(model, "can_generate", lambda: False)():
        return None
    try:
        cache = DynamicCache(config=config)
    except Exception:  # a config DynamicCache cannot read
        return None
    if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    cache.layers = [GrowingLayer() for _ in cache.layers]
    return cache


def per_position_cache(cache) -> bool:
    """Whether every layer of `cache` is a plain per-position cache (a `DynamicLayer` or a `GrowingLayer`): not a
    sliding-window, linear-attention or static one."""
    return all(type(layer) in (DynamicLayer, GrowingLayer) for layer in cache.layers)


# --------------------------------------------------------------------------------------------------------------------
# 4. Unexported helpers and private config attributes


def chunked_divergence(hidden_s, head_s, hidden_t, head_t, beta: float, temperature: float) -> torch.Tensor:
    """Per-token generalized JSD (N,) between two LM heads' next-token distributions at `temperature`, from their
    hidden states (N, H), through TRL's chunked kernel (no (N, V) logits): β = 1 is the reverse KL(student ‖ teacher),
    0.5 the JSD, 0 the forward KL (`trl.kernels.chunked_divergence`)."""
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    out, _ = ChunkedDivergenceFunction.apply(
        hidden_s, head_s.weight, head_s.bias, hidden_t, head_t.weight, head_t.bias, beta, temperature
    )
    return out


def weights_sharded(model) -> bool:
    """Whether `model`'s weights are sharded over processes by DeepSpeed ZeRO-3 or FSDP: the test `generate` makes."""
    from transformers.distributed.fsdp import is_fsdp_managed_module
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model)


def attn_implementation(config) -> str | None:
    """The attention implementation a loaded model runs (`config._attn_implementation`)."""
    return config._attn_implementation


def name_or_path(config) -> str:
    """The Hub id or folder a model was loaded from (`config._name_or_path`)."""
    return config._name_or_path
