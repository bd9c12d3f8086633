"""MoE rollout routing replay (R3), https://huggingface.co/papers/2510.11370; docs/methods/routing-replay.md.

The sampler records which experts every MoE router chose for every input position; the trainer's own log-prob
forwards (old-log-prob pass, actor forward and its checkpoint recompute) then reuse that *selection* while the gate
*weights* are recomputed from the live router logits, so the router keeps its gradient.

What this module does:

1. Finds the MoE routers of a model by class (`find_routers`, `is_moe`) and raises at once, naming the model and
   router classes, for an MoE family without an adapter. Supported: Qwen3-MoE, Mixtral, OLMoE (D12). Dense models
   are a no-op (D3).
2. Records top-k ids (Eq. 2), and optionally gate weights for the test-only full replay, with forward hooks
   (`RouteRecorder`), around HF `generate` or any forward. Ids are stored as int16 (§5).
3. Turns one `generate` call's record into per-row records of N_b - 1 rows (`split_generate_routes`; left padding
   and post-EOS decode steps dropped), stitches turns with the first-computation rule (`stitch_turn_routes`, D5),
   measures the prefix re-prefill mismatch (`prefix_recompute_mismatch`, Eq. 11) and lays records out in TRL's
   left-padded prompt + right-padded completion layout with the -1 sentinel (`routes_to_training_layout`, D4).
4. Replays (`replay_routes`, Eq. 3): selection from the record, weights from the live logits with the family's own
   formula (Eq. 4-5); with `weights=` it is the test-only full replay (D11). Validation is strict (D4, §7 item 11).
5. Diagnostics: flip rate (`routing_flips`, Eq. 9) and record size (`record_bytes_per_token`, Eq. 8).
6. `force_replay_settings` zeroes the aux-loss coefficient in the model config and Mixtral jitter (D10).
7. In the trainer (`RoutingReplay`, the one object `AgentGRPOTrainer` owns and calls at named points), with
   `routing_replay: true`: the agent loop records every router's top-k expert ids during HF generation; the per-row
   records (stitched over turns, D5) are laid out in TRL's training layout as the batch-first `routing` (B, S, L, k)
   tensor of the batch, so TRL shuffles and splits it with the rows (D4). The policy's own log-prob forwards
   (old-log-prob pass, actor forward and its checkpoint recompute) replay the recorded selection with gate weights from
   the live router logits (Eq. 3); the reference pass (a separate model, or the PEFT policy with adapters disabled), a
   separate critic and generation route freely (D7). A replay installed for a forward with gradient is held until the
   micro-step's backward has run (D8), and a chunked forward replays each chunk's row slice (D9). The load-balancing
   loss and Mixtral jitter are forced to 0 (D10). Unsupported setups raise at init (D1, D12, D13).

Logged metrics of MoE policies (routing-replay.md §8): `routing/logp_gap` (Eq. 10, mean |old-policy log-prob -
sampler log-prob| over model tokens; on-policy runs use the first actor forward on the batch; logged with and without
replay), and with replay on: `routing/replay_active` (1), `routing/flip_frac` and `routing/flip_token_frac` (Eq. 9,
free routing vs the record, one micro-batch every 10 optimizer steps), `routing/prefix_recompute_mismatch_frac`
(Eq. 11), `routing/record_bytes_per_token` and `routing/record_mb` (Eq. 8, the batch's `routing` tensor over all
processes), `routing/router_grad_norm` (when the routers are trainable).

What it leaves out:

* Routes from vLLM / SGLang (D1): only HF `generate` is hooked here.
* Adapters for Qwen2-MoE, Qwen3.5-MoE, GPT-OSS, GraniteMoE and DeepSeek-V3 routers (Eq. 4 and 6): they raise until
  each has its identity test (D12).
* Placeholder copies at re-tokenised boundaries (D6): the project's rollouts are token-in/token-out, so a missing
  record is always an error here.
* Overriding TRL: the trainer (trainers/base.py) overrides TRL's private methods and calls `RoutingReplay` from
  them, handing in TRL's own log-prob forward.
* TRL's own `GRPOConfig.router_aux_loss_coef`, which the trainer must set to 0.0 itself (D10).

Decision ids (`Dn`) without a page are docs/methods/routing-replay.md's.
"""

import logging
import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from peft import PeftModel
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock, MixtralTopKRouter
from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

logger = logging.getLogger(__name__)


class ReplayHost(Protocol):
    """What `RoutingReplay` reads of the trainer that owns it (`trainers.base.AgentGRPOTrainer`). A protocol, so that
    this module imports neither the trainer nor the agent loop: both import it."""

    accelerator: Any
    model: nn.Module
    args: Any
    state: Any
    use_vllm: bool
    env_factory: Callable | None
    tools: list | None

    def log_metric(self, name: str, value: float) -> None: ...

    def loss_mask(self, inputs: dict) -> Tensor: ...

    def forward_logps(self, model, inputs: dict, compute_entropy: bool = False, scored: Tensor | None = None): ...


class RouteRecord(Protocol):
    """What `RoutingReplay` reads of one of the agent loop's rollouts (`trainers.agent_loop.Rollout`)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    routes: Tensor | None
    route_mismatch: int
    route_compared: int


ROUTE_DTYPE = torch.int16  # routing-replay.md §5: record dtype int16 (E <= 32767 plus the sentinel)
NO_ROUTE = -1  # routing-replay.md §3: "no record" (padding, and each row's final position)
FLIP_EVERY = 10  # routing-replay.md §5 / D14: the flip diagnostic runs on one micro-batch every 10 optimizer steps


# --------------------------------------------------------------------------------------------------------------------
# 1. Family adapters: gate weights at given expert ids, from the live router logits
# --------------------------------------------------------------------------------------------------------------------


def _softmax_topk_weights(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """Qwen3-MoE / OLMoE weights at `indices` (rows, k) from raw `logits` (rows, E), op for op as the family."""
    probs = F.softmax(logits, dtype=torch.float, dim=-1)  # (rows, E) in fp32, as the router
    weights = probs.gather(-1, indices)  # (rows, k); Eq. 5 when norm_topk_prob is False
    if router.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)  # Eq. 4
    return weights.to(logits.dtype)  # (rows, k), cast back as the router does


def _mixtral_weights(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """Mixtral weights at `indices` (rows, k): always renormalised and kept in fp32, as `MixtralTopKRouter`."""
    probs = F.softmax(logits.float(), dim=-1)  # (rows, E)
    weights = probs.gather(-1, indices)  # (rows, k)
    return weights / weights.sum(dim=-1, keepdim=True)  # Eq. 4, fp32


# routing-replay.md D3: routers are discovered by class, never by module name. All three compute z = W h (no bias).
ROUTER_WEIGHTS: dict[type[nn.Module], Callable[[nn.Module, Tensor, Tensor], Tensor]] = {
    Qwen3MoeTopKRouter: _softmax_topk_weights,
    OlmoeTopKRouter: _softmax_topk_weights,
    MixtralTopKRouter: _mixtral_weights,
}


# --------------------------------------------------------------------------------------------------------------------
# 2. Router discovery
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoERouters:
    """The MoE routers of a model in forward order; their order is the L axis of every route tensor (§3)."""

    names: tuple[str, ...]  # module names, e.g. "model.layers.0.mlp.gate"
    modules: tuple[nn.Module, ...]
    layer_ids: tuple[int, ...]  # decoder-layer index of each L-axis position (dense layers are skipped)
    num_experts: int  # E
    top_k: int  # k


def _looks_like_router(module: nn.Module) -> bool:
    # transformers 5.24 names every MoE router class "...Router" (77 classes: TopKRouter, TopkRouter, Top1Router, ...)
    return type(module).__name__.endswith("Router")


def is_moe(model: nn.Module) -> bool:
    """True if `model` contains any MoE router module, supported or not."""
    return any(_looks_like_router(module) for module in model.modules())


def find_routers(model: nn.Module) -> MoERouters | None:
    """The supported MoE routers of `model`, or `None` for a dense model. Raises for an MoE family without adapter."""
    names, modules, layer_ids = [], [], []
    for name, module in model.named_modules():
        if type(module) in ROUTER_WEIGHTS:
            digits = re.findall(r"\.(\d+)\.", f".{name}.")
            names.append(name)
            modules.append(module)
            layer_ids.append(int(digits[-1]) if digits else len(layer_ids))
        elif _looks_like_router(module):
            supported = ", ".join(sorted(cls.__name__ for cls in ROUTER_WEIGHTS))
            raise ValueError(
                f"routing replay: {type(model).__name__} is an MoE model whose router {type(module).__name__} "
                f"(at '{name}') has no replay adapter; supported routers: {supported} (routing-replay.md D12). "
                "Turn routing replay off for this model."
            )
    if not modules:
        return None
    shapes = {(m.num_experts, m.top_k) for m in modules}
    if len(shapes) != 1:
        raise ValueError(f"routing replay: {type(model).__name__} mixes router shapes (E, k) = {sorted(shapes)}")
    ((num_experts, top_k),) = shapes
    return MoERouters(tuple(names), tuple(modules), tuple(layer_ids), num_experts, top_k)


def force_replay_settings(model: nn.Module) -> list[str]:
    """Zero the config's load-balancing coefficient and Mixtral router jitter (D10); returns what changed, to log."""
    changes = []
    config = model.config
    if config.router_aux_loss_coef != 0.0:  # all three supported configs carry it
        changes.append(f"router_aux_loss_coef {config.router_aux_loss_coef} -> 0.0")
        config.router_aux_loss_coef = 0.0
    for name, module in model.named_modules():
        if isinstance(module, MixtralSparseMoeBlock) and module.jitter_noise != 0.0:
            changes.append(f"{name}.jitter_noise {module.jitter_noise} -> 0.0")
            module.jitter_noise = 0.0
            config.router_jitter_noise = 0.0
    for change in changes:
        logger.warning("routing replay forces %s (routing-replay.md D10)", change)
    return changes


# --------------------------------------------------------------------------------------------------------------------
# 3. Recording
# --------------------------------------------------------------------------------------------------------------------


class RouteRecorder:
    """Context manager recording each router's top-k ids (Eq. 2), and optionally its gate weights, per forward call.

    Use around `model.generate(...)` (one prefill call, then one call per decode step) or around a plain forward.
    Record only in no-grad forwards: an activation-checkpoint recompute would record a layer twice. A dense model
    records nothing (and `indices` raises).

    Args:
        model (`nn.Module`): the policy (a PEFT wrapper is fine).
        keep_weights (`bool`, *optional*, defaults to `False`): also keep the gate weights, for the test-only full
            replay (D11).
    """

    def __init__(self, model: nn.Module, keep_weights: bool = False) -> None:
        self.model_name = type(model).__name__
        self.routers = find_routers(model)
        self.keep_weights = keep_weights
        num_layers = len(self.routers.modules) if self.routers else 0
        self._indices: list[list[Tensor]] = [[] for _ in range(num_layers)]  # [layer][call] -> (rows, k) int16
        self._weights: list[list[Tensor]] = [[] for _ in range(num_layers)]  # [layer][call] -> (rows, k)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> "RouteRecorder":
        if self.routers is None:
            logger.info("routing replay: %s has no MoE router; nothing to record", self.model_name)
            return self
        for layer, router in enumerate(self.routers.modules):
            self._handles.append(router.register_forward_hook(self._make_hook(layer)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _make_hook(self, layer: int) -> Callable:
        def hook(router: nn.Module, args: tuple, output: tuple[Tensor, Tensor, Tensor]) -> None:
            _, weights, indices = output  # (rows, E) logits, (rows, k) weights, (rows, k) ids
            self._indices[layer].append(indices.detach().to(ROUTE_DTYPE))  # Eq. 2
            if self.keep_weights:
                self._weights[layer].append(weights.detach().clone())

        return hook

    @property
    def num_calls(self) -> int:
        """Forward calls recorded so far (a generate of T new tokens makes T calls: prefill + T - 1 decode steps)."""
        return len(self._indices[0]) if self._indices else 0

    def clear(self) -> None:
        for per_layer in (*self._indices, *self._weights):
            per_layer.clear()

    def _assemble(self, per_layer_calls: list[list[Tensor]], batch_size: int, what: str) -> Tensor:
        if self.routers is None:
            raise ValueError(f"routing replay: {self.model_name} has no MoE router, so there are no {what}")
        counts = {len(calls) for calls in per_layer_calls}
        if counts == {0}:
            raise ValueError(f"routing replay: no {what} recorded (keep_weights={self.keep_weights})")
        if len(counts) != 1:
            raise ValueError(f"routing replay: MoE layers recorded different numbers of forward calls: {counts}")
        chunks = []
        for call, per_layer in enumerate(zip(*per_layer_calls, strict=True)):
            rows = per_layer[0].shape[0]
            if rows % batch_size:
                raise ValueError(
                    f"routing replay: forward call {call} routed {rows} rows, not a multiple of B = {batch_size}"
                )
            stacked = torch.stack(per_layer, dim=1)  # (rows, L, k), rows = B * positions, row-major over (B, pos)
            chunks.append(stacked.view(batch_size, rows // batch_size, *stacked.shape[1:]))  # (B, pos, L, k)
        return torch.cat(chunks, dim=1)  # (B, positions over all calls, L, k)

    def indices(self, batch_size: int) -> Tensor:
        """Recorded ids (B, positions, L, k) int16, calls concatenated; after `generate` positions = P + T_gen - 1."""
        return self._assemble(self._indices, batch_size, "routes")

    def weights(self, batch_size: int) -> Tensor:
        """Recorded gate weights, (B, positions, L, k) in the dtype the routers returned (needs `keep_weights`)."""
        return self._assemble(self._weights, batch_size, "gate weights")


# --------------------------------------------------------------------------------------------------------------------
# 4. Records: per row, across turns, and in the training layout
# --------------------------------------------------------------------------------------------------------------------


def _row_lengths(prompt_mask: Tensor, completion_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row prompt and completion token counts; checks left-padded prompts and right-padded completions."""
    P, T = prompt_mask.shape[1], completion_mask.shape[1]
    prompt_lens = prompt_mask.sum(1).long()  # (B,)
    completion_lens = completion_mask.sum(1).long()  # (B,)
    positions_p = torch.arange(P, device=prompt_mask.device)  # (P,)
    positions_c = torch.arange(T, device=completion_mask.device)  # (T,)
    expected_p = positions_p[None, :] >= (P - prompt_lens)[:, None]  # (B, P) left padding
    expected_c = positions_c[None, :] < completion_lens[:, None]  # (B, T) right padding
    for mask, expected, what in [
        (prompt_mask, expected_p, "prompt_mask"),
        (completion_mask, expected_c, "completion_mask"),
    ]:
        bad = (mask.bool() != expected).any(1).nonzero()
        if len(bad):
            raise ValueError(
                f"routing replay: row {bad[0].item()} of {what} is not contiguous (prompts must be left-padded, "
                "completions right-padded)"
            )
    return prompt_lens, completion_lens


def split_generate_routes(routes: Tensor, prompt_mask: Tensor, completion_mask: Tensor) -> list[Tensor]:
    """Cut one `generate` call's record into per-row records of N_b - 1 rows (D1, §7 items 5-6).

    Args:
        routes (`Tensor`): (B, P + T_gen - 1, L, k) from `RouteRecorder.indices(B)` (or `.weights(B)`).
        prompt_mask (`Tensor`): (B, P), the left-padded attention mask passed to `generate`.
        completion_mask (`Tensor`): (B, T), 1 on the generated tokens each row keeps (through its EOS), right-padded.

    Returns:
        `list[Tensor]`: row b's record, (p_b + c_b - 1, L, k): its prompt tokens, then its kept completion tokens
        except the last one, which is never fed back. Left padding and decode steps after EOS are dropped.
    """
    B, P = prompt_mask.shape
    if routes.shape[0] != B:
        raise ValueError(f"routing replay: routes have {routes.shape[0]} rows but prompt_mask has {B}")
    prompt_lens, completion_lens = _row_lengths(prompt_mask, completion_mask)
    fed = routes.shape[1] - P + 1  # completion tokens the sampler produced: prefill + (fed - 1) decode steps
    if fed < 1 or completion_lens.max() > fed:
        raise ValueError(
            f"routing replay: record covers {routes.shape[1]} positions = P ({P}) + {fed - 1} decode steps, but "
            f"completion_mask keeps up to {completion_lens.max().item()} tokens (needs P + c_b - 1 positions)"
        )
    return [
        routes[b, P - prompt_lens[b] : P + completion_lens[b] - 1]  # (p_b + c_b - 1, L, k)
        for b in range(B)
    ]


def stitch_turn_routes(previous: Tensor, new: Tensor) -> Tensor:
    """First-computation rule (D5): keep `previous` rows, take only the positions `new` computed first.

    Args:
        previous (`Tensor`): (n_prev, L, k), the row's record so far (earlier turns, N_prev - 1 rows).
        new (`Tensor`): (n_new, L, k), the row's record from the next generate call on the grown stream: its prefill
            re-covers all earlier positions. On its own, `new` is the "keep the last call" record; it equals the
            stitched one when `prefix_recompute_mismatch` is all False.

    Returns:
        `Tensor`: (n_new, L, k).
    """
    if new.shape[0] < previous.shape[0] or new.shape[1:] != previous.shape[1:]:
        raise ValueError(
            f"routing replay: the new call's record {tuple(new.shape)} does not extend the previous one "
            f"{tuple(previous.shape)}; the stream must only grow between turns"
        )
    return torch.cat([previous, new[previous.shape[0] :]], dim=0)  # (n_new, L, k)


def _same_sets(a: Tensor, b: Tensor) -> Tensor:
    """(..., k) id tensors -> (...) bool: same expert set, order ignored."""
    return (a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1)


def prefix_recompute_mismatch(previous: Tensor, new: Tensor) -> Tensor:
    """Eq. 11: (n_prev, L) bool, True where the new call's prefill chose another expert set than the record held.

    `previous` (n_prev, L, k), `new` (n_new >= n_prev, L, k). Its mean is `routing/prefix_recompute_mismatch_frac`.
    """
    return ~_same_sets(previous, new[: previous.shape[0]].to(previous.dtype))  # Eq. 11


def routes_to_training_layout(
    records: list[Tensor], prompt_mask: Tensor, completion_mask: Tensor, fill_value: float = NO_ROUTE
) -> Tensor:
    """Lay per-row records into TRL's training layout with the `input_ids` index map (D4).

    Args:
        records (`list[Tensor]`): B records, row b (N_b - 1, L, k), N_b = p_b + c_b its fed tokens.
        prompt_mask (`Tensor`): (B, P), left-padded.
        completion_mask (`Tensor`): (B, T), right-padded, 1 on **every** token fed to the model (model and
            environment tokens; not the loss mask, and before TRL's `mask_truncated_completions`).
        fill_value (`float`, *optional*, defaults to `-1`): value of positions without a record (padding and each
            row's final position); use 0.0 when laying out recorded weights.

    Returns:
        `Tensor`: `routing` (B, P + T, L, k) in the records' dtype, on `prompt_mask`'s device.
    """
    B, P = prompt_mask.shape
    if len(records) != B:
        raise ValueError(f"routing replay: {len(records)} records for a batch of {B} rows")
    prompt_lens, completion_lens = _row_lengths(prompt_mask, completion_mask)
    S = P + completion_mask.shape[1]
    out = torch.full((B, S, *records[0].shape[1:]), fill_value, dtype=records[0].dtype, device=prompt_mask.device)
    for b, record in enumerate(records):
        n_fed = int(prompt_lens[b] + completion_lens[b])  # N_b
        if record.shape[0] != n_fed - 1 or record.shape[1:] != out.shape[2:]:
            raise ValueError(
                f"routing replay: row {b} has a record of shape {tuple(record.shape)} but the layout feeds {n_fed} "
                f"tokens ({int(prompt_lens[b])} prompt + {int(completion_lens[b])} completion), so it needs "
                f"({n_fed - 1}, {', '.join(map(str, out.shape[2:]))})"
            )
        start = P - int(prompt_lens[b])
        out[b, start : start + n_fed - 1] = record.to(out.device)  # final position keeps fill_value (§3)
    return out  # (B, S, L, k)


# --------------------------------------------------------------------------------------------------------------------
# 5. Replay
# --------------------------------------------------------------------------------------------------------------------


def check_routing(routing: Tensor, routers: MoERouters, attention_mask: Tensor | None = None) -> None:
    """Strict validation before a replayed forward (D4, §7 item 11); raises naming the row, position and layer.

    Args:
        routing (`Tensor`): (B, S, L, k) integer ids, -1 where there is no record.
        routers (`MoERouters`): from `find_routers`.
        attention_mask (`Tensor` or `None`): (B, S). If given, every position with mask 1 except each row's final
            one must hold a record.
    """
    L, k, E = len(routers.modules), routers.top_k, routers.num_experts
    if routing.dim() != 4 or routing.is_floating_point():
        shape = tuple(routing.shape)
        raise ValueError(
            f"routing replay: routing must be an integer (B, S, L, k) tensor, got {routing.dtype} {shape}"
        )
    if routing.shape[2] != L:
        raise ValueError(
            f"routing replay: routing has {routing.shape[2]} layers, the model has {L} MoE layers "
            f"(decoder layers {list(routers.layer_ids)})"
        )
    if routing.shape[3] != k:
        raise ValueError(f"routing replay: routing has {routing.shape[3]} experts per token, the routers use k={k}")

    def fail(where: Tensor, what: str) -> None:
        b, j, layer = (int(x) for x in where.nonzero()[0][:3])
        raise ValueError(
            f"routing replay: {what} at row {b}, position {j}, layer {layer} (decoder layer "
            f"{routers.layer_ids[layer]}): {routing[b, j, layer].tolist()}"
        )

    if ((routing < NO_ROUTE) | (routing >= E)).any():
        fail(((routing < NO_ROUTE) | (routing >= E)).any(-1), f"expert id outside [0, {E})")
    missing = routing == NO_ROUTE  # (B, S, L, k)
    if (missing.any(-1) != missing.all(-1)).any():
        fail(missing.any(-1) != missing.all(-1), "partial record (some ids -1)")
    ids = routing.sort(dim=-1).values
    duplicate = (ids[..., 1:] == ids[..., :-1]).any(-1) & ~missing.any(-1)  # (B, S, L)
    if duplicate.any():
        fail(duplicate, "repeated expert id")
    if attention_mask is not None:
        if attention_mask.shape != routing.shape[:2]:
            raise ValueError(
                f"routing replay: routing is (B, S) = {tuple(routing.shape[:2])} but attention_mask is "
                f"{tuple(attention_mask.shape)}"
            )
        mask = attention_mask.bool()  # (B, S)
        S = mask.shape[1]
        last = S - 1 - mask.flip(1).long().argmax(1)  # (B,) final fed position of each row
        needs = mask & (torch.arange(S, device=mask.device)[None, :] != last[:, None])  # (B, S)
        if (needs[..., None] & missing.all(-1)).any():
            fail(needs[..., None] & missing.all(-1), "missing record (-1) at a position that needs one")


@contextmanager
def replay_routes(
    model: nn.Module, routing: Tensor, attention_mask: Tensor | None = None, weights: Tensor | None = None
) -> Iterator[None]:
    """Replay recorded expert selections in every forward (and checkpoint recompute) run inside the block (Eq. 3).

    R3 mode (`weights=None`): the experts are `routing`'s ids and the gate weights are the family formula on the
    live logits at those ids (Eq. 4-5), so the router gets gradient (Eq. 7). Full mode (`weights` given, test-only,
    D11): the recorded weights are used as well. Positions holding -1 route freely (D4). The router's first output
    (raw logits) is passed through unchanged. A dense model makes this a no-op.

    Args:
        model (`nn.Module`): the policy.
        routing (`Tensor`): (B, S, L, k) integer ids matching the forward's `input_ids` (B, S); for a row chunk,
            pass the same row slice (D9).
        attention_mask (`Tensor` or `None`): (B, S); enables the missing-record check of `check_routing`.
        weights (`Tensor` or `None`): (B, S, L, k) recorded gate weights, laid out like `routing`; full replay.
    """
    routers = find_routers(model)
    if routers is None:
        logger.info("routing replay: %s has no MoE router; replay is a no-op", type(model).__name__)
        yield
        return
    check_routing(routing, routers, attention_mask)
    if weights is not None and weights.shape != routing.shape:
        raise ValueError(f"routing replay: weights {tuple(weights.shape)} do not match routing {tuple(routing.shape)}")
    B, S, L, k = routing.shape
    handles = []

    def make_hook(layer: int, name: str) -> Callable:
        recorded = routing[:, :, layer].reshape(B * S, k).long()  # (B*S, k), row-major like the router input
        recorded_w = None if weights is None else weights[:, :, layer].reshape(B * S, k)  # (B*S, k)
        weights_fn = ROUTER_WEIGHTS[type(routers.modules[layer])]

        def hook(router: nn.Module, args: tuple, output: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, ...]:
            live_logits, live_weights, live_indices = output  # (rows, E), (rows, k), (rows, k)
            hidden = args[0].reshape(-1, router.weight.shape[1])  # (rows, H)
            if hidden.shape[0] != B * S:
                raise ValueError(
                    f"routing replay: router '{name}' received {hidden.shape[0]} rows but the installed routing "
                    f"covers B * S = {B} * {S} = {B * S}; install the slice matching this forward (D9)"
                )
            ids = recorded.to(live_indices.device)  # (rows, k)
            has_record = ids[:, :1] >= 0  # (rows, 1); -1 rows route freely (D4)
            indices = torch.where(has_record, ids, live_indices)  # (rows, k), Eq. 3: I := R
            if recorded_w is not None:  # full replay (D11): recorded ids and weights
                gate = torch.where(has_record, recorded_w.to(live_weights), live_weights)
            else:
                logits = F.linear(hidden, router.weight)  # (rows, E), Eq. 3: z(theta_current), live
                gate = weights_fn(router, logits, indices)  # (rows, k), Eq. 4 / Eq. 5
            return live_logits, gate, indices

        return hook

    try:
        for layer, (name, router) in enumerate(zip(routers.names, routers.modules, strict=True)):
            handles.append(router.register_forward_hook(make_hook(layer, name)))
        yield
    finally:
        for handle in handles:
            handle.remove()


# --------------------------------------------------------------------------------------------------------------------
# 6. Diagnostics
# --------------------------------------------------------------------------------------------------------------------


def routing_flips(recorded: Tensor, live: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Eq. 9: fraction of (position, layer) decisions, and of positions, whose live expert set differs from the record.

    Args:
        recorded (`Tensor`): (B, S, L, k) record, -1 where there is none (excluded).
        live (`Tensor`): (B, S, L, k) ids chosen by free routing on the same inputs.
        mask (`Tensor` or `None`): (B, S), 1 on the positions to count (e.g. model-token-bearing rows).

    Returns:
        `tuple[Tensor, Tensor]`: `routing/flip_frac` (F) and `routing/flip_token_frac` (F_tok), 0-d float tensors.
    """
    valid = (recorded >= 0).all(-1).all(-1)  # (B, S) positions with a record
    if mask is not None:
        valid = valid & mask.bool()
    flipped = ~_same_sets(recorded.long(), live.long()) & valid[..., None]  # (B, S, L)
    n_positions = valid.sum().clamp(min=1)
    flip_frac = flipped.sum() / (n_positions * recorded.shape[2])  # Eq. 9: F
    flip_token_frac = flipped.any(-1).sum() / n_positions  # Eq. 9: F_tok
    return flip_frac, flip_token_frac


def record_bytes_per_token(routes: Tensor) -> int:
    """Eq. 8: bytes stored per token, L * k * itemsize, for any route tensor whose last two axes are (L, k)."""
    return routes.shape[-2] * routes.shape[-1] * routes.element_size()  # Eq. 8: L * k * 2 at int16


# --------------------------------------------------------------------------------------------------------------------
# 7. The trainer's replay state
# --------------------------------------------------------------------------------------------------------------------


class RoutingReplay:
    """The routing-replay state of one `AgentGRPOTrainer` (D7-D9, D14), which owns it and calls it at named points:

    * `setup(policy)` once after TRL's init: refuses unsupported setups (D1, D12, D13), forces the replay settings
      (D10); returns whether replay is on.
    * `take_rollouts(rollouts)` after the agent loop has played a batch: checks and keeps the per-row records (§3),
      logs Eq. 11.
    * `generation()` around TRL's generate-and-score, then `add_routes(out)` (lays the records out as the batch's
      `routing`, D4) and `log_batch_metrics(out)` (Eq. 8, and Eq. 10 from the old-log-prob pass).
    * `micro_batch(inputs, first_micro_step)` around one micro-batch's loss: its routes, Eq. 9 every `FLIP_EVERY`
      optimizer steps, the on-policy Eq. 10.
    * `logps(forward, model, ...)` around TRL's log-prob forward `forward`: the policy's own passes replay (Eq. 3).
    * `release()` after a micro-step's backward (D8), `log_step_metrics()` at an optimizer step's last micro-step.
    * `free_routing()`: policy forwards inside route freely (D7).

    It reads the trainer's accelerator, model, args, `log_metric`, `loss_mask` and `forward_logps`; TRL's private
    methods are called only by the trainer, which hands them in (`forward`).

    Args:
        trainer (`ReplayHost`): the trainer that owns this state, an `AgentGRPOTrainer`.
    """

    def __init__(self, trainer: ReplayHost) -> None:
        self.trainer = trainer
        self.active = False  # True once setup found a supported MoE policy with replay on
        self.moe = False  # the policy has MoE routers (supported or not): Eq. 10 is logged with and without replay
        self._rollout_routes: list[Tensor] | None = None  # per-row records of the batch being generated
        self._routing: Tensor | None = None  # (B, S, L, k) routes of the batch the policy forwards run on
        self._replay_hooks = ExitStack()  # replay installed for a grad forward, kept until its backward has run (D8)
        self._replay_held = False  # `_replay_hooks` holds an installed replay
        self._free_routing = 0  # depth of `free_routing()` blocks
        self._gap_inputs: dict | None = None  # on-policy Eq. 10: the micro-batch whose first actor forward is measured
        self._gap_sums = torch.zeros(2, dtype=torch.float64)  # Eq. 10 numerator and denominator, this optimizer step

    # ----------------------------------------------------------------------------------------------------------------
    # Set-up and rollouts
    def setup(self, policy: nn.Module) -> bool:
        """Refuse unsupported setups at init (D1, D12, D13) and force the replay settings (D10). Returns `active`;
        the trainer then turns TRL's aux loss off (router_aux_loss_coef is 0.0, `AgentGRPOConfig.__post_init__`)."""
        trainer = self.trainer
        self.moe = is_moe(policy)
        if not trainer.args.routing_replay:
            return False
        if find_routers(policy) is None:  # raises for an MoE family without a replay adapter (D12)
            logger.warning(  # said at start-up: a dense model has no routes to replay (D3)
                "routing_replay is on, but %s has no MoE router (a dense model): it does nothing in this run",
                type(policy).__name__,
            )
            return False
        if trainer.use_vllm:
            raise ValueError(
                "routing_replay needs the sampler's routes, and TRL's vLLM client does not return them "
                "(routing-replay.md D1); set use_vllm: false (HF generation records them) or routing_replay: false"
            )
        if trainer.env_factory is None or trainer.tools:
            raise ValueError(
                "routing_replay records routes in the project's agent loop (trainers/agent_loop.py): pass env_factory "
                "and no tools/environment_factory (routing-replay.md D13)"
            )
        force_replay_settings(policy)  # logs a warning per forced value (D10)
        self.active = True
        return True

    def take_rollouts(self, rollouts: list[RouteRecord]) -> None:
        """Keep the agent loop's per-row records on the trainer, where the old-log-prob pass that TRL runs before
        merging rollout fields into the rows finds them (D7); log Eq. 11."""
        if not self.active:
            return
        for b, r in enumerate(rollouts):
            n_fed = len(r.prompt_ids) + len(r.completion_ids)  # N_b
            if r.routes is None or r.routes.shape[0] != n_fed - 1:
                found = None if r.routes is None else tuple(r.routes.shape)
                raise ValueError(
                    f"routing replay: rollout {b} feeds {n_fed} tokens but its route record is {found}, not "
                    f"({n_fed - 1}, L, k) (routing-replay.md §3)"
                )
        self._rollout_routes = [r.routes for r in rollouts]
        accelerator = self.trainer.accelerator
        mismatch = torch.tensor([sum(r.route_mismatch for r in rollouts), sum(r.route_compared for r in rollouts)])
        mismatch = accelerator.reduce(mismatch.to(accelerator.device), reduction="sum")
        frac = mismatch[0] / mismatch[1].clamp(min=1)  # Eq. 11
        self.trainer.log_metric("routing/prefix_recompute_mismatch_frac", frac)

    @contextmanager
    def generation(self) -> Iterator[None]:
        """Around TRL's generate-and-score: nothing replays during generation (D7); the records live until the block
        ends, the laid-out routes until the batch's loss."""
        self.release()
        self._rollout_routes, self._routing = None, None
        try:
            yield
        finally:
            self._rollout_routes = None

    def add_routes(self, out: dict) -> None:
        """Put the batch's `routing` (B, S, L, k) into TRL's output, batch-first so TRL shuffles and splits it with
        the rows (D4); policy forwards on this batch replay it until the loss."""
        if not self.active:
            return
        if self._routing is None:  # no old-log-prob pass laid it out already
            self._routing = self._layout_routes(out["prompt_mask"], out["completion_ids"].size(1))
        out["routing"] = self._routing  # (B, S, L, k)

    def _layout_routes(self, prompt_mask: Tensor, completion_width: int) -> Tensor:
        """The rollout's per-row records in TRL's training layout, (B, P + T, L, k), -1 where there is none (D4)."""
        if self._rollout_routes is None:
            raise ValueError(
                "routing replay: no route records for this batch; were the rollouts played by the agent loop?"
            )
        prompt_lens = prompt_mask.sum(1).cpu()  # (B,)
        records_len = torch.tensor([r.shape[0] for r in self._rollout_routes])  # (B,) N_b - 1
        completion_lens = records_len + 1 - prompt_lens  # (B,) every completion token is fed: model and environment
        if completion_lens.min() < 1 or completion_lens.max() > completion_width:
            raise ValueError(
                f"routing replay: route records of {records_len.tolist()} rows do not fit prompts of "
                f"{prompt_lens.tolist()} tokens and a completion width of {completion_width}"
            )
        completion_mask = torch.arange(completion_width)[None, :] < completion_lens[:, None]  # (B, T)
        return routes_to_training_layout(
            self._rollout_routes, prompt_mask, completion_mask.long().to(prompt_mask.device)
        )

    # ----------------------------------------------------------------------------------------------------------------
    # The policy's log-prob forwards
    @contextmanager
    def free_routing(self) -> Iterator[None]:
        """Policy forwards inside this block route freely even when replay is on (e.g. a critic adapter on the
        policy's base, routing-replay.md D7). Under activation checkpointing, run them before the actor forward."""
        self._free_routing += 1
        try:
            yield
        finally:
            self._free_routing -= 1

    @contextmanager
    def micro_batch(self, inputs: dict, first_micro_step: Callable[[], bool]) -> Iterator[None]:
        """Around one micro-batch's loss: checks its `routing`, runs the flip diagnostic on the first micro-step
        (`first_micro_step()`, asked only then) of every `FLIP_EVERY`-th optimizer step (D14), and marks the batch for
        the on-policy Eq. 10."""
        trainer = self.trainer
        if self.active:
            if inputs.get("routing") is None:
                raise ValueError(
                    "routing replay is on but the micro-batch has no `routing` tensor: batches must come from this "
                    "trainer's `_generate_and_score_completions` with the agent loop (routing-replay.md D4)"
                )
            if trainer.model.training and trainer.state.global_step % FLIP_EVERY == 0 and first_micro_step():
                self._log_flips(inputs)
        if self.moe and trainer.model.training and inputs.get("old_per_token_logps") is None:
            self._gap_inputs = inputs  # on-policy: Eq. 10 from the first actor forward at the behaviour weights (D14)
        self._routing = inputs.get("routing") if self.active else None  # this micro-batch's routes
        try:
            yield
        finally:
            self._routing, self._gap_inputs = None, None

    def logps(
        self,
        forward: Callable,
        model: nn.Module,
        input_ids: Tensor,
        attention_mask: Tensor,
        logits_to_keep: int,
        batch_size: int | None,
        compute_entropy: bool,
        compute_aux_loss: bool,
        multimodal: dict,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """TRL's log-prob forward `forward` (same arguments), wrapped in `replay_routes` (Eq. 3) for the policy's own
        passes; returns its (logps (B, T), entropies, aux loss)."""
        routing = self._policy_routing(model, input_ids, attention_mask, logits_to_keep)
        if routing is None:
            if self._replay_held and self._unwrap(model) is self._unwrap(self.trainer.model):
                self._end_replay_before_free_forward()  # the same routers: a held replay must not apply here
            args = (input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss)
            logps, entropies, aux_loss = forward(model, *args, **multimodal)
        else:
            settings = (logits_to_keep, batch_size, compute_entropy, compute_aux_loss)
            logps, entropies, aux_loss = self._replayed_logps(
                forward, model, routing, input_ids, attention_mask, *settings, multimodal
            )
        if self._gap_inputs is not None and torch.is_grad_enabled() and self._is_policy(model):
            self._add_gap(logps.detach(), self._gap_inputs)  # on-policy Eq. 10 (D14)
            self._gap_inputs = None
        return logps, entropies, aux_loss

    def _unwrap(self, model: nn.Module) -> nn.Module:
        return self.trainer.accelerator.unwrap_model(model)

    def _is_policy(self, model: nn.Module) -> bool:
        """True for a forward of the policy with its own adapter: not a separate reference or critic model, not the
        PEFT reference (adapters disabled, or TRL's "ref" adapter), routing-replay.md D7."""
        policy = self._unwrap(self.trainer.model)
        if self._unwrap(model) is not policy:
            return False
        if isinstance(policy, PeftModel):
            return policy.active_adapter != "ref" and policy.get_model_status().enabled is not False
        return True

    def _policy_routing(self, model, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int) -> Tensor | None:
        """The (B, S, L, k) routes to replay in this forward, or None to route freely (D7). Raises when routes are
        due but missing or misaligned (§2 item 5: never a silent fallback to free routing)."""
        if not self.active or self._free_routing or not self._is_policy(model):
            return None
        if self._routing is None and self._rollout_routes is not None:  # the old-log-prob pass inside generation
            prompt_mask = attention_mask[:, : input_ids.size(1) - logits_to_keep]  # (B, P)
            self._routing = self._layout_routes(prompt_mask, logits_to_keep)
        if self._routing is None:
            raise ValueError(
                "routing replay: a policy log-prob forward ran without routes; call it from `_compute_loss` (whose "
                "inputs carry `routing`) or inside `free_routing()` for a pass that must route freely"
            )
        if self._routing.shape[:2] != input_ids.shape:
            raise ValueError(
                f"routing replay: routing covers (B, S) = {tuple(self._routing.shape[:2])} but the forward's "
                f"input_ids are {tuple(input_ids.shape)}; slice `routing` exactly like the rows of the batch (D4, D9)"
            )
        return self._routing

    def _replayed_logps(
        self,
        forward,
        model,
        routing,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size,
        compute_entropy,
        compute_aux_loss,
        multimodal,
    ):
        if any(value is not None for value in multimodal.values()):
            raise ValueError("routing replay supports text-only policies (no multimodal inputs)")
        B = input_ids.size(0)
        chunk = batch_size or B
        if torch.is_grad_enabled() and chunk < B:
            raise ValueError("routing replay: a forward with gradient must run as one chunk (D8, D9)")
        logps, entropies, aux_losses = [], [], []
        settings = (logits_to_keep, None, compute_entropy, compute_aux_loss)
        for start in range(0, B, chunk):
            rows = slice(start, start + chunk)
            replay = replay_routes(model, routing[rows], attention_mask[rows])  # Eq. 3, the chunk's row slice (D9)
            if torch.is_grad_enabled():  # D8: held until the step's backward (and checkpoint recompute) has run
                self._end_replay_before_free_forward()
                self._replay_hooks.enter_context(replay)
                self._replay_held = True
                replay = nullcontext()
            with replay:
                out = forward(model, input_ids[rows], attention_mask[rows], *settings)
            logps.append(out[0])
            entropies.append(out[1])
            aux_losses.append(out[2])
        return (
            torch.cat(logps, dim=0),
            torch.cat(entropies, dim=0) if compute_entropy else None,
            torch.stack(aux_losses).mean() if compute_aux_loss else None,  # as TRL averages its chunks
        )

    def _end_replay_before_free_forward(self) -> None:
        """Remove a replay installed for an earlier grad forward of this step; refuse when its backward would need it
        (an activation-checkpoint recompute would route freely, D8)."""
        if self._replay_held and self.trainer.args.activation_checkpointing:
            raise RuntimeError(
                "routing replay: with activation checkpointing, a training step may run one replayed policy forward "
                "with gradient, and any other policy forward must come before it (D8)"
            )
        self.release()

    def release(self) -> None:
        """Remove the replay held for a grad forward; after the micro-step's backward has run (D8)."""
        self._replay_hooks.close()
        self._replay_held = False

    # ----------------------------------------------------------------------------------------------------------------
    # Metrics (§8)
    def _add_gap(self, logps: Tensor, inputs: dict) -> None:
        """Accumulate Eq. 10 over micro-batches: sum m |log pi_train - q| and sum m."""
        sampling = inputs.get("sampling_per_token_logps")
        if sampling is None:
            return
        mask = self.trainer.loss_mask(inputs).double()  # (B, T) model tokens
        diff = (logps.double() - sampling.double()).abs().nan_to_num(0.0)  # (B, T)
        self._gap_sums += torch.stack([(diff * mask).sum(), mask.sum()]).cpu()  # Eq. 10, numerator and denominator

    def log_batch_metrics(self, out: dict) -> None:
        """Per generation batch of an MoE policy: Eq. 10 from the old-log-prob pass, and the size of the routes
        (Eq. 8)."""
        if not self.moe:
            return
        if out.get("old_per_token_logps") is not None:  # off-policy: the old pass ran at the behaviour weights
            self._add_gap(out["old_per_token_logps"], out)
            self._flush_gap()
        if not self.active:
            return
        trainer = self.trainer
        routing = out["routing"]  # (B, S, L, k)
        trainer.log_metric("routing/replay_active", 1.0)
        trainer.log_metric("routing/record_bytes_per_token", record_bytes_per_token(routing))  # Eq. 8: L * k * 2
        nbytes = torch.tensor(float(routing.numel() * routing.element_size()), device=trainer.accelerator.device)
        trainer.log_metric("routing/record_mb", trainer.accelerator.reduce(nbytes, reduction="sum") / 2**20)  # Eq. 8

    def _flush_gap(self) -> None:
        accelerator = self.trainer.accelerator
        sums = accelerator.reduce(self._gap_sums.to(accelerator.device), reduction="sum")  # global sums
        if sums[1] > 0:
            self.trainer.log_metric("routing/logp_gap", sums[0] / sums[1])  # Eq. 10: divides by sum m
        self._gap_sums.zero_()

    def log_step_metrics(self) -> None:
        """At an optimizer step's last micro-step: the on-policy Eq. 10 and the router gradient norm."""
        if self.moe:
            self._flush_gap()  # on-policy: the actor forwards of this step ran at the behaviour weights (D14)
        if not self.active:
            return
        policy = self._unwrap(self.trainer.model)
        grads = [r.weight.grad for r in find_routers(policy).modules if r.weight.grad is not None]  # None under ZeRO-3
        grads = [g.full_tensor() if isinstance(g, DTensor) else g for g in grads]  # FSDP2 shards: a collective
        if grads:
            norm = torch.stack([g.detach().float().norm() for g in grads]).norm()
            self.trainer.log_metric("routing/router_grad_norm", norm)

    def _log_flips(self, inputs: dict) -> None:
        """Eq. 9 on this micro-batch: a free-routing forward without gradient against the record (D14)."""
        trainer = self.trainer
        policy = self._unwrap(trainer.model)
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)  # (B, S)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)  # (B, S)
        with torch.no_grad(), self.free_routing(), RouteRecorder(policy) as recorder:
            trainer.forward_logps(policy, inputs)  # TRL's forward; aux loss off under replay (D10)
        live = recorder.indices(input_ids.size(0))  # (B, S, L, k)
        rows = trainer.loss_mask(inputs).sum(1, keepdim=True) > 0  # (B, 1) rows bearing model tokens
        flip_frac, flip_token_frac = routing_flips(inputs["routing"], live, mask=attention_mask.bool() & rows)  # Eq. 9
        flips = trainer.accelerator.gather(torch.stack([flip_frac, flip_token_frac]).float()[None])  # (processes, 2)
        trainer.log_metric("routing/flip_frac", flips[:, 0].mean())
        trainer.log_metric("routing/flip_token_frac", flips[:, 1].mean())
