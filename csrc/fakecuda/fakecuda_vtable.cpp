// fakecuda_vtable.cpp — the one kind of write into torch's own code the fake GPU makes
// (fakecuda.h): while it is installed, slots of the virtual table of torch's CUDA hooks hold the
// fake device's answers (hasPrimaryContext always; init, getPinnedMemoryAllocator and isPinnedPtr
// in a process that is the trace's alone: Note [A process of the fake GPU's own]).
//
// Note [The primary-context slot]
// Before a backward that runs on CUDA streams, autograd's engine keeps the caller's current stream
// of each device that has a primary context: GraphTask::stash_current_streams asks
// at::globalContext().getAcceleratorHooksInterface().hasPrimaryContext(i) for every device the
// device guard counts. torch's CUDA hooks ask the driver, which fails where there is no GPU (or
// fewer GPUs than the fake has), so the backward would throw. Nothing torch supports changes that
// answer:
//  - the hooks object is made once per process, from CUDAHooksRegistry's "CUDAHooks" entry, at the
//    first call of at::detail::getCUDAHooks(), and kept; torch._C makes that call while `import
//    torch` runs (its module init asks at::hasMAGMA()), before this module can register anything,
//    and a registration could not be undone at uninstall anyway.
//  - c10::cuda::_internal::setHasPrimaryContext sets what c10::cuda::hasPrimaryContext answers,
//    but torch's CUDA hooks call their own function, not that one.
//  - the device guard, which the fake does replace through the registry meant for it
//    (DeviceGuardImplRegistrar), counts devices; the context question goes to the hooks.
//  - a PrivateUse1 backend would answer, but it becomes the accelerator of the process for good.
// So the slot is written: its page made writable with mprotect, the pointer stored, the page made
// read-only again; uninstall stores torch's function back. Before anything is written, the slot
// must hold exactly at::cuda::detail::CUDAHooks::hasPrimaryContext, whose address is looked up by
// name in the symbol table of the library that holds it (libtorch_cuda.so does not export the
// class, so its dynamic symbols do not name it). Anything else (another layout of the hooks, a
// hooks object of another class, a library without its symbol table) refuses, naming the torch
// version this module was built for, and the fake GPU does not install.
//
// Note [A process of the fake GPU's own]
// Pinned host memory (DDP's reducer pins a copy of its used-parameter map with static_graph or
// find_unused_parameters) is allocated through the CUDA hooks: at::globalContext() first runs the
// hooks' init once per process (a c10::once_flag), which asks the driver, then takes the hooks'
// pinned allocator, which asks it again, and the reducer asks the hooks whether what it got is
// pinned. The fake answers all three: init with nothing, the pinned allocator with plain host
// memory it remembers (the host is real; pinning only speeds copies), and whether a pointer is in
// such memory — but only where the
// process is the trace's alone (ab --simulate's child): the once_flag stays set after uninstall,
// so a real GPU could not be initialised in that process afterwards. Elsewhere those slots are
// left alone and pinned allocations fail as they would without a GPU.
#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <link.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "fakecuda/fakecuda.h"

#ifndef CUDAPOOL_TORCH_VERSION
#error "CUDAPOOL_TORCH_VERSION (the version of torch this is built against) must be defined"
#endif

namespace cudapool_fakecuda {
namespace {

// The slots' expected functions, members of at::cuda::detail::CUDAHooks.
static_assert(std::is_same_v<c10::DeviceIndex, int8_t>, "the mangled name below takes a signed char");
constexpr const char *kTorchContext = "_ZNK2at4cuda6detail9CUDAHooks17hasPrimaryContextEa";
constexpr const char *kTorchInit = "_ZNK2at4cuda6detail9CUDAHooks4initEv";
constexpr const char *kTorchPinned = "_ZNK2at4cuda6detail9CUDAHooks24getPinnedMemoryAllocatorEv";
constexpr const char *kTorchIsPinned = "_ZNK2at4cuda6detail9CUDAHooks11isPinnedPtrEPKv";

struct Written {
  void **slot; // set while patched
  void *was;   // what the slot held before
};
std::vector<Written> written; // in the order written

// The slot of the virtual member function `member` in the hooks object's virtual table (a pointer
// to a virtual member function holds its byte offset plus one: the Itanium C++ ABI).
template <typename Member>
void **find_slot(const at::CUDAHooksInterface &hooks, Member member) {
  struct {
    ptrdiff_t ptr, adj;
  } rep;
  static_assert(sizeof(member) == sizeof(rep), "a pointer to member function of the Itanium C++ ABI");
  std::memcpy(&rep, &member, sizeof rep);
  if (!(rep.ptr & 1) || rep.adj != 0) return nullptr;
  void **vtable = *reinterpret_cast<void **const *>(&hooks);
  return reinterpret_cast<void **>(reinterpret_cast<char *>(vtable) + (rep.ptr - 1));
}

// The address of the function `name` (mangled) in the loaded library that holds the code at
// `near`, from the library file's symbol table (.symtab, which also lists what the library does
// not export); nullptr when there is none of that name. *library: the library's path.
void *function_named(const void *near, const char *name, std::string *library) {
  Dl_info info;
  link_map *map = nullptr;
  if (dladdr1(near, &info, reinterpret_cast<void **>(&map), RTLD_DL_LINKMAP) == 0 || map == nullptr ||
      info.dli_fname == nullptr)
    return nullptr;
  *library = info.dli_fname;
  int fd = open(info.dli_fname, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return nullptr;
  struct stat st;
  void *file = MAP_FAILED;
  if (fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) >= sizeof(Elf64_Ehdr))
    file = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd);
  if (file == MAP_FAILED) return nullptr;
  const size_t size = static_cast<size_t>(st.st_size);
  const auto *bytes = static_cast<const unsigned char *>(file);
  const auto *eh = reinterpret_cast<const Elf64_Ehdr *>(bytes);
  // Whether [offset, offset + count * each) lies in the file.
  auto inside = [size](uint64_t offset, uint64_t count, uint64_t each) {
    return offset <= size && count <= (size - offset) / each;
  };
  void *found = nullptr;
  if (std::memcmp(eh->e_ident, ELFMAG, SELFMAG) == 0 && eh->e_ident[EI_CLASS] == ELFCLASS64 &&
      eh->e_shentsize == sizeof(Elf64_Shdr) && inside(eh->e_shoff, eh->e_shnum, sizeof(Elf64_Shdr))) {
    const auto *sections = reinterpret_cast<const Elf64_Shdr *>(bytes + eh->e_shoff);
    for (unsigned i = 0; i < eh->e_shnum && found == nullptr; i++) {
      const Elf64_Shdr &symtab = sections[i];
      if (symtab.sh_type != SHT_SYMTAB || symtab.sh_link >= eh->e_shnum) continue;
      const Elf64_Shdr &strtab = sections[symtab.sh_link];
      if (!inside(symtab.sh_offset, symtab.sh_size / sizeof(Elf64_Sym), sizeof(Elf64_Sym)) ||
          !inside(strtab.sh_offset, strtab.sh_size, 1))
        continue;
      const auto *syms = reinterpret_cast<const Elf64_Sym *>(bytes + symtab.sh_offset);
      const char *strings = reinterpret_cast<const char *>(bytes + strtab.sh_offset);
      const size_t name_len = std::strlen(name);
      for (size_t k = 0; k < symtab.sh_size / sizeof(Elf64_Sym); k++) {
        const Elf64_Sym &sym = syms[k];
        if (ELF64_ST_TYPE(sym.st_info) != STT_FUNC || sym.st_shndx == SHN_UNDEF) continue;
        if (sym.st_name >= strtab.sh_size || strtab.sh_size - sym.st_name <= name_len) continue;
        if (std::memcmp(strings + sym.st_name, name, name_len + 1) == 0) {
          found = reinterpret_cast<void *>(map->l_addr + sym.st_value);
          break;
        }
      }
    }
  }
  munmap(file, size);
  return found;
}

// Stores value in the read-only slot; false when its page cannot be made writable.
bool write_slot(void **slot, void *value) {
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto at = reinterpret_cast<uintptr_t>(slot);
  const uintptr_t start = at & ~(page - 1);
  const size_t span = (at + sizeof(void *) > start + page) ? 2 * page : page;
  if (mprotect(reinterpret_cast<void *>(start), span, PROT_READ | PROT_WRITE) != 0) return false;
  __atomic_store_n(slot, value, __ATOMIC_RELEASE); // other threads may call through it meanwhile
  mprotect(reinterpret_cast<void *>(start), span, PROT_READ);
  return true;
}

std::string refused(const std::string &why) {
  return "torch " CUDAPOOL_TORCH_VERSION "'s CUDA hooks are not as this build expects (" + why +
         "; Note [The primary-context slot] in csrc/fakecuda/fakecuda_vtable.cpp)";
}

// Writes `answer` into `slot` once it holds exactly torch's function `expected` (mangled): "" when
// written, else why not (nothing written).
std::string write_checked(void **slot, const char *expected, void *answer) {
  const std::string name = expected;
  if (slot == nullptr) return refused(name + " is not a virtual function of the Itanium C++ ABI");
  void *current = *slot;
  std::string library;
  void *want = function_named(current, expected, &library);
  if (want == nullptr)
    return refused("no " + name + " in the symbol table of " +
                   (library.empty() ? std::string("the library holding the hooks' function") : library));
  if (current != want) return refused("the hooks' function is not " + name + " of " + library);
  if (!write_slot(slot, answer)) return "cannot make torch's CUDA hooks answer for the fake GPU (mprotect failed)";
  written.push_back({slot, current});
  return "";
}

} // namespace

std::string patch_hooks(ContextAnswer context, const ProcessAnswers *process) {
  if (!written.empty()) return "the fake GPU is installed already";
  const at::CUDAHooksInterface &hooks = at::detail::getCUDAHooks();
  std::string why = write_checked(find_slot(hooks, &at::CUDAHooksInterface::hasPrimaryContext), kTorchContext,
                                  reinterpret_cast<void *>(context));
  if (why.empty() && process != nullptr)
    why = write_checked(find_slot(hooks, &at::CUDAHooksInterface::init), kTorchInit,
                        reinterpret_cast<void *>(process->init));
  if (why.empty() && process != nullptr)
    why = write_checked(find_slot(hooks, &at::CUDAHooksInterface::getPinnedMemoryAllocator), kTorchPinned,
                        reinterpret_cast<void *>(process->pinned_allocator));
  if (why.empty() && process != nullptr)
    why = write_checked(find_slot(hooks, &at::CUDAHooksInterface::isPinnedPtr), kTorchIsPinned,
                        reinterpret_cast<void *>(process->is_pinned));
  if (!why.empty()) unpatch_hooks();
  return why;
}

void unpatch_hooks() {
  while (!written.empty()) {
    write_slot(written.back().slot, written.back().was);
    written.pop_back();
  }
}

} // namespace cudapool_fakecuda
