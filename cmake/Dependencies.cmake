# Every dependency comes from a Debian 12 package (scripts/install-deps.sh installs them).
# How each is found is recorded in ../shared/reference/dependencies.md.
find_package(PkgConfig REQUIRED)
find_package(Threads REQUIRED)
find_package(absl REQUIRED)
# nlohmann-json parses traces and test vectors (tests, benchmarks, tools); never the library.
# kvrouterd (KVR_BUILD_SERVICE) speaks JSON with it too.
if(KVR_BUILD_TESTS OR KVR_BUILD_BENCH OR KVR_BUILD_TOOLS OR KVR_BUILD_SERVICE)
  find_package(nlohmann_json REQUIRED)
endif()
pkg_check_modules(XXHASH REQUIRED IMPORTED_TARGET libxxhash)
# FlatBuffers is kvrouter's own wire format (schema/): the runtime library, and flatc to compile
# the schemas at build time.
find_package(FlatBuffers REQUIRED)
find_program(KVR_FLATC flatc REQUIRED)
# KV event ingestion (src/ingest), each part only in a build that has it (KVR_WITH_ZMQ,
# KVR_WITH_NATS): the libuv loop, and msgpack-c++ (header-only; MSGPACK_NO_BOOST, set on
# kvrouter_wire) for the engines' payloads, with either transport; ZMQ subscriptions to
# vLLM/SGLang publishers; NATS subscriptions (libnats-dev, its sockets polled by the ingest
# loop through kvrouter's own adapter, src/ingest/nats_loop_place.h: its CMake package config is broken on Debian 12, so pkg-config finds it; linked as a shared
# library).
if(KVR_WITH_INGEST)
  pkg_check_modules(LIBUV REQUIRED IMPORTED_TARGET libuv)
  find_path(KVR_MSGPACK_INCLUDE_DIR msgpack.hpp REQUIRED)
endif()
# kvrouterd parses HTTP/1.1 with Node's http_parser 2.9 (libhttp-parser-dev; no pkg-config
# module nor CMake package on Debian 12, hence find_path/find_library).
if(KVR_BUILD_SERVICE)
  find_path(KVR_HTTP_PARSER_INCLUDE_DIR http_parser.h REQUIRED)
  find_library(KVR_HTTP_PARSER_LIBRARY http_parser REQUIRED)
endif()
if(KVR_WITH_ZMQ)
  pkg_check_modules(LIBZMQ REQUIRED IMPORTED_TARGET libzmq)
endif()
if(KVR_WITH_NATS)
  pkg_check_modules(NATS REQUIRED IMPORTED_TARGET libnats)
endif()

if(KVR_BUILD_TESTS)
  find_package(GTest REQUIRED)
  # cmocka tests the C ABI from C (tests/capi).
  pkg_check_modules(CMOCKA REQUIRED IMPORTED_TARGET cmocka)
endif()
if(KVR_BUILD_BENCH)
  find_package(benchmark REQUIRED)
endif()
