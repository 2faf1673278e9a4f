"""Owns the model and the KV cache tensors; turns a scheduled batch into one forward pass."""

from __future__ import annotations

import torch

from engine.config import LlamaConfig
from engine.models.llama import AttentionMetadata, KVCache, LlamaModel, PrefillChunk
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        config: LlamaConfig,
        num_blocks: int,
        block_size: int,
        cache_dtype: torch.dtype,
        device: torch.device,
    ):
        self.model = model
        self.config = config
        self.block_size = block_size
        self.device = device
        self.cache = KVCache(config, num_blocks, block_size, cache_dtype, device)

    def prepare(
        self, batch: ScheduledBatch
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[Sequence]]:
        size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        logits_indices: list[int] = []
        sampling: list[Sequence] = []
        prefills: list[PrefillChunk] = []
        num_decode = batch.num_single_token
        for index, (seq, count) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            start = len(input_ids)
            done = seq.num_computed_tokens
            table = seq.block_table
            input_ids.extend(seq.token_ids[done : done + count])
            positions.extend(range(done, done + count))
            slot_mapping.extend(
                table[p // size] * size + p % size for p in range(done, done + count)
            )
            if done + count == len(seq):
                logits_indices.append(start + count - 1)
                sampling.append(seq)
            if index >= num_decode:
                block_ids = mask = None
                if done:
                    blocks = -(-(done + count) // size)
                    block_ids = torch.tensor(table[:blocks], device=self.device)
                    query_positions = torch.arange(done, done + count, device=self.device)
                    key_positions = torch.arange(blocks * size, device=self.device)
                    mask = key_positions[None, :] <= query_positions[:, None]
                prefills.append(PrefillChunk(start, count, done, block_ids, mask))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, device=self.device),
            num_decode=num_decode,
            prefills=prefills,
        )
        if num_decode:
            decode_seqs = batch.seqs[:num_decode]
            lengths = [seq.num_computed_tokens + 1 for seq in decode_seqs]
            longest = max(lengths)
            width = -(-longest // size)
            block_ids_list: list[int] = []
            for seq in decode_seqs:
                row = seq.block_table[:width]
                block_ids_list.extend(row)
                block_ids_list.extend([0] * (width - len(row)))  # padding, masked out below
            meta.decode_block_ids = torch.tensor(block_ids_list, device=self.device)
            length_tensor = torch.tensor(lengths, device=self.device)
            key_positions = torch.arange(width * size, device=self.device)
            valid = key_positions[None, :] < length_tensor[:, None]
            meta.decode_mask = valid[:, None, None, :]  # [D, 1, 1, width * block_size]
        return (
            torch.tensor(input_ids, device=self.device),
            torch.tensor(positions, device=self.device),
            meta,
            torch.tensor(logits_indices, device=self.device, dtype=torch.long),
            sampling,
        )

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence]]:
        """Logits [len(sampling), vocab] fp32 for the sequences whose last token was computed."""
        input_ids, positions, meta, logits_indices, sampling = self.prepare(batch)
        logits = self.model(input_ids, positions, meta, self.cache, logits_indices)
        return logits, sampling
