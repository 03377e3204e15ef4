/* What the linear kernels share (linear_cpu.c, linear_amx.c, linear_quant.c): weight kinds of a
 * packed panel (kernels/linear_cpu.py packs them) and the AMX entry point. */
#ifndef PDSERVE_LINEAR_PACK_H
#define PDSERVE_LINEAR_PACK_H

#include <stdint.h>

#define WK_BF16 0 /* wp[p][k][j] = W[32p + j][k] as bf16 */
#define WK_I8 1   /* the same layout, int8, with a per-column fp32 scale */

/* From this many rows a call goes to the AMX tiles (where compiled in): below it a tile's 16
 * rows are mostly padding and the FMA kernel, which streams the weights once, is faster. */
#define AMX_MIN_ROWS 32

/* y = (x @ W^T) * scale + bias on AMX tiles; x is bf16. Returns 0, -1 if memory ran out, -2
 * where not compiled in. */
int pdserve_amx_linear(const void *x, int64_t ldx, const void *wp, int wkind, const float *scale, const float *bias,
                       void *y, int y_bf16, int64_t ldy, int M, int N, int K);

#endif
