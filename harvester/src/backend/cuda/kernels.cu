// The CUDA backend's kernels, compiled once at start-up by NVRTC. No CUDA headers: bf16 is
// carried as `unsigned short` and converted by hand, so NVRTC needs no include path.
//
// Layouts (row-major): the residual stream `x` is f32 [tokens, hidden]; GEMM inputs and
// outputs are bf16 [tokens, width]; the fused QKV buffer is bf16 [tokens, (q + 2 kv) * head_dim]
// with the query heads first, then the key heads, then the value heads. There is no residual-add
// or row-gather kernel: the O and down GEMMs add into `x` (beta = 1), and a kept layer is
// copied whole.

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

__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}

// x[t, :] = table[ids[t], :]. Grid: tokens; block: any.
extern "C" __global__ void embed_gather(const bf16* table, const unsigned int* ids, float* x,
                                        int hidden) {
    const int t = blockIdx.x;
    const bf16* row = table + (long long)ids[t] * hidden;
    float* out = x + (long long)t * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        out[i] = bf16_to_f32(row[i]);
    }
}

// out[t, :] = x[t, :] / rms(x[t, :]) * weight, in bf16 for the next GEMM. Grid: tokens;
// block: a multiple of 32 up to 1024.
extern "C" __global__ void rms_norm(const float* x, const bf16* weight, bf16* out, int hidden,
                                    float eps) {
    __shared__ float partial[32];
    const int t = blockIdx.x;
    const float* row = x + (long long)t * hidden;
    float sum = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        sum += row[i] * row[i];
    }
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
    const float scale = rsqrtf(partial[0] / (float)hidden + eps);
    bf16* dst = out + (long long)t * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        dst[i] = f32_to_bf16(row[i] * scale * bf16_to_f32(weight[i]));
    }
}

// Rotates the query and key heads of the fused QKV buffer in place, Hugging Face style
// (dimension i pairs with i + head_dim / 2). `inv_freq` has head_dim / 2 entries, Llama 3
// scaling already applied on the host. Grid: (tokens, q_heads + kv_heads); block: head_dim / 2.
extern "C" __global__ void rope(bf16* qkv, const unsigned int* positions, const float* inv_freq,
                                int row_width, int head_dim) {
    const int t = blockIdx.x, head = blockIdx.y, i = threadIdx.x;
    const int half = head_dim >> 1;
    if (i >= half) return;
    bf16* h = qkv + (long long)t * row_width + (long long)head * head_dim;
    float s, c;
    sincosf((float)positions[t] * inv_freq[i], &s, &c);
    const float a = bf16_to_f32(h[i]), b = bf16_to_f32(h[i + half]);
    h[i] = f32_to_bf16(a * c - b * s);
    h[i + half] = f32_to_bf16(b * c + a * s);
}

// out[t, j] = silu(gate[t, j]) * up[t, j], with gate_up [tokens, 2 * inter] (gate first).
extern "C" __global__ void swiglu(const bf16* gate_up, bf16* out, int inter, long long n) {
    for (long long k = blockIdx.x * (long long)blockDim.x + threadIdx.x; k < n;
         k += (long long)gridDim.x * blockDim.x) {
        const long long t = k / inter, j = k % inter;
        const float g = bf16_to_f32(gate_up[t * 2 * inter + j]);
        const float u = bf16_to_f32(gate_up[t * 2 * inter + inter + j]);
        out[k] = f32_to_bf16(g / (1.0f + __expf(-g)) * u);
    }
}

// Causal grouped-query attention over packed variable-length sequences, with an online softmax
// and no [n, n] buffer. One block handles `QUERIES` consecutive queries of one sequence for one
// query head; each warp owns one query and each lane `head_dim / 32` of its dimensions. Keys and
// values stream through shared memory `KEYS` at a time, shared by the block's warps.
// `tiles` holds (sequence, first query) pairs made on the host. Grid: (tiles, q_heads);
// block: 32 * QUERIES. head_dim must be a multiple of 32 and at most MAX_HEAD_DIM.
#define QUERIES 8
#define KEYS 32
#define MAX_HEAD_DIM 128
#define MAX_PER_LANE (MAX_HEAD_DIM / 32)
extern "C" __global__ void attention_varlen(const bf16* qkv, bf16* out,
                                            const unsigned int* cu_seq_lengths,
                                            const unsigned int* tiles, int q_heads, int kv_heads,
                                            int head_dim, float scale) {
    __shared__ float k_tile[KEYS * MAX_HEAD_DIM];
    __shared__ float v_tile[KEYS * MAX_HEAD_DIM];
    const int seq = tiles[2 * blockIdx.x], first = tiles[2 * blockIdx.x + 1];
    const int head = blockIdx.y, kv_head = head / (q_heads / kv_heads);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int start = cu_seq_lengths[seq], length = cu_seq_lengths[seq + 1] - start;
    const int query = first + warp;  // position within the sequence
    const int row_width = (q_heads + 2 * kv_heads) * head_dim;
    const int per_lane = head_dim >> 5;
    const int k_offset = q_heads * head_dim + kv_head * head_dim;
    const int v_offset = (q_heads + kv_heads) * head_dim + kv_head * head_dim;
    const bool active = query < length;

    float q[MAX_PER_LANE], acc[MAX_PER_LANE];
    for (int d = 0; d < per_lane; ++d) {
        q[d] = active ? bf16_to_f32(qkv[(long long)(start + query) * row_width + head * head_dim
                                        + lane + 32 * d]) * scale
                      : 0.0f;
        acc[d] = 0.0f;
    }
    float running_max = -3.0e38f, running_sum = 0.0f;
    const int last_query = min(first + QUERIES, length) - 1;
    for (int key0 = 0; key0 <= last_query; key0 += KEYS) {
        const int keys = min(KEYS, last_query + 1 - key0);
        __syncthreads();
        for (int k = threadIdx.x; k < keys * head_dim; k += blockDim.x) {
            const int j = k / head_dim, d = k % head_dim;
            const long long row = (long long)(start + key0 + j) * row_width;
            k_tile[j * head_dim + d] = bf16_to_f32(qkv[row + k_offset + d]);
            v_tile[j * head_dim + d] = bf16_to_f32(qkv[row + v_offset + d]);
        }
        __syncthreads();
        if (!active) continue;
        for (int j = 0; j < keys && key0 + j <= query; ++j) {
            float dot = 0.0f;
            for (int d = 0; d < per_lane; ++d) {
                dot += q[d] * k_tile[j * head_dim + lane + 32 * d];
            }
            const float score = warp_sum(dot);
            const float new_max = fmaxf(running_max, score);
            const float correction = __expf(running_max - new_max);
            const float weight = __expf(score - new_max);
            running_sum = running_sum * correction + weight;
            for (int d = 0; d < per_lane; ++d) {
                acc[d] = acc[d] * correction + weight * v_tile[j * head_dim + lane + 32 * d];
            }
            running_max = new_max;
        }
    }
    if (!active) return;
    const float inv = 1.0f / running_sum;
    bf16* dst = out + (long long)(start + query) * (q_heads * head_dim) + head * head_dim;
    for (int d = 0; d < per_lane; ++d) {
        dst[lane + 32 * d] = f32_to_bf16(acc[d] * inv);
    }
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
