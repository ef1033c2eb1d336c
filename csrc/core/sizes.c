/* sizes.c — the exported face of the size policy (core/sizes.h holds the rules).
 * Owns: cp_round_size, for bindings, tests and the replay. */
#include "core/sizes.h"

size_t cp_round_size(const cp_config_t *cfg, size_t size) { return cp_size_round(cfg, size); }
