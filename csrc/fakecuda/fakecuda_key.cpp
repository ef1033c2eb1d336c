// fakecuda_key.cpp — an operation's inputs as the key of the fake GPU's cache (fakecuda.h; Note
// [Fake CUDA in C++] in fakecuda_kernels.cpp): what of its arguments decides its outputs' sizes,
// strides and dtypes, and the tensors among them.
#include <cstring>
#include <functional>
#include <string>
#include <unordered_set>
#include <vector>

#include "fakecuda/fakecuda.h"

namespace cudapool_fakecuda {
namespace {

// What a cache key holds: the schema's address, then for each argument one of these tags and
// the parts said beside it. Each kind of argument has its own tag, so that the keys of two
// different arguments never read alike.
enum class Tag : int64_t {
  kNone = -1,                // None: nothing follows
  kInt = -2,                 // an int: its value (a Scalar whose value decides nothing: nothing)
  kDouble = -3,              // a float: its bits (a Scalar whose value decides nothing: nothing)
  kBool = -4,                // a bool: 0 or 1 (a Scalar whose value decides nothing: nothing)
  kDevice = -5,              // a device: its type (the index is the current device's: Inputs)
  kIntList = -6,             // int[]: the length, the values
  kDoubleList = -7,          // float[]: the length, each value's bits
  kBoolList = -8,            // bool[]: the length, the values
  kTensorList = -9,          // Tensor[]: the length, each tensor's part
  kOptionalTensorList = -10, // Tensor?[] (indexing): the length, kNone or the tensor's part each
  kString = -11,             // a string: its hash
  kComplex = -12,            // a complex Scalar whose value decides nothing: nothing
  kNumberList = -13,         // Scalar[] whose values decide nothing: the length, each one's tag
  kUndefinedTensor = -20,    // an undefined tensor: nothing
  kTensor = -21,             // a tensor (key_tensor): its kind, storage, sizes, strides, offset
};

void push_tag(std::vector<int64_t> &key, Tag tag) { key.push_back(static_cast<int64_t>(tag)); }

bool key_tensor(const at::Tensor &t, std::vector<int64_t> &key, Inputs &in) {
  if (!t.defined()) {
    push_tag(key, Tag::kUndefinedTensor);
    return true;
  }
  in.tensors.push_back(t); // every defined tensor, in the order twin() meets them
  if (t.layout() != c10::kStrided || !t.has_storage()) return false;
  c10::StorageImpl *s = t.storage().unsafeGetStorageImpl();
  int64_t which = -1;
  for (size_t i = 0; i < in.storages.size(); i++)
    if (in.storages[i] == s) which = static_cast<int64_t>(i);
  if (which < 0) {
    which = static_cast<int64_t>(in.storages.size());
    in.storages.push_back(s);
  }
  if (t.is_cuda()) {
    if (in.device < 0) in.device = t.device().index();
  } else if (!t.is_cpu()) {
    return false; // meta and other devices: computed every time
  }
  const c10::TensorImpl *impl = t.unsafeGetTensorImpl();
  push_tag(key, Tag::kTensor);
  key.push_back(static_cast<int64_t>(t.scalar_type()) | (static_cast<int64_t>(t.device().type()) << 8) |
                (int64_t{impl->is_wrapped_number()} << 16) | (int64_t{t.is_conj()} << 17) |
                (int64_t{t.is_neg()} << 18));
  key.push_back(which);
  key.push_back(static_cast<int64_t>(s->nbytes()));
  key.push_back(t.dim());
  for (int64_t v : t.sizes()) key.push_back(v);
  for (int64_t v : t.strides()) key.push_back(v);
  key.push_back(t.storage_offset());
  return true;
}

int64_t bits(double d) {
  int64_t b;
  std::memcpy(&b, &d, sizeof b);
  return b;
}

template <typename List, typename Word>
void key_list(std::vector<int64_t> &key, Tag tag, const List &l, Word word) {
  push_tag(key, tag);
  key.push_back(static_cast<int64_t>(l.size()));
  for (auto x : l) key.push_back(word(x));
}

// Whether an argument is a Scalar, Scalar? or Scalar[]: its values decide no output's shape or
// dtype (only whether each is a bool, an integer, a float or a complex number does), except for
// the operations of shaped_by_scalars.
bool is_number(const c10::Argument &arg) {
  c10::TypePtr t = arg.type();
  if (auto o = t->cast<c10::OptionalType>()) t = o->getElementType();
  if (auto l = t->cast<c10::ListType>()) t = l->getElementType();
  return t->kind() == c10::TypeKind::NumberType;
}

const std::unordered_set<std::string> shaped_by_scalars = {"aten::arange", "aten::range"};

// A Scalar's kind, for number arguments (the values of AdamW's step sizes change every step).
bool key_number(const c10::IValue &v, std::vector<int64_t> &key) {
  if (v.isInt()) {
    push_tag(key, Tag::kInt);
  } else if (v.isDouble()) {
    push_tag(key, Tag::kDouble);
  } else if (v.isBool()) {
    push_tag(key, Tag::kBool);
  } else if (v.isComplexDouble()) {
    push_tag(key, Tag::kComplex);
  } else if (v.isNone()) {
    push_tag(key, Tag::kNone);
  } else {
    return false;
  }
  return true;
}

// Appends what decides an argument's effect on the outputs; false where it cannot be cached.
// number: the argument is a Scalar whose value does not matter (is_number).
bool key_value(const c10::IValue &v, std::vector<int64_t> &key, Inputs &in, bool number) {
  if (number) {
    if (!v.isList()) return key_number(v, key);
    auto l = v.toList();
    push_tag(key, Tag::kNumberList);
    key.push_back(static_cast<int64_t>(l.size()));
    for (const c10::IValue &e : l)
      if (!key_number(e, key)) return false;
    return true;
  }
  if (v.isTensor()) return key_tensor(v.toTensor(), key, in);
  if (v.isNone()) {
    push_tag(key, Tag::kNone);
  } else if (v.isInt()) {
    push_tag(key, Tag::kInt);
    key.push_back(v.toInt());
  } else if (v.isDouble()) {
    push_tag(key, Tag::kDouble);
    key.push_back(bits(v.toDouble()));
  } else if (v.isBool()) {
    push_tag(key, Tag::kBool);
    key.push_back(v.toBool());
  } else if (v.isDevice()) {
    c10::Device d = v.toDevice();
    if (d.is_cuda() && in.device < 0) in.device = index_of(d);
    if (d.is_cpu()) in.to_host = true;
    push_tag(key, Tag::kDevice);
    key.push_back(static_cast<int64_t>(d.type()));
  } else if (v.isIntList()) {
    key_list(key, Tag::kIntList, v.toIntList(), [](int64_t x) { return x; });
  } else if (v.isDoubleList()) {
    key_list(key, Tag::kDoubleList, v.toDoubleList(), bits);
  } else if (v.isBoolList()) {
    key_list(key, Tag::kBoolList, v.toBoolList(), [](bool b) { return int64_t{b}; });
  } else if (v.isTensorList()) {
    push_tag(key, Tag::kTensorList);
    auto l = v.toTensorList();
    key.push_back(static_cast<int64_t>(l.size()));
    for (const at::Tensor &t : l)
      if (!key_tensor(t, key, in)) return false;
  } else if (v.isList()) { // Tensor?[] (indexing)
    push_tag(key, Tag::kOptionalTensorList);
    auto l = v.toList();
    key.push_back(static_cast<int64_t>(l.size()));
    for (const c10::IValue &e : l) {
      if (e.isNone()) {
        push_tag(key, Tag::kNone);
      } else if (!e.isTensor() || !key_tensor(e.toTensor(), key, in)) {
        return false;
      }
    }
  } else if (v.isString()) {
    push_tag(key, Tag::kString);
    key.push_back(static_cast<int64_t>(std::hash<std::string>{}(v.toStringRef())));
  } else {
    return false; // complex and symbolic numbers, storages, generators: computed every time
  }
  return true;
}

} // namespace

bool key_arguments(const c10::FunctionSchema &schema, const c10::IValue *args, std::vector<int64_t> &key, Inputs &in) {
  key.push_back(static_cast<int64_t>(reinterpret_cast<intptr_t>(&schema)));
  bool cacheable = true;
  bool by_kind = !shaped_by_scalars.count(schema.name());
  for (size_t i = 0; i < schema.arguments().size(); i++) {
    bool number = by_kind && is_number(schema.arguments()[i]);
    cacheable = key_value(args[i], key, in, number) && cacheable; // every tensor gathered, cacheable or not
  }
  return cacheable;
}

} // namespace cudapool_fakecuda
