// A one-op torch library for the build tests, registered in QUIRE_NS like the kernel variants,
// with an exported C++ function of the same name in every build (as the variants share names).
// torch/library.h alone and an int op: the lightest source torch's registration allows.
#include <torch/library.h>

namespace quire_test {
int64_t offset() { return OFFSET; }
}  // namespace quire_test

namespace {
int64_t answer(int64_t x) { return x + 40 + quire_test::offset(); }
}  // namespace

TORCH_LIBRARY_FRAGMENT(QUIRE_NS, m) { m.def("answer(int x) -> int", &answer); }
