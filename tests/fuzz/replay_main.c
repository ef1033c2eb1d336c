/* replay_main.c — runs a fuzz harness without libFuzzer: every file named on the command line,
 * and every regular file inside each directory named there (not recursively, dot files
 * skipped, in name order), is passed once to LLVMFuzzerTestOneInput. Any compiler builds it,
 * so the committed corpus replays under gcc's sanitizers too. A harness reports a failure by
 * aborting; reaching the end means every input passed. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

typedef struct totals_s {
  size_t files;
  size_t bytes;
} totals_t;

static int run_file(const char *path, totals_t *t) {
  FILE *f = fopen(path, "rb");
  if (f == NULL) {
    fprintf(stderr, "replay: cannot open %s\n", path);
    return -1;
  }
  size_t cap = 4096, len = 0;
  uint8_t *buf = malloc(cap);
  while (buf != NULL) {
    size_t got = fread(buf + len, 1, cap - len, f);
    len += got;
    if (len < cap) break;
    uint8_t *grown = realloc(buf, cap * 2);
    if (grown == NULL) {
      free(buf);
      buf = NULL;
      break;
    }
    buf = grown;
    cap *= 2;
  }
  int failed = buf == NULL || ferror(f);
  fclose(f);
  if (failed) {
    free(buf);
    fprintf(stderr, "replay: cannot read %s\n", path);
    return -1;
  }
  /* A copy of exactly the input's size, so that reading past it is caught. */
  uint8_t *exact = malloc(len > 0 ? len : 1);
  if (exact == NULL) {
    free(buf);
    fprintf(stderr, "replay: no memory for %s\n", path);
    return -1;
  }
  if (len > 0) memcpy(exact, buf, len);
  free(buf);
  LLVMFuzzerTestOneInput(exact, len);
  free(exact);
  t->files++;
  t->bytes += len;
  return 0;
}

static int cmp_names(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static int run_dir(const char *dir, totals_t *t) {
  DIR *d = opendir(dir);
  if (d == NULL) {
    fprintf(stderr, "replay: cannot open directory %s\n", dir);
    return -1;
  }
  char **names = NULL;
  size_t n = 0, cap = 0;
  int rc = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (e->d_name[0] == '.') continue;
    if (n == cap) {
      cap = cap ? cap * 2 : 256;
      char **grown = realloc(names, cap * sizeof *grown);
      if (grown == NULL) {
        rc = -1;
        break;
      }
      names = grown;
    }
    size_t len = strlen(dir) + strlen(e->d_name) + 2;
    names[n] = malloc(len);
    if (names[n] == NULL) {
      rc = -1;
      break;
    }
    snprintf(names[n], len, "%s/%s", dir, e->d_name);
    n++;
  }
  closedir(d);
  if (rc != 0) fprintf(stderr, "replay: no memory to list %s\n", dir);
  if (n > 0) qsort(names, n, sizeof *names, cmp_names);
  for (size_t i = 0; i < n; i++) {
    struct stat st;
    if (rc == 0 && stat(names[i], &st) == 0 && S_ISREG(st.st_mode)) rc = run_file(names[i], t);
    free(names[i]);
  }
  free(names);
  return rc;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s FILE_OR_DIR...\n", argv[0]);
    return 2;
  }
  totals_t t = {0, 0};
  for (int i = 1; i < argc; i++) {
    struct stat st;
    if (stat(argv[i], &st) != 0) {
      fprintf(stderr, "replay: %s does not exist\n", argv[i]);
      return 1;
    }
    int rc = S_ISDIR(st.st_mode) ? run_dir(argv[i], &t) : run_file(argv[i], &t);
    if (rc != 0) return 1;
  }
  if (t.files == 0) {
    fprintf(stderr, "replay: no inputs found\n");
    return 1;
  }
  printf("replay %s: %zu files, %zu bytes, all passed\n", argv[0], t.files, t.bytes);
  return 0;
}
