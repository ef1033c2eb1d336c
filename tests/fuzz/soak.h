/* soak.h — what the pool harness (fuzz_pool.c) shares with the soak that drives it with
 * generated inputs (soak_main.c). */
#ifndef CP_FUZZ_SOAK_H
#define CP_FUZZ_SOAK_H

#include <stddef.h>
#include <stdint.h>

/* The third input byte that picks a stitching configuration (fuzz_pool.c's inputs). */
#define STITCH_MARK 0x53

/* Operations run and device failures injected by every input so far, since the process began. */
extern size_t fz_ops_run;
extern uint64_t fz_faults_run;
/* Of those operations: pauses with their backups and resumes, capture windows, frees that
 * waited in a window for it to close, blocks described for another process, and pauses
 * refused because their region held such a block. */
extern size_t fz_pauses_run, fz_windows_run, fz_deferred_run, fz_shares_run, fz_shared_refusals_run;

/* The harness's whole check (the pool's invariant checker, the shadow model, every live
 * block's bytes, the device's faults) runs after every this many operations and at the end of
 * each input; 1 (fuzzing) is after every one. */
extern size_t fz_check_every;
/* Only every this many pause operations pause (with a backup: a copy of the region's bytes
 * out and back, the slowest operation by far); the others do nothing. 1 (fuzzing): all. */
extern size_t fz_pause_every;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#endif /* CP_FUZZ_SOAK_H */
