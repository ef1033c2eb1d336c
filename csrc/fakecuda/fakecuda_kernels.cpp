// fakecuda_kernels.cpp — the kernels of the fake GPU below Python (fakecuda.h): they stand for
// torch's CUDA kernels while cudapool._torch_fakecuda is installed.
//
// Note [Fake CUDA in C++]
// A script's CUDA tensors are ordinary torch CUDA tensors: dense, of device cuda:N, dispatched
// to torch's CUDA kernels, with autograd's engine, CUDA's autocast rules and every composite
// operation as torch runs them on a GPU. What is not there is the device, so:
//  - every ATen operation with a CUDA kernel that would run device code gets this module's
//    kernel instead (a torch::Library registered for the CUDA key, overriding torch's; dropped
//    at uninstall, which brings torch's back). Views keep torch's kernels: they only make
//    metadata. The kernel computes the outputs' sizes, strides and dtypes on meta tensors that
//    stand for the inputs (torch's meta kernels: C++ or Python), and makes CUDA outputs whose
//    storage comes from the recording allocator below; an output that is an input (in place,
//    out=) is that input, grown when the meta kernel grew it. What an operation returns as a
//    function of its inputs' metadata is cached: a second call with the same shapes makes its
//    outputs without the meta kernel, in C++ only (the reason this exists: tracing at tens of
//    thousands of allocations per second).
//  - the allocator records each allocation and free (id, bytes, stream, device, time) as the
//    replay's own record (core/trace_event.h), which Python gets as bytes and saves as they are,
//    and hands out addresses that are never dereferenced (a bump pointer, never reused).
//  - torch's CUDA device guard is replaced by one that keeps the device and stream per thread
//    and has N devices; events and synchronisation do nothing.
//  - autograd's engine asks torch's CUDA hooks whether a device has a primary context (the
//    driver's answer) before it stashes the caller's streams; that one slot of the hooks'
//    virtual table answers "yes" for the fake devices while installed (Note [The
//    primary-context slot] in fakecuda_vtable.cpp: why nothing torch supports can).
//  - values are not simulated: a read (item(), a copy to the host) gets zeros and is reported
//    to Python, which counts it with the script's line.
//  - what the GPU allocates besides tensors: the cuBLAS workspace of each (thread, stream) at
//    its first BLAS operation (never freed, as torch keeps it), and the scratch of kernels that
//    Python models (cudapool.fakegpu.kernel_scratch), asked once per shape and cached; steps
//    before a 0 in the model's steps run at that first call only (cuDNN's benchmark search).
//  - scaled_dot_product_attention's kernel choice (_fused_sdp_choice) is Python's
//    (cudapool.fakegpu.attention): the kernel torch picks on the named GPU.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/transformers/attention.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "fakecuda/fakecuda.h"

namespace cudapool_fakecuda {
namespace {

std::unique_ptr<Hooks> hooks; // set while installed

// ---- the cache: what an operation returns, for the key of its inputs (fakecuda_key.cpp) ----

// One tensor an operation returns, described in terms of its inputs.
struct Output {
  enum Kind { kUndefined, kInput, kView, kFresh, kHost } kind = kUndefined;
  int index = -1; // kInput, kView: which input tensor; kFresh: which new storage
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
  int64_t nbytes = 0; // kInput: the bytes its storage needs after the call
  at::ScalarType dtype = at::kFloat;
  bool conj = false, neg = false;
};
struct Returned {
  enum Kind { kValue, kTensor, kTensors } kind = kValue;
  c10::IValue value; // kValue: None, a number or a bool
  std::vector<Output> outputs;
};
struct Entry {
  std::vector<Returned> returns;
  std::vector<int64_t> fresh_bytes; // the new storages' sizes
  std::vector<int64_t> scratch;     // cudapool.fakegpu.kernel_scratch's steps
  std::string scratch_what;
  bool blas = false;       // takes the cuBLAS workspace
  bool host_write = false; // writes a host tensor (a copy to the host): zeros
  bool host_read = false;  // reads values to the host (host_write, or a host result)
};

struct KeyHash {
  size_t operator()(const std::vector<int64_t> &k) const noexcept {
    uint64_t h = 1469598103934665603ull;
    for (int64_t v : k) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};
std::mutex cache_mu;
std::unordered_map<std::vector<int64_t>, std::shared_ptr<const Entry>, KeyHash> cache;
std::atomic<int64_t> calls{0}, hits{0};

// ---- meta tensors that stand for the inputs ----------------------------------------------

struct Twins {
  std::vector<std::pair<c10::StorageImpl *, c10::Storage>> storages; // input's -> meta
  std::vector<at::Tensor> meta;                                      // meta[i] stands for tensors[i]
};

at::Tensor twin(const at::Tensor &t, Twins &tw) {
  if (!t.defined()) return t;
  TORCH_CHECK(t.layout() == c10::kStrided && t.has_storage(), "cudapool's fake GPU simulates dense tensors, not ",
              t.layout(), " ones");
  if (t.is_cpu() && t.unsafeGetTensorImpl()->is_wrapped_number()) {
    tw.meta.push_back(t); // a Python number: meta kernels take it as it is
    return t;
  }
  c10::StorageImpl *s = t.storage().unsafeGetStorageImpl();
  c10::Storage ms;
  for (auto &p : tw.storages)
    if (p.first == s) ms = p.second;
  if (!ms) {
    ms = c10::Storage(c10::Storage::use_byte_size_t(), s->nbytes(), c10::DataPtr(nullptr, c10::Device(c10::kMeta)),
                      c10::GetAllocator(c10::kMeta), true);
    tw.storages.emplace_back(s, ms);
  }
  auto m =
      at::detail::make_tensor<c10::TensorImpl>(std::move(ms), c10::DispatchKeySet(c10::DispatchKey::Meta), t.dtype());
  c10::TensorImpl *impl = m.unsafeGetTensorImpl();
  impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  if (t.unsafeGetTensorImpl()->is_wrapped_number()) impl->set_wrapped_number(true);
  if (t.is_conj()) impl->_set_conj(true);
  if (t.is_neg()) impl->_set_neg(true);
  tw.meta.push_back(m);
  return m;
}

c10::IValue twin_value(const c10::IValue &v, Twins &tw) {
  if (v.isTensor()) return v.toTensor().defined() ? c10::IValue(twin(v.toTensor(), tw)) : v;
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor &t : v.toTensorList()) out.push_back(twin(t, tw));
    return out;
  }
  if (v.isList()) {
    bool tensors = false;
    for (const c10::IValue &e : v.toList()) tensors = tensors || e.isTensor();
    if (!tensors) return v;
    c10::List<std::optional<at::Tensor>> out;
    for (const c10::IValue &e : v.toList())
      out.push_back(e.isTensor() ? std::optional<at::Tensor>(twin(e.toTensor(), tw)) : std::nullopt);
    return out;
  }
  if (v.isDevice() && (v.toDevice().is_cuda() || v.toDevice().is_cpu())) return c10::Device(c10::kMeta);
  return v;
}

Output describe(const at::Tensor &m, const Twins &tw, bool to_host, std::vector<c10::StorageImpl *> &fresh, Entry &e) {
  Output o;
  if (!m.defined()) return o;
  TORCH_CHECK(m.is_meta(), "cudapool's fake GPU: a meta kernel returned a tensor on ", m.device());
  o.dtype = m.scalar_type();
  o.sizes = m.sizes().vec();
  o.strides = m.strides().vec();
  o.offset = m.storage_offset();
  o.conj = m.is_conj();
  o.neg = m.is_neg();
  const c10::TensorImpl *impl = m.unsafeGetTensorImpl();
  c10::StorageImpl *s = m.storage().unsafeGetStorageImpl();
  for (size_t i = 0; i < tw.meta.size(); i++)
    if (tw.meta[i].unsafeGetTensorImpl() == impl) {
      o.kind = Output::kInput;
      o.index = static_cast<int>(i);
      o.nbytes = static_cast<int64_t>(s->nbytes());
      return o;
    }
  for (size_t i = 0; i < tw.meta.size(); i++)
    if (tw.meta[i].storage().unsafeGetStorageImpl() == s) {
      o.kind = Output::kView;
      o.index = static_cast<int>(i);
      return o;
    }
  if (to_host) {
    o.kind = Output::kHost;
    return o;
  }
  o.kind = Output::kFresh;
  for (size_t i = 0; i < fresh.size(); i++)
    if (fresh[i] == s) {
      o.index = static_cast<int>(i);
      return o;
    }
  o.index = static_cast<int>(fresh.size());
  fresh.push_back(s);
  e.fresh_bytes.push_back(static_cast<int64_t>(s->nbytes()));
  return o;
}

// ---- outputs from an entry ---------------------------------------------------------------

at::Tensor cuda_tensor(c10::Storage storage, const Output &o) {
  auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CUDA),
                                                    c10::scalarTypeToTypeMeta(o.dtype));
  c10::TensorImpl *impl = t.unsafeGetTensorImpl();
  impl->set_sizes_and_strides(o.sizes, o.strides, o.offset);
  if (o.conj) impl->_set_conj(true);
  if (o.neg) impl->_set_neg(true);
  return t;
}

c10::DeviceIndex device_of(const Inputs &in) { return in.device < 0 ? current_device() : in.device; }

at::Tensor make_output(const Output &o, const Inputs &in, const Entry &e, std::vector<c10::Storage> &fresh) {
  switch (o.kind) {
    case Output::kUndefined: return at::Tensor();
    case Output::kInput: {
      at::Tensor t = in.tensors[static_cast<size_t>(o.index)];
      c10::TensorImpl *impl = t.unsafeGetTensorImpl();
      if (impl->sizes() != c10::IntArrayRef(o.sizes) || impl->strides() != c10::IntArrayRef(o.strides) ||
          impl->storage_offset() != o.offset) {
        c10::Storage storage = t.storage();
        if (static_cast<size_t>(o.nbytes) > storage.nbytes()) {
          // Grown (resize_, out= with a larger result): CUDA allocates the new size, copies, then
          // frees the old block; a host tensor grows on the host.
          if (t.is_cuda()) {
            storage.set_data_ptr_noswap(allocate(static_cast<size_t>(o.nbytes), t.device().index()));
            storage.set_nbytes(static_cast<size_t>(o.nbytes));
          } else {
            t.resize_({o.nbytes / static_cast<int64_t>(t.element_size())});
          }
        }
        impl->set_sizes_and_strides(o.sizes, o.strides, o.offset);
      }
      if (t.is_cpu() && e.host_write) t.zero_();
      return t;
    }
    case Output::kView: return cuda_tensor(in.tensors[static_cast<size_t>(o.index)].storage(), o);
    case Output::kHost:
      return at::empty_strided(o.sizes, o.strides, at::TensorOptions().dtype(o.dtype).device(c10::kCPU)).zero_();
    case Output::kFresh: {
      c10::Storage &storage = fresh[static_cast<size_t>(o.index)];
      if (!storage) {
        size_t n = static_cast<size_t>(e.fresh_bytes[static_cast<size_t>(o.index)]);
        storage =
            c10::Storage(c10::Storage::use_byte_size_t(), n, allocate(n, device_of(in)), recording_allocator(), true);
      }
      return cuda_tensor(storage, o);
    }
  }
  return at::Tensor();
}

// The cuBLAS workspace of this thread and stream, at its first BLAS operation.
struct Workspaces {
  std::mutex mu;
  std::vector<std::pair<std::pair<std::thread::id, int64_t>, c10::DataPtr>> held;
};
Workspaces workspaces;

void take_workspace(const Inputs &in) {
  if (!hooks || hooks->workspace_bytes <= 0) return;
  auto key = std::make_pair(std::this_thread::get_id(), static_cast<int64_t>(current_stream()));
  std::lock_guard<std::mutex> lock(workspaces.mu);
  for (auto &w : workspaces.held)
    if (w.first == key) return;
  workspaces.held.emplace_back(key, allocate(static_cast<size_t>(hooks->workspace_bytes), device_of(in)));
}

void run_scratch(const std::vector<int64_t> &steps, const Inputs &in) {
  std::vector<int64_t> ids, sizes;
  int64_t device = device_of(in);
  for (int64_t step : steps) {
    if (step > 0) {
      ids.push_back(record_scratch(step, device));
      sizes.push_back(step);
    } else if (step < 0 && static_cast<size_t>(-step) <= ids.size()) {
      size_t i = static_cast<size_t>(-step) - 1;
      record_scratch_free(ids[i], sizes[i], device);
    }
  }
}

void finish(const Entry &e, const Inputs &in, torch::jit::Stack *stack) {
  std::vector<c10::Storage> fresh(e.fresh_bytes.size());
  for (const Returned &r : e.returns) {
    if (r.kind == Returned::kValue) {
      stack->push_back(r.value);
    } else if (r.kind == Returned::kTensor) {
      stack->push_back(make_output(r.outputs[0], in, e, fresh));
    } else {
      c10::List<at::Tensor> list;
      list.reserve(r.outputs.size());
      for (const Output &o : r.outputs) list.push_back(make_output(o, in, e, fresh));
      stack->push_back(std::move(list));
    }
  }
  if (e.blas) take_workspace(in);
  if (!e.scratch.empty()) run_scratch(e.scratch, in);
}

// The CUDA tensor an operation reads values of (the source of a copy to the host).
at::Tensor device_tensor(const Inputs &in) {
  for (const at::Tensor &t : in.tensors)
    if (t.is_cuda()) return t;
  return at::Tensor();
}

void report_read(const char *what, const at::Tensor &t) {
  if (hooks) hooks->read(what, t);
}

const std::unordered_set<std::string> blas_ops = {
    "aten::mm", "aten::addmm", "aten::bmm",  "aten::baddbmm",           "aten::addbmm",    "aten::addmv",
    "aten::mv", "aten::dot",   "aten::vdot", "aten::_addmm_activation", "aten::_scaled_mm"};

// Operations whose outputs' shapes depend on the inputs' values.
const std::unordered_set<std::string> value_shaped = {"aten::nonzero",
                                                      "aten::nonzero_numpy",
                                                      "aten::argwhere",
                                                      "aten::masked_select",
                                                      "aten::_unique",
                                                      "aten::_unique2",
                                                      "aten::unique_dim",
                                                      "aten::unique_consecutive",
                                                      "aten::unique_dim_consecutive",
                                                      "aten::repeat_interleave",
                                                      "aten::bincount",
                                                      "aten::histc",
                                                      "aten::_local_scalar_dense"};

[[noreturn]] void throw_value_shaped(const std::string &name) {
  TORCH_CHECK(false, name, " cannot run on cudapool's fake GPU: its output's shape is data-dependent (it depends on ",
              "tensor values, which the fake GPU does not have)");
}

// ---- the kernels -------------------------------------------------------------------------

void fake_kernel(const c10::OperatorHandle &op, c10::DispatchKeySet, torch::jit::Stack *stack) {
  calls++;
  const c10::FunctionSchema &schema = op.schema();
  size_t nargs = schema.arguments().size();
  size_t base = stack->size() - nargs;
  std::vector<int64_t> key;
  key.reserve(48);
  Inputs in;
  bool cacheable = key_arguments(schema, stack->data() + base, key, in);
  if (cacheable) {
    std::shared_ptr<const Entry> e;
    {
      std::lock_guard<std::mutex> lock(cache_mu);
      auto it = cache.find(key);
      if (it != cache.end()) e = it->second;
    }
    if (e) {
      hits++;
      stack->resize(base);
      if (e->host_read) report_read("a copy to the host", device_tensor(in));
      finish(*e, in, stack);
      return;
    }
  }
  // The meta kernel, on tensors that stand for the inputs.
  Twins tw;
  for (size_t i = base; i < stack->size(); i++) (*stack)[i] = twin_value((*stack)[i], tw);
  const std::string &name = schema.name();
  bool scratch = hooks && hooks->scratch_ops.count(name);
  std::vector<c10::IValue> meta_args;
  if (scratch) meta_args.assign(stack->begin() + static_cast<ptrdiff_t>(base), stack->end());
  try {
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::Meta), stack);
  } catch (const c10::NotImplementedError &exc) {
    if (value_shaped.count(name)) throw_value_shaped(name);
    TORCH_CHECK(false, name, " has no fake (meta) implementation: it cannot run on cudapool's fake GPU (",
                exc.what_without_backtrace(), ")");
  } catch (const std::exception &) {
    if (value_shaped.count(name)) throw_value_shaped(name);
    throw;
  }
  auto e = std::make_shared<Entry>();
  std::vector<c10::StorageImpl *> fresh;
  size_t nret = schema.returns().size();
  TORCH_CHECK(stack->size() >= nret && tw.meta.size() == in.tensors.size(),
              "cudapool's fake GPU: unexpected stack after ", name);
  for (size_t i = stack->size() - nret; i < stack->size(); i++) {
    const c10::IValue &r = (*stack)[i];
    Returned ret;
    if (r.isTensor()) {
      ret.kind = Returned::kTensor;
      ret.outputs.push_back(describe(r.toTensor(), tw, in.to_host, fresh, *e));
    } else if (r.isTensorList()) {
      ret.kind = Returned::kTensors;
      for (const at::Tensor &t : r.toTensorList()) ret.outputs.push_back(describe(t, tw, in.to_host, fresh, *e));
    } else if (r.isNone() || r.isInt() || r.isDouble() || r.isBool()) {
      ret.value = r;
    } else {
      TORCH_CHECK(false, "cudapool's fake GPU: ", name, " returns ", r.tagKind(), ", which it cannot simulate");
    }
    e->returns.push_back(std::move(ret));
  }
  for (const Returned &r : e->returns)
    for (const Output &o : r.outputs) {
      if (o.kind == Output::kInput && in.tensors[static_cast<size_t>(o.index)].is_cpu()) e->host_write = true;
      if (o.kind == Output::kHost) e->host_read = true;
    }
  e->host_read = e->host_read || e->host_write;
  e->blas = blas_ops.count(name) > 0;
  std::vector<int64_t> first; // steps of this first call only: before a 0 in the model's steps
  if (scratch) {
    e->scratch = hooks->scratch(schema, meta_args);
    auto mark = std::find(e->scratch.begin(), e->scratch.end(), int64_t{0});
    if (mark != e->scratch.end()) {
      first.assign(e->scratch.begin(), mark);
      e->scratch.erase(e->scratch.begin(), mark + 1);
    }
  }
  stack->resize(stack->size() - nret);
  if (e->host_read) report_read("a copy to the host", device_tensor(in));
  if (!first.empty()) run_scratch(first, in);
  finish(*e, in, stack);
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mu);
    cache.emplace(std::move(key), std::move(e));
  }
}

// item(), and what reads one value: zero of the tensor's type.
void scalar_kernel(const c10::OperatorHandle &, c10::DispatchKeySet, torch::jit::Stack *stack) {
  at::Tensor t = stack->back().toTensor();
  stack->pop_back();
  report_read(".item()", t);
  if (t.is_complex())
    stack->emplace_back(c10::Scalar(c10::complex<double>(0.0, 0.0)));
  else if (t.is_floating_point())
    stack->emplace_back(c10::Scalar(0.0));
  else if (t.scalar_type() == at::kBool)
    stack->emplace_back(c10::Scalar(false));
  else
    stack->emplace_back(c10::Scalar(int64_t{0}));
}

// torch.equal: a value read; False, as a comparison of zeros' stand-ins reads.
void equal_kernel(const c10::OperatorHandle &, c10::DispatchKeySet, torch::jit::Stack *stack) {
  at::Tensor t = (*stack)[stack->size() - 2].toTensor();
  stack->resize(stack->size() - 2);
  report_read("torch.equal()", t);
  stack->emplace_back(false);
}

void nothing_kernel(const c10::OperatorHandle &op, c10::DispatchKeySet, torch::jit::Stack *stack) {
  stack->resize(stack->size() - op.schema().arguments().size()); // record_stream: no streams to wait for
}

// Which kernel torch's scaled_dot_product_attention runs on the named GPU: Python's answer. The
// tensors themselves go to Python: whether they need a gradient is part of the choice.
int64_t choose_attention(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                         const std::optional<at::Tensor> &mask, double dropout_p, bool is_causal,
                         std::optional<double> scale, bool enable_gqa) {
  if (!hooks) return 0; // math
  return hooks->choose_attention(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa);
}

void sdp_choice_kernel(const c10::OperatorHandle &, c10::DispatchKeySet, torch::jit::Stack *stack) {
  auto args = torch::jit::last(*stack, 8);
  int64_t choice =
      choose_attention(args[0].toTensor(), args[1].toTensor(), args[2].toTensor(), args[3].toOptional<at::Tensor>(),
                       args[4].toDouble(), args[5].toBool(), args[6].toOptional<double>(), args[7].toBool());
  torch::jit::drop(*stack, 8);
  stack->emplace_back(choice);
}

// Views make only metadata: torch's kernels stay. So do the operations that set a tensor's storage.
bool keeps_torch_kernel(const c10::FunctionSchema &s) {
  for (const c10::Argument &r : s.returns())
    if (r.alias_info() && !r.alias_info()->isWrite()) return true;
  return s.name() == "aten::set_" || s.name() == "aten::is_pinned" || s.name() == "aten::_pin_memory";
}

} // namespace
} // namespace cudapool_fakecuda

// torch's scaled_dot_product_attention asks its CUDA kernel choice of this function (through a
// DispatchStub, not the dispatcher): replaced while installed.
namespace at::native {
int64_t _fused_sdp_choice_cuda(const at::Tensor &, const at::Tensor &, const at::Tensor &,
                               const std::optional<at::Tensor> &, double, bool, std::optional<double>, bool);
} // namespace at::native

namespace cudapool_fakecuda {
namespace {

std::unique_ptr<torch::Library> library;
int64_t overridden = 0;

struct Quiet final : c10::WarningHandler {
  void process(const c10::Warning &) override {} // "overriding a previously registered kernel"
};

} // namespace

int64_t install_kernels(std::unique_ptr<Hooks> h) {
  TORCH_CHECK(!library, "cudapool's fake GPU is installed already");
  TORCH_CHECK(h->workspace_bytes >= 0, "cudapool's fake GPU: workspace_bytes must be >= 0, not ", h->workspace_bytes);
  hooks = std::move(h);
  Quiet quiet;
  c10::WarningUtils::WarningHandlerGuard quiet_guard(&quiet);
  auto lib = std::make_unique<torch::Library>(
      torch::Library::IMPL, "aten", std::optional<c10::DispatchKey>(c10::DispatchKey::CUDA), __FILE__, __LINE__);
  auto &dispatcher = c10::Dispatcher::singleton();
  int64_t n = 0;
  for (const c10::OperatorName &name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto op = dispatcher.findOp(name);
    if (!op || !op->hasComputedKernelForDispatchKey(c10::DispatchKey::CUDA)) continue;
    if (op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd) &&
        !op->hasKernelForDispatchKey(c10::DispatchKey::CUDA))
      continue; // decomposes on CUDA too: its parts come here
    if (keeps_torch_kernel(op->schema())) continue;
    std::string full = name.name.substr(6);
    if (!name.overload_name.empty()) full += "." + name.overload_name;
    const std::string &base = name.name;
    if (base == "aten::_local_scalar_dense")
      lib->impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&scalar_kernel>());
    else if (base == "aten::equal")
      lib->impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&equal_kernel>());
    else if (base == "aten::record_stream")
      lib->impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&nothing_kernel>());
    else if (base == "aten::_fused_sdp_choice")
      lib->impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&sdp_choice_kernel>());
    else
      lib->impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&fake_kernel>());
    n++;
  }
  library = std::move(lib);
  overridden = n;
  at::native::_fused_sdp_choice_stub.set_cuda_dispatch_ptr(&choose_attention);
  return n;
}

void uninstall_kernels() {
  if (!library) return;
  library.reset();
  at::native::_fused_sdp_choice_stub.set_cuda_dispatch_ptr(&at::native::_fused_sdp_choice_cuda);
  {
    std::lock_guard<std::mutex> lock(workspaces.mu);
    workspaces.held.clear();
  }
  {
    std::lock_guard<std::mutex> lock(cache_mu);
    cache.clear();
  }
  hooks.reset();
}

KernelCounts kernel_counts() {
  int64_t held = 0;
  {
    std::lock_guard<std::mutex> lock(workspaces.mu);
    held = static_cast<int64_t>(workspaces.held.size());
  }
  return {calls.load(), hits.load(), overridden, held, library != nullptr};
}

} // namespace cudapool_fakecuda
