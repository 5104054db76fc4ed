# Applies KVR_SANITIZE to every target defined after this point. CI builds the tests once plain,
# once with 'address,undefined' and runs the concurrency tests once more with 'thread'.
if(KVR_SANITIZE)
  if(KVR_SANITIZE MATCHES "thread" AND KVR_SANITIZE MATCHES "address")
    message(FATAL_ERROR "ThreadSanitizer cannot be combined with AddressSanitizer")
  endif()
  set(_kvr_san_flags -fsanitize=${KVR_SANITIZE} -fno-omit-frame-pointer)
  # The reports' stack traces need line numbers: line tables at least (-g1) when the build type
  # carries no debug information; Debug and RelWithDebInfo keep their own -g level.
  if(NOT CMAKE_BUILD_TYPE MATCHES "^(Debug|RelWithDebInfo)$")
    list(APPEND _kvr_san_flags -g1)
  endif()
  if(KVR_SANITIZE MATCHES "undefined")
    list(APPEND _kvr_san_flags -fno-sanitize-recover=undefined)
  endif()
  add_compile_options(${_kvr_san_flags})
  add_link_options(-fsanitize=${KVR_SANITIZE})
  message(STATUS "kvrouter: building with -fsanitize=${KVR_SANITIZE}")
endif()
