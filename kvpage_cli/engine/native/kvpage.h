/* kvpage native CPU kernels: the library's interface, said once. Every .c file of the library
 * includes this header, so the compiler holds each definition to its prototype here, and the
 * Python loader (kvpage_cli/engine/native) binds every kvp_* function from the prototypes below
 * (one a declaration, parameters of the types it knows: int, int32_t, int64_t, float, pointers).
 *
 * Built with -DBLOCK_TOKENS=... and -DTILE_MIN_ROWS=... from kvpage_cli/engine/config.py.
 */
#ifndef KVPAGE_H
#define KVPAGE_H
#include <stdint.h>

/* Weight formats: GGML's type numbers for the GGUF block formats, and kvpage's own int8 rows. */
enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
    T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30,
    T_I8_ROW = 1000, /* kvpage int8: a row is one fp32 scale, then K int8 values */
};

/* Element kinds of a KV block: fp32, bf16, or int8 rows each followed (after the block's 64 rows)
 * by its float32 scale; an int8 element's value is (float)x * the row's scale, the product
 * store.decode_rows computes. */
enum { KIND_F32 = 0, KIND_BF16 = 1, KIND_INT8 = 2 };

/* One weight matrix W[rows, cols] in a weight format; output i is W's row perm[i] (NULL: in order);
 * int8: its products round x to int8 (kvp_qgemm_rows_q8), else fp32 products. */
typedef struct {
    int32_t type, rows, cols, int8;
    const uint8_t *data;
    int64_t row_bytes;
    const int64_t *perm;
} kvp_matrix;

/* A layer as kvp_layer_pre / kvp_layer_post read it (built once at load by the model runner). */
typedef struct {
    int32_t hidden, q_size, kv_size, inter;
    float eps;
    const float *norm_attn, *norm_mlp;                           /* [hidden] */
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;    /* NULL where the model has none */
    kvp_matrix q, k, v, o, gate, up, down;
    int32_t head_dim;
} kvp_layer;

/* attention.c: decode attention over blocks read through an address table; merging states */
int kvp_decode_states(int kind, const float *q, const int64_t *k_addr, const int64_t *v_addr, int n_items,
                      const int32_t *item_ids, const int32_t *item_pos, const int32_t *item_off,
                      const int32_t *pair_query, const int64_t *q_pos, const int64_t *q_end, int Hq, int Hkv, int D,
                      int64_t window, float scale, float *states, float *lse, int tiles);
void kvp_write_rows(int kind, const float *x, int n, int Hkv, int D, const int64_t *table, const int64_t *ids,
                    const int32_t *offset);
void kvp_merge_pairs(const float *states, const float *lse, int Nq, const int32_t *q_off, const int32_t *q_pairs,
                     int H, int D, float *out);
void kvp_fold_states(const float *states, const float *lse, int n, int H, int D, float *acc, float *m, float *l);

/* prefill.c: prompt attention with bfloat16 products (AVX512-BF16, AMX tiles) */
int kvp_prefill_set_amx(int on);
int kvp_prefill_bf16(const float *q, int64_t ldqh, int64_t ldq, int H, int R, int group, int causal, int window,
                     const int64_t *runs, int n_runs, int D, float scale, float *out, float *lse);
int kvp_decode_tiles(const float *q, const int64_t *k_addr, const int64_t *v_addr, int n_items,
                     const int32_t *item_ids, const int32_t *item_pos, const int32_t *item_off,
                     const int32_t *pair_query, const int64_t *q_pos, const int64_t *q_end, int Hq, int Hkv, int D,
                     int64_t window, float scale, float *states, float *lse, int min_pairs, int max_run);

/* amx.c: the AMX tile state */
int kvp_amx_granted(void);
void kvp_amx_configure(void);

/* linear.c: fp32 / bf16 products of a few rows */
void kvp_gemm_rows(int bf16, const float *x, int64_t ldx, const void *w, int64_t ldw, int M, int K, int N,
                   float *y, int64_t ldy);

/* layer.c: a llama-family layer around attention, for a few rows */
int kvp_layer_pre(const kvp_layer *L, const float *h, int M, const float *cos, const float *sin, float *qkv, int tiles);
int kvp_layer_post(const kvp_layer *L, float *h, const float *a, int M, int tiles);

/* formats.c: the weight formats decoded */
int kvp_quant_block(int type, int *values, int *bytes);
int kvp_dequant_rows(int type, const uint8_t *w, int64_t row_bytes, const int64_t *rows, int n, int K, float *out,
                     int64_t ldo);
int kvp_decode_i8_rows(int type, const uint8_t *w, int64_t row_bytes, int n, int K, int8_t *q, float *d, float *m);

/* rows.c, tiles.c, int8.c, kquants.c: y[M, N] = x[M, K] @ W^T, W in a weight format */
int kvp_qgemm_rows(int type, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes, int M, int K, int N,
                   float *y, int64_t ldy);
int kvp_qgemm_tiles(int type, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes, int M, int K, int N,
                    float *y, int64_t ldy);
int kvp_qgemm_set_tiles(int on);
int kvp_qgemm_rows_q8(int type, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes, int M, int K,
                      int N, float *y, int64_t ldy);
int kvp_kquant_set_gemm_rows(int n);
#endif
