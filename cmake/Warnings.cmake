# kvr_warnings: the one set of warning flags, linked PRIVATE by every target kvrouter builds (a
# usage requirement, so it never reaches a project that links kvrouter):
#   C++ (the library, its tests, the replay, the benchmarks): -Wall -Wextra, without
#     -Wunused-parameter (interfaces and callbacks name parameters they do not use);
#   C (only callers of the public header: the C ABI's tests, the examples, the header and ABI
#     checks): strict, -Wall -Wextra -pedantic -Werror, as a careful C caller would build.
# A target adds what only it needs (e.g. -Wstrict-prototypes) with target_compile_options.
if(NOT TARGET kvr_warnings)
  add_library(kvr_warnings INTERFACE)
  target_compile_options(kvr_warnings INTERFACE
    -Wall -Wextra
    $<$<COMPILE_LANGUAGE:CXX>:-Wno-unused-parameter>
    $<$<COMPILE_LANGUAGE:C>:-pedantic$<SEMICOLON>-Werror>)
endif()
