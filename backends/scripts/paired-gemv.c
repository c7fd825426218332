/* Batch-1 decode steps' linear layers, ours (tk_linear) and llama.cpp's ggml (mul_mat),
 * taken in turns in one process: each pair of steps runs within ~100 ms, so both sides
 * of a pair meet the same memory state. Built and run by paired-gemv.sh.
 *
 * A "step" is every linear layer of a llama-shaped model at batch 1 (per layer: q, k,
 * v, o, gate, up, down; then the LM head) over random f16 weights: ours copied into the
 * device's buffers (as `tessera up` loads weights), ggml's in plain memory (4 KiB
 * pages where transparent huge pages are `madvise`, as llama-server's map of the
 * file). Both on the same number of threads.
 *
 * usage: paired-gemv [STEPS [THREADS [HIDDEN KV_DIM FFN LAYERS VOCAB]]] [-v]
 * (defaults: 100 steps, 2 threads, the `bench` preset's 2048 512 8192 14 32768) */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml-cpu.h"
#include "ggml.h"
#include "tessera_kernels.h"

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double pct(double *v, int n, double p) {
    qsort(v, n, sizeof *v, by_value);
    return v[(int)(p * (n - 1) + 0.5)];
}

static void check(tk_status s, const char *what) {
    if (s != TK_OK) {
        fprintf(stderr, "%s: %s\n", what, tk_last_error());
        exit(1);
    }
}

typedef struct { double ours, ggml; } pair_t;

static int by_mean(const void *a, const void *b) {
    const pair_t *x = a, *y = b;
    double u = x->ours + x->ggml, v = y->ours + y->ggml;
    return (u > v) - (u < v);
}

int main(int argc, char **argv) {
    int verbose = argc > 1 && strcmp(argv[argc - 1], "-v") == 0;
    if (verbose) argc--;
    if (argc > 3 && argc != 8) {
        fprintf(stderr, "usage: paired-gemv.sh [STEPS [THREADS [HIDDEN KV_DIM FFN LAYERS VOCAB]]] [-v]\n");
        return 2;
    }
    int steps = argc > 1 ? atoi(argv[1]) : 100, threads = argc > 2 ? atoi(argv[2]) : 2;
    int hidden = 2048, kvd = 512, ffn = 8192, layers = 14, vocab = 32768;
    if (argc == 8) {
        hidden = atoi(argv[3]), kvd = atoi(argv[4]), ffn = atoi(argv[5]);
        layers = atoi(argv[6]), vocab = atoi(argv[7]);
    }
    if (steps < 2 || threads < 1 || hidden < 1 || kvd < 1 || ffn < 1 || layers < 1 || vocab < 1) {
        fprintf(stderr, "STEPS must be at least 2 and every size positive\n");
        return 2;
    }
    /* {k, n} of each layer's products, then the LM head's. */
    const int shape[7][2] = {{hidden, hidden}, {hidden, kvd}, {hidden, kvd}, {hidden, hidden},
                             {hidden, ffn},    {hidden, ffn}, {ffn, hidden}};
    int nmat = layers * 7 + 1;
    int *K = malloc(nmat * sizeof *K), *N = malloc(nmat * sizeof *N);
    size_t weights = 0, outputs = 0;
    for (int i = 0; i < nmat; i++) {
        K[i] = i < layers * 7 ? shape[i % 7][0] : hidden;
        N[i] = i < layers * 7 ? shape[i % 7][1] : vocab;
        weights += (size_t)K[i] * N[i];
        outputs += N[i];
    }
    int widest = ffn > vocab ? ffn : vocab;
    widest = widest > hidden ? widest : hidden;

    /* Two inputs, the weights and the products' outputs, the tensors' and graph's headers. */
    size_t graph_size = 2 * (size_t)nmat + 16;
    size_t mem = ((size_t)hidden + ffn + outputs) * 4 + weights * 2 + (2 * (size_t)nmat + 2) * ggml_tensor_overhead() +
                 ggml_graph_overhead_custom(graph_size, false) + (1u << 20);
    struct ggml_init_params params = {mem, NULL, false};
    struct ggml_context *ctx = ggml_init(params);
    if (!ctx) {
        fprintf(stderr, "ggml_init failed (%zu bytes)\n", params.mem_size);
        return 1;
    }
    struct ggml_tensor *xh = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, hidden);
    struct ggml_tensor *xf = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, ffn);
    float *x = malloc((size_t)widest * sizeof *x);
    for (int j = 0; j < widest; j++) x[j] = (float)(j % 7 - 3) * 0.01f;
    memcpy(xh->data, x, (size_t)hidden * 4);
    memcpy(xf->data, x, (size_t)ffn * 4);
    struct ggml_cgraph *graph = ggml_new_graph_custom(ctx, graph_size, false);

    tk_device_config config = {(uint32_t)threads, 0, 0};
    tk_device *dev;
    check(tk_device_create(&config, &dev), "tk_device_create");
    tk_buffer *xb, *ob, **wb = malloc(nmat * sizeof *wb);
    check(tk_alloc(dev, (uint64_t)widest * 4, &xb), "tk_alloc");
    check(tk_alloc(dev, (uint64_t)widest * 4, &ob), "tk_alloc");
    check(tk_copy_h2d(dev, (tk_ptr){xb, 0}, x, (uint64_t)widest * 4), "tk_copy_h2d");
    uint64_t seed = 88172645463325252ull;
    for (int i = 0; i < nmat; i++) {
        struct ggml_tensor *w = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, K[i], N[i]);
        ggml_fp16_t *d = w->data;
        size_t n = (size_t)K[i] * N[i];
        for (size_t j = 0; j < n; j++) {
            seed ^= seed << 13, seed ^= seed >> 7, seed ^= seed << 17;
            d[j] = ggml_fp32_to_fp16(((int)(seed % 2001) - 1000) * 2e-5f);
        }
        check(tk_alloc(dev, n * 2, &wb[i]), "tk_alloc (weights)");
        check(tk_copy_h2d(dev, (tk_ptr){wb[i], 0}, d, n * 2), "tk_copy_h2d (weights)");
        ggml_build_forward_expand(graph, ggml_mul_mat(ctx, w, K[i] == hidden ? xh : xf));
    }
    check(tk_synchronize(dev), "tk_synchronize");
    struct ggml_cplan plan = ggml_graph_plan(graph, threads, NULL);
    plan.work_data = malloc(plan.work_size + 64);
    struct ggml_threadpool_params tpp = ggml_threadpool_params_default(threads);
    plan.threadpool = ggml_threadpool_new(&tpp);
    printf("%d steps of %zu f16 weights (%.2f GB), %d threads; ours then ggml in each pair\n", steps,
           weights, weights * 2e-9, threads);

    pair_t *p = malloc(steps * sizeof *p);
    for (int s = -3; s < steps; s++) { /* 3 warm-up pairs */
        double t0 = now_ms();
        for (int i = 0; i < nmat; i++)
            check(tk_linear(dev, (tk_ptr){ob, 0}, (tk_ptr){xb, 0}, (tk_ptr){wb[i], 0}, TK_DTYPE_F16,
                            (tk_ptr){NULL, 0}, 1, N[i], K[i]),
                  "tk_linear");
        check(tk_synchronize(dev), "tk_synchronize");
        double t1 = now_ms();
        if (ggml_graph_compute(graph, &plan) != GGML_STATUS_SUCCESS) {
            fprintf(stderr, "ggml_graph_compute failed\n");
            return 1;
        }
        double t2 = now_ms();
        if (s < 0) continue;
        p[s] = (pair_t){t1 - t0, t2 - t1};
        if (verbose) printf("step %d: ours %.1f ms, ggml %.1f ms, %.3f\n", s, t1 - t0, t2 - t1, (t1 - t0) / (t2 - t1));
    }
    /* Pairs sorted by their mean time: the faster half met the memory's faster moments. */
    qsort(p, steps, sizeof *p, by_mean);
    double *o = malloc(steps * sizeof *o), *g = malloc(steps * sizeof *g), *r = malloc(steps * sizeof *r);
    const char *name[3] = {"all pairs", "faster half", "slower half"};
    int from[3] = {0, 0, steps / 2}, to[3] = {steps, steps / 2, steps};
    for (int h = 0; h < 3; h++) {
        int n = to[h] - from[h];
        for (int i = 0; i < n; i++) {
            o[i] = p[from[h] + i].ours, g[i] = p[from[h] + i].ggml;
            r[i] = o[i] / g[i];
        }
        double om = pct(o, n, 0.5), gm = pct(g, n, 0.5);
        printf("%-12s (%3d): ours %.1f ms, ggml %.1f ms (medians); ours / ggml per pair: median %.3f, p10 %.3f, p90 %.3f\n",
               name[h], n, om, gm, pct(r, n, 0.5), pct(r, n, 0.1), pct(r, n, 0.9));
    }
    return 0;
}
