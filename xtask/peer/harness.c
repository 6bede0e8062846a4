/*
 * The rdma-core side of `cargo xtask bench --peer`: rdma-core's own mlx5 provider (providers/mlx5/qp.c and cq.c,
 * compiled with rdma-core's release flags) driven against plain memory the way mlx5-bench drives the Rust core.
 *
 * The QP and CQ are set up as mlx5_create_qp / mlx5_create_cq leave them for an RC QP in RTS with 1024 send and
 * 1024 receive WQEs of one SGE, a 1024-entry CQ of 64-byte CQEs, CQE version 1 (user index lookup), and a
 * dedicated BlueFlame register (MLX5_POST_SEND_PREFER_BF=1, so a single WQE goes by BlueFlame as ours does).
 * The "BAR" is a heap page. Every function the provider calls that a datapath call must not reach aborts, so a
 * run that completes took the provider's fast paths.
 *
 * Usage: mlx5-peer time LOCK REPS          one JSON line of medians (ns per WQE / CQE)
 *        mlx5-peer count LOCK CALLS OP     CALLS calls of OP through its cg_* wrapper (for callgrind); OP is
 *                                          post_send_1, post_send_16, post_send_64, post_recv (16) or poll_cq
 * LOCK is 0 (MLX5_SINGLE_THREADED=1: no lock) or 1 (the default build: pthread spinlocks per queue).
 */
#include <config.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mlx5.h"
#include "wqe.h"

#define DEPTH 1024
#define UIDX 1
#define QPN 0x123

static struct mlx5_context *ctx;
static struct mlx5_qp *qp;
static struct mlx5_cq *cq;
static struct mlx5_bf *bf;
static char sge_buf[64];

static void __attribute__((noreturn)) die(const char *what)
{
	fprintf(stderr, "mlx5-peer: %s\n", what);
	abort();
}

/* The provider's out-of-line helpers that the measured paths never reach: reaching one is a harness error. */
#define NEVER(ret, name, ...) \
	ret name(__VA_ARGS__) { die("provider left its fast path: " #name); }
NEVER(int, mlx5_copy_to_recv_srq, struct mlx5_srq *s, int idx, void *buf, int size)
NEVER(void, mlx5_free_srq_wqe, struct mlx5_srq *s, int ind)
NEVER(struct mlx5_srq *, mlx5_find_srq, struct mlx5_context *c, uint32_t srqn)
NEVER(struct mlx5_mkey *, mlx5_find_mkey, struct mlx5_context *c, uint32_t mkey)
NEVER(void, mlx5_complete_odp_fault, struct mlx5_srq *s, int ind)
int mlx5_freeze_on_error_cqe;
NEVER(int, mlx5_get_cmd_status_err, int err, void *out)
NEVER(int, mlx5_alloc_prefered_buf, struct mlx5_context *c, struct mlx5_buf *b, size_t size, int page_size,
      enum mlx5_alloc_type alloc_type, const char *component)
NEVER(int, mlx5_free_actual_buf, struct mlx5_context *c, struct mlx5_buf *b)
NEVER(void, mlx5_get_alloc_type, struct mlx5_context *c, struct ibv_pd *pd, const char *component,
      enum mlx5_alloc_type *alloc_type, enum mlx5_alloc_type default_type)
NEVER(struct ibv_qp_ex *, ibv_qp_to_qp_ex, struct ibv_qp *q)
NEVER(int, mlx5dv_devx_qp_query, struct ibv_qp *q, const void *in, size_t inlen, void *out, size_t outlen)
NEVER(int, mlx5dv_get_clock_info, struct ibv_context *c, struct mlx5dv_clock_info *info)

static void *zalloc(size_t n)
{
	void *p = NULL;

	if (posix_memalign(&p, 4096, n))
		die("out of memory");
	memset(p, 0, n);
	return p;
}

static void init_lock(struct mlx5_spinlock *l, int lock)
{
	pthread_spin_init(&l->lock, PTHREAD_PROCESS_PRIVATE);
	l->need_lock = lock;
	l->in_use = 0;
}

static void init_wq(struct mlx5_wq *wq, int shift, int lock)
{
	wq->wrid = zalloc(DEPTH * sizeof(*wq->wrid));
	wq->wqe_head = zalloc(DEPTH * sizeof(*wq->wqe_head));
	wq->wr_data = zalloc(DEPTH * sizeof(*wq->wr_data));
	init_lock(&wq->lock, lock);
	wq->wqe_cnt = DEPTH;
	wq->max_post = DEPTH;
	wq->max_gs = 1;
	wq->qp_state_max_gs = 1;
	wq->wqe_shift = shift;
}

static void setup(int lock)
{
	ctx = zalloc(sizeof(*ctx));
	ctx->prefer_bf = 1;
	ctx->shut_up_bf = 0;
	ctx->cqe_version = 1;
	ctx->dbg_fp = stderr;
	ctx->uidx_table[0].refcnt = 1;
	ctx->uidx_table[0].table = zalloc((MLX5_UIDX_TABLE_MASK + 1) * sizeof(struct mlx5_resource *));

	cq = zalloc(sizeof(*cq));
	cq->verbs_cq.cq.context = &ctx->ibv_ctx.context;
	cq->verbs_cq.cq.cqe = DEPTH - 1;
	cq->cqe_sz = 64;
	cq->buf_a.buf = zalloc(DEPTH * 64);
	cq->buf_a.length = DEPTH * 64;
	cq->active_buf = &cq->buf_a;
	cq->dbrec = zalloc(64);
	cq->cqn = 7;
	init_lock(&cq->lock, lock);
	/* As mlx5_create_cq: every CQE invalid, owned by hardware. */
	for (int i = 0; i < DEPTH; i++) {
		struct mlx5_cqe64 *c = (struct mlx5_cqe64 *)((char *)cq->buf_a.buf + i * 64);
		c->op_own = MLX5_CQE_INVALID << 4;
	}

	bf = zalloc(sizeof(*bf));
	bf->reg = zalloc(4096);
	bf->buf_size = 256;
	bf->uuarn = 1;
	bf->need_lock = lock;
	init_lock(&bf->lock, lock);

	qp = zalloc(sizeof(*qp));
	qp->rsc.type = MLX5_RSC_TYPE_QP;
	qp->rsc.rsn = UIDX;
	qp->ibv_qp = &qp->verbs_qp.qp;
	qp->ibv_qp->context = &ctx->ibv_ctx.context;
	qp->ibv_qp->qp_type = IBV_QPT_RC;
	qp->ibv_qp->state = IBV_QPS_RTS;
	qp->ibv_qp->qp_num = QPN;
	qp->ibv_qp->send_cq = &cq->verbs_cq.cq;
	qp->ibv_qp->recv_cq = &cq->verbs_cq.cq;
	init_wq(&qp->rq, 4, lock);
	init_wq(&qp->sq, 6, lock);
	qp->rq.offset = 0;
	qp->sq.offset = DEPTH << 4;
	qp->buf_size = (DEPTH << 4) + (DEPTH << 6);
	qp->buf.buf = zalloc(qp->buf_size);
	qp->buf.length = qp->buf_size;
	qp->sq_start = (char *)qp->buf.buf + qp->sq.offset;
	qp->sq.qend = (char *)qp->sq_start + (DEPTH << 6);
	qp->db = zalloc(64);
	qp->bf = bf;
	qp->sq_signal_bits = 0;
	qp->max_inline_data = 0;
	ctx->uidx_table[0].table[UIDX] = &qp->rsc;
}

static struct ibv_sge sge;
static struct ibv_send_wr swr[64];
static struct ibv_recv_wr rwr[64];

/* `batch` 1-SGE SENDs chained; only the last is signaled unless all_signaled. */
static void make_sends(int batch, int all_signaled)
{
	for (int i = 0; i < batch; i++) {
		memset(&swr[i], 0, sizeof(swr[i]));
		swr[i].wr_id = i;
		swr[i].sg_list = &sge;
		swr[i].num_sge = 1;
		swr[i].opcode = IBV_WR_SEND;
		swr[i].send_flags = (all_signaled || i + 1 == batch) ? IBV_SEND_SIGNALED : 0;
		swr[i].next = i + 1 < batch ? &swr[i + 1] : NULL;
	}
}

static void make_recvs(int batch)
{
	for (int i = 0; i < batch; i++) {
		rwr[i].wr_id = i;
		rwr[i].sg_list = &sge;
		rwr[i].num_sge = 1;
		rwr[i].next = i + 1 < batch ? &rwr[i + 1] : NULL;
	}
}

/* One call each, out of line, so callgrind can count exactly the provider's call (as cg_* in mlx5-bench). */
__attribute__((noinline)) int cg_post_send(struct ibv_send_wr *wr);
__attribute__((noinline)) int cg_post_send(struct ibv_send_wr *wr)
{
	struct ibv_send_wr *bad;

	return mlx5_post_send(qp->ibv_qp, wr, &bad);
}

__attribute__((noinline)) int cg_post_recv(struct ibv_recv_wr *wr);
__attribute__((noinline)) int cg_post_recv(struct ibv_recv_wr *wr)
{
	struct ibv_recv_wr *bad;

	return mlx5_post_recv(qp->ibv_qp, wr, &bad);
}

__attribute__((noinline)) int cg_poll_cq(int ne, struct ibv_wc *wc);
__attribute__((noinline)) int cg_poll_cq(int ne, struct ibv_wc *wc)
{
	return mlx5_poll_cq_v1(&cq->verbs_cq.cq, ne, wc);
}

static double now_ns(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1e9 + t.tv_nsec;
}

/* Retires every outstanding WQE, as the completion of the last one would (untimed). */
static void retire_all(void)
{
	qp->sq.tail = qp->sq.head;
	qp->rq.tail = qp->rq.head;
}

static double window_post_send(int batch)
{
	int calls = DEPTH / batch;
	double t = now_ns();

	for (int i = 0; i < calls; i++)
		if (cg_post_send(swr))
			die("post_send failed");
	t = now_ns() - t;
	retire_all();
	return t / DEPTH;
}

static double window_post_recv(int batch)
{
	int calls = DEPTH / batch;
	double t = now_ns();

	for (int i = 0; i < calls; i++)
		if (cg_post_recv(rwr))
			die("post_recv failed");
	t = now_ns() - t;
	retire_all();
	return t / DEPTH;
}

/* A whole ring of ready CQEs from the consumer index on, alternating a requester CQE for send WQE
 * send_first + k/2 and a responder CQE for receive WQE recv_first + k/2, each with the owner bit of its pass (as mlx5-bench's fill_cqes). */
static void fill_cqes(unsigned send_first, unsigned recv_first)
{
	for (unsigned k = 0; k < DEPTH; k++) {
		unsigned idx = cq->cons_index + k;
		uint8_t owner = (idx / DEPTH) & 1;
		struct mlx5_cqe64 *c = (struct mlx5_cqe64 *)((char *)cq->buf_a.buf + (idx & (DEPTH - 1)) * 64);

		memset(c, 0, 64);
		c->byte_cnt = htobe32(64);
		c->srqn_uidx = htobe32(UIDX);
		if (k % 2 == 0) {
			c->sop_drop_qpn = htobe32((MLX5_OPCODE_SEND << 24) | QPN);
			c->wqe_counter = htobe16((uint16_t)(send_first + k / 2));
			c->op_own = (MLX5_CQE_REQ << 4) | owner;
		} else {
			c->sop_drop_qpn = htobe32(QPN);
			c->flags_rqpn = htobe32(QPN);
			c->wqe_counter = htobe16((uint16_t)(recv_first + k / 2));
			c->op_own = (MLX5_CQE_RESP_SEND << 4) | owner;
		}
	}
}

static struct ibv_wc wcs[16];

static double window_poll_cq(int batch)
{
	struct ibv_send_wr *bad;
	struct ibv_recv_wr *rbad;
	unsigned first = qp->sq.cur_post, recv_first = qp->rq.head;
	int got = 0;
	double t;

	/* Untimed: the WRs the completions name (sends all signaled, in calls of 64), then the CQEs. */
	make_sends(64, 1);
	for (int i = 0; i < DEPTH / 2 / 64; i++)
		if (mlx5_post_send(qp->ibv_qp, swr, &bad))
			die("post_send (poll setup) failed");
	make_recvs(64);
	for (int i = 0; i < DEPTH / 2 / 64; i++)
		if (mlx5_post_recv(qp->ibv_qp, rwr, &rbad))
			die("post_recv (poll setup) failed");
	fill_cqes(first, recv_first);
	t = now_ns();
	while (got < DEPTH) {
		int k = cg_poll_cq(batch, wcs);

		if (k <= 0)
			break;
		got += k;
	}
	t = now_ns() - t;
	if (got != DEPTH || qp->sq.tail != qp->sq.head || qp->rq.tail != qp->rq.head)
		die("poll_cq did not retire every CQE");
	return t / DEPTH;
}

/* Checks that each measured call takes the provider's real path for the shape measured (dies otherwise). */
static void check(void)
{
	struct mlx5_wqe_ctrl_seg *ctrl;
	struct mlx5_wqe_data_seg *scat;
	unsigned char *half;
	unsigned idx, off;

	/* A single WQE goes by BlueFlame: the register's current half holds the WQE's 64 bytes, then alternates. */
	make_sends(1, 0);
	off = bf->offset;
	idx = qp->sq.cur_post & (DEPTH - 1);
	if (cg_post_send(swr))
		die("post_send failed");
	ctrl = mlx5_get_send_wqe(qp, idx);
	half = (unsigned char *)bf->reg + off;
	if (memcmp(half, ctrl, 64) || bf->offset == off)
		die("a single WQE did not go by BlueFlame");
	if ((be32toh(ctrl->opmod_idx_opcode) & 0xff) != MLX5_OPCODE_SEND || (be32toh(ctrl->qpn_ds) & 0x3f) != 2 ||
	    !(ctrl->fm_ce_se & MLX5_WQE_CTRL_CQ_UPDATE))
		die("the WQE is not a signaled 1-SGE SEND");
	if (be32toh(qp->db[MLX5_SND_DBR]) != (qp->sq.cur_post & 0xffff))
		die("the send doorbell record is wrong");
	/* A batch rings the 8-byte doorbell: only the first 8 bytes of the register's half change. */
	make_sends(16, 0);
	off = bf->offset;
	half = (unsigned char *)bf->reg + off;
	memset(half, 0xee, 64);
	idx = (qp->sq.cur_post + 15) & (DEPTH - 1);
	if (cg_post_send(swr))
		die("post_send failed");
	if (memcmp(half, mlx5_get_send_wqe(qp, idx), 8) || half[8] != 0xee)
		die("a batch did not ring the 8-byte doorbell with its last WQE");
	retire_all();
	/* A receive is one 16-byte data segment and the receive doorbell record. */
	make_recvs(1);
	idx = qp->rq.head & (DEPTH - 1);
	if (cg_post_recv(rwr))
		die("post_recv failed");
	scat = (struct mlx5_wqe_data_seg *)((char *)qp->buf.buf + qp->rq.offset + (idx << qp->rq.wqe_shift));
	if (be64toh(scat->addr) != sge.addr || be32toh(scat->lkey) != sge.lkey || be32toh(scat->byte_count) != 64 ||
	    be32toh(qp->db[MLX5_RCV_DBR]) != (qp->rq.head & 0xffff))
		die("the receive WQE or its doorbell record is wrong");
	retire_all();
	/* Polling a ring of CQEs gives SEND and RECV completions for the right WRs (the last call's 16). */
	window_poll_cq(16);
	if (wcs[0].status != IBV_WC_SUCCESS || wcs[0].opcode != IBV_WC_SEND || wcs[0].wr_id != 56 ||
	    wcs[1].status != IBV_WC_SUCCESS || wcs[1].opcode != IBV_WC_RECV || wcs[1].wr_id != 56 ||
	    wcs[1].byte_len != 64 || wcs[1].qp_num != QPN || wcs[1].src_qp != QPN)
		die("poll_cq returned wrong work completions");
	if (be32toh(cq->dbrec[MLX5_CQ_SET_CI]) != (cq->cons_index & 0xffffff))
		die("the CQ consumer index was not published");
}

static int cmp(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return (x > y) - (x < y);
}

static double measure(int reps, double (*window)(int), int batch, double *min)
{
	double *v = calloc(reps, sizeof(double));
	double med;

	if (!v)
		die("out of memory");
	for (int i = 0; i < 20; i++)
		window(batch);
	for (int i = 0; i < reps; i++)
		v[i] = window(batch);
	qsort(v, reps, sizeof(double), cmp);
	med = v[reps / 2];
	*min = v[0];
	free(v);
	return med;
}

int main(int argc, char **argv)
{
	int lock, n;
	double mn;

	if (!((argc == 4 && !strcmp(argv[1], "time")) || (argc == 5 && !strcmp(argv[1], "count")))) {
		fprintf(stderr, "usage: mlx5-peer time LOCK(0|1) REPS | mlx5-peer count LOCK(0|1) CALLS OP\n");
		return 2;
	}
	lock = atoi(argv[2]);
	n = atoi(argv[3]);
	if (n < 1)
		n = 1;
	setup(lock);
	sge.addr = (uintptr_t)sge_buf;
	sge.length = 64;
	sge.lkey = 0x100;
	/* Checked before timing; not in count mode, whose instruction counts must hold only the CALLS calls. */
	if (!strcmp(argv[1], "time"))
		check();

	if (!strcmp(argv[1], "count")) {
		/* n calls of one operation, each retired untimed; poll_cq: n whole rings, 16 per call. */
		const char *op = argv[4];

		if (!strncmp(op, "post_send_", 10)) {
			make_sends(atoi(op + 10), 0);
			for (int i = 0; i < n; i++) {
				if (cg_post_send(swr))
					die("post_send failed");
				retire_all();
			}
		} else if (!strcmp(op, "post_recv")) {
			make_recvs(16);
			for (int i = 0; i < n; i++) {
				if (cg_post_recv(rwr))
					die("post_recv failed");
				retire_all();
			}
		} else if (!strcmp(op, "poll_cq")) {
			for (int i = 0; i < n; i++)
				window_poll_cq(16);
		} else {
			die("unknown operation");
		}
		printf("{\"calls\":%d}\n", n);
		return 0;
	}

	printf("{\"checked\":true,");
	static const int batches[3] = {1, 16, 64};
	for (int b = 0; b < 3; b++) {
		double med;

		make_sends(batches[b], 0);
		med = measure(n, window_post_send, batches[b], &mn);
		printf("\"post_send_%d_ns\":%.3f,\"post_send_%d_min_ns\":%.3f,", batches[b], med, batches[b], mn);
	}
	make_recvs(16);
	printf("\"post_recv_ns\":%.3f,", measure(n, window_post_recv, 16, &mn));
	printf("\"post_recv_min_ns\":%.3f,", mn);
	printf("\"poll_cq_ns\":%.3f,", measure(n, window_poll_cq, 16, &mn));
	printf("\"poll_cq_min_ns\":%.3f}\n", mn);
	return 0;
}
