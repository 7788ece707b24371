/* kvpage native CPU kernels: decode attention over blocks read through an address table, and
 * the in-order fold of per-block attention states.
 *
 * Built on first use by kvpage_cli/engine/native/__init__.py with the machine's C compiler and loaded
 * with ctypes (no torch headers, no Python API). OpenMP resolves to the runtime torch already
 * loaded (libgomp.so.1), so torch.set_num_threads governs these kernels too.
 *
 * Every block is addressed through a table of int64 addresses indexed by (id, KV head), so the
 * same kernel reads store arenas in place or pool slots. Each block's partial state (output normalised by its
 * own softmax sum, and its log-sum-exp) is computed independently and states are merged in
 * logical block order, so results do not depend on how blocks were grouped into passes or which
 * slots held them.
 */
#include "attention_item.h"

static item_fn pick_item_fn(int kind, int G, int D) {
    return kind == KIND_BF16 ? attention_items_bf16(G, D)
         : kind == KIND_INT8 ? attention_items_int8(G, D)
                             : attention_items_f32(G, D);
}

/* The first item of thread `part` of `parts`: each thread takes one run of consecutive items, of
 * about equal cost (an item costs its block's read plus one unit per pair), so that it streams
 * through neighbouring blocks and can prefetch the next one it will read. Threads taking
 * alternate items (OpenMP's dynamic schedule, as before) read the store's blocks at about half
 * the rate (README, Benchmarks: bench/native_attention.py --layout store --layers 30). */
static int first_item_of(const int32_t *item_off, int n_items, int64_t part, int parts) {
    const int64_t total = (int64_t)n_items + item_off[n_items] - item_off[0];
    const int64_t target = total * part / parts;
    int lo = 0, hi = n_items; /* the first i whose cost before it, i + pairs before it, reaches target */
    while (lo < hi) {
        const int mid = lo + (hi - lo) / 2;
        if ((int64_t)mid + item_off[mid] - item_off[0] < target) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* Blocks read by this many queries of a batch or more go to AMX tiles where the CPU has them, bfloat16
 * KV only (measured against this file's fp32 products, bench/native_attention.py: 0.8x at two
 * queries, 1.1x at four, 1.6x at sixteen): a sequence in a batch then gets other bits for its
 * shared blocks than alone (within fp32 attention's tolerance). */
#define TILE_MIN_PAIRS 4

/* Per-pair states of decode queries: states[P, Hq, D] and lse[P, Hq] for the P (block, query)
 * pairs of the items. q: [Nq, Hq, D] fp32; k_addr, v_addr: [capacity, Hkv] addresses of each
 * block's head rows ([64, D] each); item i is block item_ids[i] at logical index item_pos[i],
 * read by the queries pair_query[item_off[i] .. item_off[i+1]); query j sits at position
 * q_pos[j] and sees keys before q_end[j]. A pair with no visible token gets lse = -inf and a zero
 * output. Each pair's state is computed alone, with the same arithmetic however the queries
 * are batched, except that with `tiles` > 0 bfloat16 items read by TILE_MIN_PAIRS queries or more
 * multiply on AMX tiles where the CPU has them (a batch's generated tokens: other bits than alone),
 * up to `tiles` consecutive blocks in one pass (kvp_decode_tiles's max_run: 1, per-block states;
 * more: a pass's later blocks' pairs get lse = -inf and no output, which kvp_merge_pairs skips).
 * Items run in parallel. Returns -1 for shapes it does not handle. */
int kvp_decode_states(int kind, const float *q, const int64_t *k_addr, const int64_t *v_addr, int n_items,
                      const int32_t *item_ids, const int32_t *item_pos, const int32_t *item_off,
                      const int32_t *pair_query, const int64_t *q_pos, const int64_t *q_end, int Hq, int Hkv, int D,
                      int64_t window, float scale, float *states, float *lse, int tiles) {
    if (Hkv <= 0 || Hq % Hkv != 0 || Hq / Hkv > MAX_GROUP || D > MAX_DIM) return -1;
    if (kind < KIND_F32 || kind > KIND_INT8) return -1;
    int shared_on_tiles = 0; /* items of TILE_MIN_PAIRS pairs or more done on AMX tiles (prefill.c) */
    if (kind == KIND_BF16 && tiles) {
        const int rc = kvp_decode_tiles(q, k_addr, v_addr, n_items, item_ids, item_pos, item_off, pair_query, q_pos, q_end,
                                        Hq, Hkv, D, window, scale, states, lse, TILE_MIN_PAIRS, tiles);
        if (rc == -2) return rc;
        shared_on_tiles = rc == 0;
    }
    const int G = Hq / Hkv;
    const decode_args a = {n_items, q, k_addr, v_addr, item_ids, item_pos, item_off, pair_query, q_pos, q_end,
                           Hkv, G, D, window, scale, states, lse};
    const item_fn fn = pick_item_fn(kind, G, D);
#pragma omp parallel
    {
        int threads = 1, thread = 0;
#if defined(_OPENMP)
        threads = omp_get_num_threads();
        thread = omp_get_thread_num();
#endif
        const int end = first_item_of(item_off, n_items, (int64_t)thread + 1, threads);
        for (int i = first_item_of(item_off, n_items, thread, threads); i < end; i++)
            if (!shared_on_tiles || item_off[i + 1] - item_off[i] < TILE_MIN_PAIRS) fn(&a, i);
    }
    return 0;
}

/* float -> bfloat16 as torch rounds it: to nearest, ties to even; NaN stays a (quiet) NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if (f != f) return 0x7fc0;
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* Rows x [n, Hkv, D] (fp32) into their blocks: row r's head h goes to the block head at
 * table[ids[r] * Hkv + h] (store.py's head_addresses), row offset[r] in it, as element `kind`:
 * float32 copied, bfloat16 rounded as torch rounds, int8 as round(x / s) clamped to [-127, 127]
 * (ties to even) with s = max |x| / 127 (divided by 1 where the row is all zeros) and s written
 * after the block's 64 rows: store.encode_rows' arithmetic, so either writer gives the same bits. */
void kvp_write_rows(int kind, const float *x, int n, int Hkv, int D, const int64_t *table, const int64_t *ids,
                    const int32_t *offset) {
    for (int r = 0; r < n; r++) {
        for (int h = 0; h < Hkv; h++) {
            const float *row = x + ((int64_t)r * Hkv + h) * D;
            char *block = (char *)(intptr_t)table[ids[r] * Hkv + h];
            if (kind == KIND_F32) {
                memcpy((float *)block + (int64_t)offset[r] * D, row, sizeof(float) * (size_t)D);
            } else if (kind == KIND_BF16) {
                uint16_t *dst = (uint16_t *)block + (int64_t)offset[r] * D;
                for (int d = 0; d < D; d++) dst[d] = f32_to_bf16(row[d]);
            } else {
                float m = 0.0f;
                for (int d = 0; d < D; d++) m = fabsf(row[d]) > m ? fabsf(row[d]) : m;
                const float s = m / 127.0f;
                const float safe = s > 0.0f ? s : 1.0f;
                int8_t *dst = (int8_t *)block + (int64_t)offset[r] * D;
                for (int d = 0; d < D; d++) {
                    float v = rintf(row[d] / safe);
                    v = v < -127.0f ? -127.0f : (v > 127.0f ? 127.0f : v);
                    dst[d] = (int8_t)v;
                }
                float scale = s;
                memcpy(block + (int64_t)BLOCK_TOKENS * D + (int64_t)offset[r] * (int64_t)sizeof(float), &scale,
                       sizeof scale);
            }
        }
    }
}

/* Merges, for each query j, the states of its pairs q_pairs[q_off[j] .. q_off[j+1]) (in logical
 * block order) into out[j, H, D]: states [P, H, D], lse [P, H]. */
void kvp_merge_pairs(const float *states, const float *lse, int Nq, const int32_t *q_off, const int32_t *q_pairs,
                     int H, int D, float *out) {
#pragma omp parallel for schedule(static) collapse(2)
    for (int j = 0; j < Nq; j++) {
        for (int h = 0; h < H; h++) {
            float m = -INFINITY;
            for (int i = q_off[j]; i < q_off[j + 1]; i++) {
                const float l = lse[(int64_t)q_pairs[i] * H + h];
                m = l > m ? l : m;
            }
            float *oh = out + ((int64_t)j * H + h) * D;
            memset(oh, 0, sizeof(float) * (size_t)D);
            if (m == -INFINITY) continue;
            float total = 0.0f;
            for (int i = q_off[j]; i < q_off[j + 1]; i++) {
                const float l = lse[(int64_t)q_pairs[i] * H + h];
                if (l == -INFINITY) continue;
                const float w = expf(l - m);
                total += w;
                const float *sb = states + ((int64_t)q_pairs[i] * H + h) * D;
#pragma omp simd
                for (int d = 0; d < D; d++) oh[d] += w * sb[d];
            }
            const float inv = 1.0f / total;
#pragma omp simd
            for (int d = 0; d < D; d++) oh[d] *= inv;
        }
    }
}

/* Folds per-block states [n, H, D] / [n, H] one block after the other, in order, into a running
 * state (acc [H, D] unnormalised, m [H] running max, l [H] running sum). Folding block by block
 * makes the result independent of how the blocks were split into calls. */
void kvp_fold_states(const float *states, const float *lse, int n, int H, int D, float *acc, float *m, float *l) {
#pragma omp parallel for schedule(static)
    for (int h = 0; h < H; h++) {
        float *ah = acc + (int64_t)h * D;
        float mh = m[h], lh = l[h];
        for (int b = 0; b < n; b++) {
            const float x = lse[(int64_t)b * H + h];
            if (x == -INFINITY) continue;
            const float *sb = states + ((int64_t)b * H + h) * D;
            if (x > mh) {
                const float shrink = (mh == -INFINITY) ? 0.0f : expf(mh - x);
                lh = lh * shrink + 1.0f;
#pragma omp simd
                for (int d = 0; d < D; d++) ah[d] = ah[d] * shrink + sb[d];
                mh = x;
            } else {
                const float w = expf(x - mh);
                lh += w;
#pragma omp simd
                for (int d = 0; d < D; d++) ah[d] += w * sb[d];
            }
        }
        m[h] = mh;
        l[h] = lh;
    }
}
