"""/v1/embeddings: all-MiniLM-L6-v2 in its own thread, batching inputs across requests."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from engine.loader import minilm_path
from engine.models.bert import BertEncoder, load_bert

logger = logging.getLogger("engine.embeddings")


class EmbeddingService:
    model_name = "all-MiniLM-L6-v2"

    def __init__(self, batch_size: int = 32, threads: int = 0, folder: Path | None = None):
        self.folder = folder  # a sentence-transformers folder; None: the MiniLM package's
        self.batch_size = batch_size
        self.threads = threads
        self.model: BertEncoder | None = None
        self.tokenizer: Tokenizer | None = None
        self.max_length = 256
        self._condition = threading.Condition()
        self._pending: list[tuple[str, Future[tuple[np.ndarray, int]]]] = []
        self._thread: threading.Thread | None = None
        self._load_lock = threading.Lock()
        self._stopped = False

    @property
    def is_available(self) -> bool:
        try:
            return self.model is not None or self._folder().exists()
        except FileNotFoundError:
            return False

    def _folder(self) -> Path:
        return self.folder if self.folder is not None else minilm_path()

    def load(self) -> None:
        with self._load_lock:
            if self.model is not None:
                return
            folder = self._folder()
            tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
            sbert = folder / "sentence_bert_config.json"
            if sbert.exists():
                self.max_length = int(json.loads(sbert.read_text()).get("max_seq_length", 256))
            tokenizer.enable_truncation(self.max_length)
            tokenizer.no_padding()
            self.tokenizer = tokenizer
            self.model = load_bert(folder)
            self._thread = threading.Thread(target=self._loop, name="embeddings", daemon=True)
            self._thread.start()
            logger.info("embedding model loaded from %s", folder)

    def stop(self) -> None:
        with self._condition:
            self._stopped = True
            self._condition.notify_all()

    async def embed(self, texts: list[str]) -> tuple[list[np.ndarray], int]:
        if self.model is None:
            await asyncio.to_thread(self.load)
        futures: list[Future[tuple[np.ndarray, int]]] = []
        with self._condition:
            for text in texts:
                future: Future[tuple[np.ndarray, int]] = Future()
                self._pending.append((text, future))
                futures.append(future)
            self._condition.notify()
        results = [await asyncio.wrap_future(f) for f in futures]
        return [vector for vector, _ in results], sum(tokens for _, tokens in results)

    def encode(self, texts: list[str]) -> tuple[np.ndarray, list[int]]:
        """Embed a batch now (no queue): [len(texts), hidden] float32 and token counts."""
        assert self.model is not None and self.tokenizer is not None
        encodings = self.tokenizer.encode_batch(texts)
        lengths = [len(e.ids) for e in encodings]
        longest = max(lengths)
        ids = torch.zeros(len(texts), longest, dtype=torch.long)
        mask = torch.zeros(len(texts), longest, dtype=torch.long)
        for row, encoding in enumerate(encodings):
            ids[row, : lengths[row]] = torch.tensor(encoding.ids)
            mask[row, : lengths[row]] = 1
        vectors = self.model(ids, mask)
        return vectors.numpy(), lengths

    def _loop(self) -> None:
        while True:
            with self._condition:
                while not self._pending and not self._stopped:
                    self._condition.wait()
                if self._stopped:
                    return
                batch, self._pending = (
                    self._pending[: self.batch_size],
                    self._pending[self.batch_size :],
                )
            # Similar lengths together would pad less; inputs arrive in request order here.
            try:
                vectors, lengths = self.encode([text for text, _ in batch])
                for (_, future), vector, length in zip(batch, vectors, lengths, strict=True):
                    future.set_result((vector, length))
            except Exception as error:
                for _, future in batch:
                    future.set_exception(error)
