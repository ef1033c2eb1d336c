/* standin_open.h — the C tests' way onto the driver stand-in: the CUDA backend loaded and the
 * stand-in's control API found (csrc/standin/standin.h), or one line saying why not. */
#ifndef CP_TEST_STANDIN_OPEN_H
#define CP_TEST_STANDIN_OPEN_H

#include <stdio.h>

#include "backend/cuda.h"
#include "core/cp.h"
#include "standin/standin.h"

/* 1 when the backend runs on the stand-in and `api` is filled; else 0, after printing
 * "<test>: not the stand-in (<why>): skipped" (the test then has nothing to run). */
static inline int standin_open_or_skip(cpstandin_api_t *api, const char *test) {
  char why[512] = "";
  if (cp_cuda_load() == CP_OK && cpstandin_open(api, 0, why, sizeof why) == 0) return 1;
  printf("%s: not the stand-in (%s): skipped\n", test, why[0] ? why : cp_last_error());
  return 0;
}

#endif
