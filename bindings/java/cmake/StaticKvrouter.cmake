# kvrj_link_kvrouter_statically(TARGET): links TARGET (the JNI glue) with libkvrouter.a and,
# walking `pkg-config --static --libs`, the static archive of each dependency that has one;
# a dependency taken as an archive is walked in turn through its own pkg-config module, if it has
# one (libzmq.pc names libsodium, OpenPGM, NORM, libbsd, GSS-API). glibc's libraries (c, m,
# pthread, dl, rt) stay shared, the C++ runtime and libgcc are linked statically (the caller
# links with the C++ driver), and a dependency with no static archive stays shared: the list
# KVRJ_SHARED_DEPENDENCIES (parent scope) names those, and README.md says why each one. So does
# a library whose name matches KVRJ_SHARED_REGEX (CMakeLists.txt: archives that are not
# position-independent enough for a shared object); it is not walked further, its own shared
# library brings its dependencies.
# Archives go in one --start-group/--end-group, so their order does not matter; only what the
# glue reaches is pulled out of them, and --as-needed drops shared libraries nothing uses.
# Expects PKG_CONFIG_EXECUTABLE (FindPkgConfig) and KVROUTER_* (pkg_check_modules).

# The flags of `pkg-config --static --libs MODULE` as a list, or "" if there is no such module.
function(_kvrj_pkg_static_libs out module)
  execute_process(COMMAND "${PKG_CONFIG_EXECUTABLE}" --static --libs "${module}"
                  OUTPUT_VARIABLE flags RESULT_VARIABLE rc ERROR_QUIET
                  OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(rc)
    set(flags "")
  endif()
  separate_arguments(flags UNIX_COMMAND "${flags}")
  set(${out} "${flags}" PARENT_SCOPE)
endfunction()

function(kvrj_link_kvrouter_statically target)
  _kvrj_pkg_static_libs(queue kvrouter)
  if(NOT queue)
    message(FATAL_ERROR "pkg-config --static --libs kvrouter failed")
  endif()
  set(dirs "${KVROUTER_LIBDIR}")
  set(archives "")
  set(shared "")
  set(shared_names "")
  set(static_names "")
  set(other "")
  set(seen "")
  while(queue)
    list(POP_FRONT queue item)
    set(name "")
    set(path "")
    if(item MATCHES "^-L(.+)$")
      list(APPEND dirs "${CMAKE_MATCH_1}")
      continue()
    elseif(item MATCHES "^-Wl,--(push-state|pop-state|as-needed|no-as-needed)")
      continue() # kvrouter.pc's "--as-needed -latomic": every shared library is as-needed here
    elseif(item MATCHES "^-l(.+)$")
      set(name "${CMAKE_MATCH_1}")
    elseif(item MATCHES "^(.*/)?lib([^/]+)\\.a$")
      set(name "${CMAKE_MATCH_2}") # a bare archive (libzmq.pc's "libprotokit.a")
    elseif(item MATCHES "^-")
      list(APPEND other "${item}") # -pthread
      continue()
    else()
      message(WARNING "kvrouter_jni: link item ${item} left out")
      continue()
    endif()
    if(name IN_LIST seen)
      continue()
    endif()
    list(APPEND seen "${name}")

    if(name MATCHES "^(c|m|pthread|dl|rt|util|resolv)$")
      list(APPEND shared "-l${name}") # glibc
      continue()
    elseif(KVRJ_SHARED_REGEX AND name MATCHES "${KVRJ_SHARED_REGEX}")
      list(APPEND shared "-l${name}") # its archive cannot go into a shared object
      list(APPEND shared_names "${name}")
      continue()
    elseif(name MATCHES "^(stdc\\+\\+|gcc|gcc_s)$")
      continue() # -static-libstdc++ -static-libgcc
    elseif(name STREQUAL "atomic")
      # The toolchain's own archive, not on the linker's search path.
      execute_process(COMMAND "${CMAKE_C_COMPILER}" -print-file-name=libatomic.a
                      OUTPUT_VARIABLE path OUTPUT_STRIP_TRAILING_WHITESPACE)
      if(NOT IS_ABSOLUTE "${path}")
        set(path "")
      endif()
    else()
      # The project's directories (-L) first: kvrouter's own libdir before any system copy.
      # Debian names libuv's archive libuv_a.a.
      unset(path)
      find_library(path NAMES "lib${name}.a" "lib${name}_a.a" PATHS ${dirs} NO_DEFAULT_PATH
                   NO_CACHE)
      if(NOT path)
        unset(path)
        find_library(path NAMES "lib${name}.a" "lib${name}_a.a" NO_CACHE)
      endif()
    endif()

    if(path)
      list(APPEND archives "${path}")
      list(APPEND static_names "${name}")
      if(NOT name STREQUAL "kvrouter")
        # Its own dependencies, from its pkg-config module if it has one.
        foreach(module "lib${name}" "${name}")
          _kvrj_pkg_static_libs(more "${module}")
          if(more)
            list(PREPEND queue ${more})
            break()
          endif()
        endforeach()
      endif()
    elseif(name STREQUAL "kvrouter")
      message(FATAL_ERROR "kvrouter_jni: no libkvrouter.a in ${KVROUTER_LIBDIR} "
                          "(build kvrouter with KVR_BUILD_STATIC=ON, or use KVRJ_LINK=shared)")
    else()
      list(APPEND shared "-l${name}")
      list(APPEND shared_names "${name}")
    endif()
  endwhile()

  list(REMOVE_DUPLICATES dirs)
  set(map "${PROJECT_SOURCE_DIR}/src/main/c/kvrouter_jni.map")
  target_include_directories(${target} PRIVATE ${KVROUTER_INCLUDE_DIRS})
  target_compile_options(${target} PRIVATE ${KVROUTER_CFLAGS_OTHER})
  target_link_directories(${target} PRIVATE ${dirs})
  target_link_libraries(${target} PRIVATE JNI::JNI -Wl,--start-group ${archives} -Wl,--end-group
                                          ${other} ${shared})
  target_link_options(${target} PRIVATE -static-libstdc++ -static-libgcc
                      "-Wl,--version-script=${map}" -Wl,--exclude-libs,ALL -Wl,--gc-sections)
  if(KVRJ_STRIP_DEBUG)
    target_link_options(${target} PRIVATE -Wl,--strip-debug)
  endif()
  set_target_properties(${target} PROPERTIES LINKER_LANGUAGE CXX LINK_DEPENDS "${map}"
                                             SKIP_BUILD_RPATH ON)
  string(JOIN " " static_text ${static_names})
  string(JOIN " " shared_text ${shared_names})
  message(STATUS "kvrouter_jni: static archives: ${static_text}")
  message(STATUS "kvrouter_jni: shared besides glibc (no static archive): ${shared_text}")
  set(KVRJ_SHARED_DEPENDENCIES "${shared_names}" PARENT_SCOPE)
endfunction()
