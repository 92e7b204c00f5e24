/* The reference MPI program of tests/test_sockets.py: it does nothing but
 * what any MPI job does (MPI_Init_thread at MPI_THREAD_SERIALIZED, as tf_smb's
 * communication thread asks, and a barrier), so the sockets it holds are Open
 * MPI's own.
 *
 *   mpi_reference DIR [TIMEOUT_S]
 *
 * After the barrier each rank writes DIR/started<rank>.json ({"pid": ...,
 * "rank": ..., "host": ...}, through a temporary file and rename), then waits
 * for DIR/go (polling; exit 3 when it has not appeared within TIMEOUT_S,
 * default 120), then a second barrier and MPI_Finalize. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s DIR [TIMEOUT_S]\n", argv[0]);
    return 2;
  }
  const char *dir = argv[1];
  const double timeout_s = argc > 2 ? atof(argv[2]) : 120.0;
  int provided = 0, rank = 0;
  if (MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS) {
    fprintf(stderr, "MPI_Init_thread failed\n");
    return 1;
  }
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Barrier(MPI_COMM_WORLD);

  char host[256] = "";
  gethostname(host, sizeof host - 1);
  char tmp[4096], path[4096], go[4096];
  snprintf(tmp, sizeof tmp, "%s/started%d.json.tmp", dir, rank);
  snprintf(path, sizeof path, "%s/started%d.json", dir, rank);
  snprintf(go, sizeof go, "%s/go", dir);
  FILE *f = fopen(tmp, "w");
  if (f == NULL) {
    perror(tmp);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  fprintf(f, "{\"pid\": %d, \"rank\": %d, \"host\": \"%s\"}\n", (int)getpid(), rank, host);
  fclose(f);
  if (rename(tmp, path) != 0) {
    perror(path);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }

  const time_t deadline = time(NULL) + (time_t)timeout_s;
  while (access(go, F_OK) != 0) {
    if (time(NULL) > deadline) {
      fprintf(stderr, "rank %d: %s did not appear within %.0f s\n", rank, go, timeout_s);
      return 3; /* mpirun then ends the job */
    }
    usleep(50 * 1000);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  MPI_Finalize();
  return 0;
}
