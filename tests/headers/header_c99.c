/* include/kvrouter.h compiles alone (nothing included before it) as strict C99. */
#include "kvrouter.h"

#if !defined(__STDC_VERSION__) || __STDC_VERSION__ != 199901L
#error "this file must be compiled as C99"
#endif

int main(void) {
  kvr_router_options opts;
  kvr_router_options_init(&opts, sizeof opts);
  return kvr_version() == KVR_VERSION_NUMBER && opts.struct_size == sizeof opts ? 0 : 1;
}
