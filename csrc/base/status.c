/* status.c — status names and the thread-local last-error message.
 * Owns: cp_set_error / cp_last_error; every module reports failures through it. */
#include <stdarg.h>
#include <stdio.h>

#include "base/status.h"

static _Thread_local char cp_error_buf[4096];

const char *cp_status_name(int status) {
  switch (status) {
    case CP_OK: return "CP_OK";
    case CP_ERR_OOM: return "CP_ERR_OOM";
    case CP_ERR_INVALID: return "CP_ERR_INVALID";
    case CP_ERR_BACKEND: return "CP_ERR_BACKEND";
    case CP_ERR_HOST_OOM: return "CP_ERR_HOST_OOM";
    case CP_ERR_STATE: return "CP_ERR_STATE";
    default: return "CP_ERR_UNKNOWN";
  }
}

const char *cp_last_error(void) { return cp_error_buf; }

void cp_clear_error(void) { cp_error_buf[0] = '\0'; }

int cp_set_error(int status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(cp_error_buf, sizeof cp_error_buf, fmt, ap);
  va_end(ap);
  return status;
}
