"""The LLM learner: a Hugging Face causal LM and its optimizer, updated by the GRPO family (and SFT warm-up).

Several learner actors train data-parallel: each takes an equal slice of every batch, gradients are summed with
one all-reduce per step (gloo on CPU, nccl on GPU), and every rank applies the same optimizer step, so their
weights stay identical. Rank 0 publishes the weights and saves checkpoints.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from rlfabric import objectives
from rlfabric.actors.llm_learner_metrics import BATCH_STATISTICS, LEARNER_METRICS, MOVED_BY_THE_UPDATE
from rlfabric.algorithms.grpo import aggregate_denominator, logprob_drifted, policy_objective, row_logprob_gaps
from rlfabric.allocator import retain_freed_memory
from rlfabric.models.dropout import disable_dropout
from rlfabric.models.hf import load_causal_lm, load_tokenizer, save_pretrained
from rlfabric.models.llm_batch import grpo_batch
from rlfabric.models.packed_batch import is_row_column
from rlfabric.models.prefix_packing import check_maskable, maskable
from rlfabric.models.sequences import (
    batched_response_logprobs,
    consecutive_slices,
    keep_rows_with_advantage,
    layout_positions,
    micro_slices,
    mini_batch_slices,
    packed_layout,
    response_logprobs,
    response_logprobs_in,
    select_rows,
)
from rlfabric.models.shared_weights import SharedFlatWeights, SharedWeightsWriter
from rlfabric.models.weights import FlatWeights, flatten_state_dict
from rlfabric.trajectory import Trajectories

OPTIMIZER_FILE = "optimizer.pt"


def adamw(params: Any, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with the fused kernel where torch has one for these parameters (CPU and CUDA floats: about 4x faster
    steps than the per-tensor loop on a 4M-parameter model), else the default implementation."""
    params = list(params)
    try:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    except RuntimeError:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def clip_gradients(parameters: list[torch.nn.Parameter], max_norm: float | None) -> float:
    """The gradients' global L2 norm ||g|| before clipping; when max_norm / (||g|| + 1e-6) < 1, every gradient is
    scaled by that factor, as ``torch.nn.utils.clip_grad_norm_`` does. Within the bound the multiply (by exactly 1)
    is skipped: a pass over every gradient, about 5% of a small model's update on CPU."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.nn.utils.get_total_norm(grads)
    if max_norm and max_norm / (float(norm) + 1e-6) < 1.0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return float(norm)


class LLMLearnerCore:
    """Everything the learner does, without Ray (tests and single-process tools use it directly)."""

    def __init__(
        self,
        model_dir: str,
        grpo: dict[str, Any],
        sft: dict[str, Any],
        *,
        temperature: float,
        dtype: str = "float32",
        device: str = "cpu",
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        gradient_checkpointing: bool = False,
        reference_in_learner: bool = False,
        reference_dir: str | None = None,
        num_threads: int | None = None,
        matmul_dtype: str | None = None,
        batch_spec: dict[str, Any] | None = None,
        sequence_packing: str = "auto",
        parts: bytes | None = None,
    ) -> None:
        """``batch_spec``: how trajectory records become the packed batch (``grpo_batch``'s keyword options);
        ``sequence_packing``: how its rows reach the model (``rlfabric.models.sequences.response_logprobs``);
        ``parts``: the advantage estimators, losses and the like the driver's user code added
        (``rlfabric.objectives.snapshot``)."""
        objectives.load_snapshot(parts)
        if num_threads:
            torch.set_num_threads(num_threads)
        torch.manual_seed(seed)
        self.g = grpo
        self.sft_cfg = sft
        self.temperature = temperature
        self.matmul_dtype = matmul_dtype  # None / "float32": the weights' dtype; "bfloat16": autocast matmuls
        self.device = torch.device(device)
        self.rank, self.world_size = rank, world_size
        self.model_dir = model_dir
        self.model = load_causal_lm(model_dir, dtype=dtype, device=device)
        if gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        disable_dropout(self.model)  # the generators sample without it: the ratio must compare the same function
        self.model.train()
        if sequence_packing == "shared_prefix":
            check_maskable(self.model)
        # "auto" falls back to padded rows where the attention cannot take the shared-prefix mask.
        self.packing = sequence_packing if maskable(self.model) else "padded"
        self.tokenizer = load_tokenizer(model_dir)
        self.batch_spec = {"reward_weights": {}, "advantage": "grpo", "scale_by_std": True, "overlong_filter": False}
        self.batch_spec.update(batch_spec or {})
        self.batch_spec["world_size"] = world_size
        self.reference = None
        if reference_in_learner:  # a frozen copy of the starting weights (or of reference_dir's), for the KL
            self.reference = load_causal_lm(reference_dir or model_dir, dtype=dtype, device=device)
            self.reference.requires_grad_(False)
        self.optimizer = adamw(self.model.parameters(), lr=grpo["lr"], weight_decay=grpo["weight_decay"])
        self.version = 0
        self._shared_writer: SharedWeightsWriter | None = None
        self.shared_unavailable: str | None = None  # why shared-memory publishing is off on this node, once known
        self.drift_reported = False  # the first drifted trajectory is printed, the rest only counted

    # -- distributed ----------------------------------------------------------------------------------------

    def _all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
        return tensor

    def _all_reduce_grads(self) -> None:
        """Sum gradients over ranks in one flat buffer (one collective per step, not one per tensor)."""
        if self.world_size == 1:
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n

    def _shard(self, batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """This rank's contiguous slice of every per-row column, as tensors on the learner's device."""
        n = len(batch["input_ids"])
        per_rank = n // self.world_size
        rows = slice(self.rank * per_rank, (self.rank + 1) * per_rank)
        out: dict[str, Any] = {}
        for key, value in batch.items():
            if is_row_column(value, n):
                out[key] = torch.tensor(value[rows], device=self.device)  # a copy: object-store arrays are read-only
            else:
                out[key] = value
        return out

    # -- one optimizer step -----------------------------------------------------------------------------------

    def _step(self, lr: float, clip: float | None) -> float:
        self._all_reduce_grads()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        norm = clip_gradients(list(self.model.parameters()), clip)
        if self._shared_writer is not None:  # the parameters live in the published file: readers must see it change
            self._shared_writer.updating()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def sft_step(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """One supervised step: mean negative log-likelihood of the response tokens (temperature 1)."""
        b = self._shard(batch)
        mask = b["response_mask"]
        total_tokens = float(self._all_reduce_sum(mask.sum().detach().clone()))
        loss_sum = 0.0
        for rows in micro_slices(len(mask), self.g["micro_batch_size"]):
            logp, _ = response_logprobs(
                self.model,
                b["input_ids"][rows],
                b["attention_mask"][rows],
                int(b["prompt_len"]),
                matmul_dtype=self.matmul_dtype,
                packing=self.packing,
            )
            loss = -(logp * mask[rows]).sum() / total_tokens
            loss.backward()
            loss_sum += float(loss.detach())
        norm = self._step(self.sft_cfg["lr"], self.g["max_grad_norm"])
        self.version += 1
        total = float(self._all_reduce_sum(torch.tensor(loss_sum)))
        return {"sft_loss": total, "grad_norm": norm, "tokens": total_tokens}

    def logprobs(self, batch: dict[str, np.ndarray], model: Any = None) -> np.ndarray:
        """Response-token logprobs of this rank's slice under ``model`` (default: the current weights)."""
        return self._logprobs_of(self._shard(batch), model)

    @torch.no_grad()
    def _logprobs_of(self, b: dict[str, Any], model: Any = None) -> np.ndarray:
        return batched_response_logprobs(
            model if model is not None else self.model,
            b["input_ids"],
            b["attention_mask"],
            int(b["prompt_len"]),
            self.temperature,
            self.g["micro_batch_size"],
            self.matmul_dtype,
            self.packing,
        )

    def _global_denominator(self, mask: torch.Tensor) -> float:
        """The loss aggregation's denominator over every rank's rows."""
        local = aggregate_denominator(mask, self.g["loss_aggregation"], self.g["norm_length"])
        return float(self._all_reduce_sum(torch.tensor(local)))

    def batch_from(self, trajectories: list[Trajectories], groups: list[int] | None) -> dict[str, np.ndarray]:
        """The packed batch of the chosen groups of ``trajectories`` (every rank builds the same one)."""
        return grpo_batch(trajectories, groups, pad_id=self.tokenizer.pad_token_id, **self.batch_spec)

    def train_on(
        self,
        trajectories: list[Trajectories],
        groups: list[int] | None,
        lr: float,
        ref_logprobs: np.ndarray | None = None,
        kl_coef: float | None = None,
    ) -> dict[str, float]:
        """One GRPO-family update on the chosen groups of the records (see ``train_step``), with the seconds it
        spent building the batch and computing the update. ``kl_coef``: the KL term's coefficient from this update
        on (an adaptive controller's, ``grpo.kl_target``); None keeps the current one."""
        started = time.perf_counter()
        if kl_coef is not None:
            self.g["kl_coef"] = kl_coef
        batch = self.batch_from(trajectories, groups)
        if ref_logprobs is not None:
            batch["ref_logprobs"] = ref_logprobs
        report = batch.pop("drift_report", None)
        if report is not None and not self.drift_reported and self.rank == 0:
            self.drift_reported = True  # the first instance, readable; the count goes to the metrics every step
            print(f"rlfabric learner: rejected a trajectory whose tokens drifted from the sampled ones: {report}")
        drifted = float(batch.pop("drifted_rows", 0))
        # the batch's own statistics, present when their setting is on (every rank builds the same batch)
        built_metrics = {k: float(batch.pop(k)) for k in BATCH_STATISTICS if k in batch}
        built = time.perf_counter()
        metrics = self.train_step(batch, lr)
        drifted += metrics.pop("logprob_drifted_rows", 0.0)
        return {
            **metrics,
            **built_metrics,
            "drifted_trajectories": drifted,
            "batch_time_s": built - started,
            "compute_time_s": time.perf_counter() - built,
        }

    def train_step(self, batch: dict[str, np.ndarray], lr: float) -> dict[str, float]:
        """One GRPO-family update on a batch: ``epochs`` passes, each one optimizer step per mini-batch
        (``grpo.mini_batches``: contiguous slices of the rows), over its micro-batches.

        batch columns: input_ids, attention_mask, response_mask (loss mask), prompt_len, advantages [N] (or [N, R]
        per token, with step-level credit), behaviour_logprobs [N, R] (from the generators), and ref_logprobs
        [N, R] when a reference actor made them.
        With ``sampled_version`` [N] (and ``episode_id``), rows the current weights sampled are held to their
        behaviour logprobs (``grpo.max_logprob_gap``): one that drifted further gets no loss and is counted in
        ``logprob_drifted_rows``, the first one described.
        """
        g = self.g
        b = self._shard(batch)
        full_rows = len(b["response_mask"])
        minis = mini_batch_slices(full_rows, g["mini_batches"])
        # Each mini-batch's loss is normalised by its own rows' denominator over all ranks, so accumulation and
        # data parallelism give the same gradient as one big mini-batch.
        denominators = [self._global_denominator(b["response_mask"][mini]) for mini in minis]
        entropy_scales = [1.0] * len(minis)
        if g["skip_zero_advantage_rows"] and g["kl_coef"] == 0 and g["entropy_coef"] == 0:
            # Every remaining loss term is scaled by the advantage, so zero-advantage rows (groups whose rewards
            # are all equal; with per-token advantages, rows with 0 on every token) add exactly zero to the
            # gradient: skip their forward and backward. The denominators above still count them, so the update
            # is the one the whole batch gives.
            keeps = [keep_rows_with_advantage(b["advantages"][mini]) for mini in minis]
            b = select_rows(b, torch.cat(keeps))
            minis = consecutive_slices([int(keep.sum()) for keep in keeps])
            # The entropy diagnostic is over the rows trained on: rescale it from the whole denominators.
            entropy_scales = [
                whole / max(self._global_denominator(b["response_mask"][mini]), 1e-12)
                for whole, mini in zip(denominators, minis, strict=True)
            ]
        mask = b["response_mask"]
        # With one pass in one step, the weights do not change before the optimizer step, so the "old" logprobs are
        # the first forward's own (detached): exact, and one forward pass cheaper. More steps need them up front.
        single_pass = g["epochs"] == 1 and len(minis) == 1
        old_logp = None if single_pass else torch.as_tensor(self._logprobs_of(b)).to(self.device)
        ref_logp = None
        if g["kl_coef"] > 0:
            if "ref_logprobs" in b:
                ref_logp = b["ref_logprobs"]
            elif self.reference is not None:
                ref_logp = torch.as_tensor(self._logprobs_of(b, self.reference)).to(self.device)
        metrics: dict[str, float] = {}
        gap_sum = 0.0  # sum over loss tokens of |learner logprob - behaviour logprob|, at the batch's weights
        prompt_len = int(b["prompt_len"])
        # (mini-batch, rows) of each micro-batch, mini-batch by mini-batch
        slices = [
            (m, slice(mini.start + rows.start, mini.start + rows.stop))
            for m, mini in enumerate(minis)
            for rows in micro_slices(mini.stop - mini.start, g["micro_batch_size"])
        ]
        loss_masks = [mask[rows] for _, rows in slices]  # the logprob check may take rows out at the first pass
        logprob_drifted_rows = 0
        ids, attention = b["input_ids"].cpu().numpy(), b["attention_mask"].cpu().numpy()
        # Each micro-batch's layout, chosen (and packed) once for every epoch.
        layouts = [packed_layout(self.model, ids[r], attention[r], prompt_len, self.packing) for _, r in slices]
        micro_of = [[k for k, (of, _) in enumerate(slices) if of == m] for m in range(len(minis))]  # per mini-batch
        for epoch in range(g["epochs"]):
            sums: dict[str, float] = {}
            norms = []
            for m, micros in enumerate(micro_of):
                for k in micros:
                    rows = slices[k][1]
                    new_logp, entropy = response_logprobs_in(
                        self.model,
                        b["input_ids"][rows],
                        b["attention_mask"][rows],
                        prompt_len,
                        layouts[k],
                        self.temperature,
                        with_entropy=True,
                        matmul_dtype=self.matmul_dtype,
                    )
                    if g["entropy_coef"] == 0:
                        entropy = entropy.detach()
                    old = new_logp.detach() if single_pass else old_logp[rows]
                    if epoch == 0:
                        gap_sum += float(((old - b["behaviour_logprobs"][rows]).abs() * mask[rows]).sum())
                        loss_masks[k], rejected = self._check_logprobs(old, b, rows, loss_masks[k])
                        logprob_drifted_rows += rejected
                    loss, values = policy_objective(
                        new_logp,
                        old,
                        b["advantages"][rows],
                        loss_masks[k],
                        clip_low=g["clip_low"],
                        clip_high=g["clip_high"],
                        ratio_level=g["ratio_level"],
                        policy_loss=g["policy_loss"],
                        aggregation=g["loss_aggregation"],
                        norm_length=g["norm_length"],
                        ref_logp=None if ref_logp is None else ref_logp[rows],
                        kl_coef=g["kl_coef"],
                        kl_estimator=g["kl_estimator"],
                        entropy=entropy,
                        entropy_coef=g["entropy_coef"],
                        denominator=denominators[m],
                    )
                    loss.backward()
                    weight = float(mask[rows].sum()) / max(float(mask.sum()), 1.0)
                    for key, value in values.items():
                        # additive ones sum within a mini-batch and are averaged over mini-batches (each is over
                        # its own denominator); the per-call means are token-weighted
                        if key in ("pg_loss", "kl", "entropy"):
                            value *= (entropy_scales[m] if key == "entropy" else 1.0) / len(minis)
                        else:
                            value *= weight
                        sums[key] = sums.get(key, 0.0) + value
                norms.append(self._step(lr, g["max_grad_norm"]))
            sums["grad_norm"] = float(np.mean(norms))
            if epoch == 0:
                metrics.update(sums)
                metrics["logprob_gap"] = gap_sum / max(float(mask.sum()), 1.0)
                # every rank's count (all of them call this, once per step), so each reports the batch's total
                metrics["logprob_drifted_rows"] = float(self._all_reduce_sum(torch.tensor(float(logprob_drifted_rows))))
                metrics["trained_rows"] = float(len(mask))
                metrics["skipped_rows"] = float(full_rows - len(mask))
                # What the forward/backward ran over: real tokens, and the model's rows and positions as packed.
                metrics["trained_tokens"] = float(b["attention_mask"].sum())
                for (_, rows), layout in zip(slices, layouts, strict=True):
                    for key, value in layout_positions(layout, ids[rows], prompt_len).items():
                        metrics[f"trained_{key}"] = metrics.get(f"trained_{key}", 0.0) + value
            # How far the update moved the policy: the last pass's ratio to the batch's weights (the first pass's
            # is 1 exactly, its "old" logprobs being its own, unless an earlier mini-batch's step moved them), so
            # with one epoch and one mini-batch these stay 1, 0 and 0.
            metrics.update({k: v for k, v in sums.items() if k in MOVED_BY_THE_UPDATE})
        self.version += 1  # one policy version per batch, however many epochs and mini-batches it took
        return metrics

    def _check_logprobs(
        self, learner_logp: torch.Tensor, b: dict[str, Any], rows: slice, loss_mask: torch.Tensor
    ) -> tuple[torch.Tensor, int]:
        """The trace check's logprob half on one micro-batch: ``loss_mask`` without the rows that drifted, and how
        many did; the first one is printed with its gap and its first tokens' logprobs side by side."""
        max_gap = self.g.get("max_logprob_gap")
        if max_gap is None or "sampled_version" not in b:
            return loss_mask, 0
        behaviour = b["behaviour_logprobs"][rows]
        gaps = row_logprob_gaps(learner_logp, behaviour, loss_mask)
        drifted = logprob_drifted(gaps, b["sampled_version"][rows], self.version, max_gap)
        if not bool(drifted.any()):
            return loss_mask, 0
        if not self.drift_reported and self.rank == 0:
            self.drift_reported = True
            row = int(drifted.nonzero()[0, 0])
            sampled = loss_mask[row] > 0
            ours = [round(v, 3) for v in learner_logp[row][sampled][:6].tolist()]
            theirs = [round(v, 3) for v in behaviour[row][sampled][:6].tolist()]
            print(
                f"rlfabric learner: rejected a trajectory whose logprobs drifted from the sampled ones: episode "
                f"{int(b['episode_id'][rows][row])}, version {self.version}: mean |gap| {float(gaps[row]):.3f} per "
                f"token over {int(sampled.sum())} tokens (grpo.max_logprob_gap {max_gap:g}); first tokens, learner "
                f"{ours} vs behaviour {theirs}"
            )
        return loss_mask * (~drifted)[:, None], int(drifted.sum())

    def reset_reference(self) -> None:
        """Make the KL reference the current weights (after the SFT warm-up: the policy GRPO starts from)."""
        if self.reference is not None:
            self.reference.load_state_dict(self.model.state_dict())

    # -- weights and checkpoints -------------------------------------------------------------------------------

    def state_dict_cpu(self) -> dict[str, torch.Tensor]:
        """A copy of the weights on CPU."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def flat_weights(self) -> FlatWeights:
        """The weights packed into one CPU buffer: what ``publish`` puts in the object store."""
        return flatten_state_dict(self.model.state_dict())

    def shared_weights(self, node_id: str, reserved_bytes: Callable[[], int] = lambda: 0) -> SharedFlatWeights | None:
        """The weights written to this node's shared-memory file (made at the first call, leaving
        ``reserved_bytes()`` of /dev/shm free); None when the node cannot hold one (``shared_unavailable`` says
        why)."""
        if self._shared_writer is None and self.shared_unavailable is None:
            self._shared_writer, self.shared_unavailable = SharedWeightsWriter.create(
                self.model.state_dict(), node_id, reserved_bytes()
            )
            if self._shared_writer is not None:  # the parameters move into the file: publishing is then a stamp
                self._shared_writer.adopt(dict(self.model.named_parameters()))
        if self._shared_writer is None:
            return None
        return self._shared_writer.publish(self.model.state_dict(), self.version)

    def close(self) -> None:
        """Remove the shared-memory file, if one was made."""
        if self._shared_writer is not None:
            self._shared_writer.close()
            self._shared_writer = None

    def save(self, path: str, with_optimizer: bool = True) -> str:
        """The model in Hugging Face format at ``path``, plus the optimizer state and version (what a resumed run
        continues from) unless ``with_optimizer`` is False."""
        out = Path(path)
        self.model.eval()
        save_pretrained(self.model, self.tokenizer, out)
        self.model.train()
        if with_optimizer:
            torch.save({"optimizer": self.optimizer.state_dict(), "version": self.version}, out / OPTIMIZER_FILE)
        return str(out)

    def load_optimizer(self, path: str) -> int:
        state = torch.load(Path(path) / OPTIMIZER_FILE, map_location=self.device, weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        for group in self.optimizer.param_groups:  # the config's, which a resumed run may change (lr: per step)
            group["weight_decay"] = self.g["weight_decay"]
        self.version = int(state["version"])
        return self.version


@ray.remote
class LLMLearner:
    """A Ray actor around LLMLearnerCore; batches arrive as ObjectRefs inside a list (read zero-copy)."""

    def __init__(self, **kwargs: Any) -> None:
        retain_freed_memory()
        self.core = LLMLearnerCore(**kwargs)

    def node_address(self) -> str:
        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def init_process_group(self, address: str, port: int, backend: str) -> bool:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, str(port)
        torch.distributed.init_process_group(
            backend=backend, rank=self.core.rank, world_size=self.core.world_size, init_method=f"tcp://{address}:{port}"
        )
        return True

    def sft_step(self, batch_ref: list[ray.ObjectRef]) -> dict[str, float]:
        return self.core.sft_step(ray.get(batch_ref[0]))

    def train_step(self, batch_ref: list[ray.ObjectRef], lr: float) -> dict[str, float]:
        return self.core.train_step(ray.get(batch_ref[0]), lr)

    def train_on(
        self,
        trajectory_refs: list[ray.ObjectRef],
        groups: list[int] | None,
        lr: float,
        ref_logprobs: np.ndarray | None = None,
        kl_coef: float | None = None,
    ) -> bytes:
        """An update on the chosen groups of the trajectory records (read from the object store here); its metrics
        as ``LEARNER_METRICS`` packs them (the driver reads them every step: small)."""
        records = ray.get(trajectory_refs)
        return LEARNER_METRICS.pack(self.core.train_on(records, groups, lr, ref_logprobs, kl_coef))

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        return os.getpid()

    @ray.method(num_returns=3)
    def publish(
        self, transport: str = "object_store"
    ) -> tuple[list[ray.ObjectRef] | SharedFlatWeights, int, str | None]:
        """The current weights for the generators, their version, and the shared-memory file's path (None through
        the object store): three ObjectRefs; a generator's ``update_weights`` takes the first two as they are, and
        the driver reads only the last two (the handle lists every tensor). ``transport``
        (``learner.weight_transport``):

        - ``"object_store"``: one ``FlatWeights`` buffer in the object store (every reader reads the same object,
          zero-copy), as ``[ObjectRef]``;
        - ``"shared_memory"``: written into this node's shared-memory file, as a ``SharedFlatWeights`` handle
          (only readers on this node can map it); an error when the node cannot hold the file;
        - ``"auto"``: shared memory when the node can hold the file, else the object store.

        ``rlfabric.models.weights.as_state_dict`` unpacks either.
        """
        if transport in ("shared_memory", "auto"):
            shared = self.core.shared_weights(self.node_id(), self._object_store_bytes)
            if shared is not None:
                return shared, self.core.version, shared.path
            if transport == "shared_memory":
                raise RuntimeError(
                    f"learner.weight_transport = 'shared_memory': {self.core.shared_unavailable}; "
                    "use 'auto' or 'object_store'"
                )
        elif transport != "object_store":
            raise ValueError(
                f"weight transport {transport!r} is not valid: expected 'auto', 'shared_memory' or 'object_store'"
            )
        return [ray.put(self.core.flat_weights())], self.core.version, None

    def _object_store_bytes(self) -> int:
        """This node's object-store capacity (which may live in /dev/shm and grow into it)."""
        node_id = self.node_id()
        for node in ray.nodes():
            if node.get("NodeID") == node_id:
                return int(node.get("Resources", {}).get("object_store_memory", 0))
        return 0

    def shared_unavailable(self) -> str | None:
        return self.core.shared_unavailable

    def close(self) -> None:
        self.core.close()

    def get_version(self) -> int:
        return self.core.version

    def reset_reference(self) -> None:
        self.core.reset_reference()

    def save(self, path: str, with_optimizer: bool = True) -> str:
        return self.core.save(path, with_optimizer)

    def load_optimizer(self, path: str) -> int:
        return self.core.load_optimizer(path)
