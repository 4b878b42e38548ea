"""Validation loss during training (``dataset_val``, ``run_val_every_n_steps``, ``batch_size_val``).

Every ``run_val_every_n_steps`` optimizer steps and after the last step of each epoch, the model computes its loss on
the whole validation set: ``val_loss``, the mean cross-entropy over every predicted (unmasked) token of the set, the
training loss's own definition. It goes into that step's metrics record, so into ``metrics.jsonl``, the metric logger
(wandb), the terminal line and, the last one, ``summary.json``.

It changes nothing about training. The model runs in eval mode under ``torch.no_grad()`` (no activation is kept, no
gradient touched) and is put back in train mode after; the validation loader is its own (sequential, its own
generator: it draws nothing from the global RNG, and the training sampler's position is never touched), and the
torch and CUDA RNG states are saved before and restored after anyway, so a run with validation trains the identical
losses. The forward and loss are the recipe's own (``loss_step``: the chunked output loss or the fused linear loss,
compiled or not), on batches of ``batch_size_val`` samples (default ``batch_size``): without gradients and activations
kept for backward, a validation batch needs less memory than a training micro-batch of the same size.

With N ranks (the distributed recipe), rank r reads samples r, r+N, ... of the set. FSDP2 gathers each layer in every
rank's forward, so every rank must run the same number of batches: the shorter shares are padded with a copy of a
sample whose labels are all masked (it counts no token). Each rank sums loss x tokens and tokens; one all-reduce of
the two gives the same token-weighted mean one device computes.
"""

import math
from typing import Any, Callable, Dict, Optional

import torch
from torch.utils.data import DataLoader, Dataset
from torchtune import utils

from finetune.base import BadInput
from finetune.data.loading import collate_for
from finetune.data.packing import count_trained_tokens
from finetune.sections import ValidationSettings


class RankShare(Dataset):
    """Samples ``rank``, ``rank + world``, ... of ``ds``, padded to ``ceil(len(ds) / world)`` (the same on every rank)
    with copies of sample 0 whose labels are all ``ignore_index``: they run through the model and count no token."""

    def __init__(self, ds, *, rank: int, world: int, ignore_index: int):
        self.ds, self.ignore_index = ds, ignore_index
        self.indices = list(range(rank, len(ds), world))
        self.length = math.ceil(len(ds) / world)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Dict[str, Any]:
        if i < len(self.indices):
            return self.ds[self.indices[i]]
        sample = dict(self.ds[0])
        labels = sample["labels"]
        masked = (
            torch.full_like(labels, self.ignore_index) if torch.is_tensor(labels) else [self.ignore_index] * len(labels)
        )
        sample["labels"] = masked
        return sample


def _predicts_a_token(dataset, ignore_index: int) -> bool:
    """Whether some sample of ``dataset`` has a label the loss counts, asked sample by sample up to the first that
    has: one sample is read in the usual case, the whole set only when none has (and the run then stops)."""
    return any(
        count_trained_tokens(torch.as_tensor(dataset[i]["labels"])[None], ignore_index) for i in range(len(dataset))
    )


class Validation:
    """The validation loss of a run: ``after_step`` returns ``{"val_loss": ...}`` on the steps that validate, ``{}``
    on the others (and always without ``dataset_val``). Build it with ``Validation.off()`` or from the dataset, then
    ``using(model, loss_step)`` once the model exists."""

    def __init__(
        self,
        settings: Optional[ValidationSettings],
        device: torch.device,
        dataset=None,
        *,
        steps_per_epoch: int = 0,
        pad_id: int = 0,
        ignore_index: int = -100,
        rank: int = 0,
        world: int = 1,
        log=None,
    ):
        self.every, self.steps_per_epoch = (settings.every if settings else None), steps_per_epoch
        self.device, self.world, self.ignore_index = device, world, ignore_index
        self.loader: Optional[DataLoader] = None
        self.model: Optional[torch.nn.Module] = None
        self.loss_step: Optional[Callable] = None
        if dataset is None:
            return
        data = settings.data
        if len(dataset) == 0:
            raise BadInput(
                f"dataset_val ({data.section.get('data_files') or data.section.get('source')}) holds "
                "no samples; point dataset_val.data_files at a file with records, or set dataset_val=null"
            )
        if not _predicts_a_token(dataset, ignore_index):
            key = data.key
            raise BadInput(
                f"{key} ({data.section.get('data_files') or data.section.get('source')}) has no token to predict: "
                f"every label of its {len(dataset)} samples is masked (prompts longer than tokenizer.max_seq_len="
                f"{data.tokenizer_cfg.get('max_seq_len')}, or empty replies, with {key}.train_on_input=False), so "
                f"val_loss would be NaN; set {key}.train_on_input=True, raise tokenizer.max_seq_len, or point "
                f"{key}.data_files at records with replies"
            )
        share = RankShare(dataset, rank=rank, world=world, ignore_index=ignore_index)
        self.loader = DataLoader(
            share,
            batch_size=data.batch_size,
            shuffle=False,
            collate_fn=collate_for(data.packed, data.packed_attention, pad_id=pad_id, ignore_index=ignore_index),
            drop_last=False,  # every sample counts; the last batch may be smaller
            generator=torch.Generator().manual_seed(0),  # (a loader draws a seed per iteration: never the global RNG)
        )
        if log is not None:
            when = f"every {self.every} steps and " if self.every else ""
            log.info(
                f"Validation: {len(dataset)} {'rows' if data.packed else 'samples'} in batches of "
                f"{data.batch_size}{f' x {world} ranks' if world > 1 else ''}, {when}at the end of each epoch"
            )

    @classmethod
    def off(cls, device: torch.device) -> "Validation":
        return cls(None, device)

    @property
    def enabled(self) -> bool:
        return self.loader is not None

    def using(self, model: torch.nn.Module, loss_step: Callable) -> "Validation":
        """The model and the recipe's forward-and-loss of one batch (labels included; returns the mean loss over the
        batch's predicted tokens, or (that loss, tokens))."""
        self.model, self.loss_step = model, loss_step
        return self

    def due(self, step: int, step_in_epoch: int) -> bool:
        """Whether global step ``step`` (step ``step_in_epoch`` of its epoch, from 1) ends with a validation."""
        if not self.enabled:
            return False
        return step_in_epoch == self.steps_per_epoch or (self.every is not None and step % self.every == 0)

    def after_step(self, step: int, step_in_epoch: int, stop: Optional[Callable[[], bool]] = None) -> Dict[str, Any]:
        """``{"val_loss": ...}`` when this step validates (on every rank: they compute it together), else ``{}``;
        ``{"val_stopped": True}`` when ``stop()`` turned true during the pass (``loss``)."""
        if not self.due(step, step_in_epoch):
            return {}
        value = self.loss(stop)
        return {"val_stopped": True} if value is None else {"val_loss": value}

    def loss(self, stop: Optional[Callable[[], bool]] = None) -> Optional[float]:
        """The token-weighted mean loss over the whole validation set (every rank's share); NaN if it has no token.

        ``stop``: asked before each batch; once true, the pass is abandoned and None returned. A stop signal then
        reaches its checkpoint in seconds, not after the whole pass (6,000 samples take minutes on a CPU, longer than
        a scheduler's grace period). One process only: ranks would have to agree before each batch."""
        model = self.model
        was_training = model.training
        cuda = [self.device] if self.device.type == "cuda" else []
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = 0
        model.eval()
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=cuda):
                for batch in self.loader:
                    if stop is not None and stop():
                        return None
                    ntok = count_trained_tokens(batch["labels"], self.ignore_index)  # (before loss_step takes them)
                    utils.batch_to_device(batch, self.device)
                    out = self.loss_step(batch)
                    loss = out[0] if isinstance(out, tuple) else out
                    if ntok:  # (a batch of masked labels only: its mean is 0/0)
                        total += loss.detach().double() * ntok
                        tokens += ntok
        finally:
            model.train(was_training)
        sums = torch.stack([total, torch.tensor(float(tokens), dtype=torch.float64, device=self.device)])
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(sums)
        loss_sum, count = sums.tolist()
        return loss_sum / count if count else float("nan")
