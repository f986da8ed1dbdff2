/* switchml._switch: the switch's per-request rules and a rack's relay, compiled when the
 * package is built.
 *
 * The one production implementation of the switch's data plane: validate a REQUEST, check
 * job, rank, epoch and slot, classify it by the slot table (protocol/slots.py, passed in as
 * `rules`), aggregate, max the exponent, complete the round and write the result header in
 * place; find chunks a rank should have delivered (NACKs); answer re-sent requests (the
 * stored result again, or WAITING); cut results into UDP GSO runs; a rack switch's relay
 * (rounds up as requests, the parent's results down); and the switch's compiled
 * receive-aggregate-send loop (`switch_pump`).
 *
 * protocol/switch.py explains the protocol, protocol/jobs.py builds a job's arrays,
 * protocol/kernels/layout.py is the table of their fields (csrc/layout.h is generated from
 * it). The plain-Python reference of every rule is protocol/kernels/aggregate.py and relay.py:
 * tests/protocol/test_switch_kernels.py runs both and compares every array.
 */
#include "common.h"

/* ---- one job's state: pointers into the arrays jobs.py builds -------------------------- */

typedef struct {
    int64_t *jobv, *st, *clog, *cursor, *mkeys, *rules, *cnt;
    uint64_t *seen, *conflict;
    uint8_t *bufs;
    double *heard;
    int64_t W, words, stride, nclog, nsets;
} job_t;

#define JV(j, f) ((j)->jobv[f])
#define STV(j, f, v, s) ((j)->st[((int64_t)(f) * 2 + (v)) * (j)->W + (s)])
#define SEENW(j, v, s, w) ((j)->seen[((int64_t)(v) * (j)->W + (s)) * (j)->words + (w)])
#define CONFW(j, v, s, w) ((j)->conflict[((int64_t)(v) * (j)->W + (s)) * (j)->words + (w)])
#define BUF(j, v, s) ((j)->bufs + ((int64_t)(v) * (j)->W + (s)) * (j)->stride)
#define CLOG(j, e, c) ((j)->clog[(int64_t)(e) * 4 + (c)])

#define HALF (1LL << 31)
#define EPOCH_TRAIL (1LL << 30)
#define MASK32 0xFFFFFFFFLL
#define SHAPE_FLAGS (F_HAS_DATA | F_HAS_EXP)

typedef struct {
    int64_t seq, chunk, s, v, flags, count, elem, digest, exp_data, exp_next, itemsize;
} request_t;

typedef struct {
    uint8_t *rows;
    int64_t rowlen, nrows;
    int64_t *meta;
} replies_t;

/* ---- bitmaps --------------------------------------------------------------------------- */

static inline void clear_bit(uint64_t *bm, const job_t *j, int64_t v, int64_t s, int64_t rank)
{
    bm[((int64_t)v * j->W + s) * j->words + (rank >> 6)] &= ~(1ULL << (rank & 63));
}

static inline int has_bit(const uint64_t *bm, const job_t *j, int64_t v, int64_t s, int64_t rank)
{
    return (bm[((int64_t)v * j->W + s) * j->words + (rank >> 6)] >> (rank & 63)) & 1ULL;
}

static inline int any_bit(const uint64_t *bm, const job_t *j, int64_t v, int64_t s)
{
    for (int64_t w = 0; w < j->words; w++)
        if (bm[((int64_t)v * j->W + s) * j->words + w] != 0)
            return 1;
    return 0;
}

/* ---- framing --------------------------------------------------------------------------- */

/* Whether d[o:o+n] is a well-formed REQUEST with an int32 or int16 payload. */
static inline int request_framing(const uint8_t *d, int64_t o, int64_t n)
{
    if (n < HDR || rd_u16(d, o + H_MAGIC) != MAGIC || d[o + H_VERSION] != VERSION
        || d[o + H_TYPE] != T_REQUEST)
        return 0;
    int64_t flags = d[o + H_FLAGS];
    if (d[o + H_SET] > 1 || (flags & ~(int64_t)(REQUEST_FLAGS | F_AUTH)) != 0)
        return 0;
    if (flags & F_AUTH) /* an authenticated job's: the MAC follows the payload */
        n -= DATA_TAG;
    int64_t elem = d[o + H_ELEM];
    if (elem == E_INT32)
        return n == HDR + 4 * rd_u16(d, o + H_COUNT);
    if (elem == E_INT16)
        return n == HDR + 2 * rd_u16(d, o + H_COUNT);
    return 0;
}

static inline request_t parse(const uint8_t *d, int64_t o, int64_t base)
{
    request_t r;
    r.elem = d[o + H_ELEM];
    r.seq = rd_u32(d, o + H_SEQ);
    r.chunk = rd_u32(d, o + H_CHUNK);
    r.s = rd_u32(d, o + H_SLOT) - base;
    r.v = d[o + H_SET];
    r.flags = d[o + H_FLAGS];
    r.count = rd_u16(d, o + H_COUNT);
    r.digest = d[o + H_DIGEST];
    r.exp_data = rd_i16(d, o + H_EXP_DATA);
    r.exp_next = rd_i16(d, o + H_EXP_NEXT);
    r.itemsize = r.elem == E_INT32 ? 4 : 2;
    return r;
}

/* ---- the slot rule --------------------------------------------------------------------- */

/* slots.Round of the request's (seq, chunk) against its set's round (RFC 1982 seq). */
static inline int64_t round_order(const job_t *j, const request_t *r)
{
    int64_t cur = STV(j, S_SEQ, r->v, r->s);
    if (cur < 0)
        return 2;
    if (r->seq != cur)
        return ((r->seq - cur) & MASK32) < HALF ? 2 : 0;
    int64_t cc = STV(j, S_CHUNK, r->v, r->s);
    return r->chunk == cc ? 1 : (r->chunk > cc ? 2 : 0);
}

static inline int agrees(const job_t *j, const request_t *r)
{
    int64_t v = r->v, s = r->s;
    return r->count == STV(j, S_COUNT, v, s) && r->elem == STV(j, S_ELEM, v, s)
           && r->digest == STV(j, S_DIGEST, v, s) && r->exp_data == STV(j, S_EXP_DATA, v, s)
           && ((r->flags ^ STV(j, S_FLAGS, v, s)) & SHAPE_FLAGS) == 0;
}

static inline int64_t action_of(const job_t *j, const request_t *r, int64_t rank)
{
    int64_t order = round_order(j, r), contributed = 0, complete = 0, agree = 1;
    if (order == 1) {
        contributed = has_bit(j->seen, j, r->v, r->s, rank) ? 1 : 0;
        complete = STV(j, S_MISSING, r->v, r->s) == 0 ? 1 : 0;
        if (!contributed && !complete)
            agree = agrees(j, r) ? 1 : 0;
    }
    int64_t quorum = JV(j, J_QUORUM) > 0 ? 1 : 0; /* (slots.SLOT_RULES' first column) */
    return j->rules[(((quorum * 3 + order) * 2 + contributed) * 2 + complete) * 2 + agree];
}

/* The switch's clock (seconds) in whole microseconds, to nearest (aggregate.py's
   _microseconds): a deadline computed back in seconds compares equal. */
static inline int64_t micros(double t)
{
    return (int64_t)floor(t * 1e6 + 0.5);
}

/* The bytes of the result datagram of (slot s, set v). */
static inline int64_t result_size(const job_t *j, int64_t v, int64_t s)
{
    return HDR + (STV(j, S_ELEM, v, s) == E_INT32 ? 4 : 2) * STV(j, S_COUNT, v, s)
           + JV(j, J_TRAILER) + (JV(j, J_AUTH) ? DATA_TAG : 0);
}

/* An authenticated job's datagram at row, of n bytes with its tag: sealed again (after a
   change to its header). */
static inline void reseal(const job_t *j, uint8_t *row, int64_t n)
{
    if (JV(j, J_AUTH))
        seal_data(JV(j, J_MAC_K0), JV(j, J_MAC_K1), row, n - DATA_TAG);
}

/* A quorum job's complete round about to be overwritten: its result into the slot's history
   (rows 2.. of bufs, a ring of J_HISTORY per slot), for a rank the quorum left behind. */
static inline void archive(job_t *j, int64_t v, int64_t s)
{
    int64_t h = JV(j, J_HISTORY);
    if (h <= 0 || STV(j, S_SEQ, v, s) < 0 || STV(j, S_MISSING, v, s) != 0)
        return;
    int64_t pos = STV(j, S_HPOS, 0, s);
    memcpy(BUF(j, 2 + pos, s), BUF(j, v, s), (size_t)result_size(j, v, s));
    STV(j, S_HPOS, 0, s) = (pos + 1) % h;
}

/* The history row of the request's slot holding its round's result, or -1. */
static inline int64_t find_old(const job_t *j, const request_t *r)
{
    for (int64_t h = 0; h < JV(j, J_HISTORY); h++) {
        const uint8_t *b = BUF(j, 2 + h, r->s);
        if (b[H_TYPE] == T_RESULT && rd_u32(b, H_SEQ) == r->seq && rd_u32(b, H_CHUNK) == r->chunk)
            return 2 + h;
    }
    return -1;
}

/* A new round: the first contributor overwrites (no explicit reset of a slot); it completes
   with the job's quorum of contributions, else with every rank's. A quorum job keeps the
   round it overwrites (archive). */
static inline void start_round(job_t *j, const request_t *r, int64_t rank, const uint8_t *pay,
                               double now)
{
    int64_t v = r->v, s = r->s;
    if (STV(j, S_SEQ, v, s) >= 0 && STV(j, S_MISSING, v, s) != 0)
        j->cnt[SC_ABANDONED] += 1; /* only after a failed operation */
    archive(j, v, s);
    STV(j, S_OPENED_AT, v, s) = micros(now); /* a quorum job's deadline counts from here */
    memcpy(BUF(j, v, s) + HDR, pay, (size_t)(r->count * r->itemsize));
    STV(j, S_SEQ, v, s) = r->seq;
    STV(j, S_CHUNK, v, s) = r->chunk;
    STV(j, S_COUNT, v, s) = r->count;
    STV(j, S_ELEM, v, s) = r->elem;
    STV(j, S_FLAGS, v, s) = r->flags & (F_NONFINITE | SHAPE_FLAGS);
    STV(j, S_EXP_DATA, v, s) = r->exp_data;
    STV(j, S_EXP_NEXT, v, s) = r->exp_next;
    STV(j, S_DIGEST, v, s) = r->digest;
    for (int64_t w = 0; w < j->words; w++) {
        SEENW(j, v, s, w) = 0;
        CONFW(j, v, s, w) = 0;
    }
    SEENW(j, v, s, rank >> 6) = 1ULL << (rank & 63);
    STV(j, S_MISSING, v, s) = (JV(j, J_QUORUM) > 0 ? JV(j, J_QUORUM) : JV(j, J_N)) - 1;
}

/* Add a contribution (integer adds wrap, as a switch's adders do); whether the round has
   refused ranks left after this one (Python tells this rank). */
static inline int add(job_t *j, const request_t *r, int64_t rank, const uint8_t *pay)
{
    int64_t v = r->v, s = r->s;
    uint8_t *acc = BUF(j, v, s) + HDR;
    if (r->elem == E_INT32) {
        ui32 *a = (ui32 *)acc;
        const ui32 *x = (const ui32 *)pay;
        for (int64_t k = 0; k < r->count; k++)
            a[k] = (int32_t)((uint32_t)a[k] + (uint32_t)x[k]);
    } else {
        ui16 *a = (ui16 *)acc;
        const ui16 *x = (const ui16 *)pay;
        for (int64_t k = 0; k < r->count; k++)
            a[k] = (int16_t)((uint16_t)a[k] + (uint16_t)x[k]);
    }
    SEENW(j, v, s, rank >> 6) |= 1ULL << (rank & 63);
    STV(j, S_FLAGS, v, s) |= r->flags & F_NONFINITE;
    if (r->exp_next > STV(j, S_EXP_NEXT, v, s))
        STV(j, S_EXP_NEXT, v, s) = r->exp_next;
    STV(j, S_MISSING, v, s) -= 1;
    if (any_bit(j->conflict, j, v, s)) { /* this chunk agrees, but others did not */
        clear_bit(j->conflict, j, v, s, rank);
        return any_bit(j->conflict, j, v, s);
    }
    return 0;
}

/* Stamp a round's results going out (S_DONE_AT) and log it for NACKs. */
static inline void log_release(job_t *j, int64_t v, int64_t s, int64_t seq, int64_t chunk)
{
    int64_t stamp = JV(j, J_COMPLETIONS) + 1;
    JV(j, J_COMPLETIONS) = stamp;
    STV(j, S_DONE_AT, v, s) = stamp;
    if (JV(j, J_NACK_GAP) > JV(j, J_NACK_BASE_GAP)
        && stamp - JV(j, J_NACK_CALM_FROM) >= JV(j, J_NACK_CALM)) {
        int64_t half = JV(j, J_NACK_GAP) / 2;
        JV(j, J_NACK_GAP) = JV(j, J_NACK_BASE_GAP) > half ? JV(j, J_NACK_BASE_GAP) : half;
        JV(j, J_NACK_CALM_FROM) = stamp;
    }
    int64_t e = ((stamp % j->nclog) + j->nclog) % j->nclog;
    CLOG(j, e, 0) = seq;
    CLOG(j, e, 1) = chunk;
    CLOG(j, e, 2) = s;
    if (STV(j, S_FLAGS, v, s) & F_HAS_EXP) {
        JV(j, J_FLOAT_SEQ) = seq;
        CLOG(j, e, 3) = 1;
    } else {
        CLOG(j, e, 3) = JV(j, J_FLOAT_SEQ) == seq ? 0 : 2;
    }
}

/* Complete the round of (slot s, set v): the result header into the slot's buffer (and a
   quorum job's contributor bitmap after the payload), the completion logged (NACKs), and
   listed in done; rank: who completed it (the header's rank field). */
static inline void complete_round(job_t *j, int64_t v, int64_t s, int64_t rank, int64_t *done,
                                  int64_t ndone)
{
    int64_t seq = STV(j, S_SEQ, v, s), chunk = STV(j, S_CHUNK, v, s);
    int64_t count = STV(j, S_COUNT, v, s), elem = STV(j, S_ELEM, v, s);
    int64_t size = HDR + (elem == E_INT32 ? 4 : 2) * count, trailer = JV(j, J_TRAILER);
    int64_t flags = STV(j, S_FLAGS, v, s);
    if (trailer > 0) {
        flags |= F_CONTRIBUTORS;
        for (int64_t b = 0; b < trailer; b++)
            BUF(j, v, s)[size + b] = (uint8_t)(SEENW(j, v, s, b >> 3) >> (8 * (b & 7)));
    }
    write_header(BUF(j, v, s), 0, T_RESULT, flags, v, rank, JV(j, J_JOB), JV(j, J_TOKEN), seq,
                 chunk, s + JV(j, J_SLOT_BASE), count, elem, STV(j, S_DIGEST, v, s),
                 STV(j, S_EXP_DATA, v, s), STV(j, S_EXP_NEXT, v, s));
    if (JV(j, J_AUTH)) {
        seal_data(JV(j, J_MAC_K0), JV(j, J_MAC_K1), BUF(j, v, s), size + trailer);
        trailer += DATA_TAG;
    }
    if (JV(j, J_LOG_AT_RELEASE))
        STV(j, S_DONE_AT, v, s) = -1; /* not released yet: no chunk can follow it */
    else
        log_release(j, v, s, seq, chunk);
    done[ndone * 3] = v;
    done[ndone * 3 + 1] = s;
    done[ndone * 3 + 2] = size + trailer;
    j->cnt[SC_MULTICAST] += 1;
    JV(j, J_AGGREGATED) += count;
}

/* The round's last contribution (complete_round). */
static inline void complete(job_t *j, const request_t *r, int64_t rank, int64_t *done,
                            int64_t ndone)
{
    complete_round(j, r->v, r->s, rank, done, ndone);
}

/* A quorum job's deadline (aggregate.py's expire_rounds): complete every open round with at
   least J_QUORUM_MIN contributions that opened J_DEADLINE_US or longer before now. */
static int64_t expire_rounds(job_t *j, double now, int64_t *done, int64_t cap)
{
    int64_t d = JV(j, J_DEADLINE_US), k = JV(j, J_QUORUM), m = JV(j, J_QUORUM_MIN), nd = 0;
    if (d <= 0 || k <= 0)
        return 0;
    int64_t now_us = micros(now);
    for (int64_t v = 0; v < 2; v++) {
        for (int64_t s = 0; s < JV(j, J_WINDOW); s++) {
            int64_t missing = STV(j, S_MISSING, v, s);
            if (STV(j, S_SEQ, v, s) >= 0 && missing > 0 && k - missing >= m
                && now_us - STV(j, S_OPENED_AT, v, s) >= d) {
                if (nd == cap)
                    return nd;
                STV(j, S_MISSING, v, s) = 0;
                complete_round(j, v, s, JV(j, J_N), done, nd);
                j->cnt[SC_DEADLINE_COMPLETED] += 1;
                nd += 1;
            }
        }
    }
    return nd;
}

/* ---- switch-driven loss recovery (aggregate.py's _behind_on explains) ------------------- */

static inline int64_t find_round(const job_t *j, int64_t sp, int64_t seq, int64_t chunk)
{
    for (int64_t u = 0; u < 2; u++)
        if (STV(j, S_SEQ, u, sp) == seq && STV(j, S_CHUNK, u, sp) == chunk)
            return u;
    return -1;
}

static inline int lacks(const job_t *j, int64_t rank, int64_t seq, int64_t p, int64_t sp)
{
    for (int64_t u = 0; u < 2; u++) {
        int64_t cur = STV(j, S_SEQ, u, sp);
        if (cur < 0)
            continue;
        if (cur == seq) {
            int64_t c = STV(j, S_CHUNK, u, sp);
            if (c > p || (c == p && (has_bit(j->seen, j, u, sp, rank)
                                     || (JV(j, J_QUORUM) > 0 && STV(j, S_MISSING, u, sp) == 0))))
                return 0;
        } else if (((cur - seq) & MASK32) < HALF) {
            return 0; /* a later operation already uses the slot */
        }
    }
    return 1;
}

static inline int nack(job_t *j, int64_t chunk, int64_t slot)
{
    JV(j, J_NACK_CHUNK) = chunk;
    JV(j, J_NACK_SLOT) = slot;
    return 1;
}

static inline int behind_in_first_window(job_t *j, int64_t rank, int64_t seq, int64_t chunk,
                                         int64_t s, int64_t E)
{
    int64_t stride = JV(j, J_SHARDS);
    int64_t p = chunk - JV(j, J_NACK_GAP) * stride;
    if (p >= 0 && (E == 0 || p < E) && p != s && p % stride == s % stride)
        if (lacks(j, rank, seq, p, p))
            return nack(j, p, p);
    return 0;
}

static inline int behind_on(job_t *j, int64_t rank, const request_t *r)
{
    int64_t gap = JV(j, J_NACK_GAP);
    if (gap <= 0)
        return 0;
    int64_t seq = r->seq, chunk = r->chunk, s = r->s;
    int64_t window = JV(j, J_WINDOW);
    int64_t d = chunk - s;
    int64_t E = d >= window ? window : d;
    if (behind_in_first_window(j, rank, seq, chunk, s, E))
        return 1;
    if (E == 0)
        return 0;
    int64_t u = find_round(j, s, seq, chunk - E);
    if (u < 0 || STV(j, S_MISSING, u, s) != 0)
        return 0;
    int64_t limit = STV(j, S_DONE_AT, u, s) - gap;
    int64_t size = j->nclog;
    int64_t c = j->cursor[rank];
    if (JV(j, J_COMPLETIONS) - size > c)
        c = JV(j, J_COMPLETIONS) - size;
    int found = 0;
    while (c < limit && !found) {
        int64_t e = (((c + 1) % size) + size) % size;
        if (CLOG(j, e, 0) == seq && CLOG(j, e, 3) != 0) {
            int64_t released = CLOG(j, e, 1) + E;
            if (CLOG(j, e, 3) == 2 && released >= chunk)
                break; /* integers: it may be past the end; judge it when a later chunk comes */
            if (lacks(j, rank, seq, released, CLOG(j, e, 2)))
                found = nack(j, released, CLOG(j, e, 2));
        }
        c += 1;
    }
    j->cursor[rank] = c;
    return found;
}

/* ---- the batch ------------------------------------------------------------------------- */

static inline int member_request(const uint8_t *d, int64_t o, int64_t ln, int64_t sender,
                                 const job_t *j)
{
    if (sender < 0 || !request_framing(d, o, ln)
        || (d[o + H_FLAGS] & F_AUTH) != (JV(j, J_AUTH) ? F_AUTH : 0))
        return 0;
    if (rd_u32(d, o + H_JOB) != JV(j, J_JOB) || rd_i64(d, o + H_TOKEN) != JV(j, J_TOKEN))
        return 0;
    int64_t rank = rd_u16(d, o + H_RANK);
    return rank < JV(j, J_N) && j->mkeys[rank] == sender;
}

static inline void write_nack(job_t *j, replies_t *rp, int64_t k, int64_t rank, int64_t seq)
{
    write_header(rp->rows + k * rp->rowlen, 0, T_NACK, 0, 0, rank, JV(j, J_JOB), JV(j, J_TOKEN),
                 seq, JV(j, J_NACK_CHUNK), JV(j, J_SLOT_BASE) + JV(j, J_NACK_SLOT), 0, E_BYTES, 0,
                 EXP_ZERO, EXP_ZERO);
    rp->meta[k * 2] = rank;
    rp->meta[k * 2 + 1] = HDR;
}

static inline int before_epoch(job_t *j, int64_t seq)
{
    int64_t min_seq = JV(j, J_MIN_SEQ);
    if (min_seq < 0)
        return 0;
    int64_t ahead = (seq - min_seq) & MASK32;
    if (ahead >= HALF)
        return 1;
    if (ahead > EPOCH_TRAIL)
        JV(j, J_MIN_SEQ) = (seq - EPOCH_TRAIL) & MASK32;
    return 0;
}

static inline int outside(job_t *j, const request_t *r)
{
    if (r->s < 0 || r->s >= JV(j, J_WINDOW)) {
        j->cnt[SC_BAD_SLOT] += 1;
        return 1;
    }
    if (r->count * r->itemsize > JV(j, J_MAX_BYTES)) {
        j->cnt[SC_BAD_PAYLOAD] += 1;
        return 1;
    }
    return 0;
}

static inline void nack_was_needless(job_t *j)
{
    j->cnt[SC_NACKS_NEEDLESS] += 1;
    int64_t now = JV(j, J_COMPLETIONS);
    JV(j, J_NACK_CALM_FROM) = now;
    int64_t gap = JV(j, J_NACK_GAP);
    if (gap > 0 && now - JV(j, J_NACK_WIDENED_AT) >= JV(j, J_WINDOW)) {
        int64_t wide = 2 * gap < JV(j, J_NACK_CAP) ? 2 * gap : JV(j, J_NACK_CAP);
        JV(j, J_NACK_GAP) = JV(j, J_NACK_BASE_GAP) > wide ? JV(j, J_NACK_BASE_GAP) : wide;
        JV(j, J_NACK_WIDENED_AT) = now;
    }
}

static inline void write_resent(job_t *j, replies_t *rp, int64_t k, int64_t rank,
                                const request_t *r)
{
    int64_t v = r->v, s = r->s;
    int64_t size = result_size(j, v, s);
    uint8_t *row = rp->rows + k * rp->rowlen;
    memcpy(row, BUF(j, v, s), (size_t)size);
    row[H_FLAGS] |= F_RESENT;
    reseal(j, row, size);
    rp->meta[k * 2] = rank;
    rp->meta[k * 2 + 1] = size;
}

/* Reply k: the result of an earlier round from the slot's history, marked RESENT. */
static inline void write_old(job_t *j, replies_t *rp, int64_t k, int64_t rank,
                             const request_t *r, int64_t hrow)
{
    const uint8_t *b = BUF(j, hrow, r->s);
    int64_t size = HDR + (b[H_ELEM] == E_INT32 ? 4 : 2) * rd_u16(b, H_COUNT) + JV(j, J_TRAILER)
                   + (JV(j, J_AUTH) ? DATA_TAG : 0);
    uint8_t *row = rp->rows + k * rp->rowlen;
    memcpy(row, b, (size_t)size);
    row[H_FLAGS] |= F_RESENT;
    reseal(j, row, size);
    rp->meta[k * 2] = rank;
    rp->meta[k * 2 + 1] = size;
}

/* Whether the open round (v, s) misses a gone rank: silent for J_MEMBER_TIMEOUT_US. */
static inline int waits_for_gone(job_t *j, double now, int64_t v, int64_t s)
{
    double quiet = now - (double)JV(j, J_MEMBER_TIMEOUT_US) * 1e-6;
    for (int64_t q = 0; q < JV(j, J_N); q++)
        if (!has_bit(j->seen, j, v, s, q) && j->heard[q] < quiet)
            return 1;
    return 0;
}

/* WAITING for a round that waits for no gone rank: the ranks missing, then an empty bitmap
   (Python writes the WAITINGs that name gone ranks, sealed). */
static inline void write_waiting(job_t *j, replies_t *rp, int64_t k, int64_t rank,
                                 const request_t *r)
{
    int64_t v = r->v, s = r->s, n = JV(j, J_N), nb = (n + 7) / 8;
    uint8_t *row = rp->rows + k * rp->rowlen;
    write_header(row, 0, T_WAITING, 0, v, rank, JV(j, J_JOB), JV(j, J_TOKEN), r->seq, r->chunk,
                 s + JV(j, J_SLOT_BASE), 2 * nb, E_BYTES, 0, EXP_ZERO, EXP_ZERO);
    memset(row + HDR, 0, (size_t)(2 * nb));
    for (int64_t q = 0; q < n; q++)
        if (!has_bit(j->seen, j, v, s, q))
            row[HDR + (q >> 3)] |= (uint8_t)(1 << (q & 7));
    rp->meta[k * 2] = rank;
    rp->meta[k * 2 + 1] = HDR + 2 * nb;
}

/* Answer a re-sent request (aggregate.py's _answer_resend): SS_DONE when written, else what
   Python answers instead (SS_WAITING_CONFLICT, SS_WAITING_GONE). */
static inline int64_t answer_resend(job_t *j, double now, replies_t *rp, int64_t k,
                                    int64_t rank, const request_t *r, int64_t action)
{
    if (r->flags & F_RESENT)
        nack_was_needless(j);
    if (action == A_ANSWER_WAITING && any_bit(j->conflict, j, r->v, r->s))
        return SS_WAITING_CONFLICT;
    if (action == A_ANSWER_WAITING && waits_for_gone(j, now, r->v, r->s))
        return SS_WAITING_GONE;
    if (action == A_RESEND_RESULT || action == A_ANSWER_LATE) {
        write_resent(j, rp, k, rank, r);
        j->cnt[action == A_RESEND_RESULT ? SC_RESULTS_RESENT : SC_LATE_ANSWERED] += 1;
    } else {
        write_waiting(j, rp, k, rank, r);
        j->cnt[SC_WAITING_SENT] += 1;
        j->cnt[SC_DUPLICATE] += 1;
    }
    return SS_DONE;
}

/* Aggregate the REQUESTs of one job in a batch from datagram `start` on (aggregate.py's
   switch_requests). Returns next; *ndone_out, *nreply_out, *code_out. */
static int64_t switch_requests(job_t *j, const uint8_t *d, int64_t dn, const int64_t *starts,
                               const int64_t *lens, const int64_t *srcs, int64_t nseg,
                               int64_t start, double now, int64_t *done, replies_t *rp,
                               int64_t *ndone_out, int64_t *nreply_out, int64_t *code_out)
{
    int64_t ndone = 0, nnack = 0, i = start, code = SS_DONE;
    while (i < nseg) {
        int64_t o = starts[i], ln = lens[i];
        if (o < 0 || ln < 0 || ln > dn - o || !member_request(d, o, ln, srcs[i], j)) {
            code = SS_OTHER;
            break;
        }
        if (JV(j, J_AUTH) && !data_sealed(JV(j, J_MAC_K0), JV(j, J_MAC_K1), d + o, ln)) {
            j->cnt[SC_BAD_MAC] += 1; /* forged or damaged: dropped before it touches state */
            i += 1;
            continue;
        }
        request_t r = parse(d, o, JV(j, J_SLOT_BASE));
        if (before_epoch(j, r.seq)) {
            code = SS_OTHER; /* from before a restart: Python tells it */
            break;
        }
        int64_t rank = rd_u16(d, o + H_RANK);
        j->heard[rank] = now;
        if (outside(j, &r)) {
            i += 1;
            continue;
        }
        int64_t action = action_of(j, &r, rank);
        if ((action == A_ANSWER_LATE || action == A_ANSWER_OLD) && !(r.flags & F_RETRY))
            /* a first transmission: the round's multicast reaches this rank anyway */
            action = action == A_ANSWER_LATE ? A_DROP_LATE : A_DROP_STALE;
        if (action == A_ANSWER_OLD) {
            int64_t hrow = find_old(j, &r);
            if (hrow < 0) {
                code = SS_ROUND_GONE; /* gone from the history too: Python answers GONE */
                break;
            } else {
                write_old(j, rp, nnack, rank, &r, hrow);
                j->cnt[SC_OLD_ANSWERED] += 1;
                nnack += 1;
                i += 1;
                if (nnack == rp->nrows) {
                    code = SS_REPLIES_FULL;
                    break;
                }
                continue;
            }
        }
        if (action == A_DROP_STALE || action == A_DROP_LATE) {
            j->cnt[action == A_DROP_STALE ? SC_STALE : SC_LATE_DUPLICATE] += 1;
            i += 1;
            continue;
        }
        if (action == A_RESEND_RESULT || action == A_ANSWER_WAITING || action == A_ANSWER_LATE) {
            int64_t stop = answer_resend(j, now, rp, nnack, rank, &r, action);
            if (stop != SS_DONE) {
                code = stop;
                break;
            }
            nnack += 1;
            i += 1;
            if (nnack == rp->nrows) {
                code = SS_REPLIES_FULL;
                break;
            }
            continue;
        }
        if (action == A_REFUSE_MISMATCH) {
            code = SS_MISMATCH;
            break;
        }
        const uint8_t *pay = d + o + HDR;
        int conflicted = 0;
        if (action == A_START_ROUND)
            start_round(j, &r, rank, pay, now);
        else
            conflicted = add(j, &r, rank, pay);
        clear_bit(j->seen, j, 1 - r.v, r.s, rank); /* frees the rank from the other set */
        if (behind_on(j, rank, &r)) {
            write_nack(j, rp, nnack, rank, r.seq);
            j->cnt[SC_NACKS] += 1;
            nnack += 1;
        }
        if (STV(j, S_MISSING, r.v, r.s) == 0) {
            complete(j, &r, rank, done, ndone);
            ndone += 1;
        }
        i += 1;
        if (conflicted) {
            code = SS_CONFLICT_ADDED;
            break;
        }
        if (nnack == rp->nrows) {
            code = SS_REPLIES_FULL;
            break;
        }
    }
    *ndone_out = ndone;
    *nreply_out = nnack;
    *code_out = code;
    return i;
}

/* Cut completed rounds pend[:n] (rows (set, slot, length)) into UDP GSO runs; runs[r] =
   (first, count, size, contiguous) (aggregate.py's plan_result_runs). */
static int64_t plan_result_runs(const int64_t *pend, int64_t n, int64_t stride,
                                int64_t max_segments, int64_t max_bytes, int64_t *runs)
{
    int64_t nr = 0, i = 0;
    while (i < n) {
        int64_t size = pend[i * 3 + 2];
        int64_t contig = size == stride, count = 1, k = i + 1;
        while (k < n && count < max_segments && (count + 1) * size <= max_bytes) {
            int64_t ln = pend[k * 3 + 2];
            if (ln > size)
                break;
            if (contig && (pend[k * 3] != pend[(k - 1) * 3]
                           || pend[k * 3 + 1] != pend[(k - 1) * 3 + 1] + 1))
                contig = 0;
            count += 1;
            k += 1;
            if (ln < size)
                break;
        }
        runs[nr * 4] = i;
        runs[nr * 4 + 1] = count;
        runs[nr * 4 + 2] = size;
        runs[nr * 4 + 3] = contig;
        nr += 1;
        i = k;
    }
    return nr;
}

/* ---- a rack's relay (relay.py) --------------------------------------------------------- */

typedef struct {
    int64_t *rv, *ust, *cnt;
    double *utimes;
    int64_t W; /* lanes: ust.shape[2] */
} relay_t;

#define USTV(r, f, v, s) ((r)->ust[((int64_t)(f) * 2 + (v)) * (r)->W + (s)])
#define UTV(r, f, v, s) ((r)->utimes[((int64_t)(f) * 2 + (v)) * (r)->W + (s)])

static inline void retag(uint8_t *b, int64_t mtype, int64_t rank, int64_t job, int64_t token,
                         int64_t slot)
{
    b[H_TYPE] = (uint8_t)mtype;
    b[H_FLAGS] = b[H_FLAGS] & ~F_RESENT;
    put16(b, H_RANK, rank);
    put32(b, H_JOB, job);
    put64(b, H_TOKEN, token);
    put32(b, H_SLOT, slot);
}

static inline int parent_result(const uint8_t *d, int64_t o, int64_t ln, const int64_t *rv)
{
    if (ln < HDR || rd_u16(d, o + H_MAGIC) != MAGIC || d[o + H_VERSION] != VERSION
        || d[o + H_TYPE] != T_RESULT)
        return 0;
    if (d[o + H_SET] > 1 || ((int64_t)d[o + H_FLAGS] & ~(int64_t)KNOWN_FLAGS) != 0)
        return 0;
    int64_t elem = d[o + H_ELEM];
    int64_t isz = elem == E_INT32 ? 4 : (elem == E_INT16 ? 2 : 0);
    return isz != 0 && ln == HDR + isz * rd_u16(d, o + H_COUNT)
           && rd_u32(d, o + H_JOB) == rv[RV_PARENT_JOB]
           && rd_i64(d, o + H_TOKEN) == rv[RV_PARENT_TOKEN];
}

/* ---- the switch's sends and compiled loop (transport/switchpath.py) --------------------- */

typedef struct {
    int fd;
    int64_t max_segments, max_bytes;
    int64_t *runs, *stats; /* stats: XC_* */
    struct iovec iov[MAX_IOV];
} rsender_t;

static int send_to(rsender_t *s, const uint8_t *name, struct iovec *iov, size_t niov,
                   int64_t count, int64_t size)
{
    if (send_run(s->fd, name, iov, niov, count, size) < 0) {
        s->stats[errno == EAGAIN ? XC_BLOCKED : XC_ERRORS] += count;
        return 0;
    }
    s->stats[XC_SEND_CALLS] += 1;
    s->stats[XC_DATAGRAMS_SENT] += count;
    return 1;
}

/* A job's completed rounds pend[:n] to each joined member (names: rows of struct
   sockaddr_in by rank, family 0: none): one sendmsg per GSO run and member. Returns the
   result datagrams handed to the kernel or lost. */
static int64_t send_results(rsender_t *s, const int64_t *pend, int64_t n, const uint8_t *bufs,
                            int64_t W, int64_t stride, const uint8_t *names, int64_t nnames)
{
    int64_t nr = plan_result_runs(pend, n, stride, s->max_segments, s->max_bytes, s->runs);
    int64_t set_bytes = W * stride, out = 0;
    for (int64_t r = 0; r < nr; r++) {
        int64_t first = s->runs[r * 4], count = s->runs[r * 4 + 1];
        int64_t size = s->runs[r * 4 + 2], contiguous = s->runs[r * 4 + 3];
        size_t niov;
        if (contiguous) {
            s->iov[0].iov_base = (void *)(bufs + pend[first * 3] * set_bytes
                                          + pend[first * 3 + 1] * stride);
            s->iov[0].iov_len = (size_t)((count - 1) * stride + pend[(first + count - 1) * 3 + 2]);
            niov = 1;
        } else {
            for (int64_t k = 0; k < count; k++) {
                const int64_t *row = pend + (first + k) * 3;
                s->iov[k].iov_base = (void *)(bufs + row[0] * set_bytes + row[1] * stride);
                s->iov[k].iov_len = (size_t)row[2];
            }
            niov = (size_t)count;
        }
        for (int64_t m = 0; m < nnames; m++) {
            if (names[m * 16] == 0)
                continue;
            out += count;
            send_to(s, names + m * 16, s->iov, niov, count, size);
        }
    }
    return out;
}

static void send_replies(rsender_t *s, replies_t *rp, int64_t nreply, const uint8_t *names,
                         int64_t nnames)
{
    for (int64_t k = 0; k < nreply; k++) {
        int64_t rank = rp->meta[k * 2];
        if (rank < 0 || rank >= nnames)
            continue;
        s->iov[0].iov_base = rp->rows + k * rp->rowlen;
        s->iov[0].iov_len = (size_t)rp->meta[k * 2 + 1];
        send_to(s, names + rank * 16, s->iov, 1, 1, rp->meta[k * 2 + 1]);
    }
}

#define HOT_MAX 4 /* protocol/switch.py's HOT_JOBS */

typedef struct {
    job_t job[HOT_MAX];
    const uint8_t *names[HOT_MAX];
    int64_t nnames[HOT_MAX];
    int64_t njobs;
} hot_t;

static inline int64_t job_at(const uint8_t *buf, int64_t buf_n, const int64_t *starts,
                             const int64_t *lens, int64_t i, const hot_t *hot)
{
    if (lens[i] < HDR || starts[i] < 0 || starts[i] > buf_n - HDR)
        return -1;
    int64_t job = rd_u32(buf, starts[i] + H_JOB);
    for (int64_t k = 0; k < hot->njobs; k++)
        if (hot->job[k].jobv[J_JOB] == job)
            return k;
    return -1;
}

/* Receive, aggregate the hot jobs' requests and send their results and replies, and wait in
   poll (on the socket and wake_fd; -1: none) until something needs Python, or another thread
   asks for the dataplane (asks[0] nonzero): switchpath.py's switch_pump. */
static int switch_pump(hot_t *hot, rsender_t *s, receiver_t *rx, double max_wait_s,
                       const int64_t *asks, int64_t *stats, int64_t *taken_by, int64_t *done,
                       replies_t *rp, int64_t *out)
{
    double idle_since = now_s();
    out[0] = out[1] = out[2] = out[3] = 0;
    while (1) {
        if (__atomic_load_n(&asks[0], __ATOMIC_RELAXED) != 0)
            return FP_WAKE;
        int n = recvmmsg(rx->fd, rx->msgs, (unsigned)rx->count, MSG_DONTWAIT, NULL);
        if (n <= 0) {
            if (n < 0 && errno != EAGAIN) {
                stats[SP_ERRNO] = errno;
                return FP_RECV_FAILED;
            }
            double now = now_s();
            if (now - idle_since >= max_wait_s)
                return FP_WAKE;
            struct pollfd pfd[2] = {{rx->fd, POLLIN, 0}, {rx->wake_fd, POLLIN, 0}};
            int r = poll(pfd, rx->wake_fd >= 0 ? 2 : 1,
                         (int)((idle_since + max_wait_s - now) * 1e3) + 1);
            if (r < 0) {
                stats[SP_ERRNO] = errno;
                return FP_RECV_FAILED; /* (EINTR: Python's turn) */
            }
            if (rx->wake_fd >= 0 && (pfd[1].revents & POLLIN))
                return FP_WAKE;
            continue;
        }
        stats[SP_RECV_CALLS] += 1;
        int64_t nseg = split_mmsg(rx, n);
        double now = now_s();
        idle_since = now;
        int64_t at = 0;
        int64_t k = nseg > 0 ? job_at(rx->buf, rx->buf_n, rx->starts, rx->lens, 0, hot) : 0;
        k = k < 0 ? 0 : k;
        while (1) {
            int64_t start = at, ndone, nreply, code;
            at = switch_requests(&hot->job[k], rx->buf, rx->buf_n, rx->starts, rx->lens,
                                 rx->senders, nseg, start, now, done, rp, &ndone, &nreply, &code);
            stats[SP_TAKEN] += at - start;
            taken_by[k] += at - start;
            if (nreply) {
                send_replies(s, rp, nreply, hot->names[k], hot->nnames[k]);
                stats[SP_REPLIES] += nreply;
            }
            if (ndone)
                stats[SP_RESULTS] += send_results(s, done, ndone, hot->job[k].bufs,
                                                  hot->job[k].W, hot->job[k].stride,
                                                  hot->names[k], hot->nnames[k]);
            if (code == SS_DONE)
                break;
            if (code == SS_REPLIES_FULL)
                continue; /* (sent above: the rows are free again) */
            if (code == SS_OTHER) {
                int64_t k2 = job_at(rx->buf, rx->buf_n, rx->starts, rx->lens, at, hot);
                if (k2 >= 0 && k2 != k) {
                    k = k2;
                    continue;
                }
            }
            out[0] = at, out[1] = nseg, out[2] = code, out[3] = k;
            return FP_STOPPED;
        }
    }
}

/* ---- Python's side --------------------------------------------------------------------- */

/* A job's arrays from args[at..at+8]: jobv, st, seen, conflict, bufs, clog, cursor, mkeys,
   heard; checked against each other so that no rule indexes past them. */
static int get_job(bufs_t *b, PyObject *const *args, int at, job_t *j)
{
    Py_buffer *v;
    memset(j, 0, sizeof *j);
#define GET(name, kinds) if (!(v = getbuf(b, args[at++], name, kinds, 1))) return -1
    GET("jobv", B(K_I64)); j->jobv = v->buf;
    if (v->len / 8 < J_FIELDS) goto bad;
    GET("st", B(K_I64)); j->st = v->buf;
    if (v->ndim != 3 || v->shape[0] != S_FIELDS || v->shape[1] != 2) goto bad;
    j->W = v->shape[2];
    GET("seen", B(K_I64)); j->seen = v->buf;
    if (v->ndim != 3 || v->shape[0] != 2 || v->shape[1] != j->W) goto bad;
    j->words = v->shape[2];
    GET("conflict", B(K_I64)); j->conflict = v->buf;
    if (v->ndim != 3 || v->shape[0] != 2 || v->shape[1] != j->W || v->shape[2] != j->words)
        goto bad;
    GET("bufs", B(K_U8)); j->bufs = v->buf;
    if (v->ndim != 3 || v->shape[0] < 2 || v->shape[1] != j->W || v->shape[2] < HDR) goto bad;
    j->stride = v->shape[2];
    j->nsets = v->shape[0]; /* the two sets, then a quorum job's history rows */
    GET("clog", B(K_I64)); j->clog = v->buf;
    if (v->ndim != 2 || v->shape[1] != 4 || v->shape[0] < 1) goto bad;
    j->nclog = v->shape[0];
    int64_t n = j->jobv[J_N];
    GET("cursor", B(K_I64)); j->cursor = v->buf;
    if (v->len / 8 < n) goto bad;
    GET("mkeys", B(K_I64)); j->mkeys = v->buf;
    if (v->len / 8 < n) goto bad;
    GET("heard", B(K_F64)); j->heard = v->buf;
    if (v->len / 8 < n) goto bad;
#undef GET
    if (n < 1 || n > 64 * j->words || j->jobv[J_WINDOW] > j->W || j->jobv[J_WINDOW] < 0
        || j->jobv[J_MAX_BYTES] > j->stride - HDR || j->jobv[J_SHARDS] < 1
        || j->jobv[J_TRAILER] < 0 || j->jobv[J_TRAILER] > 8 * j->words
        || j->jobv[J_MAX_BYTES] + j->jobv[J_TRAILER] + (j->jobv[J_AUTH] ? DATA_TAG : 0)
               > j->stride - HDR
        || j->jobv[J_QUORUM] < 0 || j->jobv[J_QUORUM] > n
        || j->jobv[J_HISTORY] != j->nsets - 2)
        goto bad;
    return 0;
bad:
    PyErr_SetString(PyExc_ValueError, "switchml._switch: a job's arrays disagree with each "
                    "other or with its scalars (jobv)");
    return -1;
}

static int get_shared(bufs_t *b, PyObject *const *args, int at, job_t *j, int64_t **done,
                      int64_t *ndone_cap, replies_t *rp)
{
    Py_buffer *v;
    if (!(v = getbuf(b, args[at], "rules", B(K_I64), 0))) return -1;
    if (v->len / 8 != 48) {
        PyErr_SetString(PyExc_ValueError, "rules must be slots.action_table() (2x3x2x2x2)");
        return -1;
    }
    j->rules = v->buf;
    for (int i = 0; i < 48; i++)
        if (j->rules[i] < 0 || j->rules[i] > A_ANSWER_OLD) {
            PyErr_SetString(PyExc_ValueError, "rules hold an action that is not one");
            return -1;
        }
    if (!(v = getbuf(b, args[at + 1], "cnt", B(K_I64), 1))) return -1;
    if (v->len / 8 < SC_N) { PyErr_SetString(PyExc_ValueError, "cnt is too short"); return -1; }
    j->cnt = v->buf;
    if (!(v = getbuf(b, args[at + 2], "done", B(K_I64), 1))) return -1;
    if (v->ndim != 2 || v->shape[1] != 3) {
        PyErr_SetString(PyExc_ValueError, "done must be (rows, 3) int64");
        return -1;
    }
    *done = v->buf;
    *ndone_cap = v->shape[0];
    if (!(v = getbuf(b, args[at + 3], "replies", B(K_U8), 1))) return -1;
    if (v->ndim != 2) { PyErr_SetString(PyExc_ValueError, "replies must be 2-D"); return -1; }
    rp->rows = v->buf;
    rp->nrows = v->shape[0];
    rp->rowlen = v->shape[1];
    if (!(v = getbuf(b, args[at + 4], "reply_meta", B(K_I64), 1))) return -1;
    if (v->ndim != 2 || v->shape[1] != 2 || v->shape[0] < rp->nrows) {
        PyErr_SetString(PyExc_ValueError, "reply_meta must be (rows, 2) int64");
        return -1;
    }
    rp->meta = v->buf;
    return 0;
}

/* What the rows must hold for a job: a stored result, or WAITING's two bitmaps. */
static int check_rows(const job_t *j, const replies_t *rp, int64_t ndone_cap, int64_t nseg)
{
    int64_t nb = (j->jobv[J_N] + 7) / 8;
    if (rp->rowlen < j->stride || rp->rowlen < HDR + 2 * nb || rp->nrows < 1
        || ndone_cap < nseg) {
        PyErr_SetString(PyExc_ValueError, "switchml._switch: the reply rows are shorter than "
                        "a job's result or WAITING, or done holds fewer rows than the batch");
        return -1;
    }
    return 0;
}

/* switch_requests(d, starts, lens, srcs, nseg, start, now, jobv, st, seen, conflict, bufs,
                   clog, cursor, mkeys, heard, rules, cnt, done, replies, reply_meta)
   -> (next, ndone, nreply, code) */
static PyObject *py_switch_requests(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NEED(21);
    bufs_t b = {.n = 0};
    job_t j;
    replies_t rp;
    Py_buffer *d, *st, *ln, *sr;
    int64_t nseg, start, *done, ndone_cap, nxt, ndone, nreply, code;
    double now;
    ARR(d, 0, "d", B(K_U8), 0);
    ARR(st, 1, "starts", B(K_I64), 0);
    ARR(ln, 2, "lens", B(K_I64), 0);
    ARR(sr, 3, "srcs", B(K_I64), 0);
    I64(nseg, 4); I64(start, 5); F64(now, 6);
    if (get_job(&b, args, 7, &j) < 0) goto fail;
    if (get_shared(&b, args, 16, &j, &done, &ndone_cap, &rp) < 0) goto fail;
    if (nseg > st->len / 8 || nseg > ln->len / 8 || nseg > sr->len / 8 || start < 0) {
        PyErr_SetString(PyExc_ValueError, "nseg exceeds starts, lens or srcs");
        goto fail;
    }
    if (check_rows(&j, &rp, ndone_cap, nseg - start) < 0) goto fail;
    Py_BEGIN_ALLOW_THREADS
    nxt = switch_requests(&j, d->buf, d->len, st->buf, ln->buf, sr->buf, nseg, start, now, done,
                          &rp, &ndone, &nreply, &code);
    Py_END_ALLOW_THREADS
    release(&b);
    return Py_BuildValue("(LLLL)", (long long)nxt, (long long)ndone, (long long)nreply,
                         (long long)code);
fail:
    release(&b);
    return NULL;
}

/* expire_rounds(jobv, st, seen, conflict, bufs, clog, cursor, mkeys, heard, now, cnt, done)
   -> ndone */
static PyObject *py_expire_rounds(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NEED(12);
    bufs_t b = {.n = 0};
    job_t j;
    Py_buffer *v;
    double now;
    int64_t nd;
    if (get_job(&b, args, 0, &j) < 0) goto fail;
    F64(now, 9);
    if (!(v = getbuf(&b, args[10], "cnt", B(K_I64), 1))) goto fail;
    if (v->len / 8 < SC_N) { PyErr_SetString(PyExc_ValueError, "cnt is too short"); goto fail; }
    j.cnt = v->buf;
    if (!(v = getbuf(&b, args[11], "done", B(K_I64), 1))) goto fail;
    if (v->ndim != 2 || v->shape[1] != 3) {
        PyErr_SetString(PyExc_ValueError, "done must be (rows, 3) int64");
        goto fail;
    }
    nd = expire_rounds(&j, now, v->buf, v->shape[0]);
    release(&b);
    return PyLong_FromLongLong((long long)nd);
fail:
    release(&b);
    return NULL;
}

/* plan_result_runs(pend, n, stride, max_segments, max_bytes, runs) -> runs */
static PyObject *py_plan_result_runs(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NEED(6);
    bufs_t b = {.n = 0};
    Py_buffer *pend, *runs;
    int64_t n, stride, max_segments, max_bytes, nr;
    ARR(pend, 0, "pend", B(K_I64), 0);
    I64(n, 1); I64(stride, 2); I64(max_segments, 3); I64(max_bytes, 4);
    ARR(runs, 5, "runs", B(K_I64), 1);
    if (n < 0 || n > pend->len / 24 || n > runs->len / 32 || max_segments < 1) {
        PyErr_SetString(PyExc_ValueError, "plan_result_runs: n exceeds pend or runs");
        goto fail;
    }
    nr = plan_result_runs(pend->buf, n, stride, max_segments, max_bytes, runs->buf);
    release(&b);
    return PyLong_FromLongLong(nr);
fail:
    release(&b);
    return NULL;
}

/* log_releases(jobv, st, clog, sendq, nsend): a relay multicast the results of rounds
   sendq[:nsend] (rows (set, slot, ...)): log them now, in the order the children get them. */
static PyObject *py_log_releases(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NEED(5);
    bufs_t b = {.n = 0};
    job_t j;
    Py_buffer *v, *q;
    int64_t nsend, cols;
    memset(&j, 0, sizeof j);
    ARR(v, 0, "jobv", B(K_I64), 1); j.jobv = v->buf;
    if (v->len / 8 < J_FIELDS) goto bad;
    ARR(v, 1, "st", B(K_I64), 1); j.st = v->buf;
    if (v->ndim != 3 || v->shape[0] != S_FIELDS || v->shape[1] != 2) goto bad;
    j.W = v->shape[2];
    ARR(v, 2, "clog", B(K_I64), 1); j.clog = v->buf;
    if (v->ndim != 2 || v->shape[1] != 4 || v->shape[0] < 1) goto bad;
    j.nclog = v->shape[0];
    ARR(q, 3, "sendq", B(K_I64), 0);
    I64(nsend, 4);
    if (q->ndim != 2 || q->shape[1] < 2 || nsend < 0 || nsend > q->shape[0]) goto bad;
    cols = q->shape[1];
    for (int64_t k = 0; k < nsend; k++) {
        int64_t sv = ((int64_t *)q->buf)[k * cols], ss = ((int64_t *)q->buf)[k * cols + 1];
        if (sv < 0 || sv > 1 || ss < 0 || ss >= j.W) goto bad;
        log_release(&j, sv, ss, STV(&j, S_SEQ, sv, ss), STV(&j, S_CHUNK, sv, ss));
    }
    release(&b);
    Py_RETURN_NONE;
bad:
    PyErr_SetString(PyExc_ValueError, "log_releases: arrays of the wrong shape, or a round "
                    "outside the job's slots");
fail:
    release(&b);
    return NULL;
}

/* request_framing(d, o, n) -> bool */
static PyObject *py_request_framing(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NEED(3);
    bufs_t b = {.n = 0};
    Py_buffer *d;
    int64_t o, n;
    int r = 0;
    ARR(d, 0, "d", B(K_U8), 0);
    I64(o, 1); I64(n, 2);
    if (o >= 0 && n >= 0 && o + n <= d->len)
        r = request_framing(d->buf, o, n);
    release(&b);
    return PyBool_FromLong(r);
fail:
    release(&b);
    return NULL;
}

/* data_sealed(jobv, d) -> bool: whether d, a datagram of the authenticated job jobv with its
   MAC, verifies (the admission of a member's first request, in Python) */
static PyObject *py_data_sealed(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NEED(2);
    bufs_t b = {.n = 0};
    Py_buffer *jv, *d;
    int r = 0;
    ARR(jv, 0, "jobv", B(K_I64), 0);
    ARR(d, 1, "d", B(K_U8), 0);
    if (jv->len / 8 < J_FIELDS) {
        PyErr_SetString(PyExc_ValueError, "data_sealed: jobv is shorter than J_FIELDS");
        goto fail;
    }
    const int64_t *v = jv->buf;
    r = v[J_AUTH] && data_sealed(v[J_MAC_K0], v[J_MAC_K1], d->buf, d->len);
    release(&b);
    return PyBool_FromLong(r);
fail:
    release(&b);
    return NULL;
}

static int get_relay(bufs_t *b, PyObject *const *args, int rv_at, int ust_at, int ut_at,
                     relay_t *r)
{
    Py_buffer *v;
    memset(r, 0, sizeof *r);
    if (rv_at >= 0) {
        if (!(v = getbuf(b, args[rv_at], "rv", B(K_I64), 0))) return -1;
        if (v->len / 8 < RV_FIELDS) goto bad;
        r->rv = v->buf;
    }
    if (!(v = getbuf(b, args[ust_at], "ust", B(K_I64), 1))) return -1;
    if (v->ndim != 3 || v->shape[0] != U_FIELDS || v->shape[1] != 2) goto bad;
    r->ust = v->buf;
    r->W = v->shape[2];
    if (ut_at >= 0) {
        if (!(v = getbuf(b, args[ut_at], "utimes", B(K_F64), 1))) return -1;
        if (v->ndim != 3 || v->shape[0] != UT_FIELDS || v->shape[1] != 2 || v->shape[2] != r->W)
            goto bad;
        r->utimes = v->buf;
    }
    return 0;
bad:
    PyErr_SetString(PyExc_ValueError, "switchml._switch: a relay's arrays of the wrong shape");
    return -1;
}

/* relay_up(done, ndone, bufs, rv, up, ust, utimes, now, rto, cnt, sendq) -> n */
static PyObject *py_relay_up(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NEED(11);
    bufs_t b = {.n = 0};
    relay_t r;
    Py_buffer *dn, *bf, *up, *cn, *sq;
    int64_t ndone;
    double now, rto;
    ARR(dn, 0, "done", B(K_I64), 0);
    I64(ndone, 1);
    ARR(bf, 2, "bufs", B(K_U8), 0);
    if (get_relay(&b, args, 3, 5, 6, &r) < 0) goto fail;
    ARR(up, 4, "up", B(K_U8), 1);
    F64(now, 7); F64(rto, 8);
    ARR(cn, 9, "cnt", B(K_I64), 1);
    ARR(sq, 10, "sendq", B(K_I64), 1);
    if (bf->ndim != 3 || bf->shape[0] != 2 || up->ndim != 3 || up->shape[0] != 2 || up->shape[1] != r.W
        || dn->ndim != 2 || dn->shape[1] != 3 || ndone < 0 || ndone > dn->shape[0]
        || sq->ndim != 2 || sq->shape[1] != 3 || ndone > sq->shape[0] || cn->len / 8 < RC_N) {
        PyErr_SetString(PyExc_ValueError, "relay_up: arrays of the wrong shape");
        goto fail;
    }
    {
        const int64_t *done = dn->buf;
        int64_t *sendq = sq->buf, *cnt = cn->buf, bW = bf->shape[1], bstride = bf->shape[2];
        int64_t ustride = up->shape[2];
        for (int64_t k = 0; k < ndone; k++) {
            int64_t v = done[k * 3], s = done[k * 3 + 1], ln = done[k * 3 + 2];
            if (v < 0 || v > 1 || s < 0 || s >= r.W || s >= bW || ln < HDR || ln > bstride
                || ln > ustride) {
                PyErr_SetString(PyExc_ValueError, "relay_up: a round outside the arrays");
                goto fail;
            }
            uint8_t *q = (uint8_t *)up->buf + (v * r.W + s) * ustride;
            memcpy(q, (const uint8_t *)bf->buf + (v * bW + s) * bstride, (size_t)ln);
            retag(q, T_REQUEST, r.rv[RV_RACK], r.rv[RV_PARENT_JOB], r.rv[RV_PARENT_TOKEN],
                  r.rv[RV_PARENT_BASE] + s);
            USTV(&r, U_STATE, v, s) = U_SENT;
            USTV(&r, U_SEQ, v, s) = rd_u32(q, H_SEQ);
            USTV(&r, U_CHUNK, v, s) = rd_u32(q, H_CHUNK);
            USTV(&r, U_LEN, v, s) = ln;
            USTV(&r, U_TRIES, v, s) = 0;
            UTV(&r, UT_FIRST_SENT, v, s) = now;
            UTV(&r, UT_DUE, v, s) = now + rto;
            sendq[k * 3] = v;
            sendq[k * 3 + 1] = s;
            sendq[k * 3 + 2] = ln;
            cnt[RC_UPSTREAM_SENT] += 1;
        }
    }
    release(&b);
    return PyLong_FromLongLong(ndone);
fail:
    release(&b);
    return NULL;
}

/* relay_down(d, starts, lens, nseg, start, rv, ust, down, cnt, sendq) -> (next, nsend) */
static PyObject *py_relay_down(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NEED(10);
    bufs_t b = {.n = 0};
    relay_t r;
    Py_buffer *d, *st, *ln, *dw, *cn, *sq;
    int64_t nseg, start, i, nsend = 0;
    ARR(d, 0, "d", B(K_U8), 0);
    ARR(st, 1, "starts", B(K_I64), 0);
    ARR(ln, 2, "lens", B(K_I64), 0);
    I64(nseg, 3); I64(start, 4);
    if (get_relay(&b, args, 5, 6, -1, &r) < 0) goto fail;
    ARR(dw, 7, "down", B(K_U8), 1);
    ARR(cn, 8, "cnt", B(K_I64), 1);
    ARR(sq, 9, "sendq", B(K_I64), 1);
    if (dw->ndim != 3 || dw->shape[0] != 2 || dw->shape[1] != r.W || nseg > st->len / 8
        || nseg > ln->len / 8 || start < 0 || sq->ndim != 2 || sq->shape[1] != 3
        || sq->shape[0] < nseg - start || cn->len / 8 < RC_N) {
        PyErr_SetString(PyExc_ValueError, "relay_down: arrays of the wrong shape");
        goto fail;
    }
    {
        const uint8_t *dd = d->buf;
        const int64_t *starts = st->buf, *lens = ln->buf;
        int64_t *sendq = sq->buf, *cnt = cn->buf, dstride = dw->shape[2];
        i = start;
        while (i < nseg) {
            int64_t o = starts[i], l = lens[i];
            if (o < 0 || l < 0 || l > d->len - o || !parent_result(dd, o, l, r.rv))
                break;
            i += 1;
            int64_t v = dd[o + H_SET];
            int64_t lane = rd_u32(dd, o + H_SLOT) - r.rv[RV_PARENT_BASE];
            if (lane < 0 || lane >= r.W || USTV(&r, U_STATE, v, lane) != U_SENT
                || USTV(&r, U_SEQ, v, lane) != rd_u32(dd, o + H_SEQ)
                || USTV(&r, U_CHUNK, v, lane) != rd_u32(dd, o + H_CHUNK)) {
                cnt[RC_PARENT_DUPLICATES] += 1;
                continue;
            }
            if (l > dstride) {
                cnt[RC_PARENT_DUPLICATES] += 1;
                continue;
            }
            uint8_t *q = (uint8_t *)dw->buf + (v * r.W + lane) * dstride;
            memcpy(q, dd + o, (size_t)l);
            retag(q, T_RESULT, 0, r.rv[RV_CHILD_JOB], r.rv[RV_CHILD_TOKEN],
                  r.rv[RV_CHILD_BASE] + lane);
            USTV(&r, U_STATE, v, lane) = U_ANSWERED;
            USTV(&r, U_RESULT_LEN, v, lane) = l;
            sendq[nsend * 3] = v;
            sendq[nsend * 3 + 1] = lane;
            sendq[nsend * 3 + 2] = l;
            nsend += 1;
            cnt[RC_PARENT_RESULTS] += 1;
        }
    }
    release(&b);
    return Py_BuildValue("(LL)", (long long)i, (long long)nsend);
fail:
    release(&b);
    return NULL;
}

/* relay_next_due(ust, utimes) -> the earliest deadline of an unanswered request (inf) */
static PyObject *py_relay_next_due(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NEED(2);
    bufs_t b = {.n = 0};
    relay_t r;
    double best = INFINITY;
    if (get_relay(&b, args, -1, 0, 1, &r) < 0) goto fail;
    for (int64_t v = 0; v < 2; v++)
        for (int64_t s = 0; s < r.W; s++)
            if (USTV(&r, U_STATE, v, s) == U_SENT && UTV(&r, UT_DUE, v, s) < best)
                best = UTV(&r, UT_DUE, v, s);
    release(&b);
    return PyFloat_FromDouble(best);
fail:
    release(&b);
    return NULL;
}

/* relay_due(ust, utimes, now, rto, max_rto, out) -> n: unanswered requests past their
   deadline, into out (set, lane), backed off. */
static PyObject *py_relay_due(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NEED(6);
    bufs_t b = {.n = 0};
    relay_t r;
    Py_buffer *ov;
    double now, rto, max_rto;
    int64_t n = 0;
    if (get_relay(&b, args, -1, 0, 1, &r) < 0) goto fail;
    F64(now, 2); F64(rto, 3); F64(max_rto, 4);
    ARR(ov, 5, "out", B(K_I64), 1);
    if (ov->ndim != 2 || ov->shape[1] < 2 || ov->shape[0] < 2 * r.W) {
        PyErr_SetString(PyExc_ValueError, "relay_due: out must hold (2 x lanes, 2) int64");
        goto fail;
    }
    {
        int64_t *out = ov->buf, cols = ov->shape[1];
        for (int64_t v = 0; v < 2; v++)
            for (int64_t s = 0; s < r.W; s++)
                if (USTV(&r, U_STATE, v, s) == U_SENT && UTV(&r, UT_DUE, v, s) <= now) {
                    USTV(&r, U_TRIES, v, s) += 1;
                    double back = rto * pow(2.0, (double)USTV(&r, U_TRIES, v, s));
                    UTV(&r, UT_DUE, v, s) = now + (back < max_rto ? back : max_rto);
                    out[n * cols] = v;
                    out[n * cols + 1] = s;
                    n += 1;
                }
    }
    release(&b);
    return PyLong_FromLongLong(n);
fail:
    release(&b);
    return NULL;
}

static int get_rsender(bufs_t *b, PyObject *fd, PyObject *maxseg, PyObject *maxbytes,
                       PyObject *runs, PyObject *stats, rsender_t *s)
{
    Py_buffer *v;
    int64_t f;
    memset(s, 0, sizeof *s);
    if (arg_i64(fd, &f) < 0) return -1;
    s->fd = (int)f;
    if (arg_i64(maxseg, &s->max_segments) < 0) return -1;
    if (arg_i64(maxbytes, &s->max_bytes) < 0) return -1;
    if (s->max_segments < 1 || s->max_segments > MAX_IOV) {
        PyErr_Format(PyExc_ValueError, "max_segments must be 1..%d", MAX_IOV);
        return -1;
    }
    if (!(v = getbuf(b, runs, "runs", B(K_I64), 1))) return -1;
    if (v->ndim != 2 || v->shape[1] != 4) {
        PyErr_SetString(PyExc_ValueError, "runs must be (rows, 4) int64");
        return -1;
    }
    s->runs = v->buf;
    int64_t nruns = v->shape[0];
    if (!(v = getbuf(b, stats, "stats", B(K_I64), 1))) return -1;
    if (v->len / 8 < XC_N) { PyErr_SetString(PyExc_ValueError, "stats is too short"); return -1; }
    s->stats = v->buf;
    return (int)(nruns > 0x7fffffff ? 0x7fffffff : nruns);
}

static int check_pend(const int64_t *pend, int64_t n, int64_t W, int64_t stride)
{
    for (int64_t k = 0; k < n; k++) {
        const int64_t *row = pend + k * 3;
        if (row[0] < 0 || row[0] > 1 || row[1] < 0 || row[1] >= W || row[2] < 0
            || row[2] > stride) {
            PyErr_SetString(PyExc_ValueError, "send_results: a result outside the job's slots");
            return -1;
        }
    }
    return 0;
}

/* send_results(fd, pend, n, bufs, names, max_segments, max_bytes, runs, stats) -> sent */
static PyObject *py_send_results(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NEED(9);
    bufs_t b = {.n = 0};
    rsender_t *s = PyMem_Malloc(sizeof(rsender_t));
    Py_buffer *pend, *bf, *nm;
    int64_t n, out = 0;
    int nruns;
    if (!s) return PyErr_NoMemory();
    ARR(pend, 1, "pend", B(K_I64), 0);
    I64(n, 2);
    ARR(bf, 3, "bufs", B(K_U8), 0);
    ARR(nm, 4, "names", B(K_U8), 0);
    if ((nruns = get_rsender(&b, args[0], args[5], args[6], args[7], args[8], s)) < 0) goto fail;
    if (bf->ndim != 3 || bf->shape[0] < 2 || nm->ndim != 2 || nm->shape[1] != 16 || n < 0
        || n > pend->len / 24 || n > nruns
        || check_pend(pend->buf, n, bf->shape[1], bf->shape[2]) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "send_results: arrays of the wrong shape");
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    out = send_results(s, pend->buf, n, bf->buf, bf->shape[1], bf->shape[2], nm->buf,
                       nm->shape[0]);
    Py_END_ALLOW_THREADS
    release(&b);
    PyMem_Free(s);
    return PyLong_FromLongLong(out);
fail:
    release(&b);
    PyMem_Free(s);
    return NULL;
}

/* switch_pump(fd, wake_fd, max_wait_s, asks, stats, taken_by, sstats, jobs, rules, cnt, done,
               replies, reply_meta, max_segments, max_bytes, runs,
               msgs_addr, count, raw, msg_len_at, controllen_at, rx_names, control,
               slot_bytes, gro, sol_udp, udp_gro, buf, starts, lens, senders)
   jobs: a sequence of (jobv, st, seen, conflict, bufs, clog, cursor, mkeys, heard, names),
   the hot jobs. -> (why, at, nseg, code, k) */
static PyObject *py_switch_pump(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NEED(31);
    bufs_t b = {.n = 0};
    hot_t *hot = PyMem_Calloc(1, sizeof(hot_t));
    rsender_t *s = PyMem_Malloc(sizeof(rsender_t));
    receiver_t rx;
    replies_t rp;
    job_t shared;
    Py_buffer *v, *asks, *stats, *taken;
    PyObject *seq = NULL;
    int64_t tmp, *done, ndone_cap, out[4];
    double max_wait_s;
    int why, nruns;
    if (!hot || !s) {
        PyMem_Free(hot);
        PyMem_Free(s);
        return PyErr_NoMemory();
    }
    memset(&rx, 0, sizeof rx);
    memset(&shared, 0, sizeof shared);
    I64(tmp, 0); rx.fd = (int)tmp;
    I64(tmp, 1); rx.wake_fd = (int)tmp;
    F64(max_wait_s, 2);
    ARR(asks, 3, "asks", B(K_I64), 0);
    if (asks->len < 8) { PyErr_SetString(PyExc_ValueError, "asks must hold one int64"); goto fail; }
    ARR(stats, 4, "stats", B(K_I64), 1);
    if (stats->len / 8 < SP_N) { PyErr_SetString(PyExc_ValueError, "stats is too short"); goto fail; }
    ARR(taken, 5, "taken_by", B(K_I64), 1);
    if ((nruns = get_rsender(&b, args[0], args[13], args[14], args[15], args[6], s)) < 0)
        goto fail;
    if (nruns < 4096) { PyErr_SetString(PyExc_ValueError, "runs must hold MAX_BATCH rows"); goto fail; }
    if (get_shared(&b, args, 8, &shared, &done, &ndone_cap, &rp) < 0) goto fail;
    seq = PySequence_Fast(args[7], "jobs must be a sequence of the hot jobs' arrays");
    if (!seq) goto fail;
    hot->njobs = PySequence_Fast_GET_SIZE(seq);
    if (hot->njobs < 1 || hot->njobs > HOT_MAX || taken->len / 8 < hot->njobs) {
        PyErr_Format(PyExc_ValueError, "switch_pump takes 1 to %d hot jobs", HOT_MAX);
        goto fail;
    }
    for (int64_t k = 0; k < hot->njobs; k++) {
        PyObject *t = PySequence_Fast(PySequence_Fast_GET_ITEM(seq, k), "a job's arrays");
        if (!t) goto fail;
        if (PySequence_Fast_GET_SIZE(t) != 10) {
            Py_DECREF(t);
            PyErr_SetString(PyExc_ValueError, "a hot job is (jobv, st, seen, conflict, bufs, "
                            "clog, cursor, mkeys, heard, names)");
            goto fail;
        }
        PyObject *const *items = PySequence_Fast_ITEMS(t);
        int bad = get_job(&b, items, 0, &hot->job[k]) < 0;
        if (!bad && !(v = getbuf(&b, items[9], "names", B(K_U8), 0)))
            bad = 1;
        Py_DECREF(t); /* (the buffers hold their arrays) */
        if (bad) goto fail;
        if (v->ndim != 2 || v->shape[1] != 16) {
            PyErr_SetString(PyExc_ValueError, "names must be (ranks, 16) bytes");
            goto fail;
        }
        hot->names[k] = v->buf;
        hot->nnames[k] = v->shape[0];
        hot->job[k].rules = shared.rules;
        hot->job[k].cnt = shared.cnt;
        if (check_rows(&hot->job[k], &rp, ndone_cap, MAX_BATCH) < 0) goto fail;
    }
    if (get_receiver(&b, args, 16, MAX_BATCH, &rx) < 0) goto fail;
    Py_BEGIN_ALLOW_THREADS
    why = switch_pump(hot, s, &rx, max_wait_s, asks->buf, stats->buf, taken->buf, done, &rp,
                      out);
    Py_END_ALLOW_THREADS
    Py_XDECREF(seq);
    release(&b);
    PyMem_Free(hot);
    PyMem_Free(s);
    return Py_BuildValue("(iLLLL)", why, (long long)out[0], (long long)out[1],
                         (long long)out[2], (long long)out[3]);
fail:
    Py_XDECREF(seq);
    release(&b);
    PyMem_Free(hot);
    PyMem_Free(s);
    return NULL;
}

static PyMethodDef methods[] = {
    M(switch_requests, "switch_requests(d, starts, lens, srcs, nseg, start, now, jobv, st, "
      "seen, conflict, bufs, clog, cursor, mkeys, heard, rules, cnt, done, replies, "
      "reply_meta) -> (next, ndone, nreply, code): aggregate one job's REQUESTs of a batch"),
    M(plan_result_runs, "plan_result_runs(pend, n, stride, max_segments, max_bytes, runs) "
      "-> runs"),
    M(expire_rounds, "expire_rounds(jobv, st, seen, conflict, bufs, clog, cursor, mkeys, heard, "
      "now, cnt, done) -> ndone: complete a quorum job's rounds at their deadline"),
    M(log_releases, "log_releases(jobv, st, clog, sendq, nsend)"),
    M(request_framing, "request_framing(d, o, n) -> bool"),
    M(data_sealed, "data_sealed(jobv, d) -> bool"),
    M(relay_up, "relay_up(done, ndone, bufs, rv, up, ust, utimes, now, rto, cnt, sendq) -> n"),
    M(relay_down, "relay_down(d, starts, lens, nseg, start, rv, ust, down, cnt, sendq) "
      "-> (next, nsend)"),
    M(relay_next_due, "relay_next_due(ust, utimes) -> float"),
    M(relay_due, "relay_due(ust, utimes, now, rto, max_rto, out) -> n"),
    M(send_results, "send_results(fd, pend, n, bufs, names, max_segments, max_bytes, runs, "
      "stats) -> datagrams"),
    M(switch_pump, "switch_pump(...) -> (why, at, nseg, code, k): the switch's compiled "
      "receive-aggregate-send loop"),
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "switchml._switch",
    "The switch's per-request rules, a rack's relay and the switch's receive-aggregate-send "
    "loop, compiled when the package is built (src/switchml/csrc/switch.c).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__switch(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "J_FIELDS", J_FIELDS) < 0
        || PyModule_AddIntConstant(m, "S_FIELDS", S_FIELDS) < 0
        || PyModule_AddIntConstant(m, "SC_N", SC_N) < 0
        || PyModule_AddIntConstant(m, "U_FIELDS", U_FIELDS) < 0
        || PyModule_AddIntConstant(m, "HDR", HDR) < 0
        || PyModule_AddIntConstant(m, "MAX_BATCH", MAX_BATCH) < 0
        || PyModule_AddIntConstant(m, "HOT_MAX", HOT_MAX) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
