/* sizes.c — the exported face of the size policy (core/sizes.h holds the rules).
 * Owns: cp_round_size, for bindings, tests and the replay, and the kinds' names. */
#include "core/sizes.h"

size_t cp_round_size(const cp_config_t *cfg, size_t size) { return cp_size_round(cfg, size); }

const char *const cp_pool_kind_names[CP_KIND_COUNT] = {"all", "small_pool", "large_pool"};
