/* pause.h — what pause.c lends to resume.c: the states a pause or resume works on, and the
 * small helpers both use (Note [Paused regions] in pause.c). */
#ifndef CP_PAUSE_H
#define CP_PAUSE_H

#include "core/state.h"

/* Room in *items (of *cap entries of item_size bytes) for `need`; CP_ERR_HOST_OOM. */
int cp_pause_grow(void **items, size_t *cap, size_t need, size_t item_size);
/* The states of region `tag` (0: every region) that are paused (want) or not, each marked
 * busy, waiting (lock dropped) while another pause or resume holds some of them. */
int cp_pause_take_states_locked(cp_pool_t *pool, uint32_t tag, bool want, cp_stream_state_t ***out, size_t *out_n);
void cp_pause_put_states_locked(cp_stream_state_t **sts, size_t n);
/* Give back the backups of `st` (host_free without the lock). */
void cp_pause_drop_backups_locked(cp_pool_t *pool, cp_stream_state_t *st);
/* CP_ERR_STATE during a capture, or in a pool without page-mapped memory; `who` names the call. */
int cp_pause_refuse_locked(const cp_pool_t *pool, const char *who);
/* page_unmap, tried a second time when refused. */
int cp_pause_unmap_twice(const cp_backend_t *be, uintptr_t addr, size_t size);

#endif /* CP_PAUSE_H */
