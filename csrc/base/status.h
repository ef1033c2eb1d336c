/* status.h — status codes and the thread-local last-error message.
 * Owns: the numbers every public function returns and the text that explains them. */
#ifndef CP_STATUS_H
#define CP_STATUS_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum cp_status_e {
  CP_OK = 0,
  CP_ERR_OOM = 1,      /* device memory exhausted (or the memory cap reached) */
  CP_ERR_INVALID = 2,  /* bad argument: unknown pointer, bad size, bad config value */
  CP_ERR_BACKEND = 3,  /* the device failed in a way other than OOM */
  CP_ERR_HOST_OOM = 4, /* host memory for metadata could not be had */
  CP_ERR_STATE = 5     /* called in a state that does not allow it (e.g. after shutdown) */
} cp_status_t;

/* Short stable name of a status ("CP_ERR_OOM"). */
const char *cp_status_name(int status);

/* The calling thread's last error message, "" when none. Valid until the thread's next
 * failing call. Functions set it only when they fail. */
const char *cp_last_error(void);

/* Set the thread's last error (printf-style) and return `status`, so that a failure path
 * reads `return cp_set_error(CP_ERR_INVALID, "cp_free: unknown pointer %p", p);`. */
int cp_set_error(int status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

void cp_clear_error(void);

#ifdef __cplusplus
}
#endif

#endif /* CP_STATUS_H */
