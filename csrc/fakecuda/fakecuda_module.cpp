// fakecuda_module.cpp — the module cudapool._torch_fakecuda: installs the fake GPU below Python
// (fakecuda.h; Note [Fake CUDA in C++] in fakecuda_kernels.cpp) with Python's answers to what its
// kernels ask, and hands the recorded events to cudapool.fakegpu.native as the trace's own records. Built by setup.py against
// the installed torch and its Python bindings; used only when it was built for the running torch.
#include <torch/csrc/Storage.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "fakecuda/fakecuda.h"

#ifndef CUDAPOOL_TORCH_VERSION
#error "CUDAPOOL_TORCH_VERSION (the version of torch this is built against) must be defined"
#endif

namespace py = pybind11;

namespace {

using namespace cudapool_fakecuda;

// Python's answers; every call takes the GIL (the kernels run without it, on any thread).
struct PythonHooks final : Hooks {
  py::object on_read, on_scratch, on_attention;

  void read(const char *what, const at::Tensor &t) override {
    py::gil_scoped_acquire gil;
    on_read(what, torch::jit::toPyObject(c10::IValue(t)));
  }

  std::vector<int64_t> scratch(const c10::FunctionSchema &schema, const std::vector<c10::IValue> &args) override {
    py::gil_scoped_acquire gil;
    py::list positional;
    py::dict keywords; // keyword-only arguments by name, as torch's dispatch passes them
    for (size_t i = 0; i < args.size() && i < schema.arguments().size(); i++) {
      py::object o = torch::jit::toPyObject(args[i]);
      if (schema.arguments()[i].kwarg_only())
        keywords[py::str(schema.arguments()[i].name())] = o;
      else
        positional.append(o);
    }
    py::object steps = on_scratch(schema.name(), py::tuple(positional), keywords);
    std::vector<int64_t> out;
    for (py::handle s : steps) out.push_back(s.cast<int64_t>());
    return out;
  }

  int64_t choose_attention(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                           const std::optional<at::Tensor> &mask, double dropout_p, bool is_causal,
                           std::optional<double> scale, bool enable_gqa) override {
    py::gil_scoped_acquire gil;
    py::dict kwargs;
    kwargs["scale"] = scale ? py::object(py::float_(*scale)) : py::object(py::none());
    kwargs["enable_gqa"] = enable_gqa;
    py::tuple args =
        py::make_tuple(torch::jit::toPyObject(c10::IValue(q)), torch::jit::toPyObject(c10::IValue(k)),
                       torch::jit::toPyObject(c10::IValue(v)),
                       torch::jit::toPyObject(mask ? c10::IValue(*mask) : c10::IValue()), dropout_p, is_causal);
    return on_attention(args, kwargs).cast<int64_t>();
  }
};

int64_t install(int devices, int64_t workspace_bytes, py::object read, py::object scratch, py::object sdp_choice,
                std::vector<std::string> scratch_ops, bool whole_process) {
  TORCH_CHECK(devices >= 1 && devices <= 64, "cudapool's fake GPU: devices must be 1..64, not ", devices);
  auto hooks = std::make_unique<PythonHooks>();
  hooks->on_read = std::move(read);
  hooks->on_scratch = std::move(scratch);
  hooks->on_attention = std::move(sdp_choice);
  hooks->scratch_ops.insert(scratch_ops.begin(), scratch_ops.end());
  hooks->workspace_bytes = workspace_bytes;
  int64_t kernels = install_kernels(std::move(hooks));
  std::string why = install_device(devices, whole_process);
  if (!why.empty()) {
    uninstall_kernels();
    TORCH_CHECK(false, "cudapool's fake GPU: ", why);
  }
  return kernels;
}

void uninstall() {
  uninstall_device();
  uninstall_kernels();
}

// Appends to `records` (a bytearray of whole records) the records it does not hold yet; how many.
size_t append_records(py::object records) {
  PyObject *buf = records.ptr();
  if (!PyByteArray_Check(buf)) throw py::type_error("append_records takes a bytearray");
  const size_t have = static_cast<size_t>(PyByteArray_GET_SIZE(buf));
  if (have % sizeof(cp_trace_event_t) != 0) throw py::value_error("the bytearray does not hold whole records");
  return copy_records(have / sizeof(cp_trace_event_t), [&](size_t n) {
    if (PyByteArray_Resize(buf, static_cast<Py_ssize_t>(have + n * sizeof(cp_trace_event_t))) != 0)
      throw py::error_already_set();
    return reinterpret_cast<cp_trace_event_t *>(PyByteArray_AS_STRING(buf) + have);
  });
}

// The record's fields as (name, offset, bytes), in order: what cudapool.lab._events checks its layout against.
py::tuple record_layout() {
  using E = cp_trace_event_t;
  return py::make_tuple(py::make_tuple("action", offsetof(E, action), sizeof(E::action)),
                        py::make_tuple("device", offsetof(E, device), sizeof(E::device)),
                        py::make_tuple("id", offsetof(E, id), sizeof(E::id)),
                        py::make_tuple("size", offsetof(E, size), sizeof(E::size)),
                        py::make_tuple("stream", offsetof(E, stream), sizeof(E::stream)),
                        py::make_tuple("time_ns", offsetof(E, time_ns), sizeof(E::time_ns)));
}

// The calling thread's current device of the fake GPU: torch.cuda.set_device's (Python's patch).
void set_device(int64_t device) {
  TORCH_CHECK(device >= 0 && device < device_count(), "cudapool's fake GPU has ", device_count(),
              " device(s): there is no cuda:", device);
  set_current_device(static_cast<c10::DeviceIndex>(device));
}

// UntypedStorage.resize_ of a storage of the fake GPU (Python's patch; FSDP frees and refills its
// unsharded parameters so): as CUDA's, a new block of nbytes (none for 0) and the old one freed
// after it; the values, which are not there, are not copied.
void resize_storage(py::object storage, int64_t nbytes) {
  TORCH_CHECK(nbytes >= 0, "cudapool's fake GPU: a storage cannot be resized to ", nbytes, " bytes");
  PyObject *o = storage.ptr();
  if (!THPStorage_Check(o)) throw py::type_error("resize_storage takes a torch.UntypedStorage");
  c10::StorageImpl *impl = THPStorage_Unpack(o).unsafeGetStorageImpl();
  TORCH_CHECK(impl->device_type() == c10::kCUDA, "cudapool's fake GPU: resize_storage takes a CUDA storage");
  TORCH_CHECK(impl->resizable(), "cudapool's fake GPU: the storage is not resizable");
  c10::DeviceIndex device = impl->device().index();
  c10::DataPtr fresh = nbytes == 0 ? c10::DataPtr(nullptr, impl->device())
                                   : allocate(static_cast<size_t>(nbytes), device < 0 ? current_device() : device);
  impl->set_data_ptr_noswap(std::move(fresh));
  impl->set_nbytes(static_cast<size_t>(nbytes));
}

py::dict counts() {
  RecordCounts r = record_counts();
  KernelCounts k = kernel_counts();
  py::dict d;
  d["events"] = r.events;
  d["live_bytes"] = r.live;
  d["peak_bytes"] = r.peak;
  d["operations"] = k.operations;
  d["cached"] = k.cached;
  d["kernels"] = k.kernels;
  d["workspaces"] = k.workspaces;
  d["installed"] = k.installed;
  return d;
}

} // namespace

PYBIND11_MODULE(_torch_fakecuda, m) {
  m.doc() =
      "A CUDA device that is not there, below Python (Note [Fake CUDA in C++] in csrc/fakecuda/fakecuda_kernels.cpp).";
  m.attr("torch_version") = CUDAPOOL_TORCH_VERSION;
  m.def("install", &install, py::arg("devices"), py::arg("workspace_bytes"), py::arg("read"), py::arg("scratch"),
        py::arg("sdp_choice"), py::arg("scratch_ops"), py::arg("whole_process") = false);
  m.def("uninstall", &uninstall);
  m.def("append_records", &append_records, py::arg("records"));
  m.attr("record_size") = sizeof(cp_trace_event_t);
  m.attr("record_layout") = record_layout();
  m.def("counts", &counts);
  m.def("set_device", &set_device, py::arg("device"));
  m.def("resize_storage", &resize_storage, py::arg("storage"), py::arg("nbytes"));
  m.def("current_device", [] { return static_cast<int64_t>(current_device()); });
  m.def(
      "set_stream", [](int64_t stream) { set_current_stream(static_cast<c10::StreamId>(stream)); }, py::arg("stream"));
  m.def("current_stream", [] { return static_cast<int64_t>(current_stream()); });
  m.def(
      "watch_record",
      [](int64_t index, py::object hook) {
        if (hook.is_none()) {
          watch_record(-1, nullptr);
          return;
        }
        // Released with the GIL held, on whichever thread drops the last copy of the watcher.
        std::shared_ptr<py::object> held(new py::object(std::move(hook)), [](py::object *o) {
          py::gil_scoped_acquire gil;
          delete o;
        });
        watch_record(index, [held] {
          py::gil_scoped_acquire gil;
          try {
            (*held)();
          } catch (py::error_already_set &e) {
            e.discard_as_unraisable("cudapool._torch_fakecuda.watch_record's hook");
          }
        });
      },
      py::arg("index"), py::arg("hook"),
      "Calls hook() once, on the allocating thread, when the record at index (an allocation) is recorded; "
      "None: no longer.");
  m.def(
      "capture_to_pool",
      [](int64_t stream, int64_t pool_stream) { capture_to_pool(static_cast<c10::StreamId>(stream), pool_stream); },
      py::arg("stream"), py::arg("pool_stream"),
      "What is allocated on stream is recorded on the trace stream pool_stream from now on (0: no longer).");
}
