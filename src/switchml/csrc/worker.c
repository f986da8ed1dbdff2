/* switchml._worker: the worker's per-datagram rules, compiled when the package is built.
 *
 * The one production implementation of the worker's data plane: build (and rebuild) requests
 * into the lanes' transmit buffers, take results (dequantize into the output, time the round
 * trip, release the lane's next chunk), answer NACKs, fire the timers (timeouts, the idle
 * probe), cut queued requests into UDP GSO runs, and the compiled receive-and-send loop
 * (`pump`) that runs all of that without Python while an operation is in flight.
 *
 * protocol/worker.py explains the protocol; protocol/kernels/layout.py is the table of the
 * state's fields (csrc/layout.h is generated from it and from wire.py). The plain-Python
 * reference of every rule here is protocol/kernels/stream.py, numerics.py and timers.py: the
 * tests run both on crafted and random batches and compare every array
 * (tests/protocol/test_worker_kernels.py). Each entry point takes the same arguments as its
 * Python reference, numpy arrays through the buffer protocol, and releases the GIL while it
 * works.
 */
#include "common.h"

/* ---- one operation's state: pointers into the arrays operation.py builds ---------------- */

typedef struct {
    int64_t *opv, *lane, *next_set, *exps, *cnt, *sendq, *sendlen, *picked;
    double *lanef, *rtt;
    uint8_t *nonf, *tx8;
    const void *x; int xk; int64_t xn;
    void *out; int ok; int64_t on;
    void *res; int rk; int64_t rn;
    void *keep;     /* an in-place operation's input, kept block by block as sent; or NULL */
    int64_t *contrib; /* a quorum operation's contributors per block (OP_L); or NULL */
    int64_t xisz;   /* bytes per input element */
    int64_t nl;     /* lanes (lane.shape[1]) */
    int64_t nsendq; /* sendq.size */
} op_t;

/* The float kinds the kernels take as input and output. */
#define FLOATS (B(K_F32) | B(K_F64) | B(K_F16) | B(K_BF16))

#define OPV(o, f) ((o)->opv[f])
#define LANE(o, f, i) ((o)->lane[(int64_t)(f) * (o)->nl + (i)])
#define LANEF(o, f, i) ((o)->lanef[(int64_t)(f) * (o)->nl + (i)])

/* ---- numerics (quantize.py explains them) ---------------------------------------------- */

static inline int64_t frexp_exp(double m)
{
    int e;
    frexp(m, &e);
    return e;
}

/* The half types. float16 is the compiler's _Float16, converted a chunk at a time through F16C
   where the machine has it (quantize_f16, dequantize_f16); bfloat16 is float32's top 16 bits.
   A double is stored into either rounded once, to nearest, ties to even: first to float32
   rounding to odd (the float32 nearer zero, its last bit set if inexact), then to the half
   type to nearest. With at least two more bits
   than the half type, the odd intermediate never creates a false tie, so the two steps round
   as one (Boldo and Melquiond, "Emulation of FMA and correctly rounded sums: proved
   algorithms using rounding to odd", IEEE TC 2008). */
#ifndef __FLT16_MAX__
#error "switchml's data plane needs a C compiler with _Float16 (GCC >= 12 or Clang >= 15 on x86-64)"
#endif
typedef _Float16 f16_t;
typedef uint16_t bf16_t;

static inline float to_float_odd(double v)
{
    /* (branch-free, so that the dequantizing loops vectorize) */
    float t = (float)v;
    uint32_t u;
    memcpy(&u, &t, 4);
    uint32_t inexact = ((double)t != v) & ((u & 0x7F800000u) != 0x7F800000u); /* not inf, NaN */
    uint32_t away = fabs((double)t) > fabs(v);
    u = (u - (inexact & away)) | inexact; /* the float32 nearer zero, its last bit set */
    memcpy(&t, &u, 4);
    return t;
}

static inline float bf16_to_float(bf16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline bf16_t float_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return (bf16_t)((u >> 16) | 0x40u); /* NaN stays NaN (quiet) */
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

/* Loads as double and stores from double, per element type (the loops below take them). */
#define LD_PLAIN(p, j) ((double)(p)[j])
#define ST_ODD(T, v) (to_float_odd(v))
#define LD_BF16(p, j) ((double)bf16_to_float((p)[j]))
#define ST_PLAIN(T, v) ((T)(v))
#define ST_BF16(T, v) (float_to_bf16(to_float_odd(v)))

static inline double load_x(const void *x, int xk, int64_t j)
{
    switch (xk) {
    case K_F32: return (double)((const float *)x)[j];
    case K_F16: return (double)(float)((const f16_t *)x)[j];
    case K_BF16: return (double)bf16_to_float(((const bf16_t *)x)[j]);
    default: return ((const double *)x)[j];
    }
}

static inline int64_t kind_size(int k)
{
    return k == K_F64 || k == K_I64 ? 8 : k == K_F16 || k == K_BF16 || k == K_I16 ? 2
                                                                                  : k == K_U8 ? 1 : 4;
}

/* exponent_of_bits for a block with a NaN or Inf: an element at a time. */
static void scan_exponent(const void *x, int xk, int64_t lo, int64_t hi, int64_t b,
                          int64_t *exps, uint8_t *nonf)
{
    double m = 0.0;
    int bad = 0;
    for (int64_t j = lo; j < hi; j++) {
        double a = fabs(load_x(x, xk, j));
        if (a > m) {
            if (a == INFINITY)
                bad = 1;
            else
                m = a;
        } else if (a != a) {
            bad = 1;
        }
    }
    exps[b] = m == 0.0 ? EXP_ZERO : frexp_exp(m);
    nonf[b] = (uint8_t)bad;
}

/* Block b = x[lo:hi]: max|x| < 2**e over finite elements (EXP_ZERO for an all-zero block)
   into exps[b], and whether it holds a NaN or Inf into nonf[b]: the integer max of the bits
   with the sign cleared (numerics.py's exponent_of_bits says why). */
static inline void exponent_of_bits(const void *x, int xk, int64_t lo, int64_t hi, int64_t b,
                                    int64_t *exps, uint8_t *nonf)
{
    uint64_t mb, top;
    int mant_bits, bias;
    double tiny;
    if (xk == K_F32) {
        const uint32_t *xb = (const uint32_t *)x;
        uint32_t m = 0;
        for (int64_t j = lo; j < hi; j++) {
            uint32_t v = xb[j] & 0x7FFFFFFFu;
            m = v > m ? v : m;
        }
        mb = m;
        top = 0x7F800000u;
        mant_bits = 23;
        bias = 126;
        tiny = 0x1p-149;
    } else if (xk == K_F16 || xk == K_BF16) {
        const uint16_t *xb = (const uint16_t *)x;
        uint16_t m = 0;
        for (int64_t j = lo; j < hi; j++) {
            uint16_t v = xb[j] & 0x7FFFu;
            m = v > m ? v : m;
        }
        mb = m;
        if (xk == K_F16) {
            top = 0x7C00u;
            mant_bits = 10;
            bias = 14;
            tiny = 0x1p-24;
        } else {
            top = 0x7F80u;
            mant_bits = 7;
            bias = 126;
            tiny = 0x1p-133;
        }
    } else {
        const uint64_t *xb = (const uint64_t *)x;
        uint64_t m = 0;
        for (int64_t j = lo; j < hi; j++) {
            uint64_t v = xb[j] & 0x7FFFFFFFFFFFFFFFull;
            m = v > m ? v : m;
        }
        mb = m;
        top = 0x7FF0000000000000ull;
        mant_bits = 52;
        bias = 1022;
        tiny = 0x1p-1074;
    }
    if (mb >= top) {
        scan_exponent(x, xk, lo, hi, b, exps, nonf);
        return;
    }
    nonf[b] = 0;
    int64_t field = (int64_t)(mb >> mant_bits);
    if (mb == 0)
        exps[b] = EXP_ZERO;
    else if (field > 0)
        exps[b] = field - bias;
    else
        exps[b] = frexp_exp((double)mb * tiny);
}

/* q[qo + j] = rint(x[lo + j] * 2**(P - emax)) for j < count (P = n_bits); non-finite elements
   as 0 when the block holds any. Exact scaling (a power of two) in double. */
#define QUANT_LOOPS(XT, LD, QT)                                                               \
    do {                                                                                      \
        const XT *xs = (const XT *)x + lo;                                                    \
        QT *qs = (QT *)q + qo;                                                                \
        if (-1000 < shift && shift < 1000) {                                                  \
            double f = ldexp(1.0, (int)shift);                                                \
            if (nonfinite) {                                                                  \
                for (int64_t j = 0; j < count; j++) {                                         \
                    double y = LD(xs, j) * f;                                                 \
                    qs[j] = isfinite(y) ? (QT)rint(y) : 0;                                    \
                }                                                                             \
            } else {                                                                          \
                for (int64_t j = 0; j < count; j++)                                           \
                    qs[j] = (QT)rint(LD(xs, j) * f);                                          \
            }                                                                                 \
        } else {                                                                              \
            for (int64_t j = 0; j < count; j++) {                                             \
                double y = ldexp(LD(xs, j), (int)shift);                                      \
                if (nonfinite && !isfinite(y))                                                \
                    y = 0.0;                                                                  \
                qs[j] = (QT)rint(y);                                                          \
            }                                                                                 \
        }                                                                                     \
    } while (0)

#define QUANT_TO(QT)                                                                          \
    do {                                                                                      \
        switch (xk) {                                                                         \
        case K_F32: QUANT_LOOPS(float, LD_PLAIN, QT); break;                                  \
        case K_BF16: QUANT_LOOPS(bf16_t, LD_BF16, QT); break;                                 \
        default: QUANT_LOOPS(double, LD_PLAIN, QT); break;                                    \
        }                                                                                     \
    } while (0)

/* float16 through float32, a chunk at a time: the compiler does not vectorize _Float16's
   conversions (measured: 3.9 ns per element to quantize, against 0.3 through F16C). */
#define HALF_CHUNK 512
#define K_F32_ODD K_U8 /* (dequantize_into's output kind for float32 rounded to odd: internal) */

static void f16_to_f32(const f16_t *h, float *f, int64_t n)
{
    int64_t j = 0;
#ifdef __F16C__
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(f + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + j))));
#endif
    for (; j < n; j++)
        f[j] = (float)h[j];
}

static void f32_to_f16(const float *f, f16_t *h, int64_t n)
{
    int64_t j = 0;
#ifdef __F16C__
    for (; j + 8 <= n; j += 8)
        _mm_storeu_si128((__m128i *)(h + j),
                         _mm256_cvtps_ph(_mm256_loadu_ps(f + j), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; j < n; j++)
        h[j] = (f16_t)f[j];
}

static void quantize_into(const void *x, int xk, int64_t lo, int64_t count, int64_t emax,
                          int64_t n_bits, int nonfinite, void *q, int qk, int64_t qo);

static void quantize_f16(const f16_t *x, int64_t lo, int64_t count, int64_t emax,
                         int64_t n_bits, int nonfinite, void *q, int qk, int64_t qo)
{
    float buf[HALF_CHUNK];
    for (int64_t c = 0; c < count; c += HALF_CHUNK) {
        int64_t m = min64(HALF_CHUNK, count - c);
        f16_to_f32(x + lo + c, buf, m); /* exact */
        quantize_into(buf, K_F32, 0, m, emax, n_bits, nonfinite, q, qk, qo + c);
    }
}

/* quantize_into for a block whose own exponent is above the agreed one emax (a quorum round
   completed without this rank's look-ahead exponent): each element clamped to what the agreed
   scale holds, +-(2**P - 1), so that the switch's sum still cannot overflow; non-finite
   elements as 0; all 0 where the agreed block is all zeros (numerics.quantize_clamped). */
static void quantize_clamped(const void *x, int xk, int64_t lo, int64_t count, int64_t emax,
                             int64_t n_bits, void *q, int qk, int64_t qo)
{
    double lim = ldexp(1.0, (int)n_bits) - 1.0;
    for (int64_t j = 0; j < count; j++) {
        double y = 0.0;
        if (emax != EXP_ZERO) {
            double v = load_x(x, xk, lo + j);
            if (isfinite(v))
                y = rint(fmin(fmax(ldexp(v, (int)(n_bits - emax)), -lim), lim));
        }
        if (qk == K_I32)
            ((int32_t *)q)[qo + j] = (int32_t)y;
        else
            ((int16_t *)q)[qo + j] = (int16_t)y;
    }
}

static void quantize_into(const void *x, int xk, int64_t lo, int64_t count, int64_t emax,
                          int64_t n_bits, int nonfinite, void *q, int qk, int64_t qo)
{
    if (xk == K_F16 && emax != EXP_ZERO) {
        quantize_f16(x, lo, count, emax, n_bits, nonfinite, q, qk, qo);
        return;
    }
    if (emax == EXP_ZERO) {
        if (qk == K_I32)
            memset((int32_t *)q + qo, 0, (size_t)count * 4);
        else
            memset((int16_t *)q + qo, 0, (size_t)count * 2);
        return;
    }
    int64_t shift = n_bits - emax;
    if (qk == K_I32)
        QUANT_TO(int32_t);
    else
        QUANT_TO(int16_t);
}

/* out[lo + j] = q[qo + j] * 2**(emax - P), rounded once to out's type; NaN if nonfinite. edge: a sum within the quantization error past the
   type's largest finite value fmax is clamped to it; further out it is a genuine overflow
   (inf). q may sit at any offset. */
#define DEQUANT_LOOPS(QT, OT, ST)                                                             \
    do {                                                                                      \
        const QT *qs = (const QT *)q + qo;                                                    \
        OT *os = (OT *)out + lo;                                                              \
        if (edge) {                                                                           \
            double max_in_quanta = ldexp(fmax, (int)-shift);                                  \
            for (int64_t j = 0; j < count; j++) {                                             \
                double qj = (double)qs[j];                                                    \
                double v = ldexp(qj, (int)shift);                                             \
                if (fabs(qj) <= max_in_quanta + 0.5 * (double)num_workers) {                  \
                    if (v > fmax)                                                             \
                        v = fmax;                                                             \
                    else if (v < -fmax)                                                       \
                        v = -fmax;                                                            \
                }                                                                             \
                os[j] = ST(OT, v);                                                            \
            }                                                                                 \
        } else if (-1000 < shift && shift < 1000) {                                           \
            double f = ldexp(1.0, (int)shift);                                                \
            for (int64_t j = 0; j < count; j++)                                               \
                os[j] = ST(OT, (double)qs[j] * f);                                            \
        } else {                                                                              \
            for (int64_t j = 0; j < count; j++)                                               \
                os[j] = ST(OT, ldexp((double)qs[j], (int)shift));                             \
        }                                                                                     \
    } while (0)

#define DEQUANT_FROM(QT)                                                                      \
    do {                                                                                      \
        switch (ok) {                                                                         \
        case K_F32: DEQUANT_LOOPS(QT, float, ST_PLAIN); break;                                \
        case K_F16: /* (float32 rounded to odd, below) */                                     \
        case K_F32_ODD: DEQUANT_LOOPS(QT, float, ST_ODD); break;                              \
        case K_BF16: DEQUANT_LOOPS(QT, bf16_t, ST_BF16); break;                               \
        default: DEQUANT_LOOPS(QT, double, ST_PLAIN); break;                                  \
        }                                                                                     \
    } while (0)

static void dequantize_into(const void *q, int qk, int64_t qo, int64_t emax, int64_t n_bits,
                            int nonfinite, void *out, int ok, int64_t lo, int64_t count,
                            int64_t num_workers, int edge, double fmax);

/* float16 results: rounded to odd into float32 a chunk at a time, then to float16 by F16C. */
static void dequantize_f16(const void *q, int qk, int64_t qo, int64_t emax, int64_t n_bits,
                           f16_t *out, int64_t lo, int64_t count, int64_t num_workers, int edge,
                           double fmax)
{
    float buf[HALF_CHUNK];
    for (int64_t c = 0; c < count; c += HALF_CHUNK) {
        int64_t m = min64(HALF_CHUNK, count - c);
        dequantize_into(q, qk, qo + c, emax, n_bits, 0, buf, K_F32_ODD, 0, m, num_workers, edge,
                        fmax);
        f32_to_f16(buf, out + lo + c, m);
    }
}

static void dequantize_into(const void *q, int qk, int64_t qo, int64_t emax, int64_t n_bits,
                            int nonfinite, void *out, int ok, int64_t lo, int64_t count,
                            int64_t num_workers, int edge, double fmax)
{
    if (nonfinite || emax == EXP_ZERO) {
        double v = nonfinite ? NAN : 0.0;
        for (int64_t j = 0; j < count; j++) {
            switch (ok) {
            case K_F32: ((float *)out)[lo + j] = (float)v; break;
            case K_F16: ((f16_t *)out)[lo + j] = (f16_t)(float)v; break;
            case K_BF16: ((bf16_t *)out)[lo + j] = ST_BF16(bf16_t, v); break;
            default: ((double *)out)[lo + j] = v; break;
            }
        }
        return;
    }
    if (ok == K_F16) {
        dequantize_f16(q, qk, qo, emax, n_bits, out, lo, count, num_workers, edge, fmax);
        return;
    }
    int64_t shift = emax - n_bits;
    if (qk == K_I32)
        DEQUANT_FROM(ui32);
    else
        DEQUANT_FROM(ui16);
}

/* r[lo + j] = x[lo + j] - q[qo + j] * 2**(emax - P): this rank's own rounding error (error
   feedback); 0 where it is not finite. An unsent block (EXP_ZERO) keeps what is finite of x. */
#define RESID_LOOPS(XT, LD, QT, RT)                                                           \
    do {                                                                                      \
        const XT *xs = (const XT *)x + lo;                                                    \
        const QT *qs = (const QT *)q + qo;                                                    \
        RT *rs = (RT *)r + lo;                                                                \
        if (emax == EXP_ZERO) {                                                               \
            for (int64_t j = 0; j < count; j++) {                                             \
                double v = LD(xs, j);                                                         \
                rs[j] = (RT)(isfinite(v) ? v : 0.0);                                          \
            }                                                                                 \
        } else if (-1000 < shift && shift < 1000) {                                           \
            double f = ldexp(1.0, (int)shift);                                                \
            for (int64_t j = 0; j < count; j++) {                                             \
                double v = LD(xs, j) - (double)qs[j] * f;                                     \
                rs[j] = (RT)(isfinite(v) ? v : 0.0);                                          \
            }                                                                                 \
        } else {                                                                              \
            for (int64_t j = 0; j < count; j++) {                                             \
                double v = LD(xs, j) - ldexp((double)qs[j], (int)shift);                      \
                rs[j] = (RT)(isfinite(v) ? v : 0.0);                                          \
            }                                                                                 \
        }                                                                                     \
    } while (0)

#define RESID_FROM(XT, LD)                                                                    \
    do {                                                                                      \
        if (qk == K_I32) {                                                                    \
            if (rk == K_F32) RESID_LOOPS(XT, LD, int32_t, float);                             \
            else RESID_LOOPS(XT, LD, int32_t, double);                                        \
        } else {                                                                              \
            if (rk == K_F32) RESID_LOOPS(XT, LD, int16_t, float);                             \
            else RESID_LOOPS(XT, LD, int16_t, double);                                        \
        }                                                                                     \
    } while (0)

static void residual_into(const void *x, int xk, int64_t lo, int64_t count, const void *q,
                          int qk, int64_t qo, int64_t emax, int64_t n_bits, void *r, int rk)
{
    if (xk == K_F16) { /* through float32, a chunk at a time (quantize_f16) */
        float buf[HALF_CHUNK];
        for (int64_t c = 0; c < count; c += HALF_CHUNK) {
            int64_t m = min64(HALF_CHUNK, count - c);
            f16_to_f32((const f16_t *)x + lo + c, buf, m);
            residual_into(buf, K_F32, 0, m, q, qk, qo + c, emax, n_bits,
                          (uint8_t *)r + (lo + c) * kind_size(rk), rk);
        }
        return;
    }
    int64_t shift = emax - n_bits;
    switch (xk) {
    case K_F32: RESID_FROM(float, LD_PLAIN); break;
    case K_BF16: RESID_FROM(bf16_t, LD_BF16); break;
    default: RESID_FROM(double, LD_PLAIN); break;
    }
}

/* ---- requests (stream.py) -------------------------------------------------------------- */

/* A lane's row in the transmit buffer: one full datagram (an authenticated job's with its MAC);
   what opv's operation asks of the buffers Python allocates. */
static inline int64_t row_bytes(const int64_t *opv)
{
    return HDR + opv[OP_K] * opv[OP_ITEMSIZE] + (opv[OP_AUTH] ? DATA_TAG : 0);
}

static inline int64_t lane_row(const op_t *o, int64_t i)
{
    return i * row_bytes(o->opv);
}

/* An in-place operation's input block x[lo:lo+count] into keep, as the block is sent: its
   result overwrites it in x, and a restart (after the switch lost the job) needs the input.
   (operation.py rebuilds the input from keep for the blocks whose results landed.) */
static inline void keep_block(op_t *o, int64_t lo, int64_t count)
{
    if (o->keep)
        memcpy((uint8_t *)o->keep + lo * o->xisz, (const uint8_t *)o->x + lo * o->xisz,
               (size_t)(count * o->xisz));
}

/* Write packet p (lane i) into the lane's row of the transmit buffer from the input; return
   its length. Float: the exponent of block p (p < L) and the data of block p - E (p >= E),
   scaled with the lane's agreed exponent. Integers: block p. */
static int64_t build_request(op_t *o, int64_t p, int64_t i, int64_t set_bit, int residual)
{
    int64_t L = OPV(o, OP_L), E = OPV(o, OP_E), k = OPV(o, OP_K);
    int64_t itemsize = OPV(o, OP_ITEMSIZE);
    int64_t base = lane_row(o, i);
    int64_t flags = 0, exp_data = EXP_ZERO, exp_next = EXP_ZERO, count = 0;
    if (OPV(o, OP_IS_FLOAT)) {
        if (p < L) {
            exponent_of_bits(o->x, o->xk, p * k, min64(p * k + k, o->xn), p, o->exps, o->nonf);
            exp_next = o->exps[p];
            flags |= F_HAS_EXP;
        }
        if (p >= E) {
            int64_t blk = p - E, lo = blk * k;
            count = min64(lo + k, o->xn) - lo;
            exp_data = LANE(o, LN_EMAX, i);
            int bad = o->nonf[blk] != 0;
            keep_block(o, lo, count);
            int qk = itemsize == 4 ? K_I32 : K_I16;
            int64_t qo = (base + HDR) / itemsize;
            if (o->exps[blk] != EXP_ZERO && o->exps[blk] > exp_data) { /* left out: quorum */
                quantize_clamped(o->x, o->xk, lo, count, exp_data, OPV(o, OP_P), o->tx8, qk, qo);
                o->cnt[WC_CLAMPED] += 1;
            } else {
                quantize_into(o->x, o->xk, lo, count, exp_data, OPV(o, OP_P), bad, o->tx8, qk,
                              qo);
            }
            if (residual)
                residual_into(o->x, o->xk, lo, count, o->tx8, qk, qo, exp_data, OPV(o, OP_P),
                              o->res, o->rk);
            flags |= F_HAS_DATA | (bad ? F_NONFINITE : 0);
        }
    } else {
        int64_t lo = p * k;
        count = min64(lo + k, o->xn) - lo;
        keep_block(o, lo, count);
        memcpy(o->tx8 + base + HDR, (const int32_t *)o->x + lo, (size_t)count * 4);
        flags |= F_HAS_DATA;
    }
    write_header(o->tx8, base, T_REQUEST, flags, set_bit, OPV(o, OP_RANK), OPV(o, OP_JOB),
                 OPV(o, OP_TOKEN), OPV(o, OP_SEQ), p, LANE(o, LN_SLOT, i), count,
                 OPV(o, OP_ELEM), OPV(o, OP_DIGEST), exp_data, exp_next);
    o->cnt[WC_PACKETS_SENT] += 1;
    return HDR + count * itemsize;
}

/* An authenticated job's request: lane i's datagram sealed (its MAC after the payload, in
   sendlen); after every change to its header. Nothing for other jobs. */
static inline void seal_lane(op_t *o, int64_t i)
{
    if (!OPV(o, OP_AUTH))
        return;
    int64_t n = o->sendlen[i] - (o->tx8[lane_row(o, i) + H_FLAGS] & F_AUTH ? DATA_TAG : 0);
    seal_data(LANE(o, LN_MAC_K0, i), LANE(o, LN_MAC_K1, i), o->tx8 + lane_row(o, i), n);
    o->sendlen[i] = n + DATA_TAG;
}

/* Start (or re-send) packet p on its lane (i = p mod E): lane bookkeeping, build, deadline.
   fast: a NACK or RACK re-send (no timeout backoff). Returns the lane; the caller queues it. */
static int64_t send_chunk(op_t *o, int64_t p, int retransmit, int fast, double now)
{
    int64_t i = p % OPV(o, OP_E), set_bit;
    if (retransmit) {
        set_bit = LANE(o, LN_SET, i);
        if (fast)
            LANE(o, LN_FAST, i) = 1;
        else
            LANE(o, LN_TRIES, i) += 1;
        LANE(o, LN_XMITS, i) += 1;
        o->cnt[WC_RETRANSMISSIONS] += 1;
    } else {
        set_bit = o->next_set[i];
        o->next_set[i] = set_bit ^ 1;
        LANE(o, LN_SET, i) = set_bit;
        LANE(o, LN_CHUNK, i) = p;
        LANE(o, LN_TRIES, i) = 0;
        LANE(o, LN_XMITS, i) = 0;
        LANE(o, LN_FAST, i) = 0;
        LANEF(o, LF_SENT_AT, i) = now;
        if (p + OPV(o, OP_E) >= OPV(o, OP_T)) { /* the lane's last chunk: a tail probe candidate */
            if (OPV(o, OP_TAIL_END) == 0) /* the operation's last window: idle probes from */
                o->rtt[R_PROBED_AT] = o->rtt[R_LAST_PROGRESS]; /* the next result on */
            if (OPV(o, OP_TAIL_END) < o->nl) { /* (a chunk is sent fresh once: always) */
                LANE(o, LN_TAIL_ORDER, OPV(o, OP_TAIL_END)) = i;
                OPV(o, OP_TAIL_END) += 1;
            }
        }
    }
    int64_t n = build_request(o, p, i, set_bit, o->rn > 0 && !retransmit);
    o->sendlen[i] = n;
    if (retransmit && OPV(o, OP_TRAILER)) /* a quorum job's round may be complete: answer it */
        o->tx8[lane_row(o, i) + H_FLAGS] |= F_RETRY;
    seal_lane(o, i);
    if (retransmit)
        o->cnt[WC_PAYLOAD_RESENT] += n - HDR;
    else
        o->cnt[WC_PAYLOAD_BYTES] += n - HDR;
    double rto = dmin(o->rtt[R_RTO] * ldexp(1.0, (int)LANE(o, LN_TRIES, i)), o->rtt[R_MAX_RTO]);
    LANEF(o, LF_DEADLINE, i) = now + rto;
    LANEF(o, LF_XMIT_AT, i) = now;
    return i;
}

/* Queue lane i's datagram to send; 0 if the queue is full (nothing queued). */
static inline int queue_lane(op_t *o, int64_t i)
{
    int64_t q = OPV(o, OP_NQ);
    if (q >= o->nsendq)
        return 0;
    o->sendq[q] = i;
    OPV(o, OP_NQ) = q + 1;
    return 1;
}

/* ---- results (stream.py) --------------------------------------------------------------- */

/* RFC 6298: srtt/rttvar smoothing; rto = srtt + 4 rttvar, at least RTO_SRTTS x srtt, clamped. */
static inline void update_rtt(double *rtt, double sample)
{
    if (rtt[R_MIN_RTT] < 0 || sample < rtt[R_MIN_RTT])
        rtt[R_MIN_RTT] = sample;
    if (rtt[R_SRTT] < 0) {
        rtt[R_SRTT] = sample;
        rtt[R_RTTVAR] = sample / 2;
    } else {
        rtt[R_RTTVAR] = 0.75 * rtt[R_RTTVAR] + 0.25 * fabs(rtt[R_SRTT] - sample);
        rtt[R_SRTT] = 0.875 * rtt[R_SRTT] + 0.125 * sample;
    }
    double rto = dmax(rtt[R_SRTT] + 4 * rtt[R_RTTVAR], rtt[R_RTO_SRTTS] * rtt[R_SRTT]);
    rtt[R_RTO] = dmin(dmax(rto, rtt[R_MIN_RTO]), rtt[R_MAX_RTO]);
}

/* The item size of the RESULT of this job at d[o:o+ln], or 0 if it is not one. */
static inline int64_t result_length(const uint8_t *d, int64_t o, int64_t ln, const op_t *op)
{
    if (ln < HDR || rd_u16(d, o + H_MAGIC) != MAGIC || d[o + H_VERSION] != VERSION
        || d[o + H_TYPE] != T_RESULT)
        return 0;
    /* a quorum job's results (OP_TRAILER > 0) end in their contributor bitmap; others never */
    int64_t trailer = OPV(op, OP_TRAILER), flags = d[o + H_FLAGS];
    int64_t auth = OPV(op, OP_AUTH) ? F_AUTH : 0; /* an authenticated job's: always sealed */
    if (d[o + H_SET] > 1 || (flags & ~(int64_t)((trailer ? RESULT_FLAGS : KNOWN_FLAGS) | auth))
        || (trailer && !(flags & F_CONTRIBUTORS)) || (flags & F_AUTH) != auth)
        return 0;
    int64_t elem = d[o + H_ELEM], isz;
    if (elem == E_INT32)
        isz = 4;
    else if (elem == E_INT16)
        isz = 2;
    else
        return 0;
    if (ln != HDR + isz * rd_u16(d, o + H_COUNT) + trailer + (auth ? DATA_TAG : 0))
        return 0;
    if (rd_u32(d, o + H_JOB) != OPV(op, OP_JOB) || rd_i64(d, o + H_TOKEN) != OPV(op, OP_TOKEN))
        return 0;
    return isz;
}

/* Whether d[o:o+ln] is a NACK of the operation in flight, as the switch sends them. */
static inline int is_nack(const uint8_t *d, int64_t o, int64_t ln, const op_t *op)
{
    return ln == HDR && rd_u16(d, o + H_MAGIC) == MAGIC && d[o + H_VERSION] == VERSION
           && d[o + H_TYPE] == T_NACK && d[o + H_FLAGS] == 0 && d[o + H_SET] <= 1
           && rd_u16(d, o + H_COUNT) == 0 && d[o + H_ELEM] <= E_INT16
           && rd_u32(d, o + H_JOB) == OPV(op, OP_JOB) && rd_i64(d, o + H_TOKEN) == OPV(op, OP_TOKEN)
           && rd_u32(d, o + H_SEQ) == OPV(op, OP_SEQ) && OPV(op, OP_PY_NACKS) == 0;
}

/* The chunk to re-send for a NACK of `chunk` on `slot`, or -1 (stream.py's take_nack). */
static int64_t take_nack(op_t *o, int64_t chunk, int64_t slot, double now)
{
    o->rtt[R_LAST_HEARD] = now;
    int64_t i = chunk % OPV(o, OP_E);
    if (chunk >= OPV(o, OP_T) || slot != LANE(o, LN_SLOT, i)) {
        o->cnt[WC_BAD_SLOT] += 1;
        return -1;
    }
    int64_t p = LANE(o, LN_CHUNK, i);
    if (p < 0 || p > chunk
        || (LANE(o, LN_XMITS, i) > 0 && now - LANEF(o, LF_XMIT_AT, i) < o->rtt[R_MIN_RTT])) {
        o->cnt[WC_NACKS_IGNORED] += 1;
        return -1;
    }
    o->cnt[WC_NACK_RESENDS] += 1;
    return p;
}

/* Lane i re-sent p for a NACK of chunk: its first re-send carries RESENT. */
static inline void mark_nack_resend(op_t *o, int64_t i, int64_t p, int64_t chunk)
{
    if (p == chunk && LANE(o, LN_XMITS, i) == 1) {
        o->tx8[lane_row(o, i) + H_FLAGS] |= F_RESENT;
        seal_lane(o, i);
    }
}

/* Whether the result at d[off:] is ahead of this quorum job's rank: of a later operation (up
   to QUORUM_AHEAD), or of this one for a chunk its lane has not reached. A rank that fell
   behind gets the others' results before it needs them, and Python keeps them for then
   (stream.py's _ahead). */
static inline int result_ahead(const uint8_t *d, int64_t off, const op_t *o)
{
    int64_t ahead = (rd_u32(d, off + H_SEQ) - OPV(o, OP_SEQ)) & 0xFFFFFFFFLL;
    if (ahead)
        return ahead <= QUORUM_AHEAD;
    int64_t p = rd_u32(d, off + H_CHUNK), c = LANE(o, LN_CHUNK, p % OPV(o, OP_E));
    return p < OPV(o, OP_T) && c >= 0 && c < p; /* this operation, a chunk the lane awaits */
}

/* The lane whose chunk this result answers, or -1 (stale, repeated or foreign: counted). */
static inline int64_t lane_of(const uint8_t *d, int64_t off, op_t *o)
{
    int64_t p = rd_u32(d, off + H_CHUNK);
    if (rd_u32(d, off + H_SEQ) != OPV(o, OP_SEQ)) {
        o->cnt[WC_STALE_RESULT] += 1;
        return -1;
    }
    int64_t i = p % OPV(o, OP_E);
    if (p >= OPV(o, OP_T) || LANE(o, LN_CHUNK, i) != p) {
        o->cnt[WC_DUPLICATE_RESULT] += 1;
        return -1;
    }
    if (rd_u32(d, off + H_SLOT) != LANE(o, LN_SLOT, i) || (int64_t)d[off + H_SET] != LANE(o, LN_SET, i)) {
        o->cnt[WC_BAD_SLOT] += 1;
        return -1;
    }
    int64_t count = rd_u16(d, off + H_COUNT);
    if (count && (int64_t)d[off + H_ELEM] != OPV(o, OP_ELEM)) {
        o->cnt[WC_BAD_COUNT] += 1;
        return -1;
    }
    return i;
}

/* Dequantize a float result's data (block p - E) into out; take its look-ahead exponent for
   the lane. 0 if its size is wrong. */
static inline int store_float(const uint8_t *d, int64_t off, int64_t isz, int64_t p, int64_t i,
                              op_t *o)
{
    int64_t E = OPV(o, OP_E), k = OPV(o, OP_K);
    int64_t count = rd_u16(d, off + H_COUNT);
    if (p >= E) {
        int64_t lo = (p - E) * k;
        if (count != min64(lo + k, o->on) - lo)
            return 0;
        int64_t exp_data = rd_i16(d, off + H_EXP_DATA);
        int nonfinite = (d[off + H_FLAGS] & F_NONFINITE) != 0;
        int edge = exp_data >= OPV(o, OP_EDGE_EXP);
        dequantize_into(d + off + HDR, isz == 4 ? K_I32 : K_I16, 0, exp_data, OPV(o, OP_P),
                        nonfinite, o->out, o->ok, lo, count, OPV(o, OP_N), edge, o->rtt[R_FMAX]);
    } else if (count) {
        return 0;
    }
    if (p < OPV(o, OP_L))
        LANE(o, LN_EMAX, i) = rd_i16(d, off + H_EXP_NEXT);
    return 1;
}

/* A quorum result's contributor bitmap (the last OP_TRAILER bytes of d[off:off+ln], for
   chunk p): how many ranks the block's sum holds, into contrib; whether this rank is one. */
static inline void note_contributors(op_t *o, const uint8_t *d, int64_t off, int64_t ln,
                                     int64_t p)
{
    int64_t tb = OPV(o, OP_TRAILER), rank = OPV(o, OP_RANK), n = 0;
    const uint8_t *t = d + off + ln - tb;
    for (int64_t b = 0; b < tb; b++)
        n += __builtin_popcount(t[b]);
    if (!((t[rank >> 3] >> (rank & 7)) & 1))
        o->cnt[WC_LEFT_OUT] += 1;
    int64_t blk = OPV(o, OP_IS_FLOAT) ? p - OPV(o, OP_E) : p;
    if (blk >= 0 && o->contrib)
        o->contrib[blk] = n;
}

/* Copy an integer result (block p) into out. 0 if its size is wrong. */
static inline int store_int(const uint8_t *d, int64_t off, int64_t p, op_t *o)
{
    int64_t lo = p * OPV(o, OP_K);
    int64_t count = rd_u16(d, off + H_COUNT);
    if (count != min64(lo + OPV(o, OP_K), o->on) - lo)
        return 0;
    memcpy((int32_t *)o->out + lo, d + off + HDR, (size_t)count * 4);
    return 1;
}

/* The first round trip measured: deadlines set under the initial timeout come down to it. */
static void rearm(op_t *o)
{
    for (int64_t j = 0; j < o->nl; j++) {
        if (LANE(o, LN_CHUNK, j) >= 0) {
            double due = LANEF(o, LF_XMIT_AT, j)
                         + dmin(o->rtt[R_RTO] * ldexp(1.0, (int)LANE(o, LN_TRIES, j)),
                                o->rtt[R_MAX_RTO]);
            if (due < LANEF(o, LF_DEADLINE, j))
                LANEF(o, LF_DEADLINE, j) = due;
        }
    }
}

/* Karn's rule, and which transmission the result answers (RACK). */
static inline void time_round_trip(op_t *o, int64_t i, double now)
{
    double *rtt = o->rtt;
    double delivered = LANEF(o, LF_XMIT_AT, i);
    if (LANE(o, LN_XMITS, i) == 0) {
        int first = rtt[R_SRTT] < 0;
        update_rtt(rtt, now - LANEF(o, LF_SENT_AT, i));
        if (first)
            rearm(o);
    } else if (rtt[R_MIN_RTT] >= 0 && now - delivered < rtt[R_MIN_RTT]) {
        delivered = LANEF(o, LF_SENT_AT, i);
        if (LANE(o, LN_FAST, i)) {
            LANE(o, LN_FAST, i) = 0;
            o->cnt[WC_SPURIOUS] += 1;
            rtt[R_REO_SCALE] = dmin(rtt[R_REO_SCALE] * 2, rtt[R_MAX_REO_SCALE]);
        }
    }
    rtt[R_DELIVERED_XMIT] = delivered;
    rtt[R_LAST_PROGRESS] = now;
    rtt[R_LAST_HEARD] = now;
}

/* Tail-loss probe (RFC 8985 section 7; stream.py's _probe_tail explains). */
static void probe_tail(op_t *o, double now)
{
    int64_t h = OPV(o, OP_TAIL_HEAD), e = OPV(o, OP_TAIL_END);
    double t = o->rtt[R_DELIVERED_XMIT];
    double window = dmax(o->rtt[R_MIN_RTT] / 4, o->rtt[R_MIN_REO_WINDOW]);
    while (h < e) {
        int64_t j = LANE(o, LN_TAIL_ORDER, h);
        if (LANE(o, LN_CHUNK, j) >= 0) {
            double sent = LANEF(o, LF_XMIT_AT, j);
            if (sent >= t || now - sent < o->rtt[R_MIN_RTT])
                break;
            if (now + window < LANEF(o, LF_DEADLINE, j)) {
                LANEF(o, LF_DEADLINE, j) = now + window;
                o->cnt[WC_TAIL_PROBES] += 1;
            }
        }
        h += 1;
    }
    OPV(o, OP_TAIL_HEAD) = h;
}

/* Take the RESULTs of a batch from datagram `start` on (stream.py's worker_results). */
static int64_t worker_results(op_t *o, const uint8_t *d, int64_t dn, const int64_t *starts,
                              const int64_t *lens, int64_t nseg, int64_t start, int64_t limit,
                              double now, int64_t *code)
{
    int64_t taken = 0, i = start;
    while (i < nseg) {
        if (OPV(o, OP_NQ) >= o->nsendq) {
            *code = WS_FULL;
            return i;
        }
        int64_t off = starts[i], ln = lens[i];
        if (off < 0 || ln < 0 || ln > dn - off) { /* not within the batch: Python's check */
            *code = WS_OTHER;
            return i;
        }
        int64_t isz = result_length(d, off, ln, o);
        if (isz == 0) {
            if (!is_nack(d, off, ln, o)) {
                *code = WS_OTHER;
                return i;
            }
            i += 1; /* a NACK of this operation: answered here */
            int64_t chunk = rd_u32(d, off + H_CHUNK);
            int64_t p = take_nack(o, chunk, rd_u32(d, off + H_SLOT), now);
            if (p >= 0) {
                int64_t li = send_chunk(o, p, 1, 1, now);
                mark_nack_resend(o, li, p, chunk);
                queue_lane(o, li);
            }
            continue;
        }
        if (OPV(o, OP_TRAILER) && result_ahead(d, off, o)) { /* Python keeps it for later */
            *code = WS_OTHER;
            return i;
        }
        i += 1;
        if (OPV(o, OP_AUTH)) { /* under the key of the shard the chunk's lane talks to */
            int64_t li = rd_u32(d, off + H_CHUNK) % OPV(o, OP_E);
            if (!data_sealed(LANE(o, LN_MAC_K0, li), LANE(o, LN_MAC_K1, li), d + off, ln)) {
                o->cnt[WC_BAD_MAC] += 1; /* forged or damaged: dropped before it is read */
                continue;
            }
        }
        int64_t li = lane_of(d, off, o);
        if (li < 0)
            continue;
        int64_t p = LANE(o, LN_CHUNK, li);
        int stored = OPV(o, OP_IS_FLOAT) ? store_float(d, off, isz, p, li, o)
                                         : store_int(d, off, p, o);
        if (!stored) {
            o->cnt[WC_BAD_COUNT] += 1;
            continue;
        }
        if (OPV(o, OP_TRAILER))
            note_contributors(o, d, off, ln, p);
        o->cnt[WC_RESULTS] += 1;
        time_round_trip(o, li, now);
        if (OPV(o, OP_TAIL_END) > OPV(o, OP_TAIL_HEAD))
            probe_tail(o, now);
        OPV(o, OP_DONE) += 1;
        int64_t nxt = p + OPV(o, OP_E);
        if (nxt < OPV(o, OP_T)) {
            send_chunk(o, nxt, 0, 0, now);
            queue_lane(o, li);
        } else {
            LANE(o, LN_CHUNK, li) = -1;
        }
        if (OPV(o, OP_DONE) == OPV(o, OP_T)) {
            *code = WS_OP_COMPLETE;
            return i;
        }
        taken += 1;
        if (taken >= limit) {
            *code = WS_ONE;
            return i;
        }
    }
    *code = WS_DONE;
    return i;
}

/* The first i in start..count-1 whose sender is none of allowed[:nallowed], or count. */
static int64_t first_foreign(const int64_t *senders, int64_t start, int64_t count,
                             const int64_t *allowed, int64_t nallowed)
{
    int64_t i;
    for (i = start; i < count; i++) {
        int ok = 0;
        for (int64_t j = 0; j < nallowed; j++)
            if (allowed[j] == senders[i]) {
                ok = 1;
                break;
            }
        if (!ok)
            break;
    }
    return i < count ? i : count;
}

/* Cut the queued lanes sendq[:nq] into UDP GSO runs (stream.py's plan_runs); runs[r] =
   (first, count, size, contiguous, shard). */
static int64_t plan_runs(const int64_t *sendq, int64_t nq, const int64_t *sendlen, int64_t stride,
                         int64_t shards, int64_t max_segments, int64_t max_bytes, int64_t *order,
                         int64_t *runs)
{
    int64_t no = 0, nr = 0;
#define EMIT_RUN()                                                                            \
    do {                                                                                      \
        runs[nr * 5 + 0] = r_first;                                                           \
        runs[nr * 5 + 1] = r_count;                                                           \
        runs[nr * 5 + 2] = r_size;                                                            \
        runs[nr * 5 + 3] = r_contig;                                                          \
        runs[nr * 5 + 4] = s;                                                                 \
        nr += 1;                                                                              \
    } while (0)
    for (int64_t s = 0; s < shards; s++) {
        int64_t r_first = -1, r_count = 0, r_size = 0, r_contig = 0, prev = -1;
        for (int64_t q = 0; q < nq; q++) {
            int64_t i = sendq[q];
            if (i % shards != s)
                continue;
            int64_t ln = sendlen[i];
            if (r_count > 0) {
                int fits = r_count < max_segments && (r_count + 1) * r_size <= max_bytes
                           && ln <= r_size;
                if (fits) {
                    if (i != prev + 1)
                        r_contig = 0;
                    order[no++] = q;
                    r_count += 1;
                    prev = i;
                    if (ln < r_size) { /* a short segment ends the run */
                        EMIT_RUN();
                        r_count = 0;
                    }
                    continue;
                }
                EMIT_RUN();
                r_count = 0;
            }
            r_first = no;
            order[no++] = q;
            r_count = 1;
            r_size = ln;
            r_contig = shards == 1 && ln == stride;
            prev = i;
        }
        if (r_count > 0)
            EMIT_RUN();
    }
#undef EMIT_RUN
    return nr;
}

/* ---- timers (timers.py) ---------------------------------------------------------------- */

static double probe_time(const double *rtt)
{
    double srtt = rtt[R_SRTT];
    if (srtt < 0)
        return INFINITY;
    double pto = dmax(2.0 * srtt, rtt[R_MIN_REO_WINDOW]);
    if (rtt[R_LAST_PROGRESS] > rtt[R_PROBED_AT])
        return rtt[R_LAST_PROGRESS] + pto;
    return rtt[R_PROBED_AT] + pto * pow(2.0, rtt[R_PROBES]);
}

static double next_deadline(const op_t *o)
{
    double best = INFINITY;
    for (int64_t i = 0; i < o->nl; i++)
        if (LANE(o, LN_CHUNK, i) >= 0 && LANEF(o, LF_DEADLINE, i) < best)
            best = LANEF(o, LF_DEADLINE, i);
    if (best < INFINITY)
        best = dmin(best, probe_time(o->rtt));
    return best;
}

/* Re-send what is due at now and queue it (timers.py's fire_timers); 0, having done
   nothing, when the send queue lacks room for every busy lane. */
static int fire_timers(op_t *o, double now)
{
    int64_t busy = 0;
    for (int64_t i = 0; i < o->nl; i++)
        if (LANE(o, LN_CHUNK, i) >= 0)
            busy += 1;
    if (OPV(o, OP_NQ) > 0 && OPV(o, OP_NQ) + busy > o->nsendq)
        return 0;
    for (int64_t i = 0; i < o->nl; i++) {
        if (LANE(o, LN_CHUNK, i) >= 0 && LANEF(o, LF_DEADLINE, i) <= now) {
            o->cnt[WC_TIMER_RESENDS] += 1;
            send_chunk(o, LANE(o, LN_CHUNK, i), 1, 0, now);
            queue_lane(o, i);
        }
    }
    if (now < probe_time(o->rtt))
        return 1;
    double *rtt = o->rtt;
    if (rtt[R_LAST_PROGRESS] > rtt[R_PROBED_AT])
        rtt[R_PROBES] = 0;
    rtt[R_PROBED_AT] = now;
    rtt[R_PROBES] += 1;
    int64_t n = 0;
    for (int k = 0; k < PROBE_LANES; k++) { /* the busy lanes transmitted longest ago */
        int64_t best = -1;
        for (int64_t i = 0; i < o->nl; i++) {
            if (LANE(o, LN_CHUNK, i) < 0)
                continue;
            int taken = 0;
            for (int64_t m = 0; m < n; m++)
                taken = taken || o->picked[m] == i;
            if (!taken && (best < 0 || LANEF(o, LF_XMIT_AT, i) < LANEF(o, LF_XMIT_AT, best)))
                best = i;
        }
        if (best < 0)
            break;
        o->picked[n++] = best;
    }
    for (int64_t m = 0; m < n; m++) {
        int64_t i = o->picked[m];
        if (now - LANEF(o, LF_XMIT_AT, i) >= rtt[R_SRTT]) {
            o->cnt[WC_IDLE_PROBES] += 1;
            send_chunk(o, LANE(o, LN_CHUNK, i), 1, 1, now);
            queue_lane(o, i);
        }
    }
    return 1;
}

/* ---- the compiled loop (transport/fastpath.py) ---------------------------------------- */


typedef struct {
    int fd;
    int64_t stride, max_segments, max_bytes;
    int64_t *order, *runs, *stats;
    /* The switch's addresses: one (a connected socket: dests NULL), or a sharded switch's S
       shards, lane i's requests to shard i mod S (dests: S sockaddr_in rows of 16 bytes) and
       datagrams taken only from their sender numbers (allowed: S of them, split_mmsg's). */
    int64_t shards;
    const uint8_t *dests;
    const int64_t *allowed;
    struct iovec iov[MAX_IOV];
} sender_t;

/* Send the queued lanes as GSO runs, one switch's or each to its shard; 0 (and the unsent
   lanes left queued, in the order planned) at the first failed sendmsg. */
static int send_queued(op_t *o, sender_t *s)
{
    int64_t nq = OPV(o, OP_NQ);
    if (nq == 0)
        return 1;
    int64_t nr = plan_runs(o->sendq, nq, o->sendlen, s->stride, s->shards, s->max_segments,
                           s->max_bytes, s->order, s->runs);
    for (int64_t r = 0; r < nr; r++) {
        int64_t first = s->runs[r * 5], count = s->runs[r * 5 + 1];
        int64_t size = s->runs[r * 5 + 2], contiguous = s->runs[r * 5 + 3];
        size_t niov;
        if (contiguous) {
            int64_t lane0 = o->sendq[s->order[first]];
            int64_t last = o->sendq[s->order[first + count - 1]];
            s->iov[0].iov_base = o->tx8 + lane0 * s->stride;
            s->iov[0].iov_len = (size_t)((count - 1) * s->stride + o->sendlen[last]);
            niov = 1;
        } else {
            for (int64_t j = 0; j < count; j++) {
                int64_t ln = o->sendq[s->order[first + j]];
                s->iov[j].iov_base = o->tx8 + ln * s->stride;
                s->iov[j].iov_len = (size_t)o->sendlen[ln];
            }
            niov = (size_t)count;
        }
        const void *dest = s->dests ? s->dests + 16 * s->runs[r * 5 + 4] : NULL;
        if (send_run(s->fd, dest, s->iov, niov, count, size) < 0) {
            s->stats[ST_ERRNO] = errno;
            /* Keep what is unsent, in the order planned, for Python to send: the lanes first
               (order[q] names a queue entry, which with several shards may lie before q and
               be overwritten by the copy below), then back into the queue. */
            for (int64_t q = first; q < nq; q++)
                s->order[q] = o->sendq[s->order[q]];
            int64_t keep = 0;
            for (int64_t q = first; q < nq; q++)
                o->sendq[keep++] = s->order[q];
            OPV(o, OP_NQ) = keep;
            return 0;
        }
        s->stats[ST_SEND_CALLS] += 1;
        s->stats[ST_DATAGRAMS_SENT] += count;
    }
    OPV(o, OP_NQ) = 0;
    return 1;
}

#define FIRED (-2)
#define NOTHING_DUE (-1)
#define MAX_WAIT_S 1.0

/* What the timers ask at now: NOTHING_DUE; FP_DUE (the operation timed out); or the
   re-sends they call for, sent: FIRED, or FP_SEND_FAILED. */
static int pump_timers(op_t *o, sender_t *s, double now, double op_timeout_s)
{
    if (now >= o->rtt[R_LAST_PROGRESS] + op_timeout_s)
        return FP_DUE;
    if (now < next_deadline(o))
        return NOTHING_DUE;
    if (!fire_timers(o, now)) {
        if (!send_queued(o, s))
            return FP_SEND_FAILED;
        fire_timers(o, now);
    }
    if (!send_queued(o, s))
        return FP_SEND_FAILED;
    return FIRED;
}

/* Receive, take results and send, fire the timers, and wait in poll (on the socket and the
   inbox's wake_fd) until something needs Python (FP_*): fastpath.py's pump. */
static int pump(op_t *o, sender_t *s, receiver_t *rx, double op_timeout_s, int64_t *at,
                int64_t *nseg_out, int64_t *code_out)
{
    double idle_since = now_s();
    *at = *nseg_out = *code_out = 0;
    while (1) {
        int n = recvmmsg(rx->fd, rx->msgs, (unsigned)rx->count, MSG_DONTWAIT, NULL);
        if (n <= 0) {
            if (n < 0 && errno != EAGAIN) {
                s->stats[ST_ERRNO] = errno;
                return FP_RECV_FAILED;
            }
            double now = now_s();
            int t = pump_timers(o, s, now, op_timeout_s);
            if (t != NOTHING_DUE) {
                if (t == FIRED)
                    continue;
                return t;
            }
            double due = dmin(next_deadline(o), o->rtt[R_LAST_PROGRESS] + op_timeout_s);
            if (now - idle_since >= MAX_WAIT_S)
                return FP_WAKE;
            struct pollfd pfd[2] = {{rx->fd, POLLIN, 0}, {rx->wake_fd, POLLIN, 0}};
            int wait_ms = (int)((dmin(due, idle_since + MAX_WAIT_S) - now) * 1e3) + 1;
            int r = poll(pfd, 2, wait_ms);
            if (r < 0) {
                s->stats[ST_ERRNO] = errno;
                return FP_RECV_FAILED; /* (EINTR: Python's turn) */
            }
            if (pfd[1].revents & POLLIN)
                return FP_WAKE;
            continue;
        }
        s->stats[ST_RECV_CALLS] += 1;
        int64_t nseg = split_mmsg(rx, n);
        double now = now_s();
        idle_since = now;
        int64_t mine = nseg; /* an unconnected socket: up to the first datagram of a stranger */
        if (s->dests)
            mine = first_foreign(rx->senders, 0, nseg, s->allowed, s->shards);
        int64_t code;
        int64_t i = worker_results(o, rx->buf, rx->buf_n, rx->starts, rx->lens, mine, 0,
                                   nseg + 1, now, &code);
        if (code == WS_DONE && mine < nseg)
            code = WS_OTHER; /* Python's receive_many drops and counts it, and goes on */
        if (!send_queued(o, s)) {
            if (code != WS_DONE) {
                *at = i, *nseg_out = nseg, *code_out = code;
                return FP_STOPPED;
            }
            return FP_SEND_FAILED;
        }
        if (code != WS_DONE) {
            *at = i, *nseg_out = nseg, *code_out = code;
            return FP_STOPPED;
        }
        int t = pump_timers(o, s, now, op_timeout_s);
        if (t >= 0)
            return t;
    }
}

/* The operation's arrays, in the order of the Python kernels' arguments, from args[at]:
   opv, lane, lanef, rtt, next_set, exps, nonf, x, xbits, [out,] res, tx8, tx16, tx32, cnt,
   [sendq,] sendlen (with_out: out after xbits; with_q: sendq before sendlen). */
static int get_op(bufs_t *b, PyObject *const *args, int at, int with_out, int with_q, op_t *o)
{
    Py_buffer *v;
    memset(o, 0, sizeof *o);
#define GET(name, kinds, w) if (!(v = getbuf(b, args[at++], name, kinds, w))) return -1
    GET("opv", B(K_I64), 1); o->opv = v->buf;
    if (v->len / 8 < O_FIELDS) { PyErr_SetString(PyExc_ValueError, "opv is too short"); return -1; }
    GET("lane", B(K_I64), 1); o->lane = v->buf;
    if (v->ndim != 2 || v->shape[0] != LN_FIELDS) {
        PyErr_SetString(PyExc_ValueError, "lane must be an int64 array of (LN_FIELDS, lanes)");
        return -1;
    }
    o->nl = v->shape[1];
    GET("lanef", B(K_F64), 1); o->lanef = v->buf;
    if (v->ndim != 2 || v->shape[0] != LNF_FIELDS || v->shape[1] != o->nl) {
        PyErr_SetString(PyExc_ValueError, "lanef must be a float64 array of (LNF_FIELDS, lanes)");
        return -1;
    }
    GET("rtt", B(K_F64), 1); o->rtt = v->buf;
    if (v->len / 8 < R_FIELDS) { PyErr_SetString(PyExc_ValueError, "rtt is too short"); return -1; }
    GET("next_set", B(K_I64), 1); o->next_set = v->buf;
    if (v->len / 8 < o->nl) { PyErr_SetString(PyExc_ValueError, "next_set is shorter than the lanes"); return -1; }
    GET("exps", B(K_I64), 1); o->exps = v->buf;
    int64_t nexps = v->len / 8;
    GET("nonf", B(K_U8), 1); o->nonf = v->buf;
    if (v->len < nexps) { PyErr_SetString(PyExc_ValueError, "nonf is shorter than exps"); return -1; }
    GET("x", FLOATS | B(K_I32), 0); o->x = v->buf; o->xk = kind_of(v);
    o->xn = v->len / v->itemsize;
    o->xisz = v->itemsize;
    GET("xbits", B(K_I32) | B(K_I64) | B(K_BF16) | FLOATS, 0);
    if (with_out) {
        GET("out", FLOATS | B(K_I32), 1); o->out = v->buf; o->ok = kind_of(v);
        o->on = v->len / v->itemsize;
    }
    GET("res", B(K_F32) | B(K_F64), 1); o->res = v->buf; o->rk = kind_of(v);
    o->rn = v->len / v->itemsize;
    GET("tx8", B(K_U8), 1); o->tx8 = v->buf;
    int64_t ntx = v->len;
    GET("tx16", B(K_I16), 1);
    GET("tx32", B(K_I32), 1);
    GET("cnt", B(K_I64), 1); o->cnt = v->buf;
    if (v->len / 8 < WC_N) { PyErr_SetString(PyExc_ValueError, "cnt is too short"); return -1; }
    if (with_q) {
        GET("sendq", B(K_I64), 1); o->sendq = v->buf; o->nsendq = v->len / 8;
    }
    GET("sendlen", B(K_I64), 1); o->sendlen = v->buf;
    if (v->len / 8 < o->nl) { PyErr_SetString(PyExc_ValueError, "sendlen is shorter than the lanes"); return -1; }
#undef GET
    /* What the kernels index must lie within the arrays: the lanes' rows, the blocks. */
    int64_t k = o->opv[OP_K], isz = o->opv[OP_ITEMSIZE], E = o->opv[OP_E];
    int64_t L = o->opv[OP_L];
    if (E < 1 || E > o->nl || k < 1 || (isz != 2 && isz != 4) || ntx < o->nl * row_bytes(o->opv)
        || (o->opv[OP_IS_FLOAT] && (nexps < L || o->xk == K_I32 || (with_out && o->ok == K_I32)))
        || (!o->opv[OP_IS_FLOAT] && (o->xk != K_I32 || isz != 4 || (with_out && o->ok != K_I32)))
        || L * k < o->xn || (L > 0 && (L - 1) * k >= o->xn)
        || (with_out && o->on != o->xn) || (o->rn != 0 && o->rn != o->xn)
        || o->opv[OP_T] != (o->opv[OP_IS_FLOAT] ? L + E : L)
        || o->opv[OP_ELEM] != (isz == 4 ? E_INT32 : E_INT16)
        || o->opv[OP_TAIL_HEAD] < 0 || o->opv[OP_TAIL_END] < o->opv[OP_TAIL_HEAD]
        || o->opv[OP_TAIL_END] > o->nl || o->opv[OP_NQ] < 0
        || (with_q && o->opv[OP_NQ] > o->nsendq)) {
        PyErr_SetString(PyExc_ValueError, "switchml._worker: the operation's arrays and its "
                        "scalars (opv) disagree (lanes, block size, element types or sizes)");
        return -1;
    }
    return 0;
}

/* ---- the operation's state, handed over once ------------------------------------------- */

/* OpState: one operation's arrays, checked against each other and held (buffer views) for
   the operation's life, so that every kernel call takes the state and a few scalars. Built
   by WorkerEndpoint when the operation starts. */
typedef struct {
    PyObject_HEAD
    bufs_t b;
    op_t o;
    int64_t stride, nruns;
    int64_t *order, *runs;
    int ready;
} OpStateObject;

static PyTypeObject OpStateType;

static void opstate_dealloc(OpStateObject *self)
{
    release(&self->b);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* OpState(opv, lane, lanef, rtt, next_set, exps, nonf, x, xbits, out, res, tx8, tx16, tx32,
           cnt, sendq, sendlen, picked, order, runs, stride, keep, contrib) */
static PyObject *opstate_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (kwds && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "OpState takes its arrays by position");
        return NULL;
    }
    if (PyTuple_GET_SIZE(args) != 23) {
        PyErr_Format(PyExc_TypeError, "OpState takes 23 arguments (%zd given)",
                     PyTuple_GET_SIZE(args));
        return NULL;
    }
    OpStateObject *self = (OpStateObject *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    PyObject *const *a = &PyTuple_GET_ITEM(args, 0);
    Py_buffer *v;
    if (get_op(&self->b, a, 0, 1, 1, &self->o) < 0)
        goto fail;
    if (!(v = getbuf(&self->b, a[17], "picked", B(K_I64), 1)))
        goto fail;
    if (v->len / 8 < PROBE_LANES) {
        PyErr_SetString(PyExc_ValueError, "picked must hold PROBE_LANES int64");
        goto fail;
    }
    self->o.picked = v->buf;
    if (!(v = getbuf(&self->b, a[18], "order", B(K_I64), 1)))
        goto fail;
    self->order = v->buf;
    if (v->len / 8 < self->o.nsendq)
        goto short_queue;
    if (!(v = getbuf(&self->b, a[19], "runs", B(K_I64), 1)))
        goto fail;
    if (v->ndim != 2 || v->shape[1] != 5 || v->shape[0] < self->o.nsendq)
        goto short_queue;
    self->runs = v->buf;
    if (arg_i64(a[20], &self->stride) < 0)
        goto fail;
    if (self->stride != row_bytes(self->o.opv)) {
        PyErr_SetString(PyExc_ValueError, "OpState: stride is not the operation's datagram size");
        goto fail;
    }
    if (a[21] != Py_None) { /* keep: x's kind and size, writable, apart from x and out */
        if (!(v = getbuf(&self->b, a[21], "keep", FLOATS | B(K_I32), 1)))
            goto fail;
        const uint8_t *k0 = v->buf, *x0 = self->o.x, *u0 = self->o.out;
        int64_t nb = self->o.xn * self->o.xisz;
        if (kind_of(v) != self->o.xk || v->len != nb
            || (k0 < x0 + nb && x0 < k0 + nb) || (k0 < u0 + nb && u0 < k0 + nb)) {
            PyErr_SetString(PyExc_ValueError, "OpState: keep must be an array of x's type and "
                            "size that shares no memory with x or out");
            goto fail;
        }
        self->o.keep = v->buf;
    }
    if (a[22] != Py_None) { /* contrib: a quorum operation's contributors per block */
        if (!(v = getbuf(&self->b, a[22], "contrib", B(K_I64), 1)))
            goto fail;
        if (v->len / 8 < self->o.opv[OP_L]) {
            PyErr_SetString(PyExc_ValueError, "OpState: contrib must hold an int64 per block");
            goto fail;
        }
        self->o.contrib = v->buf;
    }
    if (self->o.opv[OP_TRAILER] < 0 || self->o.opv[OP_TRAILER] > 8192
        || (self->o.opv[OP_TRAILER] > 0 && self->o.opv[OP_TRAILER] * 8 <= self->o.opv[OP_RANK])) {
        PyErr_SetString(PyExc_ValueError, "OpState: a contributor bitmap of 0..8192 bytes");
        goto fail;
    }
    self->ready = 1;
    return (PyObject *)self;
short_queue:
    PyErr_SetString(PyExc_ValueError, "OpState: order and runs (rows of 5) must hold the send "
                    "queue");
fail:
    Py_DECREF(self);
    return NULL;
}

static PyTypeObject OpStateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "switchml._worker.OpState",
    .tp_basicsize = sizeof(OpStateObject),
    .tp_dealloc = (destructor)opstate_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One operation's arrays, checked and held for the kernels (built once per "
              "operation: OpState(opv, lane, lanef, rtt, next_set, exps, nonf, x, xbits, out, "
              "res, tx8, tx16, tx32, cnt, sendq, sendlen, picked, order, runs, stride, keep, "
              "contrib))",
    .tp_new = opstate_new,
};

static op_t *state_of(PyObject *obj)
{
    if (!PyObject_TypeCheck(obj, &OpStateType) || !((OpStateObject *)obj)->ready) {
        PyErr_SetString(PyExc_TypeError, "the first argument must be an OpState");
        return NULL;
    }
    return &((OpStateObject *)obj)->o;
}

/* worker_results(state, d, starts, lens, nseg, start, limit, now) -> (next, code) */
static PyObject *py_worker_results(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NEED(8);
    bufs_t b = {.n = 0};
    op_t *o;
    Py_buffer *d, *st, *ln;
    int64_t nseg, start, limit, code, i;
    double now;
    if (!(o = state_of(args[0]))) return NULL;
    ARR(d, 1, "d", B(K_U8), 0);
    ARR(st, 2, "starts", B(K_I64), 0);
    ARR(ln, 3, "lens", B(K_I64), 0);
    I64(nseg, 4); I64(start, 5); I64(limit, 6); F64(now, 7);
    if (nseg > st->len / 8 || nseg > ln->len / 8 || start < 0) {
        PyErr_SetString(PyExc_ValueError, "nseg exceeds starts/lens");
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    i = worker_results(o, d->buf, d->len, st->buf, ln->buf, nseg, start, limit, now, &code);
    Py_END_ALLOW_THREADS
    release(&b);
    return Py_BuildValue("(LL)", (long long)i, (long long)code);
fail:
    release(&b);
    return NULL;
}

/* send_first(state, count, now): start and queue packets 0 .. count-1 */
static PyObject *py_send_first(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NEED(3);
    op_t *o;
    int64_t count;
    double now;
    if (!(o = state_of(args[0]))) return NULL;
    if (arg_i64(args[1], &count) < 0 || arg_f64(args[2], &now) < 0) return NULL;
    if (count < 0 || count > o->nl || count > o->nsendq - OPV(o, OP_NQ)
        || count > OPV(o, OP_T)) {
        PyErr_SetString(PyExc_ValueError, "send_first: more packets than lanes or queue room");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    for (int64_t p = 0; p < count; p++) {
        send_chunk(o, p, 0, 0, now);
        queue_lane(o, p);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* send_chunk(state, p, retransmit, fast, now) -> lane */
static PyObject *py_send_chunk(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NEED(5);
    op_t *o;
    int64_t p;
    int retransmit, fast;
    double now;
    if (!(o = state_of(args[0]))) return NULL;
    if (arg_i64(args[1], &p) < 0 || (retransmit = PyObject_IsTrue(args[2])) < 0
        || (fast = PyObject_IsTrue(args[3])) < 0 || arg_f64(args[4], &now) < 0)
        return NULL;
    if (p < 0 || p >= OPV(o, OP_T)) {
        PyErr_Format(PyExc_ValueError, "send_chunk: packet %lld is not one of this operation's",
                     (long long)p);
        return NULL;
    }
    return PyLong_FromLongLong(send_chunk(o, p, retransmit, fast, now));
}

/* take_nack(state, chunk, slot, now) -> the chunk to re-send, or -1 */
static PyObject *py_take_nack(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NEED(4);
    op_t *o;
    int64_t chunk, slot;
    double now;
    if (!(o = state_of(args[0]))) return NULL;
    if (arg_i64(args[1], &chunk) < 0 || arg_i64(args[2], &slot) < 0
        || arg_f64(args[3], &now) < 0)
        return NULL;
    if (chunk < 0) {
        PyErr_SetString(PyExc_ValueError, "take_nack: a negative chunk");
        return NULL;
    }
    return PyLong_FromLongLong(take_nack(o, chunk, slot, now));
}

/* mark_nack_resend(state, i, p, chunk) */
static PyObject *py_mark_nack_resend(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NEED(4);
    op_t *o;
    int64_t i, p, chunk;
    if (!(o = state_of(args[0]))) return NULL;
    if (arg_i64(args[1], &i) < 0 || arg_i64(args[2], &p) < 0 || arg_i64(args[3], &chunk) < 0)
        return NULL;
    if (i < 0 || i >= o->nl) {
        PyErr_SetString(PyExc_ValueError, "mark_nack_resend: no such lane");
        return NULL;
    }
    mark_nack_resend(o, i, p, chunk);
    Py_RETURN_NONE;
}

/* fire_timers(state, now) -> bool */
static PyObject *py_fire_timers(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NEED(2);
    op_t *o;
    double now;
    int r;
    if (!(o = state_of(args[0]))) return NULL;
    if (arg_f64(args[1], &now) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    r = fire_timers(o, now);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(r);
}

/* next_deadline(state) -> float */
static PyObject *py_next_deadline(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NEED(1);
    op_t *o;
    if (!(o = state_of(args[0]))) return NULL;
    return PyFloat_FromDouble(next_deadline(o));
}

static PyObject *py_probe_time(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NEED(1);
    bufs_t b = {.n = 0};
    Py_buffer *v;
    double t;
    ARR(v, 0, "rtt", B(K_F64), 0);
    if (v->len / 8 < R_FIELDS) {
        PyErr_SetString(PyExc_ValueError, "rtt is too short");
        goto fail;
    }
    t = probe_time(v->buf);
    release(&b);
    return PyFloat_FromDouble(t);
fail:
    release(&b);
    return NULL;
}

/* plan_runs(sendq, nq, sendlen, stride, shards, max_segments, max_bytes, order, runs) */
static PyObject *py_plan_runs(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NEED(9);
    bufs_t b = {.n = 0};
    Py_buffer *sq, *sl, *ord, *rn;
    int64_t nq, stride, shards, max_segments, max_bytes, nr;
    ARR(sq, 0, "sendq", B(K_I64), 0);
    I64(nq, 1);
    ARR(sl, 2, "sendlen", B(K_I64), 0);
    I64(stride, 3); I64(shards, 4); I64(max_segments, 5); I64(max_bytes, 6);
    ARR(ord, 7, "order", B(K_I64), 1);
    ARR(rn, 8, "runs", B(K_I64), 1);
    if (nq < 0 || nq > sq->len / 8 || nq > ord->len / 8 || nq > rn->len / 40 || shards < 1) {
        PyErr_SetString(PyExc_ValueError, "plan_runs: nq exceeds sendq, order or runs");
        goto fail;
    }
    for (int64_t q = 0; q < nq; q++) {
        int64_t i = ((int64_t *)sq->buf)[q];
        if (i < 0 || i >= sl->len / 8) {
            PyErr_SetString(PyExc_ValueError, "plan_runs: a queued lane outside sendlen");
            goto fail;
        }
    }
    nr = plan_runs(sq->buf, nq, sl->buf, stride, shards, max_segments, max_bytes, ord->buf,
                   rn->buf);
    release(&b);
    return PyLong_FromLongLong(nr);
fail:
    release(&b);
    return NULL;
}

/* ---- the numerics over whole arrays (quantize.py's public face) ------------------------ */

/* block_exponents(x, k, exps, nonfinite) */
static PyObject *py_block_exponents(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NEED(4);
    bufs_t b = {.n = 0};
    Py_buffer *x, *e, *nf;
    int64_t k;
    ARR(x, 0, "x", FLOATS, 0);
    I64(k, 1);
    ARR(e, 2, "exps", B(K_I64), 1);
    ARR(nf, 3, "nonfinite", B(K_U8), 1);
    {
        int64_t n = x->len / x->itemsize, nb = e->len / 8;
        if (k < 1 || nf->len < nb || nb * k < n || (nb > 0 && (nb - 1) * k >= n)) {
            PyErr_SetString(PyExc_ValueError, "block_exponents: exps/nonfinite do not match "
                            "x's blocks of k elements");
            goto fail;
        }
        int xk = kind_of(x);
        for (int64_t blk = 0; blk < nb; blk++)
            exponent_of_bits(x->buf, xk, blk * k, min64(blk * k + k, n), blk, e->buf, nf->buf);
    }
    release(&b);
    Py_RETURN_NONE;
fail:
    release(&b);
    return NULL;
}

/* quantize_block(x, emax, n_bits, nonfinite, out) */
static PyObject *py_quantize_block(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NEED(5);
    bufs_t b = {.n = 0};
    Py_buffer *x, *q;
    int64_t emax, n_bits;
    int nonfinite;
    ARR(x, 0, "x", FLOATS, 0);
    I64(emax, 1); I64(n_bits, 2); BOOL(nonfinite, 3);
    ARR(q, 4, "out", B(K_I32) | B(K_I16), 1);
    if (q->len / q->itemsize != x->len / x->itemsize) {
        PyErr_SetString(PyExc_ValueError, "quantize_block: out's size differs from x's");
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    quantize_into(x->buf, kind_of(x), 0, x->len / x->itemsize, emax, n_bits, nonfinite, q->buf,
                  kind_of(q), 0);
    Py_END_ALLOW_THREADS
    release(&b);
    Py_RETURN_NONE;
fail:
    release(&b);
    return NULL;
}

/* dequantize_block(q, emax, n_bits, nonfinite, out, num_workers, edge, fmax) */
static PyObject *py_dequantize_block(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NEED(8);
    bufs_t b = {.n = 0};
    Py_buffer *q, *out;
    int64_t emax, n_bits, num_workers;
    int nonfinite, edge;
    double fmax;
    ARR(q, 0, "q", B(K_I32) | B(K_I16), 0);
    I64(emax, 1); I64(n_bits, 2); BOOL(nonfinite, 3);
    ARR(out, 4, "out", FLOATS, 1);
    I64(num_workers, 5); BOOL(edge, 6); F64(fmax, 7);
    if (q->len / q->itemsize < out->len / out->itemsize) {
        PyErr_SetString(PyExc_ValueError, "dequantize_block: q is shorter than out");
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    dequantize_into(q->buf, kind_of(q), 0, emax, n_bits, nonfinite, out->buf, kind_of(out), 0,
                    out->len / out->itemsize, num_workers, edge, fmax);
    Py_END_ALLOW_THREADS
    release(&b);
    Py_RETURN_NONE;
fail:
    release(&b);
    return NULL;
}

/* residual_block(x, q, emax, n_bits, r) */
static PyObject *py_residual_block(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NEED(5);
    bufs_t b = {.n = 0};
    Py_buffer *x, *q, *r;
    int64_t emax, n_bits;
    ARR(x, 0, "x", FLOATS, 0);
    ARR(q, 1, "q", B(K_I32) | B(K_I16), 0);
    I64(emax, 2); I64(n_bits, 3);
    ARR(r, 4, "r", B(K_F32) | B(K_F64), 1);
    {
        int64_t n = x->len / x->itemsize;
        if (q->len / q->itemsize < n || r->len / r->itemsize < n) {
            PyErr_SetString(PyExc_ValueError, "residual_block: q or r is shorter than x");
            goto fail;
        }
        Py_BEGIN_ALLOW_THREADS
        residual_into(x->buf, kind_of(x), 0, n, q->buf, kind_of(q), 0, emax, n_bits, r->buf,
                      kind_of(r));
        Py_END_ALLOW_THREADS
    }
    release(&b);
    Py_RETURN_NONE;
fail:
    release(&b);
    return NULL;
}

/* ---- receive batches (frames.py's, for the Python receive path) ------------------------ */

/* split_mmsg(msgs, msg_len_at, controllen_at, names, control, n, slot_bytes, gro, sol_udp,
              udp_gro, out_starts, out_lens, out_senders) -> datagrams */
static PyObject *py_split_mmsg(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NEED(13);
    bufs_t b = {.n = 0};
    receiver_t rx;
    Py_buffer *v;
    int64_t n, m;
    memset(&rx, 0, sizeof rx);
    ARR(v, 0, "msgs", B(K_U8), 1); rx.raw = v->buf;
    if (v->ndim != 2) { PyErr_SetString(PyExc_ValueError, "msgs must be 2-D bytes"); goto fail; }
    rx.raw_rows = v->shape[0]; rx.raw_cols = v->shape[1];
    I64(rx.msg_len_at, 1); I64(rx.controllen_at, 2);
    ARR(v, 3, "names", B(K_U8), 0); rx.names = v->buf;
    if (v->ndim != 2 || v->shape[1] < 8 || v->shape[0] < rx.raw_rows) {
        PyErr_SetString(PyExc_ValueError, "names must be (count, 16) bytes");
        goto fail;
    }
    rx.names_cols = v->shape[1];
    ARR(v, 4, "control", B(K_U8), 0); rx.control = v->buf;
    if (v->ndim != 2 || v->shape[1] < 20 || v->shape[0] < rx.raw_rows) {
        PyErr_SetString(PyExc_ValueError, "control must be (count, space) bytes");
        goto fail;
    }
    rx.control_cols = v->shape[1];
    I64(n, 5); I64(rx.slot_bytes, 6); I64(rx.gro, 7); I64(rx.sol_udp, 8); I64(rx.udp_gro, 9);
    ARR(v, 10, "out_starts", B(K_I64), 1); rx.starts = v->buf; rx.nstarts = v->len / 8;
    ARR(v, 11, "out_lens", B(K_I64), 1); rx.lens = v->buf;
    if (v->len / 8 < rx.nstarts) goto short_arrays;
    ARR(v, 12, "out_senders", B(K_I64), 1); rx.senders = v->buf;
    if (v->len / 8 < rx.nstarts) goto short_arrays;
    if (n < 0 || n > rx.raw_rows || rx.msg_len_at < 0 || rx.controllen_at < 0
        || rx.msg_len_at + 4 > rx.raw_cols || rx.controllen_at + 8 > rx.raw_cols
        || rx.slot_bytes < 1 || rx.control_cols < 20) {
        PyErr_SetString(PyExc_ValueError, "split_mmsg: n or the field offsets exceed msgs");
        goto fail;
    }
    m = split_mmsg(&rx, n);
    release(&b);
    return PyLong_FromLongLong(m);
short_arrays:
    PyErr_SetString(PyExc_ValueError, "out_lens and out_senders must be as long as out_starts");
fail:
    release(&b);
    return NULL;
}

/* gro_segments(nbytes, seg, starts, lens) -> datagrams: a GRO buffer's datagrams (all seg
   long but the last). */
static PyObject *py_gro_segments(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NEED(4);
    bufs_t b = {.n = 0};
    Py_buffer *st, *ln;
    int64_t nbytes, seg, n = 0, o = 0, cap;
    I64(nbytes, 0); I64(seg, 1);
    ARR(st, 2, "starts", B(K_I64), 1);
    ARR(ln, 3, "lens", B(K_I64), 1);
    if (seg < 1) {
        PyErr_SetString(PyExc_ValueError, "gro_segments: seg must be positive");
        goto fail;
    }
    cap = min64(st->len / 8, ln->len / 8);
    while (o < nbytes && n < cap) {
        ((int64_t *)st->buf)[n] = o;
        ((int64_t *)ln->buf)[n] = min64(seg, nbytes - o);
        o += seg;
        n += 1;
    }
    release(&b);
    return PyLong_FromLongLong(n);
fail:
    release(&b);
    return NULL;
}

/* first_foreign(senders, start, count, allowed, nallowed) -> the first i in start..count-1
   whose sender is none of allowed[:nallowed], or count. */
static PyObject *py_first_foreign(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NEED(5);
    bufs_t b = {.n = 0};
    Py_buffer *sv, *av;
    int64_t start, count, nallowed, i;
    ARR(sv, 0, "senders", B(K_I64), 0);
    I64(start, 1); I64(count, 2);
    ARR(av, 3, "allowed", B(K_I64), 0);
    I64(nallowed, 4);
    if (start < 0 || count > sv->len / 8 || nallowed < 0 || nallowed > av->len / 8) {
        PyErr_SetString(PyExc_ValueError, "first_foreign: count or nallowed exceed the arrays");
        goto fail;
    }
    i = first_foreign(sv->buf, start, count, av->buf, nallowed);
    release(&b);
    return PyLong_FromLongLong(i);
fail:
    release(&b);
    return NULL;
}

/* ---- the compiled loop's entry points -------------------------------------------------- */

/* ---- the compiled loop's entry points -------------------------------------------------- */

static int get_sender(PyObject *const *args, OpStateObject *st, sender_t *s, bufs_t *b)
{
    Py_buffer *v;
    int64_t fd;
    memset(s, 0, sizeof *s);
    if (arg_i64(args[0], &fd) < 0) return -1;
    s->fd = (int)fd;
    if (arg_i64(args[1], &s->max_segments) < 0) return -1;
    if (arg_i64(args[2], &s->max_bytes) < 0) return -1;
    if (s->max_segments < 1 || s->max_segments > MAX_IOV) {
        PyErr_Format(PyExc_ValueError, "max_segments must be 1..%d", MAX_IOV);
        return -1;
    }
    if (!(v = getbuf(b, args[3], "stats", B(K_I64), 1))) return -1;
    if (v->len / 8 < ST_N) { PyErr_SetString(PyExc_ValueError, "stats is too short"); return -1; }
    s->stats = v->buf;
    s->stride = st->stride;
    s->order = st->order;
    s->runs = st->runs;
    s->shards = 1;
    return 0;
}

#define MAX_SHARDS 4096

/* The switch's addresses for the sender: dests, S sockaddr_in rows (16 bytes each; none for
   one switch on a connected socket), and allowed, the S sender numbers datagrams may come
   from (split_mmsg's: IPv4 address << 16 | port). */
static int get_shards(bufs_t *b, PyObject *dests, PyObject *allowed, sender_t *s)
{
    Py_buffer *dv, *av;
    if (!(dv = getbuf(b, dests, "dests", B(K_U8), 0))) return -1;
    if (!(av = getbuf(b, allowed, "allowed", B(K_I64), 0))) return -1;
    if (dv->len == 0)
        return 0; /* one switch, a connected socket */
    int64_t n = av->len / 8;
    if (n < 2 || n > MAX_SHARDS || dv->len != 16 * n) {
        PyErr_SetString(PyExc_ValueError, "dests must be 16-byte sockaddr_in rows, one per "
                        "shard (2 or more), and allowed one sender number per shard");
        return -1;
    }
    s->shards = n;
    s->dests = dv->buf;
    s->allowed = av->buf;
    return 0;
}

/* The send queue as Python left it (it queues and spills lanes between calls): within
   sendq, each lane within the lanes. */
static int check_queue(const op_t *o)
{
    int64_t nq = OPV(o, OP_NQ);
    if (nq < 0 || nq > o->nsendq)
        goto bad;
    for (int64_t q = 0; q < nq; q++)
        if (o->sendq[q] < 0 || o->sendq[q] >= o->nl)
            goto bad;
    return 0;
bad:
    PyErr_SetString(PyExc_ValueError, "the send queue (opv[NQ], sendq) names lanes outside the "
                    "operation's");
    return -1;
}

/* send_queued(state, fd, max_segments, max_bytes, stats, dests, allowed) -> bool: the
   queued lanes as GSO runs, to the one switch (no dests) or each to its shard */
static PyObject *py_send_queued(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NEED(7);
    bufs_t b = {.n = 0};
    op_t *o;
    int r;
    sender_t *s;
    if (!(o = state_of(args[0]))) return NULL;
    if (!(s = PyMem_Malloc(sizeof(sender_t)))) return PyErr_NoMemory();
    if (get_sender(args + 1, (OpStateObject *)args[0], s, &b) < 0) goto fail;
    if (get_shards(&b, args[5], args[6], s) < 0) goto fail;
    if (check_queue(o) < 0) goto fail;
    Py_BEGIN_ALLOW_THREADS
    r = send_queued(o, s);
    Py_END_ALLOW_THREADS
    release(&b);
    PyMem_Free(s);
    return PyBool_FromLong(r);
fail:
    release(&b);
    PyMem_Free(s);
    return NULL;
}

/* pump(state, fd, max_segments, max_bytes, stats, op_timeout_s,                       (0-5)
        wake_fd, msgs_addr, count, raw, msg_len_at, controllen_at, names, control,
        slot_bytes, gro, sol_udp, udp_gro, buf, starts, lens, senders,   (the receiver: 6-21)
        dests, allowed)                                               (the shards: 22-23)
   -> (why, at, nseg, code) */
static PyObject *py_pump(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NEED(24);
    bufs_t b = {.n = 0};
    op_t *o;
    receiver_t rx;
    int64_t tmp, at = 0, nseg = 0, code = 0;
    double op_timeout_s;
    int why;
    sender_t *s;
    if (!(o = state_of(args[0]))) return NULL;
    if (!(s = PyMem_Malloc(sizeof(sender_t)))) return PyErr_NoMemory();
    memset(&rx, 0, sizeof rx);
    if (get_sender(args + 1, (OpStateObject *)args[0], s, &b) < 0) goto fail;
    if (get_shards(&b, args[22], args[23], s) < 0) goto fail;
    if (check_queue(o) < 0) goto fail;
    F64(op_timeout_s, 5);
    rx.fd = s->fd;
    I64(tmp, 6); rx.wake_fd = (int)tmp;
    if (get_receiver(&b, args, 7, MAX_BATCH, &rx) < 0) goto fail;
    Py_BEGIN_ALLOW_THREADS
    why = pump(o, s, &rx, op_timeout_s, &at, &nseg, &code);
    Py_END_ALLOW_THREADS
    release(&b);
    PyMem_Free(s);
    return Py_BuildValue("(iLLL)", why, (long long)at, (long long)nseg, (long long)code);
fail:
    release(&b);
    PyMem_Free(s);
    return NULL;
}

/* data_mac(key, d) -> bytes: the authenticated data plane's MAC of d under a 16-byte key
   (common.h's data_mac: SipHash-2-4, 128 bits) */
static PyObject *py_data_mac(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NEED(2);
    bufs_t b = {.n = 0};
    Py_buffer *k, *d;
    uint8_t tag[DATA_TAG];
    ARR(k, 0, "key", B(K_U8), 0);
    ARR(d, 1, "d", B(K_U8), 0);
    if (k->len != 16) {
        PyErr_SetString(PyExc_ValueError, "data_mac: the key must be 16 bytes");
        goto fail;
    }
    if (!data_mac(k->buf, d->buf, d->len, tag)) {
        PyErr_SetString(PyExc_RuntimeError, "data_mac: OpenSSL's SIPHASH failed");
        goto fail;
    }
    release(&b);
    return PyBytes_FromStringAndSize((const char *)tag, DATA_TAG);
fail:
    release(&b);
    return NULL;
}

static PyMethodDef methods[] = {
    M(data_mac, "data_mac(key, d) -> bytes"),
    M(worker_results,
      "worker_results(state, d, starts, lens, nseg, start, limit, now) -> (next, code): take "
      "the RESULTs of a batch (kernels/stream.py)"),
    M(send_first,
      "send_first(state, count, now): start and queue packets 0 .. count-1"),
    M(send_chunk,
      "send_chunk(state, p, retransmit, fast, now) -> lane: (re-)build packet p"),
    M(take_nack,
      "take_nack(state, chunk, slot, now) -> the chunk to re-send, or -1"),
    M(mark_nack_resend,
      "mark_nack_resend(state, i, p, chunk): the first re-send for a NACK is RESENT"),
    M(fire_timers,
      "fire_timers(state, now) -> bool: re-send what the timers call for"),
    M(next_deadline,
      "next_deadline(state) -> float"),
    M(probe_time,
      "probe_time(rtt) -> float: when the idle probe is due"),
    M(plan_runs,
      "plan_runs(sendq, nq, sendlen, stride, shards, max_segments, max_bytes, order, runs) "
      "-> runs: cut queued lanes into UDP GSO runs"),
    M(block_exponents,
      "block_exponents(x, k, exps, nonfinite)"),
    M(quantize_block,
      "quantize_block(x, emax, n_bits, nonfinite, out)"),
    M(dequantize_block,
      "dequantize_block(q, emax, n_bits, nonfinite, out, num_workers, edge, fmax)"),
    M(residual_block,
      "residual_block(x, q, emax, n_bits, r)"),
    M(split_mmsg,
      "split_mmsg(msgs, msg_len_at, controllen_at, names, control, n, slot_bytes, gro, "
      "sol_udp, udp_gro, out_starts, out_lens, out_senders) -> datagrams"),
    M(gro_segments,
      "gro_segments(nbytes, seg, starts, lens) -> datagrams"),
    M(first_foreign,
      "first_foreign(senders, start, count, allowed, nallowed) -> index"),
    M(send_queued,
      "send_queued(state, fd, max_segments, max_bytes, stats, dests, allowed) -> bool: send "
      "the queued lanes as GSO runs"),
    M(pump,
      "pump(...) -> (why, at, nseg, code): the worker's compiled receive-and-send loop"),
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "switchml._worker",
    "The worker's per-datagram rules and its receive-and-send loop, compiled when the package "
    "is built (src/switchml/csrc/worker.c).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__worker(void)
{
    if (PyType_Ready(&OpStateType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&OpStateType);
    if (PyModule_AddObject(m, "OpState", (PyObject *)&OpStateType) < 0) {
        Py_DECREF(&OpStateType);
        Py_DECREF(m);
        return NULL;
    }
    /* The layout compiled in, for the import-time check against kernels/layout.py. */
    if (PyModule_AddIntConstant(m, "O_FIELDS", O_FIELDS) < 0
        || PyModule_AddIntConstant(m, "R_FIELDS", R_FIELDS) < 0
        || PyModule_AddIntConstant(m, "LN_FIELDS", LN_FIELDS) < 0
        || PyModule_AddIntConstant(m, "LNF_FIELDS", LNF_FIELDS) < 0
        || PyModule_AddIntConstant(m, "WC_N", WC_N) < 0
        || PyModule_AddIntConstant(m, "HDR", HDR) < 0
        || PyModule_AddIntConstant(m, "H_EXP_NEXT", H_EXP_NEXT) < 0
        || PyModule_AddIntConstant(m, "PROBE_LANES", PROBE_LANES) < 0
        || PyModule_AddIntConstant(m, "QUORUM_AHEAD", QUORUM_AHEAD) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
