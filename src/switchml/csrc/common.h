/* What the compiled data plane's modules share (switchml._worker and switchml._switch): wire
 * framing, receive batches, the clock, and arguments through the buffer protocol. */
#pragma once
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

#include "layout.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "switchml's data plane assumes a little-endian host (the wire is little-endian)"
#endif

#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#ifndef SOL_UDP
#define SOL_UDP 17
#endif

/* Element kinds of the arrays the kernels take. bfloat16 has no buffer format of its own
   (numpy's is ml_dtypes'): the worker passes it as uint16 ('H'); int16 is 'h'. */
enum { K_OTHER = 0, K_F32, K_F64, K_I32, K_I16, K_I64, K_U8, K_F16, K_BF16 };

typedef int32_t ui32 __attribute__((aligned(1))); /* a payload at any offset of a batch */
typedef int16_t ui16 __attribute__((aligned(1)));

#define MAX_IOV 128

/* Send one run of datagrams: the buffers iov[0..niov) gathered, cut by the kernel into
   datagrams of `size` bytes (UDP_SEGMENT, for more than one; the last may be shorter), to
   `name` (a struct sockaddr_in, or NULL on a connected socket). The one "send a run" of both
   compiled loops. Returns sendmsg's result (errno set on -1). */
static inline ssize_t send_run(int fd, const void *name, struct iovec *iov, size_t niov,
                               int64_t count, int64_t size)
{
    union {
        char buf[CMSG_SPACE(sizeof(uint16_t))];
        struct cmsghdr align;
    } ctl;
    struct msghdr h;
    memset(&h, 0, sizeof h);
    h.msg_name = (void *)name;
    h.msg_namelen = name ? 16 : 0; /* sizeof(struct sockaddr_in) */
    h.msg_iov = iov;
    h.msg_iovlen = niov;
    if (count > 1) {
        memset(&ctl, 0, sizeof ctl);
        h.msg_control = ctl.buf;
        h.msg_controllen = sizeof ctl.buf;
        struct cmsghdr *c = CMSG_FIRSTHDR(&h);
        c->cmsg_level = SOL_UDP;
        c->cmsg_type = UDP_SEGMENT;
        c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
        uint16_t seg = (uint16_t)size;
        memcpy(CMSG_DATA(c), &seg, sizeof seg);
    }
    return sendmsg(fd, &h, 0);
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline double dmin(double a, double b) { return a < b ? a : b; }
static inline double dmax(double a, double b) { return a > b ? a : b; }


/* ---- framing --------------------------------------------------------------------------- */

static inline int64_t rd_u16(const uint8_t *d, int64_t o)
{
    return (int64_t)d[o] | ((int64_t)d[o + 1] << 8);
}

static inline int64_t rd_u32(const uint8_t *d, int64_t o)
{
    return (int64_t)d[o] | ((int64_t)d[o + 1] << 8) | ((int64_t)d[o + 2] << 16)
           | ((int64_t)d[o + 3] << 24);
}

static inline int64_t rd_i16(const uint8_t *d, int64_t o)
{
    int64_t v = rd_u16(d, o);
    return v >= 32768 ? v - 65536 : v;
}

static inline int64_t rd_i64(const uint8_t *d, int64_t o)
{
    uint64_t lo = (uint64_t)rd_u32(d, o), hi = (uint64_t)rd_u32(d, o + 4);
    return (int64_t)(lo | (hi << 32));
}

static inline void put16(uint8_t *d, int64_t o, int64_t v)
{
    d[o] = v & 0xFF;
    d[o + 1] = (v >> 8) & 0xFF;
}

static inline void put32(uint8_t *d, int64_t o, int64_t v)
{
    d[o] = v & 0xFF;
    d[o + 1] = (v >> 8) & 0xFF;
    d[o + 2] = (v >> 16) & 0xFF;
    d[o + 3] = (v >> 24) & 0xFF;
}

static inline void put64(uint8_t *d, int64_t o, int64_t v)
{
    uint64_t u = (uint64_t)v;
    put32(d, o, (int64_t)(u & 0xFFFFFFFFu));
    put32(d, o + 4, (int64_t)(u >> 32));
}

static inline void write_header(uint8_t *d, int64_t o, int64_t mtype, int64_t flags,
                                int64_t set_bit, int64_t rank, int64_t job, int64_t token,
                                int64_t seq, int64_t chunk, int64_t slot, int64_t count,
                                int64_t elem, int64_t digest, int64_t exp_data, int64_t exp_next)
{
    put16(d, o + H_MAGIC, MAGIC);
    d[o + H_VERSION] = VERSION;
    d[o + H_TYPE] = (uint8_t)mtype;
    d[o + H_FLAGS] = (uint8_t)flags;
    d[o + H_SET] = (uint8_t)set_bit;
    put16(d, o + H_RANK, rank);
    put32(d, o + H_JOB, job);
    put64(d, o + H_TOKEN, token);
    put32(d, o + H_SEQ, seq);
    put32(d, o + H_CHUNK, chunk);
    put32(d, o + H_SLOT, slot);
    put16(d, o + H_COUNT, count);
    d[o + H_ELEM] = (uint8_t)elem;
    d[o + H_DIGEST] = (uint8_t)digest;
    put16(d, o + H_EXP_DATA, exp_data & 0xFFFF);
    put16(d, o + H_EXP_NEXT, exp_next & 0xFFFF);
}

/* ---- the authenticated data plane (docs/protocol.md, "Authenticated data plane") --------
   A job created with JobSpec.auth_data carries a MAC on every REQUEST and RESULT: the AUTH
   flag set, then DATA_TAG bytes after the payload, SipHash-2-4 with a 128-bit tag (OpenSSL's
   EVP_MAC "SIPHASH") under the job's 16-byte data key, over the datagram before the tag (the
   header with AUTH set included). One implementation, used by both modules' kernels and, for
   Python, by data_mac. */

/* Each thread's MAC context is freed when the thread exits (an I/O thread of a closed job). */
static pthread_key_t mac_ctx_key;
static pthread_once_t mac_ctx_once = PTHREAD_ONCE_INIT;
static void free_mac_ctx(void *ctx) { EVP_MAC_CTX_free(ctx); }
static void make_mac_ctx_key(void) { pthread_key_create(&mac_ctx_key, free_mac_ctx); }

/* The MAC of d[0:n] under key (16 bytes) into tag (DATA_TAG bytes); 0 on an OpenSSL failure.
   A context per thread (the kernels run without the GIL, on several I/O threads). */
static int data_mac(const uint8_t *key, const uint8_t *d, int64_t n, uint8_t *tag)
{
    static __thread EVP_MAC_CTX *ctx = NULL;
    size_t out = 0;
    if (ctx == NULL) {
        EVP_MAC *mac = EVP_MAC_fetch(NULL, "SIPHASH", NULL);
        if (mac == NULL)
            return 0;
        EVP_MAC_CTX *c = EVP_MAC_CTX_new(mac);
        EVP_MAC_free(mac); /* the context keeps its own reference */
        size_t size = DATA_TAG; /* kept across EVP_MAC_init calls with a new key */
        OSSL_PARAM params[2] = {OSSL_PARAM_construct_size_t("size", &size),
                                OSSL_PARAM_construct_end()};
        if (c == NULL || !EVP_MAC_CTX_set_params(c, params)) {
            EVP_MAC_CTX_free(c);
            return 0;
        }
        pthread_once(&mac_ctx_once, make_mac_ctx_key);
        pthread_setspecific(mac_ctx_key, c); /* freed at the thread's exit */
        ctx = c;
    }
    return EVP_MAC_init(ctx, key, 16, NULL) && EVP_MAC_update(ctx, d, (size_t)n)
           && EVP_MAC_final(ctx, tag, &out, DATA_TAG) && out == DATA_TAG;
}

/* The job's data key from its two int64 fields (little-endian bytes). */
static inline void data_key(int64_t k0, int64_t k1, uint8_t *key)
{
    put64(key, 0, k0);
    put64(key, 8, k1);
}

/* Seal d[0:n]: set AUTH in its header and write the tag at d[n:n+DATA_TAG]. */
static inline int seal_data(int64_t k0, int64_t k1, uint8_t *d, int64_t n)
{
    uint8_t key[16];
    data_key(k0, k1, key);
    d[H_FLAGS] |= F_AUTH;
    int ok = data_mac(key, d, n, d + n);
    OPENSSL_cleanse(key, sizeof key);
    if (!ok) /* OpenSSL failed: a tag that verifies nowhere, never old bytes */
        memset(d + n, 0, DATA_TAG);
    return ok;
}

/* Whether d[0:n] (tag included) carries AUTH and a tag that verifies under the key. */
static inline int data_sealed(int64_t k0, int64_t k1, const uint8_t *d, int64_t n)
{
    uint8_t key[16], tag[DATA_TAG];
    if (n < HDR + DATA_TAG || !(d[H_FLAGS] & F_AUTH) || (k0 == 0 && k1 == 0))
        return 0; /* (an all-zero key: never set, so nothing verifies under it) */
    data_key(k0, k1, key);
    int ok = data_mac(key, d, n - DATA_TAG, tag)
             && CRYPTO_memcmp(tag, d + n - DATA_TAG, DATA_TAG) == 0;
    OPENSSL_cleanse(key, sizeof key);
    return ok;
}


static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}


typedef struct {
    int fd, wake_fd;
    struct mmsghdr *msgs;
    int64_t count, slot_bytes, gro, sol_udp, udp_gro, msg_len_at, controllen_at;
    uint8_t *raw; int64_t raw_rows, raw_cols;
    const uint8_t *names; int64_t names_cols;
    const uint8_t *control; int64_t control_cols;
    const uint8_t *buf; int64_t buf_n;
    int64_t *starts, *lens, *senders; int64_t nstarts;
} receiver_t;

/* Cut what one recvmmsg returned into datagrams (frames.py's split_mmsg); their number. */
static int64_t split_mmsg(receiver_t *rx, int64_t n)
{
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *row = rx->raw + i * rx->raw_cols;
        int64_t length = rd_u32(row, rx->msg_len_at);
        const uint8_t *nm = rx->names + i * rx->names_cols;
        int64_t sender = ((int64_t)nm[4] << 40) | ((int64_t)nm[5] << 32) | ((int64_t)nm[6] << 24)
                         | ((int64_t)nm[7] << 16) | ((int64_t)nm[2] << 8) | (int64_t)nm[3];
        int64_t seg = length;
        if (rx->gro) {
            int64_t used = rd_u16(row, rx->controllen_at);
            const uint8_t *c = rx->control + i * rx->control_cols;
            if (used >= 20 && rd_u32(c, 8) == rx->sol_udp && rd_u32(c, 12) == rx->udp_gro) {
                int64_t g = rd_u32(c, 16);
                if (0 < g && g < length)
                    seg = g;
            }
        }
        int64_t o = i * rx->slot_bytes, end = o + length;
        while (1) {
            if (m >= rx->nstarts)
                goto reset; /* (the rest is dropped: at most MAX_BATCH per call) */
            rx->starts[m] = o;
            rx->lens[m] = min64(seg, end - o);
            rx->senders[m] = sender;
            m += 1;
            o += seg;
            if (o >= end)
                break;
        }
    }
reset:
    if (rx->gro) {
        int64_t full = rx->control_cols;
        for (int64_t i = 0; i < rx->raw_rows; i++)
            for (int b = 0; b < 8; b++)
                rx->raw[i * rx->raw_cols + rx->controllen_at + b] = (full >> (8 * b)) & 0xFF;
    }
    return m;
}

/* ---- Python's side: arguments through the buffer protocol ------------------------------ */

#define MAX_BUFS 96

typedef struct {
    Py_buffer v[MAX_BUFS];
    int n;
} bufs_t;

static void release(bufs_t *b)
{
    for (int i = 0; i < b->n; i++)
        PyBuffer_Release(&b->v[i]);
    b->n = 0;
}

static int kind_of(const Py_buffer *v)
{
    const char *f = v->format ? v->format : "B";
    while (*f == '<' || *f == '=' || *f == '@' || *f == '|')
        f++;
    char c = *f;
    if (!c)
        return K_OTHER;
    if (c == 'f' && v->itemsize == 4) return K_F32;
    if (c == 'd' && v->itemsize == 8) return K_F64;
    if (strchr("bBc?", c) && v->itemsize == 1) return K_U8;
    if (c == 'h' && v->itemsize == 2) return K_I16;
    if (c == 'H' && v->itemsize == 2) return K_BF16;
    if (c == 'e' && v->itemsize == 2) return K_F16;
    if (strchr("iIlL", c) && v->itemsize == 4) return K_I32;
    if (strchr("lLqQnN", c) && v->itemsize == 8) return K_I64;
    return K_OTHER;
}

static const char *kind_name[] = {"other", "float32", "float64", "int32", "int16", "int64",
                                  "uint8", "float16", "bfloat16 (as uint16)"};

/* A C-contiguous buffer of arg `name`, of one of the kinds in `kinds` (a bit per kind);
   NULL with a TypeError/ValueError saying what was wrong. */
static Py_buffer *getbuf(bufs_t *b, PyObject *obj, const char *name, unsigned kinds,
                         int writable)
{
    if (b->n >= MAX_BUFS) {
        PyErr_SetString(PyExc_RuntimeError, "switchml: a kernel call with too many array arguments");
        return NULL;
    }
    Py_buffer *v = &b->v[b->n];
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, v, flags) < 0) {
        PyErr_Format(PyExc_TypeError,
                     "switchml._worker: %s must be a C-contiguous%s numpy array", name,
                     writable ? ", writeable" : "");
        return NULL;
    }
    b->n++;
    int k = kind_of(v);
    if (!(kinds & (1u << k))) {
        PyErr_Format(PyExc_TypeError, "switchml._worker: %s has elements of %s, not one of "
                     "the types it takes", name, kind_name[k]);
        return NULL;
    }
    return v;
}

#define B(k) (1u << (k))
/* A method table's row: py_<name>, called with the fast calling convention. */
#define M(name, doc) {#name, (PyCFunction)(void (*)(void))py_##name, METH_FASTCALL, doc}
#define NEED(n)                                                                               \
    if (nargs != (n)) {                                                                       \
        PyErr_Format(PyExc_TypeError, "%s takes %d arguments (%zd given)", __func__ + 3, (n), \
                     nargs);                                                                  \
        return NULL;                                                                          \
    }

static int arg_i64(PyObject *o, int64_t *out)
{
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *out = (int64_t)v;
    return 0;
}

static int arg_f64(PyObject *o, double *out)
{
    double v = PyFloat_AsDouble(o);
    if (v == -1.0 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

#define I64(dst, k) if (arg_i64(args[k], &(dst)) < 0) goto fail
#define F64(dst, k) if (arg_f64(args[k], &(dst)) < 0) goto fail
#define BOOL(dst, k) if (((dst) = PyObject_IsTrue(args[k])) < 0) goto fail
#define ARR(v, k, name, kinds, w) if (!((v) = getbuf(&b, args[k], name, kinds, w))) goto fail

/* A receiver's arguments from args[at..at+14]: msgs_addr, count, raw, msg_len_at,
   controllen_at, names, control, slot_bytes, gro, sol_udp, udp_gro, buf, starts, lens,
   senders (transport/batching.py's MultiReceiver); at most `max_batch` datagrams per batch.
   rx->fd and rx->wake_fd are the caller's. -1 with a ValueError or TypeError. */
static int get_receiver(bufs_t *b, PyObject *const *args, int at, int64_t max_batch,
                        receiver_t *rx)
{
    Py_buffer *v;
    int64_t addr;
    if (arg_i64(args[at], &addr) < 0 || arg_i64(args[at + 1], &rx->count) < 0) return -1;
    rx->msgs = (struct mmsghdr *)(uintptr_t)addr;
    if (!(v = getbuf(b, args[at + 2], "raw", B(K_U8), 1))) return -1;
    rx->raw = v->buf;
    if (v->ndim != 2) goto bad;
    rx->raw_rows = v->shape[0];
    rx->raw_cols = v->shape[1];
    if (arg_i64(args[at + 3], &rx->msg_len_at) < 0
        || arg_i64(args[at + 4], &rx->controllen_at) < 0) return -1;
    if (rx->msg_len_at < 0 || rx->controllen_at < 0 || rx->msg_len_at + 4 > rx->raw_cols
        || rx->controllen_at + 8 > rx->raw_cols || rx->count < 1 || rx->count > rx->raw_rows)
        goto bad;
    if (!(v = getbuf(b, args[at + 5], "names", B(K_U8), 0))) return -1;
    rx->names = v->buf;
    if (v->ndim != 2 || v->shape[0] < rx->count || v->shape[1] < 8) goto bad;
    rx->names_cols = v->shape[1];
    if (!(v = getbuf(b, args[at + 6], "control", B(K_U8), 0))) return -1;
    rx->control = v->buf;
    if (v->ndim != 2 || v->shape[0] < rx->count || v->shape[1] < 20) goto bad;
    rx->control_cols = v->shape[1];
    if (arg_i64(args[at + 7], &rx->slot_bytes) < 0 || arg_i64(args[at + 8], &rx->gro) < 0
        || arg_i64(args[at + 9], &rx->sol_udp) < 0 || arg_i64(args[at + 10], &rx->udp_gro) < 0)
        return -1;
    if (!(v = getbuf(b, args[at + 11], "buf", B(K_U8), 0))) return -1;
    rx->buf = v->buf;
    rx->buf_n = v->len;
    if (rx->slot_bytes < HDR || rx->count > rx->buf_n / rx->slot_bytes || rx->msgs == NULL)
        goto bad;
    if (!(v = getbuf(b, args[at + 12], "starts", B(K_I64), 1))) return -1;
    rx->starts = v->buf;
    rx->nstarts = v->len / 8 < max_batch ? v->len / 8 : max_batch;
    if (!(v = getbuf(b, args[at + 13], "lens", B(K_I64), 1))) return -1;
    rx->lens = v->buf;
    if (v->len / 8 < rx->nstarts) goto bad;
    if (!(v = getbuf(b, args[at + 14], "senders", B(K_I64), 1))) return -1;
    rx->senders = v->buf;
    if (v->len / 8 < rx->nstarts) goto bad;
    return 0;
bad:
    PyErr_SetString(PyExc_ValueError, "the receiver's arrays of the wrong shape");
    return -1;
}
