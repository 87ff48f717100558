"""The token embedding: nn.Embedding, or a GGUF K-quant / block-32 table looked up row by row."""

from __future__ import annotations

import torch
from torch import nn

from lmserve import kernels
from lmserve.model import gguf_blocks


class Embedding(nn.Embedding):
    """nn.Embedding, or for a GGUF K-quant token embedding its rows kept as the file's super-blocks (`qweight`
    (bytes,) uint8, `weight` None), each looked-up row dequantized exactly as gguf's dequantizer does (the C
    kernel, else gguf itself). A tied LM head kept as K-quant shares the same bytes (one copy for both)."""

    kq_type: str | None = None
    head_rows = False  # a GGUF block-32 tied table: rows looked up in the LM head's blocks (set_head)
    _head: tuple[nn.Module] | None = None  # (a tuple: not a submodule of the embedding)

    def prepare_head_rows(self) -> None:
        """No table of its own: set_head names the tied LM head whose (block-32) weight rows are the table's."""
        self.register_parameter("weight", None)
        self.head_rows = True

    def set_head(self, head: nn.Module) -> None:
        assert self.head_rows and head.out_features == self.num_embeddings and head.in_features == self.embedding_dim
        self._head = (head,)

    def prepare_kquant(self, type_name: str) -> None:
        row_bytes = gguf_blocks.kquant_row_bytes(type_name, self.embedding_dim, "token embedding")
        dev = self.weight.device
        self.register_parameter("weight", None)
        self.register_buffer("qweight", torch.empty(self.num_embeddings * row_bytes, dtype=torch.uint8, device=dev))
        self.kq_type = type_name

    @property
    def kq_segments(self) -> tuple[gguf_blocks.KQuantSegment, ...] | None:
        """The table as one K-quant segment (as a K-quant Linear's), or None."""
        if self.kq_type is None:
            return None
        row_bytes = gguf_blocks.kquant_row_bytes(self.kq_type, self.embedding_dim)
        return (gguf_blocks.KQuantSegment(self.kq_type, 0, self.num_embeddings, 0, row_bytes),)

    def kquant_rows(self, start: int, rows: int) -> torch.Tensor:
        """The (rows, row bytes) view of embedding rows start..start + rows."""
        row_bytes = self.qweight.numel() // self.num_embeddings
        assert 0 <= start and start + rows <= self.num_embeddings, f"rows {start}+{rows} of {self.num_embeddings}"
        return self.qweight[start * row_bytes : (start + rows) * row_bytes].view(rows, row_bytes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self._head is not None:
            unique, inverse = ids.reshape(-1).unique(return_inverse=True)
            values = self._head[0].weight_rows(unique)[inverse]
            return values.reshape(*ids.shape, self.embedding_dim)
        if self.kq_type is None:
            return super().forward(ids)
        rows = self.kquant_rows(0, self.num_embeddings)[ids.reshape(-1)]
        if kernels.available() and rows.device.type == "cpu":
            values = kernels.dequant_kq(self.kq_type, rows, self.embedding_dim)
        else:
            values = gguf_blocks.dequantize_kquant(self.kq_type, rows.cpu(), self.embedding_dim).to(rows.device)
        return values.reshape(*ids.shape, self.embedding_dim)
