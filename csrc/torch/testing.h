/* testing.h — entry points that exist for tests only, declared for the binding.
 * Owns: nothing but declarations; the definitions live next to the entry points they wrap. */
#ifndef CP_TORCH_TESTING_H
#define CP_TORCH_TESTING_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* cudapool_alloc (alloc.cpp), the allocation entry point torch calls, with its C++ exception
 * caught on the C++ side (ctypes and C cannot catch one). Returns the status (CP_OK on
 * success); on failure the exception's message is written to buf. */
int cudapool_alloc_catching(size_t size, int device, void *stream, void **out_ptr, char *buf, size_t buf_size);

#ifdef __cplusplus
}
#endif

#endif /* CP_TORCH_TESTING_H */
