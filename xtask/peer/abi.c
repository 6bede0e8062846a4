/*
 * The C-ABI side of `cargo xtask bench --peer`: one C program, built twice, timing the ibv_* datapath entry points
 * (ibv_post_send, ibv_post_recv, ibv_poll_cq: the inline functions of <infiniband/verbs.h>, which call through
 * the context's ops) with the shapes mlx5-bench and mlx5-peer time: 1-SGE SENDs 1, 16 and 64 per call (only the
 * last signaled), receives 16 per call, polls of 16 from a ring of 1024 CQEs half send and half receive.
 *
 *   -DABI_DROPIN  the drop-in libibverbs.so.1 (mlx5-ibverbs) on a simulated device opened as any program opens
 *                 one. For the post figures the process runs with MLX5_RS_SIM_DOORBELLS=memory, so doorbells
 *                 and BlueFlame copies land in plain memory as in the other figures; between windows (untimed)
 *                 the QP is moved to RESET and back to RTS, which empties its rings. For poll_cq the device runs:
 *                 the QP sends to itself and the CQ fills before the timed polls.
 *   otherwise     rdma-core's mlx5 provider set up in plain memory by harness.c (included), its context's ops
 *                 filled as mlx5_alloc_context fills them (post_send, post_recv, poll_cq for CQE version 1).
 *
 * Usage: abi-* time post|poll|all LOCK REPS   one JSON line of medians, ns per WQE / CQE
 *        abi-* count LOCK CALLS OP            CALLS calls of OP through its cg_abi_* wrapper (for callgrind)
 * LOCK only matters to rdma-core (0: MLX5_SINGLE_THREADED, 1: its default spinlocks); the drop-in reads
 * MLX5_SINGLE_THREADED from its environment, as rdma-core's provider does.
 */
#ifdef ABI_DROPIN
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <infiniband/verbs.h>

#define DEPTH 1024

static void __attribute__((noreturn)) die(const char *what)
{
	fprintf(stderr, "abi-dropin: %s\n", what);
	abort();
}

static char sge_buf[4096];
static struct ibv_sge sge;
static struct ibv_send_wr swr[64];
static struct ibv_recv_wr rwr[64];
static struct ibv_qp *aqp;
static struct ibv_cq *acq;
static struct ibv_context *actx;

static double now_ns(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1e9 + t.tv_nsec;
}

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

static int cmp(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return (x > y) - (x < y);
}

/* Set for the first warm-up windows: the drop-in's poll window then checks every completion; the timed ones only
 * count, as the other sides' timed loops do, and check what is left in the array after the clock stops. */
static int verify_all;

static double measure(int reps, double (*window)(int), int batch, double *min)
{
	double *v = calloc(reps, sizeof(double));
	double med;

	if (!v)
		die("out of memory");
	for (int i = 0; i < 20; i++) {
		verify_all = i < 10;
		window(batch);
	}
	verify_all = 0;
	for (int i = 0; i < reps; i++)
		v[i] = window(batch);
	qsort(v, reps, sizeof(double), cmp);
	med = v[reps / 2];
	*min = v[0];
	free(v);
	return med;
}

/* RESET -> INIT -> RTR -> RTS towards the QP itself over RoCE (GID 0). */
static void connect_self(void)
{
	struct ibv_qp_attr a;
	union ibv_gid gid;

	if (ibv_query_gid(actx, 1, 0, &gid))
		die("ibv_query_gid");
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RESET;
	if (ibv_modify_qp(aqp, &a, IBV_QP_STATE))
		die("modify to RESET");
	a.qp_state = IBV_QPS_INIT;
	a.port_num = 1;
	a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
	if (ibv_modify_qp(aqp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
		die("modify to INIT");
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = IBV_MTU_1024;
	a.dest_qp_num = aqp->qp_num;
	a.max_dest_rd_atomic = 1;
	a.min_rnr_timer = 12;
	a.ah_attr.is_global = 1;
	a.ah_attr.grh.dgid = gid;
	a.ah_attr.grh.hop_limit = 1;
	a.ah_attr.port_num = 1;
	if (ibv_modify_qp(aqp, &a,
			  IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
				  IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
		die("modify to RTR");
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	a.max_rd_atomic = 1;
	if (ibv_modify_qp(aqp, &a,
			  IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
				  IBV_QP_MAX_QP_RD_ATOMIC))
		die("modify to RTS");
}

static void setup(int lock)
{
	struct ibv_device **list;
	struct ibv_qp_init_attr init;
	struct ibv_pd *pd;
	struct ibv_mr *mr;
	int n;

	(void)lock;
	list = ibv_get_device_list(&n);
	if (!list || n < 1)
		die("no device");
	actx = ibv_open_device(list[0]);
	ibv_free_device_list(list);
	if (!actx)
		die("ibv_open_device");
	pd = ibv_alloc_pd(actx);
	if (!pd)
		die("ibv_alloc_pd");
	mr = ibv_reg_mr(pd, sge_buf, sizeof(sge_buf), IBV_ACCESS_LOCAL_WRITE);
	if (!mr)
		die("ibv_reg_mr");
	/* DEPTH - 1 completions: a ring of DEPTH entries, as the core's and rdma-core's sides poll. */
	acq = ibv_create_cq(actx, DEPTH - 1, NULL, NULL, 0);
	if (!acq)
		die("ibv_create_cq");
	memset(&init, 0, sizeof(init));
	init.send_cq = acq;
	init.recv_cq = acq;
	init.cap.max_send_wr = DEPTH;
	init.cap.max_recv_wr = DEPTH;
	init.cap.max_send_sge = 1;
	init.cap.max_recv_sge = 1;
	init.qp_type = IBV_QPT_RC;
	aqp = ibv_create_qp(pd, &init);
	if (!aqp)
		die("ibv_create_qp");
	connect_self();
	sge.addr = (uintptr_t)sge_buf;
	sge.length = 64;
	sge.lkey = mr->lkey;
}

/* Nothing the device would complete (doorbells land in memory): a move to RESET and back empties the rings. */
static void retire_all(void)
{
	connect_self();
}

#define NAME "abi-dropin"
#else
#define main harness_main
#include "harness.c"
#undef main

static struct ibv_qp *aqp;
static struct ibv_cq *acq;

/* As harness.c's setup, plus the ops mlx5_alloc_context installs, so ibv_post_send & co. reach the provider. */
static void setup_abi(int lock)
{
	setup(lock);
	ctx->ibv_ctx.context.ops.post_send = mlx5_post_send;
	ctx->ibv_ctx.context.ops.post_recv = mlx5_post_recv;
	ctx->ibv_ctx.context.ops.poll_cq = mlx5_poll_cq_v1;
	aqp = qp->ibv_qp;
	acq = &cq->verbs_cq.cq;
	sge.addr = (uintptr_t)sge_buf;
	sge.length = 64;
	sge.lkey = 0x100;
}

#define NAME "abi-rdma-core"
#endif

/* One call each, out of line, so callgrind counts exactly the call through the ABI (as cg_* elsewhere). */
__attribute__((noinline)) int cg_abi_post_send(struct ibv_send_wr *wr);
__attribute__((noinline)) int cg_abi_post_send(struct ibv_send_wr *wr)
{
	struct ibv_send_wr *bad;

	return ibv_post_send(aqp, wr, &bad);
}

__attribute__((noinline)) int cg_abi_post_recv(struct ibv_recv_wr *wr);
__attribute__((noinline)) int cg_abi_post_recv(struct ibv_recv_wr *wr)
{
	struct ibv_recv_wr *bad;

	return ibv_post_recv(aqp, wr, &bad);
}

__attribute__((noinline)) int cg_abi_poll_cq(int ne, struct ibv_wc *wc);
__attribute__((noinline)) int cg_abi_poll_cq(int ne, struct ibv_wc *wc)
{
	return ibv_poll_cq(acq, ne, wc);
}

static double abi_window_post_send(int batch)
{
	int calls = DEPTH / batch;
	double t = now_ns();

	for (int i = 0; i < calls; i++)
		if (cg_abi_post_send(swr))
			die("post_send failed");
	t = now_ns() - t;
	retire_all();
	return t / DEPTH;
}

static double abi_window_post_recv(int batch)
{
	int calls = DEPTH / batch;
	double t = now_ns();

	for (int i = 0; i < calls; i++)
		if (cg_abi_post_recv(rwr))
			die("post_recv failed");
	t = now_ns() - t;
	retire_all();
	return t / DEPTH;
}

static struct ibv_wc abi_wcs[16];

#ifdef ABI_DROPIN
static void check_wcs(int k, int *sends, int *recvs)
{
	for (int i = 0; i < k; i++) {
		if (abi_wcs[i].status != IBV_WC_SUCCESS || abi_wcs[i].qp_num != aqp->qp_num)
			die("a completion failed");
		if (abi_wcs[i].opcode == IBV_WC_RECV)
			(*recvs)++;
		else if (abi_wcs[i].opcode == IBV_WC_SEND)
			(*sends)++;
		else
			die("a completion of another opcode");
	}
}

/* Untimed: DEPTH/2 receives, then DEPTH/2 signaled SENDs of the QP to itself, which the in-line simulator runs as
 * each doorbell rings: DEPTH CQEs, half send and half receive, in a CQ of DEPTH entries (as the core's and
 * rdma-core's). Then the timed polls, with nothing in between (no sleep: the CQEs are written when the last
 * doorbell returns) and nothing read in the timed loop. */
static double abi_window_poll_cq(int batch)
{
	int got = 0, sends = 0, recvs = 0, k = 0;
	double t;

	make_recvs(64);
	for (int i = 0; i < DEPTH / 2 / 64; i++)
		if (cg_abi_post_recv(rwr))
			die("post_recv (poll setup) failed");
	make_sends(64, 1);
	for (int i = 0; i < DEPTH / 2 / 64; i++)
		if (cg_abi_post_send(swr))
			die("post_send (poll setup) failed");
	if (verify_all) {
		while (got < DEPTH && (k = cg_abi_poll_cq(batch, abi_wcs)) > 0) {
			check_wcs(k, &sends, &recvs);
			got += k;
		}
		if (got != DEPTH || sends != DEPTH / 2 || recvs != DEPTH / 2)
			die("poll_cq did not find the ring of completions");
		if (cg_abi_poll_cq(batch, abi_wcs) != 0)
			die("poll_cq found more than the ring of completions");
		return 0;
	}
	t = now_ns();
	while (got < DEPTH) {
		k = cg_abi_poll_cq(batch, abi_wcs);
		if (k <= 0)
			break;
		got += k;
	}
	t = now_ns() - t;
	if (got != DEPTH || k <= 0)
		die("poll_cq did not find the ring of completions");
	check_wcs(k, &sends, &recvs);
	return t / DEPTH;
}
#else
static double abi_window_poll_cq(int batch)
{
	struct ibv_send_wr *bad;
	struct ibv_recv_wr *rbad;
	unsigned first = qp->sq.cur_post, recv_first = qp->rq.head;
	int got = 0;
	double t;

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
		int k = cg_abi_poll_cq(batch, abi_wcs);

		if (k <= 0)
			break;
		got += k;
	}
	t = now_ns() - t;
	if (got != DEPTH || qp->sq.tail != qp->sq.head || qp->rq.tail != qp->rq.head)
		die("poll_cq did not retire every CQE");
	return t / DEPTH;
}
#endif

int main(int argc, char **argv)
{
	int lock, n;
	double mn;

	if (!((argc == 5 && !strcmp(argv[1], "time")) || (argc == 5 && !strcmp(argv[1], "count")))) {
		fprintf(stderr, "usage: " NAME " time post|poll|all LOCK REPS | " NAME " count LOCK CALLS OP\n");
		return 2;
	}
#ifdef ABI_DROPIN
	setup(0);
#endif
	if (!strcmp(argv[1], "count")) {
		const char *op = argv[4];

		lock = atoi(argv[2]);
		n = atoi(argv[3]);
#ifndef ABI_DROPIN
		setup_abi(lock);
#endif
		if (n < 1)
			n = 1;
		if (!strncmp(op, "post_send_", 10)) {
			int batch = atoi(op + 10);

			if (batch < 1 || batch > 64 || DEPTH % batch)
				die("batch");
			make_sends(batch, 0);
			/* Retired once per ring (the drop-in's retire is commands, which would swamp the count). */
			for (int i = 0; i < n; i++) {
				if (cg_abi_post_send(swr))
					die("post_send failed");
				if ((i + 1) % (DEPTH / batch) == 0)
					retire_all();
			}
		} else if (!strcmp(op, "post_recv")) {
			make_recvs(16);
			for (int i = 0; i < n; i++) {
				if (cg_abi_post_recv(rwr))
					die("post_recv failed");
				if ((i + 1) % (DEPTH / 16) == 0)
					retire_all();
			}
		} else if (!strcmp(op, "poll_cq")) {
			for (int i = 0; i < n; i++)
				abi_window_poll_cq(16);
		} else {
			die("unknown operation");
		}
		printf("{\"calls\":%d}\n", n);
		return 0;
	}
	lock = atoi(argv[3]);
	n = atoi(argv[4]);
	if (n < 1)
		n = 1;
#ifndef ABI_DROPIN
	setup_abi(lock);
#endif
	printf("{");
	if (strcmp(argv[2], "poll")) {
		static const int batches[3] = {1, 16, 64};

		for (int b = 0; b < 3; b++) {
			double med;

			make_sends(batches[b], 0);
			med = measure(n, abi_window_post_send, batches[b], &mn);
			printf("\"post_send_%d_ns\":%.3f,\"post_send_%d_min_ns\":%.3f,", batches[b], med, batches[b], mn);
		}
		make_recvs(16);
		printf("\"post_recv_ns\":%.3f,", measure(n, abi_window_post_recv, 16, &mn));
		printf("\"post_recv_min_ns\":%.3f,", mn);
	}
	if (strcmp(argv[2], "post")) {
		printf("\"poll_cq_ns\":%.3f,", measure(n, abi_window_poll_cq, 16, &mn));
		printf("\"poll_cq_min_ns\":%.3f,", mn);
	}
	printf("\"ok\":true}\n");
	return 0;
}
