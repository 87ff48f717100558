/* lmserve CPU kernels: decode-path operations where PyTorch's CPU ops leave most of the machine unused
 * (measured on the benchmark model, 2 cores, benchmarks/profile_step.py; see docs/performance.md).
 * One library, one translation unit: this file includes one source per kernel family, in this order (a later
 * family uses the static helpers of earlier ones), so the compiler sees exactly one program as before the split.
 *
 *   linear_f32               y = x W^T (+ b) for 1-2 rows of x. MKL's sgemv runs the (1 x 576) @
 *                            (576 x 49152) LM head at ~9 GB/s; streaming W once with all threads
 *                            reaches ~30 GB/s (the machine's read bandwidth). linear_bf16w_f32: the same
 *                            with bfloat16 weights (EngineArgs.weight_dtype="bfloat16").
 *   paged_decode_attention   one query token per sequence against its paged K/V history, read in
 *                            place through the block table: no gather copy, no padding mask.
 *   rmsnorm_f32, silu_mul_f32, rope_write_kv_f32
 *                            fused element-wise steps of a decoder layer (each replaced 3-10 small
 *                            PyTorch ops costing a few microseconds of dispatch apiece).
 *
 * Plain C with OpenMP, loaded with ctypes (lmserve/kernels/__init__.py compiles it on first use).
 * libgomp is the same shared object torch uses, so both share one thread pool; the caller passes
 * the thread count (torch.get_num_threads()) because OpenMP's default is per calling thread.
 * All tensors are contiguous float32 (int64 for indices); the Python side asserts it.
 */
#include "common.h"
#include "linear_f32.c"
#include "attention.c"
#include "elementwise.c"
#include "kv_quant.c"
#include "linear_quant.c"
#include "kquant.c"
#include "w4a8.c"
#include "mxfp4.c"
#include "moe.c"
#include "decode_stack.c"
#include "allreduce.c"
#include "lora.c"
#include "linear_attention.c"
#include "hybrid_stack.c"
