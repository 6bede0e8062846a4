/* The MPI program `cargo xtask verbs-apps --only mpi` runs (xtask/src/libibverbs/mpi.rs): each even rank ping-pongs 64 KiB
 * messages with the next odd one, checking every byte each way, then every rank checks MPI_Allreduce's sum of
 * 1..size. Exits non-zero on a wrong byte or sum. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    enum { LEN = 65536, ITERS = 100 };
    unsigned char *buf = malloc(LEN);
    int peer = rank ^ 1, bad = 0;
    if (peer < size) {
        for (int i = 0; i < ITERS; i++) {
            if (rank % 2 == 0) {
                for (int k = 0; k < LEN; k++) buf[k] = (unsigned char)(k * 7 + i + rank);
                MPI_Send(buf, LEN, MPI_BYTE, peer, 1, MPI_COMM_WORLD);
                MPI_Recv(buf, LEN, MPI_BYTE, peer, 2, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
                for (int k = 0; k < LEN; k++) bad |= buf[k] != (unsigned char)(k * 7 + i + rank + 1);
            } else {
                MPI_Recv(buf, LEN, MPI_BYTE, peer, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
                for (int k = 0; k < LEN; k++) bad |= buf[k] != (unsigned char)(k * 7 + i + peer);
                for (int k = 0; k < LEN; k++) buf[k] += 1;
                MPI_Send(buf, LEN, MPI_BYTE, peer, 2, MPI_COMM_WORLD);
            }
        }
    }
    long mine = rank + 1, sum = 0;
    MPI_Allreduce(&mine, &sum, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    long want = (long)size * (size + 1) / 2;
    printf("rank %d of %d: ping-pong %s, allreduce %ld (want %ld)\n", rank, size, bad ? "CORRUPT" : "ok", sum, want);
    MPI_Finalize();
    return bad || sum != want;
}
