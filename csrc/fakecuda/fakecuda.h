// fakecuda.h — the fake GPU below Python, for `ab --simulate`: what its files share.
// fakecuda_device.cpp has the device (the recording allocator, the device guard), calling
// fakecuda_vtable.cpp for the answer to autograd's context question and fakecuda_reducer.cpp for
// DistributedDataParallel's timer; fakecuda_kernels.cpp the
// kernels that stand for torch's CUDA kernels, with the cache of what they return, keyed by
// fakecuda_key.cpp; fakecuda_module.cpp the module cudapool._torch_fakecuda that Python installs
// them with (cudapool.fakegpu.native). Note [Fake CUDA in C++] in fakecuda_kernels.cpp.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/function_schema.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/Allocator.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include "core/trace_event.h" // the record the device writes: the replay's own (cp_trace_event_t)

namespace cudapool_fakecuda {

// ---- fakecuda_device.cpp ------------------------------------------------------------------

// The calling thread's current device and stream (torch.cuda.set_device and torch.cuda.stream
// on the fake GPU set them through fakecuda_module.cpp; the device guard through torch), and how
// many devices the fake GPU has.
c10::DeviceIndex current_device();
c10::StreamId current_stream();
int device_count();
void set_current_device(c10::DeviceIndex device);
void set_current_stream(c10::StreamId stream);
c10::DeviceIndex index_of(c10::Device d); // a device's index, the current one for "cuda"
// A block of the recording allocator on device (no memory: an address never dereferenced).
c10::DataPtr allocate(size_t n, c10::DeviceIndex device);
c10::Allocator *recording_allocator();
// Calls watcher (once, on the allocating thread, outside the records' lock) when the record at
// index is an allocation and is recorded; a null watcher: none.
void watch_record(int64_t index, std::function<void()> watcher);
// From now on what any thread allocates on `stream` is recorded on the trace stream pool_stream
// (a CUDA graph's private pool); 0 ends it.
void capture_to_pool(c10::StreamId stream, int64_t pool_stream);
// A kernel's scratch: its allocation (the id) and its free.
int64_t record_scratch(int64_t n, int64_t device);
void record_scratch_free(int64_t id, int64_t n, int64_t device);
// Installs the device guard and the hooks' answers (init and the pinned allocator too with
// whole_process), and starts recording; "" or why it cannot.
std::string install_device(int devices, bool whole_process);
void uninstall_device();
// The records from index start on, copied under the record's lock into room(n): room for n
// records that the caller makes (it may throw). How many were copied.
size_t copy_records(size_t start, const std::function<cp_trace_event_t *(size_t n)> &room);
struct RecordCounts {
  size_t events;
  int64_t live, peak;
};
RecordCounts record_counts();

// ---- fakecuda_reducer.cpp (Note [The reducer's timer]) ---------------------------------------

// Makes DistributedDataParallel's reducer time its iterations on the host on CUDA devices.
void install_reducer_timer();

// ---- fakecuda_vtable.cpp (Note [The primary-context slot]) ------------------------------

// What hasPrimaryContext answers while installed (called as the member function it replaces).
using ContextAnswer = bool (*)(const at::CUDAHooksInterface *hooks, c10::DeviceIndex device);
// What init, getPinnedMemoryAllocator and isPinnedPtr answer in a process of the fake GPU's own (Note [A
// process of the fake GPU's own]).
struct ProcessAnswers {
  void (*init)(const at::CUDAHooksInterface *hooks);
  c10::Allocator *(*pinned_allocator)(const at::CUDAHooksInterface *hooks);
  bool (*is_pinned)(const at::CUDAHooksInterface *hooks, const void *data);
};
// Makes torch's CUDA hooks answer with `context` (and `process`'s answers when given): "" when
// done, else why not (nothing changed).
std::string patch_hooks(ContextAnswer context, const ProcessAnswers *process);
// Gives torch's answers back (nothing when none was patched).
void unpatch_hooks();

// ---- fakecuda_key.cpp ----------------------------------------------------------------------

// The tensors among an operation's arguments, and what their devices say.
struct Inputs {
  std::vector<at::Tensor> tensors;          // every tensor argument, in order
  std::vector<c10::StorageImpl *> storages; // their distinct storages
  c10::DeviceIndex device = -1;             // of the first CUDA tensor or CUDA device argument
  bool to_host = false;                     // a device argument names the CPU
};
// Appends to key what decides the outputs of an operation of `schema` called with args (its
// arguments, as the stack holds them) and gathers their tensors into in; false when the outputs
// cannot be cached (computed every time).
bool key_arguments(const c10::FunctionSchema &schema, const c10::IValue *args, std::vector<int64_t> &key, Inputs &in);

// ---- fakecuda_kernels.cpp -----------------------------------------------------------------

// What the kernels ask of the caller (Python, through fakecuda_module.cpp).
struct Hooks {
  virtual ~Hooks() = default;
  // A read of values (t: the CUDA tensor read); may throw to refuse it.
  virtual void read(const char *what, const at::Tensor &t) = 0;
  // The scratch steps of an operation of scratch_ops with these (meta) arguments.
  virtual std::vector<int64_t> scratch(const c10::FunctionSchema &schema, const std::vector<c10::IValue> &args) = 0;
  // torch's SDPBackend value for scaled_dot_product_attention's arguments.
  virtual int64_t choose_attention(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                                   const std::optional<at::Tensor> &mask, double dropout_p, bool is_causal,
                                   std::optional<double> scale, bool enable_gqa) = 0;
  std::unordered_set<std::string> scratch_ops;
  int64_t workspace_bytes = 0;
};

// Registers the kernels (the number of operations they stand for); throws when it cannot.
int64_t install_kernels(std::unique_ptr<Hooks> hooks);
// Drops them; the hooks are destroyed here (the caller holds what they need: the GIL).
void uninstall_kernels();
struct KernelCounts {
  int64_t operations, cached, kernels;
  int64_t workspaces; // cuBLAS workspaces taken (one per thread and stream that ran a BLAS operation)
  bool installed;
};
KernelCounts kernel_counts();

} // namespace cudapool_fakecuda
