// include/kvrouter.h compiles alone as C++17, with C linkage for every function.
#include <type_traits>

#include "kvrouter.h"

static_assert(__cplusplus == 201703L, "this file must be compiled as C++17");
static_assert(std::is_same_v<kvr_status, int32_t>);
static_assert(std::is_standard_layout_v<kvr_candidate> && std::is_trivial_v<kvr_candidate>);
static_assert(std::is_standard_layout_v<kvr_router_options>);

// C linkage: the address of each entry point has a plain C function-pointer type.
extern "C" {
using version_fn = uint32_t (*)(void);
}

int main() {
  version_fn version = &kvr_version;
  kvr_request_options opts;
  kvr_request_options_init(&opts, sizeof opts);
  return version() == KVR_VERSION_NUMBER && opts.struct_size == sizeof opts ? 0 : 1;
}
