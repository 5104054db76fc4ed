# Every dependency comes from a Debian 12 package (scripts/install-deps.sh installs them).
# How each is found is recorded in ../shared/reference/dependencies.md.
find_package(PkgConfig REQUIRED)
find_package(Threads REQUIRED)
find_package(absl REQUIRED)
# nlohmann-json parses traces and test vectors (tests, benchmarks, tools); never the hot path.
find_package(nlohmann_json REQUIRED)
pkg_check_modules(XXHASH REQUIRED IMPORTED_TARGET libxxhash)
# FlatBuffers is kvrouter's own wire format (schema/): the runtime library, and flatc to compile
# the schemas at build time.
find_package(FlatBuffers REQUIRED)
find_program(KVR_FLATC flatc REQUIRED)
# KV event ingestion (src/ingest): the libuv loop, ZMQ subscriptions to vLLM/SGLang publishers,
# and msgpack-c++ (header-only; MSGPACK_NO_BOOST, set on kvrouter_ingest) for their payloads.
pkg_check_modules(LIBUV REQUIRED IMPORTED_TARGET libuv)
pkg_check_modules(LIBZMQ REQUIRED IMPORTED_TARGET libzmq)
find_path(KVR_MSGPACK_INCLUDE_DIR msgpack.hpp REQUIRED)
# NATS subscriptions (libnats-dev, with its libuv adapter header). Its CMake package config is
# broken on Debian 12, so pkg-config finds it; it is linked as a shared library.
pkg_check_modules(NATS REQUIRED IMPORTED_TARGET libnats)

if(KVR_BUILD_TESTS)
  find_package(GTest REQUIRED)
  # cmocka tests the C ABI from C (tests/capi).
  pkg_check_modules(CMOCKA REQUIRED IMPORTED_TARGET cmocka)
endif()
if(KVR_BUILD_BENCH)
  find_package(benchmark REQUIRED)
endif()
