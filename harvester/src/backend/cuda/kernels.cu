// The CUDA backend's kernels, compiled once at start-up by NVRTC. No CUDA headers: bf16 is
// carried as `unsigned short` and converted by hand, so NVRTC needs no include path.
//
// Layouts (row-major): the residual stream `x` is f32 [tokens, hidden]; GEMM inputs and
// outputs are bf16 [tokens, width]; the fused QKV buffer is bf16 [tokens, (q + 2 kv) * head_dim]
// with the query heads first, then the key heads, then the value heads. The O and down GEMMs
// add into `x` (beta = 1) unless the branch is written apart (kept, biased or normed) and added
// by `add_rows`; a kept layer is rounded whole to bf16 (`round_bf16`) or projected (`project`)
// into its capture slot. AFMoE's routed experts are grouped by expert (`moe_gather`), run as
// one GEMM pair per expert, and weighed back into their tokens (`moe_scatter`).

typedef unsigned short bf16;

__device__ __forceinline__ float bf16_to_f32(bf16 h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

// Round to nearest even; NaN stays NaN.
__device__ __forceinline__ bf16 f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (bf16)0x7fc0;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

// The activations between kernels are bf16 in the bf16 mode and f32 in the f32 mode, so the
// kernels that read or write them are templates over that type T, with one entry point a mode
// (`name` for bf16, `name_f32`). `widened` reads a T as f32; `stored<T>` writes an f32 as a T,
// rounded to bf16 or as it is: the f32 mode's kernels do the bf16 mode's arithmetic less its
// rounding.
__device__ __forceinline__ float widened(bf16 v) { return bf16_to_f32(v); }
__device__ __forceinline__ float widened(float v) { return v; }
template <typename T> __device__ __forceinline__ T stored(float v);
template <> __device__ __forceinline__ bf16 stored<bf16>(float v) { return f32_to_bf16(v); }
template <> __device__ __forceinline__ float stored<float>(float v) { return v; }

__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}

// x[t, :] = table[ids[t], :] * scale (AFMoE's muP scale; 1 for the others, exact). Grid:
// tokens; block: any.
template <typename T>
__device__ __forceinline__ void gather_rows(const T* table, const unsigned int* ids, float* x,
                                           int hidden, float scale) {
    const int t = blockIdx.x;
    const T* row = table + (long long)ids[t] * hidden;
    float* out = x + (long long)t * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        out[i] = widened(row[i]) * scale;
    }
}
extern "C" __global__ void embed_gather(const bf16* table, const unsigned int* ids, float* x,
                                        int hidden, float scale) {
    gather_rows(table, ids, x, hidden, scale);
}
extern "C" __global__ void embed_gather_f32(const float* table, const unsigned int* ids,
                                            float* x, int hidden, float scale) {
    gather_rows(table, ids, x, hidden, scale);
}

// The sum of every thread's `sum` over the block: each warp's butterfly, then one over the
// warps' partial sums; every thread gets it. Block: a multiple of 32 up to 1024.
__device__ __forceinline__ float block_sum(float sum) {
    __shared__ float partial[32];
    sum = warp_sum(sum);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) partial[warp] = sum;
    __syncthreads();
    if (warp == 0) {
        sum = lane < (int)(blockDim.x >> 5) ? partial[lane] : 0.0f;
        sum = warp_sum(sum);
        if (lane == 0) partial[0] = sum;
    }
    __syncthreads();
    return partial[0];
}

// Values of a row each thread of a norm holds in registers between the sum and the scaling:
// the widest served row (16,384) over the norms' 256 threads, so a row is read once. The
// values of a wider row past these are read twice.
#define ROW_KEPT 64

// out[t, :] = x[t, :] / rms(x[t, :]) * weight, stored as O: `rms_norm` rounds to bf16 for the
// next GEMM; `rms_norm_wide` keeps f32 (AFMoE's branch norms and its router's input);
// `rms_norm_f32` is the f32 mode's, its weights f32. Each thread sums the squares of every
// blockDim.x-th value from its own (fused), then block_sum. Grid: tokens; block: a multiple
// of 32 up to 1024.
template <typename W, typename O>
__device__ __forceinline__ void norm_rows(const float* x, const W* weight, O* out, int hidden,
                                          float eps) {
    const int t = blockIdx.x;
    const float* row = x + (long long)t * hidden;
    float kept[ROW_KEPT];
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < ROW_KEPT; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i >= hidden) break;
        kept[j] = row[i];
        sum += kept[j] * kept[j];
    }
    for (int i = threadIdx.x + ROW_KEPT * blockDim.x; i < hidden; i += blockDim.x) {
        sum += row[i] * row[i];
    }
    const float scale = rsqrtf(block_sum(sum) / (float)hidden + eps);
    O* dst = out + (long long)t * hidden;
#pragma unroll
    for (int j = 0; j < ROW_KEPT; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i >= hidden) break;
        dst[i] = stored<O>(kept[j] * scale * widened(weight[i]));
    }
    for (int i = threadIdx.x + ROW_KEPT * blockDim.x; i < hidden; i += blockDim.x) {
        dst[i] = stored<O>(row[i] * scale * widened(weight[i]));
    }
}
extern "C" __global__ void rms_norm(const float* x, const bf16* weight, bf16* out, int hidden,
                                    float eps) {
    norm_rows(x, weight, out, hidden, eps);
}
extern "C" __global__ void rms_norm_wide(const float* x, const bf16* weight, float* out,
                                         int hidden, float eps) {
    norm_rows(x, weight, out, hidden, eps);
}
extern "C" __global__ void rms_norm_f32(const float* x, const float* weight, float* out,
                                        int hidden, float eps) {
    norm_rows(x, weight, out, hidden, eps);
}

// AFMoE's RMSNorm of each query head (q_norm) and key head (k_norm) of the fused QKV rows, in
// place, bf16. One warp per head: lane l sums the squares of dimensions l, l + 32, ...
// Grid: (tokens, q_heads + kv_heads); block: 32.
template <typename T>
__device__ __forceinline__ void norm_heads(T* qkv, const T* q_norm, const T* k_norm,
                                           int row_width, int q_heads, int head_dim, float eps) {
    const int t = blockIdx.x, head = blockIdx.y, lane = threadIdx.x;
    T* h = qkv + (long long)t * row_width + (long long)head * head_dim;
    const T* weight = head < q_heads ? q_norm : k_norm;
    float sum = 0.0f;
    for (int i = lane; i < head_dim; i += 32) {
        const float v = widened(h[i]);
        sum += v * v;
    }
    const float scale = rsqrtf(warp_sum(sum) / (float)head_dim + eps);
    for (int i = lane; i < head_dim; i += 32) {
        h[i] = stored<T>(widened(h[i]) * scale * widened(weight[i]));
    }
}
extern "C" __global__ void head_norm(bf16* qkv, const bf16* q_norm, const bf16* k_norm,
                                     int row_width, int q_heads, int head_dim, float eps) {
    norm_heads(qkv, q_norm, k_norm, row_width, q_heads, head_dim, eps);
}
extern "C" __global__ void head_norm_f32(float* qkv, const float* q_norm, const float* k_norm,
                                         int row_width, int q_heads, int head_dim, float eps) {
    norm_heads(qkv, q_norm, k_norm, row_width, q_heads, head_dim, eps);
}

// attn[i] = attn[i] * sigmoid(gate[i]) over n values, as attn / (1 + exp(-gate)): AFMoE's
// attention output gate. Grid-strided; any grid.
template <typename T>
__device__ __forceinline__ void gate_values(T* attn, const T* gate, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float g = widened(gate[i]);
        attn[i] = stored<T>(widened(attn[i]) / (1.0f + __expf(-g)));
    }
}
extern "C" __global__ void sigmoid_gate(bf16* attn, const bf16* gate, long long n) {
    gate_values(attn, gate, n);
}
extern "C" __global__ void sigmoid_gate_f32(float* attn, const float* gate, long long n) {
    gate_values(attn, gate, n);
}

// rows[r, :] = normed[tokens[r], :]: each routed expert's input rows, grouped by expert.
// Grid: grouped rows; block: any.
template <typename T>
__device__ __forceinline__ void group_rows(const T* normed, const unsigned int* tokens, T* rows,
                                           int hidden) {
    const int r = blockIdx.x;
    const T* src = normed + (long long)tokens[r] * hidden;
    T* dst = rows + (long long)r * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        dst[i] = src[i];
    }
}
extern "C" __global__ void moe_gather(const bf16* normed, const unsigned int* tokens, bf16* rows,
                                      int hidden) {
    group_rows(normed, tokens, rows, hidden);
}
extern "C" __global__ void moe_gather_f32(const float* normed, const unsigned int* tokens,
                                          float* rows, int hidden) {
    group_rows(normed, tokens, rows, hidden);
}

// branch[t, :] += sum over t's k choices, in expert order, of weights[t, j] * out[slots[t, j], :]
// (one fused multiply-add each): the routed experts' outputs weighed back into their tokens.
// Grid: tokens; block: any.
extern "C" __global__ void moe_scatter(const float* out, const unsigned int* slots,
                                       const float* weights, float* branch, int hidden, int k) {
    const int t = blockIdx.x;
    float* dst = branch + (long long)t * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float acc = dst[i];
        for (int j = 0; j < k; ++j) {
            const long long slot = slots[(long long)t * k + j];
            acc = __fmaf_rn(weights[(long long)t * k + j], out[slot * hidden + i], acc);
        }
        dst[i] = acc;
    }
}

// Rotates the first `heads` heads (the query and key heads) of the fused QKV buffer in place,
// Hugging Face style (dimension i pairs with i + head_dim / 2). `inv_freq` has head_dim / 2
// entries, Llama 3 scaling already applied on the host. A thread turns its dimension pair in
// every head, so the angle's sincosf runs once per token and frequency. Grid: tokens; block:
// head_dim / 2.
template <typename T>
__device__ __forceinline__ void rotate_heads(T* qkv, const unsigned int* positions,
                                             const float* inv_freq, int row_width, int head_dim,
                                             int heads) {
    const int t = blockIdx.x, i = threadIdx.x;
    const int half = head_dim >> 1;
    if (i >= half) return;
    float s, c;
    sincosf((float)positions[t] * inv_freq[i], &s, &c);
    T* row = qkv + (long long)t * row_width;
#pragma unroll 4
    for (int head = 0; head < heads; ++head) {
        T* h = row + (long long)head * head_dim;
        const float a = widened(h[i]), b = widened(h[i + half]);
        h[i] = stored<T>(a * c - b * s);
        h[i + half] = stored<T>(b * c + a * s);
    }
}
extern "C" __global__ void rope(bf16* qkv, const unsigned int* positions, const float* inv_freq,
                                int row_width, int head_dim, int heads) {
    rotate_heads(qkv, positions, inv_freq, row_width, head_dim, heads);
}
extern "C" __global__ void rope_f32(float* qkv, const unsigned int* positions,
                                    const float* inv_freq, int row_width, int head_dim,
                                    int heads) {
    rotate_heads(qkv, positions, inv_freq, row_width, head_dim, heads);
}

template <typename T>
__device__ __forceinline__ T silu_times(T gate, T up) {
    const float g = widened(gate);
    return stored<T>(g / (1.0f + __expf(-g)) * widened(up));
}

// Two bf16 pairs packed in 32 bits: silu(gate) * up for each half.
__device__ __forceinline__ unsigned int silu_times2(unsigned int gate, unsigned int up) {
    return (unsigned int)silu_times((bf16)(gate & 0xffffu), (bf16)(up & 0xffffu))
        | ((unsigned int)silu_times((bf16)(gate >> 16), (bf16)(up >> 16)) << 16);
}

// out[t, j] = silu(gate[t, j]) * up[t, j], with gate_up [tokens, 2 * inter] (gate first). Rows
// stride over grid.y and columns over grid.x, so no thread divides. When inter is a multiple
// of 8, every row and half-row starts 16-byte aligned and each thread moves 8 values a step
// with 16-byte loads and stores; the arithmetic per value is the same either way. Grid:
// (column blocks, min(tokens, 65535)); block: any.
extern "C" __global__ void swiglu(const bf16* gate_up, bf16* out, int inter, int tokens) {
    const bool wide = (inter & 7) == 0;
    const int step = wide ? 8 : 1;
    const int stride = gridDim.x * blockDim.x * step;
    for (int t = blockIdx.y; t < tokens; t += gridDim.y) {
        const bf16* gate = gate_up + (long long)t * 2 * inter;
        const bf16* up = gate + inter;
        bf16* row = out + (long long)t * inter;
        for (int j = (blockIdx.x * blockDim.x + threadIdx.x) * step; j < inter; j += stride) {
            if (wide) {
                const uint4 g = *(const uint4*)(gate + j);
                const uint4 u = *(const uint4*)(up + j);
                uint4 o;
                o.x = silu_times2(g.x, u.x);
                o.y = silu_times2(g.y, u.y);
                o.z = silu_times2(g.z, u.z);
                o.w = silu_times2(g.w, u.w);
                *(uint4*)(row + j) = o;
            } else {
                row[j] = silu_times(gate[j], up[j]);
            }
        }
    }
}

// The f32 mode's SwiGLU: swiglu's arithmetic a value a thread, unrounded. Grid and block: as
// swiglu.
extern "C" __global__ void swiglu_f32(const float* gate_up, float* out, int inter, int tokens) {
    const int stride = gridDim.x * blockDim.x;
    for (int t = blockIdx.y; t < tokens; t += gridDim.y) {
        const float* gate = gate_up + (long long)t * 2 * inter;
        const float* up = gate + inter;
        float* row = out + (long long)t * inter;
        for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < inter; j += stride) {
            row[j] = silu_times(gate[j], up[j]);
        }
    }
}

// x[i] += branch[i] over n values: a branch output kept apart (a hook site) joins the residual
// stream, the one f32 addition the GEMM's beta = 1 makes otherwise. Grid-strided; any grid.
extern "C" __global__ void add_rows(float* x, const float* branch, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        x[i] += branch[i];
    }
}

// out[i] = bf16(x[i]) for the n values of a kept layer's residual stream (the shards' dtype).
// Grid-strided; grid and block: any.
extern "C" __global__ void round_bf16(const float* x, bf16* out, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        out[i] = f32_to_bf16(x[i]);
    }
}

// out[i] = bf16(in[i] + bias[i % width]) over n values: a projection with a bias (Qwen2's QKV),
// its product summed in f32 by the GEMM, gains the f32 bias and is rounded once. Grid-strided;
// any grid.
extern "C" __global__ void add_bias_bf16(const float* in, const float* bias, bf16* out,
                                         int width, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        out[i] = f32_to_bf16(in[i] + bias[i % width]);
    }
}

// x[i] += bias[i % width] over n values: an output projection's bias (Llama's attention_bias)
// joins its product before the product joins the residual stream. Grid-strided; any grid.
extern "C" __global__ void add_bias(float* x, const float* bias, int width, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        x[i] += bias[i % width];
    }
}

// Causal grouped-query attention over packed variable-length sequences, with an online softmax
// and no [n, n] buffer. One block handles `QUERIES` consecutive queries of one sequence for one
// query head; each warp owns one query and each lane `head_dim / 32` of its dimensions. Keys and
// values stream through shared memory `KEYS` at a time (`KEYS_F32` in the f32 mode), shared by
// the block's warps, kept in the activations' type as read (64 KiB of f32 tiles at the widest head would not fit a block's static shared
// memory). A query sees the `window` keys up to itself (Mistral's sliding window; the host
// passes INT_MAX for none), and a block starts at its first query's oldest visible key.
// `tiles` holds (sequence, first query) pairs made on the host. Grid: (tiles, q_heads);
// block: 32 * QUERIES. head_dim is even and at most MAX_HEAD_DIM; lane `l` owns dimensions
// l, l + 32, ... below it, so with heads narrower than a multiple of 32 some lanes hold none.
#define QUERIES 8
#define KEYS 32
// The f32 mode's tiles hold half the keys, so two f32 tiles of the widest head still fit a
// block's 48 KiB of static shared memory.
#define KEYS_F32 16
#define MAX_HEAD_DIM 256
#define MAX_PER_LANE (MAX_HEAD_DIM / 32)
template <typename T, int TILE_KEYS>
__device__ __forceinline__ void attend_varlen(const T* qkv, T* out,
                                              const unsigned int* cu_seq_lengths,
                                              const unsigned int* tiles, int q_heads,
                                              int kv_heads, int head_dim, int window,
                                              float scale) {
    __shared__ T k_tile[TILE_KEYS * MAX_HEAD_DIM];
    __shared__ T v_tile[TILE_KEYS * MAX_HEAD_DIM];
    const int seq = tiles[2 * blockIdx.x], first = tiles[2 * blockIdx.x + 1];
    const int head = blockIdx.y, kv_head = head / (q_heads / kv_heads);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int start = cu_seq_lengths[seq], length = cu_seq_lengths[seq + 1] - start;
    const int query = first + warp;  // position within the sequence
    const int row_width = (q_heads + 2 * kv_heads) * head_dim;
    const int per_lane = (head_dim + 31) >> 5;
    const int k_offset = q_heads * head_dim + kv_head * head_dim;
    const int v_offset = (q_heads + kv_heads) * head_dim + kv_head * head_dim;
    const bool active = query < length;

    float q[MAX_PER_LANE], acc[MAX_PER_LANE];
    for (int d = 0; d < per_lane; ++d) {
        const bool owned = active && lane + 32 * d < head_dim;
        q[d] = owned ? widened(qkv[(long long)(start + query) * row_width + head * head_dim
                                       + lane + 32 * d]) * scale
                     : 0.0f;
        acc[d] = 0.0f;
    }
    float running_max = -3.0e38f, running_sum = 0.0f;
    const int last_query = min(first + QUERIES, length) - 1;
    for (int key0 = max(0, first + 1 - window); key0 <= last_query; key0 += TILE_KEYS) {
        const int keys = min(TILE_KEYS, last_query + 1 - key0);
        __syncthreads();
        for (int k = threadIdx.x; k < keys * head_dim; k += blockDim.x) {
            const int j = k / head_dim, d = k % head_dim;
            const long long row = (long long)(start + key0 + j) * row_width;
            k_tile[j * head_dim + d] = qkv[row + k_offset + d];
            v_tile[j * head_dim + d] = qkv[row + v_offset + d];
        }
        __syncthreads();
        if (!active) continue;
        for (int j = 0; j < keys && key0 + j <= query; ++j) {
            if (key0 + j <= query - window) continue;
            float dot = 0.0f;
            for (int d = 0; d < per_lane; ++d) {
                if (lane + 32 * d < head_dim) {
                    dot += q[d] * widened(k_tile[j * head_dim + lane + 32 * d]);
                }
            }
            const float score = warp_sum(dot);
            const float new_max = fmaxf(running_max, score);
            const float correction = __expf(running_max - new_max);
            const float weight = __expf(score - new_max);
            running_sum = running_sum * correction + weight;
            for (int d = 0; d < per_lane; ++d) {
                if (lane + 32 * d < head_dim) {
                    acc[d] = acc[d] * correction
                             + weight * widened(v_tile[j * head_dim + lane + 32 * d]);
                }
            }
            running_max = new_max;
        }
    }
    if (!active) return;
    const float inv = 1.0f / running_sum;
    T* dst = out + (long long)(start + query) * (q_heads * head_dim) + head * head_dim;
    for (int d = 0; d < per_lane; ++d) {
        if (lane + 32 * d < head_dim) dst[lane + 32 * d] = stored<T>(acc[d] * inv);
    }
}
extern "C" __global__ void attention_varlen(const bf16* qkv, bf16* out,
                                            const unsigned int* cu_seq_lengths,
                                            const unsigned int* tiles, int q_heads, int kv_heads,
                                            int head_dim, int window, float scale) {
    attend_varlen<bf16, KEYS>(qkv, out, cu_seq_lengths, tiles, q_heads, kv_heads, head_dim,
                              window, scale);
}
extern "C" __global__ void attention_varlen_f32(const float* qkv, float* out,
                                                const unsigned int* cu_seq_lengths,
                                                const unsigned int* tiles, int q_heads,
                                                int kv_heads, int head_dim, int window,
                                                float scale) {
    attend_varlen<float, KEYS_F32>(qkv, out, cu_seq_lengths, tiles, q_heads, kv_heads,
                                   head_dim, window, scale);
}

// out[t, n] = x[t, :] . directions[n, :], f32. One block per token, one warp per direction at
// a time. Grid: tokens; block: a multiple of 32.
extern "C" __global__ void project(const float* x, const float* directions, float* out,
                                   int hidden, int n_directions) {
    const int t = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    const float* row = x + (long long)t * hidden;
    for (int n = warp; n < n_directions; n += warps) {
        const float* dir = directions + (long long)n * hidden;
        float dot = 0.0f;
        for (int i = lane; i < hidden; i += 32) {
            dot += row[i] * dir[i];
        }
        dot = warp_sum(dot);
        if (lane == 0) out[(long long)t * n_directions + n] = dot;
    }
}

// Causal grouped-query attention on tensor cores (mma.sync m16n8k16, bf16 in, f32 accumulate),
// flash-attention style: one block handles `MMA_QUERIES` consecutive queries of one sequence for
// one query head, each of its 4 warps 16 of them; keys and values stream through shared memory
// `MMA_KEYS` at a time (rows padded by 8 so ldmatrix's 8 rows fall in distinct banks). Scores
// stay in registers; the online softmax runs in base 2 on the scaled scores; P is rounded to
// bf16 for the P·V product, as flash attention does. A query sees the `window` keys up to
// itself (INT_MAX for none); key tiles wholly below a warp's window are skipped, which changes
// no bit, as a wholly masked tile adds nothing. `tiles` holds (sequence, first query) pairs of
// `MMA_QUERIES` queries. Grid: (tiles, q_heads); block: 128. head_dim is D (64 or 128).
#define MMA_QUERIES 64
#define MMA_KEYS 64
#define NEG_INF __int_as_float(0xff800000u)

__device__ __forceinline__ unsigned int pack_bf16(float lo, float hi) {
    return (unsigned int)f32_to_bf16(lo) | ((unsigned int)f32_to_bf16(hi) << 16);
}

__device__ __forceinline__ void mma_bf16(float* c, const unsigned int* a, unsigned int b0,
                                         unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A generic pointer into shared memory as a shared-space address.
__device__ __forceinline__ unsigned int shared_address(const void* pointer) {
    unsigned int address;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }"
        : "=r"(address)
        : "l"(pointer));
    return address;
}

// Four 8x8 bf16 matrices from shared memory: lanes 8i..8i+7 give the rows of matrix i.
__device__ __forceinline__ void ldmatrix_x4(unsigned int* r, const bf16* row) {
    const unsigned int address = shared_address(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

// The same, each matrix transposed.
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int* r, const bf16* row) {
    const unsigned int address = shared_address(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

template <int D>
__device__ __forceinline__ void attention_mma(const bf16* qkv, bf16* out,
                                              const unsigned int* cu_seq_lengths,
                                              const unsigned int* tiles, int q_heads,
                                              int kv_heads, int window, float scale) {
    constexpr int STRIDE = D + 8;
    constexpr int CHUNKS = D / 8;  // 16-byte pieces of a row
    __shared__ __align__(16) bf16 k_tile[MMA_KEYS * STRIDE];
    __shared__ __align__(16) bf16 v_tile[MMA_KEYS * STRIDE];
    const int seq = tiles[2 * blockIdx.x], first = tiles[2 * blockIdx.x + 1];
    const int head = blockIdx.y, kv_head = head / (q_heads / kv_heads);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int start = cu_seq_lengths[seq], length = cu_seq_lengths[seq + 1] - start;
    const long long row_width = (long long)(q_heads + 2 * kv_heads) * D;
    const int k_offset = q_heads * D + kv_head * D;
    const int v_offset = (q_heads + kv_heads) * D + kv_head * D;
    const int q0 = first + warp * 16;  // this warp's first query, a position in the sequence
    const int rows[2] = {q0 + g, q0 + g + 8};
    const bool busy = q0 < length;

    // The warp's 16 queries as A fragments, one per 16 dimensions.
    unsigned int qa[D / 16][4];
    #pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
        #pragma unroll
        for (int half = 0; half < 2; ++half) {
            #pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = rows[r];
                qa[kc][2 * half + r] =
                    row < length ? *(const unsigned int*)(qkv + (start + row) * row_width +
                                                          head * D + kc * 16 + half * 8 + 2 * t)
                                 : 0u;
            }
        }
    }
    const float scale_log2 = scale * 1.4426950408889634f;
    float o[D / 8][4];
    #pragma unroll
    for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float running_max[2] = {NEG_INF, NEG_INF}, running_sum[2] = {0.0f, 0.0f};

    const int kv_end = min(first + MMA_QUERIES, length);
    const int kv_start = max(0, first + 1 - window) / MMA_KEYS * MMA_KEYS;
    for (int kb = kv_start; kb < kv_end; kb += MMA_KEYS) {
        __syncthreads();
        for (int i = threadIdx.x; i < MMA_KEYS * CHUNKS; i += blockDim.x) {
            const int j = i / CHUNKS, c = i % CHUNKS;
            uint4 k = make_uint4(0, 0, 0, 0), v = k;
            if (kb + j < kv_end) {
                const bf16* row = qkv + (start + kb + j) * row_width;
                k = *(const uint4*)(row + k_offset + 8 * c);
                v = *(const uint4*)(row + v_offset + 8 * c);
            }
            *(uint4*)(k_tile + j * STRIDE + 8 * c) = k;
            *(uint4*)(v_tile + j * STRIDE + 8 * c) = v;
        }
        __syncthreads();
        if (!busy || kb > q0 + 15 || kb + MMA_KEYS <= q0 + 1 - window) continue;

        // S = Q Kᵀ for 64 keys: 8 tiles of 8 keys.
        float s[MMA_KEYS / 8][4];
        #pragma unroll
        for (int nt = 0; nt < MMA_KEYS / 8; ++nt) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
            const bf16* key_row = k_tile + (nt * 8 + (lane & 7)) * STRIDE + (lane >> 3) * 8;
            #pragma unroll
            for (int kc = 0; kc < D / 16; kc += 2) {
                unsigned int b[4];
                ldmatrix_x4(b, key_row + kc * 16);
                mma_bf16(s[nt], qa[kc], b[0], b[1]);
                mma_bf16(s[nt], qa[kc + 1], b[2], b[3]);
            }
        }
        // Mask (causal, the window, and past the sequence's end), scale, and the online softmax.
        float tile_max[2] = {NEG_INF, NEG_INF};
        #pragma unroll
        for (int nt = 0; nt < MMA_KEYS / 8; ++nt) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = kb + nt * 8 + 2 * t + (e & 1), r = e >> 1;
                const bool seen = key <= rows[r] && key > rows[r] - window && key < kv_end;
                const float v = seen ? s[nt][e] * scale_log2 : NEG_INF;
                s[nt][e] = v;
                tile_max[r] = fmaxf(tile_max[r], v);
            }
        }
        float correction[2];
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
            tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
            tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
            const float new_max = fmaxf(running_max[r], tile_max[r]);
            correction[r] = new_max == NEG_INF ? 1.0f : exp2f(running_max[r] - new_max);
            running_max[r] = new_max;
            running_sum[r] *= correction[r];
        }
        #pragma unroll
        for (int i = 0; i < D / 8; ++i) {
            o[i][0] *= correction[0];
            o[i][1] *= correction[0];
            o[i][2] *= correction[1];
            o[i][3] *= correction[1];
        }
        // P, rounded to bf16, as A fragments of 16 keys each; O += P V.
        #pragma unroll
        for (int kc = 0; kc < MMA_KEYS / 16; ++kc) {
            unsigned int pa[4];
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                float* p = s[2 * kc + h];
                #pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = e >> 1;
                    p[e] = running_max[r] == NEG_INF ? 0.0f : exp2f(p[e] - running_max[r]);
                }
                const unsigned int lo = pack_bf16(p[0], p[1]), hi = pack_bf16(p[2], p[3]);
                pa[2 * h] = lo;
                pa[2 * h + 1] = hi;
                // The sum counts P as the product sees it, rounded.
                running_sum[0] += bf16_to_f32((bf16)(lo & 0xffff)) + bf16_to_f32((bf16)(lo >> 16));
                running_sum[1] += bf16_to_f32((bf16)(hi & 0xffff)) + bf16_to_f32((bf16)(hi >> 16));
            }
            const bf16* value_row =
                v_tile + (kc * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * STRIDE + (lane >> 4) * 8;
            #pragma unroll
            for (int dt = 0; dt < D / 8; dt += 2) {
                unsigned int b[4];
                ldmatrix_x4_trans(b, value_row + dt * 8);
                mma_bf16(o[dt], pa, b[0], b[1]);
                mma_bf16(o[dt + 1], pa, b[2], b[3]);
            }
        }
    }
    if (!busy) return;
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        running_sum[r] += __shfl_xor_sync(0xffffffffu, running_sum[r], 1);
        running_sum[r] += __shfl_xor_sync(0xffffffffu, running_sum[r], 2);
    }
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (rows[r] >= length) continue;
        const float inv = 1.0f / running_sum[r];
        bf16* dst = out + (long long)(start + rows[r]) * (q_heads * D) + head * D + 2 * t;
        #pragma unroll
        for (int i = 0; i < D / 8; ++i) {
            *(unsigned int*)(dst + i * 8) = pack_bf16(o[i][2 * r] * inv, o[i][2 * r + 1] * inv);
        }
    }
}

extern "C" __global__ void __launch_bounds__(128)
    attention_mma_64(const bf16* qkv, bf16* out, const unsigned int* cu_seq_lengths,
                     const unsigned int* tiles, int q_heads, int kv_heads, int window,
                     float scale) {
    attention_mma<64>(qkv, out, cu_seq_lengths, tiles, q_heads, kv_heads, window, scale);
}

extern "C" __global__ void __launch_bounds__(128)
    attention_mma_128(const bf16* qkv, bf16* out, const unsigned int* cu_seq_lengths,
                      const unsigned int* tiles, int q_heads, int kv_heads, int window,
                      float scale) {
    attention_mma<128>(qkv, out, cu_seq_lengths, tiles, q_heads, kv_heads, window, scale);
}
