"""The quantized / fast-path Linear (float32 C kernel for few rows, oneDNN packing, int8 / int4 / GGUF block
layouts) and the model-wide passes over its instances: quantize, pack, bf16-round, choose the few-row path."""

from __future__ import annotations

import logging
import math
import os
import time

import torch
from torch import nn

from lmserve import kernels
from lmserve.config.engine import QuantizationConfig
from lmserve.model import gguf_blocks
from lmserve.model import quantization as quant
from lmserve.model.layers.embedding import Embedding

PACK_HINT_ROWS = 32  # batch size oneDNN lays the packed weights out for (any row count works)
SMALL_M_ENV = "LMSERVE_SMALL_M_LINEAR"  # few-row (decode) linears: auto (measured per weight shape) | kernel | torch
SMALL_M_MODES = ("auto", "kernel", "torch")
SMALL_M_PASS_BYTES = 64 * 2**20  # weights read per timed pass: past the L3 cache, as a decode step reads them
SMALL_M_MARGIN = 0.9  # another path replaces the C kernel only when at least 10% faster
DEQUANT_TILE_BYTES = 2 * 2**20  # int4 / int8w beyond 8 rows: float32 weight rows dequantized per GEMM call

logger = logging.getLogger(__name__)


def onednn_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Linear(nn.Linear):
    """nn.Linear with two CPU float32 fast paths, both measured on the benchmark model (docs/performance.md):

    - few rows (decode, speculative verification): up to `kernels.f32_max_rows()` rows (8 with AVX-512, else
      2) the C kernel of lmserve.kernels reads the weight once at memory bandwidth, computing each row the same
      whatever the row count; CPU BLAS's small-M path runs at a third of it.
    - more rows, after `pack_for_onednn()`: oneDNN with the weight reordered once into its blocked layout,
      1.3-1.6x MKL at 32 rows and ~1.25x at 128 on this machine. The packed copy costs the weight's size
      again in memory (the plain weight stays: the C kernel and a tied embedding read it).
    """

    _packed: torch.Tensor | None = None
    _weight_bf16: torch.Tensor | None = None  # set by round_weights_to_bf16: what the C kernel reads
    # Quantized (lmserve.model.quantization): `weight` is None and buffers `qweight`, `scales` (and for GGUF
    # Q4_1 blocks `mins`) hold it; quant_method "int8" | "int4" | "int8w" (GGUF Q8_0 blocks) | "int5" (GGUF Q5_0 /
    # Q5_1 blocks, run as 5-bit W4A8 panels) | "kquant" (GGUF Q4_K / Q5_K / Q6_K super-blocks: `qweight` alone, its
    # row segments in kq_segments).
    quant_method: str | None = None
    group_size: int | None = None
    kq_segments: tuple[gguf_blocks.KQuantSegment, ...] | None = None
    _kq_table: torch.Tensor | None = None  # kquant: the segments as the C kernel reads them
    _row_sums: torch.Tensor | None = None  # int8: sum of each qweight row (the VNNI kernel's correction)
    # int4 with int4_compute="w4a8" (pack_w4a8): the codes in the W4A8 kernels' panels; qweight / scales / mins are
    # then None (one copy of the codes; dequantized_weight unpacks the panels)
    _w4a8: quant.W4A8Weights | None = None
    # few rows: None = the C kernel; "onednn" / "torch" (float) or "int8_gemm" where choose_small_m_paths measured
    # them faster on this CPU, or LMSERVE_SMALL_M_LINEAR=torch forced them
    _small_m_path: str | None = None

    def quantize(self, method: str, group_size: int | None) -> None:
        """Replace the float weight with its quantized form: "int8" per channel, "int4" per group, "int8w"
        (8-bit weight-only) per group."""
        w = self.weight.detach()
        if method == "int8":
            q, s = quant.quantize_int8(w)
        elif method == "int8w":
            q, s = quant.quantize_int8w(w, group_size)
        else:
            q, s = quant.quantize_int4(w, group_size)
        self._set_quantized(method, group_size, q, s)

    def prepare_quantized(self, method: str, group_size: int | None, mins: bool = False) -> None:
        """Empty quantized buffers of the shapes a checkpoint holds (the loader fills them)."""
        specs = quant.quantized_tensor_specs(method, group_size, self.out_features, self.in_features, mins)
        dev = self.weight.device
        q, s, *m = (torch.empty(shape, dtype=dtype, device=dev) for shape, dtype in specs.values())
        self._set_quantized(method, group_size, q, s, m[0] if m else None)

    def prepare_kquant(self, parts: list[tuple[str, int]]) -> None:
        """Empty "kquant" bytes for GGUF K-quant parts (type, rows) in output-row order (the loader fills them)."""
        segments = gguf_blocks.kquant_segments(parts, self.in_features)
        assert segments[-1].end == self.out_features, f"K-quant parts {parts} for {self.out_features} rows"
        nbytes = segments[-1].offset + segments[-1].rows * segments[-1].row_bytes
        self.set_kquant(torch.empty(nbytes, dtype=torch.uint8, device=self.weight.device), segments)

    def set_kquant(self, qweight: torch.Tensor, segments: tuple[gguf_blocks.KQuantSegment, ...]) -> None:
        """Hold the weight as K-quant super-blocks: qweight (bytes,) uint8, the segments' rows one after the other."""
        last = segments[-1]
        assert qweight.dtype == torch.uint8 and qweight.numel() == last.offset + last.rows * last.row_bytes, (
            f"K-quant bytes {qweight.numel()} for segments {segments}"
        )
        self._set_quantized("kquant", gguf_blocks.KQ_BLOCK, qweight, None)
        self.kq_segments, self._kq_table = segments, gguf_blocks.kquant_segment_table(segments)

    def kquant_rows(self, start: int, rows: int) -> torch.Tensor:
        """The (rows, row bytes) view of output rows start..start + rows, which lie in one segment."""
        seg = next((s for s in self.kq_segments or () if s.start <= start < s.end), None)
        assert seg is not None and start + rows <= seg.end, f"rows {start}+{rows} across K-quant {self.kq_segments}"
        first = seg.offset + (start - seg.start) * seg.row_bytes
        return self.qweight[first : first + rows * seg.row_bytes].view(rows, seg.row_bytes)

    def _set_quantized(
        self,
        method: str,
        group_size: int | None,
        q: torch.Tensor,
        s: torch.Tensor | None,
        mins: torch.Tensor | None = None,
    ) -> None:
        self.register_parameter("weight", None)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", s)
        self.register_buffer("mins", mins)  # None (not saved) unless the layout has mins
        self.quant_method, self.group_size = method, group_size
        self._packed = self._weight_bf16 = self._row_sums = self._w4a8 = None
        self.kq_segments = self._kq_table = None

    def kquant_panel_bits(self) -> int | None:
        """4 / 5 when this kquant Linear is all GGUF Q4_K / Q5_K (pack_w4a8 then takes it), else None."""
        if self.quant_method != "kquant" or len(self.kq_segments) != 1:
            return None
        return gguf_blocks.KQUANT_PANEL_BITS.get(self.kq_segments[0].type_name)

    def pack_w4a8(self, keep_int4: bool = False) -> None:
        """Repack int4 codes (lmserve int4, GGUF Q4_0 / Q4_1) into the W4A8 kernels' panels, int5 codes (GGUF Q5_0 /
        Q5_1) into their 5-bit panels, or int8w weights (the int4 method's LM head, GGUF Q8_0) into their 8-bit
        panels; every row count then runs with int8 activations per block of 32. GGUF Q4_K / Q5_K super-blocks
        (kquant_panel_bits) become the int4 / int5 layout with mins first (quantization.kquant_as_block32: the
        sub-blocks' scales and mins rounded to float16). Unless keep_int4, the source layout's buffers are dropped
        (the panels hold the same values)."""
        if self.kquant_panel_bits() is not None:
            seg = self.kq_segments[0]
            lay = gguf_blocks.kquant_as_block32(seg.type_name, self.kquant_rows(0, self.out_features), self.in_features)
            method = "int4" if seg.type_name == "Q4_K" else "int5"
            self._set_quantized(method, gguf_blocks.GGUF_GROUP_SIZE, lay["qweight"], lay["scales"], lay["mins"])
        assert self.quant_method in ("int4", "int5", "int8w") and self.qweight is not None, (
            f"W4A8: not {self.quant_method}"
        )
        if self.quant_method == "int8w":
            self._w4a8 = quant.pack_w8a8(self.qweight, self.scales)
        elif self.quant_method == "int5":
            self._w4a8 = quant.pack_w5a8(self.qweight, self.scales, self.mins)
        else:
            self._w4a8 = quant.pack_w4a8(self.qweight, self.scales, self.mins)
        if not keep_int4:
            self.qweight = self.scales = self.mins = None

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight the quantized one stands for (the reference the tests compare with)."""
        if self.qweight is None:
            assert self._w4a8 is not None, "quantized Linear without weights"
            return quant.dequantize_w4a8(self._w4a8)
        if self.quant_method == "kquant":
            return torch.cat([
                gguf_blocks.dequantize_kquant(s.type_name, self.kquant_rows(s.start, s.rows), self.in_features)
                for s in self.kq_segments
            ])  # fmt: skip
        return quant.dequantize_layout(self.quant_method, self.qweight, self.scales, self.mins)

    def weight_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Output rows `rows` (int64) of the float32 weight a block-32 / W4A8 layout stands for (exactly)."""
        if self._w4a8 is not None:
            return quant.w4a8_rows(self._w4a8, rows)
        assert self.quant_method in ("int8w", "int4", "int5"), f"rows of a {self.quant_method} weight"
        mins = None if self.mins is None else self.mins[rows]
        return quant.dequantize_layout(self.quant_method, self.qweight[rows], self.scales[rows], mins)

    def round_weights_to_bf16(self) -> None:
        """Round the weight to bfloat16 in place (still a float32 tensor, so every path computes the same
        model) and keep a bf16 copy for the few-row kernel, which then reads half the bytes."""
        assert self.weight.device.type == "cpu" and self.weight.dtype == torch.float32, "bf16 weights: cpu fp32"
        self._weight_bf16 = self.weight.detach().to(torch.bfloat16)
        self.weight.data.copy_(self._weight_bf16.float())
        self._packed = None  # packed from the old values; pack again

    def pack_for_onednn(self) -> None:
        assert self.weight.device.type == "cpu" and self.weight.dtype == torch.float32, "oneDNN packing: cpu fp32"
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACK_HINT_ROWS)

    def fast_path(self, x: torch.Tensor) -> str | None:
        """Which CPU fast path forward(x) takes: "kernel", "onednn", or None for nn.Linear's. Both fast
        paths return float32 (they only exist for float32 weights and inputs). Quantized weights:
        "int8_kernel" / "int4_kernel" (C, few rows, weights streamed once), "int8_gemm" (quantization.int8_mm),
        "int4_dequant" (weights dequantized, then the float32 GEMM), "w4a8" (int4 packed by pack_w4a8: the W4A8
        kernels for every row count); GGUF Q8_0 blocks: "int8w_kernel" / "int8w_dequant" likewise, GGUF K-quants
        "kquant_kernel" / "kquant_dequant"."""
        if self.quant_method is not None:
            assert x.dim() == 2 and x.dtype == torch.float32, f"quantized Linear: 2-D float32 input, got {x.dtype}"
            if self._w4a8 is not None:
                return "w4a8" if kernels.usable(x) else "int4_dequant"
            if self.quant_method == "int5":  # weight-only: no few-row int5 kernel, dequantized tiles for every M
                return "int5_dequant"
            few = x.shape[0] <= kernel_max_rows(self) and kernels.usable(x)
            if self.quant_method == "int8":
                return "int8_kernel" if few and self._small_m_path is None else "int8_gemm"
            return f"{self.quant_method}_kernel" if few else f"{self.quant_method}_dequant"
        if x.dim() != 2 or x.dtype != self.weight.dtype:
            return None
        if x.shape[0] <= kernel_max_rows(self) and kernels.usable(x):
            if self._small_m_path is None:
                return "kernel"
            if self._small_m_path == "torch":
                return None
        return "onednn" if self._packed is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        path = self.fast_path(x)
        if path == "kernel":
            w = self._weight_bf16 if self._weight_bf16 is not None else self.weight
            return kernels.linear(x, w, self.bias)
        if path == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._packed, self.bias, "none", [], "")
        if path is not None and self.quant_method is not None:
            return self._quantized_forward(path, x)
        return super().forward(x)

    def _quantized_forward(self, path: str, x: torch.Tensor) -> torch.Tensor:
        if path == "int8_kernel":
            if self._row_sums is None:
                self._row_sums = quant.int8_row_sums(self.qweight)
            return kernels.linear_i8(x, self.qweight, self.scales, self._row_sums, self.bias)
        if path == "int8_gemm":
            xq, xs = kernels.quantize_rows_i8(x) if kernels.usable(x) else quant.quantize_activations(x)
            use_int_mm = not kernels.usable(x) or kernels.int8_dot_instructions()
            return quant.int8_linear(xq, xs, self.qweight, self.scales, self.bias, use_int_mm)
        if path == "int4_kernel":
            return kernels.linear_i4(x, self.qweight, self.scales, self.bias, self.mins)
        if path == "w4a8":
            return kernels.linear_w4a8(x, self._w4a8, self.bias)
        if path == "int8w_kernel":
            return kernels.linear_i8w(x, self.qweight, self.scales, self.bias)
        if path == "kquant_kernel":
            return kernels.linear_kq(x, self.qweight, self._kq_table, self.out_features, self.bias)
        assert path in ("int4_dequant", "int8w_dequant", "int5_dequant", "kquant_dequant"), f"unknown path {path}"
        if not kernels.usable(x):
            return nn.functional.linear(x, self.dequantized_weight(), self.bias)
        # beyond 8 rows: dequantize DEQUANT_TILE_BYTES of float32 weight rows at a time and multiply them while they
        # are in cache (a whole 49152 x 576 head dequantized at once was written to and read back from DRAM)
        o = self.out_features
        step = max(1, DEQUANT_TILE_BYTES // (4 * self.in_features))
        # (K-quant tiles stay inside one segment: one type each)
        bounds = [(s.start, s.end) for s in self.kq_segments] if path == "kquant_dequant" else [(0, o)]
        if len(bounds) == 1 and step >= o:
            return nn.functional.linear(x, self._dequantized_rows(path, 0, o), self.bias)
        out = torch.empty(x.shape[0], o, dtype=torch.float32)
        for first, last in bounds:
            for start in range(first, last, step):
                end = min(last, start + step)
                torch.mm(x, self._dequantized_rows(path, start, end).t(), out=out[:, start:end])
        return out + self.bias if self.bias is not None else out

    def _dequantized_rows(self, path: str, start: int, end: int) -> torch.Tensor:
        """Output rows start..end of the weight in float32, by the C kernel of the layout."""
        if path == "kquant_dequant":
            seg = next(s for s in self.kq_segments if s.start <= start < s.end)
            return kernels.dequant_kq(seg.type_name, self.kquant_rows(start, end - start), self.in_features)
        q, s = self.qweight[start:end], self.scales[start:end]
        if path == "int5_dequant":
            return quant.dequantize_int5(q, s, None if self.mins is None else self.mins[start:end])
        if path == "int4_dequant":
            return kernels.dequant_i4(q, s, None if self.mins is None else self.mins[start:end])
        return kernels.dequant_i8w(q, s)


def kernel_max_rows(m: Linear) -> int:
    """The most rows of input m's C decode kernel takes in one pass over its weights (0: no kernel)."""
    if m.quant_method == "int8":
        return kernels.i8_kernel_rows() if kernels.available() else 0
    if m.quant_method == "kquant":
        return kernels.KQ_MAX_ROWS if kernels.available() else 0
    if m.quant_method is not None:
        return kernels.I4_MAX_ROWS if kernels.available() else 0
    return kernels.f32_max_rows()


def quantizable_linears(model: nn.Module, config: QuantizationConfig) -> list[tuple[Linear, str, int | None]]:
    """(module, layout, group size) of every Linear `config` quantizes: the decoder's projections (qkv, o,
    gate_up, down) in config.method, and the LM head in config.lm_head's layout unless that is None. The
    embeddings stay float (a tied head's weight is the embedding table: quantizing the head gives it its own
    copy)."""
    out = []
    for name, m in model.named_modules():
        if not isinstance(m, Linear):
            continue
        if name != "lm_head":
            out.append((m, config.method, config.group_size))
        elif config.lm_head is not None:
            out.append((m, config.lm_head, quant.INT8W_GROUP if config.lm_head == "int8w" else None))
    return out


def quantize_linear_weights(model: nn.Module, config: QuantizationConfig) -> None:
    for m, layout, group in quantizable_linears(model, config):
        m.quantize(layout, group)


def pack_w4a8_weights(model: nn.Module, head: bool = False, keep_int4: bool = False, int8w: bool = False) -> int:
    """int4_compute="w4a8": repack every int4 Linear (lmserve int4, GGUF Q4_0 / Q4_1) and int5 one (GGUF Q5_0 /
    Q5_1) for the W4A8 kernels, with head an int8w LM head (the int4 method's) and with int8w (a GGUF model) every
    int8w Linear (GGUF Q8_0: llama.cpp's q8_0 x q8_0) for the same kernels' 8-bit path and every Q4_K / Q5_K one
    (not a head sharing a tied embedding's bytes) for their 4- / 5-bit paths; returns how many Linears. Needs the C
    kernels (the caller checks kernels.available())."""

    tables = [getattr(m, "qweight", None) for m in model.modules() if isinstance(m, Embedding)]
    shared = {id(q) for q in tables if q is not None}  # K-quant token embeddings' bytes (a tied head's too)

    def wanted(name: str, m: Linear) -> bool:
        if m.quant_method == "int8w":
            return int8w or (head and name == "lm_head")
        if m.kquant_panel_bits() is not None:  # (GGUF runs: int8w is set; a tied head keeps the embedding's bytes)
            return int8w and id(m.qweight) not in shared
        return m.quant_method in ("int4", "int5")

    layers = [m for name, m in model.named_modules() if isinstance(m, Linear) and m._w4a8 is None and wanted(name, m)]
    for m in layers:
        m.pack_w4a8(keep_int4)
    return len(layers)


def round_linear_weights_to_bf16(model: nn.Module) -> None:
    """EngineArgs.weight_dtype="bfloat16": every Linear's weight rounded to bf16 (tied embeddings too,
    as a bf16 checkpoint would be), with a bf16 copy for the decode kernel."""
    for m in model.modules():
        if isinstance(m, Linear):
            m.round_weights_to_bf16()


def small_m_mode() -> str:
    """LMSERVE_SMALL_M_LINEAR: "auto" (default), "kernel" or "torch"."""
    mode = os.environ.get(SMALL_M_ENV, "auto").strip().lower() or "auto"
    if mode not in SMALL_M_MODES:
        raise ValueError(f"{SMALL_M_ENV} must be one of {list(SMALL_M_MODES)}, got {mode!r}")
    return mode


def _small_m_candidates(m: Linear) -> list[str | None]:
    """The paths a few-row input can take through m (None: the C kernel)."""
    if m.quant_method == "int8":
        return [None, "int8_gemm"]
    return [None, "onednn", "torch"] if m._packed is not None else [None, "torch"]


def _time_passes(layers: list[Linear], x: torch.Tensor, candidates: list[str | None], reps: int) -> dict:
    """Best time of `reps` passes of one M=1 product through each of layers (weights streamed, not cached) per
    candidate path. Candidates take turns within each round, so a busy moment of the machine slows them alike."""
    best = dict.fromkeys(candidates, math.inf)
    for i in range(reps + 1):  # round 0 warms up (and is not counted)
        for path in candidates:
            for m in layers:
                m._small_m_path = path
            t0 = time.perf_counter()
            for m in layers:
                m(x)
            if i:
                best[path] = min(best[path], time.perf_counter() - t0)
    return best


@torch.inference_mode()
def choose_small_m_paths(model: nn.Module, mode: str | None = None, reps: int = 5) -> dict[tuple, str]:
    """Pick, per distinct weight shape, what few-row inputs (decode, up to `kernel_max_rows`) run through: the
    C kernel, oneDNN / torch.mm (float32, bf16-stored weights too) or torch._int_mm (int8). "auto" times one M=1
    pass over that shape's layers (enough of them to stream SMALL_M_PASS_BYTES, as a decode step streams weights
    from DRAM) per candidate and keeps the fastest (the kernel unless another is 10% faster): the C kernel wins
    on some CPUs and loses to oneDNN on others (docs/performance.md); the projections of a decoder the one-call
    decode stack runs keep the kernel. "kernel" / "torch" force a side. Every path computes the same product to
    float32 rounding. Call with the thread count the engine runs with. Returns {(out, in, kind): chosen path}."""
    mode = small_m_mode() if mode is None else mode
    assert mode in SMALL_M_MODES, f"small-M mode {mode!r}"
    groups: dict[tuple, list[Linear]] = {}
    for m in model.modules():
        if not isinstance(m, Linear) or m.quant_method not in (None, "int8"):
            continue
        w = m.qweight if m.quant_method is not None else m.weight
        if w.device.type != "cpu" or (m.quant_method is None and w.dtype != torch.float32):
            continue
        kind = m.quant_method or ("bf16-stored" if m._weight_bf16 is not None else "float32")
        groups.setdefault((m.out_features, m.in_features, kind), []).append(m)
    if not kernels.available() or not groups:
        return {}
    # Projections the one-call decode stack (model/decode_stack.py) runs keep the kernel under "auto": the stack
    # saves the Python between them, which a per-shape timing cannot see (the LM head is still timed).
    stacked = {id(m) for sub in model.modules() if hasattr(sub, "stack_linears") for m in sub.stack_linears()}
    chosen: dict[tuple, str] = {}
    for key, layers in groups.items():
        candidates = _small_m_candidates(layers[0])
        in_stack = mode == "auto" and all(id(m) in stacked for m in layers)
        if mode == "kernel" or in_stack:
            path, times = None, {}
        elif mode == "torch":
            path, times = candidates[1], {}
        else:
            nbytes = (layers[0].qweight if layers[0].quant_method else layers[0].weight).nbytes
            sample = layers[: max(1, min(len(layers), -(-SMALL_M_PASS_BYTES // max(1, nbytes))))]
            x = torch.randn(1, key[1])
            times = _time_passes(sample, x, candidates, reps)
            path = min(times, key=times.get)
            if times[path] > SMALL_M_MARGIN * times[None]:
                path = None  # the kernel unless another path is clearly faster (timings on a busy machine wobble)
        for m in layers:
            m._small_m_path = path
        chosen[key] = path or "kernel"
        measured = ", ".join(f"{c or 'kernel'} {t * 1e3:.2f} ms" for c, t in times.items())
        logger.info("few-row linear %d x %d (%s, %d layers): %s%s", key[0], key[1], key[2], len(layers),
                    path or "kernel", f" (M=1 pass: {measured})" if times else
                    " (decode stack)" if in_stack else f" ({SMALL_M_ENV}={mode})")  # fmt: skip
    for sub in model.modules():  # a decoder's one-call decode stack follows the kernel paths: describe it anew
        if hasattr(sub, "reset_decode_stack"):
            sub.reset_decode_stack()
    return chosen


def pack_linear_weights(model: nn.Module, max_extra_bytes: int) -> int:
    """Give every Linear of a CPU float32 model a oneDNN-packed weight copy, unless the copies would take
    more than max_extra_bytes (then none is made and BLAS runs). Returns the bytes the copies take."""
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.quant_method is None]
    if not layers or not onednn_packing_available():
        return 0
    if any(m.weight.device.type != "cpu" or m.weight.dtype != torch.float32 for m in layers):
        return 0
    extra = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    if extra > max_extra_bytes:
        return 0
    for m in layers:
        m.pack_for_onednn()
    return extra
